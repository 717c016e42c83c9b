"""Hidden-state capture, per engine: what both the alignment checks and the EAGLE-3 feature pipeline read.

Why a layer of its own, below :mod:`kimi_perf.alignment` and :mod:`kimi_perf.eagle3`: training features
are captured by one path and served by another, and the suite compares those paths. The capture code
(transformers' training-style forward in :mod:`.hidden`, an SGLang-layout server's ``/generate`` with
``return_hidden_states`` and each engine's layer-id rule in :mod:`.server`, vLLM's
``extract_hidden_states`` connector in :mod:`.vllm`) and the states' provenance types are needed by
both, so they sit under both and neither imports the other for them.
"""
