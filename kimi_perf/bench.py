"""Measure a workload R times against a running server and turn the repeats into gate samples.

Why a helper shared by all perf tests: every test must treat failures the same way -- a repeat with
request errors above the allowed rate fails the test with the errors' causes (and, if the server
died, its exit code and log), never a silent pass on the requests that happened to complete.
"""

from __future__ import annotations

import contextlib
import json
import subprocess
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from . import httpjson
from .load.client import run_workload
from .load.results import BenchResult
from .load.workload import Workload
from .progress import log
from .results import note as note_repeat

__all__ = ["BenchFailure", "RunningServer", "check_errors", "fetch_version", "measure", "samples_of"]


class BenchFailure(AssertionError):
    pass


@dataclass
class RunningServer:
    """A ready server as tests see it (independent of which engine it is)."""

    name: str
    kind: str
    base_url: str
    model: str
    process: Any  # kimi_perf.launcher.ServerProcess
    config: Any
    version: str | None = None
    # sent with every request: an existing endpoint's Authorization (--perf-url); empty for launches
    headers: dict[str, str] = field(default_factory=dict)

    def get_json(self, path: str, timeout: float = 30.0) -> Any:
        return httpjson.get_json(self.base_url + path, self.headers, timeout)

    def get_text(self, path: str, timeout: float = 30.0) -> str:
        return httpjson.get_text(self.base_url + path, self.headers, timeout)

    def post_json(self, path: str, body: Any, timeout: float = 600.0) -> Any:
        raw = httpjson.fetch(self.base_url + path, {"Content-Type": "application/json", **self.headers}, timeout,
                             data=json.dumps(body).encode())
        return json.loads(raw) if raw[:1] in (b"{", b"[") else raw.decode()

    def death_note(self, wait_s: float = 2.0) -> str | None:
        """Exit code, log and last lines if the server died. Called after requests failed: a server
        that was just killed closes its sockets before the kernel reports its exit, so give a dying
        process ``wait_s`` to be reaped rather than report it alive."""
        p = self.process
        if p is None:
            return None
        if p.alive() and p.proc is not None:
            with contextlib.suppress(subprocess.TimeoutExpired):
                p.proc.wait(timeout=wait_s)
        if p.alive():
            return None
        return (f"server {self.name} (pid {p.pid}) exited with code {p.returncode}; log: {p.log_path}\n"
                f"last log lines:\n{p.tail(20)}")




def fetch_version(srv: RunningServer) -> str | None:
    """The engine's version from /version or /server_info (None when it reports neither)."""
    for path, key in (("/version", "version"), ("/server_info", "version"), ("/get_server_info", "version")):
        try:
            data = srv.get_json(path, timeout=10)
        except Exception:  # noqa: BLE001 - an engine without this endpoint: try the next
            continue
        if isinstance(data, dict) and data.get(key):
            return str(data[key])
    return None


def measure(
    server: RunningServer,
    workload: Workload,
    prompts_for: Callable[[Workload, int], Sequence[Sequence[int]]],
    repeats: int,
    *,
    max_error_rate: float = 0.0,
    label: str = "",
    tokenizer: Any = None,
) -> list[BenchResult]:
    """Run ``repeats`` measured repeats; each uses fresh prompts (seed + repeat) so no prefix cache
    can serve a later repeat from an earlier one. An ``api="chat"`` workload decodes its prompts with
    ``tokenizer``, by default the one ``prompts_for`` carries (a PromptFactory's)."""
    if workload.api == "chat" and tokenizer is None:
        tokenizer = getattr(prompts_for, "tokenizer", None)
    results = []
    warm = list(prompts_for(workload, 10_000))[: workload.warmup]
    for i in range(repeats):
        prompts = prompts_for(workload, i)
        t0 = time.monotonic()
        res = run_workload(server.base_url, server.model, prompts, workload, warmup_prompts=warm if i == 0 else [],
                           headers=server.headers, tokenizer=tokenizer)
        m = res.metrics
        log(f"{label or server.name} c={workload.concurrency} repeat {i + 1}/{repeats}: "
                  f"{m.get('output_throughput', float('nan')):.1f} tok/s, TPOT p50 {m.get('tpot_ms_p50', float('nan')):.1f} ms, "
                  f"{int(m['num_failed'])} failed ({time.monotonic() - t0:.1f}s)")
        note_repeat(res)  # the running test's per-request records (kimi_perf.results)
        check_errors(server, res, label or server.name, max_error_rate)
        results.append(res)
    return results


def check_errors(server: RunningServer, res: BenchResult, label: str, max_error_rate: float = 0.0) -> None:
    """Raise :class:`BenchFailure` when a repeat's error rate exceeds ``max_error_rate`` (or a warm-up
    request failed), with the errors' causes and, if the server died, its exit code and log."""
    m = res.metrics
    rate = m["error_rate"]
    if not res.warmup_errors and rate <= max_error_rate:
        return
    causes: dict[str, int] = {}
    for e in [*res.errors, *res.warmup_errors]:
        causes[e[:200]] = causes.get(e[:200], 0) + 1
    death = server.death_note()
    raise BenchFailure(
        f"{label}: {int(m['num_failed'])}/{int(m['num_requests'])} requests failed "
        f"(error rate {rate:.1%} > allowed {max_error_rate:.1%})"
        + (f", {len(res.warmup_errors)} warm-up failures" if res.warmup_errors else "")
        + "; metrics below are from completed requests only. Causes:\n  "
        + "\n  ".join(f"{n}x {c}" for c, n in causes.items())
        + (f"\n{death}" if death else ""))


def samples_of(results: Sequence[BenchResult], metrics: Sequence[str]) -> dict[str, list[float]]:
    return {m: [r.metrics.get(m, float("nan")) for r in results] for m in metrics}
