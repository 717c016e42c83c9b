"""The power study's bookkeeping: exact intervals, the replay of recorded blocks by the gate's own rule,
and the summary and table written to ``benchmarks/gate-power.*`` (the trials themselves need servers
and run in ``python -m kimi_perf.power``)."""

from __future__ import annotations

import math
from dataclasses import replace

import numpy as np
import pytest

from kimi_perf.ab.config import ABSpec
from kimi_perf.ab.replay import Round, Timing, fit_timing, recorded_rounds, redesign_problem
from kimi_perf.ab.runner import Probe
from kimi_perf.power import clopper_pearson, markdown, replay, summarize

SPEC = ABSpec(threshold=0.05, alpha=0.1, repeats_per_block=5, min_blocks=3, max_blocks=6)
PROBES = [Probe("single_stream", None, ("decode_tok_s",)),  # type: ignore[arg-type]
          Probe("c8", None, ("output_throughput",))]  # type: ignore[arg-type]
GATED = [("single_stream", "decode_tok_s"), ("c8", "output_throughput")]


def _blocks(shift: float, n: int, sd: float = 0.03, seed: int = 0) -> list[dict[str, list[float]]]:
    rng = np.random.default_rng(seed)
    return [{"single_stream:decode_tok_s": list(shift + sd * rng.standard_normal(5)),
             "c8:output_throughput": list(shift + sd * rng.standard_normal(5))} for _ in range(n)]


def _rounds(shift: float, n: int, sd: float = 0.03, seed: int = 0) -> list[Round]:
    """Rounds of one block each (fresh servers every block), launch order alternating."""
    return [Round(i % 2, (b,)) for i, b in enumerate(_blocks(shift, n, sd, seed))]


def test_clopper_pearson_is_the_exact_binomial_interval():
    assert clopper_pearson(0, 4) == (0.0, pytest.approx(0.6024, abs=1e-4))
    lo, hi = clopper_pearson(4, 4)
    assert lo == pytest.approx(0.3976, abs=1e-4) and hi == 1.0
    assert clopper_pearson(0, 0) == (0.0, 1.0)


def test_replay_applies_the_gates_rule_identical_code_passes_a_10pct_slowdown_fails():
    aa = replay(_rounds(0.0, 12), SPEC, GATED, n_trials=300)
    slow = replay(_rounds(math.log(0.9), 12, seed=1), SPEC, GATED, n_trials=300)
    assert aa["fail"] == 0 and aa["pass"] > 250
    assert slow["fail"] == 300 and slow["mean_blocks"] == pytest.approx(3.0)
    # a change the size of the threshold cannot be decided either way: the budget runs out
    edge = replay(_rounds(math.log(0.95), 12, seed=2), SPEC, GATED, n_trials=300)
    assert edge["inconclusive"] > 150 and edge["mean_blocks"] > 5


def _trial(plant: float, verdict: str, commit: str | None, shift: float) -> dict:
    per = _blocks(shift, 3, seed=int(plant * 100))
    return {"plant": plant, "round": 0, "verdict": verdict, "blocks": 3, "wall_s": 300.0, "error": None,
            "block_log_ratios": {k: [b[k] for b in per] for k in per[0]}, **({"commit": commit} if commit else {})}


def test_summary_counts_verdicts_per_condition_and_the_table_names_every_commit_the_trials_ran_at():
    entry = {"profile": "embedded-cpu", "engine": "reference", "hardware_class": "cpu", "commit": "b" * 40,
             "spec": {"threshold": 0.05, "alpha": 0.1, "min_blocks": 3, "max_blocks": 6, "repeats_per_block": 5,
                      "relaunch": True},
             "trials": [_trial(0.0, "PASS", "a" * 40, 0.0), _trial(0.0, "PASS", None, 0.0),
                        _trial(0.1, "FAIL", "a" * 40, math.log(0.9)), _trial(0.1, "FAIL", None, math.log(0.9))]}
    s = summarize(entry, SPEC, PROBES, replay_trials=50)
    c0, c1 = s["conditions"]["0"], s["conditions"]["0.1"]
    assert (c0["trials"], c0["fail"], c0["pass"]) == (2, 0, 2) and c0["fail_rate_ci95"][1] == pytest.approx(0.8419, abs=1e-3)
    assert c1["fail"] == 2 and c1["replay"]["fail"] == 50 and c1["replay"]["rounds_pool"] == 6
    entry["summary"] = s
    md = markdown({"machines": {"cpu-x86_64-2c": entry}})
    assert "commits aaaaaaaaaa (2 trials), bbbbbbbbbb (2 trials)" in md
    assert "| 0% | 2 | 0/2 [0.00, 0.84] | 0/2 | 300 | 0.000 (50 from 6 launch rounds) | 0.000 |" in md
    assert "| 10% | 2 | 2/2 [0.16, 1.00] | 0/2 | 300 | 1.000 (50 from 6 launch rounds) | 0.000 |" in md


def test_a_study_under_another_policy_starts_afresh_and_keeps_the_old_trials_as_superseded():
    from kimi_perf.power import study_entry

    cfg = {"profile": "p", "spec": {"blocks_per_launch": 2}, "probes": [{"name": "c128"}]}
    doc: dict = {"machines": {}}
    e = study_entry(doc, "gpu", cfg)
    e["trials"].append({"plant": 0.0, "verdict": "PASS"})
    doc["machines"]["gpu"] = e
    assert study_entry(doc, "gpu", cfg) is e  # same policy: continued
    # a policy field added after the study was stored, at its default, is the same policy
    later = {**cfg, "spec": {"blocks_per_launch": 2, "retire_decided": False, "repeats": {}}}
    assert study_entry(doc, "gpu", later) is e
    resized = {**cfg, "spec": {"blocks_per_launch": 2, "parallel_launch": True}}
    fresh = study_entry(doc, "gpu", resized)
    assert fresh["trials"] == [] and fresh["spec"] == resized["spec"]
    assert doc["superseded"]["gpu"] == [e] and e["trials"][0]["verdict"] == "PASS"


def test_a_tree_without_git_takes_its_commit_from_the_environment(tmp_path, monkeypatch):
    """A GPU lease runs a copy of the tree without .git; its results must still name the commit."""
    from kimi_perf.machine import commit_info

    monkeypatch.delenv("GITHUB_SHA", raising=False)
    monkeypatch.delenv("CI_COMMIT_SHA", raising=False)
    monkeypatch.setenv("GIT_CEILING_DIRECTORIES", str(tmp_path.parent))
    monkeypatch.delenv("KIMI_PERF_COMMIT", raising=False)
    assert commit_info(tmp_path) == {}
    monkeypatch.setenv("KIMI_PERF_COMMIT", "57226fd")
    info = commit_info(tmp_path)
    assert info["id"] == "57226fd" and "KIMI_PERF_COMMIT" in info["source"]


def test_the_table_lists_superseded_studies_with_their_policy_and_verdicts():
    from kimi_perf.power import markdown

    spec = {"threshold": 0.025, "min_blocks": 4, "max_blocks": 8, "blocks_per_launch": 2, "parallel_launch": True}
    doc = {"machines": {}, "superseded": {"gpu": [{"spec": spec, "servers": "launched by every trial", "trials": [
        {"plant": 0.0, "verdict": "PASS"}, {"plant": 0.0, "verdict": "INCONCLUSIVE"}, {"plant": 0.05, "verdict": "FAIL"}]}]}}
    md = markdown(doc)
    assert "## Superseded studies" in md
    # the whole policy, in the header's words (ABSpec's defaults fill what an old entry did not store)
    assert ("| gpu | threshold 2.5%, alpha 0.05, blocks 4-8 x 3 pairs, launch rounds of 2 blocks in ABBA order, both "
            "sides launched together | launched by every trial | 0%: 1/0/1; 5%: 0/1/0 |") in md


def test_a_noisy_metric_decided_at_its_own_threshold_lets_identical_code_pass():
    rng = np.random.default_rng(3)
    # a top probe whose pairs vary 7% (steady C=128 on one GPU) next to a quiet single-stream probe
    rounds = [Round(i % 2, ({"single_stream:decode_tok_s": list(0.01 * rng.standard_normal(3)),
                             "c8:output_throughput": list(0.07 * rng.standard_normal(3))},)) for i in range(16)]
    spec = ABSpec(threshold=0.025, alpha=0.1, repeats_per_block=3, min_blocks=4, max_blocks=8)
    shared = replay(rounds, spec, GATED, n_trials=400)
    timing = Timing({"single_stream": 2.0, "c8": 12.0}, round_s=8.0)
    own = replay(rounds, replace(spec, thresholds={"output_throughput": 0.075}), GATED, n_trials=400,
                 timing=timing, target_s=300)
    assert shared["inconclusive"] > 150 and own["pass"] > 380 and own["fail"] == 0
    # 4 blocks, each a launch round (8 s) and 3 pairs of each probe (3 x 14 s)
    assert own["median_blocks"] == 4 and own["est_median_wall_s"] == 4 * (8 + 42) and own["within_target"] > 0.9


def test_retiring_a_decided_probe_keeps_the_verdicts_and_saves_its_time():
    """ab.retire_decided: once the expensive probe PASSED, later blocks measure only the one still
    undecided, so a replay prices those blocks at that probe's pairs alone."""
    rng = np.random.default_rng(5)
    rounds = [Round(i % 2, ({"single_stream:decode_tok_s": list(0.03 * rng.standard_normal(3)),
                             "c8:output_throughput": list(0.002 * rng.standard_normal(3))},)) for i in range(24)]
    spec = ABSpec(threshold=0.025, alpha=0.1, repeats_per_block=3, min_blocks=4, max_blocks=12)
    timing = Timing({"single_stream": 2.0, "c8": 12.0}, round_s=0.0)
    kept = replay(rounds, spec, GATED, n_trials=300, timing=timing)
    retired = replay(rounds, replace(spec, retire_decided=True), GATED, n_trials=300, timing=timing)
    assert retired["pass"] == kept["pass"] and retired["mean_blocks"] == kept["mean_blocks"]
    assert kept["mean_blocks"] > 4  # single-stream needs more blocks than the quiet top probe
    # the top probe PASSes at block 4 in every trial; each later block saves its 3 pairs of 12 s
    saved = 3 * 12.0 * (kept["mean_blocks"] - 4)
    assert retired["est_mean_wall_s"] == pytest.approx(kept["est_mean_wall_s"] - saved)


def test_rounds_are_rebuilt_from_recorded_pairs_and_recut_only_within_the_pairs_a_block_holds():
    """Launch rounds of 2 blocks x 3 pairs can be recut into 2 blocks of 1 pair, or 4 blocks of 1
    pair (two from each recorded block), but not into blocks of 3 pairs 2 at a time: that would
    reuse recorded pairs and understate the noise."""
    pairs = [{"block": b, "launch": b // 2, "probe": "c8", "base_output_throughput": 100.0,
              "candidate_output_throughput": 100.0 * (1 + 0.01 * (b * 3 + i)), "base_duration_s": 1.0,
              "candidate_duration_s": 1.5} for b in range(4) for i in range(3)]
    trial = {"plant": 0.0, "blocks": 4, "wall_s": 30.0, "pairs": pairs}
    rounds = recorded_rounds([trial], ["c8:output_throughput"], 2)
    assert [r.order for r in rounds] == [0, 1] and [len(r.blocks) for r in rounds] == [2, 2]
    assert rounds[1].blocks[0]["c8:output_throughput"] == pytest.approx([math.log(1.06), math.log(1.07), math.log(1.08)])
    spec = ABSpec(repeats_per_block=3, min_blocks=2, max_blocks=8, blocks_per_launch=2)
    assert redesign_problem(rounds, spec, ["c8"]) is None
    assert redesign_problem(rounds, replace(spec, repeats_per_block=1, blocks_per_launch=4), ["c8"]) is None
    why = redesign_problem(rounds, replace(spec, blocks_per_launch=4), ["c8"])
    assert why and "need 6 distinct pairs" in why and "holds 3" in why
    # a trial that retired c8 after its first round: its second round still serves single_stream
    ss = [{"block": b, "launch": b // 2, "probe": "single_stream", "base_decode_tok_s": 100.0,
           "candidate_decode_tok_s": 101.0} for b in range(4) for _ in range(3)]
    retired = recorded_rounds([{**trial, "pairs": pairs[:6] + ss}], ["single_stream:decode_tok_s",
                                                                      "c8:output_throughput"], 2)
    assert [sorted(r.probes) for r in retired] == [["c8", "single_stream"], ["single_stream"]]
    assert set(retired[1].blocks[0]) == {"single_stream:decode_tok_s"}
    assert redesign_problem(retired[1:], spec, ["c8"]) == "c8: no complete launch round recorded it"
    # 12 pairs of 2.5 s: the rest of the 30 s went to 2 launch rounds
    t = fit_timing([trial], [{"name": "c8", "workload": {}}], spec)
    assert t is not None and t.pair_s == {"c8": 2.5} and t.round_s == pytest.approx(0.0)
    assert Timing.rounds(5, spec) == 3 and Timing.starts_round(4, spec) and not Timing.starts_round(3, spec)
    # pairs recorded before durations were: the probe's tokens over each side's throughput
    old = [{k: v for k, v in p.items() if "duration" not in k} for p in pairs]
    t_old = fit_timing([{**trial, "pairs": old}], [{"name": "c8", "workload": {"num_prompts": 2, "output_len": 50}}],
                       spec)
    assert t_old is not None and t_old.pair_s["c8"] == pytest.approx(1.0 + 1 / 1.055, rel=0.01)


def test_what_if_replays_stored_studies_under_changed_decision_knobs_only():
    from kimi_perf.power import what_if

    per = _blocks(0.0, 6, sd=0.01)
    trial = {"plant": 0.0, "verdict": "PASS", "blocks": 6, "wall_s": 300.0, "error": None,
             "block_log_ratios": {k: [b[k] for b in per] for k in per[0]}}
    doc = {"machines": {"gpu-x": {"spec": {"threshold": 0.05, "alpha": 0.1, "repeats_per_block": 5, "min_blocks": 3,
                                           "max_blocks": 6, "blocks_per_launch": 1, "old_field": 1},
                                  "probes": [{"name": "single_stream", "gated": ["decode_tok_s"]},
                                             {"name": "c8", "gated": ["output_throughput"]}],
                                  "trials": [trial]}}}
    md = what_if(doc, {"thresholds": {"output_throughput": 0.1}}, n_trials=50)
    assert 'thresholds={"output_throughput": 0.1}' in md
    assert "| gpu-x | 0% | 6 | 1.000 | 0.000 | 0.000 | 3 | 3.0 | - | - |" in md  # no pairs recorded: no timing
    only_single = what_if(doc, {"gated": {"single_stream": ["decode_tok_s"]}}, n_trials=20)
    assert "| gpu-x | 0% | 6 | 1.000 |" in only_single
    with pytest.raises(SystemExit, match="pin_cpus.*changed what was measured"):
        what_if(doc, {"pin_cpus": True})
    more = what_if(doc, {"repeats_per_block": 9})
    assert "| gpu-x | 0% | 6 | not replayable: single_stream: 9 pairs a block x 1 blocks a launch round need 9" in more
    fewer = what_if(doc, {"repeats_per_block": 3}, n_trials=20)
    assert "| gpu-x | 0% | 6 | 1.000 |" in fewer
    with pytest.raises(SystemExit, match="recorded no pairs of"):
        what_if(doc, {"gated": {"top": ["tpot_ms_p50"]}})
    # a metric recorded per pair but not gated when the trials ran is rebuilt from the pairs
    trial["pairs"] = [{"block": b, "probe": "c8", "base_tpot_ms_p50": 10.0, "candidate_tpot_ms_p50": 10.0 * f}
                      for b in range(6) for f in (1.0, 1.01, 0.99, 1.0, 1.005)]
    tpot = what_if(doc, {"gated": {"top": ["tpot_ms_p50"]}}, n_trials=20)
    assert "| gpu-x | 0% | 6 | 1.000 | 0.000 | 0.000 | 3 | 3.0 | - | - |" in tpot


def test_a_stop_file_ends_the_study_between_trials_and_each_trial_is_saved_before_it_is_announced(
        tmp_path, monkeypatch):
    """A lease ends on a clock: its driver stops the study by a file, not a kill, so the running trial
    is finished and written. The study announces a trial only after saving it: a driver that killed the
    study on that line once lost a trial whose summary was still being written."""
    import argparse

    import kimi_perf.power as power

    events: list[str] = []
    stop = tmp_path / "stop"

    def fake_run_ab(base, cand, probes, spec, prompts):
        events.append("trial")
        stop.touch()  # asked to stop while the first trial runs
        return object()

    monkeypatch.setattr(power, "run_ab", fake_run_ab)
    monkeypatch.setattr(power, "trial_record", lambda out, plant, r: {"plant": plant, "verdict": "PASS",
                                                                      "blocks": 4, "wall_s": 1.0})
    monkeypatch.setattr(power, "log", lambda msg: events.append("announce" if "->" in msg else msg)
                        if "round" not in msg else None)
    entry: dict = {"trials": []}
    ns = argparse.Namespace(trials=3, max_wall_s=None, stop_file=stop)
    power._rounds(ns, [0.0, 0.05], entry, lambda plant: (None, None), [], SPEC, None, 0.0,
                  lambda: events.append("save"))
    assert [t["plant"] for t in entry["trials"]] == [0.0]
    assert events[:3] == ["trial", "save", "announce"]
    assert "exists; stopping" in events[-1]


def test_a_resumed_study_with_every_trial_done_says_so_and_launches_nothing(monkeypatch):
    """A lease that lands on a GPU kind whose entry is complete must say why it ends at once."""
    import argparse

    import kimi_perf.power as power

    said: list[str] = []
    monkeypatch.setattr(power, "run_ab", lambda *a: pytest.fail("a complete study ran a trial"))
    monkeypatch.setattr(power, "log", said.append)
    entry = {"trials": [{"plant": p, "verdict": "PASS"} for p in (0.0, 0.05) for _ in range(2)]}
    ns = argparse.Namespace(trials=2, max_wall_s=None, stop_file=None)
    power._rounds(ns, [0.0, 0.05], entry, lambda plant: pytest.fail("sides were made"), [], SPEC, None, 0.0,
                  lambda: pytest.fail("saved"))
    assert said == ["power: every condition has its 2 trials (0 run now); nothing to run here: raise --trials "
                    "to add more, or give this GPU other work"]


def test_a_hand_written_preface_survives_the_study_rewriting_its_markdown():
    """benchmarks/pair-segments-study.md opens with the question, the commands and a table drawn from
    two entries; resuming the study rewrote the file from its title down and erased them once."""
    from kimi_perf.power import with_preface

    doc = {"machines": {}}
    generated = markdown(doc)
    assert with_preface(None, generated) == generated
    assert with_preface(generated, generated) == generated  # a plain generated file stays plain
    prose = "# Pair segments\n\nWhat was asked, and how.\n\n"
    kept = with_preface(prose + generated[generated.index("Written by"):], generated)
    assert kept.startswith(prose) and kept.count("Written by `python -m kimi_perf.power`") == 1
    assert "# A/B gate power (measured)" not in kept
