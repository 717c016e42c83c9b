"""The same-run A/B decision: a confidence interval on the candidate/base ratio, decided sequentially.

Why this estimator. Base and candidate are measured in one job, interleaved in blocks (ABBA order,
see :mod:`kimi_perf.ab.runner`). Each pair is two adjacent repeats of the same workload, one per
side, with identical prompts, and its log ratio ``log(candidate / base)`` removes whatever the machine
did on a time scale longer than two repeats (slow drift, a neighbour's load, thermal state). What it
does *not* remove is what both repeats of a block share: the two server launches of that block (the
launch effect: allocator layout, page placement, which core the engine thread lands on) and a stall
that outlasts the block. Pairs of one block are therefore not independent of each other, but blocks
are: each has its own launches (when the profile relaunches) and its own stretch of time.

So the unit of replication is the block, and the interval is a **t interval on block summaries**,
each the median of the block's pair log ratios (with an odd number of pairs per block):

- it counts the launch effect and block-long stalls as the variance they are, where a bootstrap or
  a signed-rank interval over pairs would treat the pairs of a block as independent and come out too
  narrow (a simulation of one launch per side gave 20-30% false fails from exactly that);
- the median, not the mean, of a block's pairs: on the 2-core CPU box a stall halves one repeat now
  and then (pair log ratios of -0.69 among A/A pairs whose median absolute deviation is 0.05), and
  one such pair moves a block mean by 0.69/R. The median ignores one stalled pair in three, two in
  five. Resampling 88 measured A/A pairs of that box into simulated gates (5 pairs a block, up to 6
  blocks, a 10% shift added for detection) gave medians no false fails and 95-97% detection, means
  1-2% false fails and 83-85% detection. Pairs of a block run in ABBA order, so a drift inside the
  block cancels too;
- it is exact for normal block summaries with any number of blocks >= 2, where a bootstrap of 3-8
  blocks is known to under-cover.

A stall that hits several pairs of one block widens the interval (more blocks are measured) rather
than deciding the verdict; repeats measured while the host's steal time was high are redone before
they reach this module (:mod:`kimi_perf.procstat`).

The decision (sequential, after every block once ``min_blocks`` are in):

- PASS when the whole interval is better than ``-threshold`` (no regression as large as the
  threshold is compatible with the data);
- FAIL when the whole interval is worse than ``-threshold``;
- otherwise measure another block, up to the budget; then INCONCLUSIVE, reported with its interval
  as a warning, never as a pass.

Several metrics are decided together (the headline family: single-stream decode tok/s, output tok/s
at the top concurrency, accept length); each gets a ``1 - alpha / m`` interval (Bonferroni), so the
chance that *any* of the m intervals misses its true value is at most ``alpha`` per look. The
thresholds sit away from zero, so an A/A comparison must be off by more than the threshold plus the
interval's half-width to FAIL; the false-fail and detection rates actually reached with the repeated
looks are measured, not assumed (``python -m kimi_perf.power``, ``benchmarks/gate-power.json``).
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Literal

import numpy as np

from ..metrics import MetricDef

__all__ = ["ABDecision", "ABVerdict", "Interval", "block_t_interval", "decide", "log_ratio", "pair_log_ratio"]

ABVerdict = Literal["PASS", "FAIL", "INCONCLUSIVE"]


def log_ratio(base: float, candidate: float) -> float:
    """``log(candidate / base)``; NaN when either side is not a positive finite number."""
    if not (math.isfinite(base) and math.isfinite(candidate)) or base <= 0 or candidate <= 0:
        return float("nan")
    return math.log(candidate / base)


def pair_log_ratio(pair: Mapping[str, Any], metric: str) -> float:
    """:func:`log_ratio` of one recorded pair (``base_<metric>``, ``candidate_<metric>``, as the power
    study stores them); NaN when a side is missing or not a number."""
    sides = [pair.get(f"{s}_{metric}") for s in ("base", "candidate")]
    b, c = (float(v) if isinstance(v, (int, float)) and not isinstance(v, bool) else math.nan for v in sides)
    return log_ratio(b, c)


@dataclass(frozen=True)
class Interval:
    """A two-sided interval on the mean log ratio, and the estimate it is centred on."""

    estimate: float
    lo: float
    hi: float
    level: float
    n_blocks: int
    n_pairs: int

    @property
    def ratio(self) -> float:
        return math.exp(self.estimate)

    @property
    def ratio_lo(self) -> float:
        return math.exp(self.lo)

    @property
    def ratio_hi(self) -> float:
        return math.exp(self.hi)


def block_t_interval(blocks: Sequence[Sequence[float]], level: float) -> Interval | None:
    """t interval over the medians of per-block pair log ratios (non-finite pairs dropped).

    None with fewer than two blocks that hold a finite pair: one block mean has no spread to
    estimate. Identical block summaries give a zero-width interval (a deterministic metric)."""
    from scipy.stats import t as student_t

    summaries = []
    n_pairs = 0
    for b in blocks:
        vals = [v for v in b if math.isfinite(v)]
        if vals:
            summaries.append(float(np.median(vals)))
            n_pairs += len(vals)
    k = len(summaries)
    if k < 2:
        return None
    m = float(np.mean(summaries))
    se = float(np.std(summaries, ddof=1)) / math.sqrt(k)
    q = float(student_t.ppf(0.5 + level / 2, k - 1))
    return Interval(m, m - q * se, m + q * se, level, k, n_pairs)


@dataclass(frozen=True)
class ABDecision:
    """One metric's A/B verdict, with everything a reader needs to check it."""

    metric: str
    unit: str
    direction: str
    probe: str
    verdict: ABVerdict
    base: float  # median of the base side's repeats
    candidate: float  # median of the candidate side's repeats
    ratio: float  # candidate / base, from the interval's estimate (geometric mean of block medians)
    ratio_lo: float
    ratio_hi: float
    level: float
    threshold: float
    n_pairs: int
    n_blocks: int
    reason: str

    @property
    def worse_is(self) -> str:
        return "lower" if self.direction == "higher" else "higher"

    def message(self) -> str:
        arrow = "higher is better" if self.direction == "higher" else "lower is better"
        bound = 1 - self.threshold if self.direction == "higher" else 1 + self.threshold
        return (f"{self.metric} [{self.probe}] ({arrow}, {self.unit}): base {_fmt(self.base)}, candidate "
                f"{_fmt(self.candidate)}, ratio {self.ratio:.3f}, {self.level:.1%} interval "
                f"[{self.ratio_lo:.3f}, {self.ratio_hi:.3f}] vs threshold {bound:.3f} ({self.threshold:.1%} "
                f"{self.worse_is}), {self.n_pairs} pairs in {self.n_blocks} blocks -> {self.verdict}: {self.reason}")


def _fmt(v: float) -> str:
    if not math.isfinite(v):
        return "n/a"
    a = abs(v)
    return f"{v:.1f}" if a >= 100 else (f"{v:.3f}" if a >= 1 else f"{v:.4g}")


def decide(metric: MetricDef, probe: str, blocks: Sequence[Sequence[float]], base: Sequence[float],
           candidate: Sequence[float], *, threshold: float, alpha: float, family: int,
           min_blocks: int, final: bool) -> ABDecision:
    """Decide one metric from its per-block pair log ratios ``log(candidate / base)``.

    ``family``: how many metrics are decided together (Bonferroni). ``final``: the budget is spent,
    so an undecided interval becomes INCONCLUSIVE instead of "measure more"; before that the verdict
    of an undecided metric is INCONCLUSIVE too, but the runner keeps measuring.
    """
    if not 0 < threshold < 1:
        raise ValueError(f"threshold {threshold} must be a fraction in (0, 1)")
    level = 1 - alpha / max(1, family)
    b_med = float(np.median([v for v in base if math.isfinite(v)])) if base else float("nan")
    c_med = float(np.median([v for v in candidate if math.isfinite(v)])) if candidate else float("nan")
    iv = block_t_interval(blocks, level)
    common = dict(metric=metric.name, unit=metric.unit, direction=metric.direction, probe=probe, base=b_med,
                  candidate=c_med, level=level, threshold=threshold)
    if iv is None:
        n = sum(1 for b in blocks for v in b if math.isfinite(v))
        return ABDecision(verdict="INCONCLUSIVE", ratio=float("nan"), ratio_lo=float("nan"), ratio_hi=float("nan"),
                          n_pairs=n, n_blocks=len(blocks),
                          reason="fewer than two blocks with a finite pair: no interval", **common)  # type: ignore[arg-type]
    # in log space: a regression of `threshold` is log(1 - t) for higher-is-better metrics and
    # log(1 + t) (the candidate takes longer) for lower-is-better ones
    if metric.direction == "higher":
        bound = math.log(1 - threshold)
        fail, ok = iv.hi < bound, iv.lo > bound
    else:
        bound = math.log(1 + threshold)
        fail, ok = iv.lo > bound, iv.hi < bound
    early = iv.n_blocks < min_blocks
    if fail and not early:
        verdict, reason = "FAIL", f"the whole interval is worse than the {threshold:.1%} threshold"
    elif ok and not early:
        verdict, reason = "PASS", f"the whole interval is better than the {threshold:.1%} threshold"
    elif final:
        verdict, reason = "INCONCLUSIVE", (f"the interval straddles the {threshold:.1%} threshold after the whole "
                                           "budget: a change near the threshold or too much noise; rerun with a "
                                           "larger ab.max_blocks to decide")
    else:
        verdict, reason = "INCONCLUSIVE", ("fewer blocks than ab.min_blocks" if early
                                           else "interval straddles the threshold: measuring more blocks")
    return ABDecision(verdict=verdict, ratio=iv.ratio, ratio_lo=iv.ratio_lo, ratio_hi=iv.ratio_hi,  # type: ignore[arg-type]
                      n_pairs=iv.n_pairs, n_blocks=iv.n_blocks, reason=reason, **common)  # type: ignore[arg-type]
