"""Run reports: the terminal/markdown summary table, the JSON run file and PNG plots.

Why several outputs of one table: the terminal table is what a developer reads; the same table goes
to ``<report-dir>/summary.md`` and, on GitHub Actions, ``$GITHUB_STEP_SUMMARY``; the run file keeps
every sample with machine and commit info so a later session can re-gate or plot history.
"""

from __future__ import annotations

import math
import os
import time
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

from .baselines import atomic_write_json
from .stats import _fmt

__all__ = ["ab_rows", "summary_rows", "text_table", "markdown_table", "write_reports"]

# every verdict is printed with its reason: a WARN from a FAIL that did not repeat, an n=1 magnitude
# gate or an INCONCLUSIVE interval must not read as the plain verdict
HEADERS = ["test", "metric", "baseline", "current", "delta %", "tolerance", "verdict", "reason"]
AB_HEADERS = ["test", "metric [probe]", "base", "candidate", "ratio", "interval", "threshold", "pairs/blocks",
              "verdict"]


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
                # an external reference figure is labelled as such where its number is shown
                _fmt(d.get("baseline")) + (" (external ref)" if d["verdict"] == "REF" else ""),
                _fmt(d.get("current")),
                "" if delta is None or not math.isfinite(delta) else f"{delta * 100:+.1f}",
                "" if tol is None else f"{tol * 100:.1f}%",
                d["verdict"],
                d.get("reason") or "",
            ])
    return rows


def ab_rows(results: list[dict[str, Any]]) -> list[list[str]]:
    """One row per decided metric of every same-run A/B result; a side that failed shows as ERROR."""
    rows = []
    for rec in results:
        ab = rec.get("ab")
        if not ab:
            continue
        test = _short_test(rec["nodeid"])
        for d in ab.get("decisions", []):
            arrow = "↑" if d["direction"] == "higher" else "↓"
            bound = 1 - d["threshold"] if d["direction"] == "higher" else 1 + d["threshold"]
            ok = math.isfinite(d.get("ratio", float("nan")))
            rows.append([
                test, f"{d['metric']} {arrow} [{d['unit']}] [{d['probe']}]", _fmt(d["base"]), _fmt(d["candidate"]),
                f"{d['ratio']:.3f}" if ok else "n/a",
                f"[{d['ratio_lo']:.3f}, {d['ratio_hi']:.3f}] ({d['level']:.1%})" if ok else "n/a",
                f"{'>' if d['direction'] == 'higher' else '<'}{bound:.3f}",
                f"{d['n_pairs']}/{d['n_blocks']}", d["verdict"],
            ])
        if ab.get("error"):
            rows.append([test, "(side failed)", "", "", "", "", "", f"-/{ab.get('blocks', 0)}", "ERROR"])
    return rows


def text_table(rows: list[list[str]], headers: list[str] = HEADERS) -> str:
    if not rows:
        return "(no gated results)"
    widths = [max(len(h), *(len(r[i]) for r in rows)) for i, h in enumerate(headers)]
    fmt = "  ".join(f"{{:<{w}}}" for w in widths)
    out = [fmt.format(*headers), "  ".join("-" * w for w in widths)]
    out += [fmt.format(*r) for r in rows]
    v = headers.index("verdict")
    counts: dict[str, int] = {}
    for r in rows:
        counts[r[v]] = counts.get(r[v], 0) + 1
    out.append("verdicts: " + ", ".join(f"{k} {v}" for k, v in sorted(counts.items())))
    return "\n".join(out)


def markdown_table(rows: list[list[str]], headers: list[str] = HEADERS) -> str:
    lines = ["| " + " | ".join(headers) + " |", "|" + "---|" * len(headers)]
    v = headers.index("verdict")
    for r in rows:
        cells = [c.replace("|", "\\|") for c in r]
        if r[v] in ("FAIL", "ERROR", "INCONCLUSIVE", "WARN"):
            cells[v] = f"**{r[v]}**"
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


BaselineOf = Callable[[Mapping[str, Any], str], Sequence[float] | None]


def plot_title(results: list[dict[str, Any]], machine: Mapping[str, Any] | None, profile: str | None) -> str:
    """Model, hardware (GPU names, or the CPU and its cores), engines with their versions, profile."""
    models = sorted({str(r["key"].get("model")) for r in results})
    gpus = [g.get("name", "?") for g in (machine or {}).get("gpus") or []]
    if gpus:
        names = sorted(set(gpus))
        hw = ", ".join(f"{gpus.count(n)}x {n}" for n in names)
    elif machine:
        hw = f"CPU {machine.get('cpu') or '?'} ({machine.get('cpu_count') or '?'} cores)"
    else:
        hw = str(results[0]["key"].get("hardware")) if results else "?"
    engines: dict[str, str | None] = {}
    for r in results:
        engines.setdefault(str(r["key"].get("engine")), r.get("engine_version"))
    eng = ", ".join(f"{e} {v}" if v else e for e, v in sorted(engines.items()))
    return f"{', '.join(models)} on {hw}\nengines: {eng}" + (f"; profile {profile}" if profile else "")


def _plot_throughput(results: list[dict[str, Any]], path: Path, *, baseline: BaselineOf | None = None,
                     machine: Mapping[str, Any] | None = None, profile: str | None = None) -> Path | None:
    """Output throughput and TPOT p50 against concurrency, one colour per engine: this run's median
    (solid line), every repeat (dots) and their min-max (band); the stored baseline's median (dashed,
    hollow markers) and min-max (hatched band) where ``baseline`` has one. Titled with model, hardware,
    engines and versions, so a PNG read on its own says what it measured."""
    sweep = [r for r in results if r["key"]["scenario"] == "throughput_sweep"]
    if not sweep:
        return None
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import numpy as np

    def finite(vals: Sequence[float] | None) -> list[float]:
        return [float(v) for v in vals or () if v is not None and math.isfinite(float(v))]

    fig, axes = plt.subplots(1, 2, figsize=(11, 4.6))
    panels = (("output_throughput", "output throughput (higher is better)", "tok/s"),
              ("tpot_ms_p50", "TPOT p50 (lower is better)", "ms"))
    engines = sorted({r["key"]["engine"] for r in sweep})
    colours = {e: plt.get_cmap("tab10")(i % 10) for i, e in enumerate(engines)}
    with_base = False
    ticks: set[int] = set()
    for ax, (metric, title, unit) in zip(axes, panels):
        for eng in engines:
            recs = sorted((r for r in sweep if r["key"]["engine"] == eng), key=lambda r: r["key"]["concurrency"])
            col = colours[eng]
            cs, med, lo, hi, bc, bmed, blo, bhi = [], [], [], [], [], [], [], []
            for r in recs:
                c = r["key"]["concurrency"]
                v = finite(r["samples"].get(metric))
                if v:
                    cs.append(c)
                    med.append(float(np.median(v)))
                    lo.append(min(v))
                    hi.append(max(v))
                    ax.scatter([c] * len(v), v, s=10, color=col, alpha=0.55, zorder=3)
                b = finite(baseline(r["key"], metric)) if baseline is not None else []
                if b:
                    bc.append(c)
                    bmed.append(float(np.median(b)))
                    blo.append(min(b))
                    bhi.append(max(b))
            if cs:
                ax.plot(cs, med, marker="o", color=col, zorder=4)
                ax.fill_between(cs, lo, hi, color=col, alpha=0.18, lw=0)
            if bc:
                with_base = True
                ax.plot(bc, bmed, ls="--", marker="o", mfc="white", color=col, zorder=2)
                ax.fill_between(bc, blo, bhi, facecolor="none", edgecolor=col, hatch="///", alpha=0.45, lw=0)
            ticks |= set(cs) | set(bc)
        ax.set_xscale("log", base=2)
        ax.set_xlabel("concurrency (requests in flight)")
        ax.set_ylabel(unit)
        ax.set_title(title, fontsize=10)
        ax.grid(True, alpha=0.3)
    for ax in axes:  # the measured levels as ticks, not powers of two
        ax.set_xticks(sorted(ticks), [str(t) for t in sorted(ticks)])
        ax.minorticks_off()
    from matplotlib.lines import Line2D
    from matplotlib.patches import Patch

    handles: list[Any] = [Line2D([], [], color=colours[e], marker="o", label=e) for e in engines]
    handles += [Line2D([], [], color="grey", marker="o", label="this run: median, dots = repeats, band = min-max")]
    handles += ([Line2D([], [], color="grey", ls="--", marker="o", mfc="white", label="baseline: median"),
                 Patch(facecolor="none", edgecolor="grey", hatch="///", label="baseline: min-max")] if with_base else
                [Line2D([], [], color="none", label="(no stored baseline for these points)")])
    fig.legend(handles=handles, loc="lower center", ncol=min(len(handles), 6), fontsize=7, frameon=False)
    fig.suptitle(plot_title(sweep, machine, profile), fontsize=9)
    fig.tight_layout(rect=(0, 0.07, 1, 1))
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def ab_detail_lines(results: list[dict[str, Any]]) -> list[str]:
    """Per A/B result: what was compared, how long it took, why it stopped, and each verdict's reason."""
    out = []
    for rec in results:
        ab = rec.get("ab")
        if not ab:
            continue
        redone = sum(p.get("redone", 0) for p in ab.get("pairs", []))
        ready = [x["ready_s"] for x in ab.get("launches", []) if x.get("ready_s") is not None]
        out.append(f"{_short_test(rec['nodeid'])}: candidate {ab.get('candidate')} "
                   f"({(ab.get('versions') or {}).get('candidate') or '?'}) vs base {ab.get('base')} "
                   f"({(ab.get('versions') or {}).get('base') or '?'}); {ab.get('blocks')} blocks in "
                   f"{ab.get('wall_s', 0):.0f}s, {len(ready)} launches (ready {min(ready, default=0):.1f}-"
                   f"{max(ready, default=0):.1f}s), {redone} pair(s) redone for host steal time; stopped: "
                   f"{ab.get('stopped') or ab.get('error') or '?'}")
        for probe, rec in (ab.get("sized") or {}).items():  # ab.top_min_steady_s: what the pairs ran
            out.append(f"  {probe} sized: {rec.get('why', '?')}")
        for d in ab.get("decisions", []):
            out.append(f"  {d['metric']} [{d['probe']}] {d['verdict']}: {d['reason']}")
    return out


def _plot_ab(results: list[dict[str, Any]], path: Path) -> Path | None:
    """Per-pair candidate/base ratios of every A/B metric, by block, with the interval and threshold."""
    panels = [(rec, d) for rec in results if rec.get("ab") for d in rec["ab"].get("decisions", [])]
    if not panels:
        return None
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import numpy as np

    fig, axes = plt.subplots(1, len(panels), figsize=(4.2 * len(panels), 3.8), squeeze=False)
    for ax, (rec, d) in zip(axes[0], panels):
        pairs = [p for p in rec["ab"]["pairs"] if p["probe"] == d["probe"]]
        xs, ys = [], []
        for p in pairs:
            b, c = p["base"].get(d["metric"]), p["candidate"].get(d["metric"])
            if b and c and math.isfinite(b) and math.isfinite(c) and b > 0:
                xs.append(p["block"] + 0.15 * p["index"])
                ys.append(c / b)
        ax.scatter(xs, ys, s=14, color="tab:blue", label="pair ratio")
        by_block: dict[int, list[float]] = {}
        for x, y in zip(xs, ys):
            by_block.setdefault(int(x), []).append(y)
        if by_block:  # the block summaries the interval is computed from
            bx = sorted(by_block)
            ax.scatter(bx, [float(np.median(by_block[b])) for b in bx], s=60, marker="_", color="black",
                       label="block median")
        if math.isfinite(d["ratio"]):
            ax.axhspan(d["ratio_lo"], d["ratio_hi"], color="tab:blue", alpha=0.15,
                       label=f"{d['level']:.1%} interval")
            ax.axhline(d["ratio"], color="tab:blue", lw=1)
        bound = 1 - d["threshold"] if d["direction"] == "higher" else 1 + d["threshold"]
        ax.axhline(bound, color="tab:red", ls="--", lw=1, label=f"threshold {bound:.3f}")
        ax.axhline(1.0, color="grey", lw=0.8)
        ax.set_title(f"{d['metric']} [{d['probe']}]: {d['verdict']}", fontsize=9)
        ax.set_xlabel("block")
        ax.set_ylabel("candidate / base")
        ax.legend(fontsize=7)
        ax.grid(True, alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def merge_markdown_tables(blocks: list[str]) -> list[str]:
    """One table per comparison: tests that record one layer each (``test_extraction_vs_inference``
    is parametrized by layer) write one ``**title**`` + table block per layer; blocks with the same
    title and header become one table, rows in test order, and their notes (lines outside the table)
    are kept once. Every table ends with a blank line, so the next bold title cannot run into it."""
    groups: dict[tuple[str, str], dict[str, list[str]]] = {}
    order: list[tuple[str, str]] = []
    for block in blocks:
        lines = block.splitlines()
        title = lines[0] if lines and lines[0].startswith("**") else ""
        body = lines[1:] if title else lines
        hdr = next((i for i, ln in enumerate(body) if ln.startswith("|")), None)
        if hdr is None or hdr + 1 >= len(body) or not body[hdr + 1].startswith("|-"):
            key = (block, "")  # not a table: kept as it is, once
            if key not in groups:
                groups[key] = {"pre": [], "rows": [], "post": lines}
                order.append(key)
            continue
        end = hdr + 2
        while end < len(body) and body[end].startswith("|"):
            end += 1
        key = (title, body[hdr] + "\n" + body[hdr + 1])
        g = groups.get(key)
        if g is None:
            g = groups[key] = {"pre": [], "rows": [], "post": []}
            order.append(key)
        g["rows"] += body[hdr + 2:end]
        for part, src in (("pre", body[:hdr]), ("post", body[end:])):
            for ln in src:
                if ln.strip() and ln not in g[part]:
                    g[part].append(ln)
    out: list[str] = []
    for key in order:
        g = groups[key]
        title, header = key
        if not header:
            out += [*g["post"], ""]
            continue
        out += [title, "", *g["pre"], *([""] if g["pre"] else []), *header.split("\n"), *g["rows"], ""]
        if g["post"]:
            out += [*g["post"], ""]
    return out


def store_baseline(store: Any) -> BaselineOf:
    """A result key + metric -> the stored baseline's samples (None where there is none)."""
    from .baselines import BaselineKey

    def of(key: Mapping[str, Any], metric: str) -> Sequence[float] | None:
        try:
            return store.lookup_samples(BaselineKey(**key), metric)
        except TypeError:  # a key of another shape (older run file)
            return None

    return of


def write_reports(session: Any, machine: dict[str, Any], commit: dict[str, Any]) -> dict[str, Path]:
    out_dir: Path = session.report_dir
    out_dir.mkdir(parents=True, exist_ok=True)
    rows = summary_rows(session.results)
    md = [f"## kimi-perf: profile `{session.profile.name}` on `{session.hardware}`", ""]
    if rows:
        md += [markdown_table(rows), ""]
    abr = ab_rows(session.results)
    if abr:
        md += ["### Same-run A/B (candidate vs base, interleaved in this job)", "",
               markdown_table(abr, AB_HEADERS), "", *[f"- {ln.strip()}" for ln in ab_detail_lines(session.results)],
               ""]
    md += [f"repeats {session.repeats}; commit {commit.get('id', 'unknown')[:12]}"
           + (" (dirty)" if commit.get("dirty") else "")]
    extra_md = [r["extra"].get("markdown") for r in session.results if r.get("extra", {}).get("markdown")]
    if extra_md:
        md += ["", *merge_markdown_tables(extra_md)]
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
        "report_dir": str(out_dir),  # where results' request files are (kimi_perf.results), for a --perf-json copy
        "results": session.results,
    }
    run_path = out_dir / "run.json"
    atomic_write_json(run_path, run)
    written["run"] = run_path
    from .results import prune_requests

    prune_requests(out_dir, session.results)  # the report dir holds this run's request files only
    if session.json_path is not None:
        atomic_write_json(session.json_path, run)
        written["json"] = session.json_path
    png = _plot_throughput(session.results, out_dir / "throughput.png", baseline=store_baseline(session.store),
                           machine=machine, profile=session.profile.name)
    if png is not None:
        written["plot"] = png
    png = _plot_ab(session.results, out_dir / "ab_ratios.png")
    if png is not None:
        written["ab_plot"] = png
    return written
