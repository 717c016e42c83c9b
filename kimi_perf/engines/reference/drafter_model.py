"""The EAGLE-3 drafter: architecture, training-time-test loss, and the SpecForge/EAGLE checkpoint.

Why our own implementation: SpecForge pins torch 2.11 + sglang + triton and speculators trains on CPU
only with eager kernels, so neither can be the runtime dependency of a suite that must train on a
2-core CPU box and on an H200 alike. The architecture follows SpecForge's llama3_eagle.py exactly:

- features: the target's residual stream *entering* layers [2, N//2, N-3], concatenated [3H] and
  projected by ``fc`` (3H -> H, no bias);
- one Llama decoder layer ``midlayer`` whose attention input is
  ``cat(input_layernorm(embed(token)), hidden_norm(h))`` [2H]; residual stream starts at ``h``;
- ``norm`` then ``lm_head`` over a draft vocabulary; ``d2t[i]`` maps draft id i to target id
  ``i + d2t[i]``, ``t2d`` marks target ids in the draft vocabulary;
- embeddings are the target's, frozen, and not stored (SGLang and vLLM use the target's anyway);
- the next draft step feeds back the pre-norm output hidden (vLLM's ``hidden_prenorm``), which has
  width H, so ``fc`` is skipped for it.

Training-time test (TTT) unrolls k steps: step j at anchor t attends to step-0 keys at positions <= t
and to its own steps' keys at anchor t (the chain it would have drafted), with RoPE positions t + j,
which is what vLLM's and our engine's drafting loop compute at inference.

It lives with the reference engine, which serves it (:mod:`.drafting`); the training and evaluation
pipeline (:mod:`kimi_perf.eagle3`) imports it from here, so imports run one way: pipeline -> engine.
"""

from __future__ import annotations

import json
import math
from collections.abc import Mapping
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from ...capture.layers import (
    AUX_CONVENTIONS,
    SGLANG_AUX_CONVENTIONS,
    aux_ids_for_engine,
    default_aux_layers,
    effective_aux_layers,
    served_aux_layers,
    sglang_aux_convention,
)

__all__ = [
    "AUX_CONVENTIONS",
    "CHECKPOINT_KEYS",
    "SGLANG_AUX_CONVENTIONS",
    "Eagle3Config",
    "Eagle3Drafter",
    "TTTOutput",
    "aux_ids_for_engine",
    "default_aux_layers",
    "effective_aux_layers",
    "load_drafter",
    "save_drafter",
    "served_aux_layers",
    "sglang_aux_convention",
]

# The exact tensor set of a SpecForge/EAGLE-format EAGLE-3 checkpoint. Loaders silently skip unknown
# tensors and leave missing ones at init, so the contract test checks this set strictly.
CHECKPOINT_KEYS = (
    "fc.weight", "norm.weight", "lm_head.weight", "d2t", "t2d",
    "midlayer.hidden_norm.weight", "midlayer.input_layernorm.weight", "midlayer.post_attention_layernorm.weight",
    "midlayer.self_attn.q_proj.weight", "midlayer.self_attn.k_proj.weight", "midlayer.self_attn.v_proj.weight",
    "midlayer.self_attn.o_proj.weight",
    "midlayer.mlp.gate_proj.weight", "midlayer.mlp.up_proj.weight", "midlayer.mlp.down_proj.weight",
)

_ROPE_KEYS = ("rope_theta", "rope_scaling", "rope_parameters")


@dataclass(frozen=True)
class Eagle3Config:
    hidden_size: int
    target_hidden_size: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    intermediate_size: int
    vocab_size: int
    draft_vocab_size: int
    rms_norm_eps: float
    max_position_embeddings: int
    target_num_layers: int
    rope: Mapping[str, Any] = field(default_factory=dict)  # the target's rope keys, verbatim
    aux_layer_ids: tuple[int, ...] | None = None  # in "entering layer k" ids; None = [2, N//2, N-3]

    @property
    def aux_layers(self) -> tuple[int, ...]:
        n = self.target_num_layers
        return tuple(self.aux_layer_ids) if self.aux_layer_ids is not None else (2, n // 2, n - 3)

    @classmethod
    def for_target(cls, target_config: Mapping[str, Any], draft_vocab_size: int,
                   aux_layer_ids: tuple[int, ...] | None = None) -> Eagle3Config:
        c = target_config
        heads = int(c["num_attention_heads"])
        return cls(
            hidden_size=int(c["hidden_size"]), target_hidden_size=int(c["hidden_size"]),
            num_attention_heads=heads, num_key_value_heads=int(c.get("num_key_value_heads") or heads),
            head_dim=int(c.get("head_dim") or int(c["hidden_size"]) // heads),
            intermediate_size=int(c["intermediate_size"]), vocab_size=int(c["vocab_size"]),
            draft_vocab_size=int(draft_vocab_size), rms_norm_eps=float(c["rms_norm_eps"]),
            max_position_embeddings=int(c.get("max_position_embeddings", 4096)),
            target_num_layers=int(c["num_hidden_layers"]),
            rope={k: c[k] for k in _ROPE_KEYS if k in c}, aux_layer_ids=aux_layer_ids,
        )

    def hf_config(self, *, aux_ids_written: list[int] | None = None) -> dict[str, Any]:
        d: dict[str, Any] = {
            "architectures": ["LlamaForCausalLMEagle3"],
            "model_type": "llama",
            "hidden_size": self.hidden_size,
            "target_hidden_size": self.target_hidden_size,
            "intermediate_size": self.intermediate_size,
            "num_attention_heads": self.num_attention_heads,
            "num_key_value_heads": self.num_key_value_heads,
            "head_dim": self.head_dim,
            "num_hidden_layers": 1,
            "vocab_size": self.vocab_size,
            "draft_vocab_size": self.draft_vocab_size,
            "rms_norm_eps": self.rms_norm_eps,
            "max_position_embeddings": self.max_position_embeddings,
            "hidden_act": "silu",
            "tie_word_embeddings": False,
            "torch_dtype": "bfloat16",
            **dict(self.rope),
            "kimi_perf": {"target_num_layers": self.target_num_layers, "trained_aux_layers": list(self.aux_layers),
                          "aux_layer_convention": "residual stream entering layer k"},
        }
        if "rope_theta" not in d and isinstance(d.get("rope_parameters"), dict) and "rope_theta" in d["rope_parameters"]:
            d["rope_theta"] = d["rope_parameters"]["rope_theta"]  # older readers (vLLM on transformers<5)
        if aux_ids_written is not None:
            d["eagle_config"] = {"eagle_aux_hidden_state_layer_ids": list(aux_ids_written), "use_aux_hidden_state": True}
        return d

    @classmethod
    def from_hf_config(cls, d: Mapping[str, Any], *, engine: str = "reference",
                       target_num_layers: int | None = None) -> Eagle3Config:
        """Read a drafter config.json. Explicit aux ids are interpreted in ``engine``'s convention;
        without them the engine default [2, N//2, N-3] applies (N from the config's kimi_perf block,
        or ``target_num_layers`` for drafters made elsewhere)."""
        if "LlamaForCausalLMEagle3" not in (d.get("architectures") or []):
            raise ValueError(f"not an EAGLE-3 drafter config (architectures={d.get('architectures')})")
        meta = d.get("kimi_perf") or {}
        n = int(meta.get("target_num_layers", 0)) or target_num_layers
        written = (d.get("eagle_config") or {}).get("eagle_aux_hidden_state_layer_ids")
        aux = effective_aux_layers(list(written), engine) if written is not None else None
        heads = int(d["num_attention_heads"])
        return cls(
            hidden_size=int(d["hidden_size"]), target_hidden_size=int(d.get("target_hidden_size") or d["hidden_size"]),
            num_attention_heads=heads, num_key_value_heads=int(d.get("num_key_value_heads") or heads),
            head_dim=int(d.get("head_dim") or int(d["hidden_size"]) // heads),
            intermediate_size=int(d["intermediate_size"]), vocab_size=int(d["vocab_size"]),
            draft_vocab_size=int(d.get("draft_vocab_size") or d["vocab_size"]), rms_norm_eps=float(d["rms_norm_eps"]),
            max_position_embeddings=int(d.get("max_position_embeddings", 4096)),
            target_num_layers=n or 0, rope={k: d[k] for k in _ROPE_KEYS if k in d}, aux_layer_ids=aux,
        )


class RMSNorm(nn.Module):
    def __init__(self, size: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(size))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        dt = x.dtype
        xf = x.float()
        xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * xf.to(dt)


class _Attn(nn.Module):
    def __init__(self, c: Eagle3Config) -> None:
        super().__init__()
        h2 = 2 * c.hidden_size
        self.q_proj = nn.Linear(h2, c.num_attention_heads * c.head_dim, bias=False)
        self.k_proj = nn.Linear(h2, c.num_key_value_heads * c.head_dim, bias=False)
        self.v_proj = nn.Linear(h2, c.num_key_value_heads * c.head_dim, bias=False)
        self.o_proj = nn.Linear(c.num_attention_heads * c.head_dim, c.hidden_size, bias=False)


class _MLP(nn.Module):
    def __init__(self, c: Eagle3Config) -> None:
        super().__init__()
        self.gate_proj = nn.Linear(c.hidden_size, c.intermediate_size, bias=False)
        self.up_proj = nn.Linear(c.hidden_size, c.intermediate_size, bias=False)
        self.down_proj = nn.Linear(c.intermediate_size, c.hidden_size, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class _MidLayer(nn.Module):
    def __init__(self, c: Eagle3Config) -> None:
        super().__init__()
        self.hidden_norm = RMSNorm(c.hidden_size, c.rms_norm_eps)
        self.input_layernorm = RMSNorm(c.hidden_size, c.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(c.hidden_size, c.rms_norm_eps)
        self.self_attn = _Attn(c)
        self.mlp = _MLP(c)


@dataclass
class TTTOutput:
    loss: torch.Tensor
    step_loss: list[float]
    step_acc: list[float]  # top-1 agreement with the target's argmax, per unrolled step
    step_count: list[int]  # valid positions per step
    # with keep_hits: per step, [B, T] bool, anchor t's draft matched the target's argmax (and was valid)
    step_hits: tuple[torch.Tensor, ...] = ()


_ROPE_CACHE: dict[Any, tuple[torch.Tensor, torch.Tensor]] = {}


def _rope_table(c: Eagle3Config, need: int, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """cos/sin for positions [0, need) or more (fp32), cached per rope config and device."""
    from .model import rope_tables

    key = (json.dumps(dict(c.rope), sort_keys=True), c.head_dim, str(device))
    cached = _ROPE_CACHE.get(key)
    if cached is None or cached[0].shape[0] < need:
        size = max(need, 4096)
        cached = rope_tables(_rope_config(c), size, device)
        _ROPE_CACHE[key] = cached
    return cached


def _rope_cos_sin(c: Eagle3Config, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """cos/sin at arbitrary ``positions`` (reads the largest one back to the host: not for hot loops)."""
    cos, sin = _rope_table(c, int(positions.max().item()) + 1, positions.device)
    return cos[positions].to(dtype), sin[positions].to(dtype)


def _rope_cos_sin_range(c: Eagle3Config, start: int, length: int, device: torch.device,
                        dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """cos/sin [1, length, D] at positions start .. start+length-1: the same rows as
    :func:`_rope_cos_sin` of ``arange(length) + start``, sliced instead of gathered, with no host sync."""
    cos, sin = _rope_table(c, start + length, device)
    return cos[None, start:start + length].to(dtype), sin[None, start:start + length].to(dtype)


def _rope_config(c: Eagle3Config) -> Any:
    from transformers import LlamaConfig

    kw = dict(c.rope)
    return LlamaConfig(hidden_size=c.hidden_size, num_attention_heads=c.num_attention_heads,
                       head_dim=c.head_dim, max_position_embeddings=c.max_position_embeddings, **kw)


def _rot(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return x * cos + torch.cat((-x[..., half:], x[..., :half]), dim=-1) * sin


class Eagle3Drafter(nn.Module):
    """The trainable drafter; parameter names are the checkpoint's tensor names."""

    # buffers (register_buffer), declared so that type checkers see tensors rather than Tensor | Module
    d2t: torch.Tensor
    t2d: torch.Tensor
    embed: torch.Tensor

    def __init__(self, cfg: Eagle3Config, embed_weight: torch.Tensor) -> None:
        super().__init__()
        self.cfg = cfg
        h = cfg.hidden_size
        self.fc = nn.Linear(3 * cfg.target_hidden_size, h, bias=False)
        self.midlayer = _MidLayer(cfg)
        self.norm = RMSNorm(h, cfg.rms_norm_eps)
        self.lm_head = nn.Linear(h, cfg.draft_vocab_size, bias=False)
        self.register_buffer("d2t", torch.zeros(cfg.draft_vocab_size, dtype=torch.long))
        self.register_buffer("t2d", torch.zeros(cfg.vocab_size, dtype=torch.bool))
        # the target's embeddings, frozen and never saved
        self.register_buffer("embed", embed_weight.detach().clone(), persistent=False)

    def set_vocab(self, d2t: torch.Tensor, t2d: torch.Tensor) -> None:
        self.d2t.copy_(d2t)
        self.t2d.copy_(t2d)

    def draft_to_target(self, draft_ids: torch.Tensor) -> torch.Tensor:
        return draft_ids + self.d2t[draft_ids]

    def _qkv(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor):  # type: ignore[no-untyped-def]
        c = self.cfg
        b, t, _ = x.shape
        a = self.midlayer.self_attn
        q = a.q_proj(x).view(b, t, c.num_attention_heads, c.head_dim)
        k = a.k_proj(x).view(b, t, c.num_key_value_heads, c.head_dim)
        v = a.v_proj(x).view(b, t, c.num_key_value_heads, c.head_dim)
        cs, sn = cos[:, :, None, :], sin[:, :, None, :]
        return _rot(q, cs, sn), _rot(k, cs, sn), v

    def ttt(
        self,
        aux: torch.Tensor,  # [B, T, 3H] target features at each position
        input_ids: torch.Tensor,  # [B, T]
        target_logits: torch.Tensor,  # [B, T, Vd] target's logits at each position, restricted to the draft vocab
        target_valid: torch.Tensor,  # [B, T] bool: position p's target is trainable (assistant token, in vocab)
        steps: int,
        step_weight: float = 0.8,
        keep_hits: bool = False,
    ) -> TTTOutput:
        """Training-time test: unroll ``steps`` drafting steps and return the weighted soft-CE loss
        (``keep_hits``: also each step's per-anchor hits, for the held-out chain walk).

        Why no host sync inside the unroll: at the trainer's sizes (a 1-layer drafter, hidden 576) a
        training step is launch-bound, a few hundred small kernels. Every ``.item()``, ``float(t)`` or
        boolean-mask index (``x[mask]`` needs the mask's count: a nonzero and a device->host copy)
        makes the host wait until the GPU has drained its queue, so the GPU then idles while the host
        launches the next kernels. The step's loss, accuracy and count are therefore masked sums (a
        step with no valid position adds exactly 0 to the loss, as skipping it did), the RoPE rows are
        a slice (the largest position, t_len - 1 + k, is known on the host), the target's softmax and
        argmax are computed once and shifted by slicing, and the per-step numbers come back in one
        transfer at the end. tests/test_ttt_sync_free.py holds the former implementation and checks
        that this one computes the same loss, gradients and per-step numbers."""
        c = self.cfg
        bsz, t_len, _ = aux.shape
        dev = aux.device
        groups = c.num_attention_heads // c.num_key_value_heads
        scale = 1.0 / math.sqrt(c.head_dim)
        causal = torch.ones(t_len, t_len, device=dev, dtype=torch.bool).tril()
        # the target's distribution and greedy choice at each position, once for all steps: step k
        # reads them shifted by 1 + k (a view, no copy)
        pt_all = torch.softmax(target_logits.float(), dim=-1)
        targ_all = target_logits.argmax(-1)
        h = self.fc(aux)
        keys: list[torch.Tensor] = []
        vals: list[torch.Tensor] = []
        total = aux.new_zeros(())
        stats: list[torch.Tensor] = []  # per step: [loss, acc, count] on the device, read back once
        hits: list[torch.Tensor] = []
        for k in range(steps):
            # anchor t at step k: token x_{t+1+k}, target = distribution at position t+1+k; anchors
            # t >= t_len - shift have no token (zero) and are never valid
            shift = 1 + k
            span = max(t_len - shift, 0)
            tok = torch.zeros_like(input_ids)
            tok[:, :span] = input_ids[:, shift:]
            e = F.embedding(tok, self.embed).to(h.dtype)
            x = torch.cat([self.midlayer.input_layernorm(e), self.midlayer.hidden_norm(h)], dim=-1)
            cos, sin = _rope_cos_sin_range(c, k, t_len, dev, x.dtype)  # positions t + k
            q, kk, vv = self._qkv(x, cos, sin)
            keys.append(kk)
            vals.append(vv)
            # [B, kv, G, T, D] queries against step-0 keys (causal) and the diagonal keys of steps 1..k
            qg = q.permute(0, 2, 1, 3).reshape(bsz, c.num_key_value_heads, groups, t_len, c.head_dim)
            k0 = keys[0].permute(0, 2, 1, 3)[:, :, None]  # [B, kv, 1, T, D]
            v0 = vals[0].permute(0, 2, 1, 3)[:, :, None]
            s0 = torch.matmul(qg, k0.transpose(-1, -2)) * scale  # [B, kv, G, T, T]
            s0 = s0.masked_fill(~causal, float("-inf"))
            diag_s = [((qg * kj.permute(0, 2, 1, 3)[:, :, None]).sum(-1) * scale)[..., None]
                      for kj in keys[1:]]  # each [B, kv, G, T, 1]
            scores = torch.cat([s0, *diag_s], dim=-1).float()
            p = torch.softmax(scores, dim=-1).to(x.dtype)
            out = torch.matmul(p[..., :t_len], v0)
            for j, vj in enumerate(vals[1:]):
                out = out + p[..., t_len + j : t_len + j + 1] * vj.permute(0, 2, 1, 3)[:, :, None]
            out = out.reshape(bsz, c.num_attention_heads, t_len, c.head_dim).transpose(1, 2).reshape(bsz, t_len, -1)
            attn = self.midlayer.self_attn.o_proj(out)
            resid = attn + h
            prenorm = self.midlayer.mlp(self.midlayer.post_attention_layernorm(resid)) + resid
            logits = self.lm_head(self.norm(prenorm)).float()
            # soft CE and top-1 over the anchors that have a target, masked rather than indexed
            lg = logits[:, :span]
            valid = target_valid[:, shift:]  # [B, span]
            n = valid.sum()
            ce = -(pt_all[:, shift:] * torch.log_softmax(lg, dim=-1)).sum(-1)  # [B, span]
            loss_k = torch.where(valid, ce, 0.0).sum() / n.clamp(min=1)
            match = (lg.argmax(-1) == targ_all[:, shift:]) & valid
            acc = match.sum() / n.clamp(min=1)
            if keep_hits:
                hits.append(torch.cat([match, match.new_zeros(bsz, t_len - span)], dim=1))
            total = total + (step_weight ** k) * loss_k
            some = n > 0
            stats.append(torch.stack([torch.where(some, loss_k.detach().double(), float("nan")),
                                      torch.where(some, acc.double(), float("nan")), n.double()]))
            h = prenorm
        # the one device->host transfer of the call
        rows = torch.stack(stats).tolist() if stats else []
        return TTTOutput(loss=total, step_loss=[r[0] for r in rows], step_acc=[r[1] for r in rows],
                         step_count=[int(r[2]) for r in rows], step_hits=tuple(hits))


def save_drafter(model: Eagle3Drafter, out_dir: Path, *, aux_ids_for: str | None = None,
                 extra_meta: Mapping[str, Any] | None = None) -> Path:
    """Write config.json + model.safetensors (bf16 weights, int64 d2t, bool t2d).

    ``aux_ids_for``: None writes no explicit aux-layer ids (every engine then uses [2, N//2, N-3], which
    is what the drafter was trained on when its config has no ids); "vllm", "sglang-llama",
    "sglang-deepseek" or "reference" write ids in that engine's convention.
    """
    from safetensors.torch import save_file

    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    cfg = model.cfg
    default = (2, cfg.target_num_layers // 2, cfg.target_num_layers - 3)
    if aux_ids_for is None and cfg.aux_layers != default:
        raise ValueError(f"drafter was trained on layers {cfg.aux_layers}, not the default {default}: "
                         "pass aux_ids_for=<engine> so the checkpoint names them")
    written = None if aux_ids_for is None else aux_ids_for_engine(cfg.aux_layers, aux_ids_for)
    sd = {k: v.detach().cpu().contiguous() for k, v in model.state_dict().items()}
    tensors = {k: (sd[k] if k in ("d2t", "t2d") else sd[k].to(torch.bfloat16)) for k in CHECKPOINT_KEYS}
    tmp = out_dir / "model.safetensors.tmp"
    save_file(tensors, str(tmp), metadata={"format": "pt"})
    tmp.replace(out_dir / "model.safetensors")
    hf = cfg.hf_config(aux_ids_written=written)
    if extra_meta:
        hf["kimi_perf"].update(dict(extra_meta))
    (out_dir / "config.json").write_text(json.dumps(hf, indent=1))
    return out_dir


def load_drafter(path: Path, embed_weight: torch.Tensor, *, engine: str = "reference",
                 device: str | torch.device = "cpu", dtype: torch.dtype = torch.float32,
                 target_num_layers: int | None = None) -> Eagle3Drafter:
    from safetensors.torch import load_file

    path = Path(path)
    hf = json.loads((path / "config.json").read_text())
    cfg = Eagle3Config.from_hf_config(hf, engine=engine, target_num_layers=target_num_layers)
    sd = load_file(str(path / "model.safetensors"))
    missing = [k for k in CHECKPOINT_KEYS if k not in sd]
    unknown = [k for k in sd if k not in CHECKPOINT_KEYS and k != "embed_tokens.weight"]
    if missing or unknown:
        raise ValueError(f"{path}: drafter checkpoint has missing tensors {missing} / unknown tensors {unknown}")
    if cfg.target_num_layers == 0:
        raise ValueError(f"{path}: config lacks kimi_perf.target_num_layers; cannot resolve default aux layers")
    m = Eagle3Drafter(cfg, embed_weight.to(dtype))
    m.load_state_dict({k: v for k, v in sd.items() if k in CHECKPOINT_KEYS}, strict=True)
    return m.to(device=device, dtype=dtype).eval()


def config_dict(cfg: Eagle3Config) -> dict[str, Any]:
    d = asdict(cfg)
    d["rope"] = dict(cfg.rope)
    return d
