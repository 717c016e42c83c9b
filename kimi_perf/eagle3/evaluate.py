"""Measure EAGLE-3 acceptance and speedup on a running engine, the same way for every engine.

Acceptance comes from vLLM's Prometheus counters (``vllm:spec_decode_num_drafts_total`` and friends,
also exported by the reference engine) read before and after the measured window, so warm-up and
earlier tests never leak in:

- accept length = 1 + accepted / drafts (tokens per verify step, bonus included);
- acceptance rate = accepted / draft tokens (no bonus);
- per-position rate i = accepted at position i / drafts.

SGLang-style per-request ``meta_info`` (``spec_accept_length`` = completion_tokens / spec_verify_ct,
which also counts the prefill token) is collected when the engine returns it and reported next to it.
Speed is measured by the suite's streaming client at concurrency 1.
"""

from __future__ import annotations

import json
import urllib.request
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from ..load.client import run_workload
from ..load.workload import Workload
from ..promparse import counter_sum, parse_prometheus

__all__ = ["AcceptanceResult", "SpecCounters", "WIRING_HINT", "measure_generation", "read_spec_counters"]

WIRING_HINT = (
    "accept length exactly 1.00 means no draft token was ever accepted -- a wiring fault, not drafter "
    "quality. Likely causes: aux-layer ids in another engine's convention (off by one: vLLM uses the input "
    "of layer k, SGLang Llama adds 1), features captured pre/post final norm differently from serving, "
    "a d2t/t2d map that does not match the draft vocab, the wrong --speculative-algorithm (EAGLE vs "
    "EAGLE3), or a drafter trained for another target")


@dataclass(frozen=True)
class SpecCounters:
    drafts: float
    draft_tokens: float
    accepted: float
    per_pos: tuple[float, ...]

    def __sub__(self, o: SpecCounters) -> SpecCounters:
        n = max(len(self.per_pos), len(o.per_pos))
        a = list(self.per_pos) + [0.0] * (n - len(self.per_pos))
        b = list(o.per_pos) + [0.0] * (n - len(o.per_pos))
        return SpecCounters(self.drafts - o.drafts, self.draft_tokens - o.draft_tokens, self.accepted - o.accepted,
                            tuple(x - y for x, y in zip(a, b)))


def read_spec_counters(base_url: str) -> SpecCounters | None:
    with urllib.request.urlopen(base_url.rstrip("/") + "/metrics", timeout=30) as r:  # noqa: S310 - loopback
        m = parse_prometheus(r.read().decode())
    drafts = counter_sum(m, "vllm:spec_decode_num_drafts_total")
    if drafts is None:
        return None
    per = []
    i = 0
    while True:
        v = counter_sum(m, "vllm:spec_decode_num_accepted_tokens_per_pos_total", position=str(i))
        if v is None:
            break
        per.append(v)
        i += 1
    return SpecCounters(drafts, counter_sum(m, "vllm:spec_decode_num_draft_tokens_total") or 0.0,
                        counter_sum(m, "vllm:spec_decode_num_accepted_tokens_total") or 0.0, tuple(per))


@dataclass(frozen=True)
class AcceptanceResult:
    counters: SpecCounters | None
    output_tok_s: float
    texts: tuple[str, ...]
    completion_tokens: int
    extra: dict[str, Any] = field(default_factory=dict)
    server_accept_length: float | None = None  # SGLang /server_info window (its definition, bonus incl.)

    @property
    def accept_length(self) -> float:
        c = self.counters
        if c is None or c.drafts <= 0:
            return self.server_accept_length if self.server_accept_length is not None else float("nan")
        return 1.0 + c.accepted / c.drafts

    @property
    def accept_rate(self) -> float:
        c = self.counters
        return float("nan") if c is None or c.draft_tokens <= 0 else c.accepted / c.draft_tokens

    def pos_rates(self) -> list[float]:
        c = self.counters
        return [] if c is None or c.drafts <= 0 else [p / c.drafts for p in c.per_pos]


def _flush(base_url: str) -> None:
    try:
        req = urllib.request.Request(base_url.rstrip("/") + "/flush_cache", data=b"", method="POST")
        urllib.request.urlopen(req, timeout=30).read()  # noqa: S310 - loopback
    except OSError:
        pass  # vLLM has no /flush_cache; counters are differenced anyway


def measure_generation(base_url: str, model: str, prompts: Sequence[Sequence[int]], max_new_tokens: int,
                       *, name: str = "eagle3-eval", concurrency: int = 1) -> AcceptanceResult:
    """Greedy generation of ``prompts`` (stop at EOS, as users run it) with counters around it."""
    _flush(base_url)
    before = read_spec_counters(base_url)
    w = Workload(name=name, dataset="mtbench", input_len=max(len(p) for p in prompts), output_len=max_new_tokens,
                 num_prompts=len(prompts), concurrency=concurrency, warmup=0, ignore_eos=False)
    res = run_workload(base_url, model, prompts, w)
    if res.metrics["error_rate"] > 0:
        raise RuntimeError(f"{name}: {int(res.metrics['num_failed'])} requests failed: {res.errors[:3]}")
    after = read_spec_counters(base_url)
    delta = after - before if (after is not None and before is not None) else None
    server_len = None
    if delta is None:  # SGLang: the window since /flush_cache, from /server_info
        from ..engines.sglang import server_info_accept_length

        try:
            with urllib.request.urlopen(base_url.rstrip("/") + "/server_info", timeout=30) as r:  # noqa: S310
                server_len = server_info_accept_length(json.loads(r.read()))
        except OSError:
            server_len = None
    return AcceptanceResult(delta, res.metrics["output_throughput"], tuple(r.text for r in res.records),
                            int(res.metrics["total_output_tokens"]), server_accept_length=server_len)
