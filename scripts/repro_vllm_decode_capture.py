#!/usr/bin/env python3
"""Standalone reproduction: vLLM's extract_hidden_states decode-path capture vs a prefill of the same ids.

Needs only vLLM (in the interpreter given by --python), numpy and safetensors; nothing of kimi-perf, so
it can be attached to an upstream report. It starts ``vllm.entrypoints.openai.api_server`` with the
``extract_hidden_states`` speculative method and a hidden-states KV connector (vLLM's stock
``ExampleHiddenStatesConnector`` by default), or uses a running one (--url, with --storage the
connector's ``shared_storage_path`` on this machine), then for each prompt:

1. generates --max-tokens tokens greedily with ``kv_transfer_params.include_output_tokens`` (the
   decode-path capture: rows for prompt + output[:-1]);
2. sends exactly those ids as the prompt with ``max_tokens=1`` (the prefill capture upstream documents;
   vllm-project/speculators captures responses this way);

and prints, per layer, the lowest cosine between the two captures over prompt rows and over generated
rows, and which generated rows fall below --threshold. Exit 0 when every row agrees, 1 when only
generated rows disagree (the decode-path fault reproduced: compare vLLM #43805, #56417), 2 when prompt
rows disagree too (the two prefills differ: not this fault), 3 on a setup error.

Example (one GPU, dummy weights of a local config + tokenizer directory):

    python scripts/repro_vllm_decode_capture.py --model /path/to/llama --load-format dummy \\
        --layers 2,15,27,30 --max-tokens 32 --extra "--gpu-memory-utilization 0.3"
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request
from typing import Any

import numpy as np

PROMPTS = [[1, 450, 4996, 17354, 1701, 432, 17204, 975, 278, 17366, 11203, 29889] * 4,
           [1, 1724, 338, 278, 7483, 310, 3444, 29973] * 6]


class SetupError(RuntimeError):
    """The comparison could not be made (server, response): exit 3, never 1 (1 means reproduced)."""


def _post(url: str, body: dict[str, Any]) -> dict[str, Any]:
    req = urllib.request.Request(url + "/v1/completions", data=json.dumps(body).encode(),
                                 headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=600) as r:  # noqa: S310 - loopback
        return json.loads(r.read())


def _load(path: str) -> tuple[np.ndarray, list[int]]:
    import fcntl

    from safetensors.torch import load_file

    with open(path + ".lock") as lf:  # the connector holds LOCK_EX until the file is written
        fcntl.flock(lf, fcntl.LOCK_SH)
        d = load_file(path)
    return d["hidden_states"].float().numpy(), [int(t) for t in d["token_ids"].tolist()]


def _capture(url: str, model: str, ids: list[int], max_tokens: int, decode: bool) -> tuple[np.ndarray, list[int]]:
    body: dict[str, Any] = {"model": model, "prompt": ids, "max_tokens": max_tokens, "temperature": 0,
                            "ignore_eos": True}
    if decode:
        body["kv_transfer_params"] = {"include_output_tokens": True}
    res = _post(url, body)
    path = (res.get("kv_transfer_params") or {}).get("hidden_states_path")
    if not path:
        raise SetupError(f"no kv_transfer_params.hidden_states_path in the response: {str(res)[:300]}")
    return _load(path)


def _cos(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    num = (a * b).sum(-1)
    den = np.linalg.norm(a, axis=-1) * np.linalg.norm(b, axis=-1) + 1e-12
    return num / den


def _start(ns: argparse.Namespace, storage: str) -> tuple[subprocess.Popen[bytes], str]:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    layers = [int(x) for x in ns.layers.split(",")]
    argv = [ns.python, "-m", "vllm.entrypoints.openai.api_server", "--model", ns.model, "--served-model-name", "m",
            "--host", "127.0.0.1", "--port", str(port), "--load-format", ns.load_format, "--seed", "0",
            "--no-enable-prefix-caching", "--max-model-len", "2048",
            "--speculative-config", json.dumps({"method": "extract_hidden_states", "num_speculative_tokens": 1,
                                                "draft_model_config": {"hf_config": {
                                                    "eagle_aux_hidden_state_layer_ids": layers}}}),
            "--kv-transfer-config", json.dumps({"kv_connector": ns.connector, "kv_connector_module_path": ns.module,
                                                "kv_role": "kv_producer",
                                                "kv_connector_extra_config": {"shared_storage_path": storage}}),
            *shlex.split(ns.extra)]
    log = open(os.path.join(storage, "server.log"), "wb")  # noqa: SIM115 - lives as long as the server
    print(f"[repro] starting: {' '.join(shlex.quote(a) for a in argv)}\n[repro] log: {log.name}", flush=True)
    proc = subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    url = f"http://127.0.0.1:{port}"
    t0 = time.monotonic()
    while time.monotonic() - t0 < ns.ready_timeout:
        if proc.poll() is not None:
            raise SetupError(f"the server exited with code {proc.returncode}; see {log.name}")
        try:
            with urllib.request.urlopen(url + "/health", timeout=5):  # noqa: S310 - loopback
                print(f"[repro] ready in {time.monotonic() - t0:.0f}s", flush=True)
                return proc, url
        except OSError:
            time.sleep(2)
            if int(time.monotonic() - t0) % 30 < 2:
                print(f"[repro] waiting for the server ({time.monotonic() - t0:.0f}s)", flush=True)
    raise SetupError(f"not ready after {ns.ready_timeout}s; see {log.name}")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", help="model directory (config + tokenizer; weights unless --load-format dummy)")
    ap.add_argument("--url", help="use a running extract_hidden_states server instead of starting one")
    ap.add_argument("--served-model", default="m", help="model name of the --url server")
    ap.add_argument("--python", default=sys.executable, help="interpreter with vLLM installed")
    ap.add_argument("--load-format", default="auto")
    ap.add_argument("--layers", default="2,15,27,30", help="eagle_aux_hidden_state_layer_ids (vLLM ids)")
    ap.add_argument("--max-tokens", type=int, default=32)
    ap.add_argument("--threshold", type=float, default=0.99, help="cosine below which a row disagrees")
    ap.add_argument("--connector", default="ExampleHiddenStatesConnector")
    ap.add_argument("--module", default="vllm.distributed.kv_transfer.kv_connector.v1.example_hidden_states_connector")
    ap.add_argument("--extra", default="", help="more server flags, one string")
    ap.add_argument("--prompt-ids", action="append", default=[], help="comma-separated token ids (repeatable)")
    ap.add_argument("--ready-timeout", type=float, default=900)
    ns = ap.parse_args(argv)
    if not ns.model and not ns.url:
        ap.error("give --model (start a server) or --url (use a running one)")
    prompts = [[int(x) for x in p.split(",")] for p in ns.prompt_ids] or PROMPTS
    storage = tempfile.mkdtemp(prefix="repro-hs-")
    proc = None
    try:
        if ns.url:
            url, model = ns.url.rstrip("/"), ns.served_model
        else:
            proc, url = _start(ns, storage)
            model = "m"
        worst = 0
        for i, ids in enumerate(prompts):
            hd, td = _capture(url, model, ids, ns.max_tokens, decode=True)
            hp, tp = _capture(url, model, td, 1, decode=False)
            if tp != td:
                print(f"[repro] prompt {i}: the prefill captured other ids than were sent ({len(tp)} vs {len(td)})")
                return 3
            n_prompt = len(ids)
            print(f"\nprompt {i}: {n_prompt} prompt rows, {len(td) - n_prompt} generated rows; layer | min cos prompt "
                  f"rows | min cos generated rows | generated rows below {ns.threshold}")
            for j, layer in enumerate(ns.layers.split(",")):
                c = _cos(hd[:, j, :], hp[:, j, :])
                bad = [int(r) for r in np.flatnonzero(c < ns.threshold)]
                gen_bad = [r - n_prompt for r in bad if r >= n_prompt]
                print(f"  {layer:>5} | {c[:n_prompt].min():.5f} | "
                      f"{(c[n_prompt:].min() if len(c) > n_prompt else float('nan')):.5f} | {gen_bad or '-'}")
                if any(r < n_prompt for r in bad):
                    worst = 2
                elif gen_bad:
                    worst = max(worst, 1)
        print({0: "\nresult: decode-path and prefill captures agree",
               1: "\nresult: REPRODUCED: generated rows of the decode-path capture disagree, every prompt row agrees",
               2: "\nresult: prompt rows disagree too: the two prefills differ (not the decode-path fault)"}[worst])
        return worst
    except (SetupError, OSError) as e:
        print(f"[repro] setup error: {e}", flush=True)
        return 3
    finally:
        if proc is not None:
            os.killpg(proc.pid, signal.SIGTERM)
            proc.wait(timeout=60)


if __name__ == "__main__":
    raise SystemExit(main())
