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


# -- end to end: the plugin shows an external figure as REF in terminal, summary.md and run.json ------

PROFILE = {"name": "toy", "description": "toy profile", "hardware": "cpu",
           "model": {"source": "embedded", "name": "toy-model"},
           "engines": {"reference": {"kind": "reference"}}, "repeats": 3, "gate": {"floor": 0.05}}

TEST = '''
import pytest

@pytest.mark.perf
def test_speed(perf_gate):
    perf_gate.check(scenario="toy", engine="reference", model="toy-model", workload="w-1", concurrency=1,
                    samples={"output_throughput": [10.0, 10.1, 9.9], "tpot_ms_p50": [5.0, 5.1, 4.9]},
                    gated=["output_throughput", "tpot_ms_p50"], engine_version="1.0")
'''


def test_plugin_reports_an_external_figure_as_REF_and_never_fails_on_it(pytester):
    import json

    pytester.makeconftest('pytest_plugins = ["kimi_perf.plugin"]')
    pytester.makeini("[pytest]\naddopts = --strict-markers -p no:cacheprovider\n")
    (pytester.path / "profiles").mkdir()
    (pytester.path / "profiles" / "toy.json").write_text(json.dumps(PROFILE))
    key = {"scenario": "toy", "engine": "reference", "model": "toy-model", "hardware": "HW", "workload": "w-1",
           "concurrency": 1}
    ext = {"kind": "external", "commit": None, "no_commit_reason": "external reference figure",
           "source": "the seed team's report", "unknown": "workload and metric definition"}
    measured = {"kind": "measured", "commit": "abc123", "source": "measured by t::x"}
    pytester.makepyfile(test_toy=TEST)
    # the hardware key is the machine's: learn it from a first run without baselines
    r = pytester.runpytest_subprocess("--perf-profile", "toy", "--perf-history", "off")
    r.assert_outcomes(passed=1)
    key["hardware"] = json.loads((pytester.path / "perf-report" / "run.json").read_text())["hardware"]
    (pytester.path / "baselines").mkdir()
    (pytester.path / "baselines" / "toy.json").write_text(json.dumps({"schema_version": 2, "profile": "toy", "entries": [{
        "key": key, "commit": None, "no_commit_reason": "external reference figure", "source": "typed in",
        "metrics": {
            # 10 tok/s against an external 2,370: far beyond any tolerance, still not a FAIL
            "output_throughput": {"unit": "tok/s", "direction": "higher", "samples": [2370.0], "provenance": ext},
            "tpot_ms_p50": {"unit": "ms", "direction": "lower", "samples": [5.0, 5.05, 4.95], "provenance": measured},
        }}]}))
    r = pytester.runpytest_subprocess("--perf-profile", "toy", "--perf-history", "off")
    r.assert_outcomes(passed=1)
    r.stdout.fnmatch_lines_random(["*output_throughput*2370.0 (external ref)*REF*", "*tpot_ms_p50*PASS*"])
    md = (pytester.path / "perf-report" / "summary.md").read_text()
    assert "2370.0 (external ref)" in md and "| REF |" in md
    rec = json.loads((pytester.path / "perf-report" / "run.json").read_text())["results"][0]
    ref = next(d for d in rec["decisions"] if d["metric"] == "output_throughput")
    assert ref["verdict"] == "REF" and "the seed team's report" in ref["reason"]
    assert "workload and metric definition" in ref["reason"]
    assert rec["baseline_provenance"]["output_throughput"]["kind"] == "external"
    assert rec["baseline_provenance"]["tpot_ms_p50"]["commit"] == "abc123"
