"""The launcher: readiness, failures with exit code and log tail, port retries, and that nothing is
left running after any failure or interruption (checked by PID)."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from kimi_perf.launcher import LaunchSpec, ServerDied, ServerProcess, ServerTimeout, free_port

FAKE = str(Path(__file__).with_name("fake_server.py"))


def spec(tmp_path, mode, timeout=20.0):
    return LaunchSpec(name=f"fake-{mode}", argv_for_port=lambda p: [sys.executable, FAKE, str(p), mode],
                      ready_timeout_s=timeout, log_dir=tmp_path)


def pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    # a zombie still "exists": treat it as dead
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().split()[2] != "Z"
    except FileNotFoundError:
        return False


def wait_dead(pid: int, s: float = 10.0) -> bool:
    end = time.monotonic() + s
    while time.monotonic() < end:
        if not pid_alive(pid):
            return True
        time.sleep(0.1)
    return False


def test_ready_and_stop(tmp_path):
    with ServerProcess(spec(tmp_path, "ok")) as srv:
        pid = srv.pid
        assert srv.alive() and srv.ready_s is not None and srv.base_url.startswith("http://127.0.0.1:")
    assert wait_dead(pid)


def test_exit_before_ready_names_code_and_log(tmp_path):
    with pytest.raises(ServerDied) as ei:
        ServerProcess(spec(tmp_path, "exit7")).start()
    msg = str(ei.value)
    assert ei.value.returncode == 7 and "exited with code 7" in msg and "CUDA out of memory" in msg
    assert str(tmp_path) in msg


def test_never_ready_times_out_with_last_log_lines(tmp_path):
    srv = ServerProcess(spec(tmp_path, "never", timeout=3.0))
    t0 = time.monotonic()
    with pytest.raises(ServerTimeout) as ei:
        srv.start()
    assert time.monotonic() - t0 < 15
    assert "not ready after 3s" in str(ei.value) and "mode=never" in str(ei.value)
    assert srv.pid is not None and wait_dead(srv.pid)


def test_port_in_use_retries_on_another_port(tmp_path):
    busy = socket.socket()
    busy.bind(("127.0.0.1", 0))
    busy.listen()
    port = busy.getsockname()[1]
    try:
        srv = ServerProcess(spec(tmp_path, "portbusy")).start(port=port)
        try:
            assert srv.port != port and srv.alive()
        finally:
            srv.stop()
    finally:
        busy.close()


def test_stop_kills_the_whole_process_group(tmp_path):
    srv = ServerProcess(spec(tmp_path, "child")).start()
    time.sleep(0.5)
    kid = int(next(ln for ln in srv.tail(10).splitlines() if "grandchild pid=" in ln).split("=")[1])
    assert pid_alive(kid)
    srv.stop()
    assert wait_dead(srv.pid) and wait_dead(kid)


def test_sigterm_ignoring_server_is_killed(tmp_path):
    srv = ServerProcess(spec(tmp_path, "ignore_term")).start()
    t0 = time.monotonic()
    srv.stop(grace_s=1.0)
    assert wait_dead(srv.pid) and time.monotonic() - t0 < 10


DRIVER = textwrap.dedent("""
    import signal, sys, time
    # a job started in the background inherits SIGINT=ignored; an interactive pytest does not
    signal.signal(signal.SIGINT, signal.default_int_handler)
    sys.path.insert(0, {root!r})
    from pathlib import Path
    from kimi_perf.launcher import LaunchSpec, ServerProcess
    s = LaunchSpec(name="fake", argv_for_port=lambda p: [sys.executable, {fake!r}, str(p), "child"],
                   log_dir=Path({logs!r}))
    srv = ServerProcess(s).start()
    time.sleep(0.5)
    kid = [l for l in srv.tail(10).splitlines() if "grandchild pid=" in l][0].split("=")[1]
    print(srv.pid, kid, flush=True)
    time.sleep(600)
""")


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT, signal.SIGKILL])
def test_interrupted_test_process_leaves_nothing_running(tmp_path, sig):
    code = DRIVER.format(root=str(Path(__file__).resolve().parents[1]), fake=FAKE, logs=str(tmp_path))
    drv = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True)
    line = drv.stdout.readline()
    server_pid, kid = (int(x) for x in line.split())
    assert pid_alive(server_pid)
    drv.send_signal(sig)
    drv.wait(timeout=30)
    assert wait_dead(server_pid, 20), f"server {server_pid} survived {sig.name}"
    if sig != signal.SIGKILL:
        # SIGKILL cannot be handled: PDEATHSIG takes the server down; its grandchild may be orphaned
        # only in that case, which the server's own shutdown handles for real engines.
        assert wait_dead(kid, 20), f"grandchild {kid} survived {sig.name}"
    else:
        os.kill(kid, signal.SIGKILL) if pid_alive(kid) else None


def test_free_port_is_bindable():
    p = free_port()
    with socket.socket() as s:
        s.bind(("127.0.0.1", p))


class _Squatter:
    """An HTTP server on a port that answers 200 to everything: someone else's server."""

    def __init__(self) -> None:
        import http.server
        import threading

        class H(http.server.BaseHTTPRequestHandler):
            def do_GET(self):  # noqa: N802
                self.send_response(200)
                self.send_header("Content-Length", "2")
                self.end_headers()
                self.wfile.write(b"ok")

            def log_message(self, *a):
                pass

        self.httpd = http.server.ThreadingHTTPServer(("127.0.0.1", 0), H)
        self.port = self.httpd.server_address[1]
        threading.Thread(target=self.httpd.serve_forever, daemon=True).start()

    def close(self) -> None:
        self.httpd.shutdown()
        self.httpd.server_close()


def test_a_squatter_answering_health_is_a_bind_failure_not_ready(tmp_path):
    from kimi_perf.launcher import BindFailed

    sq = _Squatter()
    try:
        srv = ServerProcess(spec(tmp_path, "ok"))
        with pytest.raises(BindFailed) as ei:
            srv.start(port=sq.port, attempts=1)
        msg = str(ei.value)
        assert f"could not bind 127.0.0.1:{sq.port}" in msg and f"pid {os.getpid()}" in msg
        assert srv.ready_s is None and wait_dead(srv.pid)
    finally:
        sq.close()


def test_a_squatter_makes_the_launch_retry_on_a_port_it_owns(tmp_path):
    from kimi_perf.launcher import port_owner

    sq = _Squatter()
    try:
        srv = ServerProcess(spec(tmp_path, "ok")).start(port=sq.port)
        try:
            assert srv.port != sq.port and srv.alive()
            assert port_owner(srv.port, srv.pid) == (True, "")
            assert port_owner(sq.port, srv.pid)[0] is False
        finally:
            srv.stop()
    finally:
        sq.close()
