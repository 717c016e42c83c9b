"""Prometheus ``/metrics`` for the reference engine.

Speculative-decoding counters use vLLM's exact names and labels (``vllm:spec_decode_*_total`` with
``engine`` and ``model_name``) and SGLang's gauges (``sglang:spec_accept_length``), so the suite's one
Prometheus adapter reads acceptance from every engine the same way: counters before and after the
measured window, never a cumulative average that includes warm-up.
"""

from __future__ import annotations

from typing import Any

from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily


class _EngineCollector:
    def __init__(self, server: Any) -> None:
        self.server = server

    def collect(self):  # type: ignore[no-untyped-def]
        srv = self.server
        eng = srv.engine
        st = eng.stats
        labels = ["engine", "model_name"]
        lv = ["0", srv.model_name]

        def counter(name: str, doc: str, value: float) -> CounterMetricFamily:
            c = CounterMetricFamily(name, doc, labels=labels)
            c.add_metric(lv, value)
            return c

        def gauge(name: str, doc: str, value: float) -> GaugeMetricFamily:
            g = GaugeMetricFamily(name, doc, labels=labels)
            g.add_metric(lv, value)
            return g

        yield counter("kimi_ref:prompt_tokens", "Prefilled prompt tokens.", st.prompt_tokens)
        yield counter("kimi_ref:generation_tokens", "Generated (emitted) tokens.", st.generation_tokens)
        yield counter("kimi_ref:requests_finished", "Requests finished normally.", st.requests_finished)
        yield counter("kimi_ref:requests_aborted", "Requests aborted by their client.", st.requests_aborted)
        yield counter("kimi_ref:scheduler_steps", "Scheduler iterations.", st.steps)
        yield gauge("kimi_ref:num_requests_running", "Sequences in the running batch.", len(eng.running))
        yield gauge("kimi_ref:num_requests_waiting", "Requests waiting for a slot.", eng.num_waiting)
        yield gauge("kimi_ref:last_gen_throughput", "Tokens/s of the last step.", st.last_gen_throughput)
        if eng.spec_steps:
            yield counter("vllm:spec_decode_num_drafts", "Verify steps (one draft chain each).", st.spec_drafts)
            yield counter("vllm:spec_decode_num_draft_tokens", "Proposed draft tokens.", st.spec_draft_tokens)
            yield counter("vllm:spec_decode_num_accepted_tokens", "Accepted draft tokens (no bonus).",
                          st.spec_accepted_tokens)
            per = CounterMetricFamily("vllm:spec_decode_num_accepted_tokens_per_pos",
                                      "Accepted draft tokens by position in the chain.", labels=[*labels, "position"])
            for i, v in enumerate(st.spec_accepted_per_pos):
                per.add_metric([*lv, str(i)], v)
            yield per
            w_len = st.window_tokens / st.window_verify_ct if st.window_verify_ct else 0.0
            w_rate = st.window_accepted / st.window_proposed if st.window_proposed else 0.0
            yield gauge("sglang:spec_accept_length", "Tokens per verify step since /flush_cache (with bonus).", w_len)
            yield gauge("sglang:spec_accept_rate", "Accepted/proposed drafts since /flush_cache.", w_rate)


def render_metrics(server: Any) -> bytes:
    reg = CollectorRegistry(auto_describe=False)
    reg.register(_EngineCollector(server))  # type: ignore[arg-type]
    return generate_latest(reg)
