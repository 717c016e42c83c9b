#!/usr/bin/env python3
"""Run a long measurement on a leased GPU machine across calls that may each last only minutes.

Why: a lent GPU is reached through commands of at most ten minutes each, while a power study, a
drafter training or a flag A/B on SGLang and vLLM runs longer. The machine stays up between calls (and
keeps /tmp) but every call starts from a fresh copy of the working tree. So the job runs in the
background from a copy of the tree under --root, with its log and pid there, and each call either
starts it, waits on it for a bounded time while printing progress, or collects its files into the
folder the call returns ($OUT). The job itself must be resumable (``python -m kimi_perf.power``
continues its JSON; a pytest session per stage), so a machine taken back mid-way costs one stage.

    python scripts/gpu_lease.py start power -- python -m kimi_perf.power --profile h200-llama8b-dummy ...
    python scripts/gpu_lease.py wait power --max-s 540        # progress every 30 s, returns before the limit
    python scripts/gpu_lease.py collect power "$OUT" benchmarks/gate-power.json benchmarks/gate-power.md
    python scripts/gpu_lease.py status power

Exit status: start 0 (or 2 when that job already runs), wait 0 when the job ended with 0, 1 when it
ended otherwise, 3 while it still runs; status 0 running / 1 ended; collect 0.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

DEFAULT_ROOT = "/tmp/kimi-lease"
# never copied into the job's tree: version control, environments, caches, earlier reports, carried wheels
_SKIP = {".git", ".venv", ".venv-vllm", ".venv-sglang-parser", "__pycache__", ".pytest_cache", ".mypy_cache",
         ".ruff_cache", "perf-report", ".hypothesis", ".benchmarks", ".whl"}


def _job(root: str, name: str) -> Path:
    return Path(root) / name


def _state(d: Path) -> dict:
    p = d / "state.json"
    return json.loads(p.read_text()) if p.is_file() else {}


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    # a zombie child of an exited start call still answers kill 0: check /proc
    try:
        return Path(f"/proc/{pid}/stat").read_text().split()[2] != "Z"
    except OSError:
        return True


def _tail(path: Path, n: int = 15) -> str:
    if not path.is_file():
        return "(no log yet)"
    lines = path.read_bytes()[-32_000:].decode("utf-8", errors="replace").splitlines()
    return "\n".join(lines[-n:])


def start(ns: argparse.Namespace) -> int:
    d = _job(ns.root, ns.name)
    st = _state(d)
    if st.get("pid") and _alive(st["pid"]) and st.get("rc") is None:
        print(f"[lease] {ns.name} already runs (pid {st['pid']}, {time.time() - st['t0']:.0f}s); log {d / 'job.log'}")
        return 2
    repo = d / "repo"
    if ns.fresh_tree and repo.exists():
        shutil.rmtree(repo)
    if not repo.exists():
        shutil.copytree(Path.cwd(), repo, ignore=lambda _dir, names: [n for n in names if n in _SKIP], symlinks=True)
    d.mkdir(parents=True, exist_ok=True)
    cmd = list(ns.cmd[1:] if ns.cmd[:1] == ["--"] else ns.cmd)
    if not cmd:
        raise SystemExit("start: give the command after --")
    # the wrapper records the exit code next to the log, so a later call knows how it ended
    wrapper = (f"cd {repo!s} && ( {' '.join(_q(a) for a in cmd)} ) >> {d / 'job.log'!s} 2>&1; "
               f"echo $? > {d / 'rc'!s}")
    (d / "rc").unlink(missing_ok=True)
    p = subprocess.Popen(["bash", "-c", wrapper], start_new_session=True, stdin=subprocess.DEVNULL,
                         stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    (d / "state.json").write_text(json.dumps({"pid": p.pid, "t0": time.time(), "cmd": cmd, "rc": None}))
    print(f"[lease] {ns.name}: started pid {p.pid} in {repo} (log {d / 'job.log'})")
    return 0


def _q(a: str) -> str:
    import shlex

    return shlex.quote(a)


def _rc(d: Path) -> int | None:
    p = d / "rc"
    try:
        return int(p.read_text().strip()) if p.is_file() else None
    except ValueError:
        return None


def status(ns: argparse.Namespace) -> int:
    d = _job(ns.root, ns.name)
    st = _state(d)
    if not st:
        print(f"[lease] {ns.name}: no such job under {ns.root}")
        return 1
    rc = _rc(d)
    running = rc is None and _alive(st["pid"])
    print(f"[lease] {ns.name}: {'running' if running else f'ended (exit {rc})'} after "
          f"{time.time() - st['t0']:.0f}s; log {d / 'job.log'}\n{_tail(d / 'job.log')}")
    return 0 if running else 1


def wait(ns: argparse.Namespace) -> int:
    d = _job(ns.root, ns.name)
    st = _state(d)
    if not st:
        raise SystemExit(f"wait: no job {ns.name} under {ns.root}")
    t0 = time.monotonic()
    last = 0.0
    while True:
        rc = _rc(d)
        if rc is not None or not _alive(st["pid"]):
            print(f"[lease] {ns.name}: ended with exit {rc} after {time.time() - st['t0']:.0f}s\n{_tail(d / 'job.log')}")
            return 0 if rc == 0 else 1
        if time.monotonic() - t0 >= ns.max_s:
            print(f"[lease] {ns.name}: still running after {time.time() - st['t0']:.0f}s (waited {ns.max_s:.0f}s); "
                  f"call wait again\n{_tail(d / 'job.log', 5)}")
            return 3
        if time.monotonic() - last >= ns.every:
            last = time.monotonic()
            print(f"[lease] {ns.name}: running, {time.time() - st['t0']:.0f}s | {_tail(d / 'job.log', 1)}", flush=True)
        time.sleep(1.0)


def collect(ns: argparse.Namespace) -> int:
    d = _job(ns.root, ns.name)
    out = Path(ns.out) / ns.name
    out.mkdir(parents=True, exist_ok=True)
    for f in ("job.log", "state.json", "rc"):
        if (d / f).is_file():
            shutil.copy2(d / f, out / f)
    for rel in ns.paths:
        src = d / "repo" / rel
        if src.is_dir():
            shutil.copytree(src, out / rel, dirs_exist_ok=True)
        elif src.is_file():
            (out / rel).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(src, out / rel)
        else:
            print(f"[lease] {ns.name}: {rel} does not exist (yet)")
    print(f"[lease] {ns.name}: collected into {out}")
    return 0


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--root", default=DEFAULT_ROOT, help=f"where jobs live (default {DEFAULT_ROOT}; survives calls)")
    sub = ap.add_subparsers(dest="verb", required=True)
    s = sub.add_parser("start", help="copy this tree (first start only) and run CMD in the background")
    s.add_argument("name")
    s.add_argument("--fresh-tree", action="store_true", help="copy the tree again even if the job has one")
    s.add_argument("cmd", nargs=argparse.REMAINDER)
    w = sub.add_parser("wait", help="wait for the job, at most --max-s seconds, printing progress")
    w.add_argument("name")
    w.add_argument("--max-s", type=float, default=540.0)
    w.add_argument("--every", type=float, default=30.0)
    c = sub.add_parser("collect", help="copy the log and PATHS (relative to the job's tree) into OUT/NAME")
    c.add_argument("name")
    c.add_argument("out")
    c.add_argument("paths", nargs="*")
    t = sub.add_parser("status", help="running or ended, and the log's tail")
    t.add_argument("name")
    ns = ap.parse_args(argv)
    return {"start": start, "wait": wait, "collect": collect, "status": status}[ns.verb](ns)


if __name__ == "__main__":
    sys.exit(main())
