"""Disjoint CPU sets for the two sides of an A/B comparison and the client (``ab.pin_cpus``).

Why: a small model on a big GPU is host-CPU bound (the scheduler, sampling and HTTP layers of the
engine run on the host), and in a same-run A/B two servers and the load client share that host. When
the OS scheduler moves an engine thread onto a core the other server or the client is busy on, one
repeat is slower for reasons that have nothing to do with the change under test. Pinning each
server and the client to their own cores removes that source of noise; whether it actually narrows
the A/A interval on a given machine is measured with ``python -m kimi_perf.power --set pin_cpus=true``
against the same study without it (``docs/ab-gate.md``).

Whole physical cores go to one party: SMT siblings (``/sys/devices/system/cpu/cpuN/topology/
thread_siblings_list``) are kept together, because two hyperthreads of one core share its execution
units and a sibling shared between sides would couple them again. The client gets ``client`` CPUs
first (rounded up to whole cores), the remaining cores are split evenly between base and candidate;
a core left over by an odd count stays unused so both sides get the same number of CPUs. Fewer
than three cores (client, base, candidate) cannot be split: the plan says so and nothing is pinned.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

# the host's core topology is machine.py's (run.json records it too); pinning only splits it
from ..machine import core_groups

__all__ = ["CPUPlan", "core_groups", "plan_cpus"]


@dataclass(frozen=True)
class CPUPlan:
    """Which CPUs the client and each side run on (empty tuples when not pinned, with ``why``)."""

    pinned: bool
    client: tuple[int, ...] = ()
    sides: dict[str, tuple[int, ...]] = field(default_factory=dict)
    why: str = ""

    def describe(self) -> str:
        if not self.pinned:
            return f"not pinned: {self.why}"
        return (f"client on CPUs {_ranges(self.client)}, base on {_ranges(self.sides['base'])}, "
                f"candidate on {_ranges(self.sides['candidate'])}")

    def to_json(self) -> dict[str, Any]:
        d: dict[str, Any] = {"pinned": self.pinned}
        if self.pinned:
            d.update(client=list(self.client), **{k: list(v) for k, v in self.sides.items()})
        else:
            d["why"] = self.why
        return d


def _ranges(cpus: Sequence[int]) -> str:
    """``[0, 1, 2, 5]`` -> ``"0-2,5"`` (the kernel's cpulist format)."""
    out: list[str] = []
    for c in sorted(cpus):
        if out and "-" in out[-1] and int(out[-1].split("-")[1]) == c - 1:
            out[-1] = f"{out[-1].split('-')[0]}-{c}"
        elif out and "-" not in out[-1] and int(out[-1]) == c - 1:
            out[-1] = f"{out[-1]}-{c}"
        else:
            out.append(str(c))
    return ",".join(out)


def plan_cpus(available: Sequence[int], *, client: int = 2,
              siblings: Callable[[int], set[int]] | None = None) -> CPUPlan:
    """Split ``available`` (this process's affinity) into client, base and candidate sets
    (``siblings``: a CPU's SMT siblings; default the kernel's sysfs topology)."""
    groups = core_groups(available, siblings) if siblings is not None else core_groups(available)
    take: list[int] = []
    i = 0
    while i < len(groups) and len(take) < client:
        take.extend(groups[i])
        i += 1
    rest = groups[i:]
    if not take or len(rest) < 2:
        return CPUPlan(False, why=f"{len(groups)} physical core(s) available ({_ranges(available)}); pinning needs "
                                  f"cores for the client ({client} CPU) and at least one per side")
    half = len(rest) // 2
    base = tuple(c for g in rest[:half] for c in g)
    cand = tuple(c for g in rest[half:2 * half] for c in g)
    return CPUPlan(True, client=tuple(take), sides={"base": base, "candidate": cand})
