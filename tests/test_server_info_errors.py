"""A /server_info that errors must raise, not read as "this engine has none" (issue: silent paths)."""

from __future__ import annotations

import http.server
import threading

import pytest

from kimi_perf.eagle3.evaluate import _get_json


class _H(http.server.BaseHTTPRequestHandler):
    def do_GET(self):  # noqa: N802 - http.server's naming
        code = {"/server_info": 200, "/missing": 404, "/broken": 500}.get(self.path, 404)
        body = b'{"version": "x"}' if code == 200 else b"{}"
        self.send_response(code)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, *a):
        pass


@pytest.fixture
def base_url():
    srv = http.server.ThreadingHTTPServer(("127.0.0.1", 0), _H)
    t = threading.Thread(target=srv.serve_forever, daemon=True)
    t.start()
    yield f"http://127.0.0.1:{srv.server_address[1]}"
    srv.shutdown()


def test_ok_missing_and_broken(base_url):
    assert _get_json(base_url + "/server_info") == {"version": "x"}
    assert _get_json(base_url + "/missing") is None  # vLLM: no such route
    with pytest.raises(RuntimeError, match="HTTP 500"):
        _get_json(base_url + "/broken")


def test_unreachable_server_raises():
    with pytest.raises(RuntimeError, match="failed"):
        _get_json("http://127.0.0.1:9/server_info")
