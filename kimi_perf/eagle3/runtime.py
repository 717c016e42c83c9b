"""EAGLE-3 drafting inside the reference engine: the drafter's own slot KV cache and chain proposals.

Why a separate runtime from the training module: at serving time the drafter keeps a KV cache per
sequence (its single layer), extends it with the target features of every accepted token, and drafts
k tokens autoregressively on top, batched across all running sequences -- the structure of vLLM's
``EagleProposer``. The math is the training module's (same weights, same RoPE positions); a unit test
checks the two agree.

Per sequence, drafter cache entry p pairs the target feature at position p with the token at p+1
(``Sequence.draft_feats`` / ``draft_tokens`` hold entries not yet cached). Draft steps 2..k write
temporary entries after the committed ones; the next extend overwrites them.
"""

from __future__ import annotations

from collections.abc import Sequence as Seq
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F

from ..engines.reference.model import cached_attention, make_slot_batch, rms_norm, rope_tables
from .model import Eagle3Drafter, _rope_config, load_drafter

__all__ = ["DrafterRuntime"]


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
        c = self.cfg
        h = F.linear(hidden_in, self.fc) if hidden_in.shape[-1] != c.hidden_size else hidden_in
        sb = make_slot_batch(0, cache_lens, q_lens, tokens.shape[1], max_len=self.max_len, cos_table=self.cos,
                             sin_table=self.sin, kpos=self._kpos, device=self.device)
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

    @torch.inference_mode()
    def propose(self, seqs: list[Any], k: int) -> list[list[int]]:
        """Extend each sequence's drafter cache with its pending entries, then draft ``k`` tokens."""
        bsz = len(seqs)
        widths = [len(s.draft_tokens) for s in seqs]
        if min(widths) < 1:
            raise RuntimeError("a running sequence has no pending drafter input (engine bookkeeping bug)")
        m = max(widths)
        feat_dim = seqs[0].draft_feats.shape[-1]
        feats = torch.zeros(bsz, m, feat_dim, device=self.device, dtype=self.k_cache.dtype)
        toks = torch.zeros(bsz, m, dtype=torch.long)
        for i, s in enumerate(seqs):
            feats[i, : widths[i]] = s.draft_feats
            toks[i, : widths[i]] = torch.tensor(s.draft_tokens)
        base = [s.draft_cache_len for s in seqs]
        pre = self.forward(feats, toks.to(self.device), base, widths)
        last = pre[torch.arange(bsz, device=self.device), torch.tensor(widths, device=self.device) - 1]
        cur = self._next(last)
        out = [cur]
        committed = [b + w for b, w in zip(base, widths)]
        for s, cl in zip(seqs, committed):
            s.draft_cache_len = cl
            s.draft_feats = None
            s.draft_tokens = []
        h = last[:, None, :]
        for j in range(1, k):
            pre = self.forward(h, cur[:, None], [cl + j - 1 for cl in committed], [1] * bsz)
            h = pre
            cur = self._next(pre[:, 0])
            out.append(cur)
        # one device->host read for the whole chain: on a GPU every .tolist() is a sync
        return torch.stack(out, dim=1).tolist()
