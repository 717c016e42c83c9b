"""Replay recorded A/B pairs under another policy: error rates and verdict times without a GPU.

Why: direct trials of the gate cost minutes of a lent GPU each, and many policy changes (a threshold,
the block budget, fewer pairs a block, retiring decided probes) are questions about how recorded noise
is cut and decided, not about new noise. So a power study's recorded launch rounds are drawn with
replacement into many sequential trials, recut into the asked blocks and decided by the gate's own
rule (:func:`kimi_perf.ab.decide.decide`, :func:`kimi_perf.ab.runner.stop_reason`): a bootstrap of
launch rounds that keeps each round's launch effect and each block's drift, but not correlations
longer than a round (:func:`replay` says what a recut design does not reproduce).

Verdict times come from a :class:`Timing` fitted to the same study: seconds per pair of each probe
(from the durations recorded with every pair, or the probe's output tokens over its measured
throughput in studies recorded before durations were) and seconds per launch round, calibrated so
that the model gives the recorded trials' wall times. That is what lets a replay price a policy that
measures fewer probes in later blocks (``ab.retire_decided``): a block's time is the time of the probes
still measured in it. A replay cannot answer what changes the pairs themselves (longer repeats, another
launch mode) or needs more distinct pairs than were recorded: those need direct trials
(``python -m kimi_perf.power``).
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from .config import ABSpec
from .decide import decide, pair_log_ratio
from .runner import stop_reason

__all__ = ["Round", "Timing", "fit_timing", "overall", "recorded_rounds", "redesign_problem", "replay"]


def overall(verdicts: Sequence[str]) -> str:
    """The comparison's verdict from its metrics': one FAIL fails it, PASS needs every metric."""
    if any(v == "FAIL" for v in verdicts):
        return "FAIL"
    if verdicts and all(v == "PASS" for v in verdicts):
        return "PASS"
    return "INCONCLUSIVE"


@dataclass(frozen=True)
class Timing:
    """Where a study's trial time went: one pair of each probe, and one launch round (launches,
    warm-ups, stops and whatever else the model does not name, from the calibration)."""

    pair_s: Mapping[str, float]  # probe -> seconds of one pair (both sides' repeats)
    round_s: float  # seconds per launch round

    @staticmethod
    def rounds(blocks: int, spec: ABSpec) -> int:
        """Launch rounds a trial of ``blocks`` blocks started under ``spec``."""
        k = spec.blocks_per_launch
        return 1 if k == 0 else math.ceil(blocks / k)

    @staticmethod
    def starts_round(block: int, spec: ABSpec) -> bool:
        """Whether block ``block`` (0-based) begins with a launch round (as in ``run_ab``)."""
        k = spec.blocks_per_launch
        return block == 0 or (k > 0 and block % k == 0)

    def block_s(self, probes: Sequence[str], spec: ABSpec) -> float:
        """Seconds of one block measuring ``probes`` under ``spec``."""
        return sum(spec.repeats_for(p) * self.pair_s.get(p, 0.0) for p in probes)

    def to_json(self) -> dict[str, Any]:
        return {"pair_s": dict(self.pair_s), "round_s": self.round_s}


def _pair_seconds(pair: Mapping[str, Any], workload: Mapping[str, Any]) -> float | None:
    """Seconds both repeats of a recorded pair took: their recorded durations, or (studies recorded
    before durations were) the probe's output tokens over each side's measured output throughput; with
    ``ignore_eos`` the token count is the workload's (lengths drawn around ``output_len`` average it)."""
    d = [_num(pair.get(f"{s}_duration_s")) for s in ("base", "candidate")]
    if all(x is not None and x > 0 for x in d):
        return sum(x for x in d if x is not None)
    tokens = float(workload.get("num_prompts", 0)) * float(workload.get("output_len", 0))
    thr = [_num(pair.get(f"{s}_output_throughput")) for s in ("base", "candidate")]
    if tokens > 0 and workload.get("ignore_eos", True) and all(x is not None and x > 0 for x in thr):
        return sum(tokens / x for x in thr if x is not None)
    return None


def _num(v: Any) -> float | None:
    return float(v) if isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v) else None


def fit_timing(trials: Sequence[Mapping[str, Any]], probes: Sequence[Mapping[str, Any]], spec: ABSpec
               ) -> Timing | None:
    """A :class:`Timing` from a study's recorded trials (``probes``: the stored probe entries with
    their workloads), or None when the trials recorded no pairs to time. The launch-round time is the
    median over trials of (wall time - modelled pair time) / launch rounds, so the model reproduces the
    recorded walls and charges launches, warm-ups and per-repeat overheads to the rounds."""
    work = {p["name"]: p.get("workload", {}) for p in probes}
    per: dict[str, list[float]] = {}
    for t in trials:
        for pr in t.get("pairs", []):
            s = _pair_seconds(pr, work.get(pr.get("probe"), {}))
            if s is not None:
                per.setdefault(pr["probe"], []).append(s)
    if not per:
        return None
    pair_s = {p: float(np.median(v)) for p, v in per.items()}
    rest = []
    for t in trials:
        pairs = t.get("pairs", [])
        if not pairs or not t.get("blocks"):
            continue
        measured = sum(pair_s.get(pr["probe"], 0.0) * (1 + int(pr.get("redone", 0))) for pr in pairs)
        rest.append((float(t["wall_s"]) - measured) / Timing.rounds(int(t["blocks"]), spec))
    return Timing(pair_s, max(0.0, float(np.median(rest))) if rest else 0.0)


@dataclass(frozen=True)
class Round:
    """One recorded launch round: its launch order (0: the base launched first, as in even rounds of
    ``run_ab``) and its blocks, each mapping "probe:metric" to that block's pair log ratios in pair
    order (the metrics of one probe come from the same pairs, so index i is one pair throughout)."""

    order: int
    blocks: tuple[Mapping[str, Sequence[float]], ...]
    probes: frozenset[str] = frozenset()  # probes measured in every block of it (a retired one is not)

    def __post_init__(self) -> None:
        if not self.probes:  # not given: every probe its blocks hold
            held = frozenset.intersection(*(frozenset(k.partition(":")[0] for k in b) for b in self.blocks))
            object.__setattr__(self, "probes", held)


def recorded_rounds(trials: Sequence[Mapping[str, Any]], keys: Sequence[str], blocks_per_launch: int) -> list[Round]:
    """The launch rounds of a condition's trials, with the pair log ratios of ``keys`` ("probe:metric")
    rebuilt from each trial's recorded pairs (so a metric not gated when the trial ran can be replayed),
    or from its gated ``block_log_ratios`` when it recorded no pairs. Pairs recorded without their
    launch round come from trials that relaunched every block (``blocks_per_launch`` 1: the block is
    the round) or launched once (0). A round keeps the probes measured in every one of its blocks: after
    a probe was retired (``ab.retire_decided``) its rounds still serve the probes that were measured.
    Rounds cut short (a trial stopped inside a round) are dropped when complete ones exist."""
    out: list[Round] = []
    for t in trials:
        per: dict[tuple[int, int], dict[str, list[float]]] = {}
        for pr in t.get("pairs") or []:
            rnd = int(pr["launch"]) if "launch" in pr else (int(pr["block"]) if blocks_per_launch == 1 else 0)
            blk = per.setdefault((rnd, int(pr["block"])), {})
            for key in keys:
                probe, _, m = key.partition(":")
                if pr.get("probe") == probe:
                    blk.setdefault(key, []).append(pair_log_ratio(pr, m))
        from_pairs = {k for blk in per.values() for k in blk}
        for key, bl in t.get("block_log_ratios", {}).items():  # gated keys of trials that kept no pairs
            if key in keys and key not in from_pairs:
                for i, ys in enumerate(bl):
                    rnd = i if blocks_per_launch == 1 else (i // blocks_per_launch if blocks_per_launch else 0)
                    per.setdefault((rnd, i), {})[key] = list(ys)
        by_round: dict[int, list[dict[str, list[float]]]] = {}
        for (rnd, _), blk in sorted(per.items()):
            by_round.setdefault(rnd, []).append(blk)
        names = {k.partition(":")[0] for k in keys}
        for rnd, bs in sorted(by_round.items()):
            have = frozenset(p for p in names if all(b.get(k) for b in bs for k in keys if k.startswith(p + ":")))
            if have:
                kept = tuple({k: v for k, v in b.items() if k.partition(":")[0] in have} for b in bs)
                out.append(Round(rnd % 2, kept, have))
    full = max((len(r.blocks) for r in out), default=0)
    return [r for r in out if len(r.blocks) == full]


def redesign_problem(rounds: Sequence[Round], spec: ABSpec, probes: Sequence[str]) -> str | None:
    """Why ``spec``'s blocks cannot be cut from ``rounds`` without reusing a recorded pair, or None.
    A replayed launch round of k blocks takes its blocks from one recorded round's blocks in turn, and
    ``ab.repeats_for(probe)`` distinct pairs from each: more than a recorded block holds would repeat
    pairs and understate the noise."""
    if not rounds:
        return "no complete launch round recorded"
    nb = len(rounds[0].blocks)
    k = spec.blocks_per_launch or spec.max_blocks
    per_block = math.ceil(k / nb)
    for p in probes:
        held = [len(v) for r in rounds if p in r.probes for b in r.blocks for key, v in b.items()
                if key.startswith(p + ":")]
        if not held:
            return f"{p}: no complete launch round recorded it"
        have = min(held)
        need = per_block * spec.repeats_for(p)
        if need > have:
            return (f"{p}: {spec.repeats_for(p)} pairs a block x {k} blocks a launch round need {need} distinct pairs "
                    f"from each recorded block, which holds {have} ({nb} blocks a round were recorded)")
    return None


def replay(rounds: Sequence[Round], spec: ABSpec, gated: Sequence[tuple[str, str]], *, n_trials: int, seed: int = 0,
           timing: Timing | None = None, target_s: float | None = None) -> dict[str, Any]:
    """Sequential trials decided by the gate's own rule on launch rounds drawn with replacement from
    ``rounds`` (:func:`recorded_rounds`); ``gated`` lists the (probe, metric) pairs decided.

    Each replayed round draws a recorded round of the same launch order (the side launched second is
    the same, so a second-launch effect stays in), shuffles its blocks and cuts ``spec``'s blocks from
    them: block j of the round takes ``spec.repeats_for(probe)`` pairs, drawn without replacement, from
    recorded block j mod (blocks recorded per round). Under the recorded design this is a bootstrap of
    rounds that keeps their launch effect and each block's drift; under another design (fewer pairs a
    block, more blocks a round) two replayed blocks may share a recorded block's drift, which the real
    design would not: small next to the pair noise where the study measured it so (its variance
    components). With ``ab.retire_decided`` a probe whose metrics all PASSED at a decision point takes
    no more pairs, as in :func:`kimi_perf.ab.runner.run_ab`, and later rounds are drawn from those that
    measured the probes still active. With ``timing`` every trial's verdict time is estimated (median,
    mean, and the share within ``target_s``) and ``ab.time_budget_s`` ends a trial as it ends a
    comparison."""
    from ..metrics import METRICS

    rng = np.random.default_rng(seed)
    family = len(gated)
    probes = list(dict.fromkeys(p for p, _ in gated))
    by_order = {o: [r for r in rounds if r.order == o] for o in (0, 1)}
    k = spec.blocks_per_launch or spec.max_blocks
    counts = {"PASS": 0, "FAIL": 0, "INCONCLUSIVE": 0}
    used, walls = [], []
    for _ in range(n_trials):
        chosen: dict[str, list[list[float]]] = {f"{p}:{m}": [] for p, m in gated}
        retired: set[str] = set()
        verdict, wall, b = "INCONCLUSIVE", 0.0, 0
        cut: list[dict[str, list[float]]] = []
        for b in range(spec.max_blocks):
            active = [p for p in probes if p not in retired]
            if b % k == 0:  # a launch round: draw a recorded one of this launch order that measured them
                need = set(active)
                pool = ([r for r in by_order[(b // k) % 2] if need <= r.probes]
                        or [r for r in rounds if need <= r.probes])
                rnd = pool[int(rng.integers(len(pool)))]
                # every probe the round holds is cut, used or not: the random draws are then the same
                # under policies that differ only in retirement, so their replays compare paired
                cut = _cut_round(rnd, spec, sorted(rnd.probes), k, rng)
            for p, m in gated:
                if p in active:
                    chosen[f"{p}:{m}"].append(cut[b % k][f"{p}:{m}"])
            if timing is not None:
                wall += timing.block_s(active, spec) + (timing.round_s if timing.starts_round(b, spec) else 0.0)
            # as in run_ab: the block budget, or a spent time budget where an ABBA launch cycle ends
            final = b + 1 >= spec.max_blocks or (timing is not None and spec.time_budget_s is not None
                                                 and spec.balanced(b + 1) and wall >= spec.time_budget_s)
            ds = [decide(METRICS[m], p, chosen[f"{p}:{m}"], [], [], threshold=spec.threshold_for(m),
                         alpha=spec.alpha, family=family, min_blocks=spec.min_blocks, final=final)
                  for p, m in gated]
            if stop_reason(ds, b + 1, spec, final=final):
                verdict = overall([d.verdict for d in ds])
                break
            if spec.retire_decided and b + 1 >= spec.min_blocks and spec.balanced(b + 1):
                retired |= {p for p in active if all(d.verdict == "PASS" for d in ds if d.probe == p)}
        counts[verdict] += 1
        used.append(b + 1)
        walls.append(wall)
    out: dict[str, Any] = {"trials": n_trials, "rounds_pool": len(rounds),
                           **{v.lower(): n for v, n in counts.items()},
                           "mean_blocks": float(np.mean(used)) if used else None,
                           "median_blocks": float(np.median(used)) if used else None}
    if timing is not None and walls:
        out.update(est_median_wall_s=float(np.median(walls)), est_mean_wall_s=float(np.mean(walls)),
                   timing=timing.to_json())
        if target_s is not None:
            out.update(target_s=target_s, within_target=float(np.mean([w <= target_s for w in walls])))
    return out


def _cut_round(rnd: Round, spec: ABSpec, probes: Sequence[str], k: int,
               rng: np.random.Generator) -> list[dict[str, list[float]]]:
    """``k`` blocks cut from a recorded round (see :func:`replay`): pairs of one probe are drawn by
    index, so the metrics of a pair stay together."""
    src = [rnd.blocks[int(i)] for i in rng.permutation(len(rnd.blocks))]
    order = {(j, p): list(rng.permutation(min(len(v) for key, v in blk.items() if key.startswith(p + ":"))))
             for j, blk in enumerate(src) for p in probes}
    out = []
    for j in range(k):
        blk = src[j % len(src)]
        new: dict[str, list[float]] = {}
        for p in probes:
            idx = [order[(j % len(src), p)].pop() for _ in range(spec.repeats_for(p))]
            for key, v in blk.items():
                if key.startswith(p + ":"):
                    new[key] = [float(v[i]) for i in idx]
        out.append(new)
    return out
