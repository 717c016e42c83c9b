"""External reference figures (issue 16 item 2): compared and shown, never FAIL on magnitude alone."""

from __future__ import annotations

import math

from kimi_perf.metrics import METRICS
from kimi_perf.stats import reference_comparison


def test_a_far_worse_run_is_REF_not_FAIL():
    d = reference_comparison(METRICS["decode_tok_s"], [63.6], [10.0, 11.0, 12.0], source="seed team report",
                             unknown="workload; output or decode tok/s")
    assert d.verdict == "REF" and d.baseline == 63.6 and d.current == 11.0
    assert math.isclose(d.delta, 11.0 / 63.6 - 1) and d.worse_by > 0.8
    assert "seed team report" in d.reason and "output or decode tok/s" in d.reason
    msg = d.message()
    assert "external reference 63.6" in msg and "REF" in msg and "seed team report" in msg


def test_a_broken_measurement_still_fails():
    d = reference_comparison(METRICS["decode_tok_s"], [63.6], [float("nan")], source="s", unknown="u")
    assert d.verdict == "FAIL" and "no finite measurement" in d.reason
