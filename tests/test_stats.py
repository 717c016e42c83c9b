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


# -- issue 16 items 5-7 and 9: statistics that must not read stronger than they are -----------------

AL = get_metric("accept_length")
SPEEDUP = get_metric("spec_speedup")


def _brute_p(base, cur, higher=True):
    """P(rank sum of current >= observed) over every split, ties as midranks (independent check)."""
    import itertools

    from scipy.stats import rankdata

    bad = [-v if higher else v for v in [*cur, *base]]
    r = rankdata(bad)
    obs = sum(r[: len(cur)])
    sums = [sum(r[i] for i in c) for c in itertools.combinations(range(len(bad)), len(cur))]
    return sum(s >= obs - 1e-9 for s in sums) / len(sums)


@pytest.mark.parametrize("base,cur", [
    ([100.0] * 5, [90.0] * 3),  # complete separation, ties inside both groups
    ([10.0, 10.0, 11.0], [9.0, 10.0, 10.0]),  # ties across the groups
    ([5.0, 6.0, 6.0, 7.0], [6.0, 5.0, 4.0, 4.0]),
])
def test_rank_test_is_exact_with_ties(base, cur):
    assert mwu_worse_p(TP, base, cur) == pytest.approx(_brute_p(base, cur))


def test_tied_separation_reaches_alpha_exactly():
    # scipy's "exact" MWU refuses ties and its normal approximation gives another number; the
    # permutation distribution of 5 vs 3 has 56 splits and one of them is this extreme
    assert mwu_worse_p(TP, [100.0] * 5, [90.0] * 3) == pytest.approx(1 / 56)
    assert gate(TP, [100.0] * 5, [90.0] * 3, GateConfig(floor=0.05)).verdict == "FAIL"


def test_min_attainable_p():
    from kimi_perf.stats import min_attainable_p

    assert min_attainable_p(3, 3) == pytest.approx(0.05)
    assert min_attainable_p(2, 3) == pytest.approx(0.1)
    assert min_attainable_p(5, 3) == pytest.approx(1 / 56)


def test_sizes_that_cannot_reach_alpha_warn_and_say_so():
    d = gate(TP, [100.0, 100.1], [70.0, 70.2, 69.9], GateConfig(floor=0.1))
    assert d.verdict == "WARN", d.message()
    assert "cannot reach alpha" in d.reason and d.min_p == pytest.approx(0.1)
    # and a pass at those sizes still says that a regression could not have failed
    assert "cannot reach alpha" in gate(TP, [100.0, 100.1], [99.0, 99.5, 100.0], GateConfig()).reason


def test_current_variance_does_not_widen_tolerance():
    base = [100.0, 100.5, 99.5, 100.2, 99.8]
    cur = [60.0, 80.0, 100.0, 120.0, 75.0]  # median -20%, spread ~37%: 3x that was a 111% tolerance
    d = gate(TP, base, cur, GateConfig(floor=0.1))
    assert d.verdict != "PASS", d.message()
    assert d.tolerance == pytest.approx(0.1) and d.noise == pytest.approx(robust_rel_noise(base))
    assert d.current_noise == pytest.approx(robust_rel_noise(cur)) and "spread" in d.reason


def test_dependent_repeats_are_one_sample_and_magnitude_decides():
    base, floor = [1.3119] * 3, GateConfig(floor=0.15)
    d = gate(AL, base, [1.05] * 3, floor, independent=False)
    assert d.verdict == "FAIL" and d.n_current == 1 and d.n_baseline == 1 and d.p_value is None
    assert "n=1" in d.reason and "not independent" in d.reason, d.reason
    ok = gate(AL, base, [1.27] * 3, floor, independent=False)  # a retrain's 1.27: within the 15% floor
    assert ok.verdict == "PASS" and "n=1" in ok.reason


def test_confirm_fails_only_when_both_measurements_fail():
    from kimi_perf.stats import confirm_gate

    base, cfg = [100.0, 100.2, 99.8, 100.1, 99.9], GateConfig(floor=0.1)
    slow, fine = [80.0, 80.2, 79.9], [100.0, 99.9, 100.1]
    both = confirm_gate(TP, base, slow, slow, cfg)
    assert both.verdict == "FAIL" and both.n_current == 6 and "both measurements" in both.reason
    waived = confirm_gate(TP, base, slow, fine, cfg)
    assert waived.verdict == "WARN", waived.message()  # never a plain PASS
    assert "first measurement FAIL" in waived.reason
    once = confirm_gate(TP, base, fine, slow, cfg)  # only the confirming run is slow: one showing
    assert once.verdict != "FAIL" and "confirming measurement FAIL" in once.reason


@pytest.mark.parametrize("spec,plain,verdict", [
    ([11.2, 11.0, 11.4], [10.0, 10.0, 10.0], "PASS"),
    ([11.6, 9.2, 10.9], [10.0, 10.0, 10.0], "INCONCLUSIVE"),  # the CPU CI box: 1.16/0.92/1.09
    ([6.0, 5.0, 6.5], [10.0, 10.0, 10.0], "FAIL"),  # spec decoding 35-50% slower
    ([9.0], [10.0], "INCONCLUSIVE"),  # one pair: no interval
])
def test_speedup_interval_gate(spec, plain, verdict):
    from kimi_perf.stats import ratio_interval_gate

    d = ratio_interval_gate(SPEEDUP, spec, plain, threshold=1.0, level=0.95)
    assert d.verdict == verdict, d.message()
    msg = d.message()
    for part in ("spec_speedup", "higher is better", "threshold 1.000", "interval", "candidate"):
        assert part in msg, msg


def test_every_verdict_carries_a_reason():
    from kimi_perf.stats import confirm_gate, ratio_interval_gate

    ds = [gate(TP, None, [1.0], GateConfig()), gate(TP, [1.0, 1.0, 1.0], [1.0, 1.0, 1.0], GateConfig()),
          gate(TP, [100.0, 92.0, 108.0], [95.0, 109.0, 88.0], GateConfig(floor=0.03, noise_mult=0)),
          confirm_gate(TP, [100.0] * 3, [50.0] * 3, [50.0] * 3, GateConfig()),
          ratio_interval_gate(SPEEDUP, [1.0, 1.1], [1.0, 1.0])]
    assert all(d.reason and d.reason in d.message() for d in ds)


# -- issue 27 item 7: scipy's permutation MWU replaced the hand-written enumeration ------------------
# p-values the hand-written exact test (itertools over every split of the pooled midranks, removed in
# favour of scipy.stats.mannwhitneyu(method=PermutationMethod(n_resamples=inf))) gave on these cases,
# written down as exact fractions of C(n+m, n) before it was removed; TP is higher-is-better
_OLD_EXACT_P = [
    ([100.0, 101.0, 102.0], [90.0, 91.0, 92.0], 1 / 20),  # 3v3 complete separation
    ([10.0, 10.0, 11.0], [9.0, 10.0, 10.0], 3 / 10),  # 3v3 ties across the groups
    ([10.0, 12.0, 14.0], [11.0, 13.0, 15.0], 4 / 5),  # 3v3 interleaved
    ([5.0, 5.0, 5.0], [5.0, 5.0, 4.0], 1 / 2),  # 3v3 all tied but one
    ([100.0] * 3, [90.0] * 5, 1 / 56),  # 3v5 separated, ties inside both
    ([100.0] * 5, [90.0] * 3, 1 / 56),  # 5v3
    ([7.0, 8.0, 8.0], [8.0, 6.0, 7.0, 9.0, 6.0], 11 / 28),  # 3v5 mixed ties
    ([20.0, 21.0, 22.0, 23.0, 24.0], [10.0, 11.0, 12.0, 13.0, 14.0], 1 / 252),  # 5v5 separated
    ([19.6, 19.9, 20.1, 18.8, 19.4], [18.9, 19.2, 19.9, 18.1, 19.0], 31 / 252),  # 5v5 overlapping, one tie
    ([3.0, 3.0, 4.0, 4.0, 5.0], [3.0, 4.0, 4.0, 2.0, 2.0], 1 / 6),  # 5v5 many ties
    ([5.0, 6.0, 6.0, 7.0], [6.0, 5.0, 4.0, 4.0], 1 / 10),  # 4v4 ties
    ([10.0, 11.0, 12.0], [13.0, 14.0, 15.0], 1.0),  # current better: no evidence at all
]


@pytest.mark.parametrize("base,cur,p_old", _OLD_EXACT_P)
def test_scipy_permutation_mwu_matches_the_old_exact_test(base, cur, p_old):
    assert mwu_worse_p(TP, base, cur) == pytest.approx(p_old, rel=1e-12, abs=1e-15)
    assert mwu_worse_p(TP, base, cur) == pytest.approx(_brute_p(base, cur), rel=1e-12)
    # the same samples read as a lower-is-better metric mirror the badness
    assert mwu_worse_p(LAT, [-v for v in base], [-v for v in cur]) == pytest.approx(p_old, rel=1e-12)


def test_large_samples_use_the_normal_approximation_deterministically():
    # 12 vs 12 is 2.7M splits, past the exact limit: the asymptotic p, the same on every call
    base, cur = noisy(100, 0.02, 12, 1), noisy(90, 0.02, 12, 2)
    p1, p2 = mwu_worse_p(TP, base, cur), mwu_worse_p(TP, base, cur)
    assert p1 == p2 and 0 < p1 < 1e-4


def test_a_reported_figure_is_info_in_every_report_and_a_broken_one_fails():
    from kimi_perf.stats import reported

    d = reported(get_metric("accept_length"), [1.33], "reported, not gated: 4 HumanEval prompts")
    assert d.verdict == "INFO" and d.current == 1.33 and d.baseline is None
    assert d.message() == ("accept_length (higher is better, tok/step): current 1.330; "
                           "reported, not gated: 4 HumanEval prompts")
    assert reported(get_metric("accept_length"), [float("nan")], "x").verdict == "FAIL"
