"""Eagle3Drafter.ttt without host syncs computes what the former implementation computed.

Why: the trainer's TTT step was rewritten so that no step reads a number back to the host (masked
sums instead of boolean indexing, one transfer of the per-step numbers at the end; see the method's
docstring). That must change the speed and nothing else, so this file keeps the implementation as it
was (``_ttt_reference``, copied verbatim from git before the rewrite, with its RoPE helper) and checks
on a tiny float32 drafter that the new one gives the same loss, the same gradient for every parameter,
the same per-step loss / accuracy / count (NaN where a step has no valid position) and the same hits,
on padded batches, a batch whose later steps have no valid position, one that unrolls as many steps
as it has positions, and one with no valid position at all.
"""

from __future__ import annotations

import json
import math
import warnings

import pytest

torch = pytest.importorskip("torch")

import torch.nn.functional as F  # noqa: E402
from test_eagle3_model import tiny  # noqa: E402

from kimi_perf.engines.reference.drafter_model import (  # noqa: E402
    Eagle3Config,
    Eagle3Drafter,
    TTTOutput,
    _rope_config,
)

VD = 16


# ---- the former implementation, frozen (git HEAD b60dcf8 of kimi_perf/engines/reference/drafter_model.py) ----

_REF_ROPE_CACHE: dict = {}


def _ref_rope_cos_sin(c: Eagle3Config, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    from kimi_perf.engines.reference.model import rope_tables

    need = int(positions.max().item()) + 1
    key = (json.dumps(dict(c.rope), sort_keys=True), c.head_dim, str(positions.device))
    cached = _REF_ROPE_CACHE.get(key)
    if cached is None or cached[0].shape[0] < need:
        size = max(need, 4096)
        cached = rope_tables(_rope_config(c), size, positions.device)
        _REF_ROPE_CACHE[key] = cached
    cos, sin = cached
    return cos[positions].to(dtype), sin[positions].to(dtype)


def _ttt_reference(
    self: Eagle3Drafter,
    aux: torch.Tensor,  # [B, T, 3H] target features at each position
    input_ids: torch.Tensor,  # [B, T]
    target_logits: torch.Tensor,  # [B, T, Vd] target's logits at each position, restricted to the draft vocab
    target_valid: torch.Tensor,  # [B, T] bool: position p's target is trainable (assistant token, in vocab)
    steps: int,
    step_weight: float = 0.8,
    keep_hits: bool = False,
) -> TTTOutput:
    """Training-time test: unroll ``steps`` drafting steps and return the weighted soft-CE loss
    (``keep_hits``: also each step's per-anchor hits, for the held-out chain walk)."""
    c = self.cfg
    bsz, t_len, _ = aux.shape
    dev = aux.device
    groups = c.num_attention_heads // c.num_key_value_heads
    scale = 1.0 / math.sqrt(c.head_dim)
    pos0 = torch.arange(t_len, device=dev)[None, :].expand(bsz, t_len)
    causal = torch.ones(t_len, t_len, device=dev, dtype=torch.bool).tril()
    h = self.fc(aux)
    keys: list[torch.Tensor] = []
    vals: list[torch.Tensor] = []
    total = aux.new_zeros(())
    losses, accs, counts, hits = [], [], [], []
    for k in range(steps):
        # anchor t at step k: token x_{t+1+k}, target = distribution at position t+1+k
        shift = 1 + k
        tok = torch.zeros_like(input_ids)
        tok[:, : t_len - shift] = input_ids[:, shift:]
        tgt = torch.zeros_like(target_logits)
        tgt[:, : t_len - shift] = target_logits[:, shift:]
        valid = torch.zeros_like(target_valid)
        valid[:, : t_len - shift] = target_valid[:, shift:]
        e = F.embedding(tok, self.embed).to(h.dtype)
        x = torch.cat([self.midlayer.input_layernorm(e), self.midlayer.hidden_norm(h)], dim=-1)
        cos, sin = _ref_rope_cos_sin(c, pos0 + k, x.dtype)
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
        n = int(valid.sum().item())
        if n:
            logp = torch.log_softmax(logits[valid], dim=-1)
            pt = torch.softmax(tgt[valid].float(), dim=-1)
            loss_k = -(pt * logp).sum(-1).mean()
            acc = (logits[valid].argmax(-1) == tgt[valid].argmax(-1)).float().mean()
            if keep_hits:
                hits.append((logits.argmax(-1) == tgt.argmax(-1)) & valid)
            total = total + (step_weight ** k) * loss_k
            losses.append(float(loss_k.detach()))
            accs.append(float(acc))
        else:
            losses.append(float("nan"))
            accs.append(float("nan"))
            if keep_hits:
                hits.append(torch.zeros_like(valid))
        counts.append(n)
        h = prenorm
    return TTTOutput(loss=total, step_loss=losses, step_acc=accs, step_count=counts, step_hits=tuple(hits))


# ---- the comparison ----


def _drafter(seed: int = 0) -> Eagle3Drafter:
    return tiny(VD, seed=seed).float().train()  # test_eagle3_model's tiny drafter, draft vocabulary VD


def _batch(lengths: list[int], seed: int, valid_at: set[int] | None = None, density: float = 0.6):
    """A right-padded batch as train._collate builds it: zero features, ids and logits past each
    sample's length, ``valid`` only before its last position (random, or at the positions ``valid_at``)."""
    g = torch.Generator().manual_seed(seed)
    b, t = len(lengths), max(lengths)
    aux = torch.zeros(b, t, 3 * 64)
    ids = torch.zeros(b, t, dtype=torch.long)
    logits = torch.zeros(b, t, VD)
    valid = torch.zeros(b, t, dtype=torch.bool)
    for i, n in enumerate(lengths):
        aux[i, :n] = torch.randn(n, 3 * 64, generator=g)
        ids[i, :n] = torch.randint(0, 300, (n,), generator=g)
        logits[i, :n] = 3 * torch.randn(n, VD, generator=g)  # peaked enough for the drafts to agree at times
        if valid_at is None:
            valid[i, : n - 1] = torch.rand(n - 1, generator=g) < density
        else:
            for p in valid_at:
                valid[i, p] = p < n - 1
    return aux, ids, logits, valid


def _agreeing(m: Eagle3Drafter, batch, seed: int):
    """``batch`` with the target's logits raised at the drafter's own step-0 choice on about half of
    the anchors, so that the accuracies and hits compared below are far from 0 (a random drafter
    agrees with random targets 1 time in VD). The drafter's choices are read off the reference
    implementation's hits against one-hot targets, one draft token at a time."""
    aux, ids, logits, valid = batch
    g = torch.Generator().manual_seed(seed)
    chosen = torch.full(ids.shape, -1)
    with torch.no_grad():
        for c in range(VD):
            onehot = torch.full_like(logits, -9.0)
            onehot[..., c] = 9.0
            hit = _ttt_reference(m, aux, ids, onehot, torch.ones_like(valid), 1, keep_hits=True).step_hits[0]
            chosen[hit] = c  # anchor t's draft of position t + 1
    logits = logits.clone()
    pick = (torch.rand(ids.shape, generator=g) < 0.5) & (chosen >= 0)
    for b, t in pick.nonzero().tolist():
        if t + 1 < ids.shape[1]:
            logits[b, t + 1, chosen[b, t]] += 12.0
    return aux, ids, logits, valid


def _run(fn, m: Eagle3Drafter, batch, steps: int, step_weight: float) -> tuple[TTTOutput, dict[str, torch.Tensor]]:
    m.zero_grad(set_to_none=True)
    out = fn(m, *batch, steps, step_weight=step_weight, keep_hits=True)
    if out.loss.requires_grad:
        out.loss.backward()
    return out, {k: p.grad.clone() for k, p in m.named_parameters() if p.grad is not None}


def _same_floats(a: list[float], b: list[float], rel: float) -> bool:
    return len(a) == len(b) and all((math.isnan(x) and math.isnan(y)) or
                                    (not math.isnan(x) and not math.isnan(y) and x == pytest.approx(y, rel=rel, abs=1e-7))
                                    for x, y in zip(a, b))


CASES = {
    # name: (lengths, valid_at, steps, step_weight)
    "padded": ([12, 9, 5], None, 4, 0.8),
    "padded-other-weight": ([7, 11, 11, 3], None, 3, 0.5),
    # targets only at positions 1 and 2: steps 0 and 1 have valid anchors, steps 2.. have none
    "late-steps-invalid": ([8, 6], {1, 2}, 5, 0.8),
    # as many steps as positions: the last step has no anchor with a token at all
    "steps-equal-length": ([4, 4, 3], None, 4, 0.8),
}


@pytest.mark.parametrize("case", sorted(CASES))
def test_sync_free_ttt_equals_the_former_implementation(case):
    lengths, valid_at, steps, w = CASES[case]
    m = _drafter(seed=len(case))
    batch = _agreeing(m, _batch(lengths, seed=len(case) + 1, valid_at=valid_at), seed=len(case))
    want, want_g = _run(_ttt_reference, m, batch, steps, w)
    got, got_g = _run(Eagle3Drafter.ttt, m, batch, steps, w)
    assert want.loss.requires_grad and got.loss.requires_grad
    torch.testing.assert_close(got.loss.detach(), want.loss.detach(), rtol=1e-5, atol=0)
    assert got.step_count == want.step_count
    assert _same_floats(got.step_loss, want.step_loss, 1e-5), (got.step_loss, want.step_loss)
    assert _same_floats(got.step_acc, want.step_acc, 1e-6), (got.step_acc, want.step_acc)
    assert len(got.step_hits) == len(want.step_hits) == steps
    for k, (a, b) in enumerate(zip(got.step_hits, want.step_hits)):
        assert a.dtype == torch.bool and a.shape == b.shape and torch.equal(a, b), k
    assert sorted(got_g) == sorted(want_g) == sorted(k for k, _ in m.named_parameters())
    for k, g in want_g.items():
        scale = float(g.abs().max())
        torch.testing.assert_close(got_g[k], g, rtol=1e-5, atol=1e-6 * max(scale, 1e-12), msg=k)
    if valid_at is not None:  # the case is what it says: some steps have nothing to score
        assert 0 in want.step_count and math.isnan(want.step_loss[-1]) and math.isnan(got.step_acc[-1])
    if valid_at is None:  # accuracy is not trivially 0 everywhere
        assert int(want.step_hits[0].sum()) >= want.step_count[0] // 4


def test_a_batch_with_no_valid_position_scores_nothing():
    """The former implementation returned a loss with no graph (its ``backward`` raised); the new one
    returns a zero loss whose gradients are zero. Every per-step number is NaN / 0 in both."""
    m = _drafter()
    batch = _batch([6, 4], seed=3, valid_at=set())
    want = _ttt_reference(m, *batch, 3, keep_hits=True)
    got = m.ttt(*batch, 3, keep_hits=True)
    assert float(want.loss) == float(got.loss.detach()) == 0.0
    assert got.step_count == want.step_count == [0, 0, 0]
    assert all(math.isnan(x) for x in got.step_loss + got.step_acc)
    assert all(not h.any() for h in got.step_hits)
    got.loss.backward()
    assert all(p.grad is None or not p.grad.any() for p in m.parameters())


def test_no_item_or_boolean_index_inside_the_unroll():
    """On the CPU no op syncs, but the ops that sync on a GPU are visible to the profiler: reading a
    scalar (item / _local_scalar_dense) and boolean indexing (nonzero). The former implementation ran
    several per step; the new one none (its one read-back, a ``tolist``, is no dispatched op)."""
    from torch.profiler import ProfilerActivity, profile

    m = _drafter()
    batch = _batch([12, 9, 5], seed=1)
    banned = {"aten::item", "aten::_local_scalar_dense", "aten::nonzero", "aten::is_nonzero", "aten::masked_select"}

    def syncing_ops(fn) -> int:
        fn(m, *batch, 3, keep_hits=True)  # warm the RoPE table (built once per device)
        with profile(activities=[ProfilerActivity.CPU]) as prof:
            fn(m, *batch, 3, keep_hits=True)
        return sum(e.count for e in prof.key_averages() if e.key in banned)

    assert syncing_ops(_ttt_reference) >= 3 * 3  # the check can see them
    assert syncing_ops(Eagle3Drafter.ttt) == 0


@pytest.mark.gpu
def test_one_host_sync_per_ttt_call_on_cuda():
    """On CUDA, with torch's sync debug mode: the forward of ttt synchronises once (the per-step
    numbers' read-back), however many steps it unrolls; the former one did several times per step."""
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU")
    m = _drafter().cuda()
    batch = tuple(t.cuda() for t in _batch([12, 9, 5], seed=1))

    def syncs(fn, steps: int) -> int:
        fn(m, *batch, steps, keep_hits=True)  # warm the RoPE table (its copy to the GPU syncs once)
        torch.cuda.synchronize()
        with warnings.catch_warnings(record=True) as seen:
            warnings.simplefilter("always")
            torch.cuda.set_sync_debug_mode("warn")
            try:
                fn(m, *batch, steps, keep_hits=True)
            finally:
                torch.cuda.set_sync_debug_mode("default")
        return sum("synchroniz" in str(w.message).lower() for w in seen)

    assert syncs(_ttt_reference, 4) > syncs(_ttt_reference, 1)
    assert syncs(Eagle3Drafter.ttt, 1) == syncs(Eagle3Drafter.ttt, 5) <= 1
