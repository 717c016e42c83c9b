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


def _extract(base_url: str, model: str, ids: Sequence[int], max_tokens: int, *, include_output: bool,
             cleanup: bool) -> tuple[np.ndarray, tuple[int, ...], str]:
    """One completion through the extraction connector: ([tokens, layers, H], token ids, fingerprint)."""
    import os

    body: dict[str, Any] = {"model": model, "prompt": list(ids), "max_tokens": max_tokens, "temperature": 0,
                            "ignore_eos": True}
    if include_output:
        body["kv_transfer_params"] = {"include_output_tokens": True}
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
    if cleanup:
        for p in (path, path + ".lock"):
            if os.path.exists(p):
                os.remove(p)
    hs = np.asarray(data["hidden_states"], dtype=np.float32)
    toks = tuple(int(t) for t in np.asarray(data["token_ids"]).tolist())
    return hs, toks, str(res.get("system_fingerprint"))


def vllm_hidden_states(base_url: str, model: str, prompts: Sequence[Sequence[int]], max_new_tokens: int, *,
                       layers: Sequence[int], cleanup: bool = True,
                       decode: list[HiddenStates] | None = None) -> list[HiddenStates]:
    """vLLM's ``extract_hidden_states`` path, used the way upstream documents it: prompt tokens only.

    ``ExampleHiddenStatesConnector`` (vLLM PR #33736) is documented for prompt tokens with
    ``max_tokens=1``, and vllm-project/speculators captures a response by first generating it, then
    sending prompt + response as the *prompt* with ``max_tokens=1`` and checking the ids it gets back.
    The decode-path capture (``include_output_tokens``) is where the upstream faults live (vLLM #43805:
    blocks freed before the save; #56417: multi-token outputs), and on an H200 it returned wrong rows
    for the last generated tokens on identical code. So, per prompt: (1) generate ``max_new_tokens``
    (its decode-path capture also names the generated ids: prompt + output[:-1]); (2) prefill exactly
    those ids with ``max_tokens=1`` and return that capture, after checking that vLLM captured the ids
    that were sent. ``decode``, when given, receives the step-(1) captures of the same positions, for
    :func:`kimi_perf.alignment.diagnose.check_alignment` against the prefill ones (the decode-path
    check). Ids follow vLLM's convention (k = residual after k layers = entering layer k; the last
    layer is *pre*-final-norm)."""
    out = []
    for ids in prompts:
        seq: tuple[int, ...] = tuple(int(t) for t in ids)
        if max_new_tokens > 1:
            hs_d, seq, fp = _extract(base_url, model, ids, max_new_tokens, include_output=True, cleanup=cleanup)
            _check_shape(hs_d, layers)
            if seq[: len(ids)] != tuple(ids):
                raise AlignmentSetupError("vLLM's decode-path capture does not start with the prompt that was sent: "
                                          "the connector wrote another request's file (shared_storage_path shared "
                                          "between servers?)")
            if decode is not None:
                decode.append(HiddenStates({k: hs_d[:, i, :] for i, k in enumerate(layers)}, seq,
                                           Provenance("vllm-extract_hidden_states decode path", fp, "bfloat16",
                                                      (0, len(seq)), note="include_output_tokens: output rows from "
                                                      "decode steps"), prompt_len=len(ids)))
        hs, toks, fp = _extract(base_url, model, seq, 1, include_output=False, cleanup=cleanup)
        _check_shape(hs, layers)
        if toks != seq:
            first = next((i for i, (a, b) in enumerate(zip(toks, seq)) if a != b), min(len(toks), len(seq)))
            raise AlignmentSetupError(f"vLLM captured {len(toks)} token ids, not the {len(seq)} sent (first "
                                      f"difference at position {first}): the rows cannot be matched to tokens; "
                                      "check the server's --max-model-len and that prefix caching is off")
        out.append(HiddenStates({k: hs[:, i, :] for i, k in enumerate(layers)}, toks,
                                Provenance("vllm-extract_hidden_states", fp, "bfloat16", (0, len(toks)),
                                           note="prompt + generated ids prefilled with max_tokens=1 (upstream "
                                                "usage); last layer is pre-final-norm in vLLM"),
                                prompt_len=len(ids)))
    return out


def _check_shape(hs: np.ndarray, layers: Sequence[int]) -> None:
    if hs.ndim != 3 or hs.shape[1] != len(layers):
        raise AlignmentSetupError(f"vLLM hidden states have shape {hs.shape}, expected [tokens, {len(layers)}, H]")
