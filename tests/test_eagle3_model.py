"""EAGLE-3 drafter: checkpoint contract, aux-layer conventions per engine, vocab maps, and that the
serving runtime computes exactly what the training module does."""

from __future__ import annotations

import json

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

torch = pytest.importorskip("torch")

from kimi_perf.eagle3.vocab import build_vocab_maps, count_tokens  # noqa: E402
from kimi_perf.engines.reference.drafter_model import (  # noqa: E402
    CHECKPOINT_KEYS,
    Eagle3Config,
    Eagle3Drafter,
    aux_ids_for_engine,
    effective_aux_layers,
    load_drafter,
    save_drafter,
)

TARGET = {"hidden_size": 64, "intermediate_size": 128, "num_attention_heads": 4, "num_key_value_heads": 2,
          "head_dim": 16, "vocab_size": 300, "rms_norm_eps": 1e-5, "max_position_embeddings": 512,
          "num_hidden_layers": 30, "rope_parameters": {"rope_theta": 10000.0, "rope_type": "default"},
          "tie_word_embeddings": True}


def tiny(vd=50, aux=None, seed=0):
    torch.manual_seed(seed)
    cfg = Eagle3Config.for_target(TARGET, vd, aux_layer_ids=aux)
    m = Eagle3Drafter(cfg, torch.randn(300, 64))
    d2t, t2d = build_vocab_maps(np.random.default_rng(seed).integers(0, 100, 300), vd)
    m.set_vocab(torch.from_numpy(d2t), torch.from_numpy(t2d))
    with torch.no_grad():
        for p in m.parameters():
            p.add_(0.05 * torch.randn_like(p))  # norms away from 1, so a dropped norm is visible
    return m


def test_checkpoint_has_exactly_the_contract_keys_and_shapes(tmp_path):
    m = tiny()
    save_drafter(m, tmp_path)
    from safetensors.torch import load_file

    sd = load_file(str(tmp_path / "model.safetensors"))
    assert sorted(sd) == sorted(CHECKPOINT_KEYS)
    h, vd = 64, 50
    shapes = {"fc.weight": (h, 3 * h), "lm_head.weight": (vd, h), "d2t": (vd,), "t2d": (300,),
              "midlayer.self_attn.q_proj.weight": (64, 2 * h), "midlayer.self_attn.k_proj.weight": (32, 2 * h),
              "midlayer.self_attn.v_proj.weight": (32, 2 * h), "midlayer.self_attn.o_proj.weight": (h, 64),
              "midlayer.mlp.gate_proj.weight": (128, h), "midlayer.mlp.down_proj.weight": (h, 128)}
    for k, s in shapes.items():
        assert tuple(sd[k].shape) == s, k
    assert sd["d2t"].dtype == torch.int64 and sd["t2d"].dtype == torch.bool
    cfg = json.loads((tmp_path / "config.json").read_text())
    assert cfg["architectures"] == ["LlamaForCausalLMEagle3"] and cfg["num_hidden_layers"] == 1
    assert cfg["draft_vocab_size"] == 50 and cfg["vocab_size"] == 300 and cfg["target_hidden_size"] == 64
    assert cfg["tie_word_embeddings"] is False and "eagle_config" not in cfg  # no explicit ids by default


def test_roundtrip_and_strict_loading(tmp_path):
    m = tiny()
    save_drafter(m, tmp_path)
    m2 = load_drafter(tmp_path, m.embed)
    for k in CHECKPOINT_KEYS:
        a, b = m.state_dict()[k], m2.state_dict()[k]
        assert torch.equal(a.to(torch.bfloat16).to(b.dtype) if a.is_floating_point() else a, b), k
    from safetensors.torch import load_file, save_file

    sd = load_file(str(tmp_path / "model.safetensors"))
    sd["midlayer.extra.weight"] = torch.zeros(1)
    save_file(sd, str(tmp_path / "model.safetensors"))
    with pytest.raises(ValueError, match="unknown tensors"):
        load_drafter(tmp_path, m.embed)


@pytest.mark.parametrize("engine, written", [
    ("vllm", [2, 15, 27]), ("reference", [2, 15, 27]), ("sglang-llama", [1, 14, 26]),
    ("sglang-deepseek", [1, 14, 26]),
])
def test_explicit_aux_ids_in_each_engines_convention(tmp_path, engine, written):
    layers = (2, 15, 27)
    assert aux_ids_for_engine(layers, engine) == written
    assert effective_aux_layers(written, engine) == layers
    m = tiny(aux=None)
    save_drafter(m, tmp_path, aux_ids_for=engine)
    cfg = json.loads((tmp_path / "config.json").read_text())
    assert cfg["eagle_config"]["eagle_aux_hidden_state_layer_ids"] == written
    assert Eagle3Config.from_hf_config(cfg, engine=engine).aux_layers == layers


def test_off_by_one_is_what_the_wrong_convention_gives():
    # a checkpoint written for vLLM, served by SGLang's Llama: every layer shifts by one
    assert effective_aux_layers(aux_ids_for_engine((2, 15, 27), "vllm"), "sglang-llama") == (3, 16, 28)


def test_non_default_layers_must_be_named(tmp_path):
    with pytest.raises(ValueError, match="pass aux_ids_for"):
        save_drafter(tiny(aux=(3, 16, 28)), tmp_path)


@settings(max_examples=50, deadline=None)
@given(st.lists(st.integers(0, 299), min_size=1, max_size=400), st.integers(1, 300))
def test_vocab_maps_invariants(tokens, n):
    counts = count_tokens([(tokens, [1] * len(tokens))], 300)
    d2t, t2d = build_vocab_maps(counts, n)
    used = np.arange(n) + d2t
    assert len(d2t) == n and t2d.sum() == n and np.all(np.diff(used) > 0)
    assert np.all(t2d[used])
    top = np.argsort(-counts, kind="stable")[: min(n, int((counts > 0).sum()))]
    assert np.all(t2d[top])  # the most frequent assistant tokens are all in the draft vocab


def test_vocab_counts_only_assistant_tokens():
    counts = count_tokens([([5, 6, 7, 7], [0, 0, 1, 1])], 10)
    assert counts[7] == 2 and counts[5] == 0


def test_runtime_matches_training_step0(tmp_path):
    """The serving runtime (slot cache, fused weights) equals the training module's step 0, and its
    chain drafts equal the training module's greedy unroll on the drafted tokens."""
    from types import SimpleNamespace

    from kimi_perf.engines.reference.drafting import DrafterRuntime
    from kimi_perf.engines.reference.model import LlamaShape

    m = tiny(seed=3).float()
    shape = LlamaShape(64, 30, 4, 2, 16, 128, 300, 1e-5, True, 512)
    runner = SimpleNamespace(shape=shape, device=torch.device("cpu"), dtype=torch.float32, max_len=128,
                             max_slots=2, _attn_fp32=False, w=SimpleNamespace(embed=m.embed))
    rt = DrafterRuntime(m, runner)
    t = 12
    aux = torch.randn(1, t, 192)
    ids = torch.randint(0, 300, (1, t))
    # step 0 of training over the whole sequence (anchor p pairs aux[p] with ids[p+1])
    with torch.no_grad():
        h = m.fc(aux)
        tok = torch.zeros_like(ids)
        tok[:, :-1] = ids[:, 1:]
        out = m.ttt(aux, ids, torch.zeros(1, t, 50), torch.zeros(1, t, dtype=torch.bool), steps=1)
        del out, h
    seq = SimpleNamespace(draft_feats=aux[0], draft_tokens=tok[0].tolist(), draft_cache_len=0)
    drafts = rt.propose([seq], 3)[0]
    # reference: run the training module's math step by step on the same inputs
    with torch.no_grad():
        from kimi_perf.engines.reference.drafter_model import _rope_cos_sin

        def layer(hid, toks, pos, keys, vals):
            e = torch.nn.functional.embedding(toks, m.embed)
            x = torch.cat([m.midlayer.input_layernorm(e), m.midlayer.hidden_norm(hid)], -1)
            cos, sin = _rope_cos_sin(m.cfg, pos, x.dtype)
            q, k, v = m._qkv(x, cos, sin)
            keys = torch.cat([keys, k], 1)
            vals = torch.cat([vals, v], 1)
            qh, kh, vh = q.transpose(1, 2), keys.transpose(1, 2), vals.transpose(1, 2)
            n_q, n_k = qh.shape[2], kh.shape[2]
            mask = torch.ones(n_q, n_k, dtype=torch.bool).tril(n_k - n_q)
            o = torch.nn.functional.scaled_dot_product_attention(qh, kh, vh, attn_mask=mask, enable_gqa=True)
            o = m.midlayer.self_attn.o_proj(o.transpose(1, 2).reshape(1, n_q, -1))
            r = o + hid
            pre = m.midlayer.mlp(m.midlayer.post_attention_layernorm(r)) + r
            return pre, keys, vals

        pre, keys, vals = layer(m.fc(aux), tok, torch.arange(t)[None], torch.zeros(1, 0, 2, 16), torch.zeros(1, 0, 2, 16))
        want = []
        last = pre[:, -1:]
        for j in range(3):
            d = m.lm_head(m.norm(last)).argmax(-1)
            tid = m.draft_to_target(d)
            want.append(int(tid))
            if j < 2:
                last, keys, vals = layer(last, tid, torch.tensor([[t + j]]), keys, vals)
    assert drafts == want


def _runtime(seed=3, slots=8):
    from types import SimpleNamespace

    from kimi_perf.engines.reference.drafting import DrafterRuntime
    from kimi_perf.engines.reference.model import LlamaShape

    m = tiny(seed=seed).float()
    shape = LlamaShape(64, 30, 4, 2, 16, 128, 300, 1e-5, True, 512)
    runner = SimpleNamespace(shape=shape, device=torch.device("cpu"), dtype=torch.float32, max_len=128,
                             max_slots=slots, _attn_fp32=False, w=SimpleNamespace(embed=m.embed))
    return DrafterRuntime(m, runner)


def test_graph_shaped_chain_drafts_what_the_exact_shape_chain_drafts():
    """The CUDA-graph body of the drafter: extend padded to k+1 entries, padding rows, a wider key
    window. It must draft the tokens the exact-shape chain drafts and leave the real rows' caches as
    the exact chain leaves them (checked by drafting a second round from each)."""
    from types import SimpleNamespace

    k = 3
    rounds = [[2, 4, 1], [4, 1, 3]]  # per round: pending entries per row (accepted drafts + bonus, <= k+1)
    results = []
    for graph_shaped in (False, True):
        rt = _runtime()
        g = torch.Generator().manual_seed(0)
        seqs = [SimpleNamespace(draft_feats=None, draft_tokens=[], draft_cache_len=0) for _ in range(3)]
        # a first extend of different lengths per row (what follows prefills), exact-shape in both
        for s, n in zip(seqs, (7, 11, 4)):
            s.draft_feats = torch.randn(n, 192, generator=g)
            s.draft_tokens = torch.randint(0, 300, (n,), generator=g).tolist()
        out = [rt.propose(seqs, k)]
        for rnd in rounds:
            for s, n in zip(seqs, rnd):
                s.draft_feats = torch.randn(n, 192, generator=g)
                s.draft_tokens = torch.randint(0, 300, (n,), generator=g).tolist()
            if not graph_shaped:
                out.append(rt.propose(seqs, k))
                continue
            b, q = 4, k + 1  # one padding row, every row padded to k+1 pending entries
            junk = torch.Generator().manual_seed(99)  # stale garbage beyond each row's width
            feats = torch.randn(b, q, 192, generator=junk)
            toks = torch.randint(0, 300, (b, q), generator=junk)
            widths = [len(s.draft_tokens) for s in seqs] + [0]
            base = [s.draft_cache_len for s in seqs] + [0]
            for i, s in enumerate(seqs):
                feats[i, : widths[i]] = s.draft_feats
                toks[i, : widths[i]] = torch.tensor(s.draft_tokens)
            d = rt.draft_chain(feats, toks, torch.tensor(base), torch.tensor(widths), k, 128)
            for s, w in zip(seqs, widths):
                s.draft_cache_len += w
                s.draft_feats, s.draft_tokens = None, []
            out.append(d[:3].tolist())
        results.append(out)
    assert results[0] == results[1]
    assert len({tuple(map(tuple, r)) for r in results[0]}) > 1  # the rounds draft different tokens


@pytest.mark.gpu
def test_captured_drafter_chain_replays_the_eager_drafts():
    """On CUDA: the captured propose chain (DrafterGraphs) drafts what the eager chain drafts, round
    after round, including the first eager-only extend and a batch that needs a padding row."""
    from types import SimpleNamespace

    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU")
    k = 3
    outs = []
    for graphs in (False, True):
        rt = _runtime()
        for name in ("fc", "qkv", "o", "gate_up", "down", "hidden_norm", "input_norm", "post_norm", "norm",
                     "lm_head", "d2t", "embed", "cos", "sin", "_kpos", "k_cache", "v_cache"):
            setattr(rt, name, getattr(rt, name).cuda())
        rt.device = torch.device("cuda")
        if graphs:
            gr = rt.enable_cuda_graphs(max_bs=4, k=k, log=lambda m: None)
        g = torch.Generator().manual_seed(0)
        seqs = [SimpleNamespace(draft_feats=None, draft_tokens=[], draft_cache_len=0) for _ in range(3)]
        out = []
        for rnd in range(6):
            for s in seqs:
                n = 9 if rnd == 0 else int(torch.randint(1, k + 2, (1,), generator=g))
                s.draft_feats = torch.randn(n, 192, generator=g).cuda()
                s.draft_tokens = torch.randint(0, 300, (n,), generator=g).tolist()
            out.append(rt.propose(seqs, k))
        outs.append(out)
    assert gr.replays == 5 and gr.fallbacks == 1  # the first round's 9-entry extend runs eagerly
    assert outs[0] == outs[1]
