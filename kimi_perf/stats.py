"""The regression gate's statistics.

Why this shape: serving numbers on shared machines are noisy (the 2-core CI box shows +-20% and
occasional 3x stalls), so a fixed percentage threshold either cries wolf or sleeps through real
regressions. The gate takes R repeats per run, compares medians, and FAILS only when the median is
worse than ``max(floor, noise_mult * noise)`` *and* a one-sided rank test on the repeat samples
agrees (p <= alpha). When only the magnitude trips it WARNs. That is the asv / PyTorch dashboard
recipe (asv/statistics.py, docs/metrics.md) reduced to what a per-merge gate can afford.

Each choice below exists because the weaker one let a verdict read stronger than its evidence:

- ``noise`` is the *baseline's* robust relative spread (MAD * 1.4826 / |median|), measured when the
  baseline was recorded. The current run's spread is reported, never used to widen the tolerance: a
  regression that shows up as variance (one slow repeat in three, a bimodal allocator) would
  otherwise widen its own tolerance and pass.
- The rank test is an exact permutation test of the Mann-Whitney statistic with midranks, conditional
  on the observed ties, for every sample size a gate sees (C(n+m, n) <= 200,000 splits): scipy's
  ``mannwhitneyu(method=PermutationMethod(n_resamples=inf))``, which enumerates every split. Its
  ``method="exact"`` assumes no ties and its normal approximation is wrong at n = 3; the permutation
  method is what a hand-written enumeration here did before (tests/test_stats.py pins its p-values).
- A test has a smallest attainable p-value, ``1 / C(n+m, n)`` (3 vs 3: 0.05, only at complete
  separation; 2 vs 3: 0.1). When it exceeds alpha the test cannot reject whatever the data say, so
  the verdict says so -- the warning Google Benchmark's compare.py prints under 9 repetitions --
  instead of presenting "not significant" as evidence of no regression.
- Repeats that are not independent samples (accept length from one deterministic drafter and greedy
  decode: every repeat returns the same number) are one observation, not R. ``independent=False``
  collapses each side to its median, n = 1, and magnitude alone decides against the floor; the
  reason says n = 1 and why.
- :func:`confirm_gate` pools the first and the confirming measurement instead of discarding the
  first, and FAILs only when the regression showed in both; a first FAIL that did not repeat is a
  WARN with that reason, never a plain PASS.
- :func:`ratio_interval_gate` decides a same-run ratio against a fixed bound (EAGLE-3 speedup >= 1.0)
  on a t interval over paired log ratios: PASS above, FAIL wholly below, INCONCLUSIVE (a warning with
  the interval) when it straddles.

Every :class:`GateDecision` carries its reason; the plugin and reports print it next to the verdict.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, replace
from typing import Literal

import numpy as np

from .metrics import MetricDef

# REF: compared with an external reference figure, never gated (reference_comparison)
Verdict = Literal["PASS", "WARN", "FAIL", "INCONCLUSIVE", "NEW", "UPDATED", "INFO", "REF"]

__all__ = ["GateConfig", "GateDecision", "confirm_gate", "gate", "min_attainable_p", "mwu_worse_p",
           "ratio_interval_gate", "reference_comparison", "reported", "robust_rel_noise"]

# The exact test enumerates every split of the pooled samples; 10 vs 10 (184,756 splits) takes ~1.6 s in
# scipy on the 2-core CPU box, 5 vs 5 ~6 ms. Beyond the limit the normal approximation is adequate.
_EXACT_MAX_SPLITS = 200_000


@dataclass(frozen=True)
class GateConfig:
    floor: float = 0.10  # smallest relative change that can ever fail
    noise_mult: float = 3.0
    alpha: float = 0.05  # 3-vs-3 samples: the exact one-sided p-value is at least 1/20 = 0.05

    def __post_init__(self) -> None:
        if not 0 <= self.floor < 10:
            raise ValueError(f"gate floor {self.floor} must be a fraction in [0, 10)")
        if self.noise_mult < 0:
            raise ValueError(f"noise_mult {self.noise_mult} must be >= 0")
        if not 0 < self.alpha <= 1:
            raise ValueError(f"alpha {self.alpha} must be in (0, 1]")


def robust_rel_noise(samples: Sequence[float]) -> float:
    """MAD-based relative spread; 0 for fewer than 3 samples (no estimate possible)."""
    x = np.asarray([s for s in samples if math.isfinite(s)], dtype=float)
    if x.size < 3:
        return 0.0
    med = float(np.median(x))
    if med == 0:
        return 0.0
    mad = float(np.median(np.abs(x - med)))
    return 1.4826 * mad / abs(med)


def min_attainable_p(n_baseline: int, n_current: int) -> float:
    """The smallest one-sided p-value a rank test of these sample sizes can give: ``1 / C(n+m, n)``
    (complete separation, no ties; ties only raise it). 1.0 when either side is empty."""
    if n_baseline < 1 or n_current < 1:
        return 1.0
    return 1.0 / math.comb(n_baseline + n_current, n_current)


def mwu_worse_p(metric: MetricDef, baseline: Sequence[float], current: Sequence[float]) -> float | None:
    """One-sided p-value that ``current`` is stochastically worse than ``baseline``.

    Exact permutation distribution of the Mann-Whitney statistic (midranks, ties kept; scipy's
    ``PermutationMethod`` enumerating every split) up to 200,000 splits, the tie-corrected normal
    approximation beyond. None when either side has fewer
    than 2 samples (no test possible).
    """
    b = [float(v) for v in baseline if math.isfinite(v)]
    c = [float(v) for v in current if math.isfinite(v)]
    if len(b) < 2 or len(c) < 2:
        return None
    if len(set(b) | set(c)) == 1:
        return 1.0  # all identical: no evidence of any difference
    sign = -1.0 if metric.direction == "higher" else 1.0  # badness: larger is worse
    from scipy.stats import PermutationMethod, mannwhitneyu

    exact = math.comb(len(b) + len(c), len(c)) <= _EXACT_MAX_SPLITS
    # n_resamples=inf: every split is enumerated (exact, deterministic); beyond the limit the
    # tie-corrected normal approximation, never a random resample (a gate must give one answer)
    method = PermutationMethod(n_resamples=np.inf) if exact else "asymptotic"
    res = mannwhitneyu([sign * v for v in c], [sign * v for v in b], alternative="greater", method=method)
    p = float(res.pvalue)
    return 1.0 if math.isnan(p) else p


@dataclass(frozen=True)
class GateDecision:
    metric: str
    unit: str
    direction: str
    verdict: Verdict
    baseline: float | None
    current: float
    delta: float | None  # signed relative change of the median vs baseline (current/baseline - 1)
    worse_by: float | None  # relative change in the bad direction (positive = regression)
    tolerance: float | None
    floor: float | None
    noise: float | None  # the baseline's robust relative spread (what the tolerance uses)
    p_value: float | None
    n_baseline: int
    n_current: int
    reason: str
    noise_mult: float = 3.0
    current_noise: float | None = None  # this run's spread: reported, never widens the tolerance
    min_p: float | None = None  # smallest p the test could give at these sample sizes
    # ratio_interval_gate: the interval on current (a ratio) and its confidence level
    interval: tuple[float, float] | None = None
    level: float | None = None

    def message(self) -> str:
        arrow = "higher is better" if self.direction == "higher" else "lower is better"
        if self.verdict == "REF":  # no tolerance: an external figure is compared, not gated
            return (f"{self.metric} ({arrow}, {self.unit}): external reference {_fmt(self.baseline)}, current "
                    f"{_fmt(self.current)}, delta {self.delta * 100:+.1f}% -> REF: {self.reason}")  # type: ignore[operator]
        if self.baseline is None:
            return f"{self.metric} ({arrow}, {self.unit}): current {_fmt(self.current)}; {self.reason}"
        if self.interval is not None:
            lo, hi = self.interval
            return (f"{self.metric} ({arrow}, {self.unit}): candidate {_fmt(self.current)} vs threshold "
                    f"{_fmt(self.baseline)}, {self.level:.0%} interval [{lo:.3f}, {hi:.3f}] "
                    f"[n={self.n_current} pairs] -> {self.verdict}: {self.reason}")
        if self.floor is None and self.noise is None:
            # a same-run comparison with a fixed relative bound (the extraction-path matrix: a cell against
            # the drafter trained on the serving engine's own features): no stored spread, no rank test
            return (f"{self.metric} ({arrow}, {self.unit}): reference {_fmt(self.baseline)}, current "
                    f"{_fmt(self.current)}, delta {self.delta * 100:+.1f}%, tolerance "  # type: ignore[operator]
                    f"{(self.tolerance or 0) * 100:.1f}% [n={self.n_baseline} vs {self.n_current}] -> "
                    f"{self.verdict}: {self.reason}")
        p = "n/a" if self.p_value is None else f"{self.p_value:.3f}"
        return (
            f"{self.metric} ({arrow}, {self.unit}): baseline {_fmt(self.baseline)}, current {_fmt(self.current)}, "
            f"delta {self.delta * 100:+.1f}%, tolerance {self.tolerance * 100:.1f}% "  # type: ignore[operator]
            f"(floor {self.floor * 100:.0f}%, {self.noise_mult:g}x baseline noise {self.noise * 100:.1f}%), "  # type: ignore[operator]
            f"rank-test p={p} [n={self.n_baseline} vs {self.n_current}] -> {self.verdict}: {self.reason}"
        )


def _fmt(v: float | None) -> str:
    if v is None or (isinstance(v, float) and math.isnan(v)):
        return "n/a"
    a = abs(v)
    if a >= 100:
        return f"{v:.1f}"
    if a >= 1:
        return f"{v:.3f}"
    return f"{v:.4g}"


def _finite(vals: Sequence[float] | None) -> list[float]:
    return [float(v) for v in (vals or []) if v is not None and math.isfinite(float(v))]


def gate(metric: MetricDef, baseline: Sequence[float] | None, current: Sequence[float],
         cfg: GateConfig, *, independent: bool = True) -> GateDecision:
    """Decide ``current`` (this run's repeats) against ``baseline`` (the stored repeats).

    ``independent=False``: the repeats are not independent samples (one deterministic decode read R
    times); each side is collapsed to its median, n = 1, and magnitude alone decides against the floor.
    """
    cur = _finite(current)
    if not cur:
        return GateDecision(metric.name, metric.unit, metric.direction, "FAIL", None, float("nan"), None, None,
                            None, cfg.floor, None, None, 0, 0, "no finite measurement (every repeat failed?)")
    cur_med = float(np.median(cur))
    if not independent:
        cur = [cur_med]
    base = _finite(baseline)
    if not base:
        return GateDecision(metric.name, metric.unit, metric.direction, "NEW", None, cur_med, None, None, None,
                            cfg.floor, None, None, 0, len(cur),
                            "no baseline for this key (reported, not gated; --perf-update-baselines records it)",
                            noise_mult=cfg.noise_mult, current_noise=robust_rel_noise(cur))
    base_med = float(np.median(base))
    if not independent:
        base = [base_med]
    # the baseline's spread only: a current run whose regression *is* extra variance must not widen
    # its own tolerance (its spread is reported below instead)
    noise = robust_rel_noise(base)
    cur_noise = robust_rel_noise(cur)
    tol = max(cfg.floor, cfg.noise_mult * noise)
    worse = metric.worse_by(base_med, cur_med)
    delta = (cur_med / base_med - 1.0) if base_med != 0 else (0.0 if cur_med == 0 else float("inf"))
    p = mwu_worse_p(metric, base, cur)
    min_p = min_attainable_p(len(base), len(cur)) if p is not None else None
    underpowered = min_p is not None and min_p > cfg.alpha
    common = dict(metric=metric.name, unit=metric.unit, direction=metric.direction, baseline=base_med,
                  current=cur_med, delta=delta, worse_by=worse, tolerance=tol, floor=cfg.floor, noise=noise,
                  p_value=p, n_baseline=len(base), n_current=len(cur), noise_mult=cfg.noise_mult,
                  current_noise=cur_noise, min_p=min_p)
    notes = []
    if not independent:
        notes.append("n=1: the repeats are one deterministic measurement read again, not independent samples, "
                     "so no test; magnitude alone decides against the floor")
    elif underpowered:
        notes.append(f"n={len(base)} vs {len(cur)} cannot reach alpha {cfg.alpha} (smallest exact p "
                     f"{min_p:.3f}): a regression here can only WARN; record more repeats")
    if cfg.noise_mult * cur_noise > tol and cur_noise > noise:
        notes.append(f"this run's repeats spread {cur_noise * 100:.1f}% (baseline {noise * 100:.1f}%); the "
                     "tolerance uses the baseline's")
    note = "; " + "; ".join(notes) if notes else ""

    if worse <= tol:
        why = "within tolerance" if worse > 0 else ("improved beyond tolerance" if -worse > tol else "no regression")
        return GateDecision(verdict="PASS", reason=why + note, **common)  # type: ignore[arg-type]
    if p is None:
        # A baseline of one number (e.g. a figure recorded from another team's run) or a deterministic
        # metric admits no test: the magnitude alone decides, and the message says so.
        why = "regression beyond tolerance" + (note if not independent else
                                               f"; n={len(base)} vs {len(cur)}: too few samples for a rank "
                                               "test, magnitude alone decides" + note)
        return GateDecision(verdict="FAIL", reason=why, **common)  # type: ignore[arg-type]
    if underpowered:
        return GateDecision(verdict="WARN", reason="beyond tolerance by magnitude only" + note,
                            **common)  # type: ignore[arg-type]
    if p <= cfg.alpha * (1 + 1e-9):  # 1/20 vs 0.05: equal in exact arithmetic
        return GateDecision(verdict="FAIL", reason=f"regression beyond tolerance and significant (p <= {cfg.alpha})"
                            + note, **common)  # type: ignore[arg-type]
    return GateDecision(verdict="WARN", reason=f"beyond tolerance but not significant (p > {cfg.alpha}): "
                        "noisy or too few repeats" + note, **common)  # type: ignore[arg-type]


def confirm_gate(metric: MetricDef, baseline: Sequence[float] | None, first: Sequence[float],
                 again: Sequence[float], cfg: GateConfig, *, independent: bool = True) -> GateDecision:
    """The verdict after a confirming measurement: the pooled samples decide, and a FAIL needs both.

    The pooled decision (first + confirming repeats against the baseline) is the one reported, with
    its larger n. It stays FAIL only if the first and the confirming measurement each FAIL on their
    own, so a regression must show twice; a pooled FAIL seen once, or a first FAIL that did not
    repeat, is a WARN that says so (a waived FAIL is never a plain PASS).
    """
    d1 = gate(metric, baseline, first, cfg, independent=independent)
    d2 = gate(metric, baseline, again, cfg, independent=independent)
    pooled = gate(metric, baseline, [*_finite(first), *_finite(again)], cfg, independent=independent)
    showings = (f"first measurement {d1.verdict} (median {_fmt(d1.current)}), confirming measurement "
                f"{d2.verdict} (median {_fmt(d2.current)}), pooled n={pooled.n_current}")
    if pooled.verdict == "FAIL":
        if d1.verdict == "FAIL" and d2.verdict == "FAIL":
            return replace(pooled, reason=f"{pooled.reason}; the regression showed in both measurements ({showings})")
        return replace(pooled, verdict="WARN", reason=f"{pooled.reason}, but it showed in only one measurement "
                       f"({showings}): one showing does not fail")
    if d1.verdict == "FAIL":
        return replace(pooled, verdict="WARN", reason=f"{pooled.reason}; the first measurement FAILed and the "
                       f"confirming one did not ({showings}): a transient slowdown or a real one at the edge")
    return replace(pooled, reason=f"{pooled.reason} ({showings})")


def ratio_interval_gate(metric: MetricDef, numerator: Sequence[float], denominator: Sequence[float], *,
                        threshold: float = 1.0, level: float = 0.95) -> GateDecision:
    """Gate a same-run ratio (e.g. spec tok/s over plain tok/s) against ``threshold`` with a t interval.

    Pair i is ``numerator[i] / denominator[i]``, two adjacent repeats of the same prompts; the
    interval is a two-sided Student t interval on the mean pair log ratio, exact for normal log
    ratios at any n >= 2. PASS when the whole interval is at or above ``threshold`` (higher-is-better
    metrics; below for lower), FAIL when it lies wholly on the bad side, INCONCLUSIVE when it
    straddles: a warning that names the interval, never a pass. The pairs share the two servers'
    launches, so the interval covers repeat-to-repeat noise of these launches, not launch-to-launch
    variance (the same-run A/B gate, kimi_perf.ab, relaunches per block for that).
    """
    from scipy.stats import t as student_t

    logs = [math.log(a / b) for a, b in zip(numerator, denominator)
            if math.isfinite(a) and math.isfinite(b) and a > 0 and b > 0]
    n = len(logs)
    est = math.exp(float(np.mean(logs))) if logs else float("nan")
    common = dict(metric=metric.name, unit=metric.unit, direction=metric.direction, baseline=threshold,
                  current=est, delta=(est / threshold - 1.0) if logs else None, worse_by=(
                      metric.worse_by(threshold, est) if logs else None), tolerance=0.0, floor=0.0, noise=None,
                  p_value=None, n_baseline=0, n_current=n, noise_mult=0.0, level=level)
    if n < 2:
        return GateDecision(verdict="INCONCLUSIVE", reason=f"{n} finite pair(s): no interval, not gated against "
                            f"{threshold:g}", interval=(float("nan"), float("nan")), **common)  # type: ignore[arg-type]
    m = float(np.mean(logs))
    se = float(np.std(logs, ddof=1)) / math.sqrt(n)
    q = float(student_t.ppf(0.5 + level / 2, n - 1))
    lo, hi = math.exp(m - q * se), math.exp(m + q * se)
    above, below = lo >= threshold, hi < threshold
    if metric.direction == "lower":
        above, below = hi <= threshold, lo > threshold
    span = f"{level:.0%} t interval [{lo:.3f}, {hi:.3f}] over {n} paired repeats"
    if above:
        verdict, why = "PASS", f"the whole {span} is on the good side of {threshold:g}"
    elif below:
        verdict, why = "FAIL", f"the whole {span} is on the bad side of {threshold:g}"
    else:
        verdict, why = "INCONCLUSIVE", (f"the {span} straddles {threshold:g}: not shown either way; more repeats "
                                        "(--perf-repeats) narrow it")
    return GateDecision(verdict=verdict, reason=why, interval=(lo, hi), **common)  # type: ignore[arg-type]


def reference_comparison(metric: MetricDef, reference: Sequence[float], current: Sequence[float], *,
                         source: str, unknown: str) -> GateDecision:
    """Compare ``current`` with an *external reference figure* (``baselines`` provenance kind
    ``external``: typed in from another team's report or an engine's docs) without gating it.

    Kept apart from :func:`gate` on purpose: such a figure is one number on a workload and with a metric
    definition this suite did not control, so no tolerance is meaningful and magnitude alone must not
    fail a run. The verdict is ``REF`` whatever the delta; the reason carries the figure's source and
    what is unknown about it, so the table and run file say what the comparison is worth. A run with no
    finite measurement still FAILs: that is a broken measurement, not a magnitude.
    """
    cur = [float(v) for v in current if v is not None and math.isfinite(float(v))]
    ref = [float(v) for v in reference if math.isfinite(float(v))]
    if not cur:
        return GateDecision(metric.name, metric.unit, metric.direction, "FAIL", None, float("nan"), None, None,
                            None, None, None, None, len(ref), 0, "no finite measurement (every repeat failed?)")
    cur_med, ref_med = float(np.median(cur)), float(np.median(ref))
    delta = (cur_med / ref_med - 1.0) if ref_med != 0 else (0.0 if cur_med == 0 else float("inf"))
    return GateDecision(metric.name, metric.unit, metric.direction, "REF", ref_med, cur_med, delta,
                        metric.worse_by(ref_med, cur_med), None, None, None, None, len(ref), len(cur),
                        f"external reference figure, not gated (source: {source}; unknown: {unknown}); "
                        "a measured --perf-update-baselines run replaces it",
                        current_noise=robust_rel_noise(cur))


def reported(metric: MetricDef, current: Sequence[float], reason: str) -> GateDecision:
    """A measured figure shown in every report with the ``INFO`` verdict, never gated.

    For numbers a test measures and users need beside the gated ones, but whose noise no stored run
    has sized yet (e.g. acceptance on a handful of code prompts next to MT-bench's gated acceptance):
    a stored baseline would gate it with a tolerance nobody measured. ``reason`` says why it is not
    gated and what it is next to. No finite measurement is a FAIL, like any broken measurement."""
    cur = [float(v) for v in current if v is not None and math.isfinite(float(v))]
    if not cur:
        return GateDecision(metric.name, metric.unit, metric.direction, "FAIL", None, float("nan"), None, None,
                            None, None, None, None, 0, 0, "no finite measurement (every repeat failed?)")
    return GateDecision(metric.name, metric.unit, metric.direction, "INFO", None, float(np.median(cur)), None, None,
                        None, None, None, None, 0, len(cur), reason, current_noise=robust_rel_noise(cur))
