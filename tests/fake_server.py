"""A tiny stand-in server for launcher and client tests: ``python fake_server.py PORT MODE``.

Modes: ok (200 after 1 s), paced (streams tokens every FAKE_TOKEN_MS ms, times 1 + the planted
slowdown KIMI_PERF_PLANT_SLOWDOWN, like the reference engine reads it: the A/B runner's tests), never (503 forever), exit7 (exit code 7 after a log line), portbusy (bind
the given port fails like a real server), child (forks a grandchild that sleeps, prints its pid),
ignore_term (ignores SIGTERM), sse (streams a fast completion for client benchmarks), faults (the
first prompt id picks a fault, see FAULTS; for the client's failure accounting).
"""

from __future__ import annotations

import json
import os
import signal
import socket
import struct
import subprocess
import sys
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

port, mode = int(sys.argv[1]), sys.argv[2]
t0 = time.monotonic()
print(f"fake server mode={mode} pid={os.getpid()}", flush=True)
if mode == "exit7":
    print("fatal: CUDA out of memory (simulated)", flush=True)
    sys.exit(7)
if mode == "ignore_term":
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
if mode == "child":
    kid = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"])
    print(f"grandchild pid={kid.pid}", flush=True)

# faults mode: prompt[0] -> behaviour
FAULTS = {1: "ok", 2: "truncated", 3: "http500", 4: "reset", 5: "hang", 6: "no_usage", 7: "slow"}

N_TOKENS = int(os.environ.get("FAKE_SSE_TOKENS", "2000"))
CHUNK = ("data: " + json.dumps({"id": "x", "object": "text_completion", "created": 0, "model": "m",
                                "choices": [{"index": 0, "text": " tok", "logprobs": None,
                                             "finish_reason": None}]}) + "\n\n").encode()


class H(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"

    def log_message(self, *a):
        pass

    def do_GET(self):
        ready = mode in ("ok", "child", "ignore_term", "sse", "portbusy", "faults", "paced") and time.monotonic() - t0 > 1.0
        body = b"ok" if ready else b"loading"
        self.send_response(200 if ready else 503)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def do_POST(self):
        n = int(self.headers.get("Content-Length", 0))
        req = json.loads(self.rfile.read(n) or b"{}")
        toks = int(req.get("max_tokens", N_TOKENS))
        if mode == "faults" and self._fault(FAULTS.get((req.get("prompt") or [1])[0], "ok"), toks):
            return
        if mode == "paced":
            self._paced(toks)
            return
        self.send_response(200)
        self.send_header("Content-Type", "text/event-stream")
        self.send_header("Connection", "close")
        self.end_headers()
        buf = CHUNK * 64
        full, rest = divmod(toks, 64)
        for _ in range(full):
            self.wfile.write(buf)
        self.wfile.write(CHUNK * rest)
        usage = {"choices": [], "usage": {"prompt_tokens": 1, "completion_tokens": toks, "total_tokens": toks + 1}}
        self.wfile.write(f"data: {json.dumps(usage)}\n\ndata: [DONE]\n\n".encode())
        self.wfile.flush()
        self.close_connection = True


    def _paced(self, toks):
        delay = float(os.environ.get("FAKE_TOKEN_MS", "5")) / 1000 * (1 + float(os.environ.get("KIMI_PERF_PLANT_SLOWDOWN", "0")))
        self.send_response(200)
        self.send_header("Content-Type", "text/event-stream")
        self.send_header("Connection", "close")
        self.end_headers()
        for _ in range(toks):
            time.sleep(delay)
            self.wfile.write(CHUNK)
            self.wfile.flush()
        usage = {"choices": [], "usage": {"prompt_tokens": 1, "completion_tokens": toks, "total_tokens": toks + 1}}
        self.wfile.write(f"data: {json.dumps(usage)}\n\ndata: [DONE]\n\n".encode())
        self.wfile.flush()
        self.close_connection = True

    def _fault(self, kind, toks):
        """Serve one faulty response; False means 'serve normally'."""
        if kind == "ok":
            return False
        if kind == "http500":
            body = b'{"error": {"message": "simulated engine crash"}}'
            self.send_response(500)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)
            return True
        if kind == "reset":  # RST instead of a response
            self.connection.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
            self.connection.close()
            self.close_connection = True
            return True
        if kind == "hang":
            time.sleep(60)
            return True
        self.send_response(200)
        self.send_header("Content-Type", "text/event-stream")
        self.send_header("Connection", "close")
        self.end_headers()
        if kind == "truncated":  # a few chunks, then the connection closes: no usage, no [DONE]
            self.wfile.write(CHUNK * 3)
            self.wfile.write(CHUNK[:20])
        elif kind == "no_usage":
            self.wfile.write(CHUNK * 3 + b"data: [DONE]\n\n")
        elif kind == "slow":  # ~20 tokens/s, then usage and [DONE]
            for _ in range(toks):
                self.wfile.write(CHUNK)
                self.wfile.flush()
                time.sleep(0.05)
            usage = {"choices": [], "usage": {"prompt_tokens": 1, "completion_tokens": toks, "total_tokens": toks + 1}}
            self.wfile.write(f"data: {json.dumps(usage)}\n\ndata: [DONE]\n\n".encode())
        self.wfile.flush()
        self.close_connection = True
        return True


try:
    srv = ThreadingHTTPServer(("127.0.0.1", port), H)
except OSError as e:
    print(f"error: cannot bind 127.0.0.1:{port}: {e}", flush=True)
    sys.exit(98)
srv.serve_forever()
