"""Variance components and A/A bias of recorded A/B trials (kimi_perf.ab.variance), checked on
synthetic trials whose components are known, and as the power study reports them."""

from __future__ import annotations

import json
import math

import numpy as np
import pytest

from kimi_perf.ab.variance import (
    aa_bias,
    noise_note,
    noise_rows,
    pair_log_ratios,
    second_launch_effect,
    variance_components,
)
from kimi_perf.ab.variance import main as variance_main


def _trials(n_trials=40, rounds=2, blocks=3, pairs=3, sd_pair=0.02, sd_block=0.01, sd_launch=0.03, sd_trial=0.0,
            second=0.0, shift=0.0, seed=0):
    """Trials in the power study's record format; ``second`` is added (log units) to the candidate
    when it was launched second, subtracted when the base was."""
    rng = np.random.default_rng(seed)
    out = []
    for _ in range(n_trials):
        t_eff = sd_trial * rng.standard_normal()
        prs = []
        for r in range(rounds):
            l_eff = sd_launch * rng.standard_normal() + (second if r % 2 == 0 else -second)
            for b in range(blocks):
                b_eff = sd_block * rng.standard_normal()
                for _ in range(pairs):
                    y = shift + t_eff + l_eff + b_eff + sd_pair * rng.standard_normal()
                    prs.append({"block": r * blocks + b, "launch": r, "probe": "c128",
                                "base_steady_output_throughput": 1000.0,
                                "candidate_steady_output_throughput": 1000.0 * math.exp(y)})
        out.append({"pairs": prs})
    return out


def test_components_recover_the_levels_that_made_the_data():
    rows = pair_log_ratios(_trials(sd_trial=0.015), "c128", "steady_output_throughput")
    vc = variance_components(rows)["levels"]
    assert vc["pair"]["sd"] == pytest.approx(0.02, rel=0.1)
    assert vc["block"]["sd"] == pytest.approx(0.01, abs=0.005)
    assert vc["launch"]["sd"] == pytest.approx(0.03, rel=0.25)
    assert vc["trial"]["sd"] == pytest.approx(0.015, abs=0.01)


def test_one_block_per_launch_confounds_the_block_and_launch_levels():
    rows = pair_log_ratios(_trials(rounds=4, blocks=1), "c128", "steady_output_throughput")
    vc = variance_components(rows)["levels"]
    assert vc["block"]["confounded"] and not vc["launch"].get("confounded")
    assert variance_components(rows[:1]) == {"pairs": 1, "levels": {}, "why": "fewer than two pairs"}


def test_one_pair_per_block_folds_the_pair_noise_into_the_block_level():
    """A probe run once a block (``ab.repeats: {"top": 1}``) has no within-block spread to measure:
    the pair level says where its noise went instead of reporting NaN, and the block level holds both."""
    rows = pair_log_ratios(_trials(pairs=1, sd_pair=0.02, sd_block=0.01, sd_launch=0.0), "c128",
                           "steady_output_throughput")
    vc = variance_components(rows)["levels"]
    assert vc["pair"]["confounded"] and vc["pair"]["within"] == "block"
    assert vc["block"]["sd"] == pytest.approx(math.hypot(0.02, 0.01), rel=0.15)
    assert math.isfinite(variance_components(rows)["total_var"])


def test_aa_bias_interval_is_over_trials_and_checks_the_half_percent_band():
    fine = aa_bias(pair_log_ratios(_trials(sd_launch=0.002, sd_block=0.002, sd_pair=0.005), "c128",
                                   "steady_output_throughput"))
    assert fine["contains_1"] and fine["within_tolerance"] and fine["n"] == 40
    biased = aa_bias(pair_log_ratios(_trials(shift=math.log(1.012), sd_launch=0.002), "c128",
                                     "steady_output_throughput"))
    assert not biased["contains_1"] and biased["ratio"] == pytest.approx(1.012, abs=0.004)


def test_second_launch_effect_is_seen_only_where_both_orders_were_launched():
    rows = pair_log_ratios(_trials(second=math.log(1.01), sd_launch=0.004), "c128", "steady_output_throughput")
    eff = second_launch_effect(rows)
    assert eff["ratio"] == pytest.approx(1.01, abs=0.003) and eff["lo"] > 1.0
    # balanced rounds: the effect cancels in the pooled A/A ratio
    assert aa_bias(rows)["contains_1"]
    one = pair_log_ratios(_trials(rounds=1), "c128", "steady_output_throughput")
    assert second_launch_effect(one)["n"] == 0


def test_the_power_summary_and_table_carry_bias_and_components():
    from kimi_perf.ab.config import ABSpec
    from kimi_perf.ab.runner import Probe
    from kimi_perf.power import markdown, summarize

    spec = ABSpec(threshold=0.025, alpha=0.1, repeats_per_block=3, min_blocks=6, max_blocks=6, blocks_per_launch=3)
    probes = [Probe("c128", None, ("steady_output_throughput",))]  # type: ignore[arg-type]
    trials = [{**t, "plant": 0.0, "round": i, "verdict": "PASS", "blocks": 6, "wall_s": 200.0, "error": None,
               "block_log_ratios": {}} for i, t in enumerate(_trials(n_trials=6))]
    entry = {"profile": "h200-llama8b-dummy", "engine": "reference", "hardware_class": "cuda", "commit": "a" * 40,
             "spec": {"threshold": 0.025, "alpha": 0.1, "min_blocks": 6, "max_blocks": 6, "repeats_per_block": 3,
                      "blocks_per_launch": 3}, "trials": trials}
    s = summarize(entry, spec, probes, replay_trials=0)
    n = s["conditions"]["0"]["noise"]["c128:steady_output_throughput"]
    assert n["components"]["pairs"] == 6 * 2 * 3 * 3 and "ratio" in n["aa_bias"] and "ratio" in n["second_launch"]
    entry["summary"] = s
    md = markdown({"machines": {"gpu-h200-x1": entry}})
    assert "launch rounds of 3 blocks in ABBA order" in md
    assert "| 0% | c128:steady_output_throughput | 108 |" in md


def _flat(ys_by_launch, peer=0.0):
    """Flat pairs of one run: launch round -> block -> pair ratios (candidate / base)."""
    out, block = [], 0
    for launch, blocks in enumerate(ys_by_launch):
        for pairs in blocks:
            for i, r in enumerate(pairs):
                out.append({"probe": "single_stream", "block": block, "index": i, "launch": launch,
                            "base_decode_tok_s": 100.0, "candidate_decode_tok_s": 100.0 * r,
                            "base_peer_cpu_util": peer, "candidate_peer_cpu_util": peer})
            block += 1
    return out


def test_noise_note_says_where_an_undecided_runs_noise_sat_and_what_cuts_it():
    """An INCONCLUSIVE verdict names the level that dominates and its remedy: a launch effect asks for
    launch rounds (repeats cannot help), noisy pairs ask for longer repeats; a waiting side that spins
    is named with the flag that stops it."""
    launches = _flat([[[1.0, 1.0, 1.0], [1.0, 1.0, 1.0]], [[1.2, 1.2, 1.2], [1.2, 1.2, 1.2]]])
    note = noise_note(launches, "single_stream", "decode_tok_s")
    assert "most between launches: more launch rounds" in note and "more repeats do not help" in note
    assert "waiting side" not in note
    pairs = _flat([[[0.8, 1.2, 1.0], [1.2, 0.8, 1.0]], [[1.0, 0.8, 1.2], [0.8, 1.0, 1.2]]], peer=1.0)
    note = noise_note(pairs, "single_stream", "decode_tok_s")
    assert "most within pair: longer repeats" in note
    assert "the waiting side used 1.00 cores (median)" in note and "--sleep-on-idle" in note and "ab.pin_cpus" in note
    # one pair has no spread to split, but a spinning neighbour is still worth saying
    assert noise_note(pairs[:1], "single_stream", "decode_tok_s").startswith("the waiting side used 1.00 cores")
    assert noise_note(launches[:1], "single_stream", "decode_tok_s") == ""
    assert noise_note(pairs, "c128", "steady_output_throughput") == ""  # no pairs of that probe


def test_noise_rows_name_where_one_runs_noise_came_from(tmp_path, capsys):
    """A noisy job is read level by level from its own run file: here every pair of a launch agrees and
    the second launch round reads 10% apart, so the noise is all between launches (no repeats would
    help), the launch order shows, and the waiting side's CPU use and the engines' CPU per token come
    out as recorded."""
    pairs = []
    for launch in (0, 1):
        for block in (2 * launch, 2 * launch + 1):
            for i in range(3):
                c = 1000.0 * (math.exp(0.1) if launch else 1.0)
                pairs.append({"probe": "single_stream", "block": block, "index": i, "launch": launch,
                              "base": {"decode_tok_s": 1000.0, "peer_cpu_util": 0.0, "engine_cpu_ms_per_tok": 2.0},
                              "candidate": {"decode_tok_s": c, "peer_cpu_util": 1.0 if launch else 0.0,
                                            "engine_cpu_ms_per_tok": 3.0}})
    ab = {"base": "same (A/A: the candidate's own configuration)", "pairs": pairs, "decisions": [
        {"probe": "single_stream", "metric": "decode_tok_s", "verdict": "INCONCLUSIVE"}]}
    rec = {"nodeid": "t::ab", "key": {"scenario": "ab_throughput", "engine": "sglang"}, "ab": ab}
    (tmp_path / "run.json").write_text(json.dumps({"profile": "p", "results": [rec]}))
    [row] = noise_rows([rec])
    assert row["base"] == "same" and row["pairs"] == 12
    assert row["sd_pair_pct"] == pytest.approx(0.0) and row["sd_block_pct"] == pytest.approx(0.0)
    assert row["sd_launch_pct"] == pytest.approx(100 * 0.1 / math.sqrt(2))
    # launch round 0 launched the candidate second: it read 10% less than in round 1
    assert row["second_launch"] == pytest.approx(math.exp(-0.05))
    assert row["pair_ratio_min"] == pytest.approx(1.0) and row["pair_ratio_max"] == pytest.approx(math.exp(0.1))
    assert row["peer_cpu_util_median"] == pytest.approx(0.0) and row["peer_cpu_util_max"] == 1.0
    assert row["base_engine_cpu_ms_per_tok_median"] == 2.0
    assert variance_main([str(tmp_path)]) == 0
    out = capsys.readouterr().out.splitlines()
    assert out[2].startswith("| sglang | same | single_stream | decode_tok_s | 12 | 0.00 | 0.00 | 7.07 | 1.000-1.105 |")


def test_a_gpu_clock_the_metric_follows_is_named_and_a_steady_one_is_not():
    """Slow repeats that ran at a low SM clock (either side, any block) point at the GPU, not the
    engine: the note names the range, the correlation and the runner-side fix. A clock that held still,
    or moved without the metric following, is not blamed; runs without clocks read as before."""
    from kimi_perf.ab.variance import clock_link

    ratios = [[[1.0, 0.8, 1.25], [0.8, 1.25, 1.0]], [[1.25, 1.0, 0.8], [1.0, 0.8, 1.25]]]
    pairs = _flat(ratios)
    for p in pairs:  # the clock follows the speed: 1980 MHz at the fastest repeat, lower when slower
        for side in ("base", "candidate"):
            p[f"{side}_gpu_sm_clock_mhz"] = 1980.0 * p[f"{side}_decode_tok_s"] / 125.0
    ck = clock_link(pairs, "single_stream", "decode_tok_s")
    assert ck["clock_min_mhz"] == pytest.approx(1267.2) and ck["clock_max_mhz"] == pytest.approx(1980.0)
    assert ck["rho"] == pytest.approx(1.0)
    note = noise_note(pairs, "single_stream", "decode_tok_s")
    assert "the GPU's SM clock moved 1267-1980 MHz across repeats and decode_tok_s followed it" in note
    assert "nvidia-smi --lock-gpu-clocks" in note
    for p in pairs:  # held still within 1%: not the clock
        for side in ("base", "candidate"):
            p[f"{side}_gpu_sm_clock_mhz"] = 1980.0 - (p["index"] % 2) * 15.0
    assert "SM clock" not in noise_note(pairs, "single_stream", "decode_tok_s")
    for i, p in enumerate(pairs):  # moved 1200-1980 but unrelated to the metric's ranks
        for side in ("base", "candidate"):
            p[f"{side}_gpu_sm_clock_mhz"] = 1200.0 if (i // 2) % 2 else 1980.0
    assert abs(clock_link(pairs, "single_stream", "decode_tok_s")["rho"]) < 0.5
    assert "SM clock" not in noise_note(pairs, "single_stream", "decode_tok_s")
    assert clock_link(_flat(ratios), "single_stream", "decode_tok_s") == {}
    [row] = noise_rows([{"key": {"engine": "vllm"}, "ab": {"base": "same", "pairs": [], "decisions": [
        {"probe": "single_stream", "metric": "decode_tok_s"}]}}])
    assert math.isnan(row["clock_min_mhz"]) and math.isnan(row["rho"])
