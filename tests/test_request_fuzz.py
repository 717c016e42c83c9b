"""Hypothesis fuzz of the reference server's request parsing: any JSON body, made of the real field
names and hostile values (NaN, Infinity, 2**70, bools, nested junk), is either a ParsedRequest the
engine can run or a BadRequest (HTTP 400) -- never another exception (HTTP 500)."""

from __future__ import annotations

import math

from hypothesis import given, settings
from hypothesis import strategies as st

from kimi_perf.engines.reference import protocol as pr

VOCAB = 1000
# text with lone surrogates too: JSON can carry "\ud800", which no UTF-8 tokenizer takes
texts = st.text(max_size=8) | st.text(st.characters(codec=None, categories=["Cs", "Ll"]), min_size=1, max_size=4)
scalars = (st.none() | st.booleans() | st.integers(-(2**70), 2**70) | st.integers(-3, 40)
           | st.floats(allow_nan=True, allow_infinity=True) | texts)
values = st.recursive(scalars, lambda inner: st.lists(inner, max_size=4)
                      | st.dictionaries(st.text(max_size=6), inner, max_size=3), max_leaves=12)


RANGED = {"max_tokens", "max_completion_tokens", "max_new_tokens", "min_tokens", "min_new_tokens", "temperature",
          "seed", "sampling_seed", "ignore_eos", "stream"}


def body_of(fields: dict, base: dict) -> st.SearchStrategy[dict]:
    """A valid ``base`` with fuzzed fields laid over it (mostly the schema's names, some junk names),
    so most bodies get past the first check and reach the value checks behind it."""
    names = sorted(fields)
    # numbers dominate: most sampling fields are numbers, so a field usually passes its type check
    # and its value goes on to the range checks, where NaN, Infinity and 2**70 live
    # Hypothesis rarely draws large magnitudes from a wide integer range: the edges are named
    edges = st.sampled_from([-1, 2**31, 2**63 - 1, 2**63, 2**64, 2**70, -(2**70)])
    numbers = st.integers(-3, 40) | edges | st.floats(allow_nan=True, allow_infinity=True)
    # the fields whose values reach the engine are named most; every other schema field too
    ranged = st.sampled_from([n for n in names if n in RANGED])
    over = st.dictionaries(ranged | ranged | st.sampled_from(names), numbers | st.booleans() | values, max_size=3)
    junk = st.dictionaries(st.text(max_size=6), values, max_size=1)
    return st.one_of(over, over, over, junk).map(lambda o: {**base, **o})


def check(parsed: pr.ParsedRequest) -> None:
    """What the engine assumes of every request it is handed."""
    assert isinstance(parsed.max_tokens, int) and parsed.max_tokens >= 1
    assert isinstance(parsed.min_tokens, int) and 0 <= parsed.min_tokens <= parsed.max_tokens
    assert math.isfinite(parsed.temperature) and parsed.temperature >= 0
    assert parsed.seed is None or (type(parsed.seed) is int and 0 <= parsed.seed < 2**63)
    assert parsed.prompt_ids is None or all(type(t) is int and 0 <= t < VOCAB for t in parsed.prompt_ids)
    assert (parsed.prompt_ids is not None) or (parsed.prompt_text is not None) or (parsed.messages is not None)
    for t in [parsed.prompt_text or "", *(m["content"] for m in parsed.messages or [])]:
        t.encode("utf-8")  # what the tokenizer needs


def parse_or_400(fn, body):
    try:
        out = fn(body, vocab_size=VOCAB)
    except pr.BadRequest as e:
        assert str(e)  # a 400 names its problem
        return
    for p in out if isinstance(out, list) else [out]:
        check(p)


@given(body_of(pr._COMPLETION, {"prompt": [1, 2]}))
@settings(max_examples=400, deadline=None)
def test_completions_parse_or_400(body):
    parse_or_400(pr.parse_completion, body)


@given(body_of(pr._CHAT, {"messages": [{"role": "user", "content": "hi"}]}))
@settings(max_examples=300, deadline=None)
def test_chat_parse_or_400(body):
    parse_or_400(pr.parse_chat, body)


@given(body_of(pr._GENERATE, {"input_ids": [3]}), body_of(pr._SAMPLING, {}))
@settings(max_examples=300, deadline=None)
def test_generate_parse_or_400(body, sp):
    if "sampling_params" in body:
        body["sampling_params"] = sp
    parse_or_400(pr.parse_generate, body)


# the hostile values of issue 26 that came back as 200 or 500, as plain cases next to the fuzz
@given(st.sampled_from([
    {"prompt": [1], "seed": 2**70}, {"prompt": [1], "seed": -1}, {"prompt": [1], "temperature": math.nan},
    {"prompt": [1], "temperature": math.inf}, {"prompt": [1], "max_tokens": 4, "min_tokens": 5},
    {"prompt": "a\ud800"},
]))
def test_issue26_values_are_400(body):
    try:
        pr.parse_completion(body, vocab_size=VOCAB)
    except pr.BadRequest as e:
        assert e.param in body
    else:
        raise AssertionError(f"{body} accepted")
