"""Hidden-state extractors, each returning layers with explicit provenance.

Why provenance on every tensor: the failure this suite exists to catch is two paths that *both* say
"layer 15" and mean different things (entering vs leaving the layer, pre vs post final norm, a token
offset, a lossy dtype). Every extractor states its layer-id convention ("residual stream entering
layer k"; ``"final"`` = output of the final RMSNorm), dtype, backend and version, and the token
positions covered.

- :class:`HFExtractor`: one full-sequence transformers forward with pre-hooks (how training features
  are usually captured);
- :func:`server_hidden_states`: an engine's inference path over HTTP -- SGLang-layout
  ``meta_info.hidden_states`` from ``/generate`` (the reference engine, SGLang 0.5.23, also its aux mode);
- :func:`stored_hidden_states`: the drafter pipeline's feature shards, with the manifest's provenance.
"""

from __future__ import annotations

import asyncio
import json
import urllib.request
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

__all__ = ["AlignmentSetupError", "HFExtractor", "HiddenStates", "Provenance", "parse_sglang_hidden_states",
           "server_hidden_states", "server_info", "stored_hidden_states"]

Layer = int | str


class AlignmentSetupError(RuntimeError):
    """A side cannot provide what was asked (missing flag, layer, feature set); the message says the fix."""


@dataclass(frozen=True)
class Provenance:
    backend: str
    version: str
    dtype: str
    positions: tuple[int, int]  # [start, end) of the token positions covered
    layer_convention: str = "residual stream entering layer k; 'final' = final-norm output"
    note: str = ""


@dataclass(frozen=True)
class HiddenStates:
    layers: dict[Layer, np.ndarray]  # layer -> [T, H] float32
    token_ids: tuple[int, ...]  # input token at each covered position
    provenance: Provenance
    output_ids: tuple[int, ...] = field(default_factory=tuple)

    def get(self, layer: Layer) -> np.ndarray:
        if layer not in self.layers:
            have = ", ".join(str(k) for k in self.layers)
            raise AlignmentSetupError(f"{self.provenance.backend} provides layers [{have}], not {layer}")
        return self.layers[layer]


class HFExtractor:
    """transformers forward over a whole sequence; hooks capture the input of each decoder layer."""

    def __init__(self, model_dir: str | Path, *, dtype: str = "float32", device: str = "cpu") -> None:
        import torch
        import transformers
        from transformers import AutoModelForCausalLM

        self.torch = torch
        self.dtype = dtype
        self.model = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=getattr(torch, dtype)).to(device).eval()
        self.device = device
        self.version = f"transformers {transformers.__version__}"
        self.num_layers = int(self.model.config.num_hidden_layers)
        self._cap: dict[int, Any] = {}
        inner = self.model.model
        for k in range(self.num_layers + 1):
            mod = inner.layers[k] if k < self.num_layers else inner.norm

            def hook(_m: Any, args: tuple[Any, ...], kwargs: dict[str, Any], _k: int = k) -> None:
                if _k in self._want:
                    self._cap[_k] = (args[0] if args else kwargs["hidden_states"]).detach()

            mod.register_forward_pre_hook(hook, with_kwargs=True)
        self._want: set[int] = set()

    @property
    def final_norm_weight(self) -> np.ndarray:
        return self.model.model.norm.weight.detach().float().cpu().numpy()

    def __call__(self, ids: Sequence[int], layers: Sequence[Layer]) -> tuple[dict[Layer, Any], Any]:
        """Torch tensors per layer ([T, H], model dtype) and the logits' argmax [T]."""
        torch = self.torch
        self._want = {k for k in layers if isinstance(k, int)}
        self._cap.clear()
        with torch.inference_mode():
            x = torch.tensor([list(ids)], device=self.device)
            out = self.model(x, attention_mask=torch.ones_like(x), output_hidden_states="final" in layers)
        res: dict[Layer, Any] = {k: self._cap[k][0] for k in layers if isinstance(k, int)}
        if "final" in layers:
            res["final"] = out.hidden_states[-1][0]
        return res, out.logits[0].argmax(-1)

    def hidden_states(self, ids: Sequence[int], layers: Sequence[Layer]) -> HiddenStates:
        t, _ = self(ids, layers)
        return HiddenStates({k: v.float().cpu().numpy() for k, v in t.items()}, tuple(ids),
                            Provenance("hf-offline", self.version, self.dtype, (0, len(ids)),
                                       note="one full-sequence forward, no KV cache"))


def parse_sglang_hidden_states(rows: list[Any], layers: Sequence[Layer], hidden: int) -> dict[Layer, np.ndarray]:
    """SGLang's ``meta_info.hidden_states``: a 2-D prefill block, then 1-D rows (one per fed-back
    generated token) or 2-D blocks (speculative verify steps). Concatenated aux rows are split into
    ``layers`` of width ``hidden``."""
    if not rows:
        raise AlignmentSetupError("meta_info.hidden_states is empty")
    blocks = []
    for i, r in enumerate(rows):
        a = np.asarray(r, dtype=np.float32)
        if a.ndim == 1:
            a = a[None, :]
        if a.ndim != 2:
            raise AlignmentSetupError(f"hidden_states[{i}] has shape {a.shape}; expected rows of width {len(layers) * hidden}")
        blocks.append(a)
    m = np.concatenate(blocks, axis=0)
    if m.shape[1] != len(layers) * hidden:
        raise AlignmentSetupError(f"hidden-state rows are {m.shape[1]} wide, expected {len(layers)} layers x {hidden}: "
                                  "the server's --return-aux-hidden-state-layer-ids differ from the ones asked for")
    return {k: m[:, i * hidden : (i + 1) * hidden] for i, k in enumerate(layers)}


def server_info(base_url: str) -> dict[str, Any]:
    for path in ("/server_info", "/get_server_info"):
        try:
            with urllib.request.urlopen(base_url.rstrip("/") + path, timeout=30) as r:  # noqa: S310 - loopback
                return json.loads(r.read())
        except OSError:
            continue
    raise AlignmentSetupError(f"{base_url} has no /server_info: not an SGLang-compatible server")


def _server_layers(info: dict[str, Any]) -> list[Layer]:
    if info.get("enable_return_aux_hidden_states"):
        return [k if k == "final" else int(k) for k in info.get("return_aux_hidden_state_layer_ids") or []]
    if info.get("enable_return_hidden_states"):
        return ["final"]
    raise AlignmentSetupError(
        "server was started without hidden-state support: add --enable-return-hidden-states (final-norm output) "
        "or --enable-return-aux-hidden-states [--return-aux-hidden-state-layer-ids ...] (SGLang 0.5.23 also needs "
        "--speculative-algorithm EAGLE3 for aux mode)")


def server_hidden_states(base_url: str, prompts: Sequence[Sequence[int]], max_new_tokens: int, *,
                         hidden: int, concurrent: bool = True) -> list[HiddenStates]:
    """Generate greedily and return each request's inference-path hidden states (prompt + output[:-1]).

    ``concurrent``: send all prompts at once so the engine batches them (the serving condition);
    otherwise one at a time.
    """
    info = server_info(base_url)
    layers = _server_layers(info)
    version = f"{info.get('engine', 'sglang')} {info.get('version')}"
    dtype = str(info.get("dtype", "?"))

    async def one(session: Any, ids: Sequence[int]) -> dict[str, Any]:
        body = {"input_ids": list(ids), "return_hidden_states": True,
                "sampling_params": {"max_new_tokens": max_new_tokens, "temperature": 0, "ignore_eos": True}}
        async with session.post(base_url.rstrip("/") + "/generate", json=body) as r:
            text = await r.text()
            if r.status != 200:
                raise AlignmentSetupError(f"/generate with return_hidden_states: HTTP {r.status}: {text[:300]}")
            return json.loads(text)

    async def run() -> list[dict[str, Any]]:
        import aiohttp

        async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=1800)) as s:
            if concurrent:
                return list(await asyncio.gather(*(one(s, p) for p in prompts)))
            return [await one(s, p) for p in prompts]

    out = []
    for ids, res in zip(prompts, asyncio.run(run())):
        meta = res["meta_info"]
        if "hidden_states" not in meta:
            raise AlignmentSetupError("response has no meta_info.hidden_states although the server advertises them")
        parts = parse_sglang_hidden_states(meta["hidden_states"], layers, hidden)
        output = list(res["output_ids"])
        covered = list(ids) + output[:-1]
        n = next(iter(parts.values())).shape[0]
        if n != len(covered):
            raise AlignmentSetupError(f"server returned {n} hidden-state rows for {len(covered)} positions "
                                      "(prompt + output[:-1]): radix-cache hit or chunked prefill? (SGLang: "
                                      "--disable-radix-cache --chunked-prefill-size -1)")
        out.append(HiddenStates(parts, tuple(covered), Provenance(
            "server-inference", version, dtype, (0, len(covered)),
            note="prefill block + incremental decode with KV cache" + (", batched" if concurrent else "")),
            output_ids=tuple(output)))
    return out


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
                                           (0, len(toks)), note="last layer is pre-final-norm in vLLM")))
    return out
