"""Issue 16 items 5-7 and 9 end to end through the plugin (pytester): every verdict carries its reason
into the terminal summary, summary.md and run.json; the confirm step pools and FAILs only on two
showings (a FAIL that did not repeat is a WARN, never a plain PASS); n=1 dependent repeats and a test's
own interval decision (INCONCLUSIVE warns, FAIL raises) are reported like any other verdict."""

from __future__ import annotations

import json

import pytest

PROFILE = {
    "name": "toy", "description": "toy profile", "hardware": "cpu",
    "model": {"source": "embedded", "name": "toy-model"},
    "engines": {"reference": {"kind": "reference"}}, "repeats": 3,
    "gate": {"floor": 0.05, "floors": {"accept_length": 0.15}},
}

RECORD = '''
import pytest

@pytest.mark.perf
def test_speed(perf_gate):
    perf_gate.check(scenario="toy", engine="reference", model="toy-model", workload="w-1", concurrency=1,
                    samples={"output_throughput": [100.0, 100.1, 99.9], "accept_length": [1.31]},
                    gated=["output_throughput", "accept_length"], dependent=["accept_length"])
'''

CONFIRM = '''
import pytest

@pytest.mark.perf
def test_speed(perf_gate):
    perf_gate.check(scenario="toy", engine="reference", model="toy-model", workload="w-1", concurrency=1,
                    samples={{"output_throughput": [{first}] * 3, "accept_length": [1.31]}},
                    gated=["output_throughput", "accept_length"], dependent=["accept_length"],
                    confirm=lambda: {{"output_throughput": [{second}] * 3, "accept_length": [1.31]}})
'''

DECIDED = '''
import pytest
from kimi_perf.metrics import get_metric
from kimi_perf.stats import ratio_interval_gate

@pytest.mark.perf
def test_speedup(perf_gate):
    d = ratio_interval_gate(get_metric("spec_speedup"), {spec}, [10.0, 10.0, 10.0], threshold=1.0)
    perf_gate.check(scenario="toy-speedup", engine="reference", model="toy-model", workload="w-1",
                    concurrency=1, samples={{}}, gated=[], decided=[d])
'''


@pytest.fixture
def project(pytester):
    pytester.makeconftest('pytest_plugins = ["kimi_perf.plugin"]')
    pytester.makeini("[pytest]\naddopts = --strict-markers -p no:cacheprovider\n")
    (pytester.path / "profiles").mkdir()
    (pytester.path / "profiles" / "toy.json").write_text(json.dumps(PROFILE))
    return pytester


def run(project, *args):
    return project.runpytest_subprocess("--perf-profile", "toy", *args)


def _decisions(project):
    run_file = json.loads((project.path / "perf-report" / "run.json").read_text())
    return {d["metric"]: d for rec in run_file["results"] for d in rec["decisions"]}, run_file


def test_waived_fail_is_a_warn_with_its_reason_everywhere(project):
    project.makepyfile(test_toy=RECORD)
    run(project, "--perf-update-baselines").assert_outcomes(passed=1)
    project.makepyfile(test_toy=CONFIRM.format(first=60.0, second=100.0))
    r = run(project)
    r.assert_outcomes(passed=1, warnings=1)
    r.stdout.fnmatch_lines(["*output_throughput*WARN*the first measurement FAILed and the confirming one did not*",
                            "*accept_length*PASS*n=1*not independent*"])
    dec, run_file = _decisions(project)
    assert dec["output_throughput"]["verdict"] == "WARN" and "first measurement FAIL" in dec["output_throughput"]["reason"]
    assert dec["accept_length"]["n_current"] == 1 and "n=1" in dec["accept_length"]["reason"]
    # pooled: the recorded samples are the ones the reported decision used, the first kept apart
    assert run_file["results"][0]["samples"]["output_throughput"] == [60.0] * 3 + [100.0] * 3
    assert run_file["results"][0]["extra"]["first_measurement"]["samples"]["output_throughput"] == [60.0] * 3
    md = (project.path / "perf-report" / "summary.md").read_text()
    assert "| reason |" in md and "**WARN**" in md and "the confirming one did not" in md


def test_regression_in_both_measurements_fails_with_both_medians(project):
    project.makepyfile(test_toy=RECORD)
    run(project, "--perf-update-baselines").assert_outcomes(passed=1)
    project.makepyfile(test_toy=CONFIRM.format(first=60.0, second=61.0))
    r = run(project)
    r.assert_outcomes(failed=1)
    r.stdout.fnmatch_lines(["*PerfRegression: performance regression*",
                            "*output_throughput (higher is better, tok/s): baseline 100.0, current 60.500*tolerance 5.0%*"
                            "n=3 vs 6? -> FAIL*both measurements*median 60.000*median 61.000*"])


def test_a_single_showing_in_the_confirming_run_does_not_fail(project):
    # accept_length fails the first look (n=1, by magnitude) so the confirm runs; throughput is only
    # slow in the confirming measurement: one showing
    project.makepyfile(test_toy=RECORD)
    run(project, "--perf-update-baselines").assert_outcomes(passed=1)
    project.makepyfile(test_toy=CONFIRM.format(first=100.0, second=60.0).replace("[1.31]", "[1.0]"))
    r = run(project)
    r.assert_outcomes(failed=1)  # accept_length 1.0 vs 1.31 in both measurements
    dec, _ = _decisions(project)
    assert dec["accept_length"]["verdict"] == "FAIL"
    assert dec["output_throughput"]["verdict"] != "FAIL", dec["output_throughput"]["reason"]
    assert "confirming measurement FAIL" in dec["output_throughput"]["reason"]


@pytest.mark.parametrize("spec,outcome,verdict", [
    ("[11.6, 9.2, 10.9]", {"passed": 1, "warnings": 1}, "INCONCLUSIVE"),
    ("[6.0, 5.0, 6.5]", {"failed": 1}, "FAIL"),
    ("[11.2, 11.0, 11.4]", {"passed": 1}, "PASS"),
])
def test_a_tests_own_interval_decision_is_reported(project, spec, outcome, verdict):
    project.makepyfile(test_toy=DECIDED.format(spec=spec))
    r = run(project)
    r.assert_outcomes(**outcome)
    r.stdout.fnmatch_lines([f"*spec_speedup*{verdict}*95% t interval*1*"])
    dec, _ = _decisions(project)
    assert dec["spec_speedup"]["verdict"] == verdict and dec["spec_speedup"]["interval"]


DRAFTER = '''
import pytest

@pytest.mark.perf
def test_acceptance(perf_gate):
    with_ = {with_!r}
    perf_gate.check(scenario="toy-eagle3", engine="reference", model="toy-model", workload="w-1", concurrency=1,
                    samples={{"accept_length": [{accept}]}}, gated=["accept_length"], dependent=["accept_length"],
                    measured_with=with_)
'''


def test_a_baseline_of_another_drafter_is_not_compared(project):
    """A drafter's acceptance is no baseline for another drafter's: a drop from 1.8 to 1.3 FAILs against
    the same drafter's baseline and is NEW, with both names, against another's (in both directions: a
    stronger drafter once read "+36%, PASS" against a weaker one's baseline)."""
    project.makepyfile(test_toy=DRAFTER.format(with_={"drafter": "recipe a"}, accept=1.8))
    run(project, "--perf-update-baselines").assert_outcomes(passed=1)
    stored = json.loads(next((project.path / "baselines").glob("*.json")).read_text())
    assert stored["entries"][0]["extra"]["measured_with"] == {"drafter": "recipe a"}

    project.makepyfile(test_toy=DRAFTER.format(with_={"drafter": "recipe a"}, accept=1.3))
    run(project).assert_outcomes(failed=1)

    project.makepyfile(test_toy=DRAFTER.format(with_={"drafter": "recipe b"}, accept=1.3))
    r = run(project)
    r.assert_outcomes(passed=1)
    dec, run_file = _decisions(project)
    d = dec["accept_length"]
    assert d["verdict"] == "NEW" and d["baseline"] is None
    assert "measured with drafter 'recipe a', this run with 'recipe b': not compared" in d["reason"]
    assert run_file["results"][0]["baseline_engine_version"] is None


def test_a_baseline_that_names_no_drafter_is_compared_and_says_so(project):
    project.makepyfile(test_toy=DRAFTER.format(with_=None, accept=1.8))
    run(project, "--perf-update-baselines").assert_outcomes(passed=1)
    project.makepyfile(test_toy=DRAFTER.format(with_={"drafter": "recipe b"}, accept=1.3))
    run(project).assert_outcomes(failed=1)
    dec, _ = _decisions(project)
    assert dec["accept_length"]["verdict"] == "FAIL"
    assert "the baseline names no drafter it was measured with" in dec["accept_length"]["reason"]
