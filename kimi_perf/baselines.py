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
validate it with the loader, ``os.replace``. A crash mid-write leaves the old file intact, and a write
the loader would reject never replaces it. They are also merged under a lock: two runs updating one
profile at once (two jobs on a runner) each re-read the file under an ``flock`` of the baselines
directory and apply only their own entries, so neither reverts the other's; where both measured the
same metric of the same key, the later write wins and says so (:attr:`BaselineStore.conflicts`, shown
in the summary).

Provenance is kept per metric (schema 2): an update that measures only some of an entry's metrics (a
``-k`` selection, a test that did not run) keeps the others, and those must keep saying which commit,
machine and source produced *them*, not the run that happened to touch the entry last. The entry-level
``commit`` / ``source`` / ``machine`` / ``recorded_at`` describe that last write only. A metric without
a commit says why (``no_commit_reason``).

External reference figures (``provenance.kind == "external"``): a number typed in from another team's
report or an engine's documentation, one sample, on a workload and with a metric definition this suite
did not control. It is keyed to this suite's workload so it is shown next to the measurement, but the
plugin compares it without gating (verdict ``REF``, :func:`kimi_perf.stats.reference_comparison`): a
figure whose workload is unknown cannot make a run fail. Its ``unknown`` field says what is not known.
The next measured re-recording (``--perf-update-baselines``) replaces it metric by metric.

Schema-1 files (no per-metric provenance) still load: each metric inherits the entry's fields.
"""

from __future__ import annotations

import json
import math
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

from .atomic import atomic_write_json, locked_dir  # atomic_write_json re-exported: callers imported it here
from .metrics import METRICS

SCHEMA_VERSION = 2
# schema 1 is schema 2 without per-metric provenance; reading it stays supported so files recorded
# before provenance was per metric need no migration (the next write upgrades them)
READABLE_SCHEMAS = (1, 2)
PROVENANCE_KINDS = ("measured", "external")
# what a metric of a schema-1 entry without a commit says when the file never said why
LEGACY_NO_COMMIT = "recorded by a schema-1 kimi-perf that stored no commit and no reason"
KEY_FIELDS = ("scenario", "engine", "model", "hardware", "workload", "concurrency")

__all__ = ["BaselineEntry", "BaselineError", "BaselineKey", "BaselineStore", "MetricSamples", "Provenance",
           "atomic_write_json", "entries_from_results"]


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
class Provenance:
    """Where one metric's samples come from.

    ``kind``: ``"measured"`` (by this suite, gated) or ``"external"`` (a figure typed in from elsewhere:
    compared and shown, never gated; ``unknown`` says what about it is not known, e.g. the workload or
    whether "tok/s" meant output or decode tok/s). ``no_commit_reason`` is required when ``commit`` is
    None, so a baseline that cannot be traced to code says why.
    """

    kind: str = "measured"
    commit: str | None = None
    no_commit_reason: str | None = None
    source: str | None = None
    recorded_at: str | None = None
    machine: Mapping[str, Any] = field(default_factory=dict)
    engine_version: str | None = None
    unknown: str | None = None

    def __post_init__(self) -> None:
        if self.kind not in PROVENANCE_KINDS:
            raise ValueError(f"provenance kind {self.kind!r} is not one of {PROVENANCE_KINDS}")
        if self.commit is None and not self.no_commit_reason:
            raise ValueError("a metric recorded without a commit must say why (no_commit_reason)")
        if self.kind == "external" and (not self.source or not self.unknown):
            raise ValueError("an external figure needs its source and what is unknown about it (unknown)")

    @property
    def external(self) -> bool:
        return self.kind == "external"

    def to_json(self) -> dict[str, Any]:
        out: dict[str, Any] = {"kind": self.kind, "commit": self.commit}
        if self.commit is None:
            out["no_commit_reason"] = self.no_commit_reason
        out |= {"source": self.source, "recorded_at": self.recorded_at, "machine": dict(self.machine),
                "engine_version": self.engine_version}
        if self.unknown is not None:
            out["unknown"] = self.unknown
        return out


@dataclass(frozen=True)
class MetricSamples:
    unit: str
    direction: str
    samples: tuple[float, ...]
    # None only on an entry under construction: the store fills it from the entry's fields
    # (BaselineEntry.with_provenance) before it is written, and every loaded metric has one
    provenance: Provenance | None = None

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
    # why the entry-level commit is None (the last write's); each metric's provenance has its own
    no_commit_reason: str | None = None

    def entry_provenance(self) -> Provenance:
        """The provenance the entry-level fields describe (what a metric without its own inherits)."""
        return Provenance(kind="measured", commit=self.commit,
                          no_commit_reason=None if self.commit else (self.no_commit_reason or LEGACY_NO_COMMIT),
                          source=self.source, recorded_at=self.recorded_at, machine=dict(self.machine),
                          engine_version=self.engine_version)

    def with_provenance(self) -> BaselineEntry:
        """This entry with every metric's provenance filled in (from the entry's fields where missing)."""
        if all(m.provenance is not None for m in self.metrics.values()):
            return self
        inherited = self.entry_provenance()
        return replace(self, metrics={n: m if m.provenance is not None else replace(m, provenance=inherited)
                                      for n, m in self.metrics.items()})

    def to_json(self) -> dict[str, Any]:
        e = self.with_provenance()
        return {
            "key": self.key.as_dict(),
            "engine_version": self.engine_version,
            "recorded_at": self.recorded_at,
            "commit": self.commit,
            **({"no_commit_reason": self.no_commit_reason} if self.commit is None and self.no_commit_reason else {}),
            "source": self.source,
            "machine": dict(self.machine),
            "metrics": {n: {"unit": m.unit, "direction": m.direction, "median": m.median, "samples": list(m.samples),
                            "provenance": m.provenance.to_json()}  # type: ignore[union-attr]
                        for n, m in sorted(e.metrics.items())},
            **({"extra": dict(self.extra)} if self.extra else {}),
        }


def _err(path: Path, where: str, problem: str, fix: str) -> BaselineError:
    return BaselineError(f"{path}: {where}: {problem}. Fix: {fix}")


_PROVENANCE_FIELDS = frozenset({"kind", "commit", "no_commit_reason", "source", "recorded_at", "machine",
                                "engine_version", "unknown"})


def _parse_provenance(path: Path, where: str, raw: Any) -> Provenance:
    if not isinstance(raw, dict):
        raise _err(path, where, "must be an object", f"give {sorted(_PROVENANCE_FIELDS)}")
    bad = set(raw) - _PROVENANCE_FIELDS
    if bad:
        raise _err(path, where, f"unknown field(s) {sorted(bad)}", f"allowed: {', '.join(sorted(_PROVENANCE_FIELDS))}")
    for f in _PROVENANCE_FIELDS - {"machine"}:
        if raw.get(f) is not None and not isinstance(raw[f], str):
            raise _err(path, f"{where}.{f}", "must be a string or null", "quote it")
    kind = raw.get("kind", "measured")
    if kind not in PROVENANCE_KINDS:
        raise _err(path, f"{where}.kind", f"is {kind!r}", f"use one of {list(PROVENANCE_KINDS)}")
    if raw.get("commit") is None and not raw.get("no_commit_reason"):
        raise _err(path, where, "no commit and no no_commit_reason",
                   "give the commit that measured it, or say in no_commit_reason why there is none")
    if kind == "external" and (not raw.get("source") or not raw.get("unknown")):
        raise _err(path, where, "an external figure without its source or without what is unknown about it",
                   'give "source" (where the figure comes from) and "unknown" (workload, metric definition, '
                   "machine: what this suite does not know about it)")
    return Provenance(kind=kind, commit=raw.get("commit"), no_commit_reason=raw.get("no_commit_reason"),
                      source=raw.get("source"), recorded_at=raw.get("recorded_at"),
                      machine=raw.get("machine") or {}, engine_version=raw.get("engine_version"),
                      unknown=raw.get("unknown"))


def _parse_entry(path: Path, i: int, raw: Any, schema: int = SCHEMA_VERSION) -> BaselineEntry:
    where = f"entries[{i}]"
    if not isinstance(raw, dict):
        raise _err(path, where, f"must be an object, got {type(raw).__name__}", "each entry is {key, metrics, ...}")
    allowed = {"key", "engine_version", "recorded_at", "commit", "source", "machine", "metrics", "extra"}
    if schema >= 2:
        allowed.add("no_commit_reason")
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
        fields = {"unit", "direction", "samples", "median"} | ({"provenance"} if schema >= 2 else set())
        bad = set(m) - fields
        if bad:
            raise _err(path, mw, f"unknown field(s) {sorted(bad)}", f"allowed: {', '.join(sorted(fields))}"
                       + (" (per-metric provenance needs \"schema_version\": 2)" if "provenance" in bad else ""))
        if m.get("direction") != d.direction:
            raise _err(path, f"{mw}.direction", f"is {m.get('direction')!r} but {name} is {d.direction}-is-better",
                       f'set "direction": "{d.direction}"')
        if m.get("unit") != d.unit:
            raise _err(path, f"{mw}.unit", f"is {m.get('unit')!r} but {name} is measured in {d.unit}", f'set "unit": "{d.unit}"')
        samples = m.get("samples")
        if (not isinstance(samples, list) or not samples
                or not all(isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v) for v in samples)):
            # --perf-update-baselines loads the file before it rewrites it, so it cannot be the fix here
            raise _err(path, f"{mw}.samples", f"must be a non-empty list of finite numbers, got {samples!r}",
                       f"repair the samples of {mw} in {path}, or delete that metric (or the whole {where}) "
                       "from the file and re-record it with --perf-update-baselines")
        prov = _parse_provenance(path, f"{mw}.provenance", m["provenance"]) if "provenance" in m else None
        metrics[name] = MetricSamples(d.unit, d.direction, tuple(float(v) for v in samples), prov)
    for f in ("engine_version", "recorded_at", "commit", "source", "no_commit_reason"):
        if raw.get(f) is not None and not isinstance(raw[f], str):
            raise _err(path, f"{where}.{f}", "must be a string or null", "quote it")
    entry = BaselineEntry(key=bkey, metrics=metrics, engine_version=raw.get("engine_version"),
                          recorded_at=raw.get("recorded_at"), commit=raw.get("commit"), source=raw.get("source"),
                          machine=raw.get("machine") or {}, extra=raw.get("extra") or {},
                          no_commit_reason=raw.get("no_commit_reason"))
    # a metric without its own provenance (every metric of a schema-1 file) inherits the entry's
    return entry.with_provenance()


def load_file(path: Path) -> tuple[str, dict[str, BaselineEntry]]:
    try:
        raw = json.loads(path.read_text())
    except (OSError, UnicodeDecodeError) as e:
        raise BaselineError(f"{path}: cannot be read ({type(e).__name__}: {e}). "
                            "Fix: it must be a readable JSON file; restore it from git") from None
    except json.JSONDecodeError as e:
        raise BaselineError(f"{path}: not valid JSON (line {e.lineno} col {e.colno}: {e.msg}). "
                            "Fix: repair the file or restore it from git") from None
    return parse_document(path, raw)


def parse_document(path: Path, raw: Any) -> tuple[str, dict[str, BaselineEntry]]:
    """Validate a baseline document already parsed from JSON (``path`` only names it in errors)."""
    if not isinstance(raw, dict):
        raise _err(path, "top level", "must be an object", '{"schema_version": 1, "profile": ..., "entries": [...]}')
    unknown = set(raw) - {"schema_version", "profile", "entries", "notes"}
    if unknown:
        raise _err(path, "top level", f"unknown field(s) {sorted(unknown)}", "allowed: schema_version, profile, entries, notes")
    schema = raw.get("schema_version")
    if schema not in READABLE_SCHEMAS:
        raise _err(path, "schema_version", f"is {schema!r}, this kimi-perf reads {list(READABLE_SCHEMAS)}",
                   f'set "schema_version": {SCHEMA_VERSION} (or re-record)')
    profile = raw.get("profile")
    if not isinstance(profile, str) or not profile:
        raise _err(path, "profile", "missing", "name the profile this file belongs to")
    entries = raw.get("entries")
    if not isinstance(entries, list):
        raise _err(path, "entries", "missing or not a list", '"entries": []')
    out: dict[str, BaselineEntry] = {}
    for i, e in enumerate(entries):
        entry = _parse_entry(path, i, e, schema)
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
        # metrics another writer replaced under this run's update (see write); shown in the summary
        self.conflicts: list[str] = []
        if path.exists():
            file_profile, self.entries = load_file(path)
            if file_profile != profile:
                raise BaselineError(f"{path}: profile is {file_profile!r} but the run uses profile {profile!r}. "
                                    f"Fix: rename the file to {file_profile}.json or correct its \"profile\"")
        # what this run read: a key that differs at write time was changed by another writer meanwhile
        self._loaded = {k: e.to_json() for k, e in self.entries.items()}

    def get(self, key: BaselineKey) -> BaselineEntry | None:
        return self.entries.get(key.id())

    def lookup_samples(self, key: BaselineKey, metric: str) -> tuple[float, ...] | None:
        e = self.get(key)
        if e is None or metric not in e.metrics:
            return None
        return e.metrics[metric].samples

    def updated(self, new_entries: Iterable[BaselineEntry],
                base: Mapping[str, BaselineEntry] | None = None) -> dict[str, Any]:
        """The document after applying ``new_entries`` to ``base`` (default: the entries as loaded)."""
        merged = {k: e.with_provenance() for k, e in (self.entries if base is None else base).items()}
        for e in new_entries:
            # the new metrics' provenance is this write's (filled from its entry fields when not given)
            e = e.with_provenance()
            old = merged.get(e.key.id())
            if old is not None:
                # keep metrics this run did not measure (e.g. a test that was deselected with -k), with
                # the provenance they were recorded with: the entry-level fields become this write's,
                # but a kept metric's commit, source and machine stay those that measured it
                e = replace(e, metrics={**old.metrics, **e.metrics})
            merged[e.key.id()] = e
        ordered = [merged[k] for k in sorted(merged)]
        return {"schema_version": SCHEMA_VERSION, "profile": self.profile, "entries": [e.to_json() for e in ordered]}

    def write(self, new_entries: Iterable[BaselineEntry]) -> Path:
        """Apply this run's entries to the file as it is *now*: under an exclusive lock of the baselines
        directory, re-read the file (another run may have written it since this one loaded it), merge,
        validate the result with the loader and replace atomically. A metric of a key that another
        writer changed since this run loaded the file is overwritten and listed in :attr:`conflicts`."""
        new_entries = list(new_entries)
        with locked_dir(self.path.parent):
            current: dict[str, BaselineEntry] = {}
            if self.path.exists():
                file_profile, current = load_file(self.path)
                if file_profile != self.profile:
                    raise BaselineError(f"{self.path}: profile changed to {file_profile!r} during the run "
                                        f"(this run uses {self.profile!r}). Fix: restore the file from git")
            self.conflicts = self._conflicts(current, new_entries)
            data = self.updated(new_entries, base=current)

            def check(tmp: Path) -> None:
                # the written bytes, read back by the loader every later run uses, named as the real file
                parse_document(self.path, json.loads(tmp.read_text()))

            atomic_write_json(self.path, data, validate=check)
            _, self.entries = load_file(self.path)
        self._loaded = {k: e.to_json() for k, e in self.entries.items()}
        return self.path

    def _conflicts(self, current: Mapping[str, BaselineEntry], new_entries: list[BaselineEntry]) -> list[str]:
        """The metrics this write replaces although another writer changed them after this run loaded
        the file: both runs measured them, the later write wins, and a person should know which."""
        out = []
        for e in new_entries:
            kid = e.key.id()
            now = current.get(kid)
            if now is None:
                continue
            before = self._loaded.get(kid, {}).get("metrics", {})
            theirs = now.to_json()["metrics"]
            changed = sorted(m for m in e.metrics if m in theirs and theirs[m] != before.get(m))
            if changed:
                src = "; ".join(sorted({str(theirs[m]["provenance"].get("source")) for m in changed}))
                out.append(f"{kid}: {', '.join(changed)} also updated by another run ({src}) since this run "
                           "read the file; this run's samples replaced them")
        return out


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
    # machine.commit_info returns {} where git finds no repository (e.g. a copy of the working tree)
    why = None if sha else ("the run found no git commit (machine.commit_info returned none: run from a copy "
                            "of the working tree without .git, or git missing)")
    mach = {"cpu": machine.get("cpu"), "cpu_count": machine.get("cpu_count"),
            "gpus": [g["name"] if isinstance(g, Mapping) else g for g in machine.get("gpus", [])]}
    entries = []
    for rec in results:
        if rec.get("outcome") != "passed" or rec.get("ab"):
            continue
        at = _time.strftime("%Y-%m-%dT%H:%M:%SZ", _time.gmtime(rec.get("time", _time.time())))
        prov = Provenance(kind="measured", commit=sha, no_commit_reason=why, source=f"measured by {rec['nodeid']}",
                          recorded_at=at, machine=mach, engine_version=rec.get("engine_version"))
        entries.append(BaselineEntry(
            key=BaselineKey(**rec["key"]),
            metrics={m: MetricSamples(METRICS[m].unit, METRICS[m].direction, tuple(v), prov)
                     for m, v in rec["samples"].items() if v},
            engine_version=rec.get("engine_version"), recorded_at=at, commit=sha, no_commit_reason=why,
            source=prov.source, machine=mach, extra=dict(rec.get("extra") or {}),
        ))
    return entries


def _cli(argv: list[str] | None = None) -> int:
    """``python -m kimi_perf.baselines keys|add|record``: list a profile's keys, record an *external
    reference figure* (another team's run, a vendor number) with its source and what is unknown about
    it, or record a run file's results. An external figure is compared and shown, never gated (see
    the module docstring); figures measured by this suite are recorded with ``pytest
    --perf-update-baselines`` (or ``record``) instead, and replace it."""
    import argparse
    import time as _time
    from pathlib import Path as _P

    from .metrics import METRICS as _M
    from .profiles import load_profile

    ap = argparse.ArgumentParser(prog="python -m kimi_perf.baselines")
    sub = ap.add_subparsers(dest="cmd", required=True)
    k = sub.add_parser("keys", help="print the throughput keys a profile's tests use")
    k.add_argument("--profile", required=True)
    a = sub.add_parser("add", help="add an external reference figure (compared and shown, never gated)")
    for f in ("profile", "scenario", "engine", "model", "hardware", "workload", "source"):
        a.add_argument(f"--{f}", required=True)
    a.add_argument("--unknown", required=True,
                   help="what is not known about the figure: its workload, metric definition, machine, ...")
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
    at = _time.strftime("%Y-%m-%dT%H:%M:%SZ", _time.gmtime())
    why = "external reference figure: measured outside this suite, no commit of this repository produced it"
    prov = Provenance(kind="external", commit=None, no_commit_reason=why, source=ns.source, recorded_at=at,
                      engine_version=ns.engine_version, unknown=ns.unknown)
    metrics = {}
    for m in ns.metric:
        name, _, vals = m.partition("=")
        if name not in _M:
            ap.error(f"--metric {m}: unknown metric {name!r}; use one of {', '.join(sorted(_M))}")
        d = _M[name]
        metrics[name] = MetricSamples(d.unit, d.direction, tuple(float(v) for v in vals.split(",")), prov)
    entry = BaselineEntry(key=BaselineKey(ns.scenario, ns.engine, ns.model, ns.hardware, ns.workload, ns.concurrency),
                          metrics=metrics, engine_version=ns.engine_version, recorded_at=at, source=ns.source,
                          no_commit_reason=why)
    store = BaselineStore(_P(ns.dir) / f"{prof.name}.json", prof.name)
    have = store.get(entry.key)
    measured = sorted(n for n in metrics if have is not None and n in have.metrics
                      and not _external(have.metrics[n].provenance))
    if measured:
        # a measurement of this suite is what replaces a typed-in figure, never the other way round
        ap.error(f"{store.path}: {entry.key.id()} already has measured {', '.join(measured)}; an external figure "
                 "does not replace a measurement. Fix: record it under another key or delete the measured metric")
    print(store.write([entry]))
    return 0


if __name__ == "__main__":
    raise SystemExit(_cli())


def _external(prov: Any) -> bool:
    """Whether a metric's provenance marks a typed-in external figure (None: a measurement)."""
    return prov is not None and bool(prov.external)
