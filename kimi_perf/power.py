"""Prove the A/B gate's power: ``python -m kimi_perf.power`` measures how often it is wrong.

Why: a gate is only as good as its verdicts, and its error rates depend on the machine's noise, which
no formula knows. So they are measured, on the machine kind that runs the gate, with the gate exactly
as deployed (:func:`kimi_perf.ab.runner.run_ab` with the profile's ``ab`` policy):

- A/A trials: base and candidate are the same engine and code; any FAIL is a false fail;
- planted trials: the candidate's reference engine burns X% of every decode step on the CPU
  (``KIMI_PERF_PLANT_SLOWDOWN``, proportional to the step's measured duration, not a fixed sleep);
  a FAIL is a detection, a PASS a miss, INCONCLUSIVE neither.

Trials of the conditions are interleaved (round-robin, rotating the order) so a slow hour of the
machine hits every condition alike. Each trial is written to the output as soon as it ends, and a
rerun with the same configuration continues where the last one stopped (a study runs for hours).

Direct trials are expensive (minutes each), so their rates come with wide exact (Clopper-Pearson)
intervals. The report adds a *replay* estimate (:mod:`kimi_perf.ab.replay`): the recorded launch
rounds of each condition are resampled with replacement into many sequential trials decided by the
same rule, with verdict times from the study's own timing. Both are in ``benchmarks/gate-power.json`` with the
machine they ran on.
"""

from __future__ import annotations

import argparse
import json
import math
import time
from collections import Counter
from collections.abc import Sequence
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Any

import numpy as np

from .ab.config import ABSpec, describe_launches
from .ab.replay import fit_timing, overall, recorded_rounds, redesign_problem, replay
from .ab.runner import ABOutcome, ABSideError, Probe, run_ab
from .ab.variance import aa_bias, pair_log_ratios, second_launch_effect, variance_components
from .bench import RunningServer, fetch_version
from .engines.reference import PLANT_ENV
from .progress import log

__all__ = ["ProcessSide", "clopper_pearson", "replay", "study_entry", "summarize"]

TARGETS: dict[str, dict[str, Any]] = {"cpu": {"false_fail_max": 0.01, "detect": {"0.1": 0.95}, "verdict_s_max": 600},
           "cuda": {"false_fail_max": 0.01, "detect": {"0.05": 0.95}, "verdict_s_max": 300}}


@dataclass
class ProcessSide:
    """A side launched directly (no pytest): one engine config, relaunched on every ``start``."""

    role: str
    label: str
    cfg: Any
    log_dir: Path
    server: RunningServer | None = None

    def start(self, cpus: tuple[int, ...] = ()) -> RunningServer:
        from .launcher import ServerProcess

        self.stop()
        proc = ServerProcess(replace(self.cfg, cpus=tuple(cpus)).launch_spec(self.log_dir)).start()
        self.server = RunningServer(self.cfg.name, self.cfg.kind, proc.base_url, self.cfg.served_model_name, proc,
                                    self.cfg)
        self.server.version = fetch_version(self.server)
        return self.server

    def stop(self) -> None:
        if self.server is not None:
            self.server.process.stop()
            self.server = None


def clopper_pearson(k: int, n: int, level: float = 0.95) -> tuple[float, float]:
    """Exact binomial interval for k successes in n trials."""
    from scipy.stats import beta

    if n == 0:
        return (0.0, 1.0)
    a = 1 - level
    lo = 0.0 if k == 0 else float(beta.ppf(a / 2, k, n - k + 1))
    hi = 1.0 if k == n else float(beta.ppf(1 - a / 2, k + 1, n - k))
    return lo, hi


# every pair's figures kept in the study, gated or not: the gated ones and candidates for gating
# (--replay-only can decide any of them), plus what may explain noise: engine CPU, host steal, the
# load generator's CPU per chunk (a client near one core's worth at C=128 adds its own jitter), the
# length of the steady window the C=128 throughput was read from, the waiting side's CPU and the GPU's
# clock and power; and each repeat's duration, which times a replayed policy
# (kimi_perf.ab.replay.fit_timing)
RECORDED = ("decode_tok_s", "output_throughput", "steady_output_throughput", "tpot_ms_p50", "ttft_ms_p50",
            "e2el_ms_p50", "engine_cpu_ms_per_tok", "host_steal_fraction", "client_cpu_us_per_chunk",
            "steady_window_s", "duration_s", "peer_cpu_util", "gpu_sm_clock_mhz", "gpu_power_w")


def trial_record(out: ABOutcome, plant: float, round_: int) -> dict[str, Any]:
    gated = [(p.name, m) for p in out.probes for m in p.gated]
    return {
        "plant": plant, "round": round_, "verdict": overall([d.verdict for d in out.decisions]),
        "decisions": [{"probe": d.probe, "metric": d.metric, "verdict": d.verdict, "ratio": d.ratio,
                       "lo": d.ratio_lo, "hi": d.ratio_hi, "pairs": d.n_pairs} for d in out.decisions],
        "blocks": out.blocks, "wall_s": out.wall_s, "stopped": out.stopped, "error": out.error,
        "redone": sum(p.redone for p in out.pairs),
        "ready_s": [x.get("ready_s") for x in out.launches],
        # per block, per gated metric: the pair log ratios (what the replay resamples)
        "block_log_ratios": {f"{p}:{m}": out.block_log_ratios(p, m) for p, m in gated},
        # every pair's gated and noise-resistant figures, for analyses the gate does not make
        "pairs": [{"block": pr.block, "launch": pr.launch, "probe": pr.probe, "first": pr.first, "redone": pr.redone,
                   **{f"{side}_{k}": getattr(pr, side).get(k) for side in ("base", "candidate")
                      for k in RECORDED}}
                  for pr in out.pairs],
        "launch_order": [[x["role"], x.get("round", 0)] for x in out.launches],
        "cpus": out.cpus,
        "retired": out.retired,  # probe -> the blocks it ran before its metrics PASSED (ab.retire_decided)
        "sized": out.sized,  # probe -> its measured size (ab.top_min_steady_s)
        "steal_max": max((v for pr in out.pairs for v in (pr.base.get("host_steal_fraction", 0.0),
                                                          pr.candidate.get("host_steal_fraction", 0.0))
                          if math.isfinite(v)), default=None),
    }


def summarize(entry: dict[str, Any], spec: ABSpec, probes: Sequence[Probe], *, replay_trials: int) -> dict[str, Any]:
    hw = entry.get("hardware_class", "cpu")
    targets = TARGETS.get(hw, TARGETS["cpu"])
    out: dict[str, Any] = {"conditions": {}, "targets": targets}
    by_plant: dict[str, list[dict[str, Any]]] = {}
    for t in entry["trials"]:
        by_plant.setdefault(f"{t['plant']:g}", []).append(t)
    for plant, trials in sorted(by_plant.items(), key=lambda kv: float(kv[0])):
        ok = [t for t in trials if not t.get("error")]
        n = len(ok)
        k_fail = sum(t["verdict"] == "FAIL" for t in ok)
        k_inc = sum(t["verdict"] == "INCONCLUSIVE" for t in ok)
        walls = {v: float(np.median([t["wall_s"] for t in ok if t["verdict"] == v]))
                 for v in ("PASS", "FAIL", "INCONCLUSIVE") if any(t["verdict"] == v for t in ok)}
        gated = [(p.name, m) for p in probes for m in p.gated]
        rounds = recorded_rounds(ok, [f"{p}:{m}" for p, m in gated], spec.blocks_per_launch)
        c: dict[str, Any] = {
            "trials": n, "errors": len(trials) - n, "fail": k_fail, "inconclusive": k_inc,
            "pass": n - k_fail - k_inc, "fail_rate": k_fail / n if n else None,
            "fail_rate_ci95": clopper_pearson(k_fail, n), "inconclusive_rate": k_inc / n if n else None,
            "median_wall_s_by_verdict": walls, "median_wall_s": float(np.median([t["wall_s"] for t in ok])) if ok else None,
            "median_blocks": float(np.median([t["blocks"] for t in ok])) if ok else None,
        }
        noise = {}
        for p in probes:
            for m in p.gated:
                rows = pair_log_ratios(ok, p.name, m)
                noise[f"{p.name}:{m}"] = {"components": variance_components(rows)}
                if float(plant) == 0:  # identical code: what it measures as a change is bias
                    noise[f"{p.name}:{m}"].update(aa_bias=aa_bias(rows), second_launch=second_launch_effect(rows))
        c["noise"] = noise
        if rounds and replay_trials:
            r = replay(rounds, spec, gated, n_trials=replay_trials, seed=int(float(plant) * 1000),
                       timing=fit_timing(ok, entry.get("probes", []), spec), target_s=float(targets["verdict_s_max"]))
            r["fail_rate"] = r["fail"] / r["trials"]
            r["fail_rate_ci95"] = clopper_pearson(r["fail"], r["trials"])
            r["inconclusive_rate"] = r["inconclusive"] / r["trials"]
            c["replay"] = r
        out["conditions"][plant] = c
    return out


# knobs a replay can change: how recorded pairs are decided, and how they are cut into blocks and launch
# rounds (within the pairs a recorded block holds: kimi_perf.ab.replay.redesign_problem); what a pair
# is (its workload, the launch mode, pinning) needs direct trials
REPLAYABLE = ("threshold", "thresholds", "alpha", "min_blocks", "max_blocks", "time_budget_s", "gated", "retire_decided",
              "repeats_per_block", "repeats", "blocks_per_launch")


def recorded_spec(entry: dict[str, Any]) -> ABSpec:
    """The A/B policy a stored study ran under (entries before launch rounds say ``relaunch``)."""
    stored = {k: v for k, v in entry["spec"].items() if k in ABSpec.__dataclass_fields__}
    if "relaunch" in entry["spec"] and "blocks_per_launch" not in stored:
        stored["blocks_per_launch"] = 1 if entry["spec"]["relaunch"] else 0
    return ABSpec(**stored)


def what_if(doc: dict[str, Any], overrides: dict[str, Any], *, labels: Sequence[str] = (),
            n_trials: int = 4000) -> str:
    """The replay of every stored study (or ``labels``) under its recorded policy changed by
    ``overrides``: the error rates and verdict time another threshold or block budget would give on the
    noise those machines showed, before a device lease is spent on direct trials of it."""
    bad = sorted(set(overrides) - set(REPLAYABLE))
    if bad:
        raise SystemExit(f"--replay-only: {bad} changed what was measured, which a replay cannot; "
                         f"it can change {', '.join(REPLAYABLE)}")
    lines = [f"What-if replay of recorded launch rounds ({n_trials} trials per condition) with "
             + (", ".join(f"{k}={json.dumps(v)}" for k, v in overrides.items()) or "the recorded policy"), "",
             "| machine | planted | launch rounds | PASS | FAIL | INCONCLUSIVE | median blocks | mean blocks | "
             "est. wall s median / mean | within target |", "|---|---|---|---|---|---|---|---|---|---|"]
    for label, e in doc.get("machines", {}).items():
        if labels and label not in labels:
            continue
        was = recorded_spec(e)
        try:
            spec = replace(was, **overrides)
        except ValueError as err:
            raise SystemExit(f"--replay-only: {label}: {err}") from None
        gated = [(p["name"], m) for p in e["probes"] for m in p["gated"]]
        if "gated" in overrides:  # probe roles (single_stream / top) -> the recorded probe names
            names = {"single_stream": "single_stream", "top": next((p["name"] for p in e["probes"]
                                                                   if p["name"] != "single_stream"), "top")}
            gated = [(names[r], m) for r, ms in overrides["gated"].items() for m in ms]
        by_plant: dict[float, list[dict[str, Any]]] = {}
        for t in e["trials"]:
            if not t.get("error"):
                by_plant.setdefault(float(t["plant"]), []).append(t)
        target = float(TARGETS.get(e.get("hardware_class", "cpu"), TARGETS["cpu"])["verdict_s_max"])
        for plant, trials in sorted(by_plant.items()):
            rounds = recorded_rounds(trials, [f"{p}:{m}" for p, m in gated], was.blocks_per_launch)
            if not rounds:
                raise SystemExit(f"--replay-only: {label} recorded no pairs of {[f'{p}:{m}' for p, m in gated]}")
            why = redesign_problem(rounds, spec, [p for p, _ in gated])
            if why:  # another machine's study may still answer: say why this one cannot, in its row
                lines.append(f"| {label} | {plant:.0%} | {len(rounds)} | not replayable: {why}; a replay cannot "
                             "measure new pairs |")
                continue
            r = replay(rounds, spec, gated, n_trials=n_trials, seed=int(plant * 1000), target_s=target,
                       timing=fit_timing(trials, e.get("probes", []), was))
            wall = (f"{r['est_median_wall_s']:.0f} / {r['est_mean_wall_s']:.0f}" if "est_median_wall_s" in r else "-")
            within = f"{r['within_target']:.3f} (<= {target:.0f} s)" if "within_target" in r else "-"
            lines.append(f"| {label} | {plant:.0%} | {len(rounds)} | {r['pass'] / n_trials:.3f} | "
                         f"{r['fail'] / n_trials:.3f} | {r['inconclusive'] / n_trials:.3f} | {r['median_blocks']:g} | "
                         f"{r['mean_blocks']:.1f} | {wall} | {within} |")
    return "\n".join(lines)


def _commits(e: dict[str, Any]) -> str:
    """The commit(s) the trials ran at: a study continued across commits says so."""
    counts = Counter(str(t.get("commit") or e.get("commit"))[:10] for t in e.get("trials", []))
    if len(counts) <= 1:
        return f"commit {next(iter(counts), str(e.get('commit'))[:10])}"
    return "commits " + ", ".join(f"{c} ({n} trials)" for c, n in counts.items())


_TITLE = "# A/B gate power (measured)"
_GENERATED = "Written by `python -m kimi_perf.power`;"


def with_preface(previous: str | None, generated: str) -> str:
    """``generated`` under the hand-written preface of ``previous``, if it has one.

    A study's Markdown file may open with prose a person wrote (what was asked, the commands, a
    table drawn from several entries) above the generated part, which starts at its fixed sentence;
    a resumed or replayed study rewrites the file and once erased such a preface. The generated
    title is dropped when a preface stands in its place."""
    if not previous or _GENERATED not in previous:
        return generated
    preface = previous[:previous.index(_GENERATED)]
    if preface.strip() == _TITLE:
        return generated
    return preface + generated[generated.index(_GENERATED):]


def markdown(doc: dict[str, Any]) -> str:
    lines = [_TITLE, "",
             _GENERATED + " rates are FAIL verdicts per trial. A/A (plant 0): a FAIL "
             "is a false fail. Planted X: the candidate's decode steps are X slower; a FAIL is a detection. "
             "`direct` = real trials (exact 95% interval), `replay` = the same rule on recorded blocks "
             "resampled with replacement.", ""]
    for label, e in doc.get("machines", {}).items():
        s = e.get("summary", {})
        lines += [f"## {label}", "", f"{e.get('machine', {}).get('cpu', '?')}, "
                  f"{', '.join(g.get('name', '') for g in e.get('machine', {}).get('gpus', [])) or 'no GPU'}; "
                  f"profile {e.get('profile')}, engine {e.get('engine')}, {_commits(e)}; "
                  f"{_policy(e)}; servers {e.get('servers', '?')}", "",
                  "| planted | trials | FAIL rate (direct, 95% CI) | inconclusive | median wall s | FAIL rate (replay) | "
                  "inconclusive (replay) |", "|---|---|---|---|---|---|---|"]
        for plant, c in s.get("conditions", {}).items():
            rp = c.get("replay") or {}
            lo, hi = c["fail_rate_ci95"]
            lines.append(
                f"| {float(plant):.0%} | {c['trials']} | {c['fail']}/{c['trials']} [{lo:.2f}, {hi:.2f}] | "
                f"{c['inconclusive']}/{c['trials']} | {c['median_wall_s'] or 0:.0f} | "
                + (f"{rp['fail_rate']:.3f} ({rp['trials']} from {_pool(rp)}) | "
                   f"{rp['inconclusive_rate']:.3f} |" if rp else "- | - |"))
        lines.append("")
        lines += _noise_lines(s.get("conditions", {}))
    old = [(label, e) for label, es in doc.get("superseded", {}).items() for e in es]
    if old:
        lines += ["## Superseded studies", "", "Earlier studies of a machine under another A/B policy, kept in the "
                  "JSON (`superseded`) as what the current policy was resized from.", "",
                  "| machine | policy | servers | planted: verdicts (PASS/FAIL/INCONCLUSIVE) |", "|---|---|---|---|"]
        for label, e in old:
            counts = Counter((f"{t['plant']:g}", t["verdict"]) for t in e.get("trials", []) if not t.get("error"))
            per = "; ".join(f"{float(p):.0%}: {counts[(p, 'PASS')]}/{counts[(p, 'FAIL')]}/{counts[(p, 'INCONCLUSIVE')]}"
                            for p in sorted({p for p, _ in counts}, key=float))
            lines.append(f"| {label} | {_policy(e)} | {e.get('servers', '?')} | {per} |")
        lines.append("")
    return "\n".join(lines) + "\n"


def _policy(e: dict[str, Any]) -> str:
    """A stored entry's A/B policy in the words of the A/B header (thresholds, pairs, launches, budget)."""
    sp = recorded_spec(e)
    return (f"threshold {sp.describe_thresholds()}, alpha {sp.alpha}, blocks {sp.min_blocks}-{sp.max_blocks} x "
            f"{sp.describe_repeats()}, {sp.launch_schedule}"
            + (f", time budget {sp.time_budget_s:.0f} s" if sp.time_budget_s else ""))


def _pool(rp: dict[str, Any]) -> str:
    """What a stored replay drew from (summaries written before launch-round replays drew blocks)."""
    return f"{rp['rounds_pool']} launch rounds" if "rounds_pool" in rp else f"{rp.get('blocks_pool')} blocks"


def _launches(spec: dict[str, Any]) -> str:
    """A stored entry's launch schedule (entries recorded before launch rounds say ``relaunch``)."""
    return describe_launches(spec.get("blocks_per_launch", 1 if spec.get("relaunch", True) else 0),
                             bool(spec.get("pin_cpus")), bool(spec.get("parallel_launch")))


def _noise_lines(conditions: dict[str, Any]) -> list[str]:
    """The A/A bias and the variance components (sd of a pair's log ratio by level, in %)."""
    out: list[str] = []
    for plant, c in conditions.items():
        for key, n in (c.get("noise") or {}).items():
            lv = n["components"].get("levels", {})
            if not lv:
                continue
            if not out:
                out += ["| planted | probe:metric | pairs | sd within pair | between blocks | between launches | "
                        "between trials | A/A ratio (95% CI) | second-launch effect |", "|---|---|---|---|---|---|---|---|---|"]

            def sd(name: str, lv: dict[str, Any] = lv) -> str:
                x = lv.get(name, {})
                if x.get("confounded"):  # a pair level "within" blocks: 1 pair a block, its noise is in blocks
                    return f"in {x['within']}s" if x.get("within") else "confounded"
                return f"{100 * x.get('sd', float('nan')):.2f}%"

            b, s2 = n.get("aa_bias") or {}, n.get("second_launch") or {}
            bias = (f"x{b['ratio']:.4f} [{b['lo']:.4f}, {b['hi']:.4f}]" if "ratio" in b else "-")
            sec = (f"x{s2['ratio']:.4f} [{s2['lo']:.4f}, {s2['hi']:.4f}]" if "ratio" in s2 else "-")
            out.append(f"| {float(plant):.0%} | {key} | {n['components']['pairs']} | {sd('pair')} | {sd('block')} | "
                       f"{sd('launch')} | {sd('trial')} | {bias} | {sec} |")
    return out + [""] if out else []


def study_entry(doc: dict[str, Any], label: str, config: dict[str, Any]) -> dict[str, Any]:
    """The machine's entry to continue: the stored one when it ran the same A/B policy and probes, else
    a fresh one. An earlier study of the machine under another policy is evidence too (what the policy
    was resized from), so it moves to ``doc["superseded"][label]`` instead of being overwritten."""
    entry = doc.setdefault("machines", {}).get(label)
    same = entry is not None and _same_policy(entry, config)
    if entry is not None and same:
        return entry
    if entry is not None:
        log(f"power: {label} has trials of another configuration; moving them to superseded[{label}] and "
            "starting that machine's entry afresh")
        doc.setdefault("superseded", {}).setdefault(label, []).append(entry)
    return {**config, "trials": []}


def _same_policy(entry: dict[str, Any], config: dict[str, Any]) -> bool:
    """Whether a stored study ran ``config``'s A/B policy and probes. A field added to the policy or a
    workload after the study was stored is absent there; at its default it changes nothing, so it does
    not make the policy another one (or every new field would restart every study)."""
    from dataclasses import fields

    from .load.workload import Workload
    from .profile_schema import json_default

    def filled(stored: dict[str, Any], new: dict[str, Any], klass: Any) -> bool:
        dflt = {f.name: json_default(f) for f in fields(klass)}
        keys = set(stored) | set(new)
        return all(stored.get(k, dflt.get(k)) == new.get(k, dflt.get(k)) for k in keys)

    new = json.loads(json.dumps(config))
    if not filled(entry.get("spec", {}), new["spec"], ABSpec):
        return False
    old_p, new_p = entry.get("probes", []), new["probes"]
    return len(old_p) == len(new_p) and all(
        {k: v for k, v in a.items() if k != "workload"} == {k: v for k, v in b.items() if k != "workload"}
        and filled(a.get("workload", {}), b.get("workload", {}), Workload) for a, b in zip(old_p, new_p))


def _target(profile: Any) -> tuple[str, Path, str]:
    """(name, model dir, load format) of the profile's model, without pytest."""
    m = profile.model
    if m.source == "embedded":
        from .models.embedded import ensure_embedded_model

        e = ensure_embedded_model()
        return e.name, e.path, "auto"
    if m.source == "dummy":
        from .models.dummy import ensure_dummy_model
        from .profiles import DUMMY_SHAPES

        return m.name, ensure_dummy_model(m.dummy_shape, DUMMY_SHAPES[m.dummy_shape]), "dummy"
    p = Path(m.path or "").expanduser()
    if not (p / "config.json").is_file():
        raise SystemExit(f"profile {profile.name}: model {m.name} not found at {m.path}")
    return m.name, p, "auto"


def _key_json(text: str) -> tuple[str, Any]:
    """``KEY=VALUE`` with a JSON value (--set, --engine-set), checked when the options are parsed."""
    k, eq, v = text.partition("=")
    try:
        if not (k and eq):
            raise ValueError
        return k, json.loads(v)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r}: give KEY=VALUE with a JSON value, e.g. blocks_per_launch=3 "
                                         "or 'thresholds={\"steady_output_throughput\": 0.075}'") from None


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m kimi_perf.power", description=__doc__.splitlines()[0])
    ap.add_argument("--profile", default="embedded-cpu", help="profile name or JSON path (default embedded-cpu)")
    ap.add_argument("--engine", default="reference", help="reference-kind engine of the profile (default reference)")
    ap.add_argument("--trials", type=int, default=3, help="direct trials per condition (default 3)")
    ap.add_argument("--plants", default="0,0.05,0.1,0.2", help="planted slowdowns, fractions (0 = A/A)")
    ap.add_argument("--out", default="benchmarks/gate-power.json", help="JSON to write (continued when it exists)")
    ap.add_argument("--label", default=None, help="machine label in the output (default: the hardware key)")
    ap.add_argument("--max-wall-s", type=float, default=None, help="start no trial after this many seconds")
    ap.add_argument("--stop-file", type=Path, default=None,
                    help="start no trial once this file exists (a lease that must end: the running trial is "
                         "finished and saved, none is lost to a kill)")
    ap.add_argument("--set", action="append", default=[], metavar="KEY=VALUE", type=_key_json,
                    help="override an ab policy field for this study, e.g. blocks_per_launch=3 or pin_cpus=true (JSON values)")
    ap.add_argument("--replay-trials", type=int, default=4000, help="resampled trials per condition (0 = none)")
    ap.add_argument("--reuse-servers", action="store_true",
                    help="launch the base and each condition's candidate once and keep them for every trial (when "
                         "launches cost more than the trials: GPU leases); trials then share launches, so the "
                         "launch effect is not sampled, and the output says so")
    ap.add_argument("--engine-set", action="append", default=[], metavar="KEY=VALUE", type=_key_json,
                    help="override an engine setting for this study (JSON value), e.g. context_length=256 so that "
                         "five 8B servers fit on one GPU")
    ap.add_argument("--log-dir", default="perf-report/power-logs")
    ap.add_argument("--replay-only", action="store_true",
                    help="run no trial: replay the studies stored in --out under their recorded policy changed by "
                         f"--set ({', '.join(REPLAYABLE)}), e.g. --set 'thresholds={{\"steady_output_throughput\": "
                         "0.075}}', and print the error rates and verdict time it would give (--label picks one)")
    ns = ap.parse_args(argv)
    if ns.replay_only:
        out_path = Path(ns.out)
        if not out_path.is_file():
            raise SystemExit(f"--replay-only: no study at {out_path}; run python -m kimi_perf.power first or give --out")
        print(what_if(json.loads(out_path.read_text()), dict(ns.set), labels=[ns.label] if ns.label else [],
                      n_trials=ns.replay_trials or 4000))
        return 0

    from .engines.registry import build_engine_config
    from .load.prompts import PromptFactory
    from .machine import commit_info, gpu_info, hardware_key, machine_info
    from .profiles import find_profile, load_profile

    root = Path(__file__).resolve().parents[1]
    profile = load_profile(find_profile(ns.profile, [root / "profiles", Path.cwd() / "profiles"]))
    spec = replace(profile.ab, **dict(ns.set))
    name, model_dir, load_format = _target(profile)
    raw = profile.engines[ns.engine]
    if raw["kind"] != "reference":
        raise SystemExit(f"--engine {ns.engine}: the planted slowdown is the reference engine's; pick a reference engine")
    over = {"load_format": load_format, **dict(ns.engine_set)}
    cfg = build_engine_config(ns.engine, raw, model_path=str(model_dir), served_model_name=name, overrides=over)
    tp = profile.throughput
    assert tp is not None, f"profile {profile.name} has no throughput section"
    top_c = spec.top_concurrency or max(tp.concurrency)
    probes = [Probe("single_stream", replace(tp.single_stream, **dict(spec.single_stream)),
                    tuple(spec.gated.get("single_stream", ()))),
              Probe(f"c{top_c}", replace(tp.sweep_workload(top_c), **dict(spec.top)), tuple(spec.gated.get("top", ())))]
    probes = [p for p in probes if p.gated]
    prompts = PromptFactory(model_dir)
    gpus = gpu_info()
    label = ns.label or profile.hardware_key(hardware_key(gpus, use_gpu=profile.hardware == "cuda"), gpus)
    out_path = Path(ns.out)
    doc: dict[str, Any] = (json.loads(out_path.read_text()) if out_path.is_file()
                           else {"kimi_perf_gate_power": 1, "machines": {}})
    spec_json = {k: (dict(v) if hasattr(v, "items") else v) for k, v in asdict(spec).items()}
    probes_json = [{"name": p.name, "workload": p.workload.to_dict(), "gated": list(p.gated)} for p in probes]
    entry = study_entry(doc, label, {"profile": profile.name, "engine": ns.engine, "hardware_class": profile.hardware,
                                     "spec": spec_json, "probes": probes_json})
    entry["servers"] = ("launched once per side and condition, reused by every trial (launch effect not sampled)"
                        if ns.reuse_servers else f"launched by every trial: {_launches(spec_json)}")
    entry["engine_settings"] = {k: v for k, v in over.items() if k != "load_format"}
    for t in entry["trials"]:  # trials of an earlier continuation ran at the commit the entry named then
        t.setdefault("commit", entry.get("commit"))
    entry.update(machine=machine_info(), commit=commit_info(root).get("id"))
    doc["machines"][label] = entry
    plants = [float(x) for x in ns.plants.split(",")]
    log_dir = Path(ns.log_dir)
    t_start = time.monotonic()

    def save() -> None:
        entry["summary"] = summarize(entry, spec, probes, replay_trials=ns.replay_trials)
        out_path.parent.mkdir(parents=True, exist_ok=True)
        # other machines' entries may have been merged into the file meanwhile: keep them
        current = json.loads(out_path.read_text()) if out_path.is_file() else doc
        current.setdefault("machines", {})[label] = entry
        if label in doc.get("superseded", {}):
            current.setdefault("superseded", {})[label] = doc["superseded"][label]
        from .baselines import atomic_write_json

        atomic_write_json(out_path, current)
        md = out_path.with_suffix(".md")
        md.write_text(with_preface(md.read_text() if md.is_file() else None, markdown(current)))

    kept: dict[str, KeptSide] = {}

    def side(role: str, plant: float) -> ProcessSide | KeptSide:
        env = tuple(sorted({**dict(cfg.env), PLANT_ENV: f"{plant:g}"}.items()))
        tag = "base" if role == "base" else f"cand{plant:g}"
        new = ProcessSide(role, f"reference (plant {plant:g})", replace(cfg, name=f"{ns.engine}-{tag}", env=env), log_dir)
        if not ns.reuse_servers:
            return new
        if tag not in kept:
            kept[tag] = KeptSide(new)
        return kept[tag]

    def sides(plant: float) -> tuple[ProcessSide | KeptSide, ProcessSide | KeptSide]:
        return side("base", 0.0), side("candidate", plant)

    try:
        _rounds(ns, plants, entry, sides, probes, spec, prompts, t_start, save)
    finally:
        for k in kept.values():
            k.side.stop()
    save()
    return 0


class KeptSide:
    """--reuse-servers: the first ``start`` launches, later ones return the running server; ``stop`` is
    deferred to the end of the study."""

    def __init__(self, side: ProcessSide) -> None:
        self.side, self.role, self.label = side, side.role, side.label

    def start(self, cpus: tuple[int, ...] = ()) -> RunningServer:
        s = self.side.server
        if s is not None and s.process.alive():
            return s
        return self.side.start(cpus)

    def stop(self) -> None:
        pass


def _rounds(ns: Any, plants: list[float], entry: dict[str, Any], sides: Any, probes: list[Probe], spec: ABSpec,
            prompts: Any, t_start: float, save: Any) -> None:
    failures, ran = 0, 0
    for r in range(ns.trials):
        order = plants[r % len(plants):] + plants[: r % len(plants)]
        for plant in order:
            done = sum(1 for t in entry["trials"] if t["plant"] == plant)
            if done > r:
                continue  # resumed: this condition already has its trial of this round
            if ns.max_wall_s is not None and time.monotonic() - t_start > ns.max_wall_s:
                log(f"power: --max-wall-s {ns.max_wall_s:.0f} reached; stopping")
                return
            if ns.stop_file is not None and ns.stop_file.exists():
                log(f"power: {ns.stop_file} exists; stopping before the next trial")
                return
            base, cand = sides(plant)
            log(f"power: round {r + 1}/{ns.trials}, planted slowdown {plant:.0%} ({time.monotonic() - t_start:.0f}s)")
            try:
                out = run_ab(base, cand, probes, spec, prompts)
                failures = 0
            except ABSideError as e:
                out = e.outcome
                failures += 1
                log(f"power: trial failed: {e}")
                if failures >= 2:
                    raise SystemExit(f"power: two trials in a row failed; stopping (last: {e})") from None
            entry["trials"].append({**trial_record(out, plant, r), "commit": entry.get("commit")})
            t, ran = entry["trials"][-1], ran + 1
            # saved before it is announced: a driver that stops the study on this line (a lease ending)
            # must not kill it while the summary's replay is still being written (one trial was lost so)
            save()
            log(f"power: planted {plant:.0%} -> {t['verdict']} in {t['blocks']} blocks, {t['wall_s']:.0f}s (saved)")
    # said either way: a resumed study whose machine entry is already complete otherwise ends in
    # silence after its launch-free start (an H100 lease once did, and looked like a failure)
    log(f"power: every condition has its {ns.trials} trials ({ran} run now); "
        + ("done" if ran else "nothing to run here: raise --trials to add more, or give this GPU other work"))


if __name__ == "__main__":
    raise SystemExit(main())
