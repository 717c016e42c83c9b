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
- ``http-aux``: an SGLang-layout server that returns aux rows: a prefill of the sequence with
  ``return_hidden_states`` (the reference engine or SGLang 0.5.23 in aux mode,
  ``--enable-return-aux-hidden-states``; SGLang 0.5.17 serving EAGLE-3, whose rows are the drafter's
  aux layers).

- ``vllm-extract``: vLLM's ``extract_hidden_states`` speculative method (``server_url``/``server_model``:
  a server started with it for these layers): one prefill-only completion per sample; its rows are
  the residual entering each layer, like ours.

Planted faults, so the extraction-path matrix (kimi_perf.eagle3.matrix) can show what each does to
alignment and to acceptance, and tests can check alignment names it:
- ``layer_offset``: the classic extraction bug (features captured one layer off but labelled as the
  intended layers);
- ``transform="postnorm"``: each aux layer taken *after* that layer's input RMSNorm (what a hook on
  the attention module instead of the decoder layer captures) instead of the residual stream;
- ``transform="int8"``: each layer of each sample rounded to int8 with one absmax scale (a capture
  path that stores or computes activations in int8; the residual stream's outlier channels set the
  scale, so the small channels lose most of their bits).

Resumable: each shard is written to a temp name and renamed, then the manifest is rewritten
atomically; a restart skips the samples already in listed shards.
"""

from __future__ import annotations

import copy
import json
import time
from collections.abc import Iterator, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, Protocol

import torch

from ..atomic import atomic_write_json
from ..progress import log
from .data import Sample

FORMAT = "kimi-perf-eagle3-features/1"
__all__ = ["FeatureLoader", "FeaturePath", "FeatureSpec", "FeatureStore", "HeldFeatures", "OnlineFeatures", "extract_features", "truncate"]


@dataclass(frozen=True)
class FeatureSpec:
    backend: str = "hf"  # hf | reference | http-aux | vllm-extract
    layers: tuple[int, ...] | None = None  # None: [2, N//2, N-3]
    dtype: str = "bfloat16"
    device: str = "cpu"
    layer_offset: int = 0  # planted fault: capture layer k + offset, label it k
    shard_tokens: int = 65536
    server_url: str | None = None  # for http-aux and vllm-extract
    transform: str = "none"  # none | postnorm | int8 (planted faults, see the module docstring)
    server_model: str | None = None  # vllm-extract: the served model name
    # hf backend: padded tokens per batched forward (0: one sample per forward). How, not what: the
    # features agree to kernel rounding, so it is left out of the digest like the device. One sample
    # per forward kept a GPU at 9.4-19.7K tok/s on a 135M target, launch-bound
    extract_batch_tokens: int = 0
    # hf/reference backends: compute each training batch's features with the target during training
    # instead of storing them (OnlineFeatures). How, not what: left out of the digest. Stored features
    # cost ~4.6 KB a token on a 135M target (three aux layers and the final hidden, bf16): 83 GB for a
    # 47K-sample recipe's 18M tokens, past a lent GPU's 64 GB disk; the target's forward costs less
    # than the drafter's step it feeds
    online: bool = False
    # http-aux and vllm-extract: prefill requests in flight at once. How, not what (out of the digest).
    # One sample per request, one at a time, left a GPU server idle between requests while the host
    # decoded JSON rows; the extraction matrix's server rows capture thousands of samples each
    server_concurrency: int = 1

    def digest(self) -> str:
        import hashlib

        d = asdict(self)
        for k in ("server_url", "device", "server_model", "extract_batch_tokens", "online", "server_concurrency"):
            d.pop(k)
        if d["transform"] == "none":
            # added after drafters were shipped and cached: a spec without a transform keeps the digest
            # it had, so no cached feature set or shipped drafter is invalidated by the field existing
            d.pop("transform")
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
        from ..capture.hidden import HFExtractor

        self.x = HFExtractor(model_dir, dtype=str(dtype).replace("torch.", ""), device=device)
        self.layers = layers
        self.version = self.x.version

    def __call__(self, ids: list[int]) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        return self.batch([ids])[0]

    def batch(self, seqs: list[list[int]]) -> list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]]:
        return [(torch.cat([t[k] for k in self.layers], dim=-1), t["final"], am)
                for t, am in self.x.batch(seqs, [*self.layers, "final"])]


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
    """Prefill-only requests to an SGLang-layout server that returns aux rows: the reference engine or
    SGLang 0.5.23 in aux mode, or SGLang serving EAGLE-3 with ``return_hidden_states`` (0.5.17 has no aux
    mode; its rows are then the drafter's aux layers). The request and the layer naming are the
    alignment capture's (:mod:`kimi_perf.capture.server`), so training features and the alignment
    tests read a server the same way."""

    def __init__(self, url: str, layers: tuple[int, ...], hidden: int, num_layers: int) -> None:
        from ..capture.server import server_info, server_layers

        self.url = url.rstrip("/")
        self.layers = layers
        self.hidden = hidden
        self.num_layers = num_layers
        try:
            info = server_info(self.url)
            plan = server_layers(info, num_layers=num_layers)
        except Exception as e:  # noqa: BLE001 - AlignmentSetupError or OSError: both say the server is wrong
            raise RuntimeError(f"http-aux backend: {self.url}: {e}") from None
        missing = [k for k in layers if k not in plan.layers]
        if missing:
            raise RuntimeError(
                f"http-aux backend: {self.url} returns layers {list(plan.layers)} ({plan.how}); the features "
                f"want entering layers {list(layers)}: start the reference engine or SGLang 0.5.23 with "
                "--enable-return-aux-hidden-states --return-aux-hidden-state-layer-ids for them, or serve "
                "SGLang 0.5.17 EAGLE-3 with a drafter whose aux layers they are and --enable-return-hidden-states")
        self.version = f"{info.get('engine', 'sglang')} {info.get('version')} ({plan.how})"

    def __call__(self, ids: list[int]) -> tuple[torch.Tensor, None, None]:
        from ..capture.server import server_hidden_states

        # one generated token: the rows cover the prompt exactly (prompt + output[:-1])
        hs = server_hidden_states(self.url, [ids], 1, hidden=self.hidden, concurrent=False,
                                  num_layers=self.num_layers)[0]
        block = torch.cat([torch.as_tensor(hs.get(k), dtype=torch.float32) for k in self.layers], dim=-1)
        if block.shape != (len(ids), len(self.layers) * self.hidden):
            raise RuntimeError(f"aux block shape {tuple(block.shape)} != ({len(ids)}, {len(self.layers) * self.hidden})")
        # no final-norm output comes with aux rows; the trainer needs it for target logits, so the caller
        # pairs these rows with a local reference-runner final hidden (same weights)
        return block, None, None


class _VLLMExtractBackend:
    """Prefill-only completions to a vLLM server running ``extract_hidden_states`` for these layers."""

    def __init__(self, url: str, model: str, layers: tuple[int, ...]) -> None:
        self.url, self.model, self.layers = url.rstrip("/"), model, layers
        self.version = f"vllm {self._version()} extract_hidden_states"

    def _version(self) -> str:
        import urllib.request

        try:
            with urllib.request.urlopen(self.url + "/version", timeout=10) as r:  # noqa: S310 - loopback
                return str(json.loads(r.read()).get("version"))
        except OSError as e:
            raise RuntimeError(f"vllm-extract backend: {self.url}/version unreachable: {e}") from None

    def __call__(self, ids: list[int]) -> tuple[torch.Tensor, None, None]:
        from ..capture.vllm import vllm_hidden_states

        hs = vllm_hidden_states(self.url, self.model, [ids], 1, layers=list(self.layers))[0]
        rows = [torch.from_numpy(hs.layers[k][: len(ids)]) for k in self.layers]
        if rows[0].shape[0] != len(ids):
            raise RuntimeError(f"vLLM returned {rows[0].shape[0]} rows for a {len(ids)}-token prefill")
        # like http-aux, no final-norm output: the caller pairs these rows with a local reference-runner
        # final hidden (same weights) for the trainer's target logits
        return torch.cat(rows, dim=-1), None, None


def feature_layers(spec: FeatureSpec, num_layers: int) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """(the layers the features are labelled with, the layers actually captured: + the planted offset)."""
    n = num_layers
    layers = tuple(spec.layers) if spec.layers is not None else (2, n // 2, n - 3)
    captured = tuple(k + spec.layer_offset for k in layers)
    if not all(0 <= k <= n for k in captured):
        raise ValueError(f"layers {captured} outside [0, {n}]")
    return layers, captured


class Transform:
    """A planted fault applied to captured aux rows ``[T, L*H]`` (identity for ``none``)."""

    def __init__(self, name: str, model_dir: Path, layers: tuple[int, ...], hidden: int) -> None:
        if name not in ("none", "postnorm", "int8"):
            raise ValueError(f"unknown feature transform {name!r}: none, postnorm or int8")
        self.name, self.layers, self.hidden = name, layers, hidden
        self.norms: list[torch.Tensor] = []
        self.eps = 1e-5
        if name == "postnorm":
            from safetensors import safe_open

            cfg = json.loads((Path(model_dir) / "config.json").read_text())
            self.eps = float(cfg.get("rms_norm_eps", 1e-5))
            want = {k: f"model.layers.{k}.input_layernorm.weight" for k in layers}
            got: dict[int, torch.Tensor] = {}
            for f in sorted(Path(model_dir).glob("*.safetensors")):
                with safe_open(str(f), framework="pt") as h:
                    names = set(h.keys())
                    for k, n in want.items():
                        if n in names:
                            got[k] = h.get_tensor(n).float()
            if set(got) != set(layers):
                raise ValueError(f"postnorm: no input_layernorm weight for layer(s) {sorted(set(layers) - set(got))} "
                                 f"in {model_dir} (the last layer's output has no next-layer norm)")
            self.norms = [got[k] for k in layers]

    def __call__(self, aux: torch.Tensor) -> torch.Tensor:
        if self.name == "none":
            return aux
        parts = aux.float().split(self.hidden, dim=-1)
        if self.name == "postnorm":
            out = [p * torch.rsqrt(p.pow(2).mean(-1, keepdim=True) + self.eps) * w.to(p.device) for p, w in zip(parts, self.norms)]
        else:
            out = []
            for p in parts:
                scale = p.abs().max().clamp_min(1e-12) / 127.0
                out.append(torch.round(p / scale).clamp(-127, 127) * scale)
        return torch.cat(out, dim=-1)


class FeaturePath:
    """One extraction path: backend + planted fault, ``path(ids) -> (aux [T, L*H], final [T, H],
    target argmax [T])``. What :func:`extract_features` stores, and what the extraction-path matrix
    compares with an engine's inference states on the engine's own sequences."""

    def __init__(self, spec: FeatureSpec, model_dir: Path, *, max_len: int = 2048) -> None:
        from transformers import AutoConfig

        cfg = AutoConfig.from_pretrained(str(model_dir))
        n = int(cfg.num_hidden_layers)
        self.hidden = int(cfg.hidden_size)
        self.layers, self.captured = feature_layers(spec, n)
        self.num_layers = n
        dtype = getattr(torch, spec.dtype)
        self.final_be: Any = None
        if spec.backend == "hf":
            self.be: Any = _HFBackend(model_dir, self.captured, dtype, spec.device)
        elif spec.backend == "reference":
            self.be = _ReferenceBackend(model_dir, self.captured, dtype, spec.device, max_len)
        elif spec.backend in ("http-aux", "vllm-extract"):
            if not spec.server_url:
                raise ValueError(f"{spec.backend} features need FeatureSpec.server_url (a running server)")
            if spec.backend == "http-aux":
                self.be = _HTTPAuxBackend(spec.server_url, self.captured, self.hidden, n)
            else:
                self.be = _VLLMExtractBackend(spec.server_url, spec.server_model or "", self.captured)
            self.final_be = _ReferenceBackend(model_dir, (n,), dtype, spec.device, max_len)
        else:
            raise ValueError(f"unknown feature backend {spec.backend!r}: hf, reference, http-aux or vllm-extract")
        # the fault acts on the *captured* layers' rows (postnorm uses those layers' own norms)
        self.transform = Transform(spec.transform, model_dir, self.captured, self.hidden)
        self.version = self.be.version
        self.server_concurrency = max(1, spec.server_concurrency)

    def __call__(self, ids: list[int]) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        aux, final, am = self.be(ids)
        if self.final_be is not None:
            _, final, am = self.final_be(ids)
        return self.transform(aux), final, am

    def batch(self, seqs: list[list[int]]) -> list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]]:
        """``[self(ids) for ids in seqs]``, in one forward where the backend batches (hf); a server
        backend's requests ``server_concurrency`` at a time (threads: the wait is HTTP, the GIL is free),
        then the local final-norm rows one sequence at a time, in order."""
        if self.final_be is not None and self.server_concurrency > 1 and len(seqs) > 1:
            from concurrent.futures import ThreadPoolExecutor

            with ThreadPoolExecutor(min(self.server_concurrency, len(seqs))) as pool:
                rows = list(pool.map(lambda ids: self.be(ids)[0], seqs))
            out = []
            for ids, aux in zip(seqs, rows):
                _, final, am = self.final_be(ids)
                out.append((self.transform(aux), final, am))
            return out
        if not hasattr(self.be, "batch") or self.final_be is not None:
            return [self(ids) for ids in seqs]
        return [(self.transform(aux), final, am) for aux, final, am in self.be.batch(seqs)]

    def by_layer(self, ids: list[int]) -> dict[int, torch.Tensor]:
        """The aux rows split per labelled layer (what a drafter trained on this path thinks layer k is)."""
        aux = self(ids)[0].float()
        return {k: aux[:, i * self.hidden:(i + 1) * self.hidden] for i, k in enumerate(self.layers)}


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

    def loader(self, ids: set[str]) -> HeldFeatures:
        """The samples ``ids`` for training, read into host memory."""
        return HeldFeatures(self.samples(ids))

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


class FeatureLoader(Protocol):
    """What the trainer asks of a feature source for one set of samples: their lengths, and the
    features of a batch of them cut to ``max_len`` positions."""

    @property
    def lengths(self) -> dict[str, int]: ...

    def batch(self, ids: Sequence[str], max_len: int) -> list[FeatureSample]: ...


class HeldFeatures:
    """Stored features of one training run's samples, read once and held in host memory: what the
    trainer asks of a feature source (``lengths``, ``batch``)."""

    def __init__(self, samples: Iterator[FeatureSample]) -> None:
        self._s = {s.id: s for s in samples}
        self.lengths = {i: int(s.input_ids.shape[0]) for i, s in self._s.items()}

    def batch(self, ids: Sequence[str], max_len: int) -> list[FeatureSample]:
        return [truncate(self._s[i], max_len) for i in ids]


def truncate(s: FeatureSample, m: int) -> FeatureSample:
    """The first ``m`` positions of ``s`` (causal: they do not depend on what follows)."""
    if s.input_ids.shape[0] <= m:
        return s
    return FeatureSample(s.id, s.input_ids[:m], s.loss_mask[:m], s.aux[:m], s.final[:m], s.target_argmax[:m])


class OnlineFeatures:
    """Training features computed from the target for each batch as the trainer asks for it, on the
    recipe's device, and never stored (SpecForge's "online" mode).

    Why: a stored feature set grows with the data (``FeatureSpec.online``: 83 GB for 47K samples of a
    135M target), while one batch's forward of the target is cheap next to the drafter's TTT step on
    it. The rows are the path's (:class:`FeaturePath`), so they equal what :func:`extract_features`
    would store, up to the kernels' rounding for another batch shape. Only the hf and reference
    backends (in-process targets) can run this way. Samples longer than ``max_len`` are left out, as
    extraction leaves them out."""

    def __init__(self, samples: Sequence[Sample], model_dir: Path, spec: FeatureSpec, *, max_len: int = 2048) -> None:
        if spec.backend not in ("hf", "reference"):
            raise ValueError(f"online features need an in-process backend (hf or reference), not {spec.backend!r}")
        self.path = FeaturePath(spec, model_dir, max_len=max_len)
        self._s = {s.id: s for s in samples if len(s.ids) <= max_len}
        # counted once: ``Sample.ids`` joins two lists, and a caller that reads ``lengths`` per batch
        # (benchmarks/drafter_train_speed.py did, per sample of the batch) paid for every sample each
        # time: up to 1.1 s of host time a step on 8,000 samples, several times the step's device time
        self.lengths = {i: len(s.ids) for i, s in self._s.items()}
        self.layers = self.path.layers
        self.manifest = {"backend": spec.backend, "backend_version": self.path.version, "layers": list(self.layers),
                         "mode": "online", "dtype": spec.dtype}

    @property
    def sample_ids(self) -> list[str]:
        return list(self._s)

    @property
    def num_tokens(self) -> int:
        return sum(self.lengths.values())

    def loader(self, ids: set[str]) -> OnlineFeatures:
        """A view of the samples ``ids`` sharing this target: no feature is computed ahead."""
        view = copy.copy(self)
        view._s = {i: s for i, s in self._s.items() if i in ids}
        view.lengths = {i: self.lengths[i] for i in view._s}
        return view

    def batch(self, ids: Sequence[str], max_len: int) -> list[FeatureSample]:
        seqs = [list(self._s[i].ids)[:max_len] for i in ids]
        feats = self.path.batch(seqs)
        # the token ids and loss masks go to the target's device as two padded tensors, one copy each,
        # and every sample gets a row's view: a tensor made from a list on a GPU per sample was two
        # pageable copies per sample, each a stream sync (the H100 trace counted 68 syncs a step)
        width = max(len(q) for q in seqs)
        ids_t = torch.zeros(len(seqs), width, dtype=torch.long)
        mask_t = torch.zeros(len(seqs), width, dtype=torch.bool)
        for r, (i, q) in enumerate(zip(ids, seqs)):
            ids_t[r, : len(q)] = torch.tensor(q)
            mask_t[r, : len(q)] = torch.tensor(self._s[i].loss_mask[: len(q)], dtype=torch.bool)
        dev = feats[0][0].device
        ids_t, mask_t = ids_t.to(dev), mask_t.to(dev)
        return [FeatureSample(i, ids_t[r, : len(q)], mask_t[r, : len(q)], aux, final, am)
                for r, (i, q, (aux, final, am)) in enumerate(zip(ids, seqs, feats))]


def _extracted(path: FeaturePath, todo: Sequence[Sample], batch_tokens: int
               ) -> Iterator[tuple[torch.Tensor, torch.Tensor, torch.Tensor]]:
    """Each sample's (aux, final, argmax), in ``todo``'s order (so shards hold the same samples either
    way). With ``batch_tokens``, a window of samples is sorted by length and cut into batches of at
    most that many padded tokens, so padding stays small without reordering what is stored."""
    if batch_tokens <= 0:
        for s in todo:
            yield path(list(s.ids))
        return
    window = 8 * batch_tokens  # tokens held on the host at once: bounded memory for long sets
    i = 0
    while i < len(todo):
        j, tokens = i, 0
        while j < len(todo) and (j == i or tokens + len(todo[j].ids) <= window):
            tokens += len(todo[j].ids)
            j += 1
        order = sorted(range(i, j), key=lambda k: len(todo[k].ids))
        got: dict[int, tuple[torch.Tensor, torch.Tensor, torch.Tensor]] = {}
        cur: list[int] = []
        for k in [*order, None]:
            if cur and (k is None or len(todo[k].ids) * (len(cur) + 1) > batch_tokens):
                for c, (aux, final, am) in zip(cur, path.batch([list(todo[c].ids) for c in cur])):
                    got[c] = (aux.cpu(), final.cpu(), am.cpu())
                cur = []
            if k is not None:
                cur.append(k)
        for k in range(i, j):
            yield got.pop(k)
        i = j


def extract_features(samples: Sequence[Sample], model_dir: Path, out_dir: Path, spec: FeatureSpec, *,
                     model_fingerprint: str, max_len: int = 2048) -> FeatureStore:
    from safetensors.torch import save_file
    from transformers import AutoConfig

    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    cfg = AutoConfig.from_pretrained(str(model_dir))
    n = int(cfg.num_hidden_layers)
    hidden = int(cfg.hidden_size)
    layers, captured = feature_layers(spec, n)
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
            "aux_pre_norm": spec.transform != "postnorm", "planted_transform": spec.transform,
            "final": "output of the final RMSNorm (post-norm)", "dtype": spec.dtype,
            "backend": spec.backend, "backend_version": None, "planted_layer_offset": spec.layer_offset,
            "target_model": {"path": str(model_dir), "fingerprint": model_fingerprint, "num_layers": n,
                             "hidden_size": hidden},
            "shards": [], "created": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        }
    have = {sid for sh in manifest["shards"] for sid in sh["sample_ids"]}
    todo = [s for s in samples if s.id not in have and len(s.ids) <= max_len]
    if not todo:
        return FeatureStore(out_dir)
    be = FeaturePath(spec, model_dir, max_len=max_len)
    manifest["backend_version"] = be.version
    log(f"drafter features: {len(have)} samples reused, {len(todo)} to extract with {spec.backend} "
        f"(layers {list(captured)}{' PLANTED OFFSET ' + str(spec.layer_offset) if spec.layer_offset else ''}"
        f"{' PLANTED ' + spec.transform.upper() if spec.transform != 'none' else ''}) -> {out_dir}")
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

    for i, (s, (aux, final, am)) in enumerate(zip(todo, _extracted(be, todo, spec.extract_batch_tokens))):
        ids = s.ids
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
