"""kimi_perf.eagle3.train.chain_walk: the served greedy chain replayed on teacher-forced held-out hits.

Why it is tested by hand-made hit patterns: the walk is the bridge between the trainer's per-position
top-1 and the accept length an engine reports, and an off-by-one in where a span starts, how far a step
advances or where a chain is cut would shift every predicted accept length without any error.
"""

from __future__ import annotations

from kimi_perf.eagle3.train import chain_walk


def _hits(n: int, true_at: dict[int, set[int]], steps: int = 3) -> list[list[bool]]:
    return [[t in true_at.get(k, set()) for t in range(n)] for k in range(steps)]


def test_a_step_accepts_the_leading_hits_and_moves_past_them_and_the_targets_token():
    # prompt tokens 0-1, response 2-7: the prefill's anchor is 1 (its hidden state, token 2 as input)
    mask = [False, False, True, True, True, True, True, True]
    hits = _hits(8, {0: {1, 5}, 1: {1, 5}, 2: {4}})
    # anchor 1: drafts 3, 4 hit, 5 misses -> 2; the target gives 5, next anchor 4: draft 6 misses -> 0;
    # anchor 5: draft 7 hits, its second draft would be token 8, past the response -> 1; anchor 7: done
    assert chain_walk(hits, mask) == [2, 0, 1]


def test_every_hit_and_no_hit():
    mask = [False] * 3 + [True] * 9  # response 3-11, first anchor 2
    # anchor 2 accepts 4-6 and the target gives 7; anchor 6 accepts 8-10, the target gives 11: the end
    assert chain_walk(_hits(12, {k: set(range(12)) for k in range(3)}), mask) == [3, 3]
    assert chain_walk(_hits(12, {}), mask) == [0] * 8  # one verify step per response token after the first


def test_each_response_span_starts_at_its_own_prefill_anchor():
    mask = [False, True, True, True, False, False, True, True, True]
    every = _hits(9, {k: set(range(9)) for k in range(3)})
    assert chain_walk(every, mask) == [2, 2]
    # a hit at a prompt anchor is never read: the walk does not start inside the prompt
    assert chain_walk(_hits(9, {0: {4}}), mask) == [0, 0, 0, 0]


def test_the_chain_is_cut_at_steps_drafts():
    mask = [False] + [True] * 10
    every = _hits(11, {k: set(range(11)) for k in range(5)}, steps=5)
    assert chain_walk(every, mask, steps=2) == [2, 2, 2]  # 2-3 (+4), 5-6 (+7), 8-9 (+10)
    assert chain_walk(every, mask, steps=5) == [5, 3]  # 2-6 (+7), then 8-10 (cut at the span's end)


def test_easy_runs_are_consumed_in_one_step_so_per_step_rates_sit_below_per_token_top1():
    """The selection effect the walk exists for: half the response tokens easy (every draft of one hits),
    half hard (none does), in runs of 4. Per token, top-1 at draft position 0 is 0.5; per verify step it
    is 0.2: an easy run is accepted in one step, a hard run costs a step per token."""
    n = 2 + 64
    mask = [False, False] + [True] * 64
    easy = {p for p in range(n) if (p // 4) % 2 == 0}
    hits = _hits(n, {k: {t for t in range(n) if t + 2 + k in easy} for k in range(3)})
    per_token = sum(hits[0][t] for t in range(1, n - 2)) / (n - 3)
    walked = chain_walk(hits, mask)
    per_step = sum(a > 0 for a in walked) / len(walked)
    assert 0.45 < per_token < 0.55 and 0.15 < per_step < 0.25, (per_token, per_step)
