"""The reference engine's HTTP server as clients see it: readiness, exact greedy output, batching,
SGLang/vLLM response shapes, and strict validation that never takes the server down."""

from __future__ import annotations

import asyncio
import json
import sys
import urllib.error
import urllib.request

import pytest
from engine_helpers import PROMPTS, chat_ids

torch = pytest.importorskip("torch")
pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def server(model_dir, tmp_path_factory):
    from kimi_perf.engines.base import ReferenceEngineConfig
    from kimi_perf.launcher import ServerProcess

    cfg = ReferenceEngineConfig(name="ref-fp32", model_path=str(model_dir), served_model_name="smol",
                                python=sys.executable, dtype="float32", device="cpu", context_length=512,
                                max_running_requests=16, disable_cuda_graph=True, return_hidden_states=True)
    proc = ServerProcess(cfg.launch_spec(tmp_path_factory.mktemp("logs")))
    proc._spawn(__import__("kimi_perf.launcher", fromlist=["free_port"]).free_port())
    seen = set()
    for _ in range(120):
        st = proc._probe()
        seen.add(st)
        if st == 200:
            break
        if st == 503:
            pass
        __import__("time").sleep(0.25)
    proc.seen_statuses = seen
    yield proc
    proc.stop()


def post(server, path, body, raw=False):
    data = body if raw else json.dumps(body).encode()
    req = urllib.request.Request(server.base_url + path, data=data, headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=300) as r:
            return r.status, r.read().decode()
    except urllib.error.HTTPError as e:
        return e.code, e.read().decode()


def get(server, path):
    with urllib.request.urlopen(server.base_url + path, timeout=30) as r:
        return r.status, r.read().decode()


def test_health_is_503_while_loading_then_200(server):
    assert 503 in server.seen_statuses and 200 in server.seen_statuses


def test_models_info_and_metrics(server):
    assert json.loads(get(server, "/v1/models")[1])["data"][0]["id"] == "smol"
    info = json.loads(get(server, "/server_info")[1])
    assert info["dtype"] == "float32" and info["version"] and "internal_states" in info
    text = get(server, "/metrics")[1]
    assert "kimi_ref:generation_tokens_total" in text and "kimi_ref:num_requests_running" in text


def stream(server, prompt_ids, max_tokens, **extra):
    body = {"prompt": prompt_ids, "max_tokens": max_tokens, "temperature": 0, "stream": True,
            "stream_options": {"include_usage": True}, **extra}
    st, text = post(server, "/v1/completions", body)
    assert st == 200, text
    events = [ln[6:] for ln in text.split("\n") if ln.startswith("data: ")]
    assert events[-1] == "[DONE]"
    chunks = [json.loads(e) for e in events[:-1]]
    usage = chunks[-1]["usage"]
    return "".join(c["choices"][0]["text"] for c in chunks if c["choices"]), usage


def test_greedy_through_server_equals_generate(server, tok, model_dir):
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32)
    for p in PROMPTS[:3]:
        ids = chat_ids(tok, p)
        ref = hf.generate(torch.tensor([ids]), attention_mask=torch.ones(1, len(ids), dtype=torch.long), max_new_tokens=32, do_sample=False, eos_token_id=None,
                          pad_token_id=2)[0, len(ids):].tolist()
        st, body = post(server, "/generate", {"input_ids": ids, "sampling_params": {
            "max_new_tokens": 32, "temperature": 0, "ignore_eos": True}})
        assert st == 200
        assert json.loads(body)["output_ids"] == ref
        text, usage = stream(server, ids, 32, ignore_eos=True)
        assert usage["completion_tokens"] == 32 and usage["prompt_tokens"] == len(ids)
        assert text == tok.decode(ref, skip_special_tokens=True)


def test_concurrent_requests_get_the_same_outputs(server, tok):
    import aiohttp

    ids = [chat_ids(tok, p) for p in PROMPTS]
    alone = [json.loads(post(server, "/generate", {"input_ids": i, "sampling_params": {
        "max_new_tokens": 16, "temperature": 0, "ignore_eos": True}})[1])["output_ids"] for i in ids]

    async def main():
        async with aiohttp.ClientSession() as s:
            async def one(i):
                async with s.post(server.base_url + "/generate", json={"input_ids": i, "sampling_params": {
                        "max_new_tokens": 16, "temperature": 0, "ignore_eos": True}}) as r:
                    return (await r.json())["output_ids"]
            return await asyncio.gather(*(one(i) for i in ids))

    assert asyncio.run(main()) == alone


def test_hidden_states_in_sglang_layout(server, tok):
    ids = chat_ids(tok, PROMPTS[1])
    st, body = post(server, "/generate", {"input_ids": ids, "return_hidden_states": True,
                                          "sampling_params": {"max_new_tokens": 6, "temperature": 0}})
    assert st == 200
    meta = json.loads(body)["meta_info"]
    hs = meta["hidden_states"]
    assert len(hs) == meta["completion_tokens"]  # prefill block + one row per fed-back token
    assert len(hs[0]) == len(ids) and len(hs[0][0]) == 576
    assert all(len(r) == 576 and isinstance(r[0], float) for r in hs[1:])


@pytest.mark.parametrize("body, needle", [
    (b"{not json", "not valid JSON"),
    (b"[1, 2]", "must be a JSON object"),
    ({"prompt": "hi", "max_token": 3}, "unknown field 'max_token'"),
    ({"prompt": "hi", "max_tokens": -1}, "max_tokens must be >= 1"),
    ({"prompt": "hi", "max_tokens": 10**9}, "maximum context length is 512"),
    ({"prompt": "hi", "max_tokens": "3"}, "must be integer"),
    ({"prompt": "hi", "max_tokens": True}, "must be integer"),
    ({"prompt": [1, 2, 10**7], "max_tokens": 2}, "outside the vocabulary"),
    ({"prompt": [], "max_tokens": 2}, "empty"),
    ({"prompt": "word " * 600, "max_tokens": 2}, "context length is 512"),
    ({"max_tokens": 2}, "missing required field 'prompt'"),
    ({"prompt": "hi", "stream_options": {"include_usage": True}}, "only allowed when stream is true"),
    ({"prompt": "hi", "n": 2}, "n > 1"),
    ({"prompt": "hi", "model": "gpt-4"}, "does not exist"),
])
def test_bad_input_is_400_and_server_keeps_serving(server, body, needle):
    st, text = post(server, "/v1/completions", body, raw=isinstance(body, bytes))
    assert st in (400, 404), text
    err = json.loads(text)["error"]
    assert needle in err["message"], err
    ok, _ = post(server, "/v1/completions", {"prompt": "hi", "max_tokens": 1})
    assert ok == 200


def test_generate_validation(server):
    st, text = post(server, "/generate", {"text": "hi", "sampling_params": {"max_new_tokenz": 2}})
    assert st == 400 and "max_new_tokenz" in text
    st, text = post(server, "/generate", {"text": "hi", "input_ids": [1]})
    assert st == 400 and "exactly one" in text


def test_bounded_load_every_request_answered(server):
    import aiohttp

    async def main():
        async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0)) as s:
            sem = asyncio.Semaphore(64)

            async def one(i):
                async with sem, s.post(server.base_url + "/v1/completions",
                                       json={"prompt": [10 + i % 50] * (4 + i % 7), "max_tokens": 2,
                                             "temperature": 0, "ignore_eos": True}) as r:
                    return r.status, (await r.json())["usage"]["completion_tokens"]

            return await asyncio.gather(*(one(i) for i in range(256)))

    res = asyncio.run(main())
    assert res == [(200, 2)] * 256


def test_client_disconnect_frees_the_slot(server):
    import aiohttp

    async def main():
        async with aiohttp.ClientSession() as s, s.post(server.base_url + "/v1/completions", json={
                "prompt": [11] * 8, "max_tokens": 400, "temperature": 0, "ignore_eos": True, "stream": True}) as r:
            await r.content.readline()  # first chunk, then walk away
    asyncio.run(main())
    import time

    for _ in range(40):
        m = get(server, "/metrics")[1]
        if "kimi_ref:requests_aborted_total" in m and 'requests_aborted_total{engine="0",model_name="smol"} 0.0' not in m:
            break
        time.sleep(0.25)
    running = [ln for ln in m.splitlines() if ln.startswith("kimi_ref:num_requests_running")]
    assert running and running[0].endswith(" 0.0"), running
