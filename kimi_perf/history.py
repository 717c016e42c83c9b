"""Run history: every run's medians appended to ``<history-dir>/<profile>.jsonl``, and change-point
detection over it (``python -m kimi_perf.history <profile>``).

Where: ``--perf-history DIR`` (ini ``perf_history_dir``); by default ``<perf-report-dir>/history``, outside
the tracked tree. Appending into the tracked ``baselines/history/`` (the old default) dirtied every
checkout that ran the gate and was lost with an ephemeral runner's workspace; a runner that keeps history
names a kept directory (a cache, a mounted volume). The histories committed under ``baselines/history/``
before the change stay readable: the CLI reads them together with the new directory
(:data:`LEGACY_DIR`), in time order.

Why both a per-merge gate and a history: the gate answers "is this change slower than its base?" in
one job; it cannot see a slow drift of 2% a week, nor tell which of twenty merges caused a step that
each gate run called inconclusive. A history of medians, each line stamped with commit, host and engine
versions, answers that after the fact, the way MongoDB's and Apache Otava's (formerly Hunter)
performance CI do: E-divisive change-point detection over each series (Matteson & James 2014;
Fleming et al., "Hunter: Using Change Point Detection to Hunt for Performance Regressions", ICPE 2023).
The detection itself is Apache Otava's (``otava.analysis.compute_change_points``); only its
algorithm modules are used, so it is installed with ``pip install --no-deps apache-otava==0.8.0``
(its own requirements pin numpy 2.2 and cloud SDKs that the algorithm does not import).

Lines are appended, never rewritten, so the file is a log several runners can merge with ``cat``.
Series are keyed like baselines (scenario, engine, model, hardware, workload, concurrency) plus the
metric; A/B results add one series per gated metric of candidate/base ratios.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import time
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from .engines.reference import planted_fraction

__all__ = ["ChangePoint", "Series", "append_history", "change_points", "history_file", "history_lines",
           "load_series", "planted_slowdown"]

HISTORY_VERSION = 1
DEFAULT_SUBDIR = "history"  # under the report directory, when no history directory is named
LEGACY_DIR = "baselines/history"  # where runs appended before issue 25; read, never written by default


def history_file(value: str, *, rootdir: Path, report_dir: Path, profile: str) -> Path | None:
    """The file a run appends to: ``value`` is ``--perf-history`` / ``perf_history_dir`` ('' = the report
    directory's ``history/``, 'off' = none; relative paths from the rootdir)."""
    v = value.strip()
    if v.lower() == "off":
        return None
    d = Path(v) if v else report_dir / DEFAULT_SUBDIR
    return (d if d.is_absolute() else rootdir / d) / f"{profile}.jsonl"


def planted_slowdown(env: Mapping[str, str] | None = None) -> float | None:
    """The planted slowdown this run's reference engine burns (``KIMI_PERF_PLANT_SLOWDOWN``), or None.

    Stamped on every history line, so a step that a power experiment planted is never read later as a
    regression of the commit it ran on."""
    try:
        v = planted_fraction(os.environ if env is None else env)
    except ValueError:
        return None  # the engine refuses to start on it: nothing was planted
    return v if v > 0 else None


def history_lines(results: Iterable[Mapping[str, Any]], *, profile: str, hardware: str, commit: Mapping[str, Any],
                  machine: Mapping[str, Any], env: Mapping[str, str] | None = None) -> list[dict[str, Any]]:
    """One line per recorded result: medians (or A/B ratios) with the run's provenance."""
    stamp = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())
    prov = {"v": HISTORY_VERSION, "time": stamp, "profile": profile, "hardware": hardware,
            "host": machine.get("node"), "cpu": machine.get("cpu"),
            "gpus": [g.get("name") for g in machine.get("gpus", [])],
            "commit": commit.get("id"), "dirty": commit.get("dirty"), "subject": commit.get("subject"),
            "planted_slowdown": planted_slowdown(env)}
    out = []
    for rec in results:
        line: dict[str, Any] = {**prov, "nodeid": rec.get("nodeid"), "key": rec.get("key"),
                                "engine_version": rec.get("engine_version"), "outcome": rec.get("outcome")}
        meds = {}
        for m, vals in (rec.get("samples") or {}).items():
            v = [float(x) for x in vals if x is not None and math.isfinite(float(x))]
            if v:
                meds[m] = float(np.median(v))
        line["medians"] = meds
        line["verdicts"] = {d["metric"]: d["verdict"] for d in rec.get("decisions", [])}
        ab = rec.get("ab")
        if ab:
            line["ab"] = {"base": ab.get("base"), "blocks": ab.get("blocks"),
                          "ratios": {f"{d['probe']}:{d['metric']}": d["ratio"] for d in ab.get("decisions", [])},
                          "verdicts": {f"{d['probe']}:{d['metric']}": d["verdict"] for d in ab.get("decisions", [])},
                          "base_version": (ab.get("versions") or {}).get("base")}
        out.append(line)
    return out


def append_history(path: Path, lines: Sequence[Mapping[str, Any]]) -> None:
    if not lines:
        return
    path.parent.mkdir(parents=True, exist_ok=True)
    with path.open("a") as f:
        for ln in lines:
            f.write(json.dumps(ln, sort_keys=True, default=str) + "\n")
        f.flush()
        os.fsync(f.fileno())


@dataclass(frozen=True)
class Point:
    time: str
    commit: str | None
    subject: str | None
    host: str | None
    value: float
    planted: float | None = None  # the run's planted slowdown, when a power experiment set one


@dataclass(frozen=True)
class Series:
    name: str  # "single_stream reference c=1 decode_tok_s" or "ab_throughput reference single_stream:decode_tok_s (ratio)"
    points: tuple[Point, ...]


def _history_lines(paths: Sequence[Path]) -> list[dict[str, Any]]:
    """The lines of every file, merged in time order (a line found in two files, e.g. a history copied
    from the tracked directory to a kept one, counts once)."""
    found = [p for p in paths if p.is_file()]
    if not found:
        raise FileNotFoundError(f"no history at {' or '.join(str(p) for p in paths)}: runs append to it "
                                "(pytest -m perf); or pass --dir where the history files are")
    seen: set[str] = set()  # the lines of the files before this one
    lines = []
    for path in found:
        raws = path.read_text().splitlines()
        for n, raw in enumerate(raws, 1):
            if not raw.strip() or raw in seen:
                continue
            try:
                lines.append(json.loads(raw))
            except json.JSONDecodeError as e:
                raise ValueError(f"{path}:{n}: not a JSON line ({e.msg}); remove or repair that line") from None
        seen.update(raws)
    # stable: lines of one file keep their order; ISO-8601 UTC stamps sort as strings
    return sorted(lines, key=lambda ln: str(ln.get("time") or "")) if len(found) > 1 else lines


def load_series(path: Path | Sequence[Path]) -> list[Series]:
    """Every (key, metric) series of one history file, or of several merged in time order."""
    series: dict[str, list[Point]] = {}
    for ln in _history_lines([path] if isinstance(path, Path) else list(path)):
        k = ln.get("key") or {}
        name = f"{k.get('scenario')} {k.get('engine')} {k.get('workload')} c={k.get('concurrency')} [{k.get('hardware')}]"
        mk = lambda v, _ln=ln: Point(_ln.get("time"), _ln.get("commit"), _ln.get("subject"), _ln.get("host"), v,  # noqa: E731
                                     _ln.get("planted_slowdown"))
        for m, v in (ln.get("medians") or {}).items():
            series.setdefault(f"{name} {m}", []).append(mk(float(v)))
        for m, v in ((ln.get("ab") or {}).get("ratios") or {}).items():
            if v is not None and math.isfinite(float(v)):
                series.setdefault(f"{name} {m} (A/B ratio vs {ln['ab'].get('base')})", []).append(mk(float(v)))
    return [Series(k, tuple(v)) for k, v in series.items()]


@dataclass(frozen=True)
class ChangePoint:
    series: str
    index: int  # first point after the change
    at: Point
    mean_before: float
    mean_after: float
    pvalue: float

    @property
    def change(self) -> float:
        return self.mean_after / self.mean_before - 1 if self.mean_before else float("nan")


def change_points(s: Series, *, max_pvalue: float = 0.001, window: int = 50, min_points: int = 6) -> list[ChangePoint]:
    """E-divisive change points of one series (Apache Otava's implementation)."""
    if len(s.points) < min_points:
        return []
    try:
        from otava.analysis import compute_change_points
    except ImportError:
        raise RuntimeError("change-point detection needs Apache Otava's algorithm: "
                           "pip install --no-deps apache-otava==0.8.0 (scripts/setup.sh does)") from None
    values = [p.value for p in s.points]
    cps, _ = compute_change_points(values, window_len=window, max_pvalue=max_pvalue)
    return [ChangePoint(s.name, c.index, s.points[c.index], float(c.stats.mean_before()),
                        float(c.stats.mean_after()), float(c.stats.pvalue)) for c in cps]


def _cli(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m kimi_perf.history",
                                 description="change points in a profile's run history, with their commits")
    ap.add_argument("profile", help="profile name: reads <dir>/<profile>.jsonl")
    ap.add_argument("--dir", action="append", default=None,
                    help=f"history directory (repeatable; default perf-report/{DEFAULT_SUBDIR}, where runs append "
                         f"unless --perf-history named another, and {LEGACY_DIR}, the histories committed before)")
    ap.add_argument("--metric", action="append", default=None,
                    help="only series of this metric (repeatable), e.g. decode_tok_s")
    ap.add_argument("--pvalue", type=float, default=0.001, help="significance of a change point (default 0.001)")
    ap.add_argument("--min-points", type=int, default=6, help="skip series shorter than this (default 6)")
    ap.add_argument("--json", action="store_true", help="print the change points as JSON")
    ns = ap.parse_args(argv)
    paths = [Path(d) / f"{ns.profile}.jsonl" for d in (ns.dir or [f"perf-report/{DEFAULT_SUBDIR}", LEGACY_DIR])]
    try:
        all_series = load_series(paths)
    except (FileNotFoundError, ValueError) as e:
        ap.error(str(e))
    if ns.metric:
        all_series = [s for s in all_series if any(f" {m}" in s.name for m in ns.metric)]
    found: list[ChangePoint] = []
    print(f"{' + '.join(str(p) for p in paths if p.is_file())}: {len(all_series)} series")
    if ns.metric and not all_series:
        print(f"  no series of metric(s) {ns.metric}")
    for s in sorted(all_series, key=lambda s: s.name):
        cps = change_points(s, max_pvalue=ns.pvalue, min_points=ns.min_points)
        found += cps
        status = f"{len(cps)} change point(s)" if cps else (
            "no change point" if len(s.points) >= ns.min_points else f"too short ({len(s.points)} points)")
        print(f"  {s.name}: {len(s.points)} runs, {status}")
        for c in cps:
            print(f"    at run {c.index + 1}/{len(s.points)}: commit {(c.at.commit or '?')[:10]} {c.at.subject or ''!s:.60} "
                  f"({c.at.time}, host {c.at.host}): mean {c.mean_before:.4g} -> {c.mean_after:.4g} "
                  f"({c.change:+.1%}), p={c.pvalue:.2g}"
                  + (f"; PLANTED slowdown {c.at.planted:g} in that run, not the commit's" if c.at.planted else ""))
    if ns.json:
        print(json.dumps([{"series": c.series, "index": c.index, "commit": c.at.commit, "time": c.at.time,
                           "mean_before": c.mean_before, "mean_after": c.mean_after, "pvalue": c.pvalue,
                           "planted_slowdown": c.at.planted}
                          for c in found], indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(_cli())
