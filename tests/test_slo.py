"""Open-loop arrivals, goodput under SLOs and the knee (kimi_perf.load.slo, kimi_perf.load.client),
checked against their definitions (vLLM's --request-rate/--burstiness and --goodput)."""

from __future__ import annotations

import math

import numpy as np
import pytest

from kimi_perf.load.client import arrival_gaps
from kimi_perf.load.results import RequestRecord
from kimi_perf.load.slo import SLOSpec, goodput, knee, parse_slo
from kimi_perf.load.workload import Workload


def _rec(ttft: float, e2el: float, ct: int = 11, ok: bool = True) -> RequestRecord:
    return RequestRecord(index=0, prompt_len=8, max_tokens=ct, ok=ok, error=None if ok else "x", t_send=0.0,
                         t_first=ttft if ok else None, t_end=e2el, chunk_times=(), completion_tokens=ct if ok else None)


@pytest.mark.parametrize("burstiness", [0.25, 1.0, 4.0])
def test_arrival_gaps_have_the_rate_and_burstiness_of_vllms_gamma_process(burstiness):
    w = Workload(name="w", num_prompts=20_001, request_rate=5.0, burstiness=burstiness)
    g = np.asarray(arrival_gaps(w))
    assert len(g) == 20_000
    assert g.mean() == pytest.approx(1 / 5.0, rel=0.03)  # mean gap 1/rate whatever the burstiness
    assert g.std() / g.mean() == pytest.approx(1 / math.sqrt(burstiness), rel=0.05)  # CV = 1/sqrt(shape)
    assert arrival_gaps(w) == arrival_gaps(w)  # seeded: both sides of an A/B see the same arrivals
    assert arrival_gaps(Workload(name="w")) is None  # closed loop


def test_burstiness_and_rate_are_validated_and_keep_old_keys():
    with pytest.raises(ValueError, match="burstiness"):
        Workload(name="w", burstiness=0)
    with pytest.raises(ValueError, match="request_rate"):
        Workload(name="w", request_rate=-1)
    assert Workload(name="w").key == "w-18fa23f9"  # the key stored baselines were written with
    assert Workload(name="w", burstiness=2.0).key != Workload(name="w").key


def test_goodput_counts_requests_within_every_objective():
    slo = SLOSpec(ttft_ms=500, tpot_ms=100, rates=(1.0,))
    recs = [_rec(0.2, 1.0),   # TTFT 200, TPOT 80: good
            _rec(0.6, 1.0),   # TTFT 600 > 500
            _rec(0.2, 1.3),   # TPOT 110 > 100
            _rec(0.1, 0.5, ok=False),  # failed: never good
            _rec(0.3, 0.3, ct=1)]  # one token: no TPOT, meets it (vLLM)
    g = goodput(recs, duration_s=4.0, slo=slo)
    assert g == {"request_goodput": 2 / 4.0, "slo_attainment": 2 / 5}
    assert goodput(recs, 4.0, SLOSpec(e2el_ms=1100, rates=(1.0,)))["slo_attainment"] == 3 / 5


def test_knee_is_the_highest_rate_served_with_every_lower_one():
    assert knee({0.5: 1.0, 1: 0.95, 2: 0.6, 4: 0.92}, 0.9) == 1  # 4 passing above a failing 2 is noise
    assert knee({0.5: 0.5, 1: 1.0}, 0.9) == 0.0
    assert knee({0.5: 1.0, 1: float("nan")}, 0.9) == 0.5
    assert knee({1: 0.9, 2: 0.9}, 0.9) == 2


def test_profile_slo_section_is_parsed_once_with_its_defaults_and_errors_name_the_key():
    s = parse_slo({"ttft_ms": 500, "rates": [1, 2]})
    assert (s.min_attainment, s.burstiness, s.num_prompts, s.rates) == (0.9, 1.0, 16, (1.0, 2.0))
    assert s.describe() == "TTFT <= 500 ms"
    w = s.workload(Workload(name="random", input_len=64), 2.0)
    assert (w.request_rate, w.num_prompts, w.concurrency, w.input_len) == (2.0, 16, 64, 64)
    for bad, match in (({"rates": [1]}, "at least one objective"), ({"ttft_ms": 1, "rates": [2, 1]}, "increasing"),
                       ({"ttft_ms": True, "rates": [1]}, "ttft_ms"), ({"ttft_ms": 1, "rates": [1], "x": 1}, "unknown"),
                       ({"ttft_ms": 1, "rates": [1], "min_attainment": 1.5}, "min_attainment"),
                       ({"ttft_ms": 1, "rates": [1], "num_prompts": 2.5}, "num_prompts")):
        with pytest.raises(ValueError, match=match):
            parse_slo(bad)


def test_embedded_profile_slo_key_is_reachable():
    from pathlib import Path

    from kimi_perf.baselines import BaselineKey
    from kimi_perf.keys import scenario_workload, unreachable
    from kimi_perf.profiles import load_profile

    p = load_profile(Path(__file__).resolve().parents[1] / "profiles" / "embedded-cpu.json")
    assert p.throughput is not None and p.throughput.slo is not None
    key = BaselineKey(scenario="slo_knee", engine="reference", model=p.model.name, hardware="cpu-x86_64-2c",
                      workload=scenario_workload(p, "slo_knee"), concurrency=p.throughput.slo.max_concurrency)
    assert unreachable(p, key) is None
    assert "slo.max_concurrency" in (unreachable(p, BaselineKey(**{**key.__dict__, "concurrency": 3})) or "")
