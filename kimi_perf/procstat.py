"""CPU time of a server's process tree and the host's steal time, read from ``/proc``.

Why: on a shared CPU box (the 2-core CI runner) wall-clock speed moves with whatever else the host
does -- a neighbour VM's burst shows up as *steal* time, and a stalled vCPU slows every repeat it
touches by 25-45%. Two numbers resist that noise:

- the engine's own CPU seconds per output token: time the hypervisor stole from us is not charged to
  the process (Linux accounts it as steal, not user/system time), so a code change that does more work
  per token moves it while a noisy neighbour mostly does not;
- the host's steal fraction over a repeat, which says whether that repeat ran on a healthy machine at
  all. The A/B gate redoes a repeat whose steal fraction exceeds the profile's limit.

Both are read without psutil (``/proc/<pid>/stat`` fields 14-15 and 5, ``/proc/stat``'s ``cpu`` line,
see proc(5)); on a system without ``/proc`` the readers return None and the metrics are simply absent.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

__all__ = ["HostCPU", "ProcessTreeCPU", "group_cpu_seconds", "host_cpu"]

_TICK = os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 100


def _stat_fields(pid: int) -> list[str] | None:
    try:
        raw = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    # the command name (field 2) is in parentheses and may contain spaces: split after the last ')'
    rest = raw[raw.rfind(")") + 2 :].split()
    return rest  # rest[0] is field 3 (state)


def group_cpu_seconds(pgid: int) -> float | None:
    """User + system CPU seconds of every live process in process group ``pgid``, including the CPU
    time of children they have reaped. None when ``/proc`` is unavailable or the group is gone.

    Servers are started in their own session (:mod:`kimi_perf.launcher`), so the group is exactly the
    server and the workers it forked (vLLM's engine core, SGLang's scheduler)."""
    proc = Path("/proc")
    if not proc.is_dir():
        return None
    total = 0
    found = False
    for d in proc.iterdir():
        if not d.name.isdigit():
            continue
        f = _stat_fields(int(d.name))
        # fields (1-based, proc(5)): 5 pgrp, 14 utime, 15 stime, 16 cutime, 17 cstime -> rest[i - 3]
        if f is None or len(f) < 15 or int(f[2]) != pgid:
            continue
        found = True
        total += int(f[11]) + int(f[12]) + int(f[13]) + int(f[14])
    return total / _TICK if found else None


@dataclass(frozen=True)
class ProcessTreeCPU:
    """CPU seconds a process group used between two readings."""

    pgid: int
    start: float | None

    @classmethod
    def begin(cls, pgid: int) -> ProcessTreeCPU:
        return cls(pgid, group_cpu_seconds(pgid))

    def elapsed(self) -> float | None:
        end = group_cpu_seconds(self.pgid)
        if end is None or self.start is None:
            return None
        return max(0.0, end - self.start)


@dataclass(frozen=True)
class HostCPU:
    """Aggregate jiffies of the host's ``cpu`` line in ``/proc/stat``."""

    total: int
    steal: int
    idle: int

    def steal_fraction_since(self, earlier: HostCPU) -> float | None:
        dt = self.total - earlier.total
        if dt <= 0:
            return None
        return (self.steal - earlier.steal) / dt


def host_cpu() -> HostCPU | None:
    try:
        line = Path("/proc/stat").read_text().splitlines()[0]
    except (OSError, IndexError):
        return None
    parts = line.split()
    if not parts or parts[0] != "cpu":
        return None
    v = [int(x) for x in parts[1:]]
    # user nice system idle iowait irq softirq steal [guest guest_nice]; guest time is already counted
    # in user, so the total is the first eight fields
    v = (v + [0] * 8)[:8]
    return HostCPU(total=sum(v), steal=v[7], idle=v[3] + v[4])
