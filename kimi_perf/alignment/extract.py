"""Hidden-state extractors, each returning layers with explicit provenance.

Why provenance on every tensor: the failure this suite exists to catch is two paths that *both* say
"layer 15" and mean different things (entering vs leaving the layer, pre vs post final norm, a token
offset, a lossy dtype). Every extractor states its layer-id convention ("residual stream entering
layer k"; ``"final"`` = output of the final RMSNorm), dtype, backend and version, and the token
positions covered.

- :class:`HFExtractor` (defined in :mod:`kimi_perf.capture.hidden` with the provenance types, the
  layer the EAGLE-3 feature capture shares): one full-sequence transformers forward with pre-hooks
  (how training features are usually captured);
- :func:`server_hidden_states` (in :mod:`kimi_perf.capture.server`, which the EAGLE-3 feature
  pipeline's ``http-aux`` backend also uses): an engine's inference path over HTTP -- SGLang-layout
  ``meta_info.hidden_states`` from ``/generate`` (the reference engine; SGLang 0.5.17 and 0.5.23, whose
  rows are the final-norm output, or the concatenated EAGLE-3 aux layers while serving EAGLE-3 or in
  0.5.23's aux mode). :func:`server_layers` translates the ids a server uses into the suite's
  convention, by engine and model family;
- :func:`stored_hidden_states`: the drafter pipeline's feature shards, with the manifest's provenance;
- :func:`vllm_hidden_states` (in :mod:`kimi_perf.capture.vllm`, which the EAGLE-3 feature pipeline
  also imports): vLLM's ``extract_hidden_states`` path.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np

# re-exported: callers and tests import these from here
from ..capture.hidden import AlignmentSetupError, HFExtractor, HiddenStates, Layer, Provenance
from ..capture.server import (
    REFERENCE_ENGINE_NAME,
    ServerLayers,
    parse_sglang_hidden_states,
    server_hidden_states,
    server_info,
    server_layers,
)
from ..capture.vllm import vllm_hidden_states

__all__ = ["REFERENCE_ENGINE_NAME", "AlignmentSetupError", "HFExtractor", "HiddenStates", "Provenance",
           "ServerLayers", "parse_sglang_hidden_states", "server_hidden_states", "server_info",
           "server_layers", "stored_hidden_states", "vllm_hidden_states"]


def stored_hidden_states(feature_dir: str | Path, sample_id: str) -> HiddenStates:
    from ..eagle3.features import FeatureStore

    st = FeatureStore(Path(feature_dir))
    got = list(st.samples({sample_id}))
    if not got:
        raise AlignmentSetupError(f"sample {sample_id!r} is not in the feature set {feature_dir}")
    s = got[0]
    layers = st.layers
    h = s.aux.shape[1] // len(layers)
    parts: dict[Layer, np.ndarray] = {k: s.aux[:, i * h : (i + 1) * h].float().numpy() for i, k in enumerate(layers)}
    parts["final"] = s.final.float().numpy()
    man = st.manifest
    return HiddenStates(parts, tuple(s.input_ids.tolist()), Provenance(
        f"stored-features({man['backend']})", str(man.get("backend_version")), man["dtype"],
        (0, int(s.input_ids.shape[0])), note=f"manifest {Path(feature_dir) / 'manifest.json'}"))
