"""benchmarks/served_vs_walk.py's ``--url`` client against scripted vLLM- and SGLang-shaped servers: the
token ids each emitted come back per prompt, and the served acceptance is read the engine's way.

Why a test: the script's SGLang branch runs only on a GPU lease, which is short; its reading of
``output_ids`` and ``spec_verify_ct`` has to be right before one. The vLLM branch and the reference
engine's were checked against real servers on the CPU box (docs/eagle3.md), but a change to either would
otherwise go unnoticed until then. The scripted servers answer in the engines' documented shapes (vLLM's
``/v1/completions`` with ``return_token_ids`` and its ``vllm:spec_decode_*`` counters; SGLang's native
``/generate`` with ``meta_info``) and count what a real server would.
"""

from __future__ import annotations

import importlib.util
import json
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest

pytest.importorskip("torch")  # the script imports it at the top (its in-process modes need it)
ROOT = Path(__file__).resolve().parents[1]
PROMPTS = {"p1": [1, 2, 3], "p2": [4, 5]}
# each prompt's reply, its verify steps and how many drafts each position had accepted over them; in SGLang's
# terms the histogram of verify steps by correct drafts (k = 0..3): p1 [1, 1, 1, 0], p2 [1, 1, 0, 0]
REPLIES = {(1, 2, 3): ([10, 11, 12, 13, 14, 15], 3, (2, 1, 0)), (4, 5): ([20, 21, 22], 2, (1, 0, 0))}
HISTOGRAMS = {(1, 2, 3): [1, 1, 1, 0], (4, 5): [1, 1, 0, 0]}


def _script():
    spec = importlib.util.spec_from_file_location("served_vs_walk", ROOT / "benchmarks" / "served_vs_walk.py")
    assert spec is not None and spec.loader is not None
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def _serve(kind: str, *, speculative: bool = True):
    seen: list[dict] = []
    counters = {"drafts": 5.0, "accepted": 4.0, "pos": [3.0, 1.0, 0.0]}  # counts from before the pass

    class H(BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"

        def log_message(self, *a):
            pass

        def _send(self, code: int, body: str, ctype: str = "application/json") -> None:
            data = body.encode()
            self.send_response(code)
            self.send_header("Content-Type", ctype)
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)

        def do_GET(self):
            if self.path == "/server_info" and kind == "sglang":
                self._send(200, json.dumps({"internal_states": [{}], "version": "0.5.17",
                                            "speculative_algorithm": "EAGLE3"}))
            elif self.path == "/v1/models" and kind == "vllm":
                self._send(200, json.dumps({"data": [{"id": "served-name"}]}))
            elif self.path == "/metrics" and kind == "vllm":
                c = counters
                lines = [f'vllm:spec_decode_num_drafts_total{{model_name="m"}} {c["drafts"]}',
                         f'vllm:spec_decode_num_draft_tokens_total{{model_name="m"}} {3 * c["drafts"]}',
                         f'vllm:spec_decode_num_accepted_tokens_total{{model_name="m"}} {c["accepted"]}']
                lines += [f'vllm:spec_decode_num_accepted_tokens_per_pos_total{{model_name="m",position="{i}"}} {v}'
                          for i, v in enumerate(c["pos"])]
                self._send(200, "\n".join(lines) + "\n", "text/plain")
            else:
                self._send(404, "{}")

        def do_POST(self):
            req = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
            seen.append({"path": self.path, **req})
            if self.path == "/v1/completions" and kind == "vllm":
                out, steps, pos = REPLIES[tuple(req["prompt"])]
                counters["drafts"] += steps
                counters["accepted"] += sum(pos)
                counters["pos"] = [a + b for a, b in zip(counters["pos"], pos)]
                # token_ids only when asked: a client that forgets return_token_ids gets text alone
                choice = {"text": "…", **({"token_ids": out} if req.get("return_token_ids") else {})}
                self._send(200, json.dumps({"choices": [choice]}))
            elif self.path == "/generate" and kind == "sglang":
                out, steps, pos = REPLIES[tuple(req["input_ids"])]
                meta = {"prompt_tokens": len(req["input_ids"]), "completion_tokens": len(out)}
                if speculative:  # the fields sglang 0.5.17 adds on a speculative server's finished response
                    meta.update(spec_verify_ct=steps, spec_num_correct_drafts=sum(pos),
                                spec_num_proposed_drafts=3 * steps,
                                spec_correct_drafts_histogram=HISTOGRAMS[tuple(req["input_ids"])])
                self._send(200, json.dumps({"text": "…", "output_ids": out, "meta_info": meta}))
            else:
                self._send(404, "{}")

    srv = ThreadingHTTPServer(("127.0.0.1", 0), H)
    threading.Thread(target=srv.serve_forever, daemon=True).start()
    return srv, f"http://127.0.0.1:{srv.server_address[1]}", seen


@pytest.mark.parametrize("kind", ["vllm", "sglang"])
def test_serve_url_returns_each_prompts_token_ids_and_the_engines_acceptance(kind):
    srv, url, seen = _serve(kind)
    try:
        outputs, served = _script().serve_url(url, dict(PROMPTS), 6)
    finally:
        srv.shutdown()
    assert outputs == {"p1": [10, 11, 12, 13, 14, 15], "p2": [20, 21, 22]}
    assert served["engine"] == kind and served["verify_steps"] == 5
    assert all(r.get("temperature", r.get("sampling_params", {}).get("temperature")) == 0.0 for r in seen)
    # the pass's window only (vLLM's counters stood at 5 drafts before it): 5 verify steps, 4 accepted drafts
    # (2 + 1 and 1), per position 3 / 1 / 0; from SGLang's meta_info the same, as the suite reads it
    assert served["served"] == pytest.approx(1 + 4 / 5)
    assert served["served_per_pos"] == pytest.approx([3 / 5, 1 / 5, 0.0])
    if kind == "vllm":
        assert seen[0]["model"] == "served-name" and all(r["return_token_ids"] for r in seen)
    else:
        assert all(r["sampling_params"]["max_new_tokens"] == 6 for r in seen)


def test_a_server_without_speculative_counters_is_refused():
    """An SGLang server without a drafter reports no verify steps: the walk would have nothing to compare."""
    srv, url, _ = _serve("sglang", speculative=False)
    try:
        with pytest.raises(SystemExit, match="no speculative counters"):
            _script().serve_url(url, dict(PROMPTS), 6)
    finally:
        srv.shutdown()
