"""The drafter recipe sweep's command line (kimi_perf.eagle3.sweep): which settings a variant may
change, how a row is named, and the table it prints. The training it drives is tested in
tests/test_resume.py (held-out scoring) and run for real by `python -m kimi_perf.eagle3.sweep`."""

from __future__ import annotations

import pytest

from kimi_perf.eagle3.sweep import _describe, markdown, parse_variant
from kimi_perf.eagle3.train import TrainConfig


def test_a_variant_changes_training_settings_only_and_reads_json_values():
    base = TrainConfig(lr=3e-3, epochs=6)
    v = parse_variant("lr=0.001, train.epochs=12,init_lm_head=target", base)
    assert (v.lr, v.epochs, v.init_lm_head) == (0.001, 12, "target")
    assert _describe(v, base) == "epochs=12, lr=0.001, init_lm_head=target"
    assert _describe(base, base) == "recipe as profiled"
    with pytest.raises(SystemExit, match="data and feature settings need their own run"):
        parse_variant("max_new_tokens=512", base)
    with pytest.raises(SystemExit, match="not KEY=VALUE"):
        parse_variant("lr", base)


def test_the_table_shows_the_last_epoch_and_the_best_one():
    curve = [{"epoch": 1, "step": 5, "acc": [0.3, 0.2, 0.1], "all_acc": [0.25, 0.15, 0.05], "positions": 99},
             {"epoch": 2, "step": 10, "acc": [0.28, 0.2, 0.1], "all_acc": [0.22, 0.15, float("nan")], "positions": 99}]
    doc = {"profile": "p", "machine": {"cpu": "CPU X", "gpus": []},
           "rows": [{"variant": "recipe as profiled", "steps": 10, "seconds": 12.3, "train_final_step_acc": [0.6, 0.4, 0.3],
                     "heldout_by_epoch": curve, "best_epoch": 1, "heldout_coverage": 0.768,
                     "train_samples": 160, "heldout_samples": 12}]}
    text = markdown(doc)
    assert "CPU X, no GPU; 160 training and 12 held-out samples" in text
    # a row cached before the chain walk: no prediction to show
    assert "| recipe as profiled | 10 | 12 | 0.600 / 0.400 / 0.300 | 0.220 / 0.150 / - | - | 1 (-) | 76.8% |" in text


def test_epochs_rank_by_the_accept_length_the_chain_walk_predicts():
    """Top-1 at draft position 0 and the predicted accept length can disagree (a later epoch that drafts
    the easy runs better): the chain's prediction is what serving measures, so it ranks; a curve scored
    before the walk existed still ranks by top-1."""
    from kimi_perf.eagle3.sweep import _rank

    def point(epoch, top1, chain=None):
        p = {"epoch": epoch, "step": epoch * 5, "acc": [top1] * 3, "all_acc": [top1] * 3, "positions": 99}
        if chain is not None:
            p["chain"] = {"steps": 3, "verify_steps": 70, "accept_length": chain, "per_position": [chain - 1, 0, 0]}
        return p

    curve = [point(1, 0.25, 1.20), point(2, 0.22, 1.30)]
    assert max(curve, key=_rank)["epoch"] == 2
    assert max([point(1, 0.25), point(2, 0.22)], key=_rank)["epoch"] == 1
    doc = {"profile": "p", "machine": {"cpu": "CPU X", "gpus": []},
           "rows": [{"variant": "v", "steps": 10, "seconds": 1.0, "train_final_step_acc": [0.6, 0.4, 0.3],
                     "heldout_by_epoch": curve, "best_epoch": 2, "heldout_coverage": 0.5,
                     "train_samples": 160, "heldout_samples": 12}]}
    assert "| 1.300 (0.300 / 0.000 / 0.000) | 2 (1.300 (0.300 / 0.000 / 0.000)) |" in markdown(doc)
