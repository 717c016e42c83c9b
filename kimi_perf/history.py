"""Run history: every run's medians appended to ``baselines/history/<profile>.jsonl``, and change-point
detection over it (``python -m kimi_perf.history <profile>``).

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

__all__ = ["ChangePoint", "Series", "append_history", "change_points", "history_lines", "load_series",
           "planted_slowdown"]

HISTORY_VERSION = 1


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


def load_series(path: Path) -> list[Series]:
    """Every (key, metric) series of a history file, in file (= time) order."""
    if not path.is_file():
        raise FileNotFoundError(f"no history at {path}: runs append to it (pytest -m perf); "
                                "or pass --dir where the history files are")
    series: dict[str, list[Point]] = {}
    for n, raw in enumerate(path.read_text().splitlines(), 1):
        if not raw.strip():
            continue
        try:
            ln = json.loads(raw)
        except json.JSONDecodeError as e:
            raise ValueError(f"{path}:{n}: not a JSON line ({e.msg}); remove or repair that line") from None
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
    ap.add_argument("--dir", default="baselines/history", help="history directory (default baselines/history)")
    ap.add_argument("--metric", action="append", default=None,
                    help="only series of this metric (repeatable), e.g. decode_tok_s")
    ap.add_argument("--pvalue", type=float, default=0.001, help="significance of a change point (default 0.001)")
    ap.add_argument("--min-points", type=int, default=6, help="skip series shorter than this (default 6)")
    ap.add_argument("--json", action="store_true", help="print the change points as JSON")
    ns = ap.parse_args(argv)
    path = Path(ns.dir) / f"{ns.profile}.jsonl"
    try:
        all_series = load_series(path)
    except (FileNotFoundError, ValueError) as e:
        ap.error(str(e))
    if ns.metric:
        all_series = [s for s in all_series if any(f" {m}" in s.name for m in ns.metric)]
    found: list[ChangePoint] = []
    print(f"{path}: {len(all_series)} series")
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
