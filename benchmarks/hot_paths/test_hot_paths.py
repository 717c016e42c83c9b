"""pytest-benchmark of the suite's own hot paths, kept over time so "the client is never the
bottleneck" is a number with a history, not a claim (issue 25 item 6).

Not part of ``pytest`` (``benchmarks/`` is outside ``testpaths``); run and keep them with
pytest-benchmark's own storage and compare::

    pytest benchmarks/hot_paths --benchmark-autosave            # stores .benchmarks/<machine>/NNNN_*.json
    pytest benchmarks/hot_paths --benchmark-compare --benchmark-compare-fail=median:25%

What each measures, per unit of work the suite repeats in a measured phase:

- SSE framing alone (``SSEParser.feed`` over socket-sized reads), per streamed chunk;
- the client loop per token (framing + JSON + the request's timeline, ``handle_event``), per chunk;
- turning one repeat's requests into metrics (``compute_metrics``), per repeat of 256 requests;
- the gate decision (``stats.gate``, and ``confirm_gate`` after a FAIL), per metric.

Each benchmark also checks its result, so a fast wrong answer cannot pass for a speed-up.
"""

from __future__ import annotations

import json
import time

import numpy as np
import pytest

from kimi_perf.load.client import StreamOutcome, handle_event
from kimi_perf.load.results import RequestRecord, compute_metrics
from kimi_perf.load.sse import SSEParser
from kimi_perf.metrics import METRICS
from kimi_perf.stats import GateConfig, confirm_gate, gate

pytest.importorskip("pytest_benchmark")

N = 20_000  # chunks per stream: about one long completion
CHUNK = ("data: " + json.dumps({"id": "cmpl-1", "object": "text_completion", "created": 0, "model": "m",
                                "choices": [{"index": 0, "text": " tok", "logprobs": None, "finish_reason": None}]})
         + "\n\n").encode()
STREAM = CHUNK * N + b'data: {"choices":[],"usage":{"prompt_tokens":1,"completion_tokens":20000}}\n\ndata: [DONE]\n\n'
NET = [STREAM[i:i + 4096] for i in range(0, len(STREAM), 4096)]  # socket-sized reads


def _per_unit(benchmark, n: int, unit: str) -> None:
    med = benchmark.stats.stats.median
    benchmark.extra_info[f"us_per_{unit}"] = med / n * 1e6
    benchmark.extra_info[f"{unit}s_per_s"] = n / med


def test_sse_framing_per_chunk(benchmark):
    def frame() -> int:
        p = SSEParser()
        return sum(len(p.feed(piece)) for piece in NET)

    assert benchmark(frame) == N + 2  # every chunk, the usage event and [DONE]
    _per_unit(benchmark, N, "chunk")


def test_client_loop_per_token(benchmark):
    def stream() -> StreamOutcome:
        out, p, now = StreamOutcome(), SSEParser(), time.perf_counter
        for piece in NET:
            t = now()
            for data in p.feed(piece):
                handle_event(out, data, t)
        return out

    out = benchmark(stream)
    assert len(out.chunk_times) == N and out.completion_tokens == N and out.error is None
    _per_unit(benchmark, N, "chunk")


def _repeat(n_req: int = 256, toks: int = 64, conc: int = 32) -> list[RequestRecord]:
    rng = np.random.default_rng(0)
    recs = []
    for i in range(n_req):
        t0 = (i // conc) * 0.5 + rng.uniform(0, 0.01)
        first = t0 + 0.05
        chunks = tuple(first + k * 0.007 for k in range(toks))
        recs.append(RequestRecord(index=i, prompt_len=128, max_tokens=toks, ok=True, error=None, t_send=t0,
                                  t_first=first, t_end=chunks[-1], chunk_times=chunks, completion_tokens=toks))
    return recs


def test_metrics_of_one_repeat(benchmark):
    recs = _repeat()
    m = benchmark(compute_metrics, recs, 32)
    assert m["num_completed"] == 256 and m["tpot_ms_p50"] == pytest.approx(7.0, rel=1e-6)
    _per_unit(benchmark, len(recs), "request")


def test_gate_decision_per_metric(benchmark):
    base, cur, cfg = [100.0, 101.5, 99.2, 100.8, 100.1], [80.2, 79.5, 81.0, 80.6, 79.9], GateConfig()
    d = benchmark(gate, METRICS["output_throughput"], base, cur, cfg)
    assert d.verdict == "FAIL" and d.p_value is not None and d.p_value <= cfg.alpha


def test_confirm_gate_per_metric(benchmark):
    base, first, again = [100.0, 101.5, 99.2], [80.2, 79.5, 81.0], [99.8, 100.9, 100.2]
    d = benchmark(confirm_gate, METRICS["output_throughput"], base, first, again, GateConfig())
    assert d.verdict == "WARN" and "confirming measurement" in d.reason
