"""pytest-xdist and the suite's engine servers: each worker its own GPU(s), or ``-n`` refused.

Why: every xdist worker is its own process with its own server pool, so ``-n N`` launches up to N
servers of each engine. On a cuda profile each of them would see every GPU and start on GPU 0, measuring
each other's load. The controller therefore gives worker *i* its own slice of the visible GPUs through
``CUDA_VISIBLE_DEVICES`` (the profile's ``min_gpus`` each; the servers a worker launches inherit it) and
refuses ``-n`` beyond what the visible GPUs allow, as a usage error naming the fix. On a CPU profile the
N servers share the cores: allowed (unit tests use ``-n`` too), and the run header says so, since
numbers measured that way are not comparable to a baseline recorded without ``-n``.

The check reads the profile only when ``-n`` asks for two or more workers and the profile loads; a
broken or missing profile is left to the session, which reports it if a selected test needs it.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import pytest

__all__ = ["WORKER_KEY", "check_workers", "header_lines"]

WORKER_KEY = "kimi_perf_cuda_visible_devices"  # in each worker's workerinput
_NOTE = pytest.StashKey[str]()


def _n_workers(config: pytest.Config) -> int:
    """Workers xdist will start (after its ``-n auto``/``--maxprocesses`` resolution), 0 without xdist."""
    if getattr(config.option, "dist", "no") == "no":
        return 0
    return len(getattr(config.option, "tx", None) or [])


def _profile(config: pytest.Config) -> Any:
    from .options import _opt
    from .profiles import ProfileError, find_profile, load_profile

    try:
        return load_profile(find_profile(str(_opt(config, "perf_profile")),
                                         [Path(str(config.rootpath)) / "profiles", Path.cwd() / "profiles"]))
    except (ProfileError, OSError):
        return None


def _visible_ids(n_gpus: int) -> list[str]:
    vis = os.environ.get("CUDA_VISIBLE_DEVICES")
    if vis is not None and vis.strip():
        return [v.strip() for v in vis.split(",") if v.strip() and v.strip() != "-1"][:n_gpus]
    return [str(i) for i in range(n_gpus)]


class _AssignGpus:
    """Controller-side xdist hook: each worker's GPU slice goes into its workerinput."""

    def __init__(self, slices: list[str]) -> None:
        self.slices = slices

    def pytest_configure_node(self, node: Any) -> None:
        wid = str(node.workerinput.get("workerid", node.gateway.id))
        idx = int(wid[2:]) if wid[2:].isdigit() else 0
        node.workerinput[WORKER_KEY] = self.slices[idx % len(self.slices)]


def check_workers(config: pytest.Config) -> None:
    """Called from the plugin's ``pytest_configure``: on a worker, take its GPU slice; on the controller,
    plan the slices (cuda) or note the shared cores (cpu), or refuse ``-n``."""
    wi = getattr(config, "workerinput", None)
    if wi is not None:
        if wi.get(WORKER_KEY) is not None:
            os.environ["CUDA_VISIBLE_DEVICES"] = wi[WORKER_KEY]
        return
    n = _n_workers(config)
    if n < 2:
        return
    profile = _profile(config)
    if profile is None:
        return
    if profile.hardware != "cuda":
        config.stash[_NOTE] = (
            f"kimi-perf: -n {n} on CPU profile {profile.name}: if perf tests run, each xdist worker launches its "
            f"own server of every engine its tests use (up to {n} per engine), sharing {os.cpu_count()} CPU "
            "cores; perf numbers measured so are not comparable to baselines recorded without -n")
        return
    from .machine import gpu_info

    ids = _visible_ids(len(gpu_info()))
    per = max(1, profile.min_gpus)
    if n * per > len(ids):
        fit = len(ids) // per
        raise pytest.UsageError(
            f"-n {n}: profile {profile.name} is a cuda profile and every xdist worker launches its own engine "
            f"servers on {per} GPU(s) of its own, so {n} workers need {n * per} GPUs; this machine has {len(ids)} "
            f"visible. Fix: " + (f"-n {fit} or fewer, or " if fit >= 2 else "") + "run without -n (one process "
            "shares one server per engine across the tests)")
    slices = [",".join(ids[i * per:(i + 1) * per]) for i in range(n)]
    config.pluginmanager.register(_AssignGpus(slices), "kimi-perf-xdist-gpus")
    config.stash[_NOTE] = (f"kimi-perf: -n {n} on cuda profile {profile.name}: worker i gets CUDA_VISIBLE_DEVICES "
                           + ", ".join(f"gw{i}={s}" for i, s in enumerate(slices)))


def header_lines(config: pytest.Config) -> list[str]:
    note = config.stash.get(_NOTE, None)
    return [note] if note else []
