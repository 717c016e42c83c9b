"""Recording results and deciding verdicts inside the test: the ``perf_gate`` recorder (:class:`PerfGate`).

Split out of :mod:`kimi_perf.plugin`: the gate decisions of a test (baseline comparison, confirming
re-measurement, A/B outcomes) are the plugin's core logic and read best apart from the pytest hooks.
"""

from __future__ import annotations

import json
import math
import time
import warnings
from collections.abc import Callable, Collection, Mapping, Sequence
from dataclasses import asdict, replace
from typing import TYPE_CHECKING, Any

import pytest

from .baselines import BaselineKey
from .metrics import METRICS, get_metric
from .results import drain, request_lines, write_requests
from .session import GateContext
from .stats import GateDecision, confirm_gate, gate

if TYPE_CHECKING:
    from .ab.decide import ABDecision
    from .ab.runner import ABOutcome

PROP = "kimi_perf"


def measured_with_mismatch(entry_extra: Mapping[str, Any] | None,
                           measured_with: Mapping[str, str] | None) -> tuple[str, str]:
    """(why the baseline is of something else, or ""; which of ``measured_with`` it does not name, or "").

    ``entry_extra`` is the stored entry's ``extra`` (its ``measured_with`` as the measuring run recorded
    it); see :meth:`PerfGate.check`."""
    if not measured_with or entry_extra is None:
        return "", ""
    stored = entry_extra.get("measured_with") or {}
    if not isinstance(stored, Mapping):
        stored = {}
    other = [f"the baseline was measured with {k} {stored[k]!r}, this run with {v!r}"
             for k, v in sorted(measured_with.items()) if k in stored and stored[k] != v]
    unnamed = [k for k in sorted(measured_with) if k not in stored]
    return "; ".join(other), (f"the baseline names no {', '.join(unnamed)} it was measured with "
                              "(re-record it with --perf-update-baselines)" if unnamed else "")


class PerfWarning(UserWarning):
    """A metric moved beyond tolerance without statistical support (verdict WARN)."""


class PerfRegression(AssertionError):
    """A gated metric regressed (verdict FAIL)."""



def unresolved_verdicts(user_properties: Sequence[tuple[str, Any]]) -> list[str]:
    """The WARN and INCONCLUSIVE verdicts among a test's recorded results (gate and A/B decisions), one
    line each with its reason: what ``--perf-strict`` fails on."""
    out = []
    for name, value in user_properties:
        if name != PROP:
            continue
        rec = json.loads(value) if isinstance(value, str) else value
        k = rec.get("key") or {}
        where = f"{k.get('scenario')} [{k.get('engine')} c={k.get('concurrency')}]"
        for d in rec.get("decisions") or []:
            if d.get("verdict") in ("WARN", "INCONCLUSIVE"):
                out.append(f"{where} {d.get('metric')}: {d['verdict']}: {d.get('reason')}")
        for d in (rec.get("ab") or {}).get("decisions") or []:
            if d.get("verdict") in ("WARN", "INCONCLUSIVE"):
                out.append(f"{where} A/B {d.get('metric')} [{d.get('probe')}]: {d['verdict']}: {d.get('reason')}")
    return out


def _finite(v: float) -> bool:
    return isinstance(v, (int, float)) and math.isfinite(v)


class PerfGate:
    """Per-test recorder: ``perf_gate.check(...)`` gates metrics against the stored baseline."""

    def __init__(self, ctx: GateContext, node: pytest.Item) -> None:
        self.ctx = ctx
        self.node = node
        self.decisions: list[GateDecision] = []
        self._seq = 0  # request files written by this test's checks

    def key(self, *, scenario: str, engine: str, model: str, workload: str, concurrency: int) -> BaselineKey:
        return BaselineKey(scenario=scenario, engine=engine, model=model, hardware=self.ctx.hardware,
                           workload=workload, concurrency=concurrency)

    def check(
        self,
        *,
        scenario: str,
        engine: str,
        model: str,
        workload: str,
        concurrency: int,
        samples: Mapping[str, Sequence[float]],
        gated: Sequence[str],
        engine_version: str | None = None,
        extra: Mapping[str, Any] | None = None,
        fail: bool = True,
        confirm: Callable[[], Mapping[str, Sequence[float]]] | None = None,
        dependent: Collection[str] = (),
        decided: Sequence[GateDecision] = (),
        measured_with: Mapping[str, str] | None = None,
    ) -> list[GateDecision]:
        """Gate ``samples`` against the stored baseline; raise :class:`PerfRegression` on a FAIL.

        ``confirm``: re-measures the same workload. When a gated metric FAILs, it is called once and
        the first and fresh samples are pooled (``stats.confirm_gate``): a FAIL must show in both
        measurements, and a first FAIL that does not repeat is a WARN with that reason. Shared CI
        runners have slowdowns that last tens of seconds (measured on a 2-core VM: single-stream decode
        at 11.4 tok/s for two repeats, then 16.6, same code), longer than one test's repeats, which no
        within-run statistic can see; a real regression shows in both measurements. The first
        measurement's samples and verdicts are kept in the run file.

        ``dependent``: gated metrics whose repeats are not independent samples (one deterministic
        decode read R times); gated as n=1 by magnitude (``stats.gate(independent=False)``).
        ``decided``: decisions the test made itself against a fixed bound (e.g. a same-run ratio's
        interval vs 1.0); recorded and reported with the others, FAIL raises, INCONCLUSIVE warns.
        ``measured_with``: what the figures depend on that the key does not name, e.g. ``{"drafter":
        identity}`` (:func:`kimi_perf.eagle3.shipped.drafter_identity`). It is kept in the record's
        ``extra``, so ``--perf-update-baselines`` stores it with the entry. A baseline that names another
        value is not compared: its metrics report NEW with both values, because one drafter's acceptance
        is no baseline for another's (a shipped 1.78 drafter once read "+36%, PASS" against the CI
        recipe's 1.31). A baseline that names none was recorded before this existed: compared, and the
        reason says it names none.
        """
        s = self.ctx
        measured = drain()  # the repeats the test measured for this check (kimi_perf.results)
        for m in [*samples, *gated]:
            get_metric(m)  # unknown metric name: a KeyError that lists the known ones
        missing = [m for m in gated if m not in samples]
        if missing:
            raise ValueError(f"gated metric(s) {missing} were not measured")
        key = self.key(scenario=scenario, engine=engine, model=model, workload=workload, concurrency=concurrency)
        entry = s.store.get(key)
        other, unnamed = measured_with_mismatch(entry.extra if entry is not None else None, measured_with)
        if other:
            entry = None  # reported as NEW below, with the reason
        # external reference figures (baselines provenance kind "external": typed in, not measured) leave
        # the gated list here and come back as REF decisions below, so they never trigger a confirming
        # re-measurement and never FAIL on magnitude (issue 16 item 2)
        refs = {m: entry.metrics[m] for m in gated if entry is not None and m in entry.metrics
                and (p := entry.metrics[m].provenance) is not None and p.external}
        gated = [m for m in gated if m not in refs]

        def base_of(m: str) -> Sequence[float] | None:
            return entry.metrics[m].samples if entry is not None and m in entry.metrics else None

        def decide(smp: Mapping[str, Sequence[float]]) -> list[GateDecision]:
            return [gate(METRICS[m], base_of(m), smp[m], s.gate.for_metric(m), independent=m not in dependent)
                    for m in gated]

        decisions = decide(samples)
        if other:
            decisions = [replace(d, reason=f"{other}: not compared (--perf-update-baselines records this run's)")
                         if d.verdict == "NEW" else d for d in decisions]
        confirmed_from = None
        confirming: list[Any] = []
        if confirm is not None and not s.update and any(d.verdict == "FAIL" for d in decisions):
            first = [d for d in decisions if d.verdict == "FAIL"]
            from .progress import log

            log(f"[{engine} c={concurrency}] {', '.join(d.metric for d in first)} FAIL on the first measurement "
                f"({'; '.join(d.message() for d in first)}); measuring again to confirm")
            confirmed_from = {"samples": {m: [float(v) for v in vals if _finite(v)] for m, vals in samples.items()},
                              "decisions": [asdict(d) for d in decisions]}
            again = confirm()
            confirming = drain()
            missing = [m for m in gated if m not in again]
            if missing:
                raise ValueError(f"the confirming measurement did not measure gated metric(s) {missing}")
            # pooled, not replaced: the recorded samples are what the reported decision used
            decisions = [confirm_gate(METRICS[m], base_of(m), samples[m], again[m], s.gate.for_metric(m),
                                      independent=m not in dependent) for m in gated]
            samples = {m: [*samples.get(m, []), *again.get(m, [])] for m in {**samples, **again}}
        if refs:
            from .stats import reference_comparison

            decisions += [reference_comparison(METRICS[m], r.samples, samples[m],
                                               source=(r.provenance.source if r.provenance else None) or "?",
                                               unknown=(r.provenance.unknown if r.provenance else None) or "?")
                          for m, r in refs.items()]
        if s.update:
            decisions = [replace(d, verdict="UPDATED", reason=f"recorded as baseline (was: {d.verdict}, {d.reason})")
                         for d in decisions]
            # a bound the test decided is no baseline: kept as decided, but nothing fails in update mode
            decisions += [replace(d, reason=f"{d.reason} (not raised: --perf-update-baselines)")
                          if d.verdict == "FAIL" else d for d in decided]
            decided = ()
        if unnamed and entry is not None:
            decisions = [replace(d, reason=f"{d.reason}; {unnamed}") if d.baseline is not None else d
                         for d in decisions]
        decisions = [*decisions, *decided]
        self.decisions += decisions
        if confirmed_from is not None:
            extra = {**(extra or {}), "first_measurement": confirmed_from}
        if measured_with:
            extra = {**(extra or {}), "measured_with": dict(measured_with)}
        record: dict[str, Any] = {
            "nodeid": self.node.nodeid, "key": key.as_dict(), "engine_version": engine_version,
            "baseline_engine_version": entry.engine_version if entry else None,
            "samples": {m: [float(v) for v in vals if _finite(v)] for m, vals in samples.items()},
            "decisions": [asdict(d) for d in decisions], "extra": dict(extra or {}), "time": time.time(),
        }
        if entry is not None:  # which run (or which external source) each baseline figure comes from
            record["baseline_provenance"] = {m: p.provenance.to_json() for m, p in entry.metrics.items()
                                             if p.provenance is not None}
        self._write_requests(record, measured, confirming)
        self.node.user_properties.append((PROP, json.dumps(record, default=str)))
        fails = [d for d in decisions if d.verdict == "FAIL"]
        for d in decisions:
            if d.verdict in ("WARN", "INCONCLUSIVE"):
                warnings.warn(PerfWarning(f"[{engine} c={concurrency}] {d.message()}"), stacklevel=2)
        if fails and fail and not s.update:
            ver = ""
            if entry is not None and entry.engine_version and engine_version and entry.engine_version != engine_version:
                ver = f" (engine version changed: baseline {entry.engine_version}, current {engine_version})"
            raise PerfRegression(
                f"performance regression in {scenario} [{engine}, c={concurrency}, {workload}]{ver}:\n  "
                + "\n  ".join(d.message() for d in fails))
        return decisions

    def _write_requests(self, record: dict[str, Any], first: Sequence[Any], confirming: Sequence[Any]) -> None:
        """Per-request JSONL of this check's repeats beside run.json, named in the record (the run file
        keeps the path, not the requests). Written here, in the process that measured them."""
        lines = [*request_lines(first, measurement="first"),
                 *request_lines(confirming, measurement="confirm", first_repeat=len(first))]
        if not lines:
            return
        self._seq += 1
        rel = write_requests(self.ctx.report_dir, self.node.nodeid, self._seq, lines)
        record["requests"] = {"file": rel, "count": len(lines), "repeats": len(first) + len(confirming)}

    def check_ab(self, outcome: ABOutcome, *, scenario: str, engine: str, model: str,
                 extra: Mapping[str, Any] | None = None, fail: bool = True) -> list[ABDecision]:
        """Record a same-run A/B outcome (every pair, every decision) and gate it: a FAIL raises
        :class:`PerfRegression` naming metric, direction, base, candidate, interval and threshold; an
        INCONCLUSIVE verdict is a :class:`PerfWarning` with its interval, never a silent pass."""
        s = self.ctx
        probes = outcome.probes
        key = self.key(scenario=scenario, engine=engine, model=model,
                       workload="+".join(p.workload.key for p in probes) or scenario,
                       concurrency=max((p.workload.concurrency for p in probes), default=1))
        ab = {**outcome.to_json(), "base_spec": s.ab_base}
        record: dict[str, Any] = {
            "nodeid": self.node.nodeid, "key": key.as_dict(), "engine_version": outcome.versions.get("candidate"),
            "baseline_engine_version": outcome.versions.get("base"), "samples": {}, "decisions": [],
            "ab": ab, "extra": dict(extra or {}), "time": time.time(),
        }
        self.node.user_properties.append((PROP, json.dumps(record, default=str)))
        for d in outcome.decisions:
            if d.verdict == "INCONCLUSIVE":
                warnings.warn(PerfWarning(f"[A/B {engine} vs {outcome.base_label}] {d.message()}"), stacklevel=2)
        fails = [d for d in outcome.decisions if d.verdict == "FAIL"]
        if fails and fail:
            raise PerfRegression(
                f"performance regression in {scenario} [{engine}]: candidate ({outcome.candidate_label}) vs base "
                f"({outcome.base_label}), measured in this run, {outcome.blocks} blocks, {outcome.wall_s:.0f}s:\n  "
                + "\n  ".join(d.message() for d in fails))
        return list(outcome.decisions)
