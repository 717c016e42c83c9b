"""The A/B gate end to end, as users run it: ``pytest -m ab --perf-ab BASE`` in a subprocess, real
reference-engine servers (a tiny random-weight Llama, so each run takes about a minute on 2 cores),
the real client, the real decision, the real reports.

- a planted slowdown (``KIMI_PERF_PLANT_SLOWDOWN``, candidate only) must FAIL, with the interval and
  the threshold in the failure message;
- an A/A comparison (``--perf-ab same``) must PASS;
- an unknown base, a ref that does not resolve: usage errors that name the fix, before anything runs.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PROFILE = ROOT / "tests" / "data" / "profiles" / "ab-tiny-cpu.json"


def run_ab(tmp_path: Path, base: str, plant: str | None = None, *extra: str) -> tuple[subprocess.CompletedProcess[str], Path]:
    report = tmp_path / "report"
    env = {k: v for k, v in os.environ.items() if k != "KIMI_PERF_PLANT_SLOWDOWN"}
    if plant is not None:
        env["KIMI_PERF_PLANT_SLOWDOWN"] = plant
    cmd = [sys.executable, "-m", "pytest", "perf_tests/test_ab.py", "-m", "ab", "-p", "no:cacheprovider",
           "--perf-profile", str(PROFILE), "--perf-ab", base, "--perf-report-dir", str(report),
           "--perf-history", str(tmp_path / "history"), "-o", "addopts=--strict-markers -ra", *extra]
    r = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=900)
    return r, report


@pytest.mark.slow
def test_planted_slowdown_fails_and_a_a_passes(tmp_path):
    r, report = run_ab(tmp_path, "same", "0.5")
    out = r.stdout + r.stderr
    assert r.returncode == 1, out[-4000:]
    assert "PerfRegression: performance regression in ab_throughput [reference]" in out, out[-4000:]
    # the failure message carries metric, direction, base, candidate, interval and threshold
    assert "(higher is better, tok/s): base" in out and "interval [" in out and "vs threshold 0.950" in out
    assert "same-run A/B: candidate vs base" in out  # the terminal table
    run = json.loads((report / "run.json").read_text())
    ab = run["results"][0]["ab"]
    assert any(d["verdict"] == "FAIL" for d in ab["decisions"]) and ab["pairs"]
    assert "### Same-run A/B" in (report / "summary.md").read_text() and (report / "ab_ratios.png").is_file()
    hist = (tmp_path / "history" / "ab-tiny-cpu.jsonl").read_text().splitlines()
    assert json.loads(hist[-1])["ab"]["verdicts"]

    r, report = run_ab(tmp_path, "same", None)
    out = r.stdout + r.stderr
    assert r.returncode == 0, out[-4000:]
    decisions = json.loads((report / "run.json").read_text())["results"][0]["ab"]["decisions"]
    # no false FAIL; an INCONCLUSIVE A/A is allowed by the rule but is then a visible warning
    assert decisions and all(d["verdict"] in ("PASS", "INCONCLUSIVE") for d in decisions), decisions
    if any(d["verdict"] == "INCONCLUSIVE" for d in decisions):
        assert "PerfWarning" in out


def test_bad_bases_are_usage_errors(tmp_path):
    r, _ = run_ab(tmp_path, "no-such-variant")
    assert r.returncode == 4 and "not a variant of this profile; choose one of: same, git:REF" in r.stderr, r.stderr
    r, _ = run_ab(tmp_path, "git:no-such-ref-anywhere")
    assert r.returncode == 4 and "does not name a commit" in r.stderr, r.stderr


def test_ab_tests_are_deselected_without_perf_ab():
    r = subprocess.run([sys.executable, "-m", "pytest", "perf_tests/test_ab.py", "--collect-only", "-q",
                        "-p", "no:cacheprovider"], cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert "deselected" in r.stdout and "no tests collected" in r.stdout, r.stdout


def test_selecting_the_ab_tests_without_a_base_is_a_usage_error():
    r = subprocess.run([sys.executable, "-m", "pytest", "perf_tests/test_ab.py", "-m", "ab", "--collect-only", "-q",
                        "-p", "no:cacheprovider"], cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert r.returncode == 4 and "add --perf-ab BASE" in r.stderr, (r.stdout, r.stderr)
