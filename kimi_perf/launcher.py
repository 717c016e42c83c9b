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
  last log lines in every failure message,
- ready only when the process answering ``/health`` is the one launched: the listening socket's owner
  (``/proc/net/tcp*`` inode -> ``/proc/<pid>/fd``) must be the server or a process of its group. An
  HTTP server squatting the port (two sessions racing :func:`free_port`) answered 200 and the launcher
  reported "ready" against it while the real server died of EADDRINUSE; now that is a bind failure,
  said as such with the squatter's pid, and retried on a new port.
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
    "BindFailed",
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


class BindFailed(ServerDied):
    """The server could not bind its port: another process holds it."""


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


# the launcher's pid, in every server's environment: a server that reads it (the reference engine) exits
# at once when its parent is no longer that process, even where PR_SET_PDEATHSIG's SIGTERM is not enough
PARENT_ENV = "KIMI_PERF_PARENT_PID"

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


def _listening_inodes(port: int) -> set[str] | None:
    """Inodes of the TCP sockets listening on ``port`` (any address), or None where /proc cannot say."""
    found: set[str] = set()
    readable = False
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        try:
            lines = Path(table).read_text().splitlines()[1:]
        except OSError:
            continue
        readable = True
        for ln in lines:
            f = ln.split()
            # local_address is ADDR:PORT in hex; state 0A is LISTEN; field 9 the socket inode
            if len(f) > 9 and f[3] == "0A" and int(f[1].rsplit(":", 1)[1], 16) == port:
                found.add(f[9])
    return found if readable else None


def _pid_table() -> dict[int, tuple[int, int]]:
    """pid -> (ppid, pgrp) of every process /proc lists."""
    out = {}
    for d in Path("/proc").iterdir():
        if not d.name.isdigit():
            continue
        try:
            stat = (d / "stat").read_text()
        except OSError:
            continue
        rest = stat[stat.rfind(")") + 2:].split()  # the command name may hold spaces and parentheses
        out[int(d.name)] = (int(rest[1]), int(rest[2]))
    return out


def _holds_socket(pid: int, inodes: set[str]) -> bool:
    try:
        fds = os.listdir(f"/proc/{pid}/fd")
    except OSError:
        return False
    for fd in fds:
        try:
            link = os.readlink(f"/proc/{pid}/fd/{fd}")
        except OSError:
            continue
        if link.startswith("socket:[") and link[8:-1] in inodes:
            return True
    return False


def port_owner(port: int, leader: int) -> tuple[bool | None, str]:
    """Whether the socket listening on ``port`` belongs to ``leader``, its process group or a
    descendant: (True, ""), (False, "pid N (cmdline)") naming the holder, or (None, why) where /proc
    cannot tell (not Linux): the caller then trusts the answer, as before."""
    inodes = _listening_inodes(port)
    if inodes is None:
        return None, "no /proc/net/tcp"
    if not inodes:
        return False, "no process listens there"
    table = _pid_table()

    def ours(pid: int) -> bool:
        seen = 0
        while pid > 1 and seen < 64:
            if pid == leader or table.get(pid, (0, 0))[1] == leader:
                return True
            pid, seen = table.get(pid, (0, 0))[0], seen + 1
        return False

    mine = [p for p in table if ours(p)]
    if any(_holds_socket(p, inodes) for p in mine):
        return True, ""
    for p in table:
        if p not in mine and _holds_socket(p, inodes):
            try:
                cmd = Path(f"/proc/{p}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace").strip()
            except OSError:
                cmd = "?"
            return False, f"pid {p} ({cmd[:120]})"
    return False, "a process this user cannot inspect"


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
        # who answered on our port instead of the launched server, if anyone did (see port_owner)
        self.squatter: str | None = None

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
        self.squatter = None
        log_dir = Path(self.spec.log_dir)
        log_dir.mkdir(parents=True, exist_ok=True)
        self.log_path = log_dir / f"{self.spec.name}-{port}.log"
        argv = [str(a) for a in self.spec.argv_for_port(port)]
        env = {**os.environ, **self.spec.env, PARENT_ENV: str(os.getpid())}
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
                if isinstance(e, BindFailed) and attempt + 1 < attempts:
                    log(f"{self.spec.name}: {e.args[0].split(' (exit code')[0]}; retrying on a new port")
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
                low = self.tail(50).lower()
                if self.squatter or any(m in low for m in self.spec.port_in_use_markers):
                    raise BindFailed(
                        f"{self.spec.name} could not bind {self.spec.host}:{self.port}: the port is held by "
                        f"{self.squatter or 'another process'} (exit code {rc}; log: {self.log_path}); "
                        f"last log lines:\n{self.tail()}", rc)
                raise ServerDied(
                    f"{self.spec.name} exited with code {rc} before becoming ready "
                    f"(log: {self.log_path}); last log lines:\n{self.tail()}", rc)
            status = self._probe()
            now = time.monotonic()
            if status == 200:
                owned, holder = port_owner(self.port, self.proc.pid)  # type: ignore[arg-type]
                if owned is not False:
                    self.ready_s = now - t0
                    log(f"{self.spec.name}: ready in {self.ready_s:.1f}s at {self.base_url}")
                    return self.ready_s
                # someone else answered: not ready; the launched server will usually exit on EADDRINUSE
                self.squatter = holder
            if self.squatter and status is not None:
                phase = f"port {self.port} answered by {self.squatter}, not the launched server"
            else:
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
            time.sleep(0.1 if self.squatter else 0.5)

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
