"""The SGLang adapter against recorded-shape SGLang 0.5.17 responses (tests/data/sglang_0_5_17, whose
README names the SGLang function that builds each one): /flush_cache refusals and retries, the
per-request acceptance read from /generate meta_info, hidden-state rows while serving EAGLE-3, and the
per-release flag tables. No GPU and no SGLang install: in-process HTTP servers answer as SGLang does.
"""

from __future__ import annotations

import json
import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any
from urllib.parse import parse_qs, urlparse

import numpy as np
import pytest

from kimi_perf.alignment.extract import parse_sglang_hidden_states, server_hidden_states, server_layers
from kimi_perf.eagle3.evaluate import FlushError, flush_cache, measure_generation, sglang_acceptance
from kimi_perf.engines.base import SpecConfig
from kimi_perf.engines.registry import EngineConfigError, build_engine_config
from kimi_perf.engines.sglang import (
    SGLangConfig,
    SGLangFlagError,
    check_sglang_flags,
    parse_generate_response,
)

DATA = Path(__file__).resolve().parent / "data" / "sglang_0_5_17"


def fixture(name: str) -> Any:
    return json.loads((DATA / name).read_text())


Handler = Callable[[BaseHTTPRequestHandler, str, dict[str, list[str]], bytes], tuple[int, str, str]]


@contextmanager
def serve(handle: Handler) -> Iterator[str]:
    """A loopback HTTP server in a thread; ``handle(request, path, query, body)`` -> (status, type, body)."""

    class H(BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"

        def log_message(self, *a: Any) -> None:
            pass

        def _any(self) -> None:
            u = urlparse(self.path)
            body = self.rfile.read(int(self.headers.get("Content-Length", 0) or 0))
            status, ctype, text = handle(self, u.path, parse_qs(u.query), body)
            data = text.encode()
            self.send_response(status)
            self.send_header("Content-Type", ctype)
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)

        do_GET = do_POST = _any

    srv = ThreadingHTTPServer(("127.0.0.1", 0), H)
    t = threading.Thread(target=srv.serve_forever, daemon=True)
    t.start()
    try:
        yield f"http://127.0.0.1:{srv.server_address[1]}"
    finally:
        srv.shutdown()
        srv.server_close()


# -- item 1: /flush_cache ------------------------------------------------------------------------------

FLUSH = fixture("flush_cache_answers.json")


def test_flush_waits_for_idle_and_retries_until_the_server_flushes():
    answers = [FLUSH["busy"], FLUSH["in_progress"], FLUSH["ok"]]
    seen: list[dict[str, list[str]]] = []

    def handle(_r, path, q, _b):
        assert path == "/flush_cache"
        seen.append(q)
        a = answers[min(len(seen) - 1, len(answers) - 1)]
        return a["status"], "text/plain", a["body"]

    with serve(handle) as url:
        out = flush_cache(url, deadline_s=10, server_wait_s=5, first_backoff_s=0.01)
    assert out.flushed and out.status == 200 and out.attempts == 3
    # every attempt asks SGLang to defer the flush until idle instead of refusing at once
    assert all(float(q["timeout"][0]) > 0 for q in seen)


def test_flush_that_keeps_being_refused_fails_with_the_servers_answer():
    def handle(_r, _p, _q, _b):
        return FLUSH["timed_out"]["status"], "text/plain", FLUSH["timed_out"]["body"]

    with serve(handle) as url, pytest.raises(FlushError) as ei:
        flush_cache(url, deadline_s=0.3, server_wait_s=0.1, first_backoff_s=0.02)
    msg = str(ei.value)
    assert "HTTP 400" in msg and "Timed out waiting for idle state." in msg
    assert "still sending requests" in msg  # names what to look at


def test_flush_absent_endpoint_is_not_an_error_and_a_dead_server_is():
    with serve(lambda *_: (404, "application/json", '{"detail":"Not Found"}')) as url:
        out = flush_cache(url, deadline_s=1)
    assert not out.flushed and out.status == 404 and out.attempts == 1  # vLLM: counters are differenced
    with pytest.raises(FlushError, match="is the server running"):
        flush_cache(url, deadline_s=1)  # the server above is gone now


# -- item 7: acceptance from /generate meta_info -------------------------------------------------------

def _completion_sse(max_tokens: int) -> str:
    chunk = json.dumps({"id": "x", "object": "text_completion", "created": 0, "model": "m",
                        "choices": [{"index": 0, "text": " tok", "logprobs": None, "finish_reason": None}]})
    usage = json.dumps({"choices": [], "usage": {"prompt_tokens": 5, "completion_tokens": max_tokens,
                                                 "total_tokens": max_tokens + 5}})
    return f"data: {chunk}\n\n" * max_tokens + f"data: {usage}\n\ndata: [DONE]\n\n"


class FakeSGLang:
    """Answers like sglang 0.5.17 serving EAGLE-3: /server_info, /flush_cache, /metrics (SGLang's own
    names, no vllm:spec_decode_*), streaming /v1/completions and non-streaming /generate, whose
    response is picked by the prompt's first token (an index into ``generate``)."""

    def __init__(self, generate: list[dict[str, Any]], info: dict[str, Any] | None = None) -> None:
        self.generate = generate
        self.info = info or fixture("server_info_eagle3.json")
        self.calls: list[str] = []

    def __call__(self, _r, path, _q, body):
        self.calls.append(path)
        req = json.loads(body or b"{}")
        if path == "/server_info":
            return 200, "application/json", json.dumps(self.info)
        if path == "/flush_cache":
            return 200, "text/plain", FLUSH["ok"]["body"]
        if path == "/metrics":
            return 200, "text/plain", "# TYPE sglang:num_running_reqs gauge\nsglang:num_running_reqs 0.0\n"
        if path == "/v1/completions":
            n = self.generate[req["prompt"][0]]["meta_info"]["completion_tokens"]
            return 200, "text/event-stream", _completion_sse(n)
        if path == "/generate":
            return 200, "application/json", json.dumps(self.generate[req["input_ids"][0]])
        return 404, "application/json", '{"detail":"Not Found"}'


def test_sglang_acceptance_from_generate_meta_info():
    gen = fixture("generate_eagle3_responses.json")
    fake = FakeSGLang(gen)
    with serve(fake) as url:
        res = measure_generation(url, "model", [[0, 5, 6], [1, 5], [2, 7]], 16, name="t")
    # flush, timed streaming pass, flush, /generate acceptance pass
    assert fake.calls.count("/flush_cache") == 2 and fake.calls.count("/generate") == 3
    assert res.source == "sglang-meta_info" and res.completion_tokens == 28
    c = res.counters
    assert c is not None and (c.drafts, c.draft_tokens, c.accepted) == (13, 39, 12)
    assert res.accept_length == pytest.approx(1 + 12 / 13)  # the counters' definition, as on vLLM
    assert res.accept_rate == pytest.approx(12 / 39)
    # summed histogram [5, 5, 2, 1]: a draft at position i is accepted when a step took more than i
    assert res.pos_rates() == pytest.approx([8 / 13, 3 / 13, 1 / 13])
    sg = res.extra["sglang"]
    assert sg["accept_length_sglang_definition"] == pytest.approx(28 / 13)  # completion / verify
    assert sg["requests_without_spec_fields"] == 1  # the EOS-on-prefill request
    assert res.server_accept_length == 1.9 and sg["server_info_window_accept_length"] == 1.9
    assert sg["server_info_window_vs_per_request"] == pytest.approx(1.9 - (1 + 12 / 13))
    assert sg["flush"]["flushed"] and res.extra["flush"]["flushed"]


def test_sglang_without_histogram_says_why_per_position_is_missing():
    gen = fixture("generate_eagle3_responses.json")
    for r in gen:
        for k in ("spec_correct_drafts_histogram", "spec_accept_histogram"):
            r["meta_info"].pop(k, None)
    with serve(FakeSGLang(gen)) as url:
        res = measure_generation(url, "model", [[0, 5], [1, 5]], 16, name="t")
    assert res.accept_length == pytest.approx(1 + (8 + 4) / 13) and res.pos_rates() == []
    assert "no spec_correct_drafts_histogram" in res.extra["per_position_unavailable"]


def test_plain_sglang_server_runs_no_acceptance_pass():
    info = {**fixture("server_info_eagle3.json"), "speculative_algorithm": None, "internal_states": [{}]}
    fake = FakeSGLang(fixture("generate_eagle3_responses.json"), info)
    with serve(fake) as url:
        res = measure_generation(url, "model", [[0, 5]], 16, name="t")
    assert "/generate" not in fake.calls and res.counters is None and res.source == "none"


def test_sglang_acceptance_rejects_inconsistent_meta_info():
    recs = parse_generate_response(fixture("generate_eagle3_responses.json"))
    acc = sglang_acceptance(recs)
    assert acc.histogram == (5, 5, 2, 1) and acc.without_spec_fields == 1
    bad = [dict(recs[0], spec_correct_drafts_histogram=[7])]  # 7 steps, but 0 correct drafts claimed
    assert sglang_acceptance(bad).histogram is None
    assert "does not add up" in (sglang_acceptance(bad).histogram_unusable or "")
    no_spec = [{k: v for k, v in recs[0].items() if not k.startswith("spec_")}]
    with pytest.raises(ValueError, match="16 completion tokens but no spec_verify_ct"):
        sglang_acceptance(no_spec)


# -- item 4: hidden states while serving EAGLE-3 --------------------------------------------------------

DRAFT_CFG = {"architectures": ["LlamaForCausalLMEagle3"],
             "eagle_config": {"eagle_aux_hidden_state_layer_ids": [1, 14, 26], "use_aux_hidden_state": True}}


def test_return_hidden_states_under_eagle3_are_the_drafters_aux_layers():
    resp = fixture("generate_eagle3_return_hidden_states.json")
    info = fixture("server_info_eagle3.json")
    plan = server_layers(info, model_family="llama", draft_config=DRAFT_CFG)
    # SGLang's Llama captures id + 1: ids [1, 14, 26] are the residual streams entering 2, 15, 27
    assert plan.layers == (2, 15, 27) and plan.convention == "sglang-llama" and plan.server_ids == (1, 14, 26)
    parts = parse_sglang_hidden_states(resp["meta_info"]["hidden_states"], list(plan.layers), 4)
    # prompt (5) + output[:-1] (3) rows; slot j of the packed row is layer plan.layers[j]
    assert parts[2].shape == (8, 4)
    assert parts[15][6].tolist() == pytest.approx([206.0, 206.1, 206.2, 206.3])
    assert parts[27][0].tolist() == pytest.approx([300.0, 300.1, 300.2, 300.3])
    assert parse_generate_response(resp)[0]["spec_correct_drafts_histogram"] == [0, 0, 1]


def test_server_hidden_states_against_a_fake_0_5_17(tmp_path):
    resp = fixture("generate_eagle3_return_hidden_states.json")
    (tmp_path / "config.json").write_text(json.dumps(DRAFT_CFG))
    info = {**fixture("server_info_eagle3.json"), "speculative_draft_model_path": str(tmp_path)}

    def handle(_r, path, _q, body):
        if path == "/server_info":
            return 200, "application/json", json.dumps(info)
        req = json.loads(body)
        assert path == "/generate" and req["return_hidden_states"] is True
        assert req["input_ids"] == [1, 3923, 374, 279, 6864]
        return 200, "application/json", json.dumps(resp)

    with serve(handle) as url:
        hs = server_hidden_states(url, [[1, 3923, 374, 279, 6864]], 4, hidden=4, model_family="llama")[0]
    assert sorted(hs.layers) == [2, 15, 27] and hs.token_ids == (1, 3923, 374, 279, 6864, 12366, 11, 9822)
    assert np.allclose(hs.get(2)[:, 0], 100 + np.arange(8))
    note = hs.provenance.note
    assert "SGLang 0.5.17 serving EAGLE-3" in note and "entering layers [2, 15, 27]" in note


def test_http_aux_feature_backend_reads_sglang_0_5_17_serving_eagle3(tmp_path):
    """The pipeline's http-aux backend (an SGLang extraction row of the matrix) takes the prompt's rows
    through the alignment capture's request and naming: one generated token, prompt rows only, layers by
    SGLang's id rule; a server returning other layers is refused with the flags to fix it."""
    from kimi_perf.eagle3.features import _HTTPAuxBackend

    resp = fixture("generate_eagle3_return_hidden_states.json")
    resp = {**resp, "output_ids": resp["output_ids"][:1]}  # max_new_tokens 1 (a verify step may add rows)
    (tmp_path / "draft").mkdir()
    (tmp_path / "draft" / "config.json").write_text(json.dumps(DRAFT_CFG))
    (tmp_path / "config.json").write_text(json.dumps({"architectures": ["LlamaForCausalLM"], "num_hidden_layers": 30}))
    info = {**fixture("server_info_eagle3.json"), "speculative_draft_model_path": str(tmp_path / "draft"),
            "model_path": str(tmp_path)}
    seen = []

    def handle(_r, path, _q, body):
        if path == "/server_info":
            return 200, "application/json", json.dumps(info)
        req = json.loads(body)
        seen.append(req["sampling_params"]["max_new_tokens"])
        return 200, "application/json", json.dumps(resp)

    ids = [1, 3923, 374, 279, 6864]
    with serve(handle) as url:
        be = _HTTPAuxBackend(url, (2, 15, 27), 4, 30)
        aux, final, _ = be(ids)
        with pytest.raises(RuntimeError, match=r"returns layers \[2, 15, 27\].*want entering layers \[3, 16, 28\]"):
            _HTTPAuxBackend(url, (3, 16, 28), 4, 30)
    assert seen == [1] and final is None and "SGLang 0.5.17 serving EAGLE-3" in be.version
    assert tuple(aux.shape) == (5, 12)
    assert aux[:, 0].tolist() == pytest.approx(100 + np.arange(5))  # layer 2 = the packed row's first slot
    assert aux[0, 8:].tolist() == pytest.approx([300.0, 300.1, 300.2, 300.3])  # layer 27, third slot


# -- items 2 and 6: per-release flags and surfaced warnings ---------------------------------------------

def test_sglang_0_5_17_renders_the_h200_launch():
    c = SGLangConfig(name="s", model_path="/m", python="py", version="0.5.17", attention_backend="triton",
                     sampling_backend="pytorch", mem_fraction_static=0.3, return_hidden_states=True)
    a = c.argv(30000)
    for flag, val in (("--attention-backend", "triton"), ("--sampling-backend", "pytorch"),
                      ("--mem-fraction-static", "0.3"), ("--random-seed", "0")):
        assert a[a.index(flag) + 1] == val
    assert "--enable-metrics" in a and "--enable-return-hidden-states" in a
    assert c.flag_warnings() == [] and c.describe()["version"] == "0.5.17"


def test_flag_tables_differ_where_the_releases_do():
    # 0.5.17 still accepts --cuda-graph-max-bs as a deprecated alias; 0.5.23 made it ambiguous
    assert check_sglang_flags(["--cuda-graph-max-bs", "8"], "0.5.17") == [
        "--cuda-graph-max-bs: SGLang 0.5.17: deprecated alias of --cuda-graph-max-bs-decode in 0.5.17 "
        "(removed in 0.5.23)"]
    with pytest.raises(SGLangFlagError, match="not accepted by SGLang 0.5.23.*use --cuda-graph-max-bs-"):
        check_sglang_flags(["--cuda-graph-max-bs", "8"], "0.5.23")
    with pytest.raises(SGLangFlagError, match="not accepted by SGLang 0.5.17.*no capture-only aux mode"):
        check_sglang_flags(["--enable-return-aux-hidden-states"], "0.5.17")
    with pytest.raises(SGLangFlagError, match="supported: 0.5.17, 0.5.23"):
        check_sglang_flags([], "0.4.0")
    with pytest.raises(SGLangFlagError, match="'intel_xpu' is not a choice of SGLang 0.5.17"):
        SGLangConfig(name="s", model_path="/m", python="py", version="0.5.17", sampling_backend="intel_xpu")


def test_aux_mode_on_0_5_17_is_a_config_error_naming_the_alternative():
    with pytest.raises(EngineConfigError, match="engines.sglang: .*0.5.17 has no capture-only aux mode.*"
                                                "return_hidden_states"):
        build_engine_config("sglang", {"kind": "sglang", "version": "0.5.17", "aux_hidden_states": True},
                            model_path="/m", served_model_name="m")


def test_aux_mode_with_a_drafter_fails_before_launch():
    # sglang 0.5.23 ServerArgs validation (handle_aux_hidden_state_capture) rejects this at startup
    with pytest.raises(SGLangFlagError, match="--speculative-draft-model-path.*set return_hidden_states"):
        SGLangConfig(name="s", model_path="/m", python="py", aux_hidden_states=True, spec=SpecConfig("/d"))
    with pytest.raises(SGLangFlagError, match="aux_layer_ids needs aux_hidden_states"):
        SGLangConfig(name="s", model_path="/m", python="py", aux_layer_ids=(2, 15))


def test_deprecation_warnings_are_kept_and_logged_at_launch(tmp_path):
    from kimi_perf import progress

    c = SGLangConfig(name="s17", model_path="/m", python="py", version="0.5.17", disable_cuda_graph=True,
                     extra_args=("--cuda-graph-max-bs", "8"))
    warns = c.flag_warnings()
    assert [w.split(":")[0] for w in warns] == ["--disable-cuda-graph", "--cuda-graph-max-bs"]
    assert c.describe()["flag_warnings"] == warns
    lines: list[str] = []
    prev = progress.set_sink(lines.append)
    try:
        c.launch_spec(tmp_path)
    finally:
        progress.set_sink(prev)  # the session's sink: later tests' progress lines must still show
    assert len(lines) == 2 and "s17: --disable-cuda-graph: SGLang 0.5.17: deprecated" in lines[0]
