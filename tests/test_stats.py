"""The gate: planted regressions on synthetic samples give the verdicts the rule specifies."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kimi_perf.metrics import get_metric
from kimi_perf.stats import GateConfig, gate, mwu_worse_p, robust_rel_noise

TP = get_metric("output_throughput")  # higher is better
LAT = get_metric("tpot_ms_p50")  # lower is better


def noisy(center, rel, n, seed):
    return list(center * (1 + rel * np.random.default_rng(seed).standard_normal(n)))


def test_identical_samples_pass():
    s = [100.0, 101.0, 99.0, 100.5, 99.5]
    d = gate(TP, s, s, GateConfig(floor=0.05))
    assert d.verdict == "PASS" and d.delta == pytest.approx(0.0)


def test_planted_20pct_regression_fails():
    base = noisy(100, 0.01, 5, 1)
    cur = [v * 0.8 for v in noisy(100, 0.01, 5, 2)]
    d = gate(TP, base, cur, GateConfig(floor=0.05))
    assert d.verdict == "FAIL", d.message()
    msg = d.message()
    for part in ("output_throughput", "higher is better", "baseline", "current", "delta -", "tolerance", "p="):
        assert part in msg


def test_planted_20pct_latency_regression_fails():
    base = noisy(50, 0.01, 5, 3)
    cur = [v * 1.2 for v in noisy(50, 0.01, 5, 4)]
    assert gate(LAT, base, cur, GateConfig(floor=0.05)).verdict == "FAIL"


def test_planted_5pct_regression_below_floor_passes():
    base = noisy(100, 0.005, 5, 5)
    cur = [v * 0.95 for v in noisy(100, 0.005, 5, 6)]
    assert gate(TP, base, cur, GateConfig(floor=0.10)).verdict == "PASS"


def test_planted_5pct_regression_noisy_samples_warns():
    # the median moved 5% (beyond a 3% floor) but the samples overlap: magnitude only -> WARN
    base = [100.0, 92.0, 108.0]
    cur = [95.0, 109.0, 88.0]
    d = gate(TP, base, cur, GateConfig(floor=0.03, noise_mult=0.0))
    assert d.verdict == "WARN", d.message()


def test_planted_5pct_regression_consistent_samples_fails_with_small_floor():
    base = [100.0, 100.2, 99.8, 100.1, 99.9]
    cur = [95.0, 95.1, 94.9, 95.2, 94.8]
    assert gate(TP, base, cur, GateConfig(floor=0.03)).verdict == "FAIL"


def test_noise_widens_tolerance():
    base = noisy(100, 0.10, 7, 7)
    d = gate(TP, base, [v * 0.85 for v in noisy(100, 0.10, 7, 8)], GateConfig(floor=0.05))
    assert d.tolerance >= 3 * robust_rel_noise(base) * 0.99


def test_improvement_passes():
    assert gate(TP, [100, 101, 99], [150, 151, 149], GateConfig()).verdict == "PASS"


def test_missing_baseline_is_new_not_fail():
    d = gate(TP, None, [1.0, 2.0], GateConfig())
    assert d.verdict == "NEW"


def test_single_number_baseline_magnitude_decides():
    d = gate(TP, [100.0], [70.0, 71.0, 69.0], GateConfig(floor=0.1))
    assert d.verdict == "FAIL" and "magnitude alone" in d.reason


def test_no_finite_current_fails():
    assert gate(TP, [1.0, 2.0], [float("nan")], GateConfig()).verdict == "FAIL"


def test_mwu_direction():
    assert mwu_worse_p(TP, [10, 11, 12], [1, 2, 3]) == pytest.approx(0.05)
    assert mwu_worse_p(TP, [1, 2, 3], [10, 11, 12]) > 0.5
    assert mwu_worse_p(LAT, [1, 2, 3], [10, 11, 12]) == pytest.approx(0.05)
    assert mwu_worse_p(TP, [1.0], [2.0, 3.0]) is None


@settings(max_examples=100, deadline=None)
@given(st.lists(st.floats(1, 1e4), min_size=3, max_size=10), st.floats(0.5, 2))
def test_noise_is_scale_invariant(vals, k):
    assert robust_rel_noise([v * k for v in vals]) == pytest.approx(robust_rel_noise(vals), rel=1e-6, abs=1e-12)


def test_gate_config_validation():
    with pytest.raises(ValueError):
        GateConfig(alpha=0)
    with pytest.raises(ValueError):
        GateConfig(floor=-1)
