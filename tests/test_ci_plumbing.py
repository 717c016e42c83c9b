"""CI plumbing of the plugin (issue 25 item 5), end to end in scratch projects (pytester):
``--perf-strict`` fails WARN and INCONCLUSIVE; a host repository's own perf/gpu/matrix-marked tests are
left alone; ``-n`` under a cuda profile gives each worker its own GPU or is refused."""

from __future__ import annotations

import json
import os
import stat

import pytest
from test_plugin import project  # noqa: F401 - the scratch-project fixture toy_project builds on

PROFILE = {"name": "toy", "description": "toy profile", "hardware": "cpu",
           "model": {"source": "embedded", "name": "toy-model"}, "engines": {"reference": {"kind": "reference"}},
           "repeats": 2, "gate": {"floor": 0.05}}

GATED = '''
import pytest
from kimi_perf.stats import GateDecision

@pytest.mark.perf
def test_warn(perf_gate):
    # n=2 vs 2 cannot reach significance: a 30% drop is a WARN (magnitude only)
    perf_gate.check(scenario="toy", engine="reference", model="toy-model", workload="w-1", concurrency=1,
                    samples={"output_throughput": [{speed}, {speed} * 1.001]}, gated=["output_throughput"])

@pytest.mark.perf
def test_inconclusive_decided_by_the_test(perf_gate):
    d = GateDecision(metric="spec_speedup", unit="x", direction="higher", verdict="INCONCLUSIVE", baseline=1.0,
                     current=1.02, delta=0.02, worse_by=-0.02, tolerance=None, floor=None, noise=None, p_value=None,
                     n_baseline=1, n_current=3, reason="interval [0.97, 1.08] straddles 1")
    perf_gate.check(scenario="toy_ratio", engine="reference", model="toy-model", workload="w-1", concurrency=1,
                    samples={"spec_speedup": [1.0, 1.02, 1.04]}, gated=[], decided=[d], fail=False)
'''


@pytest.fixture
def toy_project(project):  # noqa: F811 - test_plugin's fixture, imported above
    """test_plugin's scratch project (plugin, ini, profiles/), with this module's two-repeat profile."""
    (project.path / "profiles" / "toy.json").write_text(json.dumps(PROFILE))
    return project


def test_strict_fails_warn_and_inconclusive_that_otherwise_pass(toy_project):
    toy_project.makepyfile(test_toy=GATED.replace("{speed}", "100.0"))
    # recording baselines: nothing fails on a verdict, --perf-strict or not (the decided INCONCLUSIVE stays)
    toy_project.runpytest_subprocess("--perf-profile", "toy", "--perf-update-baselines",
                                     "--perf-strict").assert_outcomes(passed=2)
    toy_project.makepyfile(test_toy=GATED.replace("{speed}", "70.0"))
    r = toy_project.runpytest_subprocess("--perf-profile", "toy")
    r.assert_outcomes(passed=2, warnings=2)
    r.stdout.fnmatch_lines(["*output_throughput*WARN*", "*spec_speedup*INCONCLUSIVE*"])
    r = toy_project.runpytest_subprocess("--perf-profile", "toy", "--perf-strict")
    r.assert_outcomes(failed=2, warnings=2)
    assert r.ret == pytest.ExitCode.TESTS_FAILED
    r.stdout.fnmatch_lines(["*kimi-perf --perf-strict: verdicts that are not a PASS fail this run:*",
                            "*toy [[]reference c=1[]] output_throughput: WARN: beyond tolerance by magnitude only*",
                            "*toy_ratio [[]reference c=1[]] spec_speedup: INCONCLUSIVE: interval [[]0.97, 1.08[]]*"])
    # the run file records the tests as failed, so the summary and history see what CI saw
    run = json.loads((toy_project.path / "perf-report" / "run.json").read_text())
    assert {r["outcome"] for r in run["results"]} == {"failed"}
    # a PASS stays a pass under --perf-strict
    toy_project.makepyfile(test_toy=GATED.replace("{speed}", "100.0").split("@pytest.mark.perf\ndef test_inconclusive")[0])
    toy_project.runpytest_subprocess("--perf-profile", "toy", "--perf-strict").assert_outcomes(passed=1)


HOST_TESTS = '''
import pytest

@pytest.mark.perf
def test_host_perf():
    pass

@pytest.mark.gpu
def test_host_gpu():
    pass

@pytest.mark.matrix
def test_host_matrix():
    pass

@pytest.mark.ab
def test_host_ab():
    pass
'''


def test_a_host_repositorys_own_marked_tests_are_left_alone(pytester, monkeypatch):
    """A repository with its own perf/gpu/matrix/ab markers and kimi-perf installed (the plugin loaded, as
    the pytest11 entry point does): its tests are not the suite's (they use none of its fixtures), so no
    profile is looked for, nothing is skipped or deselected, and -m perf selects the host's tests."""
    monkeypatch.setenv("CI", "true")  # where a suite test would fail on a missing profile
    monkeypatch.setenv("PATH", "/nonexistent")  # no nvidia-smi: no GPU on this machine either way
    pytester.makeconftest('pytest_plugins = ["kimi_perf.plugin"]')
    pytester.makeini("[pytest]\naddopts = --strict-markers -p no:cacheprovider\nmarkers =\n"
                     "    perf: the host's benchmarks\n    gpu: the host's GPU tests\n    matrix: the host's matrix\n"
                     "    ab: the host's A/B tests\n")
    pytester.makepyfile(test_host=HOST_TESTS)
    import sys

    # the interpreter itself (PATH is emptied), the run's -p and ini otherwise as pytester gives them
    r = pytester.run(sys.executable, "-m", "pytest", "-rA")
    r.assert_outcomes(passed=4)
    r = pytester.run(sys.executable, "-m", "pytest", "-m", "perf", "-rA")
    r.assert_outcomes(passed=1, deselected=3)
    assert "kimi-perf summary" not in r.stdout.str() and "profile" not in r.stdout.str()  # no session


def _fake_nvidia_smi(tmp_path, n: int):
    d = tmp_path / "bin"
    d.mkdir()
    exe = d / "nvidia-smi"
    exe.write_text("#!/bin/sh\n" + "".join('echo "NVIDIA H200, 560.35, 143771 MiB"\n' for _ in range(n)))
    exe.chmod(exe.stat().st_mode | stat.S_IEXEC)
    return d


CUDA_TEST = '''
import os
import pytest

@pytest.mark.parametrize("i", range(4))
def test_sees_its_own_gpu(perf_session, i):
    wid = os.environ.get("PYTEST_XDIST_WORKER", "main")
    out = os.path.join(os.environ["GPU_OUT"], f"gpu-{wid}.txt")
    open(out, "w").write(os.environ.get("CUDA_VISIBLE_DEVICES", "unset") + " " + str(len(perf_session.gpus)))
'''


def test_xdist_workers_get_their_own_gpu_or_n_is_refused(toy_project, tmp_path, monkeypatch):
    pytest.importorskip("xdist")
    cuda = {**PROFILE, "name": "gpu-toy", "hardware": "cuda", "min_gpus": 1}
    (toy_project.path / "profiles" / "gpu-toy.json").write_text(json.dumps(cuda))
    monkeypatch.setenv("PATH", f"{_fake_nvidia_smi(tmp_path, 2)}{os.pathsep}{os.environ['PATH']}")
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    toy_project.makepyfile(test_gpu=CUDA_TEST)
    r = toy_project.runpytest_subprocess("--perf-profile", "gpu-toy", "-n", "3")
    assert r.ret == pytest.ExitCode.USAGE_ERROR
    r.stderr.fnmatch_lines(["*-n 3: profile gpu-toy is a cuda profile*so 3 workers need 3 GPUs; this machine has 2 "
                            "visible. Fix: -n 2 or fewer, or run without -n*"])
    monkeypatch.setenv("GPU_OUT", str(tmp_path))
    r = toy_project.runpytest_subprocess("--perf-profile", "gpu-toy", "-n", "2")
    r.assert_outcomes(passed=4)
    r.stdout.fnmatch_lines(["*kimi-perf: -n 2 on cuda profile gpu-toy: worker i gets CUDA_VISIBLE_DEVICES gw0=0, gw1=1*"])
    seen = sorted((tmp_path / f"gpu-gw{i}.txt").read_text() for i in range(2))
    assert seen == ["0 1", "1 1"]  # each worker sees one GPU, its own
    # a CPU profile under -n: allowed, and the header says what it costs
    r = toy_project.runpytest_subprocess("--perf-profile", "toy", "-n", "2")
    r.stdout.fnmatch_lines(["*kimi-perf: -n 2 on CPU profile toy: if perf tests run, each xdist worker launches its own server*"
                            "not comparable to baselines recorded without -n*"])
