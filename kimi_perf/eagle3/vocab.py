"""Draft-vocabulary maps from assistant-token frequencies (SpecForge's construction).

The drafter predicts over the N most frequent target tokens of the *loss-masked* (assistant) part of
the training data. ``used`` = those ids sorted ascending; ``d2t[i] = used[i] - i`` (int64 offsets, so
``target_id = i + d2t[i]``); ``t2d`` = bool mask over the target vocabulary. If the data has fewer
than N distinct tokens, the rest of the draft vocabulary is filled with the lowest unused ids so the
size is exactly N (engines allocate ``draft_vocab_size`` rows).

Coverage: a target token outside the draft vocabulary can never be drafted, so the share of the
target's *held-out* assistant tokens that a vocabulary built from the training data covers is a ceiling
on every draft position's acceptance. Its in-sample counterpart (coverage of the training tokens) flatters
a small vocabulary on little data; :func:`coverage_table` reports both for several sizes, the recipe
table's vocabulary column (cutting Llama-3.1-8B's draft vocabulary to 25% cost ~0.2 accept length,
vLLM PR #24343). ``python -m kimi_perf.eagle3.vocab SAMPLES.jsonl`` prints it for stored samples.
"""

from __future__ import annotations

from collections.abc import Iterable

import numpy as np

__all__ = ["DEFAULT_SIZES", "build_vocab_maps", "count_tokens", "coverage_table"]

# the sizes the recipe table compares (SpecForge's small-model configs use 16K; EAGLE-3 Llama 32K)
DEFAULT_SIZES = (2048, 8192, 16384, 32768)


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


def coverage_table(train_counts: np.ndarray, heldout_counts: np.ndarray,
                   sizes: Iterable[int] = DEFAULT_SIZES) -> list[dict[str, float | int | None]]:
    """For each draft-vocabulary size (capped at the target vocabulary): the share of training and of
    held-out assistant tokens that the vocabulary built from ``train_counts`` covers; a share is None
    when there are no such tokens."""
    vocab = train_counts.shape[0]
    n_train, n_held = int(train_counts.sum()), int(heldout_counts.sum())
    rows: list[dict[str, float | int | None]] = []
    for size in sorted({min(int(n), vocab) for n in sizes}):
        _, t2d = build_vocab_maps(train_counts, size)
        rows.append({"size": size,
                     "train_coverage": float(train_counts[t2d].sum() / n_train) if n_train else None,
                     "heldout_coverage": float(heldout_counts[t2d].sum() / n_held) if n_held else None,
                     "train_tokens": n_train, "heldout_tokens": n_held})
    return rows


def _pct(x: object) -> str:
    return f"{x:.1%}" if isinstance(x, float) else "-"


def main(argv: list[str] | None = None) -> int:
    import argparse
    from pathlib import Path

    from .data import read_samples

    ap = argparse.ArgumentParser(prog="python -m kimi_perf.eagle3.vocab",
                                 description="Draft-vocabulary coverage of stored samples (train vs held-out).")
    ap.add_argument("samples", type=Path, help="a drafter recipe's samples.jsonl")
    ap.add_argument("--sizes", default=",".join(map(str, DEFAULT_SIZES)), help="draft vocabulary sizes, comma-separated")
    ap.add_argument("--vocab-size", type=int, default=0, help="target vocabulary size (default: largest id + 1)")
    ns = ap.parse_args(argv)
    samples = list(read_samples(ns.samples).values())
    if not samples:
        ap.error(f"{ns.samples}: no samples")
    vocab = ns.vocab_size or 1 + max(max(s.ids) for s in samples)
    train = count_tokens(((s.ids, s.loss_mask) for s in samples if s.split == "train"), vocab)
    held = count_tokens(((s.ids, s.loss_mask) for s in samples if s.split != "train"), vocab)
    print(f"{ns.samples}: {int((train > 0).sum())} distinct training assistant tokens, "
          f"{int(train.sum())} training / {int(held.sum())} held-out assistant tokens\n")
    print("| draft vocab | coverage, training tokens | coverage, held-out tokens |\n|---|---|---|")
    for r in coverage_table(train, held, [int(x) for x in ns.sizes.split(",")]):
        print(f"| {r['size']:,} | {_pct(r['train_coverage'])} | {_pct(r['heldout_coverage'])} |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
