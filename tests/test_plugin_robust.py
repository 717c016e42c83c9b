"""The plugin under signals and bad options, end to end in a scratch project: SIGTERM/SIGHUP end the
session like SIGINT (servers stopped, run.json and summary kept, exit code naming the signal), numeric
options are bounded, and the directories a run writes are checked before anything runs."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from test_launcher import pid_alive, wait_dead
from test_plugin import PROFILE

FAKE = str(Path(__file__).with_name("fake_server.py"))

CONFTEST = f'''
import sys
from pathlib import Path
import pytest
from kimi_perf.launcher import LaunchSpec, ServerProcess
pytest_plugins = ["kimi_perf.plugin"]

@pytest.fixture(scope="session")
def server(tmp_path_factory):
    spec = LaunchSpec(name="fake", argv_for_port=lambda p: [sys.executable, {FAKE!r}, str(p), "ok"],
                      log_dir=tmp_path_factory.mktemp("logs"), ready_timeout_s=30)
    with ServerProcess(spec) as srv:
        yield srv
'''

TESTS = '''
import os, time
from pathlib import Path
import pytest

@pytest.mark.perf
def test_one(perf_gate, server):
    perf_gate.check(scenario="toy", engine="reference", model="toy-model", workload="w-1", concurrency=1,
                    samples={"output_throughput": [100.0, 100.1, 99.9]}, gated=["output_throughput"])

@pytest.mark.perf
def test_two_hangs(server):
    Path("server.pid").write_text(str(server.pid))
    time.sleep(120)

@pytest.mark.perf
def test_three_must_not_run(server):
    Path("three.ran").touch()
'''


@pytest.fixture
def project(pytester):
    pytester.makeconftest(CONFTEST)
    pytester.makeini("[pytest]\naddopts = --strict-markers -p no:cacheprovider\n")
    (pytester.path / "profiles").mkdir()
    (pytester.path / "profiles" / "toy.json").write_text(json.dumps(PROFILE))
    return pytester


@pytest.mark.parametrize("sig, xdist", [(signal.SIGTERM, False), (signal.SIGHUP, False), (signal.SIGTERM, True)],
                         ids=["SIGTERM", "SIGHUP", "SIGTERM-xdist"])
def test_signal_ends_the_session_like_sigint(project, sig, xdist):
    project.makepyfile(test_sig=TESTS)
    root = str(Path(__file__).resolve().parents[1])
    env = {**os.environ, "PYTHONPATH": root + os.pathsep + os.environ.get("PYTHONPATH", "")}
    # under xdist the signal reaches the controller only (a CI runner may signal just the main process)
    extra = ["-n", "1"] if xdist else []
    proc = subprocess.Popen([sys.executable, "-m", "pytest", "--perf-profile", "toy", "-v", *extra, "test_sig.py"],
                            cwd=project.path, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    pid_file = project.path / "server.pid"
    for _ in range(600):
        if pid_file.exists() and pid_file.read_text():
            break
        if proc.poll() is not None:
            break
        time.sleep(0.1)
    assert pid_file.exists(), proc.communicate()[0]
    server_pid = int(pid_file.read_text())
    proc.send_signal(sig)
    out, _ = proc.communicate(timeout=90)
    assert proc.returncode == 128 + sig, out
    assert not (project.path / "three.ran").exists(), "the session went on to the next test"
    assert wait_dead(server_pid, 20), f"server {server_pid} survived {sig.name}"
    run = json.loads((project.path / "perf-report" / "run.json").read_text())
    assert [r["nodeid"].split("::")[-1] for r in run["results"]] == ["test_one"]
    assert "kimi-perf summary" in out and f"{sig.name} received" in out
    assert not pid_alive(server_pid)


@pytest.mark.parametrize("args, needle", [
    (["--perf-server-timeout=-5"], "--perf-server-timeout"),
    (["--perf-server-timeout=nan"], "--perf-server-timeout"),
    (["--perf-repeats=1000000000"], "--perf-repeats"),
    (["--perf-report-dir=afile"], "--perf-report-dir"),
    (["--perf-report-dir=afile/sub"], "--perf-report-dir"),
    (["--perf-update-baselines", "--perf-baseline-dir=afile"], "--perf-baseline-dir"),
    (["--perf-json=afile/run.json"], "--perf-json"),
])
def test_bad_option_values_are_usage_errors_naming_the_option(project, args, needle):
    project.makepyfile(test_sig=TESTS.replace("time.sleep(120)", "pass"))
    (project.path / "afile").write_text("x")
    r = project.runpytest_subprocess("--perf-profile", "toy", *args)
    assert r.ret == pytest.ExitCode.USAGE_ERROR, r.stdout.str()
    assert needle in r.stderr.str()
    assert not (project.path / "perf-report").exists()


@pytest.mark.skipif(os.geteuid() == 0, reason="root writes into read-only directories")
def test_read_only_baseline_dir_is_refused_up_front(project):
    project.makepyfile(test_sig=TESTS)
    (project.path / "baselines").mkdir(mode=0o555)
    r = project.runpytest_subprocess("--perf-profile", "toy", "--perf-update-baselines")
    assert r.ret == pytest.ExitCode.USAGE_ERROR and "--perf-baseline-dir" in r.stderr.str()


RACE = '''
from pathlib import Path
import pytest
from kimi_perf.baselines import BaselineEntry, BaselineStore, MetricSamples

@pytest.mark.perf
def test_speed(perf_gate):
    # another run records the same key while this one is measuring
    key = perf_gate.key(scenario="toy", engine="reference", model="toy-model", workload="w-1", concurrency=1)
    other = BaselineEntry(key=key, metrics={{"output_throughput": MetricSamples("tok/s", "higher", (50.0,) * 3)}},
                          commit="other", source="the other job")
    BaselineStore(Path("baselines") / "toy.json", "toy").write([other])
    {action}
    perf_gate.check(scenario="toy", engine="reference", model="toy-model", workload="w-1", concurrency=1,
                    samples={{"output_throughput": [100.0, 100.1, 99.9]}}, gated=["output_throughput"])
'''


def test_conflicting_update_is_said_in_the_summary(project):
    project.makepyfile(test_race=RACE.format(action="pass"))
    r = project.runpytest_subprocess("--perf-profile", "toy", "--perf-update-baselines")
    r.assert_outcomes(passed=1)
    r.stdout.fnmatch_lines(["*baselines updated*", "*CONFLICTING UPDATE*output_throughput also updated by another "
                            "run (the other job)*"])


def test_a_failed_baseline_write_keeps_the_summary_and_fails_the_run(project):
    # the file turns into a directory under the run: the write at the end fails with an OSError
    action = 'Path("baselines/toy.json").unlink(); Path("baselines/toy.json").mkdir()'
    project.makepyfile(test_race=RACE.format(action=action))
    r = project.runpytest_subprocess("--perf-profile", "toy", "--perf-update-baselines")
    assert r.ret == pytest.ExitCode.TESTS_FAILED
    r.stdout.fnmatch_lines(["*kimi-perf summary*", "*baselines NOT updated*IsADirectoryError*"])
    assert (project.path / "perf-report" / "run.json").is_file()
