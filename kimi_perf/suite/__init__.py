"""The objects behind the suite's pytest fixtures: the target model, the server pool and engine
configs, prompts, the alignment context, the EAGLE-3 drafter and its A/B runs, the same-run A/B and
the extraction matrix.

Why a package of its own: the project rule is that fixture functions live in ``fixtures/`` and the
classes they use live in the library. ``fixtures/`` is this repository's pytest layer and is not
installed with kimi-perf; these classes are, so a host repository's own fixtures can build the same
objects, and unit tests can construct them directly, without pytest's fixture machinery. The package
sits below :mod:`kimi_perf.plugin` (it imports :class:`~kimi_perf.session.PerfSession` from where it is
defined), so the plugin never depends on the suite's services.

Nothing here imports torch, transformers or an engine at import time.
"""
