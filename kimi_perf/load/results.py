"""Per-request records and the metric computation of one benchmark repeat.

The formulas live here, in one function, so the unit tests can pin them (hypothesis checks the
invariants) and every engine's numbers come from the same code. See :mod:`kimi_perf.metrics` for the
definitions; the only modelling choice is the steady-state window (below).
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass
from typing import Any

import numpy as np

from .workload import Workload

__all__ = ["BenchResult", "RequestRecord", "compute_metrics", "percentile", "steady_window"]


@dataclass(frozen=True)
class RequestRecord:
    """One measured request; times are seconds from the start of the measured phase."""

    index: int
    prompt_len: int
    max_tokens: int
    ok: bool
    error: str | None
    t_send: float
    t_first: float | None
    t_end: float
    chunk_times: tuple[float, ...]
    completion_tokens: int | None
    server_prompt_tokens: int | None = None
    text: str = ""

    @property
    def ttft(self) -> float | None:
        return None if self.t_first is None else self.t_first - self.t_send

    @property
    def e2el(self) -> float:
        return self.t_end - self.t_send

    @property
    def tpot(self) -> float | None:
        """(E2EL - TTFT) / (completion_tokens - 1), tokens from the server's usage report."""
        ct = self.completion_tokens
        if not self.ok or ct is None or ct < 2 or self.ttft is None:
            return None
        return (self.e2el - self.ttft) / (ct - 1)

    @property
    def inter_chunk(self) -> list[float]:
        c = self.chunk_times
        return [b - a for a, b in zip(c, c[1:])]


def percentile(values: list[float], q: float) -> float:
    """Linear-interpolated percentile (numpy's default, as vLLM's and SGLang's bench clients use)."""
    if not values:
        return float("nan")
    return float(np.percentile(np.asarray(values, dtype=float), q))


def steady_window(records: list[RequestRecord], concurrency: int) -> tuple[float, float] | None:
    """The interval during which ``concurrency`` requests were in flight.

    Closed-loop runs ramp up (first sends) and drain (the last requests finishing with the batch
    emptying); throughput over the whole run mixes those in. The window starts when the in-flight
    count first reaches C and ends at the first request end after the *last* send -- from then on the
    batch only drains. (Between an end and the refill it replaces, the count dips below C for the
    client's reaction time; those dips are part of steady state, not drain.) None if C is never
    reached.
    """
    if not records:
        return None
    ev: list[tuple[float, int]] = []
    for r in records:
        ev.append((r.t_send, 1))
        ev.append((r.t_end, -1))
    ev.sort(key=lambda e: (e[0], -e[1]))
    n = 0
    start = None
    for t, d in ev:
        n += d
        if n >= concurrency:
            start = t
            break
    if start is None:
        return None
    last_send = max(r.t_send for r in records)
    # strictly after: the end that freed the slot for the last send happens at (or just before) it
    ends = [r.t_end for r in records if r.t_end > last_send]
    end = min(ends) if ends else None
    if end is None or end <= start:
        return None
    return start, end


def _tokens_in_window(r: RequestRecord, lo: float, hi: float) -> float:
    """Tokens a request produced inside [lo, hi]: its first token at t_first, the remaining ct-1
    spread uniformly over [t_first, t_end] (chunks do not say how many tokens each carries)."""
    if not r.ok or r.completion_tokens is None or r.t_first is None:
        return 0.0
    total = 0.0
    if lo <= r.t_first <= hi:
        total += 1.0
    rest = r.completion_tokens - 1
    span = r.t_end - r.t_first
    if rest <= 0:
        return total
    if span <= 0:
        return total + (rest if lo <= r.t_end <= hi else 0.0)
    overlap = max(0.0, min(hi, r.t_end) - max(lo, r.t_first))
    return total + rest * overlap / span


def compute_metrics(
    records: list[RequestRecord] | tuple[RequestRecord, ...],
    concurrency: int,
    *,
    duration_s: float | None = None,
    client_cpu_s: float | None = None,
) -> dict[str, float]:
    recs = list(records)
    ok = [r for r in recs if r.ok]
    n_all = len(recs)
    m: dict[str, float] = {
        "num_requests": float(n_all),
        "num_completed": float(len(ok)),
        "num_failed": float(n_all - len(ok)),
        "error_rate": (n_all - len(ok)) / n_all if n_all else float("nan"),
    }
    if not ok:
        return m
    if duration_s is None:
        duration_s = max(r.t_end for r in recs) - min(r.t_send for r in recs)
    tokens = sum(r.completion_tokens or 0 for r in ok)
    m["duration_s"] = duration_s
    m["total_output_tokens"] = float(tokens)
    # the server's count where it reported one: a chat request's prompt is the decoded text in the
    # server's chat template, longer than the ids the client drew (for token-id completions they agree)
    m["total_input_tokens"] = float(sum(r.server_prompt_tokens if r.server_prompt_tokens is not None
                                        else r.prompt_len for r in ok))
    m["output_throughput"] = tokens / duration_s if duration_s > 0 else float("nan")
    m["request_throughput"] = len(ok) / duration_s if duration_s > 0 else float("nan")
    ttft = [r.ttft * 1000 for r in ok if r.ttft is not None]
    tpot = [r.tpot * 1000 for r in ok if r.tpot is not None]
    itl = [g * 1000 for r in ok for g in r.inter_chunk]
    e2el = [r.e2el * 1000 for r in ok]
    for name, vals in (("ttft_ms", ttft), ("tpot_ms", tpot), ("inter_chunk_ms", itl), ("e2el_ms", e2el)):
        m[f"{name}_mean"] = float(np.mean(vals)) if vals else float("nan")
        for q in (50, 90, 99):
            m[f"{name}_p{q}"] = percentile(vals, q)
    dec = [((r.completion_tokens or 0) - 1) / (r.e2el - (r.ttft or 0.0)) for r in ok
           if r.tpot is not None and r.e2el - (r.ttft or 0.0) > 0]
    m["decode_tok_s"] = float(np.median(dec)) if dec else float("nan")
    win = steady_window(recs, concurrency)
    if win is not None and (win[1] - win[0]) >= 0.1 * duration_s:
        lo, hi = win
        m["steady_output_throughput"] = sum(_tokens_in_window(r, lo, hi) for r in ok) / (hi - lo)
        m["steady_window_s"] = hi - lo
    else:
        m["steady_output_throughput"] = float("nan")
    chunks = sum(len(r.chunk_times) for r in recs)
    if client_cpu_s is not None and chunks:
        m["client_cpu_us_per_chunk"] = client_cpu_s / chunks * 1e6
    m["chunks_per_token"] = chunks / tokens if tokens else float("nan")
    return m


@dataclass(frozen=True)
class BenchResult:
    """One measured repeat: the workload, every request, and the derived metrics."""

    workload: Workload
    records: tuple[RequestRecord, ...]
    metrics: dict[str, float]
    duration_s: float
    client_cpu_s: float
    warmup_errors: tuple[str, ...] = ()

    @property
    def errors(self) -> list[str]:
        return [r.error for r in self.records if r.error]

    def to_frame(self) -> Any:
        import pandas as pd

        rows = []
        for r in self.records:
            d = asdict(r)
            d.pop("chunk_times")
            d["n_chunks"] = len(r.chunk_times)
            d["ttft_ms"] = None if r.ttft is None else r.ttft * 1000
            d["tpot_ms"] = None if r.tpot is None else r.tpot * 1000
            d["e2el_ms"] = r.e2el * 1000
            rows.append(d)
        return pd.DataFrame(rows)

    def summary(self) -> dict[str, Any]:
        return {"workload": self.workload.to_dict(),
                "metrics": {k: (None if isinstance(v, float) and math.isnan(v) else v) for k, v in self.metrics.items()},
                "errors": self.errors[:10], "warmup_errors": list(self.warmup_errors)}
