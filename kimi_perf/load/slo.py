"""Goodput under latency SLOs, and the knee of a request-rate sweep.

Why: throughput alone rewards a server that queues requests until every user waits seconds for the
first token. A deployment has latency objectives, and what it can serve is the load at which requests
still meet them. The definitions follow vLLM's benchmark client (``vllm bench serve --goodput
ttft:MS tpot:MS e2el:MS``, vllm/benchmarks/serve.py): a completed request is *good* when it meets every
given objective (TTFT, TPOT = (E2EL - TTFT) / (output tokens - 1) from the server's token count, E2EL,
each in ms), and **request goodput** is good requests per second of the run. Next to it the suite
reports **SLO attainment**, good requests over all requests sent (a failed request is not good), and
sweeps the open-loop request rate (Poisson arrivals by default, :func:`kimi_perf.load.client.arrival_gaps`)
to find the **knee**: the highest rate of the sweep at which attainment is at least
``slo.min_attainment`` with every lower rate meeting it too (a rate that passes above a failing one is
noise, not capacity). ``docs/metrics.md`` defines each with its anchor.

The profile's ``throughput.slo`` section is parsed here into :class:`SLOSpec` (typed, defaults in one
place).
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, fields
from typing import Any

from .results import RequestRecord
from .workload import Dataset, Workload

__all__ = ["SLOSpec", "good_request", "goodput", "knee", "parse_slo"]


@dataclass(frozen=True)
class SLOSpec:
    """Latency objectives and the rate sweep that finds the knee (profile ``throughput.slo``)."""

    ttft_ms: float | None = None  # time to first token, per request
    tpot_ms: float | None = None  # time per output token after the first, per request
    e2el_ms: float | None = None  # end-to-end latency, per request
    min_attainment: float = 0.9  # fraction of requests that must be good for a rate to count as served
    rates: tuple[float, ...] = ()  # request rates (req/s) swept in increasing order
    burstiness: float = 1.0  # gamma shape of the arrivals (1 = Poisson), vLLM's --burstiness
    num_prompts: int = 16  # requests per rate and repeat
    max_concurrency: int = 64  # requests in flight at most (vLLM's --max-concurrency)
    # prompts: "random" ids of the throughput workload's length, or "sharegpt-multiturn" (ShareGPT V3
    # conversations replayed turn by turn with their history, up to that length)
    dataset: Dataset = "random"

    def objectives(self) -> dict[str, float]:
        """The objectives that are set, by the per-request metric they bound."""
        return {k: float(v) for k, v in (("ttft_ms", self.ttft_ms), ("tpot_ms", self.tpot_ms),
                                         ("e2el_ms", self.e2el_ms)) if v is not None}

    def describe(self) -> str:
        return " and ".join(f"{k.removesuffix('_ms').upper()} <= {v:g} ms" for k, v in self.objectives().items())

    def workload(self, base: Workload, rate: float) -> Workload:
        """The sweep's workload at ``rate``: the throughput workload's lengths and seed, open loop."""
        from dataclasses import replace

        return replace(base, name=f"{base.name}-slo", request_rate=float(rate), burstiness=self.burstiness,
                       num_prompts=self.num_prompts, concurrency=self.max_concurrency, dataset=self.dataset,
                       prefix_len=0)


def good_request(r: RequestRecord, slo: SLOSpec) -> bool:
    """vLLM's rule: completed, and within every objective that is set."""
    if not r.ok:
        return False
    obj = slo.objectives()
    got = {"ttft_ms": None if r.ttft is None else r.ttft * 1000,
           "tpot_ms": None if r.tpot is None else r.tpot * 1000, "e2el_ms": r.e2el * 1000}
    for k, limit in obj.items():
        v = got[k]
        if k == "tpot_ms" and v is None:  # one output token: no TPOT to exceed (vLLM counts it as met)
            continue
        if v is None or v > limit:
            return False
    return True


def goodput(records: Sequence[RequestRecord], duration_s: float, slo: SLOSpec) -> dict[str, float]:
    """``request_goodput`` (good requests / s) and ``slo_attainment`` (good / sent) of one repeat."""
    n = len(records)
    good = sum(good_request(r, slo) for r in records)
    return {"request_goodput": good / duration_s if duration_s > 0 else float("nan"),
            "slo_attainment": good / n if n else float("nan")}


def knee(attainment_by_rate: Mapping[float, float], min_attainment: float) -> float:
    """The highest rate whose attainment, and every lower rate's, is at least ``min_attainment``;
    0.0 when even the lowest rate misses (NaN attainment counts as a miss)."""
    best = 0.0
    for rate in sorted(attainment_by_rate):
        a = attainment_by_rate[rate]
        if not (math.isfinite(a) and a >= min_attainment):
            break
        best = rate
    return best


def parse_slo(raw: Any, where: str = "throughput.slo") -> SLOSpec:
    """The profile's ``throughput.slo`` object; a ValueError names the key and the fix."""
    if not isinstance(raw, Mapping):
        raise ValueError(f"{where}: must be an object, e.g. {{\"ttft_ms\": 500, \"tpot_ms\": 100, "
                         "\"rates\": [0.5, 1, 2]}")
    known = {f.name for f in fields(SLOSpec)}
    unknown = set(raw) - known
    if unknown:
        raise ValueError(f"{where}: unknown key(s) {sorted(unknown)}; allowed: {sorted(known)}")

    def num(k: str, lo: float, hi: float = math.inf, *, integer: bool = False) -> Any:
        v = raw[k]
        ok_type = isinstance(v, int) if integer else isinstance(v, (int, float))
        if isinstance(v, bool) or not ok_type or not lo < v <= hi:
            kind = "an integer" if integer else "a number"
            raise ValueError(f"{where}.{k}: {v!r} must be {kind} in ({lo:g}, {hi:g}]")
        return v

    kw: dict[str, Any] = {}
    for k in ("ttft_ms", "tpot_ms", "e2el_ms"):
        if raw.get(k) is not None:
            kw[k] = float(num(k, 0.0, 3.6e6))
    if not kw:
        raise ValueError(f"{where}: set at least one objective (ttft_ms, tpot_ms, e2el_ms)")
    if "min_attainment" in raw:
        kw["min_attainment"] = float(num("min_attainment", 0.0, 1.0))
    if "burstiness" in raw:
        kw["burstiness"] = float(num("burstiness", 0.0, 1e3))
    for k, hi in (("num_prompts", 100_000), ("max_concurrency", 100_000)):
        if k in raw:
            kw[k] = int(num(k, 0, hi, integer=True))
    rates = raw.get("rates")
    if (not isinstance(rates, list) or not rates or any(isinstance(r, bool) or not isinstance(r, (int, float))
                                                         or not 0 < r < 1e6 for r in rates)
            or sorted(rates) != rates or len(set(rates)) != len(rates)):
        raise ValueError(f"{where}.rates: {rates!r} must be a non-empty increasing list of request rates > 0 "
                         "(req/s), e.g. [0.5, 1, 2, 4]")
    kw["rates"] = tuple(float(r) for r in rates)
    if "dataset" in raw:
        if raw["dataset"] not in ("random", "sharegpt-multiturn"):
            raise ValueError(f"{where}.dataset: {raw['dataset']!r} must be \"random\" or \"sharegpt-multiturn\"")
        kw["dataset"] = raw["dataset"]
    return SLOSpec(**kw)
