"""One launcher for every engine: free port, own process group, log file, readiness, teardown.

Why: a merge gate that leaks an 8-GPU server or hangs on a server that never came up is worse than no
gate. Every server (reference, vLLM, SGLang) is started the same way:

- on 127.0.0.1 unless told otherwise, on a port found free just before launch (and a new one if the
  server reports the port taken),
- in its own session/process group (``start_new_session``), so SIGTERM-then-SIGKILL of the *group*
  also ends the workers an engine forks (vLLM's engine core, SGLang's scheduler/detokeniser),
- with ``PR_SET_PDEATHSIG`` so a SIGKILLed pytest still takes its server down, and a module-level
  registry that atexit and signal handlers sweep, so SIGINT/SIGTERM of the test process leaves
  nothing running,
- with a log file per server, progress lines while waiting (phase, elapsed/timeout, log path) and the
  last log lines in every failure message.
"""

from __future__ import annotations

import atexit
import contextlib
import ctypes
import os
import signal
import socket
import subprocess
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from .progress import log

__all__ = [
    "LaunchSpec",
    "ServerDied",
    "ServerError",
    "ServerProcess",
    "ServerTimeout",
    "free_port",
    "kill_all",
    "live_servers",
]


class ServerError(RuntimeError):
    """Base for launch failures; the message carries the log tail."""


class ServerDied(ServerError):
    def __init__(self, msg: str, returncode: int | None) -> None:
        super().__init__(msg)
        self.returncode = returncode


class ServerTimeout(ServerError):
    pass


@dataclass(frozen=True)
class LaunchSpec:
    """What to run. ``argv_for_port`` renders the command for a concrete port."""

    name: str
    argv_for_port: Callable[[int], Sequence[str]]
    env: Mapping[str, str] = field(default_factory=dict)
    host: str = "127.0.0.1"
    health_path: str = "/health"
    ready_timeout_s: float = 600.0
    log_dir: Path = Path("perf-report/logs")
    port_in_use_markers: tuple[str, ...] = ("address already in use", "cannot bind", "errno 98")
    cwd: str | None = None
    cpus: tuple[int, ...] = ()  # CPU affinity of the server and everything it spawns; () = inherited


def free_port(host: str = "127.0.0.1") -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((host, 0))
        return int(s.getsockname()[1])


_LIVE: dict[int, ServerProcess] = {}
_LIVE_LOCK = threading.Lock()


def live_servers() -> list[ServerProcess]:
    with _LIVE_LOCK:
        return list(_LIVE.values())


def kill_all() -> None:
    for srv in live_servers():
        srv.stop(grace_s=5.0)


_PR_SET_PDEATHSIG = 1


def die_with_parent() -> None:
    """``preexec_fn``: the child gets SIGTERM when its parent dies (a SIGKILLed pytest included)."""
    try:
        libc = ctypes.CDLL("libc.so.6", use_errno=True)
        libc.prctl(_PR_SET_PDEATHSIG, signal.SIGTERM)
    except OSError:
        pass


def _child_setup(cpus: tuple[int, ...]) -> Callable[[], None]:
    """``preexec_fn``: :func:`die_with_parent`, and the CPU affinity set in the child before it execs,
    so no engine thread ever runs outside it (setting it on the pid after the launch would race
    the threads the engine starts while importing)."""

    def setup() -> None:
        die_with_parent()
        if cpus:
            os.sched_setaffinity(0, cpus)

    return setup


def _install_handlers() -> None:
    atexit.register(kill_all)
    for sig in (signal.SIGTERM, signal.SIGHUP):
        prev = signal.getsignal(sig)

        def handler(signum: int, frame: object, _prev: object = prev) -> None:
            kill_all()
            if callable(_prev) and _prev not in (signal.SIG_IGN, signal.SIG_DFL):
                _prev(signum, frame)  # type: ignore[operator]
            else:
                raise SystemExit(128 + signum)

        with contextlib.suppress(ValueError):  # not the main thread
            signal.signal(sig, handler)


_handlers_installed = False




class ServerProcess:
    """A launched server. Use as a context manager, or call :meth:`start` and :meth:`stop`."""

    def __init__(self, spec: LaunchSpec, *, progress_every_s: float = 10.0) -> None:
        self.spec = spec
        self.port: int | None = None
        self.proc: subprocess.Popen[bytes] | None = None
        self.log_path: Path | None = None
        self.progress_every_s = progress_every_s
        self.started_at = 0.0
        self.ready_s: float | None = None

    @property
    def base_url(self) -> str:
        return f"http://{self.spec.host}:{self.port}"

    @property
    def pid(self) -> int | None:
        return self.proc.pid if self.proc else None

    def __enter__(self) -> ServerProcess:
        self.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    @property
    def returncode(self) -> int | None:
        return None if self.proc is None else self.proc.poll()

    def tail(self, n: int = 30) -> str:
        if self.log_path is None or not self.log_path.exists():
            return "(no log)"
        data = self.log_path.read_bytes()[-64 * 1024 :].decode("utf-8", errors="replace")
        lines = [ln for ln in data.splitlines() if ln.strip()]
        return "\n".join(lines[-n:])

    def _spawn(self, port: int) -> None:
        global _handlers_installed
        if not _handlers_installed and threading.current_thread() is threading.main_thread():
            _install_handlers()
            _handlers_installed = True
        self.port = port
        log_dir = Path(self.spec.log_dir)
        log_dir.mkdir(parents=True, exist_ok=True)
        self.log_path = log_dir / f"{self.spec.name}-{port}.log"
        argv = [str(a) for a in self.spec.argv_for_port(port)]
        env = {**os.environ, **self.spec.env}
        env.setdefault("PYTHONUNBUFFERED", "1")
        with self.log_path.open("wb") as logf:
            logf.write(f"$ {' '.join(argv)}\n".encode())
            logf.flush()
            self.proc = subprocess.Popen(
                argv, stdout=logf, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, env=env,
                cwd=self.spec.cwd, start_new_session=True, preexec_fn=_child_setup(tuple(self.spec.cpus)),
            )
        with _LIVE_LOCK:
            _LIVE[self.proc.pid] = self
        self.started_at = time.monotonic()
        pin = f", CPUs {','.join(map(str, self.spec.cpus))}" if self.spec.cpus else ""
        log(f"{self.spec.name}: launched pid {self.proc.pid} on {self.spec.host}:{port}{pin} (log: {self.log_path})")

    def start(self, port: int | None = None, *, attempts: int = 3) -> ServerProcess:
        last: ServerError | None = None
        for attempt in range(attempts):
            self._spawn(port if (port is not None and attempt == 0) else free_port(self.spec.host))
            try:
                self.wait_ready()
                return self
            except ServerDied as e:
                last = e
                low = self.tail(50).lower()
                if any(m in low for m in self.spec.port_in_use_markers) and attempt + 1 < attempts:
                    log(f"{self.spec.name}: port {self.port} was taken; retrying on a new port")
                    self.stop()
                    continue
                self.stop()
                raise
            except BaseException:
                self.stop()
                raise
        assert last is not None
        raise last

    def _probe(self) -> int | None:
        url = self.base_url + self.spec.health_path
        try:
            with urllib.request.urlopen(url, timeout=5) as r:  # noqa: S310 - loopback URL we built
                return int(r.status)
        except urllib.error.HTTPError as e:
            return int(e.code)
        except (urllib.error.URLError, ConnectionError, TimeoutError, OSError):
            return None

    def wait_ready(self) -> float:
        assert self.proc is not None
        timeout = self.spec.ready_timeout_s
        t0 = self.started_at
        next_report = t0 + self.progress_every_s
        phase = "starting"
        while True:
            rc = self.proc.poll()
            if rc is not None:
                raise ServerDied(
                    f"{self.spec.name} exited with code {rc} before becoming ready "
                    f"(log: {self.log_path}); last log lines:\n{self.tail()}", rc)
            status = self._probe()
            now = time.monotonic()
            if status == 200:
                self.ready_s = now - t0
                log(f"{self.spec.name}: ready in {self.ready_s:.1f}s at {self.base_url}")
                return self.ready_s
            phase = "loading (health 503)" if status == 503 else (
                f"health {status}" if status else "starting (port not open yet)")
            if now - t0 > timeout:
                msg = (f"{self.spec.name} not ready after {timeout:.0f}s ({phase}; log: {self.log_path}); "
                       f"last log lines:\n{self.tail()}")
                raise ServerTimeout(msg)
            if now >= next_report:
                last = self.tail(1).replace("\n", " ")[:140]
                log(f"{self.spec.name}: {phase}, {now - t0:.0f}s/{timeout:.0f}s (log: {self.log_path}) | {last}")
                next_report = now + self.progress_every_s
            time.sleep(0.5)

    def stop(self, grace_s: float = 15.0) -> int | None:
        """SIGTERM the process group, SIGKILL it after ``grace_s``; returns the exit code."""
        p = self.proc
        if p is None:
            return None
        rc = stop_process_group(p, grace_s)
        with _LIVE_LOCK:
            _LIVE.pop(p.pid, None)
        return rc


def stop_process_group(p: subprocess.Popen[Any], grace_s: float = 15.0) -> int | None:
    """SIGTERM the group that ``p`` leads (started with ``start_new_session``), SIGKILL it after
    ``grace_s``, and escalate while any member survives its leader; returns ``p``'s exit code."""
    try:
        pgid = os.getpgid(p.pid)
    except ProcessLookupError:
        pgid = None
    if p.poll() is None or pgid is not None:
        for sig, wait in ((signal.SIGTERM, grace_s), (signal.SIGKILL, 5.0)):
            try:
                if pgid is not None:
                    os.killpg(pgid, sig)
                else:
                    p.send_signal(sig)
            except ProcessLookupError:
                break
            try:
                p.wait(timeout=wait)
                if pgid is not None and _group_alive(pgid):
                    continue  # leader gone but a worker of the group survived: escalate
                break
            except subprocess.TimeoutExpired:
                continue
    return p.poll()


def _group_alive(pgid: int) -> bool:
    try:
        os.killpg(pgid, 0)
        return True
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
