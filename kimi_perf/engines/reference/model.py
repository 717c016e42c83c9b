"""Llama-family forward pass over a slot KV cache: the compute core of the reference engine.

Why not call the transformers model directly: the engine needs (a) continuous batching, where every
running sequence has its own cache length and a step mixes sequences of different ages, (b) the
residual stream *entering* any decoder layer, captured during real serving (the EAGLE-3 aux
features and the alignment tests read it), and (c) verification of several draft tokens per sequence
in one forward. transformers' caches and hooks give each of these only in one mode at a time, and
their internals move between 5.x releases (the lent H200 has 5.17, CI installs the newest). The math
below follows transformers' Llama line by line (RMSNorm in fp32 then cast, rotate-half RoPE, SiLU
gated MLP), so greedy output matches ``model.generate``; the tests check that token for token.

Cache layout: one tensor per layer, ``[slots, kv_heads, max_len, head_dim]``. The scheduler keeps the
running sequences compacted in slots ``[0, n)``, so a decode step reads a *view* of the cache (no
gather) and new sequences are prefilled in the slots right after the running ones.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F

# torch-free, shared with the bandwidth floor (kimi_perf.roofline); re-exported here for the engine's callers
from ...models.shapes import LlamaShape

__all__ = [
    "CaptureSpec",
    "LlamaRunner",
    "LlamaShape",
    "RunnerOutput",
    "load_llama_weights",
    "random_llama_weights",
]


@dataclass
class LayerWeights:
    qkv: torch.Tensor  # [(heads + 2*kv_heads) * head_dim, hidden]: q, k, v fused (one GEMM)
    o: torch.Tensor
    gate_up: torch.Tensor  # [2 * intermediate, hidden]: gate then up, fused
    down: torch.Tensor
    input_norm: torch.Tensor
    post_norm: torch.Tensor


@dataclass
class LlamaWeights:
    embed: torch.Tensor
    layers: list[LayerWeights]
    norm: torch.Tensor
    lm_head: torch.Tensor

    def nbytes(self) -> int:
        seen: set[int] = set()
        total = 0
        tensors = [self.embed, self.norm, self.lm_head]
        for layer in self.layers:
            tensors += [layer.qkv, layer.o, layer.gate_up, layer.down, layer.input_norm, layer.post_norm]
        for t in tensors:
            if t.data_ptr() in seen:
                continue
            seen.add(t.data_ptr())
            total += t.numel() * t.element_size()
        return total


@dataclass(frozen=True)
class CaptureSpec:
    """Which hidden states a forward returns.

    ``layers``: ids k in ``[0, N]``, each the residual stream *entering* decoder layer k (k = 0 is the
    embedding output, k = N the output of the last layer before the final norm) -- vLLM's and the
    EAGLE-3 papers' convention. ``final_norm``: also the output of the final RMSNorm (what SGLang's
    ``return_hidden_states`` and transformers' last ``hidden_states`` entry are).
    """

    layers: tuple[int, ...] = ()
    final_norm: bool = False

    def __bool__(self) -> bool:
        return bool(self.layers) or self.final_norm


@dataclass
class RunnerOutput:
    logits: torch.Tensor | None  # [B, V] for "last", [B, q, V] for "all"
    hidden: dict[int | str, torch.Tensor] = field(default_factory=dict)  # id -> [B, q, H]


def _read_config(model_dir: Path) -> Any:
    from transformers import AutoConfig

    return AutoConfig.from_pretrained(str(model_dir))


def _fuse_layer(get: Any, i: int) -> LayerWeights:
    p = f"model.layers.{i}."
    return LayerWeights(
        qkv=torch.cat([get(p + "self_attn.q_proj.weight"), get(p + "self_attn.k_proj.weight"),
                       get(p + "self_attn.v_proj.weight")], dim=0),
        o=get(p + "self_attn.o_proj.weight"),
        gate_up=torch.cat([get(p + "mlp.gate_proj.weight"), get(p + "mlp.up_proj.weight")], dim=0),
        down=get(p + "mlp.down_proj.weight"),
        input_norm=get(p + "input_layernorm.weight"),
        post_norm=get(p + "post_attention_layernorm.weight"),
    )


def load_llama_weights(model_dir: Path, shape: LlamaShape, dtype: torch.dtype, device: torch.device) -> LlamaWeights:
    """Load a transformers Llama checkpoint (safetensors, possibly sharded) into fused tensors."""
    from safetensors import safe_open

    files = sorted(Path(model_dir).glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(
            f"no *.safetensors under {model_dir}; the reference engine reads transformers checkpoints "
            "(use --load-format dummy for random weights)"
        )
    handles = [safe_open(str(f), framework="pt", device="cpu") for f in files]
    where: dict[str, Any] = {}
    for h in handles:
        for k in h.keys():  # noqa: SIM118 - safe_open has keys(), not __iter__
            where[k] = h

    def get(name: str) -> torch.Tensor:
        if name not in where:
            raise KeyError(f"tensor {name!r} missing from the checkpoint in {model_dir}")
        return where[name].get_tensor(name).to(device=device, dtype=dtype)

    layers = [_fuse_layer(get, i) for i in range(shape.num_layers)]
    embed = get("model.embed_tokens.weight")
    lm_head = embed if shape.tie_word_embeddings or "lm_head.weight" not in where else get("lm_head.weight")
    return LlamaWeights(embed=embed, layers=layers, norm=get("model.norm.weight"), lm_head=lm_head)


def random_llama_weights(shape: LlamaShape, dtype: torch.dtype, device: torch.device, seed: int = 0) -> LlamaWeights:
    """Random weights (``--load-format dummy``): right shapes and bytes, meaningless values.

    Norm weights are drawn around 1 rather than set to 1, so a dropped or doubled final norm is
    visible in hidden-state comparisons even on dummy weights (docs/metrics.md section 3).
    """
    gen = torch.Generator(device=device).manual_seed(seed)
    std = 0.02
    h, d = shape.hidden_size, shape.head_dim

    def rnd(*size: int) -> torch.Tensor:
        return (torch.randn(*size, generator=gen, device=device, dtype=torch.float32) * std).to(dtype)

    def norm_w() -> torch.Tensor:
        return (1.0 + 0.25 * torch.rand(h, generator=gen, device=device)).to(dtype)

    layers = []
    for _ in range(shape.num_layers):
        layers.append(
            LayerWeights(
                qkv=rnd((shape.num_heads + 2 * shape.num_kv_heads) * d, h),
                o=rnd(h, shape.num_heads * d),
                gate_up=rnd(2 * shape.intermediate_size, h),
                down=rnd(h, shape.intermediate_size),
                input_norm=norm_w(),
                post_norm=norm_w(),
            )
        )
    embed = rnd(shape.vocab_size, h)
    lm_head = embed if shape.tie_word_embeddings else rnd(shape.vocab_size, h)
    return LlamaWeights(embed=embed, layers=layers, norm=norm_w(), lm_head=lm_head)


def rope_tables(config: Any, max_len: int, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """cos/sin for positions [0, max_len), computed exactly as transformers' LlamaRotaryEmbedding."""
    from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding

    rot = LlamaRotaryEmbedding(config=config)
    inv_freq = rot.inv_freq.to(device=device, dtype=torch.float32)
    pos = torch.arange(max_len, device=device, dtype=torch.float32)
    freqs = pos[:, None] * inv_freq[None, :]
    emb = torch.cat((freqs, freqs), dim=-1)
    scale = float(getattr(rot, "attention_scaling", 1.0))
    return emb.cos() * scale, emb.sin() * scale


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """transformers' LlamaRMSNorm: normalise in fp32, cast back, then scale."""
    dt = x.dtype
    xf = x.to(torch.float32)
    xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    return weight * xf.to(dt)


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


class LlamaRunner:
    """Batched Llama forward over a slot KV cache. Not thread-safe: one scheduler thread owns it."""

    def __init__(
        self,
        shape: LlamaShape,
        weights: LlamaWeights,
        config: Any,
        *,
        device: torch.device,
        dtype: torch.dtype,
        max_slots: int,
        max_len: int,
    ) -> None:
        self.shape = shape
        self.w = weights
        self.device = device
        self.dtype = dtype
        self.max_slots = max_slots
        self.max_len = max_len
        # One scratch position past max_len absorbs the key/value writes of right padding, so padded
        # rows never overwrite a real cache entry.
        cos, sin = rope_tables(config, max_len + 1, device)
        self.cos = cos.to(dtype)
        self.sin = sin.to(dtype)
        kv = shape.num_kv_heads
        self.k_cache = [
            torch.zeros(max_slots, kv, max_len + 1, shape.head_dim, device=device, dtype=dtype)
            for _ in range(shape.num_layers)
        ]
        self.v_cache = [torch.zeros_like(k) for k in self.k_cache]
        self._kpos = torch.arange(max_len, device=device)
        self._attn_fp32 = device.type == "cpu" and dtype != torch.float32
        # set by cuda_graphs.enable_cuda_graphs: replays captured decode/verify forwards
        self.graphs: Any = None

    # -- construction -------------------------------------------------------------------------

    @classmethod
    def from_pretrained(
        cls,
        model_dir: str | Path,
        *,
        device: str | torch.device = "cpu",
        dtype: torch.dtype = torch.bfloat16,
        max_slots: int = 16,
        max_len: int = 2048,
        load_format: str = "auto",
        seed: int = 0,
    ) -> LlamaRunner:
        model_dir = Path(model_dir)
        config = _read_config(model_dir)
        archs = getattr(config, "architectures", None) or []
        if getattr(config, "model_type", "") not in ("llama", "mistral") and not any("Llama" in a for a in archs):
            raise ValueError(
                f"{model_dir} is a {config.model_type!r} model; the reference engine implements the "
                "Llama architecture only (SmolLM2, Llama-3.x, Mistral-style)"
            )
        shape = LlamaShape.from_config(config)
        dev = torch.device(device)
        if load_format == "dummy":
            weights = random_llama_weights(shape, dtype, dev, seed=seed)
        elif load_format in ("auto", "safetensors"):
            weights = load_llama_weights(model_dir, shape, dtype, dev)
        else:
            raise ValueError(f"unknown load format {load_format!r}: use 'auto' or 'dummy'")
        return cls(shape, weights, config, device=dev, dtype=dtype, max_slots=max_slots, max_len=max_len)

    # -- cache management ---------------------------------------------------------------------

    def move_slot(self, src: int, dst: int, length: int) -> None:
        """Copy a sequence's cache from ``src`` to ``dst`` (compaction after a sequence finishes)."""
        if src == dst or length <= 0:
            return
        for k, v in zip(self.k_cache, self.v_cache):
            k[dst, :, :length].copy_(k[src, :, :length])
            v[dst, :, :length].copy_(v[src, :, :length])

    # -- forward ------------------------------------------------------------------------------

    def embed(self, tokens: torch.Tensor) -> torch.Tensor:
        return F.embedding(tokens, self.w.embed)

    def logits(self, hidden_normed: torch.Tensor) -> torch.Tensor:
        return F.linear(hidden_normed, self.w.lm_head)

    @torch.inference_mode()
    def forward(
        self,
        start_slot: int,
        tokens: torch.Tensor,
        cache_lens: Sequence[int],
        q_lens: Sequence[int],
        *,
        capture: CaptureSpec = CaptureSpec(),
        logits: str = "last",
    ) -> RunnerOutput:
        """Run ``tokens`` [B, q] for the sequences in slots ``[start_slot, start_slot + B)``.

        Row b has ``cache_lens[b]`` tokens already cached and ``q_lens[b] <= q`` real new tokens
        (the rest is right padding, whose outputs are garbage and never read). The new tokens' keys
        and values are written at positions ``cache_lens[b] + j``. Lengths are host-side ints so a
        step never waits on the device to learn its own shapes. ``logits``: "last" (at each row's
        last real token), "all" (every position), or "none".
        """
        bsz, q = tokens.shape
        if start_slot + bsz > self.max_slots:
            raise ValueError(f"slots [{start_slot}, {start_slot + bsz}) exceed max_slots={self.max_slots}")
        if self.graphs is not None and start_slot == 0:
            out = self.graphs.run(tokens, cache_lens, q_lens, capture, logits)
            if out is not None:
                return out
        sb = make_slot_batch(start_slot, cache_lens, q_lens, q, max_len=self.max_len, cos_table=self.cos,
                             sin_table=self.sin, kpos=self._kpos, device=self.device)
        return self.forward_batch(tokens, sb, capture=capture, logits=logits)

    def forward_batch(self, tokens: torch.Tensor, sb: SlotBatch, *, capture: CaptureSpec = CaptureSpec(),
                      logits: str = "last") -> RunnerOutput:
        """The forward proper, on device tensors only (no host reads): what CUDA graphs capture."""
        s = self.shape
        bsz = tokens.shape[0]
        dev = self.device
        n_t = sb.n_t
        hidden: dict[int | str, torch.Tensor] = {}
        want = set(capture.layers)
        x = self.embed(tokens)
        for i, layer in enumerate(self.w.layers):
            if i in want:
                hidden[i] = x.clone()
            x = x + cached_attention(rms_norm(x, layer.input_norm, s.rms_norm_eps), layer.qkv, layer.o,
                                     self.k_cache[i], self.v_cache[i], sb, heads=s.num_heads,
                                     kv_heads=s.num_kv_heads, head_dim=s.head_dim, attn_fp32=self._attn_fp32)
            h = rms_norm(x, layer.post_norm, s.rms_norm_eps)
            gate, up = F.linear(h, layer.gate_up).chunk(2, dim=-1)
            x = x + F.linear(F.silu(gate) * up, layer.down)
        if s.num_layers in want:
            hidden[s.num_layers] = x.clone()
        out_logits = None
        ar_b = torch.arange(bsz, device=dev)
        if capture.final_norm or logits == "all":
            normed = rms_norm(x, self.w.norm, s.rms_norm_eps)  # [B, q, H]
            if capture.final_norm:
                hidden["final"] = normed
            if logits == "all":
                out_logits = self.logits(normed)
            elif logits == "last":
                out_logits = self.logits(normed[ar_b, (n_t - 1).clamp(min=0)])
        elif logits == "last":
            # only each row's last real position needs the final norm and the (large) vocab projection
            last = x[ar_b, (n_t - 1).clamp(min=0)]
            out_logits = self.logits(rms_norm(last, self.w.norm, s.rms_norm_eps))
        return RunnerOutput(logits=out_logits, hidden=hidden)


@dataclass
class SlotBatch:
    """Geometry of one forward over slots ``[start, start + bsz)``, shared by every layer (and by the
    EAGLE-3 drafter's layer, which uses the same cache layout)."""

    start: int
    bsz: int
    q_len: int
    t_max: int
    rows: torch.Tensor  # [B, q] slot index of each new token
    positions: torch.Tensor  # [B, q] cache position (right padding -> the scratch position)
    cos: torch.Tensor  # [B, q, 1, D]
    sin: torch.Tensor
    mask: torch.Tensor  # [B, 1, q, T] bool
    n_t: torch.Tensor  # [B] real new tokens per row


def make_slot_batch(start: int, cache_lens: Sequence[int], q_lens: Sequence[int], q: int, *, max_len: int,
                    cos_table: torch.Tensor, sin_table: torch.Tensor, kpos: torch.Tensor,
                    device: torch.device) -> SlotBatch:
    """The batch geometry from host-side lengths (the eager path: ``t_max`` is the longest row)."""
    totals = [c + n for c, n in zip(cache_lens, q_lens)]
    t_max = max(totals)
    if t_max > max_len:
        raise ValueError(f"sequence length {t_max} exceeds the cache's max_len={max_len}")
    return slot_batch_from_tensors(start, torch.tensor(list(cache_lens), device=device),
                                   torch.tensor(list(q_lens), device=device), q, t_max, max_len=max_len,
                                   cos_table=cos_table, sin_table=sin_table, kpos=kpos)


def slot_batch_from_tensors(start: int, c_t: torch.Tensor, n_t: torch.Tensor, q: int, t_max: int, *, max_len: int,
                            cos_table: torch.Tensor, sin_table: torch.Tensor, kpos: torch.Tensor) -> SlotBatch:
    """The batch geometry from device tensors and a fixed key window ``t_max``.

    Pure tensor ops with static shapes, so a CUDA graph can capture it: a replay only changes the
    contents of ``c_t`` (cached tokens per row) and ``n_t`` (new real tokens per row; 0 marks a
    padding row of a graph's batch bucket, whose writes all land in the scratch position).
    """
    bsz = c_t.shape[0]
    device = c_t.device
    ar = torch.arange(q, device=device)
    positions = c_t[:, None] + ar[None, :]
    real = ar[None, :] < n_t[:, None]
    positions = torch.where(real, positions, torch.full_like(positions, max_len))
    kp = kpos[:t_max]
    # allowed[b, i, j]: causal against the query's own position, and only real cached/new keys
    allowed = (kp[None, None, :] <= positions[:, :, None]) & (kp[None, None, :] < (c_t + n_t)[:, None, None])
    rows = torch.arange(start, start + bsz, device=device)[:, None].expand(bsz, q)
    return SlotBatch(start=start, bsz=bsz, q_len=q, t_max=t_max, rows=rows, positions=positions,
                     cos=cos_table[positions].unsqueeze(2), sin=sin_table[positions].unsqueeze(2),
                     mask=allowed[:, None, :, :], n_t=n_t)


def cached_attention(h: torch.Tensor, qkv_w: torch.Tensor, o_w: torch.Tensor, k_cache: torch.Tensor,
                     v_cache: torch.Tensor, b: SlotBatch, *, heads: int, kv_heads: int, head_dim: int,
                     attn_fp32: bool) -> torch.Tensor:
    """Fused-QKV projection, RoPE, cache write, masked attention over the slots' cache, output proj."""
    q_size, kv_size = heads * head_dim, kv_heads * head_dim
    qs, ks, vs = F.linear(h, qkv_w).split([q_size, kv_size, kv_size], dim=-1)
    qs = qs.view(b.bsz, b.q_len, heads, head_dim)
    ks = ks.view(b.bsz, b.q_len, kv_heads, head_dim)
    vs = vs.view(b.bsz, b.q_len, kv_heads, head_dim)
    qs = qs * b.cos + _rotate_half(qs) * b.sin
    ks = ks * b.cos + _rotate_half(ks) * b.sin
    # advanced indices on dims 0 and 2 with a slice between: the value is laid out [B, q, kv, D]
    k_cache[b.rows, :, b.positions] = ks
    v_cache[b.rows, :, b.positions] = vs
    keys = k_cache[b.start : b.start + b.bsz, :, : b.t_max]  # [B, kv, T, D] view, no copy
    vals = v_cache[b.start : b.start + b.bsz, :, : b.t_max]
    qh = qs.transpose(1, 2)  # [B, H, q, D]
    if attn_fp32:
        # CPU kernels for bf16 attention are 3-4x slower than fp32 at decode shapes; the upcast of the
        # cached bf16 values is exact, so this only adds precision.
        qh, keys, vals = qh.float(), keys.float(), vals.float()
    out = F.scaled_dot_product_attention(qh, keys, vals, attn_mask=b.mask, enable_gqa=True,
                                         scale=1.0 / math.sqrt(head_dim))
    out = out.to(h.dtype).transpose(1, 2).reshape(b.bsz, b.q_len, -1)
    return F.linear(out, o_w)
