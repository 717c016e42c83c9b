"""Interleaved same-run A/B: base and candidate servers measured in ABBA blocks until a verdict.

Why interleave instead of "measure A, then measure B": the noise of a shared machine comes in
stretches (a neighbour's burst, a stalled vCPU for a few repeats, a slower host for the whole job), and
a comparison of two stretches measures the machine, not the change. Here every pair is two adjacent
repeats with identical prompts, one per side, and the side that goes first alternates (ABBA), so a
drift inside a block cancels in its mean. Servers are launched afresh every ``ab.blocks_per_launch``
blocks: a launch has its own luck (memory layout, thread placement) that stays with the server, so a
single launch per side is a persistent bias no number of repeats can average away. The launch order
alternates too (base first in round 0, candidate first in round 1, ...): on the H200 the side launched
second read ~1% faster on identical code, and a schedule where the base always launches first turns
that into a bias of the verdict. With launch rounds of several blocks the comparison stops only after
whole ABBA launch cycles (:meth:`ABSpec.balanced`), so the order effect cancels in the estimate.

With ``ab.retire_decided`` a probe whose gated metrics have all PASSED at a decision point is not
measured any more (:func:`_retire`): on one GPU the C=128 repeat is most of a block's time, and the
blocks that single-stream decode still needs then cost a fraction of the first ones.

With ``ab.pair_segments`` = k a pair is 2k segments of 1/k the output length, the sides in
Thue-Morse order (A B B A for k = 2; :func:`segment_order`), each side's record the mean of its
segments (:func:`merge_segments`): on a host whose CPU speed wanders within seconds a drift across
the pair no longer lands on the side measured second.

With ``ab.pin_cpus`` each side's server and the client run on disjoint CPU sets
(:mod:`kimi_perf.ab.pinning`), recorded with the launches.

The runner owns only the schedule; starting and stopping servers, making prompts and deciding are
given to it (:class:`Side`, ``prompts_for``, :func:`kimi_perf.ab.decide.decide`), so the pytest tests
and the power study (``python -m kimi_perf.power``) run exactly the same comparison.

Per repeat it records the client's metrics plus the engine's CPU time per output token and the host's
steal fraction (:mod:`kimi_perf.procstat`); a pair measured while steal exceeded ``ab.max_steal`` is
measured again (at most ``ab.max_redo`` times per block) and the report says how many were redone.
"""

from __future__ import annotations

import math
import os
import time
from collections.abc import Callable, Mapping, Sequence
from concurrent.futures import Executor, ThreadPoolExecutor
from dataclasses import asdict, dataclass, field, replace
from typing import Any, Protocol

from ..bench import BenchFailure, RunningServer, check_errors
from ..gpuclock import GpuClocks
from ..launcher import ServerError
from ..load.client import run_workload
from ..load.workload import Workload
from ..metrics import METRICS
from ..procstat import ProcessTreeCPU, host_cpu
from ..progress import log
from .config import TOP_MAX_GROWTH, ABSpec, probe_role
from .decide import ABDecision, decide, log_ratio
from .pinning import CPUPlan, plan_cpus
from .variance import flat_pairs, noise_note

__all__ = ["ABOutcome", "ABSideError", "PairRecord", "Probe", "Side", "launch_together", "measure_repeat",
           "merge_segments", "run_ab", "run_ab_prompts", "segment_order", "segment_workload", "size_for_window",
           "stop_reason"]


class Side(Protocol):
    """One side of the comparison: how to get its server running, and how to stop it."""

    role: str  # "base" | "candidate"
    label: str  # what it is, for messages: "git:HEAD~1 (abc1234)", "reference (this checkout)"

    def start(self, cpus: tuple[int, ...] = ()) -> RunningServer:
        """Launch the side's server (on the CPUs ``cpus`` when not empty)."""

    def stop(self) -> None: ...


@dataclass(frozen=True)
class Probe:
    """A workload measured on both sides every pair, and the metrics decided from it."""

    name: str  # "single_stream", "c8"
    workload: Workload
    gated: tuple[str, ...]
    reported: tuple[str, ...] = ()


@dataclass(frozen=True)
class PairRecord:
    block: int
    index: int
    probe: str
    first: str  # which side ran first: "base" or "candidate"
    base: dict[str, float]
    candidate: dict[str, float]
    redone: int = 0  # times this pair was measured again for host steal time
    launch: int = 0  # the launch round the pair's servers came from (ABSpec.launch_round)


@dataclass
class ABOutcome:
    """Everything measured and decided; kept (and written to run.json) even when a side failed."""

    base_label: str
    candidate_label: str
    spec: ABSpec
    probes: tuple[Probe, ...]
    pairs: list[PairRecord] = field(default_factory=list)
    decisions: list[ABDecision] = field(default_factory=list)
    launches: list[dict[str, Any]] = field(default_factory=list)
    versions: dict[str, str | None] = field(default_factory=dict)
    blocks: int = 0
    wall_s: float = 0.0
    stopped: str = ""
    error: str | None = None
    cpus: dict[str, Any] = field(default_factory=dict)  # the CPU plan (pinning) or why there is none
    retired: dict[str, int] = field(default_factory=dict)  # probe -> blocks it ran (ab.retire_decided)
    sized: dict[str, dict[str, Any]] = field(default_factory=dict)  # probe -> its sizing (ab.top_min_steady_s)

    @property
    def verdicts(self) -> dict[str, str]:
        return {f"{d.probe}:{d.metric}": d.verdict for d in self.decisions}

    def samples(self, role: str, probe: str, metric: str) -> list[float]:
        return [getattr(p, role).get(metric, float("nan")) for p in self.pairs if p.probe == probe]

    def block_log_ratios(self, probe: str, metric: str) -> list[list[float]]:
        out: dict[int, list[float]] = {}
        for p in self.pairs:
            if p.probe == probe:
                out.setdefault(p.block, []).append(log_ratio(p.base.get(metric, float("nan")),
                                                             p.candidate.get(metric, float("nan"))))
        return [out[b] for b in sorted(out)]

    def to_json(self) -> dict[str, Any]:
        return {
            "base": self.base_label, "candidate": self.candidate_label, "spec": _jsonable(asdict(self.spec)),
            "probes": [{"name": p.name, "workload": p.workload.to_dict(), "gated": list(p.gated)} for p in self.probes],
            "pairs": [asdict(p) for p in self.pairs], "decisions": [asdict(d) for d in self.decisions],
            "launches": self.launches, "versions": self.versions, "blocks": self.blocks,
            "wall_s": self.wall_s, "stopped": self.stopped, "error": self.error, "cpus": self.cpus,
            "retired": self.retired, "sized": self.sized,
        }


def _jsonable(d: dict[str, Any]) -> dict[str, Any]:
    return {k: (dict(v) if hasattr(v, "items") else list(v) if isinstance(v, tuple) else v) for k, v in d.items()}


class ABSideError(RuntimeError):
    """One side could not be measured (did not start, died, requests failed). Carries the partial
    outcome so nothing measured is lost."""

    def __init__(self, role: str, label: str, cause: str, fix: str, outcome: ABOutcome) -> None:
        super().__init__(f"A/B {role} side [{label}]: {cause}\nFix: {fix}")
        self.role = role
        self.outcome = outcome


_FIX = {
    "base": ("the base is what the candidate is compared against: check that it still starts on this machine "
             "(its server log above), or pick another base (--perf-ab NAME|same|git:REF)"),
    "candidate": "the candidate (this checkout) did not run: fix it first; its log is above",
}


def _side_error(out: ABOutcome, role: str, label: str, error: str, cause: str) -> ABSideError:
    """Record on ``out`` why ``role`` could not be measured (``out.error``) and return the error to
    raise, which carries the outcome so far and the side's fix."""
    out.error = f"{role} {error}"
    return ABSideError(role, label, cause, _FIX[role], out)


def _pgid(server: RunningServer | None) -> int | None:
    if server is None or server.process is None or server.process.pid is None:
        return None
    try:
        return os.getpgid(server.process.pid)
    except ProcessLookupError:
        return None


def measure_repeat(server: RunningServer, workload: Workload, prompts: Sequence[Sequence[int]],
                   *, label: str = "", max_error_rate: float = 0.02, peer: RunningServer | None = None
                   ) -> dict[str, float]:
    """One repeat with the engine's CPU time and the host's steal fraction next to the client's metrics.
    ``peer``: the other A/B side's server, idle meanwhile; its CPU use (``peer_cpu_util``, in cores)
    shows a waiting engine that spins next to the measured one (SGLang without --sleep-on-idle)."""
    pgid, peer_pgid = _pgid(server), _pgid(peer)
    cpu = ProcessTreeCPU.begin(pgid) if pgid is not None else None
    peer_cpu = ProcessTreeCPU.begin(peer_pgid) if peer_pgid is not None else None
    h0 = host_cpu()
    t0 = time.monotonic()
    res = run_workload(server.base_url, server.model, prompts, workload, warmup_prompts=[], headers=server.headers)
    wall = time.monotonic() - t0
    h1 = host_cpu()
    cpu_s = cpu.elapsed() if cpu is not None else None
    peer_s = peer_cpu.elapsed() if peer_cpu is not None else None
    # a stray failed stream among a C=128 batch (e.g. random-weight output that detokenises to no
    # text) is counted, not fatal; a server that fails requests in earnest still stops the comparison
    check_errors(server, res, label, max_error_rate)
    m = {k: float(v) for k, v in res.metrics.items()}
    toks = m.get("total_output_tokens", 0.0)
    m["engine_cpu_ms_per_tok"] = cpu_s / toks * 1000 if (cpu_s is not None and toks) else float("nan")
    steal = h1.steal_fraction_since(h0) if (h0 is not None and h1 is not None) else None
    m["host_steal_fraction"] = float("nan") if steal is None else steal
    if peer is not None:
        m["peer_cpu_util"] = peer_s / wall if (peer_s is not None and wall > 0) else float("nan")
    return m


# counts add up over a side's segments; steal is a pair's worst (the redo rule asks for the worst)
_SEGMENT_SUMS = frozenset({"num_requests", "num_completed", "num_failed", "total_output_tokens",
                           "total_input_tokens", "duration_s"})


def segment_order(k: int) -> list[int]:
    """Which side (0 = the pair's first, 1 = its second) measures each of a pair's 2k segments: the
    Thue-Morse sequence (0 1 1 0 1 0 0 1 ...). Every even prefix of it is balanced, and its segments of
    either side share their centre of time, so a drift that is linear (or, at k = 4, quadratic) over
    the pair cancels in the difference of the sides' means."""
    return [bin(j).count("1") % 2 for j in range(2 * k)]


def segment_workload(workload: Workload, k: int) -> Workload:
    """One of a pair's k segments per side: the probe's requests with 1/k of its output length."""
    return workload if k == 1 else replace(workload, output_len=max(2, math.ceil(workload.output_len / k)))


def merge_segments(segments: Sequence[Mapping[str, float]]) -> dict[str, float]:
    """A side's record of a pair from its segments: counts summed, steal the worst, every other
    metric (rates, latencies, CPU per token, clocks) the mean of the segments, which is what makes a
    drift cancel between the sides (:func:`segment_order`). NaNs (a metric a segment could not
    measure) are left out of the mean; ``segments`` says how many were merged."""
    if len(segments) == 1:
        return dict(segments[0])
    out: dict[str, float] = {}
    for key in dict.fromkeys(k for s in segments for k in s):
        vals = [float(s[key]) for s in segments if key in s]
        finite = [v for v in vals if math.isfinite(v)]
        if key in _SEGMENT_SUMS:
            out[key] = float(sum(vals))
        elif key == "host_steal_fraction":
            out[key] = max(finite) if finite else float("nan")
        else:
            out[key] = sum(finite) / len(finite) if finite else float("nan")
    out["segments"] = float(len(segments))
    return out


def size_for_window(workload: Workload, windows: Mapping[str, float], min_steady_s: float) -> dict[str, Any]:
    """How many prompts ``workload`` needs for a steady window of ``min_steady_s`` seconds, given the
    windows one repeat of it had on each side (``steady_window_s``; NaN: C was never in flight).

    The window runs from the moment C requests are in flight to the first end after the last send, so
    it lasts about as long as the server takes for the N - C requests after the first batch: it grows
    linearly with N - C (vLLM's 0.86-1.13 s at 384 x 64 tokens, C=128 and ~19K tok/s is two to three
    requests' time, where N - C is two batches). A probe of a single batch (N = C, the CPU profile's C=8) still
    has a window of about one request, so it counts as one batch, not zero. The shorter side's window
    sets the size (both sides run the same prompts), rounded up to whole batches of C and at most
    ``TOP_MAX_GROWTH`` times the given size. Never shrinks: a profile's size is a floor."""
    n, c = workload.num_prompts, workload.concurrency
    seen = {k: float(v) for k, v in windows.items()}
    rec: dict[str, Any] = {"configured": n, "used": n, "min_steady_s": float(min_steady_s),
                           "steady_window_s": seen, "capped": False}
    missing = [k for k, w in seen.items() if not (math.isfinite(w) and w > 0)]
    if missing or not seen:
        rec["why"] = f"no steady window on {', '.join(missing)} ({n} prompts never had {c} in flight): kept {n}"
        return rec
    w = min(seen.values())
    if w >= min_steady_s:
        rec["why"] = f"steady window {w:.2f} s >= {min_steady_s:g} s: kept {n}"
        return rec
    need = c + math.ceil(max(n - c, c) * min_steady_s / w)
    need = -(-need // c) * c  # whole batches of C
    cap = n * TOP_MAX_GROWTH
    rec["used"], rec["capped"] = min(need, cap), need > cap
    rec["why"] = (f"steady window {w:.2f} s < {min_steady_s:g} s (ab.top_min_steady_s): {n} -> {rec['used']} prompts"
                  + (f" (capped at {TOP_MAX_GROWTH}x; {need} wanted)" if need > cap else ""))
    return rec


def run_ab(base: Side, candidate: Side, probes: Sequence[Probe], spec: ABSpec,
           prompts_for: Callable[[Workload, int], Sequence[Sequence[int]]], *,
           on_block: Callable[[ABOutcome], None] | None = None) -> ABOutcome:
    """Measure blocks until every gated metric is decided, one FAILs, or the budget is spent."""
    out = ABOutcome(base_label=base.label, candidate_label=candidate.label, spec=spec, probes=tuple(probes))
    family = sum(len(p.gated) for p in probes)
    t0 = time.monotonic()
    sides = {"base": base, "candidate": candidate}
    running: dict[str, RunningServer] = {}
    pair_serial = 0
    plan = plan_cpus(sorted(os.sched_getaffinity(0)), client=spec.client_cpus) if spec.pin_cpus else None
    out.cpus = plan.to_json() if plan is not None else {"pinned": False, "why": "ab.pin_cpus is false"}
    if plan is not None:
        log(f"A/B CPU pinning: {plan.describe()}")

    # parallel launches spawn from worker threads that must live as long as the servers (see
    # launch_together): one pool for the whole comparison, shut down after the servers are stopped
    launcher = (ThreadPoolExecutor(max_workers=2, thread_name_prefix="ab-launch") if spec.parallel_launch
                else None)

    def cpus_of(role: str) -> tuple[int, ...]:
        return plan.sides[role] if plan is not None and plan.pinned else ()

    def start(role: str) -> RunningServer:
        cpus = cpus_of(role)
        return sides[role].start(cpus) if cpus else sides[role].start()

    def started(role: str, block: int, srv: RunningServer | BaseException, t: float) -> None:
        """Record a launch (or turn its failure into the side's error); warm-ups come after."""
        if isinstance(srv, (ServerError, BenchFailure)):
            raise _side_error(out, role, sides[role].label, f"did not start: {srv}",
                              f"server did not start: {srv}") from None
        if isinstance(srv, BaseException):
            raise srv
        running[role] = srv
        out.versions[role] = srv.version
        _check_source(srv, role, sides[role], out)
        ready = getattr(srv.process, "ready_s", None)
        out.launches.append({"role": role, "block": block, "round": spec.launch_round(block), "ready_s": ready,
                             "wall_s": time.monotonic() - t, "cpus": list(cpus_of(role)),
                             "together": spec.parallel_launch})

    def launch_round(roles: tuple[str, str], block: int) -> None:
        if not spec.parallel_launch:
            for role in roles:
                t = time.monotonic()
                try:
                    srv: RunningServer | BaseException = start(role)
                except (ServerError, BenchFailure) as e:
                    srv = e
                started(role, block, srv, t)
                warm_up(role, block)
            return
        assert launcher is not None
        results = launch_together(roles, start, launcher)
        # every server that did start is registered before a failure is raised, so stop_all stops it
        for role in sorted(roles, key=lambda r: isinstance(results[r][0], BaseException)):
            started(role, block, *results[role])
        for role in roles:
            warm_up(role, block)

    def active() -> list[Probe]:
        return [p for p in probes if p.name not in out.retired]

    def warm_up(role: str, block: int) -> None:
        srv = running[role]
        for p in active():  # first-use costs (allocator growth, kernel selection) stay out of the pairs
            # one full batch of short requests: the probe's prefill and decode shapes, a few seconds
            warm_w = replace(p.workload, num_prompts=p.workload.concurrency, output_len=min(8, p.workload.output_len))
            try:
                measure_repeat(srv, warm_w, prompts_for(warm_w, 10_000 + block), label=f"{role} {p.name} warm-up",
                               max_error_rate=0.5)
            except BenchFailure as e:
                raise _side_error(out, role, sides[role].label, f"failed its warm-up: {e}", f"warm-up failed: {e}") from None

    # the workloads the pairs run: the probes' own, unless ab.top_min_steady_s sized one (size_top);
    # out.probes keeps the configured ones, which name the result (its key stays the profile's)
    work = {p.name: p.workload for p in probes}

    def size_top() -> None:
        """ab.top_min_steady_s: one discarded repeat of each top probe per side, after the first launch
        round's warm-ups, sets the size every pair of the comparison then runs."""
        assert spec.top_min_steady_s is not None
        for p in (p for p in probes if probe_role(p.name) == "top"):
            windows, prompts = {}, prompts_for(p.workload, 20_000)  # the same prompts on both sides
            for role in ("base", "candidate"):
                try:
                    m = measure_repeat(running[role], p.workload, prompts, label=f"{role} {p.name} sizing")
                except BenchFailure as e:
                    raise _side_error(out, role, sides[role].label, f"failed its sizing repeat: {e}",
                                      f"sizing repeat failed: {e}") from None
                windows[role] = m.get("steady_window_s", float("nan"))
            rec = size_for_window(p.workload, windows, spec.top_min_steady_s)
            out.sized[p.name] = rec
            work[p.name] = replace(p.workload, num_prompts=rec["used"])
            log(f"A/B sizing {p.name}: {rec['why']}")

    def stop_all() -> None:
        for role in list(running):
            sides[role].stop()
            running.pop(role)

    def one(role: str, probe: Probe, prompts: Sequence[Sequence[int]], workload: Workload | None = None
            ) -> dict[str, float]:
        try:
            other = running.get("candidate" if role == "base" else "base")
            t = time.monotonic()
            m = measure_repeat(running[role], workload or work[probe.name], prompts, label=f"A/B {role} {probe.name}",
                               peer=other)
            if clocks is not None:
                m.update(clocks.window(t, time.monotonic()))
            return m
        except BenchFailure as e:
            raise _side_error(out, role, sides[role].label, f"failed during measurement: {e}",
                              f"requests failed: {e}") from None

    def pair(first: str, second: str, probe: Probe, serial: int) -> dict[str, dict[str, float]]:
        """One pair: a repeat per side with the same prompts, or with ab.pair_segments = k, 2k segments
        of 1/k the length in Thue-Morse order, a side's i-th segment and the other's on the same prompts."""
        k = spec.pair_segments
        if k == 1:
            prompts = prompts_for(work[probe.name], serial)
            return {first: one(first, probe, prompts), second: one(second, probe, prompts)}
        seg_w = segment_workload(work[probe.name], k)
        segs: dict[str, list[dict[str, float]]] = {first: [], second: []}
        for who in segment_order(k):
            role = (first, second)[who]
            segs[role].append(one(role, probe, prompts_for(seg_w, 1_000_000 + serial * 16 + len(segs[role])), seg_w))
        return {role: merge_segments(ms) for role, ms in segs.items()}

    client_affinity = _pin_client(plan)
    # the GPU's SM clock and power during each repeat (none on a CPU box): a side that read slower
    # because the GPU clocked lower shows it in the noise table (kimi_perf.gpuclock says why)
    clocks = GpuClocks.start()
    try:
        for b in range(spec.max_blocks):
            order = ("base", "candidate") if b % 2 == 0 else ("candidate", "base")
            rnd = spec.launch_round(b)
            if b == 0 or (spec.blocks_per_launch and b % spec.blocks_per_launch == 0):
                stop_all()
                # alternate which side launches first, round by round (ABBA over launches)
                launch_round(("base", "candidate") if rnd % 2 == 0 else ("candidate", "base"), b)
                if b == 0 and spec.top_min_steady_s:
                    size_top()
            redo_left = spec.max_redo
            for i in range(max(spec.repeats_for(p.name) for p in probes)):
                first, second = order if i % 2 == 0 else order[::-1]
                for probe in (p for p in active() if i < spec.repeats_for(p.name)):
                    redone = 0
                    while True:
                        r = pair(first, second, probe, pair_serial)
                        steal = max((v for v in (r["base"]["host_steal_fraction"], r["candidate"]["host_steal_fraction"])
                                     if math.isfinite(v)), default=0.0)
                        if steal <= spec.max_steal or redo_left <= 0:
                            break
                        redo_left -= 1
                        redone += 1
                        log(f"A/B block {b + 1} pair {i + 1} {probe.name}: host steal {steal:.1%} > "
                            f"{spec.max_steal:.0%} (ab.max_steal): measuring the pair again")
                    out.pairs.append(PairRecord(b, i, probe.name, first, r["base"], r["candidate"], redone, rnd))
                    pair_serial += 1
                    log(f"A/B block {b + 1}/{spec.max_blocks} pair {i + 1}/{spec.repeats_for(probe.name)} {probe.name}: "
                        + ", ".join(f"{m} base {r['base'].get(m, float('nan')):.4g} candidate "
                                    f"{r['candidate'].get(m, float('nan')):.4g}" for m in probe.gated)
                        + f" ({time.monotonic() - t0:.0f}s)")
            out.blocks = b + 1
            # a spent time budget ends the comparison where an ABBA launch cycle ends (at most k - 1
            # blocks later), so the last verdict is not left to the launch order either
            final = b + 1 >= spec.max_blocks or (spec.time_budget_s is not None and spec.balanced(b + 1)
                                                 and time.monotonic() - t0 >= spec.time_budget_s)
            out.decisions = _decide_all(out, family, final=final)
            out.wall_s = time.monotonic() - t0
            _log_block(out)
            if on_block is not None:
                on_block(out)
            out.stopped = stop_reason(out.decisions, out.blocks, spec, final=final,
                                      time_spent=b + 1 < spec.max_blocks)
            if out.stopped:
                break
            if spec.retire_decided:
                _retire(out, b + 1)
        if out.stopped and out.decisions and not any(d.verdict == "FAIL" for d in out.decisions):
            out.decisions = _decide_all(out, family, final=True)
    finally:
        stop_all()
        if launcher is not None:
            launcher.shutdown(wait=True)
        if clocks is not None:
            clocks.close()
        _unpin_client(client_affinity)
        out.wall_s = time.monotonic() - t0
    return out


def launch_together(roles: Sequence[str], start: Callable[[str], RunningServer], executor: Executor, *,
                    every_s: float = 10.0, stagger_s: float = 0.5) -> dict[str, tuple[RunningServer | BaseException, float]]:
    """Start every side at once (``ab.parallel_launch``): each side's blocking ``start`` runs on its own
    worker of ``executor``, submitted in ``roles`` order (so the ABBA launch order still says who went
    first), while this thread waits and prints progress -- progress lines from worker threads bypass
    pytest's capture suspension (:mod:`kimi_perf.progress`), so the waiting is reported from here.
    Returns, per role, the server or the exception its start raised, and the time its start began.
    Starts are ``stagger_s`` apart: without it the threads raced and the side due second was often
    spawned first (seen on the CPU box), which would turn the ABBA launch order into a coin toss.

    The executor must outlive the servers: a server's parent-death signal (``PR_SET_PDEATHSIG``, see
    :mod:`kimi_perf.launcher`) fires when the *thread* that spawned it exits, so a pool shut down after
    the launch would kill the servers it started (found by this module's test: SIGTERM before warm-up)."""
    from concurrent.futures import wait

    t0 = time.monotonic()
    futs = {}
    for i, role in enumerate(roles):
        if i:
            time.sleep(stagger_s)
        futs[role] = (executor.submit(start, role), time.monotonic())
    pending = {f for f, _ in futs.values()}
    while pending:
        _done, pending = wait(pending, timeout=every_s)
        if pending:
            waiting = [r for r, (f, _) in futs.items() if f in pending]
            log(f"A/B launching {' and '.join(roles)} together: waiting for {', '.join(waiting)} "
                f"({time.monotonic() - t0:.0f}s)")
    results: dict[str, tuple[RunningServer | BaseException, float]] = {}
    for role, (f, t) in futs.items():
        e = f.exception()
        results[role] = (e if e is not None else f.result(), t)
    return results


def _pin_client(plan: CPUPlan | None) -> set[int] | None:
    """Move the measuring thread (the client's event loop runs in it) onto the plan's client CPUs;
    returns the affinity to restore, None when nothing was changed."""
    if plan is None or not plan.pinned:
        return None
    before = os.sched_getaffinity(0)
    os.sched_setaffinity(0, plan.client)
    return before


def _unpin_client(before: set[int] | None) -> None:
    if before is not None:
        os.sched_setaffinity(0, before)


def _check_source(srv: RunningServer, role: str, side: Side, out: ABOutcome) -> None:
    """A server that must run another source tree (a git base) says which one it runs; comparing the
    candidate with itself while the report says "HEAD~1" would be the worst silent failure of a gate."""
    from pathlib import Path

    want = getattr(srv.config, "source_root", None)
    if not want:
        return
    try:
        got = srv.get_json("/server_info", timeout=30).get("source_root")
    except (OSError, ValueError, AttributeError):
        got = None
    if got is None:
        log(f"A/B {role}: the server does not report its source root (a commit older than that report): "
            f"started in {want} with it first on PYTHONPATH")
        return
    if Path(got).resolve() != Path(want).resolve():
        out.error = f"{role} runs {got}, not {want}"
        raise ABSideError(role, side.label, f"the server runs the code in {got}, not the worktree {want}",
                          "the base must import kimi_perf from its worktree: report this as a bug", out)


def run_ab_prompts(base: Side, candidate: Side, prompts: Sequence[Sequence[int]], metric: str, spec: ABSpec,
                   measure: Callable[[RunningServer, Sequence[int]], float], *, probe: str) -> ABOutcome:
    """A/B of a metric that is deterministic for a given prompt (EAGLE-3 accept length under greedy
    decoding): repeats would only copy the same number, so the replication unit is the *prompt*. Each
    prompt is measured once per side (the side going first alternates) and is its own block; the
    interval says how the candidate/base ratio varies over the prompt population. Servers are launched
    once: a launch cannot change a deterministic count."""
    w = Workload(name=probe, dataset="mtbench", input_len=max(len(p) for p in prompts), num_prompts=len(prompts))
    pr = Probe(name=probe, workload=w, gated=(metric,))
    out = ABOutcome(base_label=base.label, candidate_label=candidate.label, spec=spec, probes=(pr,))
    sides = {"base": base, "candidate": candidate}
    running: dict[str, RunningServer] = {}
    t0 = time.monotonic()
    try:
        for role in ("base", "candidate"):
            t = time.monotonic()
            try:
                running[role] = sides[role].start()
            except ServerError as e:
                raise _side_error(out, role, sides[role].label, f"did not start: {e}", f"server did not start: {e}") from None
            out.versions[role] = running[role].version
            _check_source(running[role], role, sides[role], out)
            out.launches.append({"role": role, "block": 0, "wall_s": time.monotonic() - t,
                                 "ready_s": getattr(running[role].process, "ready_s", None)})
        for i, p in enumerate(prompts):
            order = ("base", "candidate") if i % 2 == 0 else ("candidate", "base")
            vals = {}
            for role in order:
                try:
                    vals[role] = float(measure(running[role], p))
                except (BenchFailure, RuntimeError, OSError) as e:
                    raise _side_error(out, role, sides[role].label, f"failed on prompt {i}: {e}",
                                      f"measurement failed: {e}") from None
            out.pairs.append(PairRecord(i, 0, probe, order[0], {metric: vals["base"]}, {metric: vals["candidate"]}))
            out.blocks = i + 1
        out.decisions = _decide_all(out, 1, final=True)
        out.stopped = f"all {len(prompts)} prompts measured"
    finally:
        for role in list(running):
            sides[role].stop()
        out.wall_s = time.monotonic() - t0
    _log_block(out)
    return out


def stop_reason(decisions: Sequence[ABDecision], blocks: int, spec: ABSpec, *, final: bool,
                time_spent: bool = False) -> str:
    """Why the comparison stops after ``blocks`` blocks ("" = measure another block). One FAIL is
    enough for a merge gate; a PASS needs every metric decided. With launch rounds of several blocks
    a verdict is reached only at the end of an ABBA launch cycle (``spec.balanced``): stopping after
    the first round would keep whatever the launch order did to it."""
    if blocks >= spec.min_blocks and spec.balanced(blocks):
        if any(d.verdict == "FAIL" for d in decisions):
            return "a gated metric FAILED"
        if all(d.verdict == "PASS" for d in decisions):
            return "every gated metric decided"
    if final:
        return "time budget (ab.time_budget_s) spent" if time_spent else "block budget (ab.max_blocks) spent"
    return ""


def _retire(out: ABOutcome, blocks: int) -> None:
    """``ab.retire_decided``: after a decision point, stop measuring every probe whose gated metrics
    have all PASSED. Its pairs stop growing, so each later look recomputes the same interval and the
    same PASS: the verdict stands from its first crossing, as a FAIL's does. The probes still
    measured lose only a neighbour in time (the retired probe's repeats no longer run between theirs),
    which is what direct trials of a retiring policy check."""
    s = out.spec
    if blocks < s.min_blocks or not s.balanced(blocks):
        return
    for p in out.probes:
        ds = [d for d in out.decisions if d.probe == p.name]
        if p.name not in out.retired and ds and all(d.verdict == "PASS" for d in ds):
            out.retired[p.name] = blocks
            log(f"A/B {p.name}: every gated metric PASSED after {blocks} blocks; not measured any more "
                "(ab.retire_decided)")


def _decide_all(out: ABOutcome, family: int, *, final: bool) -> list[ABDecision]:
    s = out.spec
    ds = [decide(METRICS[m], p.name, out.block_log_ratios(p.name, m), out.samples("base", p.name, m),
                 out.samples("candidate", p.name, m), threshold=s.threshold_for(m), alpha=s.alpha, family=family,
                 min_blocks=s.min_blocks, final=final)
          for p in out.probes for m in p.gated]
    if final and any(d.verdict == "INCONCLUSIVE" for d in ds):
        # an undecided final verdict says where its noise sat and what would cut it (variance.noise_note)
        flat = flat_pairs([asdict(p) for p in out.pairs])
        ds = [replace(d, reason=f"{d.reason}; {note}") if d.verdict == "INCONCLUSIVE"
              and (note := noise_note(flat, d.probe, d.metric)) else d for d in ds]
    return ds


def _log_block(out: ABOutcome) -> None:
    parts = [f"{d.metric}[{d.probe}] " + (f"x{d.ratio:.3f} [{d.ratio_lo:.3f}, {d.ratio_hi:.3f}] {d.verdict}"
                                          if math.isfinite(d.ratio) else "no interval yet")
             for d in out.decisions]
    log(f"A/B block {out.blocks}/{out.spec.max_blocks} ({out.wall_s:.0f}s): " + "; ".join(parts))
