"""The load generator must not be the bottleneck: >= 20,000 streamed tokens/s on one core.

Two measurements: (1) pytest-benchmark of the client's per-chunk work (SSE framing + JSON + record)
in process, and (2) the real asyncio client streaming from a local server that emits pre-built chunks
as fast as a socket allows, timed end to end with the client's own CPU time.
"""

from __future__ import annotations

import json
import os
import sys
import time
from pathlib import Path

import pytest

from kimi_perf.launcher import LaunchSpec, ServerProcess
from kimi_perf.load.client import StreamOutcome, handle_event, run_workload
from kimi_perf.load.sse import SSEParser
from kimi_perf.load.workload import Workload

N = 20_000
CHUNK = ("data: " + json.dumps({"id": "cmpl-1", "object": "text_completion", "created": 0, "model": "m",
                                "choices": [{"index": 0, "text": " tok", "logprobs": None, "finish_reason": None}]})
         + "\n\n").encode()
STREAM = CHUNK * N + b'data: {"choices":[],"usage":{"prompt_tokens":1,"completion_tokens":20000}}\n\ndata: [DONE]\n\n'
NET = [STREAM[i : i + 4096] for i in range(0, len(STREAM), 4096)]  # socket-sized reads


def parse_stream() -> StreamOutcome:
    out = StreamOutcome()
    p = SSEParser()
    now = time.perf_counter
    for piece in NET:
        t = now()
        for data in p.feed(piece):
            handle_event(out, data, t)
    return out


def test_per_chunk_parse_rate(benchmark):
    out = benchmark.pedantic(parse_stream, rounds=5, iterations=1)
    assert len(out.chunk_times) == N and out.completion_tokens == N
    rate = N / benchmark.stats.stats.median
    benchmark.extra_info["tokens_per_s"] = rate
    print(f"\nclient parse rate: {rate:,.0f} chunks/s ({1e6 / rate:.1f} us/chunk) on one core")
    assert rate >= 20_000


@pytest.mark.slow
def test_end_to_end_client_rate_against_fast_sse_source(tmp_path):
    fake = str(Path(__file__).with_name("fake_server.py"))
    spec = LaunchSpec(name="fast-sse", argv_for_port=lambda p: [sys.executable, fake, str(p), "sse"],
                      log_dir=tmp_path, ready_timeout_s=20, env={"FAKE_SSE_TOKENS": str(N)})
    with ServerProcess(spec) as srv:
        w = Workload(name="fast", input_len=1, output_len=N, num_prompts=2, concurrency=1, warmup=0)
        res = run_workload(srv.base_url, "m", [[1], [1]], w)
    m = res.metrics
    assert m["error_rate"] == 0 and m["total_output_tokens"] == 2 * N
    cpu_rate = 2 * N / res.client_cpu_s
    print(f"\nend-to-end: {m['output_throughput']:,.0f} tok/s wall, {cpu_rate:,.0f} tok/s per client CPU-second, "
          f"{m['client_cpu_us_per_chunk']:.1f} us client CPU per chunk (cores: {os.cpu_count()})")
    assert cpu_rate >= 20_000


def test_a_long_repeat_prints_a_progress_line_every_heartbeat(tmp_path, monkeypatch):
    """No silent minutes: a repeat longer than the heartbeat says how far it got (phase, requests done)."""
    from kimi_perf import progress
    from kimi_perf.load import client

    monkeypatch.setattr(client, "HEARTBEAT_S", 0.1)
    lines: list[str] = []
    prev = progress.set_sink(lines.append)
    fake = str(Path(__file__).with_name("fake_server.py"))
    spec = LaunchSpec(name="paced", argv_for_port=lambda p: [sys.executable, fake, str(p), "paced"],
                      log_dir=tmp_path, ready_timeout_s=20, env={"FAKE_TOKEN_MS": "5"})
    try:
        with ServerProcess(spec) as srv:
            w = Workload(name="beat", input_len=1, output_len=60, num_prompts=3, concurrency=1, warmup=1)
            res = run_workload(srv.base_url, "m", [[1], [1], [1]], w)
    finally:
        progress.set_sink(prev)
    assert res.metrics["error_rate"] == 0
    beats = [ln for ln in lines if "beat c=1:" in ln]
    assert any("warm-up, 0/1 requests done" in ln for ln in beats), lines
    assert any("measuring" in ln and "/3 requests done" in ln for ln in beats), lines
