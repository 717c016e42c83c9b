"""No data loss: each drafter pipeline stage (regenerate, extract, train) is SIGKILLed mid-run in a
subprocess, then run again; the second run must reuse every finished unit of work, redo none, and end
with exactly the data an uninterrupted run produces.

A tiny random Llama (6 layers, hidden 64, the embedded model's tokenizer) keeps each stage at seconds.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest
from engine_helpers import embedded_path

torch = pytest.importorskip("torch")
pytestmark = pytest.mark.slow
ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory):
    import shutil

    from transformers import LlamaConfig, LlamaForCausalLM

    src = embedded_path()
    out = tmp_path_factory.mktemp("tiny-llama")
    cfg = LlamaConfig(vocab_size=49152, hidden_size=64, intermediate_size=128, num_hidden_layers=6,
                      num_attention_heads=4, num_key_value_heads=2, head_dim=16, max_position_embeddings=2048,
                      tie_word_embeddings=True, bos_token_id=1, eos_token_id=2)
    torch.manual_seed(0)
    LlamaForCausalLM(cfg).save_pretrained(out)
    for f in ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "chat_template.jinja"):
        if (src / f).is_file():
            shutil.copy2(src / f, out / f)
    return out


def _kill_when(proc: subprocess.Popen, ready, timeout: float = 120.0) -> None:
    """SIGKILL ``proc`` as soon as ``ready()`` holds (the stage has made some, not all, progress)."""
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        if ready():
            proc.send_signal(signal.SIGKILL)
            proc.wait(30)
            return
        if proc.poll() is not None:
            pytest.fail(f"the stage finished (rc {proc.returncode}) before it could be killed:\n"
                        f"{proc.stdout.read() if proc.stdout else ''}")
        time.sleep(0.02)
    proc.kill()
    pytest.fail("the stage made no progress to kill it at")


def _spawn(code: str) -> subprocess.Popen:
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])}
    return subprocess.Popen([sys.executable, "-c", textwrap.dedent(code)], env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True)


DATA_CFG = dict(max_train_items=10, max_heldout_items=2, max_new_tokens=48, concurrency=1)


@pytest.fixture(scope="module")
def tiny_server(tiny_model, tmp_path_factory):
    from kimi_perf.engines.base import ReferenceEngineConfig
    from kimi_perf.launcher import ServerProcess

    cfg = ReferenceEngineConfig(name="tiny", model_path=str(tiny_model), served_model_name="tiny", dtype="float32",
                                device="cpu", context_length=1024, max_running_requests=4, ready_timeout_s=120)
    with ServerProcess(cfg.launch_spec(tmp_path_factory.mktemp("logs"))) as srv:
        yield srv


def test_generation_killed_then_resumed(tiny_model, tiny_server, tmp_path):
    from transformers import AutoTokenizer

    from kimi_perf.eagle3.data import DataConfig, build_items, generate_samples, read_samples

    out = tmp_path / "samples.jsonl"
    proc = _spawn(f"""
        from transformers import AutoTokenizer
        from kimi_perf.eagle3.data import DataConfig, build_items, generate_samples
        from pathlib import Path
        cfg = DataConfig(**{DATA_CFG!r})
        generate_samples({tiny_server.base_url!r}, AutoTokenizer.from_pretrained({str(tiny_model)!r}),
                         build_items(cfg), Path({str(out)!r}), cfg)
    """)
    _kill_when(proc, lambda: out.is_file() and out.read_bytes().count(b"\n") >= 3)
    before = read_samples(out)
    assert len(before) >= 3
    cfg = DataConfig(**DATA_CFG)
    items = build_items(cfg)
    assert len(before) < len(items)
    with open(out, "ab") as f:  # a write torn by the kill: the reader must drop it, not choke on it
        f.write(b'{"id": "torn", "sou')
    tok = AutoTokenizer.from_pretrained(str(tiny_model))
    calls = []
    samples = generate_samples(lambda: calls.append(1) or tiny_server.base_url, tok, items, out, cfg)
    assert set(samples) == {i.id for i in items}
    for sid, s in before.items():  # finished work is kept as it was, not redone
        assert samples[sid] == s
    lines = out.read_bytes().splitlines()
    ids = [json.loads(ln)["id"] for ln in lines]
    assert sorted(ids) == sorted(samples) and len(ids) == len(set(ids))
    # a third run has nothing to do and never asks for a server
    calls.clear()
    assert generate_samples(lambda: calls.append(1) or tiny_server.base_url, tok, items, out, cfg) == samples
    assert not calls


def _samples(n: int = 14):
    from kimi_perf.eagle3.data import Sample

    g = torch.Generator().manual_seed(0)
    out = []
    for i in range(n):
        p = torch.randint(100, 40000, (20 + i,), generator=g).tolist()
        r = torch.randint(100, 40000, (30,), generator=g).tolist()
        out.append(Sample(id=f"s{i:02d}", source="sharegpt", split="train", prompt_ids=p, response_ids=r))
    return out


FEAT_CODE = """
    import pickle, sys
    from pathlib import Path
    from kimi_perf.eagle3.features import FeatureSpec, extract_features
    samples = pickle.loads(bytes.fromhex({blob!r}))
    extract_features(samples, Path({model!r}), Path({out!r}), FeatureSpec(shard_tokens=60, dtype="float32"),
                     model_fingerprint="tiny")
"""


def test_feature_extraction_killed_then_resumed(tiny_model, tmp_path):
    import pickle

    from kimi_perf.eagle3.features import FeatureSpec, FeatureStore, extract_features

    samples = _samples()
    out = tmp_path / "features"
    proc = _spawn(FEAT_CODE.format(blob=pickle.dumps(samples).hex(), model=str(tiny_model), out=str(out)))
    manifest = out / "manifest.json"

    def some_shards() -> bool:
        try:
            return len(json.loads(manifest.read_text())["shards"]) >= 2
        except (OSError, ValueError):
            return False

    _kill_when(proc, some_shards)
    done_before = json.loads(manifest.read_text())["shards"]
    files_before = {sh["file"]: (out / sh["file"]).read_bytes() for sh in done_before}
    assert len({s for sh in done_before for s in sh["sample_ids"]}) < len(samples)
    store = extract_features(samples, tiny_model, out, FeatureSpec(shard_tokens=60, dtype="float32"),
                             model_fingerprint="tiny")
    ids = [s for sh in store.manifest["shards"] for s in sh["sample_ids"]]
    assert sorted(ids) == [s.id for s in samples] and len(ids) == len(set(ids))
    for name, data in files_before.items():  # finished shards untouched
        assert (out / name).read_bytes() == data
    # the resumed store equals a store extracted in one go
    whole = extract_features(samples, tiny_model, tmp_path / "whole", FeatureSpec(shard_tokens=60, dtype="float32"),
                             model_fingerprint="tiny")
    a = {s.id: s for s in FeatureStore(out).samples()}
    b = {s.id: s for s in whole.samples()}
    for sid in b:
        torch.testing.assert_close(a[sid].aux, b[sid].aux)
        assert torch.equal(a[sid].target_argmax, b[sid].target_argmax)


TRAIN_CODE = """
    import json, torch
    from pathlib import Path
    from kimi_perf.eagle3.features import FeatureStore
    from kimi_perf.eagle3.pipeline import load_target_tensors
    from kimi_perf.eagle3.train import TrainConfig, train_drafter
    from kimi_perf.eagle3.vocab import build_vocab_maps, count_tokens
    store = FeatureStore(Path({feat!r}))
    cfg, embed, lm = load_target_tensors(Path({model!r}))
    samples = list(store.samples())
    counts = count_tokens(((s.input_ids.tolist(), s.loss_mask.tolist()) for s in samples), cfg["vocab_size"])
    d2t, t2d = build_vocab_maps(counts, 256)
    tc = TrainConfig(**{tcfg!r})
    m, r = train_drafter(store, [s.id for s in samples], cfg, embed, lm, torch.from_numpy(d2t),
                         torch.from_numpy(t2d), Path({work!r}), tc)
    torch.save(m.state_dict(), Path({work!r}) / "final.pt")
    print(json.dumps({{"steps": r.steps, "resumed": r.resumed_from_step}}))
"""


def test_training_killed_then_resumed_matches_an_uninterrupted_run(tiny_model, tmp_path):
    from kimi_perf.eagle3.features import FeatureSpec, extract_features

    samples = _samples(16)
    for s in samples:  # loss on the responses, as the pipeline's samples have
        assert s.loss_mask.count(1) > 0
    extract_features(samples, tiny_model, tmp_path / "feat", FeatureSpec(shard_tokens=4096, dtype="float32"),
                     model_fingerprint="tiny")
    tcfg = dict(draft_vocab_size=256, ttt_steps=2, epochs=6, batch_tokens=64, checkpoint_every=3, log_every=5,
                device="cpu", threads=1, warmup_steps=2)
    code = {w: TRAIN_CODE.format(feat=str(tmp_path / "feat"), model=str(tiny_model), tcfg=tcfg, work=str(tmp_path / w))
            for w in ("killed", "whole")}
    proc = _spawn(code["killed"])
    state = tmp_path / "killed" / "train_state.pt"
    _kill_when(proc, lambda: state.is_file() and state.stat().st_size > 0 and time.sleep(0.3) is None)
    resumed = _spawn(code["killed"])
    out, _ = resumed.communicate(timeout=300)
    assert resumed.returncode == 0, out
    r = json.loads(out.strip().splitlines()[-1])
    assert "resuming at step" in out and r["resumed"] >= 3 and r["steps"] > r["resumed"]
    whole = _spawn(code["whole"])
    out2, _ = whole.communicate(timeout=300)
    assert whole.returncode == 0, out2
    assert json.loads(out2.strip().splitlines()[-1]) == {"steps": r["steps"], "resumed": 0}
    a = torch.load(tmp_path / "killed" / "final.pt")
    b = torch.load(tmp_path / "whole" / "final.pt")
    for k in b:  # resuming from the checkpoint (model, optimiser, RNG, data order) changes nothing
        torch.testing.assert_close(a[k], b[k], rtol=0, atol=0, msg=k)


def test_batched_extraction_stores_what_one_sample_per_forward_stores(tiny_model, tmp_path):
    """extract_batch_tokens changes how features are computed (right-padded batches, length-sorted
    within a window), not what is stored: the same samples in the same shards, rows equal to kernel
    rounding, and the same spec digest (cached feature sets and shipped drafters stay valid)."""
    from dataclasses import replace

    from kimi_perf.eagle3.features import FeatureSpec, FeatureStore, extract_features

    samples = _samples(14)  # 50-63 tokens each, increasing: interleaved so the length sort reorders them
    samples = samples[::2] + samples[1::2]
    one = FeatureSpec(shard_tokens=200, dtype="float32")
    batched = replace(one, extract_batch_tokens=190)  # 3 samples per forward: several batches, padded rows
    assert batched.digest() == one.digest()
    a = extract_features(samples, tiny_model, tmp_path / "one", one, model_fingerprint="tiny")
    b = extract_features(samples, tiny_model, tmp_path / "batched", batched, model_fingerprint="tiny")
    assert [sh["sample_ids"] for sh in a.manifest["shards"]] == [sh["sample_ids"] for sh in b.manifest["shards"]]
    rows_a = {s.id: s for s in FeatureStore(a.root).samples()}
    for s in FeatureStore(b.root).samples():
        r = rows_a[s.id]
        assert s.aux.shape == r.aux.shape and torch.equal(s.input_ids, r.input_ids)
        torch.testing.assert_close(s.aux, r.aux, atol=2e-5, rtol=1e-4)
        torch.testing.assert_close(s.final, r.final, atol=2e-5, rtol=1e-4)
        assert torch.equal(s.target_argmax, r.target_argmax)


def test_held_out_scoring_per_epoch_leaves_training_unchanged(tiny_model, tmp_path):
    """The trainer scores held-out samples after every epoch (kimi_perf.eagle3.train.evaluate_heldout):
    one curve point per epoch, ``all_acc`` (every assistant position, out-of-vocabulary targets as misses)
    never above ``acc``, and the weights bit-identical to a run that scores nothing, so turning the
    curve on cannot change a drafter or its content hash."""
    from kimi_perf.eagle3.features import FeatureSpec, extract_features
    from kimi_perf.eagle3.pipeline import load_target_tensors
    from kimi_perf.eagle3.train import TrainConfig, train_drafter
    from kimi_perf.eagle3.vocab import build_vocab_maps, count_tokens

    samples = _samples(16)
    store = extract_features(samples, tiny_model, tmp_path / "feat", FeatureSpec(shard_tokens=4096, dtype="float32"),
                             model_fingerprint="tiny")
    train_ids, held_ids = [s.id for s in samples[:12]], [s.id for s in samples[12:]]
    cfg, embed, lm = load_target_tensors(tiny_model)
    counts = count_tokens(((s.ids, s.loss_mask) for s in samples[:12]), cfg["vocab_size"])
    d2t, t2d = build_vocab_maps(counts, 256)  # the held-out responses' tokens are mostly outside it
    tc = TrainConfig(draft_vocab_size=256, ttt_steps=2, epochs=3, batch_tokens=128, device="cpu", threads=1,
                     warmup_steps=2, log_every=100, checkpoint_every=100)
    runs = {}
    for name, held in (("scored", held_ids), ("plain", None)):
        runs[name] = train_drafter(store, train_ids, cfg, embed, lm, torch.from_numpy(d2t), torch.from_numpy(t2d),
                                   tmp_path / name, tc, heldout_ids=held)
    (m_scored, r_scored), (m_plain, r_plain) = runs["scored"], runs["plain"]
    assert [p["epoch"] for p in r_scored.heldout_by_epoch] == [1, 2, 3] and r_plain.heldout_by_epoch == []
    assert r_scored.heldout_by_epoch[-1]["step"] == r_scored.steps
    assert r_scored.heldout_by_epoch[0]["positions"] == sum(len(s.response_ids) for s in samples[12:])
    for point in r_scored.heldout_by_epoch:
        for acc, all_acc in zip(point["acc"], point["all_acc"]):
            assert all_acc <= acc or acc != acc  # NaN when no position of that step was draftable
        # the chain walk of the held-out samples: 2 drafts a step here (ttt_steps 2, under CHAIN_STEPS 3)
        ch = point["chain"]
        assert ch["steps"] == 2 and ch["verify_steps"] >= sum(len(s.response_ids) for s in samples[12:]) / 3
        assert ch["accept_length"] == pytest.approx(1 + sum(ch["per_position"]))
        assert ch["per_position"][0] >= ch["per_position"][1]
    for k, v in m_plain.state_dict().items():
        torch.testing.assert_close(m_scored.state_dict()[k], v, rtol=0, atol=0, msg=k)


def test_a_resumed_run_reports_the_held_out_points_of_the_epochs_before_it(tiny_model, tmp_path):
    """The held-out curve (one point per epoch) is what the recipe's epochs are chosen by, and a GPU
    lease can end mid-training: the points of the epochs before a kill travel in the checkpoint, so
    the resumed run's curve equals an uninterrupted run's. (It used to start empty on resume.)"""
    from kimi_perf.eagle3.features import FeatureSpec, extract_features
    from kimi_perf.eagle3.pipeline import load_target_tensors
    from kimi_perf.eagle3.train import TrainConfig, train_drafter
    from kimi_perf.eagle3.vocab import build_vocab_maps, count_tokens

    samples = _samples(16)
    store = extract_features(samples, tiny_model, tmp_path / "feat", FeatureSpec(shard_tokens=4096, dtype="float32"),
                             model_fingerprint="tiny")
    train_ids, held_ids = [s.id for s in samples[:12]], [s.id for s in samples[12:]]
    cfg, embed, lm = load_target_tensors(tiny_model)
    d2t, t2d = build_vocab_maps(count_tokens(((s.ids, s.loss_mask) for s in samples[:12]), cfg["vocab_size"]), 256)
    tc = TrainConfig(draft_vocab_size=256, ttt_steps=2, epochs=3, batch_tokens=128, device="cpu", threads=1,
                     warmup_steps=2, log_every=100, checkpoint_every=1)

    def run(work, stop=None):
        return train_drafter(store, train_ids, cfg, embed, lm, torch.from_numpy(d2t), torch.from_numpy(t2d),
                             work, tc, heldout_ids=held_ids, stop_after_steps=stop)[1]

    whole = run(tmp_path / "whole")
    assert [p["epoch"] for p in whole.heldout_by_epoch] == [1, 2, 3]
    first = run(tmp_path / "killed", stop=whole.heldout_by_epoch[1]["step"])  # killed right after epoch 2
    assert [p["epoch"] for p in first.heldout_by_epoch] == [1, 2]
    resumed = run(tmp_path / "killed")
    assert resumed.resumed_from_step == whole.heldout_by_epoch[1]["step"]
    assert resumed.heldout_by_epoch == whole.heldout_by_epoch


def test_online_features_train_the_drafter_the_stored_ones_do(tiny_model, tmp_path):
    """FeatureSpec.online computes each training batch's rows from the target instead of reading
    stored shards (a 47K-sample recipe's shards would be 83 GB). It changes how, not what: the same
    steps over the same samples, the same held-out positions scored, weights equal to the stored
    run's up to the kernels' rounding for another batch shape, and the same spec digest."""
    from dataclasses import replace

    from kimi_perf.eagle3.features import FeatureSpec, OnlineFeatures, extract_features
    from kimi_perf.eagle3.pipeline import load_target_tensors
    from kimi_perf.eagle3.train import TrainConfig, train_drafter
    from kimi_perf.eagle3.vocab import build_vocab_maps, count_tokens

    samples = _samples(16)
    spec = FeatureSpec(shard_tokens=4096, dtype="float32")
    assert replace(spec, online=True).digest() == spec.digest()
    stored = extract_features(samples, tiny_model, tmp_path / "feat", spec, model_fingerprint="tiny")
    online = OnlineFeatures(samples, tiny_model, replace(spec, online=True))
    assert online.layers == stored.layers and online.num_tokens == stored.num_tokens
    # counted once, not per read: the trainer and the speed benchmark read lengths per run and per batch
    assert online.lengths is online.lengths
    # a view holds only its ids: the held-out scoring must not see training samples
    assert set(online.loader({samples[0].id}).lengths) == {samples[0].id}
    # a batch cut at max_len (50, 59 and 53 tokens, cut at 55): each sample's own ids and loss mask,
    # rows of one padded tensor, and rows of the target of the same length
    by_id = {s.id: s for s in samples}
    for fs in online.batch([samples[0].id, samples[9].id, samples[3].id], 55):
        n = min(len(by_id[fs.id].ids), 55)
        assert fs.input_ids.tolist() == by_id[fs.id].ids[:n]
        assert fs.loss_mask.tolist() == [bool(x) for x in by_id[fs.id].loss_mask[:n]]
        assert fs.aux.shape[0] == fs.final.shape[0] == fs.target_argmax.shape[0] == n
    train_ids, held_ids = [s.id for s in samples[:12]], [s.id for s in samples[12:]]
    cfg, embed, lm = load_target_tensors(tiny_model)
    counts = count_tokens(((s.ids, s.loss_mask) for s in samples[:12]), cfg["vocab_size"])
    d2t, t2d = build_vocab_maps(counts, 256)
    tc = TrainConfig(draft_vocab_size=256, ttt_steps=2, epochs=2, batch_tokens=128, device="cpu", threads=1,
                     warmup_steps=2, log_every=100, checkpoint_every=100)
    runs = {name: train_drafter(src, train_ids, cfg, embed, lm, torch.from_numpy(d2t), torch.from_numpy(t2d),
                                tmp_path / name, tc, heldout_ids=held_ids)
            for name, src in (("stored", stored), ("online", online))}
    (m_s, r_s), (m_o, r_o) = runs["stored"], runs["online"]
    assert (r_o.steps, r_o.tokens) == (r_s.steps, r_s.tokens) and r_o.steps > 4
    assert [p["positions"] for p in r_o.heldout_by_epoch] == [p["positions"] for p in r_s.heldout_by_epoch]
    assert r_o.heldout_by_epoch[0]["positions"] == sum(len(s.response_ids) for s in samples[12:])
    for k, v in m_s.state_dict().items():
        torch.testing.assert_close(m_o.state_dict()[k], v, atol=1e-4, rtol=1e-3, msg=k)


def test_online_features_need_an_in_process_target(tiny_model):
    from kimi_perf.eagle3.features import FeatureSpec, OnlineFeatures

    with pytest.raises(ValueError, match="in-process backend"):
        OnlineFeatures(_samples(2), tiny_model, FeatureSpec(backend="http-aux", online=True, server_url="http://x"))


def test_an_online_recipe_stores_only_the_held_out_rows(tiny_model, tmp_path):
    """pipeline.feature_source: a stored recipe extracts every sample; an online one stores only the
    held-out samples' rows (with the manifest the alignment tests read) and trains from the target."""
    from dataclasses import replace

    from kimi_perf.eagle3.features import FeatureSpec, FeatureStore, OnlineFeatures
    from kimi_perf.eagle3.pipeline import DrafterRecipe, feature_source

    samples = _samples(6)
    held = samples[4:]
    recipe = DrafterRecipe(features=FeatureSpec(shard_tokens=4096, dtype="float32"))
    src = feature_source(recipe, samples, held, tiny_model, tmp_path / "stored", "tiny")
    assert isinstance(src, FeatureStore) and sorted(src.sample_ids) == sorted(s.id for s in samples)
    online = replace(recipe, features=replace(recipe.features, online=True))
    src = feature_source(online, samples, held, tiny_model, tmp_path / "online", "tiny")
    assert isinstance(src, OnlineFeatures) and sorted(src.sample_ids) == sorted(s.id for s in samples)
    assert sorted(FeatureStore(tmp_path / "online").sample_ids) == sorted(s.id for s in held)
