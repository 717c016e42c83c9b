"""Draft-vocabulary maps from assistant-token frequencies (SpecForge's construction).

The drafter predicts over the N most frequent target tokens of the *loss-masked* (assistant) part of
the training data. ``used`` = those ids sorted ascending; ``d2t[i] = used[i] - i`` (int64 offsets, so
``target_id = i + d2t[i]``); ``t2d`` = bool mask over the target vocabulary. If the data has fewer
than N distinct tokens, the rest of the draft vocabulary is filled with the lowest unused ids so the
size is exactly N (engines allocate ``draft_vocab_size`` rows).
"""

from __future__ import annotations

from collections.abc import Iterable

import numpy as np

__all__ = ["build_vocab_maps", "count_tokens"]


def count_tokens(samples: Iterable[tuple[list[int], list[int]]], vocab_size: int) -> np.ndarray:
    """Counts of target ids over assistant positions; ``samples`` yields (ids, loss_mask)."""
    counts = np.zeros(vocab_size, dtype=np.int64)
    for ids, mask in samples:
        a = np.asarray(ids, dtype=np.int64)
        m = np.asarray(mask, dtype=bool)
        np.add.at(counts, a[m], 1)
    return counts


def build_vocab_maps(counts: np.ndarray, draft_vocab_size: int) -> tuple[np.ndarray, np.ndarray]:
    """Return (d2t int64 [N], t2d bool [V])."""
    vocab = counts.shape[0]
    if not 0 < draft_vocab_size <= vocab:
        raise ValueError(f"draft_vocab_size {draft_vocab_size} must be in [1, {vocab}]")
    # stable: ties broken by lower id, so the same data always gives the same map
    order = np.lexsort((np.arange(vocab), -counts))
    seen = order[counts[order] > 0][:draft_vocab_size]
    if seen.size < draft_vocab_size:
        fill = np.setdiff1d(np.arange(vocab), seen, assume_unique=False)[: draft_vocab_size - seen.size]
        seen = np.concatenate([seen, fill])
    used = np.sort(seen)
    d2t = used - np.arange(draft_vocab_size)
    t2d = np.zeros(vocab, dtype=bool)
    t2d[used] = True
    return d2t.astype(np.int64), t2d
