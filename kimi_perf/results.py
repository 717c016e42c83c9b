"""Run results as data: per-request records beside ``run.json``, pandas loaders and dashboard exporters.

Why: ``run.json`` keeps each repeat's metrics but not the requests behind them, so a TTFT tail or one
failed request cannot be looked into after the run; pandas was a dependency nobody called; and no
dashboard reads ``run.json``. This module closes the three gaps:

- **capture** (test process): :func:`kimi_perf.bench.measure` hands every measured repeat to
  :func:`note`; :meth:`kimi_perf.recorder.PerfGate.check` takes what the test measured since its last
  check (:func:`drain`) and writes one JSON line per request to ``<report-dir>/requests/<test>.<n>.jsonl``,
  naming the file in the result record (``record["requests"]``). Written by the process that measured
  (an xdist worker writes its own), so the records never travel through ``report.user_properties``.
- **loaders**: :class:`RunResults` reads a report directory or a run file into pandas DataFrames:
  ``requests()`` (one row per request), ``repeats()`` (one row per metric sample) and ``verdicts()``
  (one row per gate or A/B decision), like :meth:`BenchResult.to_frame` does for one repeat.
- **exporters**: Bencher Metric Format (https://bencher.dev/docs/reference/bencher-metric-format) and
  github-action-benchmark's ``customBiggerIsBetter`` / ``customSmallerIsBetter`` JSON
  (https://github.com/benchmark-action/github-action-benchmark, "Examples" and ``src/extract.ts``);
  directions and units come from :mod:`kimi_perf.metrics`.

CLI: ``python -m kimi_perf.results export --format bencher|gab RUN_DIR [-o OUT]`` and
``python -m kimi_perf.results show RUN_DIR``; ``python -m kimi_perf.results ab-table RUN_DIR...`` prints
the same-run A/B decisions of several runs (e.g. one per engine flag variant) as one markdown table
(where each A/B's noise came from: ``python -m kimi_perf.ab.variance RUN_DIR...``). Both formats are a few lines of dict building; no
library writes them, so they are built here, and the tests validate them against JSON Schemas
written from the formats' public docs (``tests/test_results.py``).
"""

from __future__ import annotations

import argparse
import hashlib
import json
import math
import re
import sys
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from .metrics import METRICS, MetricDef

if TYPE_CHECKING:
    import pandas as pd

    from .load.results import BenchResult

__all__ = ["REQUESTS_DIR", "RunResults", "begin_capture", "drain", "end_capture", "note", "prune_requests",
           "request_lines", "to_bencher", "to_gab", "write_requests"]

REQUESTS_DIR = "requests"
KEY_COLUMNS = ("scenario", "engine", "model", "hardware", "workload", "concurrency")

# -- capture, in the process that measures ---------------------------------------------------------

# the repeats measured since the running test started (or since its last check); None outside a test,
# so a library user calling measure() from a script collects nothing
_pending: list[BenchResult] | None = None


def begin_capture() -> None:
    """Start collecting the repeats of one test (the plugin calls it in ``pytest_runtest_setup``)."""
    global _pending
    _pending = []


def end_capture() -> None:
    global _pending
    _pending = None


def note(result: BenchResult) -> None:
    """A measured repeat of the running test (called by :func:`kimi_perf.bench.measure`)."""
    if _pending is not None:
        _pending.append(result)


def drain() -> list[BenchResult]:
    """The repeats noted since the last drain, in measurement order; the list starts empty again."""
    out = list(_pending or [])
    if _pending is not None:
        _pending.clear()
    return out


def _ms(v: float | None) -> float | None:
    return None if v is None else v * 1000.0


def request_lines(results: Sequence[BenchResult], *, measurement: str = "first",
                  first_repeat: int = 0) -> list[dict[str, Any]]:
    """One JSON-able dict per request. ``repeat`` counts across measurements (the confirming repeats
    follow the first ones), as the pooled samples of the result record do, so requests join their
    repeat's metrics on (result, repeat). The generated text is left out (its length is kept): the
    records are for timing, and a prompt set's outputs can be large."""
    out = []
    for n, res in enumerate(results):
        w = res.workload
        for r in res.records:
            out.append({
                "measurement": measurement, "repeat": first_repeat + n, "workload": w.name,
                "concurrency": w.concurrency, "index": r.index, "ok": r.ok, "error": r.error,
                "prompt_len": r.prompt_len, "server_prompt_tokens": r.server_prompt_tokens,
                "max_tokens": r.max_tokens, "completion_tokens": r.completion_tokens,
                "t_send": r.t_send, "t_first": r.t_first, "t_end": r.t_end,
                "ttft_ms": _ms(r.ttft), "tpot_ms": _ms(r.tpot), "e2el_ms": _ms(r.e2el),
                "n_chunks": len(r.chunk_times), "chunk_times": list(r.chunk_times), "text_chars": len(r.text),
            })
    return out


def _slug(nodeid: str) -> str:
    """A file name for a test id: readable, bounded, unique (a digest of the full id)."""
    path, _, rest = nodeid.partition("::")
    short = re.sub(r"[^A-Za-z0-9_.=-]+", "_", f"{Path(path).stem}__{rest}" if rest else nodeid).strip("_")
    return f"{short[:120]}-{hashlib.sha1(nodeid.encode()).hexdigest()[:8]}"


def write_requests(report_dir: Path, nodeid: str, seq: int, lines: Sequence[Mapping[str, Any]]) -> str:
    """Write ``lines`` as JSONL under ``<report_dir>/requests/``; the path relative to the report dir."""
    rel = f"{REQUESTS_DIR}/{_slug(nodeid)}.{seq}.jsonl"
    path = Path(report_dir) / rel
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + ".tmp")
    with tmp.open("w") as f:
        for ln in lines:
            f.write(json.dumps(ln, default=str) + "\n")  # never raise inside a measured test
    tmp.replace(path)
    return rel


def prune_requests(report_dir: Path, results: Iterable[Mapping[str, Any]]) -> list[Path]:
    """Remove request files an earlier run left in ``report_dir`` that this run's results do not name,
    so a report directory holds one run's records (called on the controller when it writes run.json)."""
    d = Path(report_dir) / REQUESTS_DIR
    if not d.is_dir():
        return []
    keep = {(Path(report_dir) / r["requests"]["file"]).resolve() for r in results if r.get("requests")}
    gone = [p for p in d.glob("*.jsonl") if p.resolve() not in keep]
    for p in gone:
        p.unlink()
    return gone


# -- loaders --------------------------------------------------------------------------------------


def _finite(v: Any) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)


@dataclass(frozen=True)
class RunResults:
    """One run file (``run.json`` or a ``--perf-json`` copy) and the directory its request files are in."""

    path: Path
    data: Mapping[str, Any]

    @classmethod
    def load(cls, where: str | Path) -> RunResults:
        p = Path(where)
        if p.is_dir():
            p = p / "run.json"
        if not p.is_file():
            raise FileNotFoundError(f"no run file at {p}: pass a report directory (--perf-report-dir, default "
                                    "perf-report) or a run file (--perf-json)")
        try:
            data = json.loads(p.read_text())
        except json.JSONDecodeError as e:
            raise ValueError(f"{p}: not JSON ({e.msg} at line {e.lineno})") from None
        if not isinstance(data, dict) or "results" not in data:
            raise ValueError(f"{p}: not a kimi-perf run file (no 'results'); run files are written by "
                             "pytest -m perf to <report-dir>/run.json")
        return cls(p, data)

    @property
    def results(self) -> list[dict[str, Any]]:
        return list(self.data.get("results") or [])

    def _base(self, rec: Mapping[str, Any]) -> dict[str, Any]:
        k = rec.get("key") or {}
        return {"nodeid": rec.get("nodeid"), **{c: k.get(c) for c in KEY_COLUMNS},
                "engine_version": rec.get("engine_version"), "outcome": rec.get("outcome")}

    def repeats(self) -> pd.DataFrame:
        """One row per recorded sample: the result's key, metric, unit, direction, repeat index, value and
        whether it came from the first or the confirming measurement (a confirmed FAIL pools both)."""
        import pandas as pd

        rows = []
        for rec in self.results:
            base = self._base(rec)
            first = ((rec.get("extra") or {}).get("first_measurement") or {}).get("samples") or {}
            for m, vals in (rec.get("samples") or {}).items():
                md = METRICS.get(m)
                n_first = len(first.get(m, vals)) if first else len(vals)
                for i, v in enumerate(vals):
                    rows.append({**base, "metric": m, "unit": md.unit if md else None,
                                 "direction": md.direction if md else None, "repeat": i,
                                 "measurement": "first" if i < n_first else "confirm", "value": float(v)})
        cols = [*self._base({}).keys(), "metric", "unit", "direction", "repeat", "measurement", "value"]
        return pd.DataFrame(rows, columns=cols)

    def verdicts(self) -> pd.DataFrame:
        """One row per decision: ``kind`` gate (against the stored baseline) or ab (same-run ratio)."""
        import pandas as pd

        rows = []
        for rec in self.results:
            base = self._base(rec)
            for d in rec.get("decisions") or []:
                rows.append({**base, "kind": "gate", "probe": None, "metric": d.get("metric"), "unit": d.get("unit"),
                             "direction": d.get("direction"), "verdict": d.get("verdict"),
                             "baseline": d.get("baseline"), "current": d.get("current"), "delta": d.get("delta"),
                             "tolerance": d.get("tolerance"), "p_value": d.get("p_value"),
                             "ratio_lo": None, "ratio_hi": None, "n_baseline": d.get("n_baseline"),
                             "n_current": d.get("n_current"), "reason": d.get("reason")})
            for d in (rec.get("ab") or {}).get("decisions") or []:
                ratio = d.get("ratio")
                rows.append({**base, "kind": "ab", "probe": d.get("probe"), "metric": d.get("metric"),
                             "unit": d.get("unit"), "direction": d.get("direction"), "verdict": d.get("verdict"),
                             "baseline": d.get("base"), "current": d.get("candidate"),
                             "delta": ratio - 1 if _finite(ratio) else None, "tolerance": d.get("threshold"),
                             "p_value": None, "ratio_lo": d.get("ratio_lo"), "ratio_hi": d.get("ratio_hi"),
                             "n_baseline": d.get("n_pairs"), "n_current": d.get("n_pairs"), "reason": d.get("reason")})
        cols = [*self._base({}).keys(), "kind", "probe", "metric", "unit", "direction", "verdict", "baseline",
                "current", "delta", "tolerance", "p_value", "ratio_lo", "ratio_hi", "n_baseline", "n_current",
                "reason"]
        return pd.DataFrame(rows, columns=cols)

    def requests(self, *, chunks: bool = False) -> pd.DataFrame:
        """One row per measured request of every result that recorded them (run files written before
        per-request records existed give an empty frame). ``chunks=True`` keeps each request's chunk
        arrival times as a list column."""
        import pandas as pd

        frames = []
        for rec in self.results:
            ref = rec.get("requests")
            if not ref:
                continue
            f = self.path.parent / ref["file"]
            if not f.is_file() and self.data.get("report_dir"):  # a --perf-json copy: the run's report dir
                f = Path(self.data["report_dir"]) / ref["file"]
            if not f.is_file():
                raise FileNotFoundError(f"{self.path}: result {rec.get('nodeid')} names {f}, which is missing "
                                        "(copy the report directory whole, requests/ included)")
            lines = [json.loads(ln) for ln in f.read_text().splitlines() if ln.strip()]
            df = pd.DataFrame(lines)
            if not chunks:
                df = df.drop(columns=["chunk_times"], errors="ignore")
            for c, v in reversed(list(self._base(rec).items())):
                if c not in ("workload", "concurrency"):  # the request lines carry their own
                    df.insert(0, c, v)
            frames.append(df)
        if not frames:
            return pd.DataFrame(columns=[*self._base({}).keys(), "measurement", "repeat", "index", "ok"])
        return pd.concat(frames, ignore_index=True)


# -- exporters ------------------------------------------------------------------------------------


def _summaries(run: RunResults, metrics: Sequence[str] | None = None) -> list[dict[str, Any]]:
    """Per (result, metric): the median of its finite samples, min, max and n, with name parts."""
    import numpy as np

    out = []
    for rec in run.results:
        k = rec.get("key") or {}
        bench = f"{k.get('scenario')}/{k.get('engine')}/{k.get('workload')}/c{k.get('concurrency')}"
        verdicts = {d.get("metric"): d.get("verdict") for d in rec.get("decisions") or []}
        for m, vals in (rec.get("samples") or {}).items():
            md = METRICS.get(m)
            v = [float(x) for x in vals if _finite(x)]
            if md is None or not v or (metrics and m not in metrics):
                continue
            out.append({"bench": bench, "metric": md, "value": float(np.median(v)), "lo": min(v), "hi": max(v),
                        "n": len(v), "verdict": verdicts.get(m), "engine_version": rec.get("engine_version")})
        ab = rec.get("ab") or {}
        for d in ab.get("decisions") or []:  # same-run A/B: the candidate/base ratio and its interval
            md = METRICS.get(d.get("metric"))
            if md is None or not all(_finite(d.get(f)) for f in ("ratio", "ratio_lo", "ratio_hi")):
                continue
            if metrics and md.name not in metrics:
                continue
            ratio = MetricDef(f"{d.get('probe')}:{md.name}:ab_ratio", "x", md.direction,
                              f"candidate/base ratio of {md.name}")
            out.append({"bench": f"{k.get('scenario')}/{k.get('engine')}/ab-vs-{ab.get('base')}", "metric": ratio,
                        "value": float(d["ratio"]), "lo": float(d["ratio_lo"]), "hi": float(d["ratio_hi"]),
                        "n": d.get("n_pairs"), "verdict": d.get("verdict"), "engine_version": rec.get("engine_version")})
    return out


def to_bencher(run: RunResults, metrics: Sequence[str] | None = None) -> dict[str, dict[str, dict[str, float]]]:
    """Bencher Metric Format: ``{benchmark: {measure: {value, lower_value, upper_value}}}``; benchmark
    = ``scenario/engine/workload/c<concurrency>``, measure = the metric name, value = the median of the
    repeats and lower/upper = their min/max. BMF carries no unit or direction: a Bencher measure gets
    them where it is created (docs/results-export.md lists them from kimi_perf.metrics). A same-run
    A/B result adds ``<probe>:<metric>:ab_ratio`` (candidate/base, lower/upper = its interval) under
    ``scenario/engine/ab-vs-<base>``."""
    out: dict[str, dict[str, dict[str, float]]] = {}
    for s in _summaries(run, metrics):
        out.setdefault(s["bench"], {})[s["metric"].name] = {"value": s["value"], "lower_value": s["lo"],
                                                              "upper_value": s["hi"]}
    return out


def to_gab(run: RunResults, metrics: Sequence[str] | None = None) -> dict[str, list[dict[str, Any]]]:
    """github-action-benchmark custom JSON, one list per tool: ``customBiggerIsBetter`` for metrics
    whose direction is "higher", ``customSmallerIsBetter`` for "lower"; each entry
    ``{name, unit, value, range, extra}`` (range: the repeats' spread around the median, a string as
    the action shows it)."""
    out: dict[str, list[dict[str, Any]]] = {"customBiggerIsBetter": [], "customSmallerIsBetter": []}
    d = run.data
    for s in _summaries(run, metrics):
        md = s["metric"]
        spread = max(s["hi"] - s["value"], s["value"] - s["lo"])
        spread_of = "pairs, interval" if md.name.endswith(":ab_ratio") else "repeats, min/max"
        extra = (f"{s['n']} {spread_of} {s['lo']:.6g}..{s['hi']:.6g}; verdict {s['verdict'] or 'not gated'}; "
                 f"profile {d.get('profile')}, hardware {d.get('hardware')}"
                 + (f", engine {s['engine_version']}" if s["engine_version"] else ""))
        tool = "customBiggerIsBetter" if md.direction == "higher" else "customSmallerIsBetter"
        out[tool].append({"name": f"{s['bench']} {md.name}", "unit": md.unit, "value": s["value"],
                          "range": f"± {spread:.4g}", "extra": extra})
    return out


GAB_FILES = {"customBiggerIsBetter": "gab-bigger-is-better.json", "customSmallerIsBetter": "gab-smaller-is-better.json"}


def export(run: RunResults, fmt: str, out: Path, metrics: Sequence[str] | None = None) -> list[Path]:
    """Write ``fmt`` (bencher | gab) under ``out`` (a directory; for bencher also a .json file path)."""
    if fmt == "bencher":
        path = out if out.suffix == ".json" else out / "bencher.json"
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(to_bencher(run, metrics), indent=1, allow_nan=False) + "\n")
        return [path]
    if fmt == "gab":
        out.mkdir(parents=True, exist_ok=True)
        written = []
        for tool, entries in to_gab(run, metrics).items():
            path = out / GAB_FILES[tool]
            path.write_text(json.dumps(entries, indent=1, allow_nan=False, ensure_ascii=False) + "\n")
            written.append(path)
        return written
    raise ValueError(f"unknown export format {fmt!r}: bencher or gab")


def ab_rows(run: RunResults) -> list[dict[str, Any]]:
    """One row per same-run A/B decision of ``run``, with the comparison it came from: which base, how
    many blocks and launches, how long it took and why it stopped. A variant A/B of an engine flag is
    read from these rows (the README's and docs/results.md's flag tables), not retyped."""
    rows = []
    for rec in run.results:
        ab = rec.get("ab") or {}
        k = rec.get("key") or {}
        for d in ab.get("decisions") or []:
            rows.append({"engine": k.get("engine"), "hardware": k.get("hardware"), "scenario": k.get("scenario"),
                         "base": ab.get("base"), "base_version": (ab.get("versions") or {}).get("base"),
                         "candidate_version": (ab.get("versions") or {}).get("candidate"),
                         "probe": d.get("probe"), "metric": d.get("metric"), "unit": d.get("unit"),
                         "direction": d.get("direction"), "verdict": d.get("verdict"),
                         "base_value": d.get("base"), "candidate_value": d.get("candidate"), "ratio": d.get("ratio"),
                         "ratio_lo": d.get("ratio_lo"), "ratio_hi": d.get("ratio_hi"), "level": d.get("level"),
                         "threshold": d.get("threshold"), "pairs": d.get("n_pairs"), "blocks": ab.get("blocks"),
                         "launches": len(ab.get("launches") or []), "wall_s": ab.get("wall_s"),
                         "stopped": ab.get("stopped") or ab.get("error"), "reason": d.get("reason")})
    return rows


def ab_table(runs: Sequence[RunResults]) -> str:
    """Markdown table of every A/B decision in ``runs`` (one row per metric): base, candidate/base
    ratio with its interval, threshold, verdict, pairs, blocks, launches and wall time."""

    def num(v: Any, fmt: str) -> str:
        return format(v, fmt) if _finite(v) else "n/a"

    out = ["| engine | base (candidate: this checkout) | test | metric | base | candidate | ratio [interval] "
           "| threshold | verdict | pairs / blocks / launches | wall s |",
           "|---|---|---|---|---|---|---|---|---|---|---|"]
    for run in runs:
        for r in ab_rows(run):
            arrow = "↑" if r["direction"] == "higher" else "↓"
            interval = (f"{num(r['ratio'], '.4f')} [{num(r['ratio_lo'], '.4f')}, {num(r['ratio_hi'], '.4f')}]"
                        + (f" ({r['level']:.0%})" if _finite(r["level"]) else ""))
            out.append(f"| {r['engine']} | {r['base']} | {r['scenario']} | {r['metric']} {arrow} [{r['unit']}] "
                       f"| {num(r['base_value'], '.4g')} | {num(r['candidate_value'], '.4g')} | {interval} "
                       f"| {num(r['threshold'], '.1%')} | {r['verdict']} | {r['pairs']} / {r['blocks']} / {r['launches']} "
                       f"| {num(r['wall_s'], '.0f')} |")
    return "\n".join(out)


def _cli(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m kimi_perf.results",
                                 description="a kimi-perf run's results as tables, or as files a dashboard ingests")
    sub = ap.add_subparsers(dest="cmd", required=True)
    ex = sub.add_parser("export", help="write Bencher BMF or github-action-benchmark JSON")
    ex.add_argument("--format", required=True, choices=["bencher", "gab"],
                    help="bencher: one BMF file (bencher run --adapter json --file ...); gab: "
                         f"{GAB_FILES['customBiggerIsBetter']} and {GAB_FILES['customSmallerIsBetter']} "
                         "(github-action-benchmark tool customBiggerIsBetter / customSmallerIsBetter)")
    ex.add_argument("run", help="report directory (holding run.json) or run file")
    ex.add_argument("-o", "--out", default=None, help="output directory (bencher: or a .json path); "
                                                      "default: the run file's directory")
    ex.add_argument("--metric", action="append", default=None, help="only this metric (repeatable)")
    sh = sub.add_parser("show", help="print the run's verdicts and repeats as tables (pandas)")
    sh.add_argument("run", help="report directory (holding run.json) or run file")
    at = sub.add_parser("ab-table", help="print the same-run A/B decisions of one or more runs as a markdown table")
    at.add_argument("runs", nargs="+", help="report directories (holding run.json) or run files")
    ns = ap.parse_args(argv)
    if ns.cmd == "ab-table":
        try:
            loaded = [RunResults.load(r) for r in ns.runs]
        except (FileNotFoundError, ValueError) as e:
            ap.error(str(e))
        print(ab_table(loaded))
        return 0
    try:
        run = RunResults.load(ns.run)
    except (FileNotFoundError, ValueError) as e:
        ap.error(str(e))
    metrics = getattr(ns, "metric", None)
    if metrics:
        unknown = [m for m in metrics if m not in METRICS]
        if unknown:
            ap.error(f"--metric: unknown metric(s) {unknown}; known: {', '.join(sorted(METRICS))}")
    if ns.cmd == "export":
        written = export(run, ns.format, Path(ns.out) if ns.out else run.path.parent, metrics)
        for p in written:
            print(p)
        return 0
    import pandas as pd

    with pd.option_context("display.width", 200, "display.max_columns", 12, "display.max_colwidth", 40):
        v = run.verdicts()
        print(f"{run.path}: profile {run.data.get('profile')}, hardware {run.data.get('hardware')}, "
              f"{len(run.results)} results")
        print(v[["engine", "scenario", "concurrency", "metric", "verdict", "baseline", "current"]].to_string()
              if len(v) else "(no decisions)")
        req = run.requests()
        print(f"{len(req)} request records" + (f", {int((~req['ok'].astype(bool)).sum())} failed" if len(req) else ""))
    return 0


if __name__ == "__main__":
    sys.exit(_cli())
