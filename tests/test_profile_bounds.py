"""Profile bounds: every number a profile gives is bounded and typed (a bool is not an integer), and a
Hypothesis fuzz over the shipped profile's numeric fields finds no value that loads but is out of
range -- a profile either loads into values a run can use or is a ProfileError naming the key."""

from __future__ import annotations

import copy
import json
import math
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kimi_perf.profiles import MAX_CONCURRENCY, ProfileError, load_profile

ROOT = Path(__file__).resolve().parents[1]
BASE = json.loads((ROOT / "profiles" / "embedded-cpu.json").read_text())

# (path into the profile, hostile value) cases of issue 26 and their kin
CASES = [
    (("throughput", "concurrency"), [True, 8]),
    (("throughput", "concurrency"), [10**6]),
    (("repeats",), 10**9),
    (("repeats",), True),
    (("throughput", "workload", "input_len"), 12.5),
    (("throughput", "workload", "ignore_eos"), "no"),
    (("throughput", "workload", "request_timeout_s"), -1),
    (("throughput", "workload", "temperature"), math.nan),
    (("throughput", "workload", "num_prompts"), True),
    (("throughput", "single_stream", "output_len"), 0.5),
    (("throughput", "prompts_per_concurrency"), 10**8),
    (("gate", "noise_mult"), math.inf),
    (("min_gpus",), False),
]


def write(tmp_path: Path, d: dict) -> Path:
    p = tmp_path / "embedded-cpu.json"
    p.write_text(json.dumps(d))  # json.dumps writes NaN/Infinity, which json.loads reads back
    return p


def put(d: dict, keys: tuple[str, ...], value) -> dict:
    d = copy.deepcopy(d)
    cur = d
    for k in keys[:-1]:
        cur = cur.setdefault(k, {})
    cur[keys[-1]] = value
    return d


@pytest.mark.parametrize("keys, value", CASES, ids=lambda x: ".".join(x) if isinstance(x, tuple) else repr(x))
def test_out_of_range_or_mistyped_number_is_a_profile_error_naming_the_key(tmp_path, keys, value):
    with pytest.raises(ProfileError) as ei:
        load_profile(write(tmp_path, put(BASE, keys, value)))
    assert keys[-1] in str(ei.value) and "Fix:" in str(ei.value)


def usable(prof) -> None:
    """What a run assumes of a loaded profile."""
    assert type(prof.repeats) is int and 1 <= prof.repeats <= 100
    assert type(prof.min_gpus) is int and 0 <= prof.min_gpus <= 64
    tp = prof.throughput
    assert all(type(c) is int and 1 <= c <= MAX_CONCURRENCY for c in tp.concurrency)
    assert type(tp.prompts_per_concurrency) is int and tp.prompts_per_concurrency >= 1
    for w in (tp.workload, tp.single_stream):
        for f in ("input_len", "output_len", "num_prompts", "concurrency", "warmup", "seed"):
            assert type(getattr(w, f)) is int, f
        assert type(w.ignore_eos) is bool
        assert math.isfinite(w.temperature) and w.temperature >= 0
        assert math.isfinite(w.request_timeout_s) and w.request_timeout_s > 0
    for v in (prof.gate.default.floor, prof.gate.default.noise_mult, prof.gate.default.alpha):
        assert math.isfinite(v)


NUMERIC = [("repeats",), ("min_gpus",), ("throughput", "prompts_per_concurrency"),
           *[("throughput", sec, f) for sec in ("workload", "single_stream")
             for f in ("input_len", "output_len", "num_prompts", "warmup", "seed", "ignore_eos", "temperature",
                       "request_timeout_s")],
           ("gate", "floor"), ("gate", "noise_mult"), ("gate", "alpha")]
hostile = (st.booleans() | st.integers(-5, 10**12) | st.integers(-(2**70), 2**70)
           | st.floats(allow_nan=True, allow_infinity=True) | st.text(max_size=4) | st.none())


@given(st.lists(st.tuples(st.sampled_from(NUMERIC), hostile), min_size=1, max_size=3),
       st.lists(hostile | st.integers(1, 64), min_size=0, max_size=3))
@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
def test_fuzzed_profile_loads_usable_or_is_a_profile_error(tmp_path, edits, conc):
    d = BASE
    for keys, value in edits:
        d = put(d, keys, value)
    if conc:
        d = put(d, ("throughput", "concurrency"), conc)
    try:
        prof = load_profile(write(tmp_path, d))
    except ProfileError as e:
        assert "embedded-cpu.json" in str(e)
        return
    usable(prof)
