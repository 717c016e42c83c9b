"""The traffic datasets of the prompt factory: shared-prefix prompts and ShareGPT V3 conversations
replayed turn by turn (kimi_perf.load.prompts), and the workload fields they add."""

from __future__ import annotations

import pytest

from kimi_perf.data import Conversation
from kimi_perf.load.prompts import PromptFactory
from kimi_perf.load.workload import Workload


@pytest.fixture(scope="module")
def factory():
    from kimi_perf.models.embedded import ensure_embedded_model

    try:
        return PromptFactory(ensure_embedded_model().path)
    except FileNotFoundError as e:
        pytest.skip(f"embedded model not set up: {e}")


def test_shared_prefix_prompts_share_exactly_their_prefix(factory):
    w = Workload(name="p", dataset="shared-prefix", input_len=64, prefix_len=48, num_prompts=5)
    ps = factory(w, 0)
    assert all(len(p) == 64 for p in ps) and len({tuple(p[:48]) for p in ps}) == 1
    assert len({tuple(p[48:]) for p in ps}) == 5  # the tails are the prompts' own
    assert factory(w, 1)[0][:48] != ps[0][:48]  # another repeat, another prefix: no cache carried over
    with pytest.raises(ValueError, match="prefix_len"):
        Workload(name="p", dataset="shared-prefix", input_len=64, prefix_len=64)
    with pytest.raises(ValueError, match="only the shared-prefix dataset"):
        Workload(name="p", prefix_len=8)
    assert Workload(name="w").key == "w-18fa23f9"  # keys stored before prefix_len existed are unchanged


def test_multiturn_replays_whole_conversations_with_their_history(factory, monkeypatch):
    import kimi_perf.data as data

    convs = [Conversation("a", "sharegpt-v3", "chat", ("What is 2+2?", "And 3+3?", "x " * 400), ("4", "6")),
             Conversation("b", "sharegpt-v3", "chat", ("Name a colour.",), ())]
    monkeypatch.setattr(data, "load_sharegpt_v3", lambda: convs)
    w = Workload(name="m", dataset="sharegpt-multiturn", input_len=128, num_prompts=3)
    ps = factory(w, 0)
    assert len(ps) == 3
    turns_a = factory.conversation_turns(128)[0]
    assert len(turns_a) == 2  # the third turn does not fit 128 tokens: the conversation ends there
    # turn 2 carries turn 1 and its recorded answer: it starts with turn 1's prompt minus the generation
    # prompt, so it shares that prefix
    head = turns_a[0][:-3]
    assert turns_a[1][: len(head)] == head and len(turns_a[1]) > len(turns_a[0])
    assert factory.tokenizer.decode(turns_a[1]).count("4") >= 1
    a_at = [i for i, p in enumerate(ps) if p in turns_a]
    assert a_at == sorted(a_at)  # a conversation's turns come in order


def test_output_len_range_ratio_draws_seeded_lengths_around_output_len_and_keys_the_workload():
    """Staggered request ends (vLLM's --random-range-ratio on outputs): deterministic per seed, so
    both sides of an A/B pair ask for the same lengths, uniform on [L(1-r), L(1+r)], mean ~L."""
    from kimi_perf.load.workload import Workload

    fixed = Workload(name="w", output_len=64, num_prompts=384)
    assert fixed.output_lens(5) == [64] * 5
    w = Workload(name="w", output_len=64, num_prompts=384, output_len_range_ratio=0.5)
    lens = w.output_lens(384)
    assert lens == w.output_lens(384) and min(lens) >= 32 and max(lens) <= 96
    assert min(lens) <= 36 and max(lens) >= 92 and abs(sum(lens) / len(lens) - 64) < 3
    assert Workload(name="w", output_len=64, seed=1, output_len_range_ratio=0.5).output_lens(50) != lens[:50]
    # the key of a fixed-length workload is what it was before the field existed; a ratio changes it
    assert fixed.key == Workload(name="w", output_len=64, num_prompts=384, output_len_range_ratio=0.0).key
    assert w.key != fixed.key
    with pytest.raises(ValueError, match="output_len_range_ratio=1.0"):
        Workload(name="w", output_len_range_ratio=1.0)


def test_the_client_asks_each_request_for_its_own_length(tmp_path):
    """The server's usage counts come back equal to the drawn lengths: max_tokens went per request."""
    import sys
    from pathlib import Path

    from kimi_perf.launcher import LaunchSpec, ServerProcess
    from kimi_perf.load.client import run_workload
    from kimi_perf.load.workload import Workload

    fake = str(Path(__file__).with_name("fake_server.py"))
    spec = LaunchSpec(name="paced", argv_for_port=lambda p: [sys.executable, fake, str(p), "paced"],
                      log_dir=tmp_path, ready_timeout_s=20, env={"FAKE_TOKEN_MS": "1"})
    w = Workload(name="spread", input_len=1, output_len=20, num_prompts=6, concurrency=3, warmup=0,
                 output_len_range_ratio=0.5)
    with ServerProcess(spec) as srv:
        res = run_workload(srv.base_url, "m", [[1]] * 6, w)
    assert res.metrics["error_rate"] == 0
    assert [r.completion_tokens for r in res.records] == [r.max_tokens for r in res.records] == w.output_lens(6)
    assert len(set(w.output_lens(6))) > 1
