"""A bounded Hypothesis fuzz of the reference server over HTTP: hostile bodies (the in-process fuzz's
strategies, plus raw bytes) sent to the three generation routes never get a 5xx, and the server stays
healthy. The in-process fuzz (test_request_fuzz.py) covers the parser in depth; this one covers what
it cannot see: tokenization, the sequence checks and the HTTP layer."""

from __future__ import annotations

import json
import sys
import urllib.error
import urllib.request

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from test_request_fuzz import body_of

from kimi_perf.engines.reference import protocol as pr

pytest.importorskip("torch")
pytestmark = pytest.mark.slow
MAX_KEYS = ("max_tokens", "max_completion_tokens", "max_new_tokens")


@pytest.fixture(scope="module")
def server(model_dir, tmp_path_factory):
    from kimi_perf.engines.base import ReferenceEngineConfig
    from kimi_perf.launcher import ServerProcess

    cfg = ReferenceEngineConfig(name="ref-fuzz", model_path=str(model_dir), served_model_name="smol",
                                python=sys.executable, dtype="float32", device="cpu", context_length=128,
                                max_running_requests=4, disable_cuda_graph=True)
    with ServerProcess(cfg.launch_spec(tmp_path_factory.mktemp("logs"))) as srv:
        yield srv


def cap(body):
    """Keep a valid request short (the fuzz is about parsing, not generation time)."""
    for d in (body, body.get("sampling_params") if isinstance(body.get("sampling_params"), dict) else {}):
        for k in MAX_KEYS:
            if type(d.get(k)) is int and d[k] > 3:
                d[k] = 3
    return body


def post(server, path, data: bytes) -> int:
    req = urllib.request.Request(server.base_url + path, data=data, headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=120) as r:
            r.read()
            return r.status
    except urllib.error.HTTPError as e:
        return e.code


# the values that reach the engine, drawn directly: a body with only these is otherwise valid, so a
# seed torch cannot take or a text the tokenizer cannot encode gets as far as they go
engine_bound = st.fixed_dictionaries(
    {"prompt": st.lists(st.integers(0, 100), min_size=1, max_size=3) | st.text(min_size=1, max_size=6)
     | st.text(st.characters(codec=None, categories=["Cs", "Ll"]), min_size=1, max_size=3)},
    # Hypothesis rarely draws large magnitudes from a wide integer range: the edges are named
    optional={"seed": st.sampled_from([-1, 2**63 - 1, 2**63, 2**64, 2**70]) | st.integers(0, 2**64),
              "temperature": st.floats(0, 2) | st.floats(allow_nan=True, allow_infinity=True),
              "max_tokens": st.integers(1, 3), "min_tokens": st.integers(0, 5), "ignore_eos": st.booleans()})

requests = st.one_of(
    st.tuples(st.just("/v1/completions"), engine_bound),
    st.tuples(st.just("/v1/completions"), body_of(pr._COMPLETION, {"prompt": [1, 2]}).map(cap)),
    st.tuples(st.just("/v1/completions"), body_of(pr._COMPLETION, {"prompt": "Hello"}).map(cap)),
    st.tuples(st.just("/v1/chat/completions"),
              body_of(pr._CHAT, {"messages": [{"role": "user", "content": "hi"}]}).map(cap)),
    st.tuples(st.just("/generate"), st.tuples(body_of(pr._GENERATE, {"text": "a"}), body_of(pr._SAMPLING, {})).map(
        lambda t: cap({**t[0], "sampling_params": t[1]} if "sampling_params" in t[0] else t[0]))),
)


@given(requests)
@settings(max_examples=120, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
def test_no_5xx_for_any_body(server, req):
    path, body = req
    data = json.dumps(body).encode()  # allow_nan: NaN and Infinity go out as JSON's extensions
    status = post(server, path, data)
    assert status < 500, (status, path, body)


@given(st.binary(max_size=64))
@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
def test_no_5xx_for_raw_bytes(server, data):
    assert post(server, "/v1/completions", data) < 500


def test_still_healthy_after_the_fuzz(server):
    with urllib.request.urlopen(server.base_url + "/health", timeout=10) as r:
        assert r.status == 200
