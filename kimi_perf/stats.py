"""The regression gate's statistics.

Why this shape: serving numbers on shared machines are noisy (the 2-core CI box shows +-20% and
occasional 3x stalls), so a fixed percentage threshold either cries wolf or sleeps through real
regressions. The gate takes R repeats per run, compares medians, and FAILS only when the median is
worse than ``max(floor, noise_mult * noise)`` *and* a one-sided Mann-Whitney U test on the repeat
samples agrees (p <= alpha). When only the magnitude trips it WARNs. That is the asv / PyTorch
dashboard recipe (asv/statistics.py, docs/metrics.md) reduced to what a per-merge gate can afford.

``noise`` is the larger of the baseline's and the current run's robust relative spread (MAD * 1.4826
/ |median|), so a run on a noisier machine widens its own tolerance instead of failing spuriously.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Literal

import numpy as np

from .metrics import MetricDef

Verdict = Literal["PASS", "WARN", "FAIL", "NEW", "UPDATED", "INFO"]

__all__ = ["GateConfig", "GateDecision", "gate", "mwu_worse_p", "robust_rel_noise"]


@dataclass(frozen=True)
class GateConfig:
    floor: float = 0.10  # smallest relative change that can ever fail
    noise_mult: float = 3.0
    alpha: float = 0.05  # 3-vs-3 samples: the exact one-sided MWU p-value is at least 1/20 = 0.05

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


def mwu_worse_p(metric: MetricDef, baseline: Sequence[float], current: Sequence[float]) -> float | None:
    """One-sided p-value that ``current`` is stochastically worse than ``baseline``.

    None when either side has fewer than 2 samples (no test possible).
    """
    from scipy.stats import mannwhitneyu

    b = [float(v) for v in baseline if math.isfinite(v)]
    c = [float(v) for v in current if math.isfinite(v)]
    if len(b) < 2 or len(c) < 2:
        return None
    if len(set(b) | set(c)) == 1:
        return 1.0  # all identical: no evidence of any difference
    alternative = "less" if metric.direction == "higher" else "greater"
    method = "exact" if len(b) + len(c) <= 16 and len(set(b + c)) == len(b + c) else "auto"
    res = mannwhitneyu(c, b, alternative=alternative, method=method)
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
    noise: float | None
    p_value: float | None
    n_baseline: int
    n_current: int
    reason: str
    noise_mult: float = 3.0

    def message(self) -> str:
        arrow = "higher is better" if self.direction == "higher" else "lower is better"
        if self.baseline is None:
            return f"{self.metric} ({arrow}, {self.unit}): current {_fmt(self.current)}; {self.reason}"
        p = "n/a" if self.p_value is None else f"{self.p_value:.3f}"
        return (
            f"{self.metric} ({arrow}, {self.unit}): baseline {_fmt(self.baseline)}, current {_fmt(self.current)}, "
            f"delta {self.delta * 100:+.1f}%, tolerance {self.tolerance * 100:.1f}% "  # type: ignore[operator]
            f"(floor {self.floor * 100:.0f}%, {self.noise_mult:g}x noise {self.noise * 100:.1f}%), MWU p={p} "  # type: ignore[operator]
            f"[n={self.n_baseline} vs {self.n_current}] -> {self.verdict}: {self.reason}"
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


def gate(metric: MetricDef, baseline: Sequence[float] | None, current: Sequence[float],
         cfg: GateConfig) -> GateDecision:
    cur = [float(v) for v in current if v is not None and math.isfinite(float(v))]
    if not cur:
        return GateDecision(metric.name, metric.unit, metric.direction, "FAIL", None, float("nan"), None, None,
                            None, cfg.floor, None, None, 0, 0, "no finite measurement (every repeat failed?)")
    cur_med = float(np.median(cur))
    if not baseline:
        return GateDecision(metric.name, metric.unit, metric.direction, "NEW", None, cur_med, None, None, None,
                            cfg.floor, robust_rel_noise(cur), None, 0, len(cur),
                            "no baseline for this key (reported, not gated; --perf-update-baselines records it)")
    base = [float(v) for v in baseline if math.isfinite(float(v))]
    base_med = float(np.median(base))
    noise = max(robust_rel_noise(base), robust_rel_noise(cur))
    tol = max(cfg.floor, cfg.noise_mult * noise)
    worse = metric.worse_by(base_med, cur_med)
    delta = (cur_med / base_med - 1.0) if base_med != 0 else (0.0 if cur_med == 0 else float("inf"))
    p = mwu_worse_p(metric, base, cur)
    common = dict(metric=metric.name, unit=metric.unit, direction=metric.direction, baseline=base_med,
                  current=cur_med, delta=delta, worse_by=worse, tolerance=tol, floor=cfg.floor, noise=noise,
                  p_value=p, n_baseline=len(base), n_current=len(cur), noise_mult=cfg.noise_mult)
    if worse <= tol:
        why = "within tolerance" if worse > 0 else ("improved beyond tolerance" if -worse > tol else "no regression")
        return GateDecision(verdict="PASS", reason=why, **common)  # type: ignore[arg-type]
    if p is None:
        # A baseline of one number (e.g. a figure recorded from another team's run) admits no test:
        # the magnitude alone decides, and the message says so.
        return GateDecision(verdict="FAIL", reason="regression beyond tolerance; too few samples for MWU, "
                            "magnitude alone decides", **common)  # type: ignore[arg-type]
    if p <= cfg.alpha:
        return GateDecision(verdict="FAIL", reason=f"regression beyond tolerance and significant (p <= {cfg.alpha})",
                            **common)  # type: ignore[arg-type]
    return GateDecision(verdict="WARN", reason=f"beyond tolerance but not significant (p > {cfg.alpha}): "
                        "noisy or too few repeats", **common)  # type: ignore[arg-type]
