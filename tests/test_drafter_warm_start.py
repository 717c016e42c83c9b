"""``train.init_from``: a recipe trains on from a shipped drafter's weights.

Why these tests: a warm start that silently loaded nothing (or loaded a drafter of another draft
vocabulary, whose lm_head rows mean other tokens) would train "from the bundle" while starting from
noise or from garbage, and the only symptom would be a held-out curve a lease later. And the field must
not change the digest of any recipe written before it, or every shipped bundle would stop applying.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import asdict, replace
from pathlib import Path

import pytest

torch = pytest.importorskip("torch")

from kimi_perf.eagle3.shipped import (  # noqa: E402
    SHIPPED_ROOT,
    ShippedDrafterError,
    bundle_at,
    restore,
    retired,
    served_path,
)
from kimi_perf.eagle3.train import TrainConfig, warm_start  # noqa: E402
from kimi_perf.engines.reference.drafter_model import CHECKPOINT_KEYS, Eagle3Drafter, load_drafter  # noqa: E402
from kimi_perf.profiles import load_profile  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
# the embedded-cpu recipe's fp32-trained bundle (the smallest shipped one)
BUNDLE = "a114c67ab3aea404-9b84de8d53f8-03d0b33f6cff-bca767665699"


def _old_digest(cfg: TrainConfig) -> str:
    d = asdict(cfg)
    for k in ("checkpoint_every", "log_every", "device", "threads", "init_from", "max_samples", "reinit"):
        d.pop(k)
    return hashlib.sha256(json.dumps(d, sort_keys=True).encode()).hexdigest()[:12]


def test_init_from_keeps_the_digests_of_recipes_without_it_and_changes_theirs_with_it():
    cfg = TrainConfig(draft_vocab_size=8192, lr=3e-3, epochs=3)
    assert cfg.digest() == _old_digest(cfg)
    assert replace(cfg, init_from=BUNDLE).digest() != cfg.digest()
    assert replace(cfg, max_samples=5000).digest() != cfg.digest()
    assert replace(cfg, reinit=("fc",)).digest() != cfg.digest()
    # the shipped GPU bundle's name ends in its train digest, which the profile's recipe before the
    # warm start gave: the field left that recipe's digest alone
    train = load_profile(ROOT / "profiles" / "h200-embedded.json").eagle3.drafter_recipe().train
    # the parent is retired from the tree (RETIRED.json), its name and digests stay
    assert train.init_from in retired() and not (SHIPPED_ROOT / train.init_from).exists()
    assert replace(train, init_from="", seed=0, lr=0.003).digest() == train.init_from.split("-")[3]


def test_a_retired_parent_names_the_restore_and_restore_brings_it_back_verified(tmp_path, monkeypatch):
    """A warm start's parent retired from the tree (the tree travels with every GPU lease call) fails
    with the command that restores it, and that command puts back the bundle the manifest names."""
    import subprocess

    parent = load_profile(ROOT / "profiles" / "h200-embedded.json").eagle3.drafter_recipe().train.init_from
    with pytest.raises(ValueError, match=rf"retired from the tree .*shipped restore {parent}"):
        warm_start(None, parent)  # refused before any weight is read
    commit = retired()[parent]["commit"]
    if subprocess.run(["git", "-C", str(ROOT), "cat-file", "-e", f"{commit}^{{commit}}"], check=False).returncode:
        pytest.skip(f"this checkout has no commit {commit[:12]} (a shallow clone or a package): nothing to restore")
    got = restore(parent, into=tmp_path)
    b = bundle_at(got)
    assert b is not None and b.name == parent and b.manifest["recipe_key"]["train"] == parent.split("-")[3]
    with pytest.raises(ShippedDrafterError, match="is not a retired bundle"):
        restore("no-such-bundle", into=tmp_path)


def _served(tmp_path, monkeypatch):
    monkeypatch.setenv("KIMI_PERF_CACHE", str(tmp_path))
    path = served_path(bundle_at(SHIPPED_ROOT / BUNDLE), root=tmp_path)
    shipped = load_drafter(path, torch.zeros(49152, 576))
    return shipped, Eagle3Drafter(shipped.cfg, torch.zeros(49152, 576))


def test_a_warm_start_loads_every_tensor_of_the_bundle(tmp_path, monkeypatch):
    shipped, fresh = _served(tmp_path, monkeypatch)
    fresh.set_vocab(shipped.d2t, shipped.t2d)
    assert not torch.equal(fresh.fc.weight, shipped.fc.weight)
    warm_start(fresh, BUNDLE)
    want, got = shipped.state_dict(), fresh.state_dict()
    for k in CHECKPOINT_KEYS:
        assert torch.equal(got[k], want[k]), k


def test_reinit_fc_resets_only_the_feature_projection_after_a_warm_start(tmp_path, monkeypatch):
    """``train.reinit=("fc",)``: a matrix row fine-tuned from a parent must learn its own path's input
    mapping; every other tensor keeps the parent's weights."""
    from kimi_perf.eagle3.train import reinit_modules

    shipped, fresh = _served(tmp_path, monkeypatch)
    fresh.set_vocab(shipped.d2t, shipped.t2d)
    warm_start(fresh, BUNDLE)
    reinit_modules(fresh, ("fc",))
    want, got = shipped.state_dict(), fresh.state_dict()
    assert not torch.equal(got["fc.weight"], want["fc.weight"])
    for k in CHECKPOINT_KEYS:
        if k != "fc.weight":
            assert torch.equal(got[k], want[k]), k
    with pytest.raises(ValueError, match=r"train.reinit \['midlayer'\].*\['fc'\]"):
        reinit_modules(fresh, ("midlayer",))


def test_a_bundle_of_another_draft_vocabulary_or_name_is_refused_with_the_reason(tmp_path, monkeypatch):
    shipped, fresh = _served(tmp_path, monkeypatch)
    d2t = shipped.d2t.clone()
    d2t[-1] += 1
    fresh.set_vocab(d2t, shipped.t2d)
    before = fresh.fc.weight.clone()
    with pytest.raises(ValueError, match=r"d2t differs \(another draft vocabulary\).*leave init_from out"):
        warm_start(fresh, BUNDLE)
    assert torch.equal(fresh.fc.weight, before)  # nothing half-loaded
    with pytest.raises(ValueError, match=r"'no-such-bundle' is not a drafter bundle shipped in .*shipped: .*" + BUNDLE):
        warm_start(fresh, "no-such-bundle")
    small = Eagle3Drafter(replace(shipped.cfg, draft_vocab_size=1024), torch.zeros(49152, 576))
    with pytest.raises(ValueError, match=r"lm_head.weight: \(\d+, 576\) vs \(1024, 576\)"):
        warm_start(small, BUNDLE)


def _samples(n: int, vocab: int = 64) -> list:
    from kimi_perf.eagle3.data import Sample

    # sample i answers with token i % vocab (and 1 + i % 3 copies of it): the draft vocabulary of the
    # whole set and of any slice of it differ
    return [Sample(id=f"src{i % 3}-{i:04d}-t1", source=f"src{i % 3}", split="train", prompt_ids=[1, 2],
                   response_ids=[i % vocab] * (1 + i % 3)) for i in range(n)]


def test_max_samples_slices_by_id_hash_the_same_way_whatever_the_order():
    from kimi_perf.eagle3.pipeline import capped_train

    s = _samples(300)
    cut = capped_train(s, 60)
    assert len(cut) == 60 and len({x.id for x in cut}) == 60
    assert {x.id for x in capped_train(list(reversed(s)), 60)} == {x.id for x in cut}
    assert {x.source for x in cut} == {"src0", "src1", "src2"}  # not the first 60 of the file (src order)
    assert {x.id for x in cut} != {x.id for x in s[:60]}
    assert capped_train(s, 0) is s and capped_train(s, 300) is s


def test_a_capped_recipe_trains_on_the_slice_with_the_vocabulary_of_all_samples(tmp_path, monkeypatch):
    """What a warm start on a slice needs: the draft vocabulary the parent was built with (counted over
    every training sample), and the trainer and feature extraction given only the slice (and the
    held-out samples). Stages stubbed: the recipe's wiring is under test, not the model."""
    import numpy as np

    from kimi_perf.eagle3 import pipeline
    from kimi_perf.eagle3.data import Sample
    from kimi_perf.eagle3.pipeline import DrafterRecipe, build_drafter

    samples = _samples(200) + [Sample(id="mtbench-1-t1", source="mtbench", split="heldout", prompt_ids=[1],
                                      response_ids=[5, 6])]
    seen: dict = {}

    class Stop(Exception):
        pass

    def fake_source(recipe, ss, heldout, *a, **k):
        seen["extracted"] = {s.id for s in ss}

        class Store:
            sample_ids = [s.id for s in ss]
        return Store()

    def fake_train(store, train_ids, cfg, embed, lm, d2t, t2d, *a, **k):
        seen["train_ids"], seen["t2d"] = set(train_ids), t2d.numpy().copy()
        raise Stop

    vocab = 64
    monkeypatch.setattr(pipeline, "build_items", lambda cfg: [])
    monkeypatch.setattr(pipeline, "generate_samples", lambda *a, **k: {s.id: s for s in samples})
    monkeypatch.setattr(pipeline, "load_target_tensors",
                        lambda d: ({"vocab_size": vocab, "num_hidden_layers": 4}, torch.zeros(vocab, 2), torch.zeros(vocab, 2)))
    monkeypatch.setattr(pipeline, "feature_source", fake_source)
    monkeypatch.setattr(pipeline, "train_drafter", fake_train)
    t2d_of = {}
    for cap in (0, 40):
        recipe = DrafterRecipe.from_dict({"train": {"draft_vocab_size": 16, "max_samples": cap}})
        with pytest.raises(Stop):
            build_drafter(recipe, tmp_path, "fp", gen_url="http://unused", tokenizer=None, root=tmp_path / "cache")
        t2d_of[cap] = seen["t2d"]
        want = {s.id for s in pipeline.capped_train(samples[:200], cap)}
        assert seen["train_ids"] == want and seen["extracted"] == want | {"mtbench-1-t1"}
    assert len(seen["train_ids"]) == 40
    # the slice alone would pick other tokens: the map is the whole set's
    from kimi_perf.eagle3.vocab import build_vocab_maps, count_tokens
    alone = build_vocab_maps(count_tokens(((s.ids, s.loss_mask) for s in pipeline.capped_train(samples[:200], 40)), vocab), 16)[1]
    assert np.array_equal(t2d_of[0], t2d_of[40]) and not np.array_equal(alone, t2d_of[40])
