"""vLLM's hidden-state capture the upstream way (kimi_perf.alignment.vllm), against a fake server that
speaks the extract_hidden_states connector's protocol: a completion whose response names a safetensors
file (``hidden_states`` [tokens, layers, H], ``token_ids``) guarded by a ``.lock`` flock.

The fake computes each row from (token, position, layer) so two captures of the same ids agree; its
decode path can be told to corrupt the last generated rows, the pattern vLLM 0.26.0 showed on an H200."""

from __future__ import annotations

import json
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import numpy as np
import pytest

from kimi_perf.alignment.diagnose import check_alignment
from kimi_perf.alignment.hidden import AlignmentSetupError
from kimi_perf.alignment.vllm import vllm_hidden_states

LAYERS = [2, 15, 27, 30]
H = 16


def _row(tok: int, pos: int, layer: int) -> np.ndarray:
    return np.random.default_rng(tok * 100_003 + pos * 101 + layer).standard_normal(H).astype(np.float32)


class _Fake(BaseHTTPRequestHandler):
    corrupt_last = 0  # decode path: how many final generated rows come back wrong
    drop_prefill_token = False  # prefill path: capture one id fewer than sent
    out_dir: Path

    def log_message(self, *a):  # quiet
        pass

    def do_POST(self):  # noqa: N802 - http.server's name
        from safetensors.numpy import save_file

        body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        prompt, n = list(body["prompt"]), int(body["max_tokens"])
        output = [(prompt[-1] + 7 * (i + 1)) % 1000 for i in range(n)]
        decode = bool((body.get("kv_transfer_params") or {}).get("include_output_tokens"))
        ids = prompt + output[:-1] if decode else prompt
        if not decode and type(self).drop_prefill_token:
            ids = ids[:-1]
        hs = np.stack([np.stack([_row(t, p, k) for k in LAYERS]) for p, t in enumerate(ids)])
        if decode and type(self).corrupt_last:
            hs[-type(self).corrupt_last:] = -hs[-type(self).corrupt_last:]
        path = str(self.out_dir / f"req-{len(list(self.out_dir.iterdir()))}.safetensors")
        Path(path + ".lock").write_text("")
        save_file({"hidden_states": hs, "token_ids": np.asarray(ids, dtype=np.int64)}, path)
        data = json.dumps({"choices": [{"text": "x"}], "system_fingerprint": "vllm-fake",
                           "kv_transfer_params": {"hidden_states_path": path}}).encode()
        self.send_response(200)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)


@pytest.fixture
def fake_vllm(tmp_path):
    handler = type("H", (_Fake,), {"out_dir": tmp_path, "corrupt_last": 0, "drop_prefill_token": False})
    srv = ThreadingHTTPServer(("127.0.0.1", 0), handler)
    t = threading.Thread(target=srv.serve_forever, daemon=True)
    t.start()
    yield handler, f"http://127.0.0.1:{srv.server_address[1]}"
    srv.shutdown()


def test_capture_prefills_prompt_plus_generated_ids_and_keeps_the_decode_rows_for_the_check(fake_vllm):
    handler, url = fake_vllm
    handler.corrupt_last = 5
    prompts = [[11, 12, 13, 14, 15, 16], [21, 22, 23]]
    decode: list = []
    got = vllm_hidden_states(url, "m", prompts, 12, layers=LAYERS, decode=decode)
    assert [len(h.token_ids) for h in got] == [6 + 11, 3 + 11] and [h.prompt_len for h in got] == [6, 3]
    assert got[0].token_ids[:6] == tuple(prompts[0]) and got[0].token_ids == decode[0].token_ids
    assert "max_tokens=1" in got[0].provenance.note and "decode path" in decode[0].provenance.backend
    # the prefill capture is what the model computed; the decode capture's last rows are not
    want = np.stack([_row(t, p, 27) for p, t in enumerate(got[0].token_ids)])
    assert np.allclose(got[0].layers[27], want)
    rep = check_alignment(decode[0], got[0], [27], threshold=0.99, norm_ratio_tol=0.05, num_layers=30)
    assert not rep.ok and rep.verdicts[0].cause.startswith("decode-path capture fault"), rep.verdicts[0].cause
    assert not list(Path(handler.out_dir).glob("*.safetensors"))  # files removed after reading


def test_a_single_token_capture_is_one_prefill_and_agreeing_paths_pass(fake_vllm):
    handler, url = fake_vllm
    decode: list = []
    got = vllm_hidden_states(url, "m", [[5, 6, 7]], 1, layers=LAYERS, decode=decode)
    assert got[0].token_ids == (5, 6, 7) and decode == []  # max_tokens 1: no decode path to check
    got = vllm_hidden_states(url, "m", [[5, 6, 7]], 8, layers=LAYERS, decode=decode)
    assert check_alignment(decode[0], got[0], LAYERS, threshold=0.99, norm_ratio_tol=0.05).ok


def test_a_capture_of_other_ids_than_sent_is_refused(fake_vllm):
    handler, url = fake_vllm
    handler.drop_prefill_token = True
    with pytest.raises(AlignmentSetupError, match=r"captured 10 token ids, not the 11 sent"):
        vllm_hidden_states(url, "m", [[1, 2, 3, 4]], 8, layers=LAYERS)
