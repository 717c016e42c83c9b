"""Where the A/B gate's noise comes from: variance components and the A/A bias of recorded trials.

Why: the sizes of a probe (requests per repeat, pairs per block, blocks per launch) trade wall time
against noise, and which trade pays depends on *where* the noise is. A pair's log ratio
``log(candidate / base)`` varies

- between the pairs of one block (a repeat's own noise: too short a repeat, a stall),
- between the blocks of one launch (drift over minutes),
- between launch rounds of one trial (the launch effect: memory layout, thread placement),
- between trials (jobs: the host, the GPU's clocks that day).

A probe whose noise is within the pair needs longer repeats; one whose noise is between launches
needs more launches, and no number of repeats helps. The estimates are the classical nested-ANOVA
moment estimators computed level by level on group means (each level's spread of means, less what
the level below contributes through the average group size); with unbalanced groups they are
approximate, and a negative estimate (the level adds nothing measurable) is reported as 0 with its
raw value. A hand-written estimator because the design is small and nested and the one maintained
implementation (statsmodels' MixedLM) is not a dependency of the suite; scipy has none.

The A/A bias is what identical code measures as a change: the mean over A/A trials of each trial's
estimate (the mean of its block medians, the gate's own estimator), with a t interval over trials --
trials are independent jobs, blocks of one trial are not. The *second-launch effect* compares, within
trials that launched in both orders, blocks whose candidate launched second with blocks whose base
did: on identical code it is the advantage of being launched second.

One gated job needs no study to say where its own noise was: :func:`noise_note` puts it into an
INCONCLUSIVE verdict's reason, and ``python -m kimi_perf.ab.variance RUN_DIR...`` prints it for any
run files as a table (:func:`noise_table`).
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from collections.abc import Iterable, Mapping, Sequence
from pathlib import Path
from typing import Any

import numpy as np

from .decide import pair_log_ratio

__all__ = ["aa_bias", "clock_link", "flat_pairs", "noise_note", "noise_rows", "noise_table", "pair_log_ratios",
           "second_launch_effect", "variance_components"]

LEVELS = ("trial", "launch", "block")


def flat_pairs(pairs: Sequence[Mapping[str, Any]]) -> list[dict[str, Any]]:
    """The pairs of one run file's A/B (``results[].ab.pairs``: each side's metrics under ``base`` and
    ``candidate``) in the power study's flat form (``base_<metric>``, ``candidate_<metric>``), so the
    estimators here read a single gated job as they read a study's trials."""
    out = []
    for p in pairs:
        q = {k: v for k, v in p.items() if k not in ("base", "candidate")}
        for side in ("base", "candidate"):
            for k, v in (p.get(side) or {}).items():
                q[f"{side}_{k}"] = v
        out.append(q)
    return out


def pair_log_ratios(trials: Sequence[Mapping[str, Any]], probe: str, metric: str) -> list[dict[str, Any]]:
    """One row per finite pair: trial index, launch round, block, log(candidate / base) and who launched
    second in that round (trials recorded before launch rounds existed are round 0, base first)."""
    rows = []
    for ti, t in enumerate(trials):
        for p in t.get("pairs", []):
            if p.get("probe") != probe:
                continue
            y = pair_log_ratio(p, metric)
            if not math.isfinite(y):
                continue
            rnd = int(p.get("launch", 0))
            rows.append({"trial": ti, "launch": rnd, "block": int(p["block"]), "y": y,
                         "second": "candidate" if rnd % 2 == 0 else "base"})
    return rows


def _groups(rows: Sequence[Mapping[str, Any]], depth: int) -> dict[tuple[int, ...], list[float]]:
    out: dict[tuple[int, ...], list[float]] = {}
    for r in rows:
        out.setdefault(tuple(r[k] for k in LEVELS[:depth]), []).append(float(r["y"]))
    return out


def variance_components(rows: Sequence[Mapping[str, Any]]) -> dict[str, Any]:
    """Nested moment estimates of the variance of a pair's log ratio at each level (see module doc).

    Returns ``{"levels": {name: {"var", "sd", "raw", "groups", "confounded"?}}, "total_var", "pairs"}``;
    ``sd`` is in log units (0.01 ~ 1%). A level with one group per parent everywhere (one launch per
    trial, say) cannot be told apart from the level above and is marked confounded; with one pair in every
    block the pair level is marked confounded with ``"within": "block"``, and the block level holds both."""
    if len(rows) < 2:
        return {"pairs": len(rows), "levels": {}, "why": "fewer than two pairs"}
    levels: dict[str, dict[str, Any]] = {}
    # pair level: pooled spread of pairs around their block mean
    blocks = _groups(rows, 3)
    ss = sum(float(np.sum((np.asarray(v) - np.mean(v)) ** 2)) for v in blocks.values())
    df = sum(len(v) - 1 for v in blocks.values())
    if df > 0:
        s2_below = ss / df
        levels["pair"] = {"var": s2_below, "sd": math.sqrt(s2_below), "raw": s2_below, "groups": len(rows)}
    else:
        # one pair in every block (a probe run once a block, e.g. ``ab.repeats: {"top": 1}``): a pair's own
        # noise cannot be told from the block's, so the block level carries both and the pair level says so
        s2_below = 0.0
        levels["pair"] = {"var": float("nan"), "sd": float("nan"), "raw": float("nan"), "groups": len(rows),
                          "confounded": True, "within": "block"}
    # each higher level: spread of the lower level's group means around this level's group means
    lower_means = {k: float(np.mean(v)) for k, v in blocks.items()}
    lower_size = float(np.mean([len(v) for v in blocks.values()]))
    s2_lower_means = s2_below  # the variance the lower level's means carry from below, per unit of size
    for depth, name in ((2, "block"), (1, "launch"), (0, "trial")):
        parents: dict[tuple[int, ...], list[float]] = {}
        for k, m in lower_means.items():
            parents.setdefault(k[:depth], []).append(m)
        df = sum(len(v) - 1 for v in parents.values())
        if df <= 0:
            levels[name] = {"var": float("nan"), "sd": float("nan"), "raw": float("nan"),
                            "groups": len(lower_means), "confounded": True}
        else:
            ss = sum(float(np.sum((np.asarray(v) - np.mean(v)) ** 2)) for v in parents.values())
            s2_means = ss / df
            raw = s2_means - s2_lower_means / lower_size
            levels[name] = {"var": max(raw, 0.0), "sd": math.sqrt(max(raw, 0.0)), "raw": raw,
                            "groups": len(lower_means)}
            s2_lower_means = s2_means
        lower_size = float(np.mean([len(v) for v in parents.values()]))
        lower_means = {k: float(np.mean(v)) for k, v in parents.items()}
    total = sum(v["var"] for v in levels.values() if math.isfinite(v["var"]))
    return {"pairs": len(rows), "levels": levels, "total_var": total}


def _t_interval(values: Sequence[float], level: float = 0.95) -> dict[str, Any]:
    from scipy.stats import t as student_t

    v = [x for x in values if math.isfinite(x)]
    if len(v) < 2:
        return {"n": len(v), "why": "fewer than two trials"}
    m = float(np.mean(v))
    half = float(student_t.ppf(0.5 + level / 2, len(v) - 1)) * float(np.std(v, ddof=1)) / math.sqrt(len(v))
    return {"n": len(v), "ratio": math.exp(m), "lo": math.exp(m - half), "hi": math.exp(m + half), "level": level}


def aa_bias(rows: Sequence[Mapping[str, Any]], *, tolerance: float = 0.005, level: float = 0.95) -> dict[str, Any]:
    """Pooled A/A ratio over trials (each trial: the mean of its block medians) with a t interval, and
    whether the interval contains 1 and lies within ``1 +- tolerance``."""
    per_trial: dict[int, dict[int, list[float]]] = {}
    for r in rows:
        per_trial.setdefault(r["trial"], {}).setdefault(r["block"], []).append(float(r["y"]))
    est = [float(np.mean([np.median(b) for b in t.values()])) for t in per_trial.values()]
    out = _t_interval(est, level)
    if "ratio" in out:
        out["contains_1"] = out["lo"] <= 1.0 <= out["hi"]
        out["within_tolerance"] = 1 - tolerance <= out["lo"] and out["hi"] <= 1 + tolerance
        out["tolerance"] = tolerance
    return out


def second_launch_effect(rows: Sequence[Mapping[str, Any]], *, level: float = 0.95) -> dict[str, Any]:
    """How much faster a side reads when it was launched second: per trial with both launch orders,
    half the difference between its blocks where the candidate launched second and those where the
    base did (log units), pooled over trials with a t interval; as a ratio (1.01 = 1% faster)."""
    per_trial: dict[int, dict[str, list[float]]] = {}
    blocks: dict[tuple[int, int], list[float]] = {}
    for r in rows:
        blocks.setdefault((r["trial"], r["block"]), []).append(float(r["y"]))
        per_trial.setdefault(r["trial"], {"candidate": [], "base": []})
    seconds = {(r["trial"], r["block"]): r["second"] for r in rows}
    for (t, b), ys in blocks.items():
        per_trial[t][seconds[(t, b)]].append(float(np.median(ys)))
    diffs = [(np.mean(v["candidate"]) - np.mean(v["base"])) / 2 for v in per_trial.values() if v["candidate"] and v["base"]]
    if not diffs:
        return {"n": 0, "why": "no trial launched in both orders (blocks_per_launch 0, or a single round)"}
    return _t_interval([float(d) for d in diffs], level)


# what to change when most of an undecided comparison's noise sits at a level
_ADVICE = {
    "pair": "longer repeats or more pairs a block (ab.single_stream / ab.top sizes, ab.repeats_per_block)",
    "block": "more blocks (ab.max_blocks, ab.time_budget_s)",
    "launch": "more launch rounds (a smaller ab.blocks_per_launch or a larger ab.max_blocks); more repeats do not help",
}
_WHERE = {"pair": "within pair", "block": "between blocks", "launch": "between launches"}
# cores the waiting side may use while the other is measured before it counts as a competitor: a
# sleeping server's health checks read ~0.01-0.07 (SGLang with --sleep-on-idle on the H100)
PEER_CPU_BUSY = 0.5


# a GPU whose SM clock moved by more than this across the repeats of a probe, with the metric following
# it (|Spearman rho| at least CLOCK_RHO), is named as a noise source in the verdict
CLOCK_SPREAD = 0.05
CLOCK_RHO = 0.5


def clock_link(pairs: Sequence[Mapping[str, Any]], probe: str, metric: str) -> dict[str, float]:
    """The GPU SM clock (``gpu_sm_clock_mhz``, median per repeat; :mod:`kimi_perf.gpuclock`) across the
    repeats of ``probe``, both sides: its lowest and highest value and the Spearman rank correlation of
    ``metric`` with it over the repeats that have both (``scipy.stats.spearmanr``; rank-based because
    the link between clock and speed need not be linear). Empty where no repeat has a clock (a CPU box,
    runs recorded before the sampler existed)."""
    xs: list[float] = []
    ys: list[float] = []
    for p in pairs:
        if p.get("probe") != probe:
            continue
        for side in ("base", "candidate"):
            c: Any = p.get(f"{side}_gpu_sm_clock_mhz")
            v: Any = p.get(f"{side}_{metric}")
            if _finite(c) and _finite(v):
                xs.append(float(c))
                ys.append(float(v))
    if not xs:
        return {}
    out = {"clock_min_mhz": min(xs), "clock_max_mhz": max(xs), "rho": math.nan}
    if len(xs) >= 3 and len(set(xs)) > 1 and len(set(ys)) > 1:
        from scipy.stats import spearmanr  # lazy: scipy is only needed where clocks were sampled

        out["rho"] = float(spearmanr(xs, ys).statistic)
    return out


def noise_note(pairs: Sequence[Mapping[str, Any]], probe: str, metric: str) -> str:
    """One sentence for an INCONCLUSIVE verdict: where the noise of ``metric`` in ``probe`` sat (the SD
    of a pair's ratio by level), what would cut it, and whether the waiting side competed for the host
    CPU. ``pairs`` are flat (:func:`flat_pairs`). "" when there is too little to say.

    Why in the verdict: a GPU job that ends INCONCLUSIVE is rerun by someone who did not design the
    policy; "the interval straddles the threshold" does not tell them whether to add repeats, launch
    rounds or quiet the host, and the run already holds the answer."""
    rows = pair_log_ratios([{"pairs": pairs}], probe, metric)
    levels = variance_components(rows).get("levels", {})
    sds = {lv: float(levels[lv]["sd"]) for lv in ("pair", "block", "launch")
           if lv in levels and math.isfinite(levels[lv]["sd"])}
    parts = []
    if sds:
        where = ", ".join(f"{100 * v:.1f}% {_WHERE[lv]}" for lv, v in sds.items())
        top = max(sds, key=lambda k: sds[k])
        parts.append(f"noise (SD of a pair's ratio): {where}; most {_WHERE[top]}: {_ADVICE[top]}")
    peer = [float(p[f"{s}_peer_cpu_util"]) for p in pairs if p.get("probe") == probe for s in ("base", "candidate")
            if isinstance(p.get(f"{s}_peer_cpu_util"), (int, float)) and math.isfinite(p[f"{s}_peer_cpu_util"])]
    if peer and float(np.median(peer)) > PEER_CPU_BUSY:
        parts.append(f"the waiting side used {float(np.median(peer)):.2f} cores (median) while the other was measured: "
                     "an idle server that polls competes for the host CPU (SGLang: --sleep-on-idle), or pin the "
                     "sides to disjoint cores (ab.pin_cpus)")
    ck = clock_link(pairs, probe, metric)
    if (ck and ck["clock_max_mhz"] > (1 + CLOCK_SPREAD) * ck["clock_min_mhz"] and math.isfinite(ck["rho"])
            and abs(ck["rho"]) >= CLOCK_RHO):
        parts.append(f"the GPU's SM clock moved {ck['clock_min_mhz']:.0f}-{ck['clock_max_mhz']:.0f} MHz across "
                     f"repeats and {metric} followed it (Spearman rho {ck['rho']:.2f}): lock the runner's GPU "
                     "clocks (nvidia-smi --lock-gpu-clocks) for merge jobs")
    return "; ".join(parts)


def _finite(v: Any) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)


def _median(vals: Iterable[Any]) -> float:
    v = [float(x) for x in vals if _finite(x)]
    return float(np.median(v)) if v else math.nan


def noise_rows(results: Sequence[Mapping[str, Any]]) -> list[dict[str, Any]]:
    """Where the noise of each gated A/B metric in a run file's ``results`` came from: the variance
    components of a pair's log ratio (within pair, between blocks, between launch rounds), the range of
    the pair ratios, this run's second-launch difference (blocks whose candidate launched second
    against those whose base did; one run gives no interval), and the host signals that explain a noisy
    run: the waiting side's CPU use (``peer_cpu_util``), the measured server's CPU per token, and the
    GPU's SM clock range with the metric's rank correlation to it (:func:`clock_link`).

    Why from one run: a user whose GPU job came out INCONCLUSIVE needs to know whether more repeats,
    more launches or a quieter host would help, before paying for a power study."""
    rows = []
    for rec in results:
        ab = rec.get("ab") or {}
        flat = flat_pairs(ab.get("pairs") or [])
        key = rec.get("key") or {}
        for d in ab.get("decisions") or []:
            probe, metric = d.get("probe"), d.get("metric")
            lr = pair_log_ratios([{"pairs": flat}], probe, metric)
            levels = variance_components(lr).get("levels", {})
            mine = [p for p in flat if p.get("probe") == probe]
            by_block: dict[int, list[float]] = {}
            second: dict[int, str] = {}
            for r in lr:
                by_block.setdefault(r["block"], []).append(r["y"])
                second[r["block"]] = r["second"]
            cand2 = [_median(v) for b, v in by_block.items() if second[b] == "candidate"]
            base2 = [_median(v) for b, v in by_block.items() if second[b] == "base"]
            ys = [r["y"] for r in lr]
            peers = [p.get(f"{s}_peer_cpu_util") for p in mine for s in ("base", "candidate")]
            ck = clock_link(flat, probe, metric)
            rows.append({
                # the base's name without its description: the decision table (results ab-table) has that
                "engine": key.get("engine"), "base": str(ab.get("base")).split(" (")[0], "probe": probe,
                "metric": metric, "pairs": len(lr),
                **{f"sd_{lv}_pct": 100 * levels.get(lv, {}).get("sd", math.nan) for lv in _WHERE},
                "pair_ratio_min": math.exp(min(ys)) if ys else math.nan,
                "pair_ratio_max": math.exp(max(ys)) if ys else math.nan,
                "second_launch": (math.exp((float(np.mean(cand2)) - float(np.mean(base2))) / 2)
                                  if cand2 and base2 else math.nan),
                "peer_cpu_util_median": _median(peers),
                "peer_cpu_util_max": max((float(v) for v in peers if v is not None and _finite(v)), default=math.nan),
                **{f"{side}_engine_cpu_ms_per_tok_median": _median(p.get(f"{side}_engine_cpu_ms_per_tok") for p in mine)
                   for side in ("base", "candidate")},
                **{k: ck.get(k, math.nan) for k in ("clock_min_mhz", "clock_max_mhz", "rho")},
            })
    return rows


def noise_table(runs: Sequence[Sequence[Mapping[str, Any]]]) -> str:
    """Markdown table of :func:`noise_rows` over several runs' results: SDs in percent of a pair's
    ratio, n/a where the design cannot separate a level (one pair a block: the block level holds the
    pair's noise)."""

    def num(v: Any, fmt: str) -> str:
        return format(v, fmt) if _finite(v) else "n/a"

    head = ["engine", "base", "probe", "metric", "pairs", "SD within pair %", "between blocks %",
            "between launches %", "pair ratios", "second launch (this run)",
            "waiting side's CPU, cores (median / max)", "engine CPU ms/tok base / candidate",
            "GPU SM clock MHz (min-max)", "metric vs clock (Spearman rho)"]
    lines = [head, ["---"] * len(head)]
    for results in runs:
        for r in noise_rows(results):
            lines.append([str(r["engine"]), r["base"], str(r["probe"]), str(r["metric"]), str(r["pairs"]),
                          *(num(r[f"sd_{lv}_pct"], ".2f") for lv in _WHERE),
                          f"{num(r['pair_ratio_min'], '.3f')}-{num(r['pair_ratio_max'], '.3f')}",
                          f"x{num(r['second_launch'], '.4f')}",
                          f"{num(r['peer_cpu_util_median'], '.3f')} / {num(r['peer_cpu_util_max'], '.3f')}",
                          " / ".join(num(r[f"{side}_engine_cpu_ms_per_tok_median"], ".2f")
                                     for side in ("base", "candidate")),
                          f"{num(r['clock_min_mhz'], '.0f')}-{num(r['clock_max_mhz'], '.0f')}",
                          num(r["rho"], ".2f")])
    return "\n".join("| " + " | ".join(cells) + " |" for cells in lines)


def main(argv: list[str] | None = None) -> int:
    """``python -m kimi_perf.ab.variance RUN...``: :func:`noise_table` of report folders or run files."""
    ap = argparse.ArgumentParser(prog="python -m kimi_perf.ab.variance",
                                 description="where each same-run A/B's noise came from: variance components of "
                                             "a pair's ratio, launch order and host CPU, as a markdown table")
    ap.add_argument("runs", nargs="+", help="report directories (holding run.json) or run files")
    ns = ap.parse_args(argv)
    runs = []
    for r in ns.runs:
        path = Path(r) / "run.json" if Path(r).is_dir() else Path(r)
        try:
            runs.append(json.loads(path.read_text()).get("results") or [])
        except (OSError, ValueError) as e:
            ap.error(f"{path}: {e}")
    print(noise_table(runs))
    return 0


if __name__ == "__main__":
    sys.exit(main())
