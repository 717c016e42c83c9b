"""The reference server's lifecycle: SIGTERM with a stream open ends that stream with an error event
and the process within its grace period; with its launching parent gone it exits at once."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import textwrap
import time
import urllib.request
from pathlib import Path

import pytest
from test_launcher import pid_alive, wait_dead

pytest.importorskip("torch")
pytestmark = pytest.mark.slow
ROOT = Path(__file__).resolve().parents[1]


def test_sigterm_with_a_stream_open_ends_the_stream_with_an_error_and_exits(model_dir, tmp_path):
    from kimi_perf.engines.base import ReferenceEngineConfig
    from kimi_perf.launcher import ServerProcess

    cfg = ReferenceEngineConfig(name="ref-term", model_path=str(model_dir), served_model_name="smol",
                                python=sys.executable, dtype="float32", device="cpu", context_length=512,
                                max_running_requests=4, disable_cuda_graph=True,
                                extra_args=("--shutdown-grace-s", "3"))
    srv = ServerProcess(cfg.launch_spec(tmp_path)).start()
    try:
        body = json.dumps({"prompt": [1, 2, 3], "max_tokens": 500, "ignore_eos": True, "temperature": 0,
                           "stream": True}).encode()
        req = urllib.request.Request(srv.base_url + "/v1/completions", data=body,
                                     headers={"Content-Type": "application/json"})
        with urllib.request.urlopen(req, timeout=120) as r:
            first = r.readline()
            assert first.startswith(b"data: {")
            os.kill(srv.pid, signal.SIGTERM)
            events = [ln.decode()[6:].strip() for ln in r.read().splitlines() if ln.startswith(b"data: ")]
        assert events and "[DONE]" not in events
        last = json.loads(events[-1])
        assert last["error"]["code"] == 503 and "shutting down" in last["error"]["message"]
        # exits on its own (no SIGKILL needed): within the 3 s grace plus the engine thread's stop
        assert srv.proc.wait(timeout=30) == 0
        assert "1 open request(s) ended" in srv.tail(5)
    finally:
        srv.stop(grace_s=2.0)


DRIVER = textwrap.dedent("""
    import os, subprocess, sys
    # launched the way kimi-perf's launcher does it, minus PR_SET_PDEATHSIG: only the parent watch is left
    env = {{**os.environ, "KIMI_PERF_PARENT_PID": str(os.getpid())}}
    p = subprocess.Popen([sys.executable, "-m", "kimi_perf.engines.reference.server", "--model-path", {model!r},
                          "--port", "0", "--device", "cpu", "--dtype", "float32", "--disable-cuda-graph"],
                         cwd={root!r}, env=env, stdout=open({log!r}, "w"), stderr=subprocess.STDOUT,
                         start_new_session=True)
    print(p.pid, flush=True)
    import time; time.sleep(600)
""")


def test_server_exits_at_once_when_its_parent_dies(model_dir, tmp_path):
    log = tmp_path / "server.log"
    drv = subprocess.Popen([sys.executable, "-c", DRIVER.format(model=str(model_dir), root=str(ROOT), log=str(log))],
                           stdout=subprocess.PIPE, text=True)
    server_pid = int(drv.stdout.readline())
    try:
        for _ in range(600):
            if "listening on" in log.read_text():
                break
            assert pid_alive(server_pid), log.read_text()
            time.sleep(0.1)
        drv.kill()  # SIGKILL: nothing of the parent runs; the server is re-parented
        drv.wait()
        assert wait_dead(server_pid, 15), f"server outlived its parent:\n{log.read_text()}"
        assert "parent" in log.read_text() and "gone" in log.read_text()
    finally:
        if pid_alive(server_pid):
            os.kill(server_pid, signal.SIGKILL)
