"""The target runner: its Python and platform tags, and what it already has installed."""

from __future__ import annotations

import os
import re
from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from ._base import DEFAULT_PLATFORMS, TARGETS_DIR, WheelhouseError, canonical_name


def expand_platforms(spec: str | Iterable[str]) -> tuple[str, ...]:
    """Platform tags for pip's ``--platform``: ``manylinux_2_17..2_39_x86_64`` expands to every glibc
    minor in the range, newest first, plus the legacy aliases (manylinux2014 = 2_17, manylinux2010 =
    2_12, manylinux1 = 2_5) that fall in it; other tags pass through. pip matches each given tag
    exactly, so a range is the safe way to accept every wheel a glibc-2.39 target can load."""
    items = [spec] if isinstance(spec, str) else list(spec)
    out: list[str] = []
    for item in items:
        for tag in (t.strip() for t in item.split(",")):
            if not tag:
                continue
            m = re.fullmatch(r"manylinux_(\d+)_(\d+)\.\.(\d+)_(\d+)_(\w+)", tag)
            if not m:
                out.append(tag)
                continue
            major, lo, major2, hi, arch = int(m[1]), int(m[2]), int(m[3]), int(m[4]), m[5]
            if major != major2 or lo > hi:
                raise WheelhouseError(
                    f"platform range {tag!r}: write it as manylinux_2_LO..2_HI_ARCH, LO <= HI"
                )
            for minor in range(hi, lo - 1, -1):
                out.append(f"manylinux_{major}_{minor}_{arch}")
            aliases = {17: "manylinux2014", 12: "manylinux2010", 5: "manylinux1"}
            out += [f"{alias}_{arch}" for minor, alias in aliases.items() if major == 2 and lo <= minor <= hi]
    return tuple(dict.fromkeys(out))


@dataclass(frozen=True)
class TargetSpec:
    """The interpreter and platform the wheelhouse is for (not this machine)."""

    python: str = "3.12"  # "3.12" or, better for python_full_version markers, "3.12.3"
    platforms: tuple[str, ...] = field(default_factory=lambda: expand_platforms(DEFAULT_PLATFORMS))
    implementation: str = "cp"

    def __post_init__(self) -> None:
        bad = []
        if not re.fullmatch(r"3\.\d+(\.\d+)?", self.python):
            bad.append(f"python {self.python!r} (write 3.12 or 3.12.3)")
        if self.implementation not in ("cp", "pp"):
            bad.append(f"implementation {self.implementation!r} (cp or pp)")
        if not self.platforms:
            bad.append("no platform tags (give --platform manylinux_2_17..2_39_x86_64)")
        machines = {self._machine(p) for p in self.platforms}
        if None in machines:
            bad.append(
                f"platforms {list(self.platforms)} (Linux tags only: manylinux_*, musllinux_*, linux_*)"
            )
        elif len(machines) > 1:
            bad.append(
                f"platforms of several machines {sorted(m for m in machines if m)} (one target at a time)"
            )
        if bad:
            raise ValueError("TargetSpec: invalid " + "; ".join(bad))

    @staticmethod
    def _machine(tag: str) -> str | None:
        m = re.fullmatch(
            r"(?:manylinux\w*?|musllinux_\d+_\d+|linux)_(x86_64|aarch64|i686|ppc64le|s390x|armv7l)", tag
        )
        return m[1] if m else None

    @property
    def python_short(self) -> str:
        return ".".join(self.python.split(".")[:2])

    @property
    def machine(self) -> str:
        return self._machine(self.platforms[0]) or ""

    def marker_env(self) -> dict[str, str]:
        """PEP 508 marker variables of the target (Linux only; release/version strings unknown)."""
        full = self.python if self.python.count(".") == 2 else self.python + ".0"
        cpython = self.implementation == "cp"
        return {
            "implementation_name": "cpython" if cpython else "pypy",
            "implementation_version": full,
            "os_name": "posix",
            "platform_machine": self.machine,
            "platform_python_implementation": "CPython" if cpython else "PyPy",
            "platform_release": "",
            "platform_system": "Linux",
            "platform_version": "",
            "python_full_version": full,
            "python_version": self.python_short,
            "sys_platform": "linux",
            "extra": "",
        }

    def pip_args(self) -> list[str]:
        args = [
            "--only-binary=:all:",
            "--python-version",
            self.python,
            "--implementation",
            self.implementation,
        ]
        for p in self.platforms:
            args += ["--platform", p]
        return args

    def describe(self) -> str:
        minors = sorted(int(m[1]) for p in self.platforms if (m := re.fullmatch(r"manylinux_2_(\d+)_\w+", p)))
        span = f"manylinux_2_{minors[0]}..2_{minors[-1]}" if len(minors) > 1 else ",".join(self.platforms)
        return f"{self.implementation}{self.python} {self.machine}, {span}"

    def to_dict(self) -> dict[str, Any]:
        return {
            "python": self.python,
            "implementation": self.implementation,
            "platforms": list(self.platforms),
            "marker_env": self.marker_env(),
        }


@dataclass(frozen=True)
class InstalledPackage:
    """A package the target already has; ``version`` None: listed without one (any version)."""

    name: str
    version: str | None = None


_NAME = r"[A-Za-z0-9](?:[A-Za-z0-9._-]*[A-Za-z0-9])?"


def parse_target_list(text: str, source: str = "target list") -> dict[str, InstalledPackage]:
    """The target's installed packages by canonical name, from ``pip list --format=freeze`` lines
    (``name==version``, ``name @ url``), ``pip list`` table rows (``name version [location]``) or bare
    names (present, version unknown). ``#`` starts a comment."""
    out: dict[str, InstalledPackage] = {}
    for lineno, raw in enumerate(text.splitlines(), 1):
        line = raw.split("#", 1)[0].strip()
        if not line or line.startswith(("-e ", "--")) or re.fullmatch(r"[-\s]+", line):
            continue
        if re.fullmatch(r"Package\s+Version(\s+.*)?", line, re.IGNORECASE):
            continue
        m = re.fullmatch(rf"({_NAME})\s*(?:\[[^\]]*\])?\s*===?\s*(\S+)", line) or re.fullmatch(
            rf"({_NAME})\s+(\d\S*)(?:\s+\S.*)?", line
        )
        if m:
            out[canonical_name(m[1])] = InstalledPackage(m[1], m[2])
            continue
        m = re.fullmatch(rf"({_NAME})(?:\s*(?:\[[^\]]*\])?\s*@\s*\S+)?", line)
        if m:
            out[canonical_name(m[1])] = InstalledPackage(m[1], None)
            continue
        raise WheelhouseError(
            f"{source}:{lineno}: cannot read {raw.strip()!r}; write `pip list --format=freeze` lines "
            "(name==version), `pip list` table rows (name version) or a bare name (present, any version)"
        )
    return out


def load_target_list(ref: str | os.PathLike[str] | None) -> tuple[dict[str, InstalledPackage], str | None]:
    """A target list by path, or by the name of a bundled one under ``kimi_perf/wheelhouse_targets``."""
    if ref is None:
        return {}, None
    path = Path(ref)
    if not path.exists() and os.sep not in str(ref):
        path = TARGETS_DIR / (str(ref) if str(ref).endswith(".txt") else f"{ref}.txt")
    if not path.exists():
        known = sorted(p.stem for p in TARGETS_DIR.glob("*.txt"))
        raise WheelhouseError(
            f"target list {ref!r} not found; give a file with the target's "
            f"`pip list --format=freeze` output or one of the bundled ones: {known}"
        )
    return parse_target_list(path.read_text(), str(path)), str(path)
