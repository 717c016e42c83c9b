"""The power study's bookkeeping: exact intervals, the replay of recorded blocks by the gate's own rule,
and the summary and table written to ``benchmarks/gate-power.*`` (the trials themselves need servers
and run in ``python -m kimi_perf.power``)."""

from __future__ import annotations

import math
from dataclasses import replace

import numpy as np
import pytest

from kimi_perf.ab.config import ABSpec
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


def test_clopper_pearson_is_the_exact_binomial_interval():
    assert clopper_pearson(0, 4) == (0.0, pytest.approx(0.6024, abs=1e-4))
    lo, hi = clopper_pearson(4, 4)
    assert lo == pytest.approx(0.3976, abs=1e-4) and hi == 1.0
    assert clopper_pearson(0, 0) == (0.0, 1.0)


def test_replay_applies_the_gates_rule_identical_code_passes_a_10pct_slowdown_fails():
    aa = replay(_blocks(0.0, 12), SPEC, GATED, n_trials=300)
    slow = replay(_blocks(math.log(0.9), 12, seed=1), SPEC, GATED, n_trials=300)
    assert aa["fail"] == 0 and aa["pass"] > 250
    assert slow["fail"] == 300 and slow["mean_blocks"] == pytest.approx(3.0)
    # a change the size of the threshold cannot be decided either way: the budget runs out
    edge = replay(_blocks(math.log(0.95), 12, seed=2), SPEC, GATED, n_trials=300)
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
    assert c1["fail"] == 2 and c1["replay"]["fail"] == 50 and c1["replay"]["blocks_pool"] == 6
    entry["summary"] = s
    md = markdown({"machines": {"cpu-x86_64-2c": entry}})
    assert "commits aaaaaaaaaa (2 trials), bbbbbbbbbb (2 trials)" in md
    assert "| 0% | 2 | 0/2 [0.00, 0.84] | 0/2 | 300 | 0.000 (50 from 6 blocks) | 0.000 |" in md
    assert "| 10% | 2 | 2/2 [0.16, 1.00] | 0/2 | 300 | 1.000 (50 from 6 blocks) | 0.000 |" in md


def test_a_study_under_another_policy_starts_afresh_and_keeps_the_old_trials_as_superseded():
    from kimi_perf.power import study_entry

    cfg = {"profile": "p", "spec": {"blocks_per_launch": 2}, "probes": [{"name": "c128"}]}
    doc: dict = {"machines": {}}
    e = study_entry(doc, "gpu", cfg)
    e["trials"].append({"plant": 0.0, "verdict": "PASS"})
    doc["machines"]["gpu"] = e
    assert study_entry(doc, "gpu", cfg) is e  # same policy: continued
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
    assert ("| gpu | threshold 2.5%, blocks 4-8, launch rounds of 2 blocks in ABBA order, both sides launched together "
            "| launched by every trial | 0%: 1/0/1; 5%: 0/1/0 |") in md


def test_a_noisy_metric_decided_at_its_own_threshold_lets_identical_code_pass():
    rng = np.random.default_rng(3)
    # a top probe whose pairs vary 7% (steady C=128 on one GPU) next to a quiet single-stream probe
    blocks = [{"single_stream:decode_tok_s": list(0.01 * rng.standard_normal(3)),
               "c8:output_throughput": list(0.07 * rng.standard_normal(3))} for _ in range(16)]
    spec = ABSpec(threshold=0.025, alpha=0.1, repeats_per_block=3, min_blocks=4, max_blocks=8)
    shared = replay(blocks, spec, GATED, n_trials=400)
    own = replay(blocks, replace(spec, thresholds={"output_throughput": 0.075}), GATED, n_trials=400,
                 s_per_block=50.0)
    assert shared["inconclusive"] > 150 and own["pass"] > 380 and own["fail"] == 0
    assert own["median_blocks"] == 4 and own["est_median_wall_s"] == 200.0


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
    assert "| gpu-x | 0% | 6 | 1.000 | 0.000 | 0.000 | 3 | 3.0 | 150 |" in md
    only_single = what_if(doc, {"gated": {"single_stream": ["decode_tok_s"]}}, n_trials=20)
    assert "| gpu-x | 0% | 6 | 1.000 |" in only_single
    with pytest.raises(SystemExit, match="repeats_per_block.*cannot"):
        what_if(doc, {"repeats_per_block": 9})
    with pytest.raises(SystemExit, match="recorded no pairs of"):
        what_if(doc, {"gated": {"top": ["tpot_ms_p50"]}})
    # a metric recorded per pair but not gated when the trials ran is rebuilt from the pairs
    trial["pairs"] = [{"block": b, "probe": "c8", "base_tpot_ms_p50": 10.0, "candidate_tpot_ms_p50": 10.0 * f}
                      for b in range(6) for f in (1.0, 1.01, 0.99)]
    tpot = what_if(doc, {"gated": {"top": ["tpot_ms_p50"]}}, n_trials=20)
    assert "| gpu-x | 0% | 6 | 1.000 | 0.000 | 0.000 | 3 | 3.0 | 150 |" in tpot
