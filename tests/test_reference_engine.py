"""The reference engine's compute and scheduler, in process: exactness against transformers, and
continuous batching that changes nothing about each request's output."""

from __future__ import annotations

import threading

import pytest
from engine_helpers import PROMPTS, chat_ids

torch = pytest.importorskip("torch")
pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def hf_fp32(model_dir):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32).eval()


def make_engine(model_dir, dtype=torch.float32, **kw):
    from kimi_perf.engines.reference.engine import Engine
    from kimi_perf.engines.reference.model import LlamaRunner

    runner = LlamaRunner.from_pretrained(model_dir, dtype=dtype, max_slots=8, max_len=512)
    return Engine(runner, eos_token_ids={2}, max_running=8, **kw)


def run_all(engine, prompts, max_new, ignore_eos=True, params=None):
    """Run ``prompts`` through the engine thread; ``params`` (one SamplingParams per prompt) overrides
    the greedy defaults."""
    from kimi_perf.engines.reference.engine import SamplingParams, Sequence

    done = threading.Event()
    params = params or [SamplingParams(max_new_tokens=max_new, ignore_eos=ignore_eos)] * len(prompts)
    seqs = [Sequence(rid=str(i), prompt=p, params=pp) for i, (p, pp) in enumerate(zip(prompts, params))]
    left = {id(s) for s in seqs}

    def on_step(events):
        for e in events:
            if e.finished:
                left.discard(id(e.seq))
        if not left:
            done.set()

    engine.on_step = on_step
    engine.start()
    try:
        for s in seqs:
            engine.submit(s)
        assert done.wait(300), "engine did not finish"
    finally:
        engine.stop()
    return [s.output for s in seqs]


def test_greedy_matches_transformers_generate_fp32(model_dir, tok, hf_fp32):
    prompts = [chat_ids(tok, p) for p in PROMPTS]
    ours = run_all(make_engine(model_dir), prompts, 40, ignore_eos=False)
    for p, o in zip(prompts, ours):
        ref = hf_fp32.generate(torch.tensor([p]), attention_mask=torch.ones(1, len(p), dtype=torch.long), max_new_tokens=40, do_sample=False, eos_token_id=2,
                               pad_token_id=2)[0, len(p):].tolist()
        assert o == ref, f"diverged at {next((i for i, (a, b) in enumerate(zip(o, ref)) if a != b), None)}"


def test_batching_does_not_change_outputs(model_dir, tok):
    prompts = [chat_ids(tok, p) for p in PROMPTS]
    alone = [run_all(make_engine(model_dir), [p], 24)[0] for p in prompts[:3]]
    together = run_all(make_engine(model_dir), prompts, 24)
    assert together[:3] == alone


def test_retiring_mid_batch_moves_one_cache_per_finished_sequence(model_dir, tok):
    """Requests that end at different steps (as EOS-terminated ones do) leave holes anywhere in the
    slot range; filling them from the top must keep every survivor's output and cost one cache copy
    per finished sequence (a shift-down compaction cost ~n/2 per retirement)."""
    from kimi_perf.engines.reference.engine import SamplingParams

    prompts = [chat_ids(tok, p) for p in PROMPTS][:6]
    lengths = [3, 30, 9, 30, 5, 30]  # slots 0, 2 and 4 retire first, at different steps
    params = [SamplingParams(max_new_tokens=n, ignore_eos=True) for n in lengths]
    alone = [run_all(make_engine(model_dir), [p], n)[0] for p, n in zip(prompts, lengths)]
    eng = make_engine(model_dir)
    moves = []
    real_move = eng.runner.move_slot
    eng.runner.move_slot = lambda src, dst, n: (moves.append((src, dst)), real_move(src, dst, n))
    together = run_all(eng, prompts, 0, params=params)
    assert together == alone
    assert all(len(o) == n for o, n in zip(together, lengths))
    # slot 0 finishes first (n=5): slot 5 fills it; slot 4 next (n=4): nothing above it, no copy; slot 2
    # last (n=3): slot 3 fills it. Shifting down instead made 8 copies.
    assert moves == [(5, 0), (3, 2)]


def test_hidden_state_capture_is_the_residual_entering_each_layer(model_dir, tok, hf_fp32):
    from kimi_perf.engines.reference.model import CaptureSpec, LlamaRunner

    ids = chat_ids(tok, PROMPTS[0])
    r = LlamaRunner.from_pretrained(model_dir, dtype=torch.float32, max_slots=1, max_len=256)
    out = r.forward(0, torch.tensor([ids]), [0], [len(ids)], capture=CaptureSpec(layers=(0, 2, 15, 30), final_norm=True),
                    logits="none")
    with torch.no_grad():
        hf = hf_fp32(torch.tensor([ids]), output_hidden_states=True).hidden_states
    for k in (0, 2, 15):
        torch.testing.assert_close(out.hidden[k][0], hf[k][0], rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(out.hidden["final"][0], hf[30][0], rtol=1e-4, atol=1e-4)  # HF's last = post-norm
    assert not torch.allclose(out.hidden[30][0], hf[30][0], atol=1e-2)  # pre-norm differs (norm weights != 1)


def test_detokenizer_streams_the_same_text(model_dir, tok):
    from kimi_perf.engines.reference.detok import IncrementalDetokenizer

    ids = tok("Héllo wörld — 漢字 and emoji 🎉 done.")["input_ids"]
    d = IncrementalDetokenizer(tok.backend_tokenizer, len(tok))
    text = "".join(d.add([i]) for i in ids) + d.flush()
    assert text == tok.decode(ids, skip_special_tokens=True)


def test_padded_bucket_and_wider_window_give_the_same_logits(model_dir, tok):
    """What a CUDA graph replays: the batch padded to a bucket with n_t = 0 rows and a key window wider
    than the longest sequence. Checked eagerly (runs anywhere) against the exact-shape forward."""
    from kimi_perf.engines.reference.model import CaptureSpec, LlamaRunner, slot_batch_from_tensors

    r = LlamaRunner.from_pretrained(model_dir, dtype=torch.float32, max_slots=8, max_len=256)
    prompts = [chat_ids(tok, p) for p in PROMPTS[:3]]
    for i, p in enumerate(prompts):  # prefill each into its slot
        r.forward(i, torch.tensor([p]), [0], [len(p)], logits="none")
    lens = [len(p) for p in prompts]
    nxt = torch.tensor([[11], [12], [13]])
    for q, cap, mode in ((1, CaptureSpec(), "last"), (3, CaptureSpec(layers=(2, 15, 27)), "all")):
        toks = nxt.repeat(1, q)
        exact = r.forward(0, toks, lens, [q] * 3, capture=cap, logits=mode)
        exact = (exact.logits.clone(), {k: v.clone() for k, v in exact.hidden.items()})
        padded = torch.zeros(4, q, dtype=torch.long)
        padded[:3] = toks
        sb = slot_batch_from_tensors(0, torch.tensor(lens + [0]), torch.tensor([q, q, q, 0]), q, 256,
                                     max_len=r.max_len, cos_table=r.cos, sin_table=r.sin, kpos=r._kpos)
        with torch.inference_mode():
            out = r.forward_batch(padded, sb, capture=cap, logits=mode)
        torch.testing.assert_close(out.logits[:3], exact[0], rtol=1e-4, atol=1e-4)
        for k, v in exact[1].items():
            torch.testing.assert_close(out.hidden[k][:3], v, rtol=1e-4, atol=1e-4)


def test_bucket_tables():
    from kimi_perf.engines.reference.cuda_graphs import batch_buckets, window_buckets

    assert batch_buckets(1) == [1]
    assert batch_buckets(12) == [1, 2, 4, 8, 12]
    assert batch_buckets(128) == [1, 2, 4, 8, 16, 24, 32, 48, 64, 80, 96, 112, 128]
    assert window_buckets(1029) == [256, 512, 1024, 1029]
    assert window_buckets(200) == [200]


@pytest.mark.gpu
def test_cuda_graphs_give_the_eager_greedy_output(model_dir, tok):
    """Graph replay (bucketed, padded, windowed) must produce exactly the eager engine's tokens."""
    from kimi_perf.engines.reference.cuda_graphs import enable_cuda_graphs
    from kimi_perf.engines.reference.engine import Engine
    from kimi_perf.engines.reference.model import LlamaRunner

    prompts = [chat_ids(tok, p) for p in PROMPTS]
    outs = {}
    for graphs in (False, True):
        runner = LlamaRunner.from_pretrained(model_dir, device="cuda", dtype=torch.float32, max_slots=8, max_len=512)
        if graphs:
            gr = enable_cuda_graphs(runner, max_bs=8, q_lens=[1], log=lambda m: None)
        outs[graphs] = run_all(Engine(runner, eos_token_ids={2}, max_running=8), prompts, 40)
    assert gr.replays > 30 and gr.fallbacks == 0  # prefills are not fallbacks: they are never graphed
    assert outs[True] == outs[False]


def _run_params(engine, prompts, params):
    return run_all(engine, prompts, 0, params=params)


def test_seeded_sampling_is_reproducible_in_any_batch(model_dir, tok):
    from kimi_perf.engines.reference.engine import SamplingParams

    prompts = [chat_ids(tok, p) for p in PROMPTS[:4]]
    hot = SamplingParams(max_new_tokens=16, temperature=0.9, ignore_eos=True, seed=7)
    greedy = SamplingParams(max_new_tokens=16, ignore_eos=True)
    alone = _run_params(make_engine(model_dir), prompts[:1], [hot])[0]
    mixed = _run_params(make_engine(model_dir), prompts, [hot, greedy, SamplingParams(
        max_new_tokens=16, temperature=0.9, ignore_eos=True, seed=8), greedy])
    assert mixed[0] == alone  # same seed, same tokens, whatever else is in the batch
    assert mixed[2] != mixed[0] or prompts[2] != prompts[0]
    assert mixed[1] == _run_params(make_engine(model_dir), prompts[1:2], [greedy])[0]
    other_seed = _run_params(make_engine(model_dir), prompts[:1], [SamplingParams(
        max_new_tokens=16, temperature=0.9, ignore_eos=True, seed=8)])[0]
    assert other_seed != alone


def test_prefill_batching_policy(model_dir):
    import time as _time

    from kimi_perf.engines.reference.engine import SamplingParams, Sequence

    eng = make_engine(model_dir, prefill_wait_s=0.05)
    mk = lambda i: Sequence(rid=str(i), prompt=[1, 2, 3], params=SamplingParams())  # noqa: E731
    eng._waiting.append(mk(0))
    assert eng._prefill_due()  # nothing running: prefill at once
    eng.running = [mk(i) for i in range(1, 17)]  # 16 running: wait for 2 arrivals or 50 ms
    assert not eng._prefill_due()
    eng._waiting.append(mk(99))
    assert eng._prefill_due()
    eng._waiting.pop()
    eng._waiting[0].t_arrival = _time.monotonic() - 0.06
    assert eng._prefill_due()
    eng.running = eng.running[:7]  # <= 8 running: a single arrival is enough
    eng._waiting[0].t_arrival = _time.monotonic()
    assert eng._prefill_due()


def test_planted_slowdown_burns_that_fraction_of_each_decode_step(model_dir, tok, monkeypatch):
    """The gate's power is proven with this switch (python -m kimi_perf.power): 25% means every decode
    step burns a quarter of its own duration on the CPU, on top of it -- not a fixed sleep."""
    from kimi_perf.engines.reference.engine import PLANT_ENV

    prompts = [chat_ids(tok, PROMPTS[0])]
    plain = make_engine(model_dir)
    run_all(plain, prompts, 12)
    assert plain.stats.planted_s == 0
    monkeypatch.setenv(PLANT_ENV, "0.25")
    slow = make_engine(model_dir)
    run_all(slow, prompts, 12)
    st = slow.stats
    work = st.decode_s - st.planted_s
    # 11 decode steps after the prefill; each burns 25% of what the step took before the burn
    assert st.planted_s == pytest.approx(0.25 * work, rel=0.05), (st.planted_s, work)
    monkeypatch.setenv(PLANT_ENV, "-1")
    with pytest.raises(ValueError, match=PLANT_ENV):
        make_engine(model_dir)


class _OracleDrafter:
    """Proposes the plain greedy continuation itself, so every draft is accepted: acceptance is then
    decided by the engine's truncation alone (issue 16 item 9: count what is emitted)."""

    aux_layers = (1,)

    def __init__(self, continuation):
        self.cont = continuation  # {rid: plain greedy output}

    def propose(self, seqs, k):
        out = []
        for s in seqs:
            # s.next_token is output[-1], not yet fed; the drafts follow it
            nxt = self.cont[s.rid][len(s.output): len(s.output) + k]
            out.append(nxt + [0] * (k - len(nxt)))
        return out

    def move_slot(self, src, dst, length):
        pass


@pytest.mark.parametrize("max_new", [9, 10, 12])
def test_spec_counters_count_emitted_tokens_when_max_tokens_truncates(model_dir, tok, max_new):
    """k=3 and a drafter that is always right: each verify step emits 4 tokens (3 drafts + bonus)
    until max_tokens cuts the last step. The counters must give 1 + accepted / drafts = emitted tokens
    per verify step (the prefill's first token is no verify step), not the accepted prefix before the cut."""
    k = 3
    prompt = chat_ids(tok, PROMPTS[0])
    plain = run_all(make_engine(model_dir), [prompt], max_new + k + 1)[0]
    eng = make_engine(model_dir, drafter=_OracleDrafter({"0": plain}), spec_steps=k)
    out = run_all(eng, [prompt], max_new)[0]
    assert out == plain[:max_new]
    st = eng.stats
    verify_emitted = max_new - 1  # the prefill emitted the first token
    assert st.spec_drafts == -(-verify_emitted // (k + 1))  # ceil: the last step may be cut
    # 1 + accepted/drafts = emitted per verify step, i.e. every step emits its accepted drafts plus one
    assert st.spec_accepted_tokens == verify_emitted - st.spec_drafts
    assert st.window_tokens == verify_emitted
    assert st.spec_accepted_tokens <= st.spec_drafts * k
    # per position: a step that emitted e tokens accepted positions 0..e-2
    assert st.spec_accepted_per_pos[0] >= st.spec_accepted_per_pos[1] >= st.spec_accepted_per_pos[2]
    assert sum(st.spec_accepted_per_pos) == st.spec_accepted_tokens
