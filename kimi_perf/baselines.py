"""Stored baselines: ``baselines/<profile>.json``, one entry per measured key, samples kept.

Why samples and not just a number: the gate's Mann-Whitney test needs the baseline's repeat samples,
and a reviewer needs to see how noisy a baseline was when it was recorded. Why a strict schema: a
baseline file that silently fails to match (a typo in a metric name, a direction flipped) is a gate
that never fires. Loading validates everything and raises :class:`BaselineError` naming the file, the
entry and the fix; the plugin turns that into ``pytest.UsageError``.

Key: (scenario, engine, model, hardware, workload, concurrency). The engine *version* is stored with
each entry and printed next to the verdict but deliberately not part of the key: catching what an
engine upgrade does to throughput is the point of the gate, so a new version must compare against
the old version's numbers, not start from "no baseline".

Updates (``--perf-update-baselines``) are atomic: write a temp file in the same directory, fsync,
``os.replace``. A crash mid-write leaves the old file intact.
"""

from __future__ import annotations

import json
import math
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from .atomic import atomic_write_json  # re-exported: callers imported it from here
from .metrics import METRICS

SCHEMA_VERSION = 1
KEY_FIELDS = ("scenario", "engine", "model", "hardware", "workload", "concurrency")

__all__ = ["BaselineEntry", "BaselineError", "BaselineKey", "BaselineStore", "atomic_write_json", "entries_from_results"]


class BaselineError(ValueError):
    pass


@dataclass(frozen=True)
class BaselineKey:
    scenario: str
    engine: str
    model: str
    hardware: str
    workload: str
    concurrency: int

    def as_dict(self) -> dict[str, Any]:
        return {f: getattr(self, f) for f in KEY_FIELDS}

    def id(self) -> str:
        return "|".join(f"{f}={getattr(self, f)}" for f in KEY_FIELDS)


@dataclass(frozen=True)
class MetricSamples:
    unit: str
    direction: str
    samples: tuple[float, ...]

    @property
    def median(self) -> float:
        import numpy as np

        return float(np.median(self.samples)) if self.samples else float("nan")


@dataclass(frozen=True)
class BaselineEntry:
    key: BaselineKey
    metrics: Mapping[str, MetricSamples]
    engine_version: str | None = None
    recorded_at: str | None = None
    commit: str | None = None
    source: str | None = None
    machine: Mapping[str, Any] = field(default_factory=dict)
    extra: Mapping[str, Any] = field(default_factory=dict)

    def to_json(self) -> dict[str, Any]:
        return {
            "key": self.key.as_dict(),
            "engine_version": self.engine_version,
            "recorded_at": self.recorded_at,
            "commit": self.commit,
            "source": self.source,
            "machine": dict(self.machine),
            "metrics": {n: {"unit": m.unit, "direction": m.direction, "median": m.median, "samples": list(m.samples)}
                        for n, m in sorted(self.metrics.items())},
            **({"extra": dict(self.extra)} if self.extra else {}),
        }


def _err(path: Path, where: str, problem: str, fix: str) -> BaselineError:
    return BaselineError(f"{path}: {where}: {problem}. Fix: {fix}")


def _parse_entry(path: Path, i: int, raw: Any) -> BaselineEntry:
    where = f"entries[{i}]"
    if not isinstance(raw, dict):
        raise _err(path, where, f"must be an object, got {type(raw).__name__}", "each entry is {key, metrics, ...}")
    allowed = {"key", "engine_version", "recorded_at", "commit", "source", "machine", "metrics", "extra"}
    unknown = set(raw) - allowed
    if unknown:
        raise _err(path, where, f"unknown field(s) {sorted(unknown)}", f"allowed fields: {sorted(allowed)}")
    key = raw.get("key")
    if not isinstance(key, dict):
        raise _err(path, f"{where}.key", "missing or not an object", f"give {list(KEY_FIELDS)}")
    missing = [f for f in KEY_FIELDS if f not in key]
    extra = set(key) - set(KEY_FIELDS)
    if missing or extra:
        raise _err(path, f"{where}.key", f"missing {missing} / unknown {sorted(extra)}", f"key fields are exactly {list(KEY_FIELDS)}")
    for f in KEY_FIELDS[:-1]:
        if not isinstance(key[f], str) or not key[f]:
            raise _err(path, f"{where}.key.{f}", f"must be a non-empty string, got {key[f]!r}", "quote it")
    if isinstance(key["concurrency"], bool) or not isinstance(key["concurrency"], int) or key["concurrency"] < 1:
        raise _err(path, f"{where}.key.concurrency", f"must be an integer >= 1, got {key['concurrency']!r}", "e.g. 8")
    bkey = BaselineKey(**key)
    metrics_raw = raw.get("metrics")
    if not isinstance(metrics_raw, dict) or not metrics_raw:
        raise _err(path, f"{where}.metrics", "missing or empty", "map metric name -> {unit, direction, samples}")
    metrics: dict[str, MetricSamples] = {}
    for name, m in metrics_raw.items():
        mw = f"{where}.metrics.{name}"
        if name not in METRICS:
            raise _err(path, mw, f"unknown metric {name!r}", f"use one of kimi_perf.metrics.METRICS: {', '.join(sorted(METRICS))}")
        d = METRICS[name]
        if not isinstance(m, dict):
            raise _err(path, mw, "must be an object", "{unit, direction, samples}")
        bad = set(m) - {"unit", "direction", "samples", "median"}
        if bad:
            raise _err(path, mw, f"unknown field(s) {sorted(bad)}", "allowed: unit, direction, samples, median")
        if m.get("direction") != d.direction:
            raise _err(path, f"{mw}.direction", f"is {m.get('direction')!r} but {name} is {d.direction}-is-better",
                       f'set "direction": "{d.direction}"')
        if m.get("unit") != d.unit:
            raise _err(path, f"{mw}.unit", f"is {m.get('unit')!r} but {name} is measured in {d.unit}", f'set "unit": "{d.unit}"')
        samples = m.get("samples")
        if (not isinstance(samples, list) or not samples
                or not all(isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v) for v in samples)):
            raise _err(path, f"{mw}.samples", f"must be a non-empty list of finite numbers, got {samples!r}",
                       "re-record with --perf-update-baselines")
        metrics[name] = MetricSamples(d.unit, d.direction, tuple(float(v) for v in samples))
    for f in ("engine_version", "recorded_at", "commit", "source"):
        if raw.get(f) is not None and not isinstance(raw[f], str):
            raise _err(path, f"{where}.{f}", "must be a string or null", "quote it")
    return BaselineEntry(key=bkey, metrics=metrics, engine_version=raw.get("engine_version"),
                         recorded_at=raw.get("recorded_at"), commit=raw.get("commit"), source=raw.get("source"),
                         machine=raw.get("machine") or {}, extra=raw.get("extra") or {})


def load_file(path: Path) -> tuple[str, dict[str, BaselineEntry]]:
    try:
        raw = json.loads(path.read_text())
    except json.JSONDecodeError as e:
        raise BaselineError(f"{path}: not valid JSON (line {e.lineno} col {e.colno}: {e.msg}). "
                            "Fix: repair the file or restore it from git") from None
    if not isinstance(raw, dict):
        raise _err(path, "top level", "must be an object", '{"schema_version": 1, "profile": ..., "entries": [...]}')
    unknown = set(raw) - {"schema_version", "profile", "entries", "notes"}
    if unknown:
        raise _err(path, "top level", f"unknown field(s) {sorted(unknown)}", "allowed: schema_version, profile, entries, notes")
    if raw.get("schema_version") != SCHEMA_VERSION:
        raise _err(path, "schema_version", f"is {raw.get('schema_version')!r}, this kimi-perf reads {SCHEMA_VERSION}",
                   f'set "schema_version": {SCHEMA_VERSION} (or re-record)')
    profile = raw.get("profile")
    if not isinstance(profile, str) or not profile:
        raise _err(path, "profile", "missing", "name the profile this file belongs to")
    entries = raw.get("entries")
    if not isinstance(entries, list):
        raise _err(path, "entries", "missing or not a list", '"entries": []')
    out: dict[str, BaselineEntry] = {}
    for i, e in enumerate(entries):
        entry = _parse_entry(path, i, e)
        kid = entry.key.id()
        if kid in out:
            raise _err(path, f"entries[{i}]", f"duplicate key {kid}", "delete one of the two entries")
        out[kid] = entry
    return profile, out


class BaselineStore:
    """The baselines of one profile."""

    def __init__(self, path: Path, profile: str) -> None:
        self.path = path
        self.profile = profile
        self.entries: dict[str, BaselineEntry] = {}
        if path.exists():
            file_profile, self.entries = load_file(path)
            if file_profile != profile:
                raise BaselineError(f"{path}: profile is {file_profile!r} but the run uses profile {profile!r}. "
                                    f"Fix: rename the file to {file_profile}.json or correct its \"profile\"")

    def get(self, key: BaselineKey) -> BaselineEntry | None:
        return self.entries.get(key.id())

    def lookup_samples(self, key: BaselineKey, metric: str) -> tuple[float, ...] | None:
        e = self.get(key)
        if e is None or metric not in e.metrics:
            return None
        return e.metrics[metric].samples

    def updated(self, new_entries: Iterable[BaselineEntry]) -> dict[str, Any]:
        merged = dict(self.entries)
        for e in new_entries:
            old = merged.get(e.key.id())
            if old is not None:
                # keep metrics this run did not measure (e.g. a test that was deselected with -k)
                metrics = {**old.metrics, **e.metrics}
                e = BaselineEntry(key=e.key, metrics=metrics, engine_version=e.engine_version,
                                  recorded_at=e.recorded_at, commit=e.commit, source=e.source,
                                  machine=e.machine, extra=e.extra)
            merged[e.key.id()] = e
        ordered = [merged[k] for k in sorted(merged)]
        return {"schema_version": SCHEMA_VERSION, "profile": self.profile, "entries": [e.to_json() for e in ordered]}

    def write(self, new_entries: Iterable[BaselineEntry]) -> Path:
        data = self.updated(new_entries)
        atomic_write_json(self.path, data)
        _, self.entries = load_file(self.path)
        return self.path


def entries_from_results(results: Iterable[Mapping[str, Any]], *, commit: Mapping[str, Any],
                         machine: Mapping[str, Any]) -> list[BaselineEntry]:
    """Baseline entries for the measured results of one run (a session's records or a run.json's
    ``results``): what ``--perf-update-baselines`` writes and ``python -m kimi_perf.baselines record``
    replays from a run file. Only passed, non-A/B results qualify: in update mode regressions do not
    fail, so a failed test failed for another reason and its numbers are no baseline; an A/B outcome
    compares two sides of one run and is no baseline at all."""
    import time as _time

    # a baseline measured on uncommitted code must not claim the commit it was built on
    sha = commit.get("id")
    if sha and commit.get("dirty"):
        sha += "+dirty"
    entries = []
    for rec in results:
        if rec.get("outcome") != "passed" or rec.get("ab"):
            continue
        entries.append(BaselineEntry(
            key=BaselineKey(**rec["key"]),
            metrics={m: MetricSamples(METRICS[m].unit, METRICS[m].direction, tuple(v))
                     for m, v in rec["samples"].items() if v},
            engine_version=rec.get("engine_version"),
            recorded_at=_time.strftime("%Y-%m-%dT%H:%M:%SZ", _time.gmtime(rec.get("time", _time.time()))),
            commit=sha, source=f"measured by {rec['nodeid']}",
            machine={"cpu": machine.get("cpu"), "cpu_count": machine.get("cpu_count"),
                     "gpus": [g["name"] if isinstance(g, Mapping) else g for g in machine.get("gpus", [])]},
            extra=dict(rec.get("extra") or {}),
        ))
    return entries


def _cli(argv: list[str] | None = None) -> int:
    """``python -m kimi_perf.baselines keys|add``: list a profile's keys, or record an *externally
    measured* figure (another team's run, a vendor number) with its source, as a one-sample entry.
    Figures measured by this suite are recorded with ``pytest --perf-update-baselines`` instead."""
    import argparse
    import time as _time
    from pathlib import Path as _P

    from .metrics import METRICS as _M
    from .profiles import load_profile

    ap = argparse.ArgumentParser(prog="python -m kimi_perf.baselines")
    sub = ap.add_subparsers(dest="cmd", required=True)
    k = sub.add_parser("keys", help="print the throughput keys a profile's tests use")
    k.add_argument("--profile", required=True)
    a = sub.add_parser("add", help="add an externally measured figure")
    for f in ("profile", "scenario", "engine", "model", "hardware", "workload", "source"):
        a.add_argument(f"--{f}", required=True)
    a.add_argument("--concurrency", type=int, required=True)
    a.add_argument("--metric", action="append", required=True, help="NAME=VALUE[,VALUE...]")
    a.add_argument("--engine-version", default=None)
    a.add_argument("--dir", default="baselines")
    r = sub.add_parser("record", help="record the passed results of a run file (report dir's run.json) as "
                                      "baselines, as --perf-update-baselines would have at the end of that run")
    r.add_argument("run_json", help="run.json written by a pytest -m perf run")
    r.add_argument("--commit", default=None,
                   help="commit the run's code was (default: the run file's, '+dirty' when it was dirty)")
    r.add_argument("--dir", default="baselines")
    ns = ap.parse_args(argv)
    if ns.cmd == "record":
        run = json.loads(_P(ns.run_json).read_text())
        commit = dict(run.get("commit") or {})
        if ns.commit:
            commit = {"id": ns.commit, "dirty": False}
        entries = entries_from_results(run.get("results", []), commit=commit, machine=run.get("machine") or {})
        skipped = len(run.get("results", [])) - len(entries)
        store = BaselineStore(_P(ns.dir) / f"{run['profile']}.json", run["profile"])
        print(f"{store.write(entries)}: {len(entries)} entries recorded from {ns.run_json}"
              + (f" ({skipped} failed or A/B results left out)" if skipped else ""))
        return 0
    prof = load_profile(_P("profiles") / f"{ns.profile}.json")
    if ns.cmd == "keys":
        tp = prof.throughput
        if tp is None:
            return 0
        print(f"single_stream concurrency=1 workload={tp.single_stream.key}")
        for c in tp.concurrency:
            print(f"throughput_sweep concurrency={c} workload={tp.sweep_workload(c).key}")
        return 0
    metrics = {}
    for m in ns.metric:
        name, _, vals = m.partition("=")
        d = _M[name]
        metrics[name] = MetricSamples(d.unit, d.direction, tuple(float(v) for v in vals.split(",")))
    entry = BaselineEntry(key=BaselineKey(ns.scenario, ns.engine, ns.model, ns.hardware, ns.workload, ns.concurrency),
                          metrics=metrics, engine_version=ns.engine_version,
                          recorded_at=_time.strftime("%Y-%m-%dT%H:%M:%SZ", _time.gmtime()), source=ns.source)
    store = BaselineStore(_P(ns.dir) / f"{prof.name}.json", prof.name)
    print(store.write([entry]))
    return 0


if __name__ == "__main__":
    raise SystemExit(_cli())
