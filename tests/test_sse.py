"""SSE parsing: events split anywhere, CRLF, comments, multi-line data, truncation."""

from __future__ import annotations

import json

from hypothesis import given, settings
from hypothesis import strategies as st

from kimi_perf.load.sse import SSEParser

text = st.text(alphabet=st.characters(blacklist_categories=("Cs",), blacklist_characters="\r\n"), max_size=40)


def encode(payloads, crlf=False):
    nl = "\r\n" if crlf else "\n"
    return "".join(f"data: {p}{nl}{nl}" for p in payloads).encode()


@settings(max_examples=300, deadline=None)
@given(payloads=st.lists(text.filter(lambda s: s != ""), min_size=1, max_size=20), crlf=st.booleans(),
       cuts=st.lists(st.integers(0, 10_000), max_size=30))
def test_any_chunking_gives_the_same_events(payloads, crlf, cuts):
    raw = encode(payloads, crlf)
    points = sorted({c % (len(raw) + 1) for c in cuts})
    parser = SSEParser()
    got = []
    prev = 0
    for p in [*points, len(raw)]:
        got += parser.feed(raw[prev:p])
        prev = p
    assert got == payloads
    assert not parser.pending


def test_multiline_data_comments_and_other_fields():
    p = SSEParser()
    out = p.feed(b": keep-alive\n\nevent: message\nid: 7\ndata: a\ndata: b\n\nretry: 10\n\n")
    assert out == ["a\nb"]


def test_utf8_split_inside_a_character():
    raw = 'data: {"t": "é漢"}\n\n'.encode()
    p = SSEParser()
    got = []
    for i in range(len(raw)):
        got += p.feed(raw[i : i + 1])
    assert json.loads(got[0])["t"] == "é漢"


def test_truncated_stream_is_pending():
    p = SSEParser()
    assert p.feed(b"data: [DONE]\n\ndata: {\"x\"") == ["[DONE]"]
    assert p.pending


def test_done_and_json_events():
    p = SSEParser()
    evs = p.feed(b'data: {"choices":[{"text":"hi"}]}\n\ndata: [DONE]\n\n')
    assert json.loads(evs[0])["choices"][0]["text"] == "hi" and evs[1] == "[DONE]"


@settings(max_examples=200, deadline=None)
@given(st.binary(max_size=2000))
def test_fuzz_never_crashes(data):
    p = SSEParser()
    for i in range(0, len(data), 7):
        for ev in p.feed(data[i : i + 7]):
            assert isinstance(ev, str)
