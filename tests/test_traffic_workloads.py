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
