"""The objects behind the suite's pytest fixtures: the target model, the server pool and engine
configs, prompts, the alignment context, the EAGLE-3 drafter and its A/B runs, the same-run A/B and
the extraction matrix.

Why a package of its own: the project rule is that fixture functions live in ``fixtures/`` and the
classes they use live in the library. ``fixtures/`` is this repository's pytest layer and is not
installed with kimi-perf; these classes are, so a host repository's own fixtures can build the same
objects, and unit tests can construct them directly, without pytest's fixture machinery. The package
sits below :mod:`kimi_perf.plugin`, so the plugin never depends on the suite's services.

The services take typed specs, not the whole :class:`~kimi_perf.session.PerfSession` (issue 27): a
:class:`~kimi_perf.session.ServerSettings` (pool, engine configs, alignment, A/B), an
:class:`~kimi_perf.session.Eagle3Settings` (drafter, EAGLE-3 A/B, matrix), the profile's typed sections
and a :class:`~kimi_perf.missing.MissingPolicy` for the skip-or-fail rule. The session builds them
(``PerfSession.server_settings()`` and friends); fixtures/ passes them on.

Nothing here imports torch, transformers or an engine at import time.
"""
