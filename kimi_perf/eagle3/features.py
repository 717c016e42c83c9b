"""EAGLE-3 training features: captured through a chosen backend, stored as safetensors shards.

Why shards with a manifest: features are the artefact whose provenance decides whether a drafter
works. The manifest records, for every shard, the sample ids and token counts, and for the whole set
the layer ids *and their convention* ("residual stream entering layer k"), whether the final hidden is
pre- or post-norm, dtype, backend and version, and the target model's fingerprint. The alignment tests
read these shards back and compare them with what the serving path computes.

Backends:
- ``hf``: one full-sequence transformers forward over prompt + response, forward pre-hooks on the
  decoder layers (the usual way training data is captured);
- ``reference``: the reference engine's own runner in one prefill over the sequence;
- ``http-aux``: an SGLang-style server in aux mode (``--enable-return-aux-hidden-states``): a prefill
  of the sequence with ``return_hidden_states`` returns the aux rows (SGLang 0.5.23 or ours).

``layer_offset`` plants the classic extraction bug (features captured one layer off but labelled as
the intended layers) so tests can show what it does to acceptance and that alignment names it.

Resumable: each shard is written to a temp name and renamed, then the manifest is rewritten
atomically; a restart skips the samples already in listed shards.
"""

from __future__ import annotations

import json
import time
from collections.abc import Iterator, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import torch

from ..atomic import atomic_write_json
from ..progress import log
from .data import Sample

FORMAT = "kimi-perf-eagle3-features/1"
__all__ = ["FeatureSpec", "FeatureStore", "extract_features"]


@dataclass(frozen=True)
class FeatureSpec:
    backend: str = "hf"  # hf | reference | http-aux
    layers: tuple[int, ...] | None = None  # None: [2, N//2, N-3]
    dtype: str = "bfloat16"
    device: str = "cpu"
    layer_offset: int = 0  # planted fault: capture layer k + offset, label it k
    shard_tokens: int = 65536
    server_url: str | None = None  # for http-aux

    def digest(self) -> str:
        import hashlib

        d = asdict(self)
        d.pop("server_url")
        d.pop("device")
        return hashlib.sha256(json.dumps(d, sort_keys=True).encode()).hexdigest()[:12]


@dataclass
class FeatureSample:
    id: str
    input_ids: torch.Tensor  # [T] int64
    loss_mask: torch.Tensor  # [T] bool
    aux: torch.Tensor  # [T, len(layers) * H]
    final: torch.Tensor  # [T, H] post-final-norm
    target_argmax: torch.Tensor  # [T] int64: the target's greedy next token at each position


class _HFBackend:
    def __init__(self, model_dir: Path, layers: tuple[int, ...], dtype: torch.dtype, device: str) -> None:
        from ..alignment.hidden import HFExtractor

        self.x = HFExtractor(model_dir, dtype=str(dtype).replace("torch.", ""), device=device)
        self.layers = layers
        self.version = self.x.version

    def __call__(self, ids: list[int]) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        t, argmax = self.x(ids, [*self.layers, "final"])
        return torch.cat([t[k] for k in self.layers], dim=-1), t["final"], argmax


class _ReferenceBackend:
    def __init__(self, model_dir: Path, layers: tuple[int, ...], dtype: torch.dtype, device: str, max_len: int) -> None:
        from ..engines.reference.model import LlamaRunner

        self.r = LlamaRunner.from_pretrained(model_dir, device=device, dtype=dtype, max_slots=1, max_len=max_len)
        self.layers = layers
        self.n = self.r.shape.num_layers
        self.version = "kimi-perf reference runner"

    @torch.inference_mode()
    def __call__(self, ids: list[int]) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        from ..engines.reference.model import CaptureSpec

        out = self.r.forward(0, torch.tensor([ids], device=self.r.device), [0], [len(ids)],
                             capture=CaptureSpec(layers=tuple(sorted(set(self.layers))), final_norm=True), logits="all")
        aux = torch.cat([out.hidden[k][0] for k in self.layers], dim=-1)
        assert out.logits is not None
        return aux, out.hidden["final"][0], out.logits[0].argmax(-1)


class _HTTPAuxBackend:
    """Prefill-only requests to an aux-mode server; rows of the 2-D prefill block are the features."""

    def __init__(self, url: str, layers: tuple[int, ...], hidden: int) -> None:
        self.url = url.rstrip("/")
        self.layers = layers
        self.hidden = hidden
        self.version = self._version()

    def _version(self) -> str:
        import urllib.request

        try:
            with urllib.request.urlopen(self.url + "/server_info", timeout=10) as r:  # noqa: S310 - loopback
                info = json.loads(r.read())
        except OSError as e:
            raise RuntimeError(f"http-aux backend: {self.url}/server_info unreachable: {e}") from None
        if not info.get("enable_return_aux_hidden_states"):
            raise RuntimeError(f"{self.url} was not started with --enable-return-aux-hidden-states "
                               "(SGLang: add --enable-return-aux-hidden-states --speculative-algorithm EAGLE3)")
        got = tuple(info.get("return_aux_hidden_state_layer_ids") or ())
        if got and got != self.layers:
            raise RuntimeError(f"{self.url} returns aux layers {got}, features want {self.layers}: restart it "
                               f"with --return-aux-hidden-state-layer-ids {','.join(map(str, self.layers))}")
        return f"{info.get('engine', 'sglang')} {info.get('version')}"

    def __call__(self, ids: list[int]) -> tuple[torch.Tensor, None, None]:
        import urllib.request

        body = {"input_ids": ids, "return_hidden_states": True,
                "sampling_params": {"max_new_tokens": 1, "temperature": 0}}
        req = urllib.request.Request(self.url + "/generate", data=json.dumps(body).encode(),
                                     headers={"Content-Type": "application/json"})
        with urllib.request.urlopen(req, timeout=600) as r:  # noqa: S310 - loopback
            meta = json.loads(r.read())["meta_info"]
        block = torch.tensor(meta["hidden_states"][0], dtype=torch.float32)
        if block.shape != (len(ids), len(self.layers) * self.hidden):
            raise RuntimeError(f"aux block shape {tuple(block.shape)} != ({len(ids)}, {len(self.layers) * self.hidden})")
        # aux mode returns no final-norm output; the trainer needs it for target logits, so the caller
        # pairs these rows with a local reference-runner final hidden (same weights)
        return block, None, None


class FeatureStore:
    """Read side: ``FeatureStore(dir).samples()`` yields FeatureSample with the manifest's provenance."""

    def __init__(self, root: Path) -> None:
        self.root = Path(root)
        mpath = self.root / "manifest.json"
        if not mpath.is_file():
            raise FileNotFoundError(f"{self.root}: no manifest.json (not a feature directory, or extraction never finished a shard)")
        self.manifest = json.loads(mpath.read_text())
        if self.manifest.get("format") != FORMAT:
            raise ValueError(f"{mpath}: format {self.manifest.get('format')!r}, expected {FORMAT}")

    @property
    def layers(self) -> tuple[int, ...]:
        return tuple(self.manifest["layers"])

    @property
    def sample_ids(self) -> list[str]:
        return [sid for sh in self.manifest["shards"] for sid in sh["sample_ids"]]

    @property
    def num_tokens(self) -> int:
        return sum(sh["num_tokens"] for sh in self.manifest["shards"])

    def samples(self, ids: set[str] | None = None) -> Iterator[FeatureSample]:
        from safetensors.torch import load_file

        for sh in self.manifest["shards"]:
            if ids is not None and not ids.intersection(sh["sample_ids"]):
                continue
            t = load_file(str(self.root / sh["file"]))
            off = t["offsets"].tolist()
            for i, sid in enumerate(sh["sample_ids"]):
                if ids is not None and sid not in ids:
                    continue
                a, b = off[i], off[i + 1]
                yield FeatureSample(id=sid, input_ids=t["input_ids"][a:b].long(), loss_mask=t["loss_mask"][a:b].bool(),
                                    aux=t["aux"][a:b], final=t["final"][a:b], target_argmax=t["target_argmax"][a:b].long())


def extract_features(samples: Sequence[Sample], model_dir: Path, out_dir: Path, spec: FeatureSpec, *,
                     model_fingerprint: str, max_len: int = 2048) -> FeatureStore:
    from safetensors.torch import save_file
    from transformers import AutoConfig

    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    cfg = AutoConfig.from_pretrained(str(model_dir))
    n = int(cfg.num_hidden_layers)
    hidden = int(cfg.hidden_size)
    layers = tuple(spec.layers) if spec.layers is not None else (2, n // 2, n - 3)
    captured = tuple(k + spec.layer_offset for k in layers)
    if not all(0 <= k <= n for k in captured):
        raise ValueError(f"layers {captured} outside [0, {n}]")
    dtype = getattr(torch, spec.dtype)
    mpath = out_dir / "manifest.json"
    if mpath.is_file():
        manifest = json.loads(mpath.read_text())
        if manifest.get("spec_digest") != spec.digest() or manifest["target_model"]["fingerprint"] != model_fingerprint:
            raise ValueError(f"{out_dir} holds features of another spec or target model; use a new directory")
    else:
        manifest = {
            "format": FORMAT, "spec_digest": spec.digest(), "layers": list(layers),
            "layer_convention": "residual stream entering layer k (k=0: embeddings, k=N: last layer output, pre-norm)",
            "aux_pre_norm": True, "final": "output of the final RMSNorm (post-norm)", "dtype": spec.dtype,
            "backend": spec.backend, "backend_version": None, "planted_layer_offset": spec.layer_offset,
            "target_model": {"path": str(model_dir), "fingerprint": model_fingerprint, "num_layers": n,
                             "hidden_size": hidden},
            "shards": [], "created": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        }
    have = {sid for sh in manifest["shards"] for sid in sh["sample_ids"]}
    todo = [s for s in samples if s.id not in have and len(s.ids) <= max_len]
    if not todo:
        return FeatureStore(out_dir)
    if spec.backend == "hf":
        be: Any = _HFBackend(model_dir, captured, dtype, spec.device)
        final_be = None
    elif spec.backend == "reference":
        be = _ReferenceBackend(model_dir, captured, dtype, spec.device, max_len)
        final_be = None
    elif spec.backend == "http-aux":
        if not spec.server_url:
            raise ValueError("http-aux features need FeatureSpec.server_url (an aux-mode server)")
        be = _HTTPAuxBackend(spec.server_url, captured, hidden)
        final_be = _ReferenceBackend(model_dir, (n,), dtype, spec.device, max_len)
    else:
        raise ValueError(f"unknown feature backend {spec.backend!r}: hf, reference or http-aux")
    manifest["backend_version"] = be.version
    log(f"drafter features: {len(have)} samples reused, {len(todo)} to extract with {spec.backend} "
        f"(layers {list(captured)}{' PLANTED OFFSET ' + str(spec.layer_offset) if spec.layer_offset else ''}) -> {out_dir}")
    t0 = time.monotonic()
    buf: dict[str, list[torch.Tensor]] = {k: [] for k in ("aux", "final", "input_ids", "loss_mask", "target_argmax")}
    buf_ids: list[str] = []
    buf_tokens = 0
    done_tokens = 0

    def flush() -> None:
        nonlocal buf_tokens
        if not buf_ids:
            return
        idx = len(manifest["shards"])
        name = f"shard-{idx:05d}.safetensors"
        lens = [t.shape[0] for t in buf["input_ids"]]
        offsets = torch.tensor([0, *torch.tensor(lens).cumsum(0).tolist()], dtype=torch.int64)
        tensors = {
            "aux": torch.cat(buf["aux"]).to(dtype).contiguous(), "final": torch.cat(buf["final"]).to(dtype).contiguous(),
            "input_ids": torch.cat(buf["input_ids"]).to(torch.int32), "loss_mask": torch.cat(buf["loss_mask"]).to(torch.uint8),
            "target_argmax": torch.cat(buf["target_argmax"]).to(torch.int32), "offsets": offsets,
        }
        tmp = out_dir / (name + ".tmp")
        save_file(tensors, str(tmp))
        tmp.replace(out_dir / name)
        manifest["shards"].append({"file": name, "sample_ids": list(buf_ids), "num_tokens": int(sum(lens))})
        atomic_write_json(mpath, manifest)
        for v in buf.values():
            v.clear()
        buf_ids.clear()
        buf_tokens = 0

    for i, s in enumerate(todo):
        ids = s.ids
        aux, final, am = be(ids)
        if final_be is not None:
            _, final, am = final_be(ids)
        buf["aux"].append(aux.cpu())
        buf["final"].append(final.cpu())
        buf["input_ids"].append(torch.tensor(ids))
        buf["loss_mask"].append(torch.tensor(s.loss_mask))
        buf["target_argmax"].append(am.cpu())
        buf_ids.append(s.id)
        buf_tokens += len(ids)
        done_tokens += len(ids)
        if buf_tokens >= spec.shard_tokens:
            flush()
        if (i + 1) % 50 == 0 or i + 1 == len(todo):
            el = time.monotonic() - t0
            log(f"drafter features: {i + 1}/{len(todo)} samples, {done_tokens} tokens, {done_tokens / max(el, 1e-9):.0f} tok/s")
    flush()
    return FeatureStore(out_dir)
