"""The pytest plugin end to end in a scratch project (pytester): options, usage errors, the gate as
an assertion, the summary table, baseline update, and the same path under pytest-xdist."""

from __future__ import annotations

import json

import pytest

PROFILE = {
    "name": "toy", "description": "toy profile", "hardware": "cpu",
    # "embedded" needs nothing at configure time; a "path" model that does not exist would (rightly)
    # make the plugin skip every perf test, see test_missing_model_skips_with_reason
    "model": {"source": "embedded", "name": "toy-model"},
    "engines": {"reference": {"kind": "reference"}}, "repeats": 3,
    "gate": {"floor": 0.05},
}

TEST = '''
import pytest

@pytest.mark.perf
@pytest.mark.parametrize("speed", [{speeds}])
def test_speed(perf_gate, speed):
    perf_gate.check(scenario="toy", engine="reference", model="toy-model", workload="w-1", concurrency=1,
                    samples={{"output_throughput": [speed, speed * 1.001, speed * 0.999]}},
                    gated=["output_throughput"], engine_version="1.0")
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


def test_record_then_gate_then_fail(project):
    project.makepyfile(test_toy=TEST.format(speeds="100.0"))
    r = run(project, "--perf-update-baselines")
    r.assert_outcomes(passed=1)
    r.stdout.fnmatch_lines(["*kimi-perf summary*", "*output_throughput*UPDATED*", "*baselines updated*"])
    data = json.loads((project.path / "baselines" / "toy.json").read_text())
    assert data["entries"][0]["metrics"]["output_throughput"]["samples"] == pytest.approx([100, 100.1, 99.9])
    assert (project.path / "perf-report" / "summary.md").is_file()
    run_file = json.loads((project.path / "perf-report" / "run.json").read_text())
    assert run_file["results"][0]["key"]["engine"] == "reference" and "machine" in run_file

    project.makepyfile(test_toy=TEST.format(speeds="101.0"))
    run(project).assert_outcomes(passed=1)

    project.makepyfile(test_toy=TEST.format(speeds="70.0"))
    r = run(project)
    r.assert_outcomes(failed=1)
    r.stdout.fnmatch_lines([
        "*PerfRegression: performance regression in toy*",
        "*output_throughput (higher is better, tok/s): baseline 100.0, current 70.0*delta -30.0%*tolerance 5.0%*FAIL*",
        "*output_throughput*FAIL*",
    ])


def test_baseline_names_its_commit_and_marks_uncommitted_code(project):
    import shutil
    import subprocess

    if shutil.which("git") is None:
        pytest.skip("git is not installed")
    project.makepyfile(test_toy=TEST.format(speeds="100.0"))
    git = lambda *a: subprocess.run(["git", "-c", "user.name=t", "-c", "user.email=t@t", *a],  # noqa: E731
                                    cwd=project.path, check=True, capture_output=True, text=True).stdout.strip()
    git("init", "-q")
    git("add", "test_toy.py", "profiles")
    git("commit", "-qm", "toy")
    sha = git("rev-parse", "HEAD")
    entry = lambda: json.loads((project.path / "baselines" / "toy.json").read_text())["entries"][0]  # noqa: E731
    run(project, "--perf-update-baselines").assert_outcomes(passed=1)
    assert entry()["commit"] == sha
    project.makepyfile(test_toy=TEST.format(speeds="100.0") + "\n# edited, not committed\n")
    run(project, "--perf-update-baselines").assert_outcomes(passed=1)
    assert entry()["commit"] == sha + "+dirty"


CONFIRM_TEST = '''
import pytest

calls = []

@pytest.mark.perf
def test_speed(perf_gate):
    def again():
        calls.append(1)
        return {{"output_throughput": [{second}, {second}, {second}]}}
    perf_gate.check(scenario="toy", engine="reference", model="toy-model", workload="w-1", concurrency=1,
                    samples={{"output_throughput": [{first}, {first}, {first}]}}, gated=["output_throughput"],
                    confirm=again)
    assert len(calls) == {calls}
'''


def test_a_regression_must_show_twice_to_fail(project):
    """A FAIL triggers one confirming measurement: a transient dip passes, a repeated one fails, and
    a pass never re-measures."""
    project.makepyfile(test_toy=TEST.format(speeds="100.0"))
    run(project, "--perf-update-baselines").assert_outcomes(passed=1)
    project.makepyfile(test_toy=CONFIRM_TEST.format(first=60.0, second=100.0, calls=1))
    r = run(project)
    r.assert_outcomes(passed=1)
    r.stdout.fnmatch_lines(["*output_throughput FAIL on the first measurement*measuring again to confirm*",
                            "*output_throughput*PASS*"])
    run_file = json.loads((project.path / "perf-report" / "run.json").read_text())
    assert run_file["results"][0]["extra"]["first_measurement"]["samples"]["output_throughput"] == [60.0] * 3
    project.makepyfile(test_toy=CONFIRM_TEST.format(first=60.0, second=61.0, calls=1))
    r = run(project)
    r.assert_outcomes(failed=1)
    # the confirming repeats are pooled with the first (n=3 vs 6), and the reason names both showings
    r.stdout.fnmatch_lines(["*PerfRegression: performance regression in toy*",
                            "*current 60.500*n=3 vs 6*showed in both measurements (first measurement FAIL "
                            "(median 60.000), confirming measurement FAIL (median 61.000), pooled n=6)*"])
    project.makepyfile(test_toy=CONFIRM_TEST.format(first=99.0, second=0.0, calls=0))
    run(project).assert_outcomes(passed=1)


def test_same_results_under_xdist(project):
    pytest.importorskip("xdist")
    project.makepyfile(test_toy=TEST.format(speeds="100.0, 50.0"))
    run(project, "--perf-update-baselines").assert_outcomes(passed=2)
    project.makepyfile(test_toy=TEST.format(speeds="100.0, 20.0"))
    r = run(project, "-n", "2")
    r.assert_outcomes(passed=1, failed=1)
    r.stdout.fnmatch_lines(["*kimi-perf summary*", "*PASS*", "*FAIL*"])


def _missing_model_project(project):
    prof = {**PROFILE, "model": {"source": "path", "path": "/nonexistent", "name": "toy-model"}}
    (project.path / "profiles" / "toy.json").write_text(json.dumps(prof))
    # the profile comes from the ini, not named on the command line: only CI=true makes it strict
    project.makeini("[pytest]\naddopts = --strict-markers -p no:cacheprovider\nperf_profile = toy\n")
    project.makepyfile(test_toy=TEST.format(speeds="100.0"))


def test_missing_model_skips_with_reason(project, monkeypatch):
    monkeypatch.delenv("CI", raising=False)
    _missing_model_project(project)
    r = project.runpytest_subprocess("-rs")
    r.assert_outcomes(skipped=1)
    r.stdout.fnmatch_lines(["*profile toy needs model toy-model at /nonexistent (or --perf-model PATH)*"])


@pytest.mark.parametrize("how", ["CI=true", "--perf-profile"])
def test_missing_model_fails_when_the_run_asked_for_it(project, monkeypatch, how):
    """CI, or a user who named the profile, must not come back green with nothing measured."""
    _missing_model_project(project)
    if how == "CI=true":
        monkeypatch.setenv("CI", "true")
        r = project.runpytest_subprocess("-rE")
    else:
        monkeypatch.delenv("CI", raising=False)
        r = project.runpytest_subprocess("-rE", "--perf-profile", "toy")
    r.assert_outcomes(errors=1)  # failed in setup: reported as an error, never as a skip
    assert r.ret != 0
    r.stdout.fnmatch_lines(["*profile toy needs model toy-model at /nonexistent*a failure, not a skip*"])


def test_unknown_profile_is_usage_error(project):
    project.makepyfile(test_toy=TEST.format(speeds="1.0"))
    r = project.runpytest_subprocess("--perf-profile", "nope")
    assert r.ret == pytest.ExitCode.USAGE_ERROR
    r.stderr.fnmatch_lines(["*unknown profile 'nope'; known profiles: toy*"])


def test_unknown_engine_is_usage_error(project):
    project.makepyfile(test_toy=TEST.format(speeds="1.0"))
    r = run(project, "--perf-engine", "tgi")
    assert r.ret == pytest.ExitCode.USAGE_ERROR
    r.stderr.fnmatch_lines(["*has no engine tgi; its engines: reference*"])


def test_malformed_baseline_is_usage_error(project):
    (project.path / "baselines").mkdir()
    (project.path / "baselines" / "toy.json").write_text('{"schema_version": 1, "profile": "toy", "entries": [{}]}')
    project.makepyfile(test_toy=TEST.format(speeds="1.0"))
    r = run(project)
    assert r.ret == pytest.ExitCode.USAGE_ERROR
    r.stderr.fnmatch_lines(["*toy.json: entries[[]0[]].key: missing or not an object*Fix:*"])


def test_unknown_flag_and_marker_are_errors(project):
    project.makepyfile(test_toy="import pytest\n@pytest.mark.perff\ndef test_x():\n    pass\n")
    r = run(project)
    assert r.ret != 0
    r.stdout.fnmatch_lines(["*'perff' not found in `markers`*"])
    r = run(project, "--perf-repeat", "3")
    assert r.ret == pytest.ExitCode.USAGE_ERROR


def test_help_lists_option_group(project):
    r = project.runpytest_subprocess("--help")
    r.stdout.fnmatch_lines(["*kimi-perf: LLM serving performance gates*", "*--perf-profile=NAME*",
                            "*--perf-update-baselines*", "*perf_profile (string)*"])


def test_collect_only_does_not_import_torch(project):
    project.makepyfile(test_toy=TEST.format(speeds="1.0") + "\nimport sys\n\ndef test_no_torch():\n    assert 'torch' not in sys.modules\n")
    r = run(project, "-k", "no_torch")
    r.assert_outcomes(passed=1)


def test_inert_when_no_selected_test_needs_it(project):
    """A broken baseline file (or an unknown profile) cannot block tests that never read it: the plugin
    builds its session only for a selected perf test, so `pytest tests/` runs while
    `pytest -m perf` still stops on the broken file as a usage error."""
    (project.path / "baselines").mkdir()
    (project.path / "baselines" / "toy.json").write_text("{not json")
    project.makepyfile(test_unit="def test_plain():\n    pass\n", test_toy=TEST.format(speeds="1.0"))
    run(project, "test_unit.py").assert_outcomes(passed=1)
    run(project, "-m", "not perf").assert_outcomes(passed=1, deselected=1)
    project.runpytest_subprocess("--perf-profile", "nope", "test_unit.py").assert_outcomes(passed=1)
    assert run(project, "-m", "perf").ret == pytest.ExitCode.USAGE_ERROR


def test_help_quotes_the_defaults_from_one_place(project, monkeypatch):
    from kimi_perf.plugin import _DEFAULT

    monkeypatch.setenv("COLUMNS", "400")
    r = project.runpytest_subprocess("--help")
    r.stdout.fnmatch_lines([f"*--perf-profile=NAME*(ini: perf_profile; default {_DEFAULT['perf_profile']})*",
                            f"*ready (ini: perf_server_timeout; default {_DEFAULT['perf_server_timeout']})*"])


def test_entry_point_registers_once_beside_the_conftest_listing(pytester):
    """Installed, the pytest11 entry point loads the plugin in a project with no conftest; a project
    whose conftest (or -p) also names kimi_perf.plugin gets it once, not a duplicate-name error."""
    from importlib.metadata import distributions

    # every distribution, as pluggy reads them: entry_points() keeps one per name, and a stale
    # kimi_perf.egg-info in the checkout (on sys.path as the cwd) can shadow the installed one
    eps = [e for d in distributions() for e in d.entry_points if e.group == "pytest11"]
    if not [e for e in eps if e.value == "kimi_perf.plugin"]:
        pytest.skip("kimi-perf is not installed (pip install -e .)")
    pytester.makepyfile(test_x="def test_x():\n    pass\n")
    r = pytester.runpytest_subprocess("--help")
    r.stdout.fnmatch_lines(["*kimi-perf: LLM serving performance gates*"])
    pytester.makeconftest('pytest_plugins = ["kimi_perf.plugin"]')
    for args in ([], ["-p", "kimi_perf.plugin"]):
        r = pytester.runpytest_subprocess("--fixtures", *args)  # collects, needs no profile
        assert r.ret == 0, r.stderr.str()
        r.stdout.fnmatch_lines(["*perf_gate*"])


def test_an_option_value_taken_for_the_rootdir_is_refused_with_the_fix(tmp_path):
    """pytest picks its rootdir before the plugin's options exist, so ``--perf-report-dir /elsewhere`` (two
    tokens, an existing directory outside the repository, no test path) rooted the run there with no ini:
    no markers, no baselines. The plugin refuses that run and names the one-token form."""
    import subprocess
    import sys
    from pathlib import Path

    root = Path(__file__).resolve().parents[1]
    out = tmp_path / "reports"
    out.mkdir()
    cmd = [sys.executable, "-m", "pytest", "--collect-only", "-q", "-p", "no:cacheprovider", "-m", "perf"]
    r = subprocess.run([*cmd, "--perf-report-dir", str(out)], cwd=root, capture_output=True, text=True, timeout=120)
    assert r.returncode == 4, r.stdout + r.stderr
    assert f"write --perf-report-dir={out} as one argument" in r.stderr
    ok = subprocess.run([*cmd, f"--perf-report-dir={out}"], cwd=root, capture_output=True, text=True, timeout=120)
    assert ok.returncode == 0, ok.stdout + ok.stderr


def test_one_perf_module_alone_is_parametrized_from_the_profile():
    """``pytest perf_tests/test_eagle3.py`` alone: no earlier module builds the session, so the module's
    own pytest_generate_tests must (kimi_perf.session.session_for_params). Reading the stash instead left
    eagle3_engine unparametrized and the run ended in "fixture 'eagle3_engine' not found" (seen on the H200)."""
    import subprocess
    import sys
    from pathlib import Path

    root = Path(__file__).resolve().parents[1]
    r = subprocess.run([sys.executable, "-m", "pytest", "--collect-only", "-q", "-p", "no:cacheprovider",
                        "perf_tests/test_eagle3.py", "perf_tests/test_engine_alignment.py"],
                       cwd=root, capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stdout + r.stderr
    assert "perf_tests/test_eagle3.py::test_acceptance[reference]" in r.stdout
    assert "perf_tests/test_engine_alignment.py::test_engine_alignment_vs_hf[reference]" in r.stdout
