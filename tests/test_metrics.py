"""Metric formulas: TPOT from server token counts, throughput, percentiles, steady-state window."""

from __future__ import annotations

import math

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kimi_perf.load.results import RequestRecord, compute_metrics, percentile, steady_window
from kimi_perf.metrics import METRICS, get_metric


def rec(i=0, send=0.0, first=0.1, end=1.0, ct=10, chunks=None, ok=True, err=None):
    if chunks is None:
        chunks = tuple(np.linspace(first, end, ct)) if first is not None else ()
    return RequestRecord(index=i, prompt_len=8, max_tokens=ct, ok=ok, error=err, t_send=send, t_first=first,
                         t_end=end, chunk_times=tuple(chunks), completion_tokens=ct)


def test_tpot_uses_server_token_count_not_chunks():
    # a speculative stream: 3 chunks carrying 12 tokens
    r = rec(first=0.2, end=2.4, ct=12, chunks=(0.2, 1.3, 2.4))
    assert r.tpot == pytest.approx((2.4 - 0.2) / 11)
    assert r.inter_chunk == pytest.approx([1.1, 1.1])
    m = compute_metrics([r], 1)
    assert m["tpot_ms_p50"] == pytest.approx(200.0)
    assert m["inter_chunk_ms_p50"] == pytest.approx(1100.0)
    assert m["chunks_per_token"] == pytest.approx(3 / 12)


@settings(max_examples=200, deadline=None)
@given(ttft=st.floats(0.001, 5), per_tok=st.floats(1e-4, 1.0), ct=st.integers(2, 4000),
       chunks=st.integers(1, 50))
def test_tpot_invariant_under_chunking(ttft, per_tok, ct, chunks):
    end = ttft + per_tok * (ct - 1)
    times = tuple(np.linspace(ttft, end, min(chunks, ct)))
    r = rec(first=ttft, end=end, ct=ct, chunks=times)
    assert r.tpot == pytest.approx(per_tok, rel=1e-6)
    assert r.ttft == pytest.approx(ttft)


@settings(max_examples=100, deadline=None)
@given(cts=st.lists(st.integers(1, 500), min_size=1, max_size=30), dur=st.floats(0.5, 100))
def test_output_throughput_is_tokens_over_duration(cts, dur):
    recs = [rec(i=i, send=0, first=0.01, end=dur, ct=c) for i, c in enumerate(cts)]
    m = compute_metrics(recs, 1, duration_s=dur)
    assert m["output_throughput"] == pytest.approx(sum(cts) / dur)
    assert m["request_throughput"] == pytest.approx(len(cts) / dur)


def test_failed_requests_are_counted_and_excluded():
    good = [rec(i=i, ct=10) for i in range(3)]
    bad = [rec(i=9, first=None, end=0.5, ct=None, chunks=(), ok=False, err="HTTP 500: boom")]
    m = compute_metrics(good + bad, 1, duration_s=1.0)
    assert m["num_failed"] == 1 and m["num_completed"] == 3
    assert m["error_rate"] == pytest.approx(0.25)
    assert m["output_throughput"] == pytest.approx(30.0)  # only completed requests' tokens


def test_all_failed_gives_no_throughput():
    m = compute_metrics([rec(ok=False, err="x", ct=None, first=None, chunks=())], 1)
    assert m["error_rate"] == 1.0 and "output_throughput" not in m


@settings(max_examples=200, deadline=None)
@given(st.lists(st.floats(-1e6, 1e6, allow_nan=False), min_size=1, max_size=200), st.floats(0, 100))
def test_percentile_bounds_and_monotonic(vals, q):
    p = percentile(vals, q)
    assert min(vals) - 1e-6 <= p <= max(vals) + 1e-6
    assert percentile(vals, 0) <= percentile(vals, 50) <= percentile(vals, 100)
    assert percentile(vals, 50) == pytest.approx(float(np.median(vals)))


def test_percentile_empty_is_nan():
    assert math.isnan(percentile([], 50))


def test_steady_window_excludes_ramp_and_drain():
    # C=2, 4 requests: closed loop, second wave sent when the first finish
    recs = [rec(0, 0.0, 0.1, 2.0), rec(1, 0.5, 0.6, 3.0), rec(2, 2.0, 2.1, 4.0), rec(3, 3.0, 3.1, 6.0)]
    win = steady_window(recs, 2)
    assert win == (0.5, 4.0)  # from the 2nd send to the first end after the last send
    m = compute_metrics(recs, 2, duration_s=6.0)
    assert 0 < m["steady_output_throughput"] < float("inf")


def test_steady_window_none_when_concurrency_never_reached():
    assert steady_window([rec(0, 0, 0.1, 1.0)], 4) is None


def test_every_metric_has_unit_and_direction():
    for m in METRICS.values():
        assert m.unit and m.direction in ("higher", "lower") and m.description


def test_worse_by_respects_direction():
    assert get_metric("output_throughput").worse_by(100, 80) == pytest.approx(0.2)
    assert get_metric("tpot_ms_p50").worse_by(100, 120) == pytest.approx(0.2)
    assert get_metric("tpot_ms_p50").worse_by(100, 80) == pytest.approx(-0.2)


def test_unknown_metric_names_known_ones():
    with pytest.raises(KeyError, match="did you mean"):
        get_metric("output_thruput")
