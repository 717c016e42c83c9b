"""Faults the suite must survive and report: broken streams, a server killed mid-benchmark, and garbage
in the parsers and loaders. Nothing here may pass silently: every failure is counted with its cause,
and every crash names the exit code and the log file.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import sys
import threading
import time
from dataclasses import dataclass
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kimi_perf.bench import BenchFailure, RunningServer, measure
from kimi_perf.launcher import LaunchSpec, ServerProcess
from kimi_perf.load.client import run_workload
from kimi_perf.load.workload import Workload

FAKE = str(Path(__file__).with_name("fake_server.py"))


@pytest.fixture(scope="module")
def faulty(tmp_path_factory):
    spec = LaunchSpec(name="faulty", argv_for_port=lambda p: [sys.executable, FAKE, str(p), "faults"],
                      ready_timeout_s=20, log_dir=tmp_path_factory.mktemp("logs"))
    with ServerProcess(spec) as srv:
        yield srv


def test_stream_faults_are_counted_with_their_causes(faulty):
    w = Workload(name="faults", input_len=1, output_len=8, num_prompts=6, concurrency=6, warmup=0,
                 request_timeout_s=3)
    res = run_workload(faulty.base_url, "m", [[1], [2], [3], [4], [5], [6]], w)
    errors = {r.index: r.error for r in res.records}
    assert errors[0] is None and res.records[0].ok
    assert "truncated" in errors[1] or "without [DONE]" in errors[1]
    assert errors[2].startswith("HTTP 500") and "simulated engine crash" in errors[2]
    assert "connection error" in errors[3] or "truncated" in errors[3]
    assert errors[4] == "timeout after 3s (client-side)"
    assert "no usage in stream" in errors[5]
    m = res.metrics
    # metrics come from the one completed request only, and say how many failed
    assert m["num_failed"] == 5 and m["num_requests"] == 6 and m["error_rate"] == pytest.approx(5 / 6)
    assert m["output_throughput"] > 0


def test_error_rate_above_threshold_fails_with_causes(faulty):
    srv = RunningServer(name="faulty", kind="fake", base_url=faulty.base_url, model="m", process=faulty, config=None)
    w = Workload(name="faults", input_len=1, output_len=8, num_prompts=4, concurrency=2, warmup=0,
                 request_timeout_s=5)
    prompts = [[1], [3], [1], [3]]
    with pytest.raises(BenchFailure) as ei:
        measure(srv, w, lambda wl, i: prompts, 1, max_error_rate=0.25)
    msg = str(ei.value)
    assert "2/4 requests failed (error rate 50.0% > allowed 25.0%)" in msg
    assert "2x HTTP 500" in msg and "completed requests only" in msg
    # at or below the threshold the repeat counts
    assert len(measure(srv, w, lambda wl, i: [[1], [1], [1], [3]], 1, max_error_rate=0.25)) == 1


@dataclass(frozen=True)
class _FakeEngine:
    """An EngineConfig stand-in for the pool: a slow-streaming fake server."""

    name: str
    log_dir: Path
    kind: str = "fake"
    served_model_name: str = "m"

    def launch_spec(self, log_dir: Path) -> LaunchSpec:
        return LaunchSpec(name=self.name, argv_for_port=lambda p: [sys.executable, FAKE, str(p), "faults"],
                          ready_timeout_s=20, log_dir=log_dir)


def test_server_killed_mid_benchmark_fails_that_test_and_the_pool_restarts_it(tmp_path):
    from kimi_perf.suite.servers import ServerPool

    pool = ServerPool(tmp_path)
    cfg = _FakeEngine("victim", tmp_path)
    try:
        srv = pool.get(cfg)  # type: ignore[arg-type]
        pid = srv.process.pid
        w = Workload(name="slow", input_len=1, output_len=40, num_prompts=4, concurrency=4, warmup=0,
                     request_timeout_s=30)
        threading.Timer(0.6, lambda: os.kill(pid, signal.SIGKILL)).start()
        t0 = time.monotonic()
        with pytest.raises(BenchFailure) as ei:
            measure(srv, w, lambda wl, i: [[7]] * 4, 1)
        assert time.monotonic() - t0 < 20
        msg = str(ei.value)
        assert "4/4 requests failed" in msg
        assert f"server victim (pid {pid}) exited with code -9; log: {srv.process.log_path}" in msg
        assert "last log lines" in msg and "fake server mode=faults" in msg
        # the next test that needs this server gets a fresh one
        again = pool.get(cfg)  # type: ignore[arg-type]
        assert again.process.pid != pid and again.process.alive()
    finally:
        pool.stop_all()
    assert not srv.process.alive()


# -- fuzzing the parsers and loaders: garbage in -> their own error type, never a crash ----------------

json_values = st.recursive(
    st.none() | st.booleans() | st.integers(-10, 10**6) | st.floats(allow_nan=True) | st.text(max_size=12),
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=12), inner, max_size=5),
    max_leaves=25,
)


@given(st.text(max_size=400))
@settings(max_examples=300, deadline=None)
def test_prometheus_parser_only_raises_its_own_error(text):
    from kimi_perf.promparse import MetricsParseError, parse_prometheus

    try:
        out = parse_prometheus(text)
    except MetricsParseError as e:
        assert "not Prometheus text exposition" in str(e)
    else:
        assert all(isinstance(v, float) for v in out.values())


@given(st.lists(st.sampled_from([
    "# TYPE vllm:spec_decode_num_drafts counter\n", "vllm:spec_decode_num_drafts_total{engine=\"0\"} 12\n",
    "vllm:spec_decode_num_accepted_tokens_per_pos_total{position=\"0\"} 5\n", "# HELP x y\n", "x 1\n",
    "x{a=\"b\"} nan\n", "garbage line\n", "y{unclosed 3\n", "\n"]), max_size=12))
@settings(max_examples=200, deadline=None)
def test_prometheus_parser_on_mixed_real_and_broken_lines(lines):
    from kimi_perf.promparse import MetricsParseError, parse_prometheus

    with contextlib.suppress(MetricsParseError):  # its own error is fine; anything else fails the test
        parse_prometheus("".join(lines))


BASE_ENTRY = {"key": {"scenario": "s", "engine": "e", "model": "m", "hardware": "h", "workload": "w",
                      "concurrency": 1},
              "metrics": {"output_throughput": {"unit": "tok/s", "direction": "higher", "samples": [1.0]}}}


@given(json_values)
@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
def test_baseline_loader_rejects_any_garbage_with_a_baseline_error(tmp_path, doc):
    from kimi_perf.baselines import BaselineError, load_file

    p = tmp_path / "b.json"
    p.write_text(json.dumps(doc))
    with pytest.raises(BaselineError) as ei:
        load_file(p)
    assert str(p) in str(ei.value)


@given(st.sampled_from(["key", "metrics"]), st.text(max_size=8), json_values)
@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
def test_baseline_loader_on_mutated_entries(tmp_path, part, field, value):
    from kimi_perf.baselines import BaselineError, load_file

    entry = json.loads(json.dumps(BASE_ENTRY))
    if part == "key":
        entry["key"][field or "scenario"] = value
    else:
        entry["metrics"]["output_throughput"][field or "samples"] = value
    p = tmp_path / "b.json"
    p.write_text(json.dumps({"schema_version": 1, "profile": "p", "entries": [entry]}))
    try:
        _, entries = load_file(p)
    except BaselineError as e:
        assert str(p) in str(e) and "Fix:" in str(e)
    else:
        (e,) = entries.values()
        assert all(isinstance(x, float) for x in e.metrics["output_throughput"].samples)


@given(json_values)
@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
def test_profile_loader_rejects_any_garbage_with_a_profile_error(tmp_path, doc):
    from kimi_perf.profiles import ProfileError, load_profile

    p = tmp_path / "p.json"
    p.write_text(json.dumps(doc))
    with pytest.raises(ProfileError) as ei:
        load_profile(p)
    assert str(p) in str(ei.value)


SHIPPED = json.loads((Path(__file__).parents[1] / "profiles" / "embedded-cpu.json").read_text())


@given(st.sampled_from(sorted(SHIPPED)), json_values)
@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
def test_profile_loader_on_mutated_sections(tmp_path, section, value):
    from kimi_perf.profiles import ProfileError, load_profile

    doc = json.loads(json.dumps(SHIPPED))
    doc["name"] = "p"
    if section != "name":
        doc[section] = value
    p = tmp_path / "p.json"
    p.write_text(json.dumps(doc))
    try:
        load_profile(p)
    except ProfileError as e:
        assert str(p) in str(e)
