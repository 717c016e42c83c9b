"""EAGLE-3 drafters as the suite trains, stores and serves them.

Why the suite owns a drafter pipeline: acceptance can only be gated against a drafter whose training
data, hidden-state capture path and format are known, and the CPU CI must train one for real in
minutes. ``model`` holds the checkpoint format, ``vocab`` the draft/target vocabulary maps, ``data``,
``features``, ``train`` and ``pipeline`` the resumable data -> features -> training steps, ``runtime``
the drafting loop the reference engine serves, ``evaluate`` acceptance and speedup against no-spec
decoding. The modules that need torch import it at module level, so this package is imported only
where a drafter is built or served (fixtures and tests import it lazily).
"""
