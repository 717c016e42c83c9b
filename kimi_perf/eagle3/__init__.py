"""EAGLE-3 drafters as the suite trains, stores and serves them.

Why the suite owns a drafter pipeline: acceptance can only be gated against a drafter whose training
data, hidden-state capture path and format are known, and the CPU CI must train one for real in
minutes. The modules hold the checkpoint format and vocabulary maps (``model``), the resumable
data -> features -> training pipeline (``data``, ``features``, ``train``) and the evaluation against
no-spec decoding (``evaluate``). Heavy imports (torch, transformers) happen inside functions.
"""
