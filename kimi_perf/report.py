"""Run reports: the terminal/markdown summary table, the JSON run file and PNG plots.

Why several outputs of one table: the terminal table is what a developer reads; the same table goes
to ``<report-dir>/summary.md`` and, on GitHub Actions, ``$GITHUB_STEP_SUMMARY``; the run file keeps
every sample with machine and commit info so a later session can re-gate or plot history.
"""

from __future__ import annotations

import math
import os
import time
from pathlib import Path
from typing import Any

from .baselines import atomic_write_json
from .stats import _fmt

__all__ = ["summary_rows", "text_table", "markdown_table", "write_reports"]

HEADERS = ["test", "metric", "baseline", "current", "delta %", "tolerance", "verdict"]


def _short_test(nodeid: str) -> str:
    path, _, rest = nodeid.partition("::")
    return f"{Path(path).stem}::{rest}" if rest else nodeid


def summary_rows(results: list[dict[str, Any]]) -> list[list[str]]:
    rows = []
    for rec in results:
        for d in rec.get("decisions", []):
            arrow = "↑" if d["direction"] == "higher" else "↓"
            delta = d.get("delta")
            tol = d.get("tolerance")
            rows.append([
                _short_test(rec["nodeid"]),
                f"{d['metric']} {arrow} [{d['unit']}]",
                _fmt(d.get("baseline")),
                _fmt(d.get("current")),
                "" if delta is None or not math.isfinite(delta) else f"{delta * 100:+.1f}",
                "" if tol is None else f"{tol * 100:.1f}%",
                d["verdict"],
            ])
    return rows


def text_table(rows: list[list[str]]) -> str:
    if not rows:
        return "(no gated results)"
    widths = [max(len(h), *(len(r[i]) for r in rows)) for i, h in enumerate(HEADERS)]
    fmt = "  ".join(f"{{:<{w}}}" for w in widths)
    out = [fmt.format(*HEADERS), "  ".join("-" * w for w in widths)]
    out += [fmt.format(*r) for r in rows]
    counts: dict[str, int] = {}
    for r in rows:
        counts[r[-1]] = counts.get(r[-1], 0) + 1
    out.append("verdicts: " + ", ".join(f"{k} {v}" for k, v in sorted(counts.items())))
    return "\n".join(out)


def markdown_table(rows: list[list[str]]) -> str:
    lines = ["| " + " | ".join(HEADERS) + " |", "|" + "---|" * len(HEADERS)]
    for r in rows:
        cells = [c.replace("|", "\\|") for c in r]
        if r[-1] == "FAIL":
            cells[-1] = "**FAIL**"
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def _plot_throughput(results: list[dict[str, Any]], path: Path) -> Path | None:
    sweep = [r for r in results if r["key"]["scenario"] == "throughput_sweep"]
    if not sweep:
        return None
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import numpy as np

    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(10, 4))
    by_engine: dict[str, list[tuple[int, float, float]]] = {}
    for r in sweep:
        s = r["samples"]
        tp = float(np.median(s["output_throughput"])) if s.get("output_throughput") else float("nan")
        tpot = float(np.median(s["tpot_ms_p50"])) if s.get("tpot_ms_p50") else float("nan")
        by_engine.setdefault(r["key"]["engine"], []).append((r["key"]["concurrency"], tp, tpot))
    for eng, pts in sorted(by_engine.items()):
        pts.sort()
        c = [p[0] for p in pts]
        ax1.plot(c, [p[1] for p in pts], marker="o", label=eng)
        ax2.plot(c, [p[2] for p in pts], marker="o", label=eng)
    for ax, title, unit in ((ax1, "output throughput", "tok/s"), (ax2, "TPOT p50", "ms")):
        ax.set_xscale("log", base=2)
        ax.set_xlabel("concurrency")
        ax.set_ylabel(unit)
        ax.set_title(title)
        ax.grid(True, alpha=0.3)
        ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def write_reports(session: Any, machine: dict[str, Any], commit: dict[str, Any]) -> dict[str, Path]:
    out_dir: Path = session.report_dir
    out_dir.mkdir(parents=True, exist_ok=True)
    rows = summary_rows(session.results)
    md = [f"## kimi-perf: profile `{session.profile.name}` on `{session.hardware}`", "",
          markdown_table(rows), "",
          f"repeats {session.repeats}; commit {commit.get('id', 'unknown')[:12]}"
          + (" (dirty)" if commit.get("dirty") else "")]
    extra_md = [r["extra"].get("markdown") for r in session.results if r.get("extra", {}).get("markdown")]
    if extra_md:
        md += ["", *extra_md]
    written: dict[str, Path] = {}
    summary = out_dir / "summary.md"
    summary.write_text("\n".join(md) + "\n")
    written["summary"] = summary
    gh = os.environ.get("GITHUB_STEP_SUMMARY")
    if gh:
        with open(gh, "a") as f:
            f.write("\n".join(md) + "\n")
    run = {
        "kimi_perf_run": 1,
        "profile": session.profile.name,
        "hardware": session.hardware,
        "repeats": session.repeats,
        "started": session.started,
        "finished": time.time(),
        "machine": machine,
        "commit": commit,
        "results": session.results,
    }
    run_path = out_dir / "run.json"
    atomic_write_json(run_path, run)
    written["run"] = run_path
    if session.json_path is not None:
        atomic_write_json(session.json_path, run)
        written["json"] = session.json_path
    png = _plot_throughput(session.results, out_dir / "throughput.png")
    if png is not None:
        written["plot"] = png
    return written
