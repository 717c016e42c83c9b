"""Metric definitions: every number the suite gates has a name, a unit and a direction here.

Why one registry: the gate must know whether "lower" is a regression, the report must print units, and
a baseline file that names an unknown metric must be a clear error rather than a silent pass. The
definitions follow the serving-benchmark anchors (vllm/benchmarks/serve.py; docs/metrics.md) exactly:

- TTFT: first streamed chunk *with content* minus send time.
- TPOT: ``(E2EL - TTFT) / (completion_tokens - 1)`` with ``completion_tokens`` from the server's usage
  report -- never the number of chunks, because under speculative decoding one chunk carries several
  tokens.
- Inter-chunk latency: gaps between content chunks, reported under that name (it is *not* a per-token
  latency).
- Output throughput: ``sum(completion_tokens) / duration`` of the measured phase.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

Direction = Literal["higher", "lower"]

__all__ = ["METRICS", "Direction", "MetricDef", "get_metric"]


@dataclass(frozen=True)
class MetricDef:
    name: str
    unit: str
    direction: Direction
    description: str

    @property
    def arrow(self) -> str:
        return "↑" if self.direction == "higher" else "↓"

    def worse_by(self, baseline: float, current: float) -> float:
        """Relative change in the *bad* direction (positive = regression), as a fraction of baseline."""
        if baseline == 0:
            return 0.0 if current == 0 else (float("inf") if self._is_worse(baseline, current) else float("-inf"))
        rel = (current - baseline) / abs(baseline)
        return -rel if self.direction == "higher" else rel

    def _is_worse(self, baseline: float, current: float) -> bool:
        return current < baseline if self.direction == "higher" else current > baseline


def _m(name: str, unit: str, direction: Direction, description: str) -> MetricDef:
    return MetricDef(name, unit, direction, description)


_ALL = [
    _m("output_throughput", "tok/s", "higher", "sum(completion_tokens) / measured duration"),
    _m("steady_output_throughput", "tok/s", "higher",
       "output tok/s inside the window where all C requests are in flight (decode time interpolated)"),
    _m("request_throughput", "req/s", "higher", "completed requests / measured duration"),
    _m("decode_tok_s", "tok/s", "higher", "single-stream decode speed: median of (ct-1)/(E2EL-TTFT)"),
    _m("ttft_ms_p50", "ms", "lower", "time to first content chunk, median"),
    _m("ttft_ms_p90", "ms", "lower", "time to first content chunk, p90"),
    _m("ttft_ms_p99", "ms", "lower", "time to first content chunk, p99"),
    _m("ttft_ms_mean", "ms", "lower", "time to first content chunk, mean"),
    _m("tpot_ms_p50", "ms", "lower", "(E2EL-TTFT)/(completion_tokens-1), median over requests"),
    _m("tpot_ms_p90", "ms", "lower", "TPOT p90"),
    _m("tpot_ms_p99", "ms", "lower", "TPOT p99"),
    _m("tpot_ms_mean", "ms", "lower", "TPOT mean"),
    _m("inter_chunk_ms_p50", "ms", "lower", "gap between streamed content chunks, median (not per token)"),
    _m("inter_chunk_ms_p90", "ms", "lower", "inter-chunk gap p90"),
    _m("inter_chunk_ms_p99", "ms", "lower", "inter-chunk gap p99"),
    _m("e2el_ms_p50", "ms", "lower", "end-to-end request latency, median"),
    _m("e2el_ms_p90", "ms", "lower", "end-to-end request latency, p90"),
    _m("e2el_ms_p99", "ms", "lower", "end-to-end request latency, p99"),
    _m("error_rate", "fraction", "lower", "failed requests / all measured requests"),
    _m("batching_gain", "x", "higher", "output tok/s at concurrency C / output tok/s at concurrency 1, same run"),
    _m("decode_floor_ratio", "fraction", "higher",
       "single-stream decode tok/s / (copy bandwidth / weight bytes), both measured in the same run"),
    _m("client_cpu_us_per_chunk", "us", "lower", "load-generator CPU time per streamed chunk"),
    _m("engine_cpu_ms_per_tok", "ms", "lower",
       "user+system CPU time of the server's whole process group during a repeat / its output tokens "
       "(from /proc; steal time is not charged to it)"),
    _m("host_steal_fraction", "fraction", "lower", "host CPU steal time / all CPU time during a repeat (/proc/stat)"),
    _m("peer_cpu_util", "cores", "lower",
       "CPU seconds of the other A/B side's server (waiting while this side is measured) / the repeat's "
       "wall seconds (from /proc)"),
    _m("gpu_sm_clock_mhz", "MHz", "higher",
       "median SM clock of the GPUs the servers see during a repeat (nvidia-smi --loop-ms; kimi_perf.gpuclock)"),
    _m("gpu_power_w", "W", "lower", "median power draw of those GPUs during a repeat (nvidia-smi power.draw)"),
    _m("server_ready_s", "s", "lower", "launch to first healthy /health answer of a server"),
    # latency objectives (kimi_perf.load.slo; vLLM's --goodput definition)
    _m("request_goodput", "req/s", "higher",
       "requests that completed within every SLO (TTFT, TPOT, E2EL) / measured duration (vLLM --goodput)"),
    _m("slo_attainment", "fraction", "higher", "requests within every SLO / requests sent (failed = not good)"),
    _m("prefix_cache_ttft_ratio", "x", "lower",
       "TTFT p50 of prompts sharing a prefix / TTFT p50 of unrelated prompts of the same length, same server and run"),
    _m("slo_knee_rate", "req/s", "higher",
       "highest request rate of the sweep at which SLO attainment (and every lower rate's) >= slo.min_attainment"),
    # speculative decoding
    _m("accept_length", "tok/step", "higher", "tokens per verify step incl. bonus (SGLang spec_accept_length)"),
    _m("accept_rate", "fraction", "higher", "accepted drafts / proposed drafts (no bonus)"),
    _m("accept_rate_pos0", "fraction", "higher", "accepted at draft position 0 / drafts"),
    _m("accept_rate_pos1", "fraction", "higher", "accepted at draft position 1 / drafts"),
    _m("accept_rate_pos2", "fraction", "higher", "accepted at draft position 2 / drafts"),
    _m("accept_rate_pos3", "fraction", "higher", "accepted at draft position 3 / drafts"),
    _m("spec_speedup", "x", "higher", "spec output tok/s / no-spec output tok/s, same workload, same run"),
    # hidden-state alignment
    _m("cosine_min", "cos", "higher", "minimum per-token cosine similarity"),
    _m("cosine_p1", "cos", "higher", "1st percentile of per-token cosine similarity"),
    _m("cosine_mean", "cos", "higher", "mean per-token cosine similarity"),
    _m("rel_l2_max", "fraction", "lower", "maximum per-token relative L2 error"),
    # collectives
    _m("allreduce_us_p50", "us", "lower", "all-reduce latency, median"),
    _m("allreduce_us_p99", "us", "lower", "all-reduce latency, p99"),
    _m("preset_ratio", "x", "higher", "tuned-preset speed / default-preset speed in the same run (>1: tuned is faster)"),
    # training
    _m("train_tok_s", "tok/s", "higher", "drafter training tokens per second"),
]

METRICS: dict[str, MetricDef] = {m.name: m for m in _ALL}


def get_metric(name: str) -> MetricDef:
    try:
        return METRICS[name]
    except KeyError:
        close = [m for m in METRICS if m.split("_")[0] == name.split("_")[0]]
        hint = f" (did you mean {', '.join(close[:4])}?)" if close else ""
        raise KeyError(f"unknown metric {name!r}{hint}; known: {', '.join(sorted(METRICS))}") from None
