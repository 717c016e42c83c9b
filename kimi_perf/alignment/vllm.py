"""vLLM's ``extract_hidden_states`` capture, read without importing vLLM.

Why its own module: both the alignment tests (vLLM's inference states) and the EAGLE-3 feature
pipeline (vLLM as the extraction path of training features, kimi_perf.eagle3.features) read it, and
the pipeline must not import :mod:`kimi_perf.alignment.extract`, which reads the pipeline's stored
features (a module circle).
"""

from __future__ import annotations

import json
import urllib.request
from collections.abc import Sequence
from typing import Any

import numpy as np

from .hidden import AlignmentSetupError, HiddenStates, Provenance

__all__ = ["vllm_hidden_states"]


def _load_locked(path: str) -> dict[str, Any]:
    """vLLM's ``load_hidden_states`` without importing vLLM: wait on the companion ``.lock`` (shared
    flock) until the writer released it, then read the safetensors file."""
    import fcntl

    from safetensors.numpy import load_file

    with open(path + ".lock") as lf:
        fcntl.flock(lf, fcntl.LOCK_SH)
        try:
            return load_file(path)
        except Exception:  # noqa: BLE001 - bf16 has no numpy dtype: fall back to torch
            from safetensors.torch import load_file as load_t

            return {k: v.float().numpy() for k, v in load_t(path).items()}


def vllm_hidden_states(base_url: str, model: str, prompts: Sequence[Sequence[int]], max_new_tokens: int, *,
                       layers: Sequence[int], cleanup: bool = True) -> list[HiddenStates]:
    """vLLM's ``extract_hidden_states`` path: a completion with ``kv_transfer_params.include_output_tokens``
    makes the connector write ``[tokens, layers, H]`` for prompt + output[:-1]; ids follow vLLM's
    convention (k = residual after k layers = entering layer k; the last layer is *pre*-final-norm)."""
    import os

    out = []
    for ids in prompts:
        body = {"model": model, "prompt": list(ids), "max_tokens": max_new_tokens, "temperature": 0,
                "ignore_eos": True, "kv_transfer_params": {"include_output_tokens": True}}
        req = urllib.request.Request(base_url.rstrip("/") + "/v1/completions", data=json.dumps(body).encode(),
                                     headers={"Content-Type": "application/json"})
        with urllib.request.urlopen(req, timeout=600) as r:  # noqa: S310 - loopback
            res = json.loads(r.read())
        path = (res.get("kv_transfer_params") or {}).get("hidden_states_path")
        if not path:
            raise AlignmentSetupError("vLLM returned no kv_transfer_params.hidden_states_path: start it with "
                                      "--speculative-config '{\"method\":\"extract_hidden_states\",...}' and "
                                      "--kv-transfer-config pointing at kimi_perf.engines.vllm_connector")
        data = _load_locked(path)
        hs = np.asarray(data["hidden_states"], dtype=np.float32)
        toks = tuple(int(t) for t in np.asarray(data["token_ids"]).tolist())
        if hs.ndim != 3 or hs.shape[1] != len(layers):
            raise AlignmentSetupError(f"vLLM hidden states have shape {hs.shape}, expected [tokens, {len(layers)}, H]")
        if cleanup:
            for p in (path, path + ".lock"):
                if os.path.exists(p):
                    os.remove(p)
        out.append(HiddenStates({k: hs[:, i, :] for i, k in enumerate(layers)}, toks,
                                Provenance("vllm-extract_hidden_states", str(res.get("system_fingerprint")), "bfloat16",
                                           (0, len(toks)), note="last layer is pre-final-norm in vLLM"),
                                prompt_len=len(ids)))
    return out
