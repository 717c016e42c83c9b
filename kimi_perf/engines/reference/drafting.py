"""EAGLE-3 drafting inside the reference engine: the drafter's own slot KV cache and chain proposals.

Why a separate runtime from the training module: at serving time the drafter keeps a KV cache per
sequence (its single layer), extends it with the target features of every accepted token, and drafts
k tokens autoregressively on top, batched across all running sequences -- the structure of vLLM's
``EagleProposer``. The math is the training module's (same weights, same RoPE positions); a unit test
checks the two agree.

On CUDA the whole propose chain is replayed from CUDA graphs (:class:`DrafterGraphs`), as the
target's decode and verify steps are (``engines/reference/cuda_graphs.py``).

Per sequence, drafter cache entry p pairs the target feature at position p with the token at p+1
(``Sequence.draft_feats`` / ``draft_tokens`` hold entries not yet cached). Draft steps 2..k write
temporary entries after the committed ones; the next extend overwrites them.
"""

from __future__ import annotations

import functools
from collections.abc import Sequence as Seq
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F

from .drafter_model import Eagle3Drafter, _rope_config, load_drafter
from .model import (
    cached_attention,
    make_slot_batch,
    rms_norm,
    rope_tables,
    slot_batch_from_tensors,
)

__all__ = ["DrafterGraphs", "DrafterRuntime"]


def _pack_pending(seqs: Seq[Any], widths: Seq[int], feats: torch.Tensor, host_toks: torch.Tensor) -> None:
    """Row i of ``feats`` (device) and ``host_toks`` (host) gets sequence i's pending drafter entries."""
    for i, s in enumerate(seqs):
        feats[i, : widths[i]] = s.draft_feats
        host_toks[i, : widths[i]] = torch.tensor(s.draft_tokens)


class DrafterRuntime:
    def __init__(self, model: Eagle3Drafter, runner: Any) -> None:
        c = model.cfg
        rs = runner.shape
        if c.hidden_size != rs.hidden_size or c.target_hidden_size != rs.hidden_size:
            raise ValueError(f"drafter hidden size {c.hidden_size} (target_hidden_size {c.target_hidden_size}) "
                             f"does not match the target's {rs.hidden_size}")
        if c.vocab_size != rs.vocab_size:
            raise ValueError(f"drafter vocab_size {c.vocab_size} != target vocab {rs.vocab_size}")
        bad = [k for k in c.aux_layers if not 0 <= k <= rs.num_layers]
        if bad:
            raise ValueError(f"drafter aux layers {c.aux_layers}: {bad} outside [0, {rs.num_layers}]")
        self.cfg = c
        self.aux_layers = tuple(c.aux_layers)
        dev, dt = runner.device, runner.dtype
        m = model.to(device=dev, dtype=dt)
        ml = m.midlayer
        a = ml.self_attn
        self.fc = m.fc.weight.detach()
        self.qkv = torch.cat([a.q_proj.weight, a.k_proj.weight, a.v_proj.weight], dim=0).detach()
        self.o = a.o_proj.weight.detach()
        self.gate_up = torch.cat([ml.mlp.gate_proj.weight, ml.mlp.up_proj.weight], dim=0).detach()
        self.down = ml.mlp.down_proj.weight.detach()
        self.hidden_norm = ml.hidden_norm.weight.detach()
        self.input_norm = ml.input_layernorm.weight.detach()
        self.post_norm = ml.post_attention_layernorm.weight.detach()
        self.norm = m.norm.weight.detach()
        self.lm_head = m.lm_head.weight.detach()
        self.d2t = m.d2t.to(dev)
        self.embed = runner.w.embed  # SGLang and vLLM serve with the target's embeddings too
        self.device = dev
        self.max_len = runner.max_len
        self.max_slots = runner.max_slots
        self._attn_fp32 = runner._attn_fp32
        cos, sin = rope_tables(_rope_config(c), runner.max_len + 1, dev)
        self.cos, self.sin = cos.to(dt), sin.to(dt)
        self._kpos = torch.arange(runner.max_len, device=dev)
        self.k_cache = torch.zeros(runner.max_slots, c.num_key_value_heads, runner.max_len + 1, c.head_dim,
                                   device=dev, dtype=dt)
        self.v_cache = torch.zeros_like(self.k_cache)
        self.graphs: DrafterGraphs | None = None

    @classmethod
    def from_pretrained(cls, path: str | Path, runner: Any) -> DrafterRuntime:
        model = load_drafter(Path(path), runner.w.embed.float().cpu(), engine="reference",
                             target_num_layers=runner.shape.num_layers)
        return cls(model, runner)

    def move_slot(self, src: int, dst: int, length: int) -> None:
        if src != dst and length > 0:
            self.k_cache[dst, :, :length].copy_(self.k_cache[src, :, :length])
            self.v_cache[dst, :, :length].copy_(self.v_cache[src, :, :length])

    @torch.inference_mode()
    def forward(self, hidden_in: torch.Tensor, tokens: torch.Tensor, cache_lens: Seq[int],
                q_lens: Seq[int]) -> torch.Tensor:
        """One drafter layer over slots [0, B): returns the pre-norm hidden [B, q, H]."""
        sb = make_slot_batch(0, cache_lens, q_lens, tokens.shape[1], max_len=self.max_len, cos_table=self.cos,
                             sin_table=self.sin, kpos=self._kpos, device=self.device)
        return self._layer(hidden_in, tokens, sb)

    def _layer(self, hidden_in: torch.Tensor, tokens: torch.Tensor, sb: Any) -> torch.Tensor:
        c = self.cfg
        h = F.linear(hidden_in, self.fc) if hidden_in.shape[-1] != c.hidden_size else hidden_in
        e = F.embedding(tokens, self.embed)
        x = torch.cat([rms_norm(e, self.input_norm, c.rms_norm_eps), rms_norm(h, self.hidden_norm, c.rms_norm_eps)], -1)
        attn = cached_attention(x, self.qkv, self.o, self.k_cache, self.v_cache, sb, heads=c.num_attention_heads,
                                kv_heads=c.num_key_value_heads, head_dim=c.head_dim, attn_fp32=self._attn_fp32)
        resid = attn + h
        gate, up = F.linear(rms_norm(resid, self.post_norm, c.rms_norm_eps), self.gate_up).chunk(2, dim=-1)
        return F.linear(F.silu(gate) * up, self.down) + resid

    def _next(self, prenorm_rows: torch.Tensor) -> torch.Tensor:
        d = F.linear(rms_norm(prenorm_rows, self.norm, self.cfg.rms_norm_eps), self.lm_head).argmax(-1)
        return d + self.d2t[d]

    def draft_chain(self, feats: torch.Tensor, toks: torch.Tensor, c_t: torch.Tensor, n_t: torch.Tensor, k: int,
                    window: int) -> torch.Tensor:
        """Extend every row's cache with its ``n_t`` pending entries, then draft ``k`` tokens: [B, k].

        Device tensors and static shapes only (one key ``window`` for every forward), so the same code
        runs eagerly and inside a CUDA graph. A row with ``n_t = 0`` is padding: every write it makes
        lands in the scratch position and its drafts are never read.
        """
        geo = dict(max_len=self.max_len, cos_table=self.cos, sin_table=self.sin, kpos=self._kpos)
        pre = self._layer(feats, toks, slot_batch_from_tensors(0, c_t, n_t, toks.shape[1], window, **geo))
        rows = torch.arange(toks.shape[0], device=toks.device)
        last = pre[rows, (n_t - 1).clamp(min=0)]
        cur = self._next(last)
        out = [cur]
        committed = c_t + n_t
        active = (n_t > 0).long()
        h = last[:, None, :]
        for j in range(1, k):
            sb = slot_batch_from_tensors(0, committed + (j - 1), active, 1, window, **geo)
            h = self._layer(h, cur[:, None], sb)
            cur = self._next(h[:, 0])
            out.append(cur)
        return torch.stack(out, dim=1)

    def chain_window(self, base: Seq[int], widths: Seq[int], k: int) -> int:
        """Keys the chain can see: the longest row's committed entries plus its k-1 draft entries."""
        return min(self.max_len, max(b + w for b, w in zip(base, widths)) + k - 1)

    def enable_cuda_graphs(self, *, max_bs: int, k: int, log: Any = print) -> DrafterGraphs:
        """Capture the whole propose chain (extend + k draft steps) per batch bucket and key window."""
        self.graphs = DrafterGraphs(self, max_bs=max_bs, k=k)
        self.graphs.capture_all(log=log)
        return self.graphs

    @torch.inference_mode()
    def propose(self, seqs: list[Any], k: int) -> list[list[int]]:
        """Extend each sequence's drafter cache with its pending entries, then draft ``k`` tokens."""
        bsz = len(seqs)
        widths = [len(s.draft_tokens) for s in seqs]
        if min(widths) < 1:
            raise RuntimeError("a running sequence has no pending drafter input (engine bookkeeping bug)")
        base = [s.draft_cache_len for s in seqs]
        drafts = self.graphs.run(seqs, base, widths, k) if self.graphs is not None else None
        if drafts is None:
            m = max(widths)
            feat_dim = seqs[0].draft_feats.shape[-1]
            feats = torch.zeros(bsz, m, feat_dim, device=self.device, dtype=self.k_cache.dtype)
            toks = torch.zeros(bsz, m, dtype=torch.long)
            _pack_pending(seqs, widths, feats, toks)
            drafts = self.draft_chain(feats, toks.to(self.device), torch.tensor(base, device=self.device),
                                      torch.tensor(widths, device=self.device), k, self.chain_window(base, widths, k))
        for s, b, w in zip(seqs, base, widths):
            s.draft_cache_len = b + w
            s.draft_feats = None
            s.draft_tokens = []
        # one device->host read for the whole chain: on a GPU every .tolist() is a sync
        return drafts[:bsz].tolist()


class DrafterGraphs:
    """The propose chain captured as CUDA graphs, keyed by (batch bucket, key window).

    Why: the drafter is one small layer, so an eager chain of k draft steps is ~100 kernel launches
    from Python, several times the GPU time it buys. On a small target (the embedded model on an H200,
    ~2.5 ms per plain decode step) a spec round with the eager chain, and a weak first drafter, ran at
    0.52x of plain decoding; graphed, with a better-trained drafter, 0.98-1.05x. The extend part is padded to
    ``k + 1`` pending entries per row (what a verify step leaves: accepted drafts + the bonus token);
    a longer extend (the first round after a prefill) runs eagerly.
    """

    def __init__(self, rt: DrafterRuntime, *, max_bs: int, k: int) -> None:
        from .cuda_graphs import batch_buckets, window_buckets

        self.rt = rt
        self.k = k
        self.q = k + 1
        self.buckets = batch_buckets(min(max_bs, rt.max_slots))
        self.windows = window_buckets(rt.max_len)
        self.feat_dim = rt.fc.shape[1]
        self.static: dict[int, tuple[torch.Tensor, ...]] = {}
        self.graphs: dict[tuple[int, int], tuple[torch.cuda.CUDAGraph, torch.Tensor]] = {}
        self.pool = torch.cuda.graph_pool_handle()
        self.replays = 0
        self.fallbacks = 0

    @torch.inference_mode()
    def capture_all(self, log: Any = print) -> None:
        import time

        from .cuda_graphs import capture_graph

        rt, t0 = self.rt, time.monotonic()
        stream = torch.cuda.Stream()
        for b in sorted(self.buckets, reverse=True):
            st = (torch.zeros(b, self.q, self.feat_dim, device=rt.device, dtype=rt.k_cache.dtype),
                  torch.zeros(b, self.q, dtype=torch.long, device=rt.device),
                  torch.zeros(b, dtype=torch.long, device=rt.device),
                  torch.zeros(b, dtype=torch.long, device=rt.device))  # feats, toks, c_t, n_t (0: all padding)
            self.static[b] = st
            for t in sorted(self.windows, reverse=True):
                self.graphs[(b, t)] = capture_graph(functools.partial(rt.draft_chain, *st, self.k, t),
                                                    pool=self.pool, stream=stream)
        torch.cuda.synchronize()
        log(f"[kimi-ref] CUDA graphs: drafter chain captured for {len(self.graphs)} (batch, window) shapes, "
            f"k={self.k}, in {time.monotonic() - t0:.1f}s")

    def run(self, seqs: list[Any], base: Seq[int], widths: Seq[int], k: int) -> torch.Tensor | None:
        bsz = len(seqs)
        b = next((x for x in self.buckets if x >= bsz), None)
        t = next((x for x in self.windows if x >= self.rt.chain_window(base, widths, k)), None)
        if k != self.k or max(widths) > self.q or b is None or t is None:
            self.fallbacks += 1
            return None
        feats, toks, c_t, n_t = self.static[b]
        host_toks = torch.zeros(b, self.q, dtype=torch.long)
        _pack_pending(seqs, widths, feats, host_toks)
        toks.copy_(host_toks, non_blocking=True)
        c_t.copy_(torch.tensor(list(base) + [0] * (b - bsz)), non_blocking=True)
        n_t.copy_(torch.tensor(list(widths) + [0] * (b - bsz)), non_blocking=True)
        g, out = self.graphs[(b, t)]
        g.replay()
        self.replays += 1
        return out
