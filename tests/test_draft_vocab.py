"""Draft-vocabulary coverage (kimi_perf.eagle3.vocab.coverage_table): the ceiling a vocabulary built from
the training data puts on acceptance of held-out tokens, and the CLI that prints it for stored samples."""

from __future__ import annotations

import json

import numpy as np
from hypothesis import given
from hypothesis import strategies as st

from kimi_perf.eagle3.vocab import count_tokens, coverage_table, main


def _counts(tokens, vocab=100):
    return count_tokens([(tokens, [1] * len(tokens))], vocab)


@given(st.lists(st.integers(0, 99), min_size=1, max_size=300), st.lists(st.integers(0, 99), min_size=1, max_size=300))
def test_coverage_grows_with_size_and_is_complete_at_the_whole_vocabulary(train, held):
    rows = coverage_table(_counts(train), _counts(held), [1, 5, 20, 100, 500])
    assert [r["size"] for r in rows] == [1, 5, 20, 100]  # capped at the vocabulary, each size once
    for key in ("train_coverage", "heldout_coverage"):
        vals = [r[key] for r in rows]
        assert vals == sorted(vals) and all(0.0 <= v <= 1.0 for v in vals)
        assert vals[-1] == 1.0


def test_held_out_tokens_unseen_in_training_are_what_a_small_vocabulary_misses():
    """Training covers ids 0-9 only; the held-out text uses 0-9 half the time and unseen high ids the
    rest: a 10-token vocabulary covers all training tokens but only half the held-out ones."""
    train = _counts(list(range(10)) * 5)
    held = _counts(list(range(10)) + list(range(90, 100)))
    row = coverage_table(train, held, [10])[0]
    assert row["train_coverage"] == 1.0 and row["heldout_coverage"] == 0.5
    assert coverage_table(train, np.zeros(100, dtype=np.int64), [10])[0]["heldout_coverage"] is None


def test_cli_prints_the_table_for_stored_samples(tmp_path, capsys):
    rows = [{"id": f"s{i}", "source": "t", "split": "train" if i < 3 else "heldout", "prompt_ids": [1, 2],
             "response_ids": [5, 6, 7] if i < 3 else [5, 40]} for i in range(4)]
    path = tmp_path / "samples.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    assert main([str(path), "--sizes", "3", "--vocab-size", "64"]) == 0
    out = capsys.readouterr().out
    assert "3 distinct training assistant tokens" in out and "| 3 | 100.0% | 50.0% |" in out


def test_heldout_coverage_keeps_evaluation_only_sources_apart():
    """Code prompts (an evaluation-only source) get their own coverage rows and leave the chat number
    alone: here the chat answers use only trained tokens and the code answer only an untrained one."""
    from kimi_perf.eagle3.data import Sample
    from kimi_perf.eagle3.pipeline import heldout_coverage

    counts = np.zeros(10, dtype=np.int64)
    counts[[1, 2]] = [5, 3]
    chat = Sample("mtbench-1-t1", "mtbench", "heldout", [0], [1, 2, 1])
    code = Sample("humaneval-0-t1", "humaneval", "heldout", [0], [9, 9])
    by_size, by_source = heldout_coverage(counts, [chat, code], [2])
    assert by_size[0]["heldout_coverage"] == 1.0 and by_size[0]["heldout_tokens"] == 3
    assert list(by_source) == ["humaneval"] and by_source["humaneval"][0]["heldout_coverage"] == 0.0
    assert heldout_coverage(counts, [chat], [2])[1] == {}  # no code prompts: no extra rows
