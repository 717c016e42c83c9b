"""--perf-url: an existing OpenAI-compatible server as the engine under test (kimi_perf.endpoint).

The end-to-end test starts a real vLLM (CPU build) server itself, outside the suite, with an API key,
and runs the suite's throughput tests against it in a separate pytest process, as a CI job that
deploys its server separately would; then the endpoint EAGLE-3 acceptance test, which skips (and fails
under CI=true) because this server serves no drafter; then a chat workload through the library."""

from __future__ import annotations

import os
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import pytest

from kimi_perf.endpoint import Endpoint, EndpointError, parse_endpoint

ROOT = Path(__file__).resolve().parents[1]


def test_endpoint_options_are_checked_when_parsed(tmp_path):
    ep = parse_endpoint("http://127.0.0.1:8000/", tokenizer=None, api_key_env=None, served_model=None)
    assert ep == Endpoint("http://127.0.0.1:8000")
    for url in ("127.0.0.1:8000", "http://h:1/v1", "ftp://h", "http://h/x?y=1"):
        with pytest.raises(EndpointError, match="scheme://host"):
            parse_endpoint(url, tokenizer=None, api_key_env=None, served_model=None)
    with pytest.raises(EndpointError, match="--perf-tokenizer .*no tokenizer.json"):
        parse_endpoint("http://h:1", tokenizer=str(tmp_path), api_key_env=None, served_model=None)
    with pytest.raises(EndpointError, match="applies to --perf-url only"):
        parse_endpoint(None, tokenizer=str(tmp_path), api_key_env=None, served_model=None)
    with pytest.raises(EndpointError, match="NAME of an environment variable"):
        parse_endpoint("http://h:1", tokenizer=None, api_key_env="sk-abc.def", served_model=None)


def test_the_token_comes_from_the_environment_only(monkeypatch):
    ep = Endpoint("http://h:1", api_key_env="MY_TOKEN")
    monkeypatch.delenv("MY_TOKEN", raising=False)
    assert ep.headers() == {}
    monkeypatch.setenv("MY_TOKEN", "s3cret")
    assert ep.headers() == {"Authorization": "Bearer s3cret"}


def test_a_url_run_names_one_engine(pytester):
    # the plugin builds its session (and checks the --perf-* values) only for a selected perf test
    pytester.makepyfile(test_x="import pytest\n@pytest.mark.perf\ndef test_x(perf_session):\n    pass\n")
    r = pytester.runpytest("--perf-url", "http://127.0.0.1:9", "--perf-engine", "reference,vllm",
                           "--perf-profile", str(ROOT / "profiles" / "embedded-cpu.json"))
    assert r.ret == pytest.ExitCode.USAGE_ERROR
    assert "name the one engine" in r.stderr.str()


def _vllm_python() -> Path | None:
    py = Path(os.environ.get("KIMI_PERF_VLLM_PYTHON", ROOT / ".venv-vllm" / "bin" / "python"))
    return py if py.exists() else None


@pytest.mark.slow
def test_the_suite_measures_an_existing_vllm_server_through_perf_url(tmp_path, monkeypatch):
    from kimi_perf.launcher import free_port
    from kimi_perf.models.embedded import ensure_embedded_model

    py = _vllm_python()
    if py is None:
        if os.environ.get("CI", "").lower() == "true":
            pytest.fail("no vLLM environment (.venv-vllm): CI runs scripts/setup.sh --full, which makes it")
        pytest.skip("no vLLM environment: scripts/setup.sh --full makes .venv-vllm")
    model = ensure_embedded_model().path
    port = free_port()
    log = (tmp_path / "vllm.log").open("wb")
    server = subprocess.Popen(
        [str(py), "-m", "vllm.entrypoints.openai.api_server", "--model", str(model), "--served-model-name", "smol",
         "--host", "127.0.0.1", "--port", str(port), "--dtype", "bfloat16", "--max-model-len", "1024",
         "--enforce-eager", "--kv-cache-memory-bytes", "128M", "--api-key", "s3cret"],
        stdout=log, stderr=subprocess.STDOUT, start_new_session=True,
        env={**os.environ, "VLLM_NO_USAGE_STATS": "1", "DO_NOT_TRACK": "1"})
    try:
        url = f"http://127.0.0.1:{port}"
        t0 = time.monotonic()
        while True:
            assert server.poll() is None, f"vLLM exited with {server.returncode}: {(tmp_path / 'vllm.log').read_text()[-2000:]}"
            try:
                urllib.request.urlopen(url + "/health", timeout=5)  # noqa: S310 - loopback
                break
            except OSError:
                assert time.monotonic() - t0 < 300, "vLLM not ready in 300 s"
                time.sleep(2)
        # without the token the probe says which variable to set
        with pytest.raises(EndpointError, match="export KIMI_PERF_API_KEY"):
            Endpoint(url).probe()
        # outside CI a missing piece skips; the CI=true run below checks that it fails there
        env = {**{k: v for k, v in os.environ.items() if k != "CI"}, "KIMI_PERF_API_KEY": "s3cret"}
        args = [sys.executable, "-m", "pytest", "-p", "no:cacheprovider", "-q", "-rA", "-m", "perf",
                "-k", "test_single_stream_decode or test_concurrency_sweep or test_acceptance_in_vllm "
                      "or test_acceptance_of_the_endpoint",
                f"--perf-url={url}", "--perf-engine", "vllm", f"--perf-tokenizer={model}", "--perf-repeats", "1",
                f"--perf-report-dir={tmp_path / 'report'}", f"--perf-baseline-dir={tmp_path / 'baselines'}",
                "--perf-history=off", "perf_tests/test_throughput.py", "perf_tests/test_eagle3.py"]
        r = subprocess.run(args, cwd=ROOT, env=env, capture_output=True, text=True, timeout=900)
        out = r.stdout + r.stderr
        assert r.returncode == 0, out[-4000:]
        assert "4 passed" in out, out[-3000:]  # single stream + the sweep at C = 1, 4, 8
        assert f"measuring the existing endpoint {url} (model smol, vllm" in out
        # a test that serves a drafter of its own skips, saying why
        assert "--perf-url " + url + " measures an existing endpoint" in out, out[-3000:]
        run = (tmp_path / "report" / "run.json").read_text()
        assert '"decode_tok_s"' in run and '"vllm"' in run
        # EAGLE-3 acceptance of the endpoint: no drafter served, so no spec counters: a skip saying so ...
        assert "the endpoint reports no speculative decoding" in out, out[-3000:]
        # ... and under CI=true a failure (kimi_perf.missing), not a green run with nothing measured
        k = args.index("-k")
        ci = subprocess.run([*args[:k + 1], "test_acceptance_of_the_endpoint", *args[k + 2:]], cwd=ROOT,
                            env={**env, "CI": "true"}, capture_output=True, text=True, timeout=600)
        assert ci.returncode == 1, (ci.stdout + ci.stderr)[-3000:]
        assert "a failure, not a skip: CI=true" in ci.stdout, ci.stdout[-3000:]

        # a chat workload through the same token: /v1/chat/completions, tokens and TPOT from vLLM's usage
        from kimi_perf.bench import RunningServer, measure
        from kimi_perf.load.prompts import PromptFactory
        from kimi_perf.load.workload import Workload

        monkeypatch.setenv("KIMI_PERF_API_KEY", "s3cret")
        srv = RunningServer(name="vllm", kind="vllm", base_url=url, model="smol", process=None, config=None,
                            headers=Endpoint(url).headers())
        w = Workload(name="chat", api="chat", input_len=48, output_len=12, num_prompts=4, concurrency=2, warmup=1)
        res = measure(srv, w, PromptFactory(model), 1, label="vllm chat")[0]
        assert res.metrics["num_failed"] == 0, res.errors
        for r in res.records:
            assert r.completion_tokens == 12  # ignore_eos took: exactly max_completion_tokens, per usage
            assert r.server_prompt_tokens is not None and r.server_prompt_tokens > 0
            assert r.tpot == pytest.approx((r.e2el - r.ttft) / 11)
        assert res.metrics["total_output_tokens"] == 48
        assert res.metrics["total_input_tokens"] == sum(r.server_prompt_tokens for r in res.records)
        # the chat template wraps the decoded prompt: the server saw more than the 48 drawn ids
        assert all(r.server_prompt_tokens > 48 for r in res.records)
    finally:
        import signal

        os.killpg(server.pid, signal.SIGTERM)
        server.wait(timeout=60)
        log.close()
