"""Run history: lines appended per run, series per key and metric, and change points named by commit."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np

from kimi_perf.history import (
    _cli,
    append_history,
    change_points,
    history_lines,
    load_series,
    planted_slowdown,
)

KEY = {"scenario": "single_stream", "engine": "reference", "model": "m", "hardware": "cpu-x86_64-2c",
       "workload": "w-1", "concurrency": 1}


def _record(v: float) -> dict:
    return {"nodeid": "perf_tests/test_throughput.py::test_single_stream_decode[reference]", "key": KEY,
            "engine_version": "0.1.0", "samples": {"decode_tok_s": [v * 0.99, v, v * 1.01]},
            "decisions": [{"metric": "decode_tok_s", "verdict": "PASS"}], "outcome": "passed"}


def _ab_record(ratio: float) -> dict:
    return {"nodeid": "perf_tests/test_ab.py::test_ab_throughput[reference]", "key": {**KEY, "scenario": "ab_throughput"},
            "samples": {}, "decisions": [],
            "ab": {"base": "git:HEAD~1", "blocks": 3, "versions": {"base": "0.1.0"},
                   "decisions": [{"probe": "single_stream", "metric": "decode_tok_s", "ratio": ratio, "verdict": "PASS"}]}}


def test_a_step_in_the_history_is_found_at_the_commit_that_made_it(tmp_path, capsys):
    path = tmp_path / "embedded-cpu.jsonl"
    rng = np.random.default_rng(1)
    for i in range(30):
        level = 18.0 if i < 18 else 14.0  # commit c18 made single-stream decode 22% slower
        commit = {"id": f"c{i:02d}" + "0" * 38, "dirty": False, "subject": f"change {i}"}
        lines = history_lines([_record(level * (1 + 0.02 * rng.standard_normal())), _ab_record(1.0)],
                              profile="embedded-cpu", hardware="cpu-x86_64-2c", commit=commit,
                              machine={"node": "box", "cpu": "x86", "gpus": []})
        append_history(path, lines)
    raw = [json.loads(ln) for ln in path.read_text().splitlines()]
    assert len(raw) == 60 and raw[0]["commit"].startswith("c00") and raw[0]["medians"]["decode_tok_s"] > 15
    assert raw[1]["ab"]["ratios"] == {"single_stream:decode_tok_s": 1.0}
    series = {s.name: s for s in load_series(path)}
    decode = next(s for n, s in series.items() if n.endswith("decode_tok_s"))
    cps = change_points(decode)
    assert len(cps) == 1 and cps[0].at.commit.startswith("c18") and cps[0].change < -0.15
    assert _cli(["embedded-cpu", "--dir", str(tmp_path), "--metric", "decode_tok_s"]) == 0
    out = capsys.readouterr().out
    assert "at run 19/30: commit c180000000 change 18" in out and "mean 18.0" in out and "(-23." in out


def test_a_flat_history_has_no_change_point_and_short_series_are_skipped(tmp_path):
    path = tmp_path / "p.jsonl"
    rng = np.random.default_rng(2)
    for i in range(20):
        append_history(path, history_lines([_record(18 * (1 + 0.02 * rng.standard_normal()))], profile="p",
                                           hardware="h", commit={"id": f"{i:040d}"}, machine={}))
    (s,) = load_series(path)
    assert change_points(s) == []
    assert change_points(type(s)(s.name, s.points[:4])) == []


def test_a_planted_step_is_stamped_and_named_as_planted_not_as_the_commits(tmp_path, capsys):
    """A power experiment's planted slowdown lands in the same history as real runs; the change point
    it makes must say it was planted, or a later reader blames the commit it ran on."""
    path = tmp_path / "embedded-cpu.jsonl"
    rng = np.random.default_rng(3)
    commit = {"id": "d" * 40, "dirty": False, "subject": "one commit, measured 16 times"}
    for i in range(16):
        env = {"KIMI_PERF_PLANT_SLOWDOWN": "0.3"} if i >= 8 else {}
        level = 18.0 / (1.3 if i >= 8 else 1.0)
        append_history(path, history_lines([_record(level * (1 + 0.02 * rng.standard_normal()))],
                                           profile="embedded-cpu", hardware="cpu-x86_64-2c", commit=commit,
                                           machine={"node": "box"}, env=env))
    raw = [json.loads(ln) for ln in path.read_text().splitlines()]
    assert [r["planted_slowdown"] for r in raw] == [None] * 8 + [0.3] * 8
    assert _cli(["embedded-cpu", "--dir", str(tmp_path), "--metric", "decode_tok_s"]) == 0
    out = capsys.readouterr().out
    assert "at run 9/16" in out and "PLANTED slowdown 0.3 in that run, not the commit's" in out
    # a malformed switch is not a planted slowdown, and zero is none
    assert planted_slowdown({"KIMI_PERF_PLANT_SLOWDOWN": "x"}) is None
    assert planted_slowdown({"KIMI_PERF_PLANT_SLOWDOWN": "0"}) is None


def test_history_goes_under_the_report_dir_unless_a_path_is_named(tmp_path):
    from kimi_perf.history import history_file

    kw = {"rootdir": tmp_path, "report_dir": tmp_path / "perf-report", "profile": "p"}
    assert history_file("", **kw) == tmp_path / "perf-report" / "history" / "p.jsonl"
    assert history_file("  ", **kw) == tmp_path / "perf-report" / "history" / "p.jsonl"
    assert history_file("off", **kw) is None and history_file("OFF", **kw) is None
    assert history_file("kept/hist", **kw) == tmp_path / "kept" / "hist" / "p.jsonl"
    assert history_file("/var/h", **kw) == Path("/var/h/p.jsonl")


def test_the_tracked_history_is_still_read_with_the_new_one_in_time_order(tmp_path, monkeypatch, capsys):
    """Runs before the move appended to baselines/history/; runs after to perf-report/history/. The CLI's
    default reads both, merged by time, and a line copied from one into the other counts once."""
    monkeypatch.chdir(tmp_path)
    old, new = tmp_path / "baselines" / "history" / "p.jsonl", tmp_path / "perf-report" / "history" / "p.jsonl"
    rng = np.random.default_rng(4)
    lines = []
    for i in range(20):
        ln = history_lines([_record((18.0 if i < 12 else 14.0) * (1 + 0.02 * rng.standard_normal()))], profile="p",
                           hardware="h", commit={"id": f"c{i:02d}" + "0" * 38}, machine={})[0]
        lines.append({**ln, "time": f"2026-01-{i + 1:02d}T00:00:00Z"})
    append_history(new, lines[10:])  # the new directory first on disk, but later in time
    append_history(old, lines[:10])
    append_history(new, lines[9:10])  # one old line copied over
    (s,) = load_series([new, old])
    assert [p.commit[:3] for p in s.points] == [f"c{i:02d}" for i in range(20)]
    assert _cli(["p", "--metric", "decode_tok_s"]) == 0
    out = capsys.readouterr().out
    assert "perf-report/history/p.jsonl + baselines/history/p.jsonl: 1 series" in out
    assert "20 runs" in out and "commit c120000000" in out
