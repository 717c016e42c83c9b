"""Offline wheelhouse builder: bring an inference engine to an air-gapped GPU runner as wheels, in parts.

Why: GPU runners are often air-gapped -- our lent H200 box reaches nothing outside itself -- and what
can be carried to one is capped per transfer (64 MiB a call there). An engine such as
``sglang==0.5.17`` or ``vllm==0.26.0`` therefore has to arrive as wheels, split into parts, and only
the wheels the runner lacks: its torch, CUDA libraries and most of the scientific stack are already
installed, and re-carrying them would cost gigabytes and could shadow the runner's own builds.

What it does (``plan`` stops after step 3, ``build`` does all of it):

1. Resolve the engine's closure for the *target* (Python version, manylinux platform tags,
   implementation), not for this machine, with pip itself: ``pip install --dry-run --ignore-installed
   --only-binary=:all: --python-version X --implementation cp --platform ... --target TMP --report
   FILE SPEC`` and pip's installation report (format version 1; pip's documentation page
   "Installation Report", https://pip.pypa.io/en/stable/reference/installation-report/). ``--pin``
   requirements go to pip as constraints, so they steer the resolver without becoming roots.
   pip evaluates environment markers with the interpreter it runs in, not with ``--python-version``
   (pypa/pip#11010, pypa/pip#13296), so pip is run by an interpreter of the target's Python version
   when one is found here; either way the closure is walked again below with every
   ``Requires-Dist`` marker evaluated for the target (``packaging``), and a requirement the target
   needs but the report lacks is added as a root and the closure resolved again.
2. Leave out what the target already has: its ``pip list --format=freeze`` (or ``pip list`` table)
   output, compared by PEP 503 name. A package is left out when the target's version satisfies every
   specifier that the carried part of the closure puts on it; when it does not (sglang 0.5.17 pins
   ``transformers==5.12.1``, the target has 5.17.0) the package is carried and reported as a
   ``clash:`` line -- the wheelhouse goes first on PYTHONPATH, so the carried version wins
   (``--trust-target NAME`` keeps the target's instead). A name listed without a version counts as
   present at a version that satisfies (listed as unverified).
3. Leave out documented runtime-unused packages (name globs with a reason each; built-in defaults per
   engine version, below), and whatever is only needed by left-out packages (torch's CUDA wheels when
   the target has torch, tilelang's z3-solver when tilelang is left out).
4. Download the kept wheels (``pip download --no-deps --only-binary=:all:`` with the same target
   flags; files the index serves from a local ``file://`` mirror are copied), check each sha256 against
   the report, optionally repack kernel wheels without members the target never loads (RECORD
   rewritten, a build tag added to the file name so the copy is told apart from PyPI's), pack them into
   one deterministic tar split into ``<name>.tar.part-NNN`` files of at most ``--part-size`` (60 MiB by
   default), and write ``MANIFEST.json`` (parts, their sha256 and the whole tar's, kept / left-out /
   clash lists with reasons, the target) and ``install.sh``, which on the target checks the parts,
   reassembles and checks the tar, and runs ``python3 -m pip install --no-index --no-deps --target``.
5. ``stage`` puts one part (and install.sh, MANIFEST.json) into a folder that one transfer carries,
   so parts travel one call at a time.

Observed 2026-12 on an H200 (Python 3.12.3, torch 2.11.0+cu130, transformers 5.17.0, tokenizers
0.23.2 on the runner), with launches that served requests; these are the built-in defaults
(``ENGINE_DEFAULTS``; ``--no-defaults`` drops them, ``--keep NAME`` keeps one package):

- sglang 0.5.17 (upstream: sgl-project/sglang, ``python/pyproject.toml``; the facts below are read
  from the published wheels' ``Requires-Dist``): left out
  ``tokenspeed-*``, ``nvidia-cutlass-dsl*``, ``nvidia-nvvm``, ``nvidia-cuda-nvcc``,
  ``nvidia-cuda-cccl``, ``nvidia-cuda-crt``, ``nvidia-cuda-nvdisasm``, ``tilelang``, ``z3-solver``,
  ``nvidia-mathdx``, ``modelscope``, ``py-spy``, ``humming-kernels``, ``pyelftools``. It pins
  ``transformers==5.12.1`` (which needs ``tokenizers<=0.23.0``), so with the runner's transformers 5.17
  both ``transformers==5.12.1`` and ``tokenizers==0.22.2`` are carried (default pins). Its kernel wheel
  ``sglang-kernel==0.4.5`` is 383 MB, of which ``sgl_kernel/flash_ops.abi3.so`` (FA3) is 342 MB
  compressed and ``sgl_kernel/sm100/*`` 16 MB; on an H200 only ``sgl_kernel/sm90/common_ops`` loads, so
  ``--repack 'sglang-kernel:sgl_kernel/flash_ops.abi3.so,sgl_kernel/sm100/*'`` (H200 only: it breaks
  Blackwell and FA3) cuts it to 25.3 MB (measured on the built wheelhouse).
- vllm 0.26.0 (upstream: vllm-project/vllm, ``requirements/``; read from the published wheels'
  ``Requires-Dist``): left out ``tokenspeed-*``, ``nvidia-cutlass-dsl*``, ``nvidia-nvvm``,
  ``nvidia-cuda-nvcc``, ``nvidia-cuda-cccl``, ``nvidia-cuda-crt``, ``nvidia-cuda-nvdisasm``,
  ``tilelang``, ``pynvvideocodec``, ``z3-solver``, ``torchcodec``, ``fastsafetensors``,
  ``quack-kernels``, ``humming-kernels``. vllm pins ``apache-tvm-ffi==0.1.10`` while xgrammar 0.2.9
  (mlc-ai/xgrammar) requires ``apache-tvm-ffi>=0.1.11``; ``apache-tvm-ffi==0.1.11`` is carried instead
  (default override, applied after resolution and reported). pip alone settles the conflict by
  backtracking to xgrammar 0.2.7 (``>=0.1.10``), which 0.1.11 also satisfies.

Found by this module's own resolution (2026-12, not from a launch): mistral_common 1.13.1, in both
closures, requires ``numpy<2.4``, so numpy 2.3.5 is carried over the runner's 2.5.2 (a clash line);
``--trust-target numpy`` would keep the runner's.

    python -m kimi_perf.wheelhouse plan  --spec sglang==0.5.17 --python 3.12.3 \\
        --target-list h200-torch2.11-cu130
    python -m kimi_perf.wheelhouse build --spec sglang==0.5.17 --python 3.12.3 \\
        --target-list h200-torch2.11-cu130 \\
        --repack 'sglang-kernel:sgl_kernel/flash_ops.abi3.so,sgl_kernel/sm100/*' --out /work/wheelhouse/sglang
    python -m kimi_perf.wheelhouse stage --out /work/wheelhouse/sglang --part 0 --into .carry/wheelhouse

docs/wheelhouse.md has the walk-through.
"""

from __future__ import annotations

import argparse
import fnmatch
import hashlib
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
from collections import defaultdict, deque
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field, replace
from enum import Enum
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:  # packaging is imported lazily: `import kimi_perf.wheelhouse` stays cheap
    from packaging.requirements import Requirement

__all__ = [
    "ENGINE_DEFAULTS",
    "EngineDefaults",
    "Exclusion",
    "InstalledPackage",
    "Override",
    "PackResult",
    "PartInfo",
    "Plan",
    "PlanEntry",
    "RepackResult",
    "RepackRule",
    "ResolvedPackage",
    "Status",
    "TargetSpec",
    "WheelhouseError",
    "apply_overrides",
    "build",
    "canonical_name",
    "defaults_for",
    "expand_platforms",
    "main",
    "make_plan",
    "pack_parts",
    "parse_part_size",
    "parse_report",
    "parse_target_list",
    "repack_wheel",
    "resolve_and_plan",
    "split_file",
    "stage_part",
    "write_install_sh",
]

_HERE = Path(__file__).resolve().parent
TARGETS_DIR = _HERE / "wheelhouse_targets"
MIB = 1 << 20
DEFAULT_PART_SIZE = 60 * MIB
DEFAULT_PLATFORMS = "manylinux_2_17..2_39_x86_64"
# Fixed tar member mtime (2026-01-01 UTC): the tar, and so every part, is byte-identical for the same
# wheels, and GNU tar does not warn about "implausibly old" 1970 stamps as it would for 0.
_TAR_MTIME = 1767225600


class WheelhouseError(RuntimeError):
    """A failure whose message says what to change."""


def _say(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


def canonical_name(name: str) -> str:
    """PEP 503 normalisation: runs of ``-_.`` become ``-``, lower case."""
    return re.sub(r"[-_.]+", "-", name).lower()


def _packaging() -> Any:
    """The ``packaging`` modules, imported on first use (pip and pytest depend on it, so it is there)."""
    try:
        import packaging.markers
        import packaging.requirements
        import packaging.specifiers
        import packaging.version
    except ImportError as e:  # pragma: no cover - pip itself vendors its own copy, so say how to get one
        raise WheelhouseError("the wheelhouse needs the 'packaging' library: pip install packaging") from e
    return packaging


# ---------------------------------------------------------------------------------------------------
# The target


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


# ---------------------------------------------------------------------------------------------------
# pip's installation report


@dataclass(frozen=True)
class ResolvedPackage:
    """One item of the resolved closure (one ``install`` entry of pip's report)."""

    name: str
    version: str
    url: str
    sha256: str | None = None
    requires_dist: tuple[str, ...] = ()
    requested: bool = False
    requested_extras: tuple[str, ...] = ()
    size: int | None = None  # bytes of the wheel, when known (the report does not say)

    @property
    def key(self) -> str:
        return canonical_name(self.name)

    @property
    def filename(self) -> str:
        from urllib.parse import unquote, urlparse

        return unquote(urlparse(self.url).path.rsplit("/", 1)[-1])

    @property
    def label(self) -> str:
        return f"{self.name} {self.version}"


def parse_report(report: Mapping[str, Any]) -> tuple[ResolvedPackage, ...]:
    """The ``install`` items of a pip installation report (format version 1, pip >= 22.2)."""
    version = str(report.get("version"))
    if version != "1":
        raise WheelhouseError(
            f"pip installation report version {version!r}; this reads version 1 "
            "(pip 22.2 or newer writes it): upgrade or downgrade the resolving pip"
        )
    out = []
    for item in report.get("install", []):
        md = item.get("metadata", {})
        di = item.get("download_info", {})
        name, ver, url = md.get("name", "?"), md.get("version", "?"), di.get("url", "")
        if "dir_info" in di or "vcs_info" in di or not url.endswith(".whl"):
            raise WheelhouseError(
                f"{name} {ver} resolved to {url!r}, not a wheel from an index; a wheelhouse "
                "carries released wheels only: --pin it to a version that has one"
            )
        ai = di.get("archive_info", {})
        sha = (ai.get("hashes") or {}).get("sha256")
        if sha is None and str(ai.get("hash", "")).startswith("sha256="):
            sha = ai["hash"].split("=", 1)[1]
        out.append(
            ResolvedPackage(
                name=name,
                version=ver,
                url=url,
                sha256=sha,
                requires_dist=tuple(md.get("requires_dist") or ()),
                requested=bool(item.get("requested")),
                requested_extras=tuple(item.get("requested_extras") or ()),
            )
        )
    return tuple(out)


# ---------------------------------------------------------------------------------------------------
# Exclusions, overrides, repacks and the per-engine defaults


@dataclass(frozen=True)
class Exclusion:
    """Packages (a PEP 503 name glob: ``tokenspeed-*``) left out, and why."""

    pattern: str
    reason: str = "left out on the command line"

    def matches(self, name: str) -> bool:
        return fnmatch.fnmatchcase(canonical_name(name), canonical_name(self.pattern))

    @classmethod
    def parse(cls, text: str) -> Exclusion:
        """``GLOB`` or ``GLOB:REASON``."""
        pattern, _, reason = text.partition(":")
        if not pattern.strip():
            raise WheelhouseError(f"--exclude {text!r}: give a package name glob, e.g. 'tokenspeed-*:reason'")
        return cls(pattern.strip(), reason.strip() or "left out on the command line")


@dataclass(frozen=True)
class Override:
    """Carry ``name==version`` instead of what the resolver chose (applied after resolution, because
    pip cannot resolve against an engine's own exact pin)."""

    requirement: str
    reason: str = "given on the command line"

    def __post_init__(self) -> None:
        if not re.fullmatch(rf"{_NAME}==[^\s=;,]+", self.requirement):
            raise ValueError(f"override {self.requirement!r}: write NAME==VERSION (one exact version)")

    @property
    def name(self) -> str:
        return self.requirement.split("==", 1)[0]

    @property
    def version(self) -> str:
        return self.requirement.split("==", 1)[1]

    @property
    def key(self) -> str:
        return canonical_name(self.name)


@dataclass(frozen=True)
class RepackRule:
    """Drop the wheel members of ``package`` that match any of ``patterns`` (fnmatch; ``*`` also
    crosses ``/``)."""

    package: str
    patterns: tuple[str, ...]
    reason: str = ""

    @classmethod
    def parse(cls, text: str) -> RepackRule:
        """``PACKAGE:PATTERN[,PATTERN...]``."""
        pkg, _, pats = text.partition(":")
        patterns = tuple(p.strip() for p in pats.split(",") if p.strip())
        if not pkg.strip() or not patterns:
            raise WheelhouseError(
                f"--repack {text!r}: write PACKAGE:PATTERN[,PATTERN...], e.g. "
                "'sglang-kernel:sgl_kernel/flash_ops.abi3.so,sgl_kernel/sm100/*'"
            )
        return cls(pkg.strip(), patterns)

    def to_cli(self) -> str:
        return f"{self.package}:{','.join(self.patterns)}"


@dataclass(frozen=True)
class EngineDefaults:
    """What was observed to work for one engine release: exclusions, pins, overrides, repack hints."""

    engine: str
    version: str
    excludes: tuple[Exclusion, ...] = ()
    pins: tuple[str, ...] = ()
    overrides: tuple[Override, ...] = ()
    repack_hints: tuple[RepackRule, ...] = ()
    observed: str = ""


_OBSERVED = (
    "observed 2026-12 on an H200 (Python 3.12.3, torch 2.11.0+cu130): a launch without these "
    "packages served requests"
)
_LAUNCH = "left out in a launch that served requests"
_TOOLCHAIN = (
    "CUDA compiler toolchain wheel (pulled via humming-kernels[cu13] / nvidia-cutlass-dsl-libs) "
    f"for JIT builds; {_LAUNCH}"
)
_COMMON_EXCLUDES = (
    Exclusion(
        "tokenspeed-*",
        f"TokenSpeed MLA kernels and their Triton fork (tokenspeed-mla, tokenspeed-triton); {_LAUNCH}",
    ),
    Exclusion(
        "nvidia-cutlass-dsl*",
        f"CUTLASS CuTe Python DSL and its per-CUDA libraries, used to JIT CuTe kernels; {_LAUNCH}",
    ),
    Exclusion("nvidia-nvvm", _TOOLCHAIN),
    Exclusion("nvidia-cuda-nvcc", _TOOLCHAIN),
    Exclusion("nvidia-cuda-cccl", _TOOLCHAIN),
    Exclusion("nvidia-cuda-crt", _TOOLCHAIN),
    Exclusion("nvidia-cuda-nvdisasm", _TOOLCHAIN),
    Exclusion("tilelang", f"TileLang kernel compiler; {_LAUNCH}"),
    Exclusion("z3-solver", f"SMT solver needed by tilelang only; {_LAUNCH}"),
    Exclusion("humming-kernels", f"humming-kernels[cu13] (pulls the nvcc wheels); {_LAUNCH}"),
)

ENGINE_DEFAULTS: tuple[EngineDefaults, ...] = (
    EngineDefaults(
        engine="sglang",
        version="0.5.17",
        excludes=_COMMON_EXCLUDES
        + (
            Exclusion("nvidia-mathdx", f"MathDx device-library headers for JIT builds; {_LAUNCH}"),
            Exclusion(
                "modelscope", f"ModelScope hub client, only for models fetched from ModelScope; {_LAUNCH}"
            ),
            Exclusion("py-spy", f"sampling profiler, a debugging aid; {_LAUNCH}"),
            Exclusion("pyelftools", f"ELF reader needed by humming-kernels only; {_LAUNCH}"),
        ),
        # sglang 0.5.17 pins transformers==5.12.1, whose tokenizers<=0.23.0 rejects the runner's 0.23.2;
        # pinned here too so a resolution with a looser spec (e.g. --spec sglang) keeps the known pair.
        pins=("transformers==5.12.1", "tokenizers==0.22.2"),
        repack_hints=(
            RepackRule(
                "sglang-kernel",
                ("sgl_kernel/flash_ops.abi3.so", "sgl_kernel/sm100/*"),
                "H200 (sm90) only: FA3's flash_ops (342 MB) and the sm100 build never load "
                "there; only sm90/common_ops does",
            ),
        ),
        observed=_OBSERVED,
    ),
    EngineDefaults(
        engine="vllm",
        version="0.26.0",
        excludes=_COMMON_EXCLUDES
        + (
            Exclusion("pynvvideocodec", f"NVIDIA video codec bindings for video inputs; {_LAUNCH}"),
            Exclusion("torchcodec", f"audio/video decoding for multimodal inputs; {_LAUNCH}"),
            Exclusion(
                "fastsafetensors",
                f"optional GPU-direct weight loader (--load-format fastsafetensors); {_LAUNCH}",
            ),
            Exclusion(
                "quack-kernels", f"CuTe-DSL kernels (need nvidia-cutlass-dsl, left out too); {_LAUNCH}"
            ),
        ),
        overrides=(
            Override(
                "apache-tvm-ffi==0.1.11",
                "vllm 0.26.0 pins apache-tvm-ffi==0.1.10 but xgrammar 0.2.9 requires >=0.1.11; "
                "0.1.11 is what the served launch ran",
            ),
        ),
        observed=_OBSERVED,
    ),
)


def defaults_for(specs: Sequence[str]) -> tuple[list[EngineDefaults], list[str]]:
    """The built-in defaults for the specs that name a known engine release exactly, and notes for
    specs that name a known engine at another version (whose defaults were never observed)."""
    pk = _packaging()
    found, notes = [], []
    for spec in specs:
        try:
            req = pk.requirements.Requirement(spec)
        except pk.requirements.InvalidRequirement as e:
            raise WheelhouseError(
                f"--spec {spec!r} is not a requirement ({e}); write e.g. sglang==0.5.17"
            ) from e
        known = [d for d in ENGINE_DEFAULTS if canonical_name(d.engine) == canonical_name(req.name)]
        exact = [d for d in known if str(req.specifier) == f"=={d.version}"]
        if exact:
            found.append(exact[0])
        elif known:
            notes.append(
                f"no observed defaults for {spec} (known: "
                f"{', '.join(f'{d.engine}=={d.version}' for d in known)}); nothing is left out as unused "
                "unless --exclude says so"
            )
    return found, notes


# ---------------------------------------------------------------------------------------------------
# The plan: what is carried, what is left out, and why


class Status(str, Enum):
    CARRY = "carry"  # kept: needed and not on the target
    CLASH = "clash"  # kept: on the target, at a version the closure rejects
    OVERRIDE = "override"  # kept: an --override version instead of the resolved one
    ON_TARGET = "on-target"  # left out: the target's version satisfies the closure
    UNUSED = "unused"  # left out: documented runtime-unused
    PRUNED = "pruned"  # left out: only needed by left-out packages
    NOT_NEEDED = "not-needed"  # left out: no requirement whose marker holds on the target leads to it

    @property
    def kept(self) -> bool:
        return self in (Status.CARRY, Status.CLASH, Status.OVERRIDE)


@dataclass(frozen=True)
class PlanEntry:
    name: str
    version: str
    status: Status
    reason: str
    size: int | None = None
    requested_by: tuple[str, ...] = ()
    url: str = ""
    sha256: str | None = None

    @property
    def key(self) -> str:
        return canonical_name(self.name)

    @property
    def filename(self) -> str:
        return ResolvedPackage(self.name, self.version, self.url).filename

    def to_dict(self) -> dict[str, Any]:
        return {
            "name": self.name,
            "version": self.version,
            "status": self.status.value,
            "reason": self.reason,
            "size": self.size,
            "requested_by": list(self.requested_by),
            "url": self.url,
            "sha256": self.sha256,
        }


def _mb(n: int | None) -> str:
    return "?" if n is None else f"{n / 1e6:.1f}"


@dataclass(frozen=True)
class Plan:
    target: TargetSpec
    entries: tuple[PlanEntry, ...]
    missing: tuple[str, ...] = ()  # requirements the target needs that neither the closure nor the target has
    unverified: tuple[str, ...] = ()  # left out as on the target, but its version there is unknown
    notes: tuple[str, ...] = ()

    @property
    def kept(self) -> tuple[PlanEntry, ...]:
        return tuple(e for e in self.entries if e.status.kept)

    @property
    def left_out(self) -> tuple[PlanEntry, ...]:
        return tuple(e for e in self.entries if not e.status.kept)

    @property
    def clash_lines(self) -> tuple[str, ...]:
        return tuple(e.reason for e in self.entries if e.status in (Status.CLASH, Status.OVERRIDE))

    def entry(self, name: str) -> PlanEntry:
        key = canonical_name(name)
        for e in self.entries:
            if e.key == key:
                return e
        raise KeyError(name)

    @staticmethod
    def _total(entries: Iterable[PlanEntry]) -> tuple[int, bool]:
        sizes = [e.size for e in entries]
        return sum(s or 0 for s in sizes), any(s is None for s in sizes)

    def table(self) -> str:
        """The kept / left-out table with sizes (MB = 10^6 bytes), biggest first within each status."""
        order = list(Status)
        rows = sorted(self.entries, key=lambda e: (order.index(e.status), -(e.size or 0), e.key))
        w = max([len(e.name) for e in rows] + [7])
        lines = [f"{'status':<10}  {'package':<{w}}  {'version':<22}  {'MB':>8}  reason / needed by"]
        for e in rows:
            why = e.reason
            if e.status is Status.CARRY and len(e.requested_by) > 4:
                why = (
                    why.split(", needed by ")[0]
                    if why.startswith("requested")
                    else "needed by " + ", ".join(e.requested_by[:4]) + f" ... ({len(e.requested_by)})"
                )
            lines.append(f"{e.status.value:<10}  {e.name:<{w}}  {e.version:<22}  {_mb(e.size):>8}  {why}")
        kept_b, kept_q = self._total(self.kept)
        out_b, out_q = self._total(self.left_out)
        by_status = ", ".join(
            f"{s.value} {n}" for s in Status if (n := sum(e.status is s for e in self.entries))
        )
        lines.append("")
        lines.append(
            f"target {self.target.describe()}: carry {len(self.kept)} wheels, {_mb(kept_b)} MB"
            f"{' + unknown' if kept_q else ''}; leave out {len(self.left_out)}, {_mb(out_b)} MB"
            f"{' + unknown' if out_q else ''} ({by_status})"
        )
        for line in self.clash_lines:
            lines.append(line)
        if self.unverified:
            import textwrap

            lines += textwrap.wrap(
                f"unverified ({len(self.unverified)} listed on the target without a version, "
                f"assumed to satisfy): " + ", ".join(self.unverified),
                110,
                subsequent_indent="  ",
            )
        for line in self.missing:
            lines.append(f"missing: {line}")
        for line in self.notes:
            lines.append(f"note: {line}")
        return "\n".join(lines)

    def to_dict(self) -> dict[str, Any]:
        kept_b, _ = self._total(self.kept)
        return {
            "target": self.target.to_dict(),
            "kept": [e.to_dict() for e in self.kept],
            "left_out": [e.to_dict() for e in self.left_out],
            "clashes": list(self.clash_lines),
            "unverified": list(self.unverified),
            "missing": list(self.missing),
            "notes": list(self.notes),
            "kept_bytes": kept_b,
        }


def _spec_text(req: Requirement) -> str:
    return str(req.specifier) or "any version"


def make_plan(
    packages: Sequence[ResolvedPackage],
    target: TargetSpec,
    *,
    roots: Sequence[str] = (),
    installed: Mapping[str, InstalledPackage] | None = None,
    exclusions: Sequence[Exclusion] = (),
    overridden: Mapping[str, tuple[str, Override]] | None = None,
    trusted: Iterable[str] = (),
    notes: Sequence[str] = (),
) -> Plan:
    """Decide, for every package of the resolved closure, whether it is carried and why.

    The closure is walked from ``roots`` (requirement strings; default: the report's requested
    packages) along ``Requires-Dist`` whose markers hold on the target (with the extras requested on
    the way). The walk does not go through a package that is left out -- documented unused, or on the
    target at a version satisfying every specifier the carried packages put on it -- so what only those
    need is left out too. A target version that stops satisfying once another carried package adds a
    specifier turns the package into a carried clash and the walk continues through it.
    ``overridden`` maps canonical names to (the resolved version, the Override now in ``packages``);
    ``trusted`` names target packages left out even where their version misses a specifier (an
    over-strict upper bound, say), reported as such.
    """
    pk = _packaging()
    Requirement_ = pk.requirements.Requirement
    env = target.marker_env()
    installed = dict(installed or {})
    overridden = dict(overridden or {})
    trusted = {canonical_name(t) for t in trusted}
    by_key = {p.key: p for p in packages}
    note_list = list(notes)

    def deps(p: ResolvedPackage, extras: frozenset[str]) -> list[Requirement]:
        out = []
        for s in p.requires_dist:
            try:
                r = Requirement_(s)
            except pk.requirements.InvalidRequirement:
                note_list.append(f"{p.label}: unreadable requirement {s!r} skipped")
                continue
            if r.marker is None or any(r.marker.evaluate({**env, "extra": e}) for e in ("", *sorted(extras))):
                out.append(r)
        return out

    root_reqs: list[tuple[str, Requirement]] = []
    for s in roots or [
        p.name + (f"[{','.join(p.requested_extras)}]" if p.requested_extras else "")
        for p in packages
        if p.requested
    ]:
        try:
            r = Requirement_(s)
        except pk.requirements.InvalidRequirement as e:
            raise WheelhouseError(f"{s!r} is not a requirement ({e}); write e.g. sglang==0.5.17") from e
        if r.marker is None or r.marker.evaluate(env):
            root_reqs.append(("requested", r))

    def excluded_by(key: str) -> Exclusion | None:
        return next((x for x in exclusions if x.matches(key)), None)

    def unmet(key: str, specs: Iterable[tuple[str, Requirement]]) -> list[tuple[str, Requirement]]:
        have = installed[key].version
        if have is None:
            return []
        try:
            v = pk.version.Version(have)
        except pk.version.InvalidVersion:
            return []  # unparseable target version: treated like an unknown one
        return [(who, r) for who, r in specs if not r.specifier.contains(v, prereleases=True)]

    def walk(
        stopping: bool,
    ) -> tuple[
        dict[str, set[str]], set[str], dict[str, list[tuple[str, Requirement]]], list[tuple[str, Requirement]]
    ]:
        visited: dict[str, set[str]] = {}
        expanded: set[str] = set()
        specs: dict[str, list[tuple[str, Requirement]]] = defaultdict(list)
        missing: list[tuple[str, Requirement]] = []
        queue: deque[tuple[str, frozenset[str]]] = deque()
        for who, r in root_reqs:
            k = canonical_name(r.name)
            specs[k].append((who, r))
            queue.append((k, frozenset(canonical_name(e) for e in r.extras)))
        while queue:
            key, extras = queue.popleft()
            if key not in by_key:
                continue
            seen = visited.get(key)
            if seen is not None and key in expanded and extras <= seen:
                continue
            visited[key] = (seen or set()) | extras
            if stopping and left_out(key, specs[key]):
                continue
            expanded.add(key)
            p = by_key[key]
            for r in deps(p, frozenset(visited[key])):
                k = canonical_name(r.name)
                specs[k].append((p.label, r))
                if k in by_key:
                    queue.append((k, frozenset(canonical_name(e) for e in r.extras)))
                elif stopping and excluded_by(k) is None and (k not in installed or unmet(k, [(p.label, r)])):
                    missing.append((p.label, r))
        return visited, expanded, specs, missing

    def left_out(key: str, specs: list[tuple[str, Requirement]]) -> bool:
        if excluded_by(key) is not None:
            return True
        if key not in installed:
            return False
        if key in overridden:
            return installed[key].version == by_key[key].version
        return key in trusted or not unmet(key, specs)

    full_visited, _, full_specs, _ = walk(stopping=False)
    visited, expanded, specs, missing = walk(stopping=True)

    parents: dict[str, list[str]] = defaultdict(list)
    for k, lst in full_specs.items():
        own = by_key[k].label if k in by_key else None
        for who, _r in lst:
            if who not in parents[k] and who != own:  # pkg[extra] -> pkg is no parent
                parents[k].append(who)
    status_of: dict[str, Status] = {}
    for p in packages:
        if p.key in expanded:
            status_of[p.key] = (
                Status.OVERRIDE
                if p.key in overridden
                else (Status.CLASH if p.key in installed else Status.CARRY)
            )
        elif p.key in visited:
            status_of[p.key] = Status.UNUSED if excluded_by(p.key) else Status.ON_TARGET
        elif p.key in full_visited:
            status_of[p.key] = Status.PRUNED
        else:
            status_of[p.key] = Status.NOT_NEEDED
    label_status = {by_key[k].label: s for k, s in status_of.items()}

    entries, unverified = [], []
    for p in packages:
        st = status_of[p.key]
        mine = specs[p.key] if p.key in visited else full_specs[p.key]
        spec_txt = ", ".join(f"{_spec_text(r)} ({who})" for who, r in mine) or "any version"
        have = installed.get(p.key)
        if st is Status.CARRY:
            others = [w for w in parents[p.key] if w != "requested"]
            reason = ", ".join(
                (["requested"] if "requested" in parents[p.key] else [])
                + (["needed by " + ", ".join(others)] if others else [])
            )
        elif st is Status.CLASH:
            bad = unmet(p.key, mine)
            need = ",".join(sorted({str(r.specifier) for _, r in bad}))
            who = ", ".join(dict.fromkeys(w for w, _ in bad))
            reason = (
                f"clash: the target's {p.name} {have.version if have else '?'} does not satisfy {need}, "
                f"carried {p.version} (required by {who})"
            )
        elif st is Status.OVERRIDE:
            old, ov = overridden[p.key]
            v = pk.version.Version(p.version)
            broken = [
                f"{who} requires {_spec_text(r)}" for who, r in mine if not r.specifier.contains(v, True)
            ]
            reason = (
                f"override: carried {p.name} {p.version} instead of the resolved {old}"
                f"{' although ' + '; '.join(broken) if broken else ''} -- {ov.reason}"
            )
        elif st is Status.UNUSED:
            x = excluded_by(p.key)
            reason = f"unused ({x.pattern}): {x.reason}" if x else "unused"
        elif st is Status.ON_TARGET and have is not None and have.version is None:
            reason = f"on the target (version not listed; assumed to satisfy {spec_txt})"
            clauses = sorted({str(c) for _, r in mine for c in r.specifier})
            unverified.append(f"{p.name} {','.join(clauses) or '(any)'}")
        elif st is Status.ON_TARGET and (bad := unmet(p.key, mine)):
            need = ",".join(sorted({str(r.specifier) for _, r in bad}))
            reason = (
                f"on the target: {p.name} {have.version if have else '?'} trusted (--trust-target) although "
                f"{', '.join(dict.fromkeys(w for w, _ in bad))} require {need}"
            )
        elif st is Status.ON_TARGET:
            reason = f"on the target: {p.name} {have.version if have else '?'} satisfies {spec_txt}"
        elif st is Status.PRUNED:
            why = [f"{w} ({label_status[w].value})" for w in parents[p.key] if w in label_status]
            reason = "only needed by left-out packages: " + ", ".join(why)
        else:
            reason = "no requirement whose marker holds on the target leads to it"
        entries.append(
            PlanEntry(p.name, p.version, st, reason, p.size, tuple(parents[p.key]), p.url, p.sha256)
        )

    missing_lines = []
    for who, r in dict.fromkeys(missing):
        k = canonical_name(r.name)
        on = f"; the target has {installed[k].version}" if k in installed else ""
        missing_lines.append(f"{_req_text(r)} (needed by {who}{on}) is not in the resolved closure")
    return Plan(
        target,
        tuple(entries),
        tuple(dict.fromkeys(missing_lines)),
        tuple(unverified),
        tuple(dict.fromkeys(note_list)),
    )


def _req_text(r: Requirement) -> str:
    """The requirement without its marker: what to resolve as an extra root."""
    return r.name + (f"[{','.join(sorted(r.extras))}]" if r.extras else "") + str(r.specifier)


def apply_overrides(
    packages: Sequence[ResolvedPackage],
    overrides: Sequence[Override],
    fetch: Callable[[Override], ResolvedPackage],
) -> tuple[tuple[ResolvedPackage, ...], dict[str, tuple[str, Override]], list[str]]:
    """Replace resolved packages by their ``--override`` versions; ``fetch`` resolves one override
    alone (pip with ``--no-deps``). Returns the packages, {key: (resolved version, override)}, notes.
    An override of a package that is not in the closure is added as a requested package."""
    out = list(packages)
    done: dict[str, tuple[str, Override]] = {}
    notes = []
    for ov in overrides:
        idx = next((i for i, p in enumerate(out) if p.key == ov.key), None)
        if idx is not None and out[idx].version == ov.version:
            notes.append(f"override {ov.requirement}: the resolver already chose it")
            continue
        new = fetch(ov)
        if idx is None:
            out.append(replace(new, requested=True))
            notes.append(f"override {ov.requirement}: not in the closure, carried as requested")
            done[ov.key] = ("(none)", ov)
        else:
            done[ov.key] = (out[idx].version, ov)
            out[idx] = replace(new, requested=out[idx].requested, requested_extras=out[idx].requested_extras)
    return tuple(out), done, notes


# ---------------------------------------------------------------------------------------------------
# Running pip


def find_resolver_python(target: TargetSpec) -> tuple[str, str | None]:
    """An interpreter of the target's major.minor that has pip (so pip evaluates markers as the target
    would), else this one with a note."""
    want = target.python_short
    if f"{sys.version_info[0]}.{sys.version_info[1]}" == want:
        return sys.executable, None
    cands: list[str] = []
    if w := shutil.which(f"python{want}"):
        cands.append(w)
    pyenv = Path(os.environ.get("PYENV_ROOT", Path.home() / ".pyenv"))
    cands += [str(p) for p in sorted(pyenv.glob(f"versions/{want}.*/bin/python{want}"), reverse=True)]
    cands += [f"/usr/bin/python{want}", f"/usr/local/bin/python{want}"]
    for c in dict.fromkeys(cands):
        if not Path(c).exists():
            continue
        try:
            r = subprocess.run(
                [c, "-c", "import sys, pip; print('%d.%d' % sys.version_info[:2])"],
                capture_output=True,
                text=True,
                timeout=60,
            )
        except (OSError, subprocess.TimeoutExpired):
            continue
        if r.returncode == 0 and r.stdout.strip() == want:
            return c, None
    return sys.executable, (
        f"no Python {want} with pip found here: pip ran under Python "
        f"{sys.version_info[0]}.{sys.version_info[1]}, "
        "which evaluates markers for itself (pypa/pip#11010); the closure was re-checked with the target's "
        "markers. Pass --resolver-python PATH for an exact resolution"
    )


def _pip_error(log: str, what: str, target: TargetSpec) -> WheelhouseError:
    lines = [ln for ln in log.splitlines() if not ln.startswith("WARNING: Location")]
    first = next((i for i, ln in enumerate(lines) if ln.startswith("ERROR:")), max(0, len(lines) - 30))
    msg = "\n".join(lines[max(0, first - 15) :][:60])
    text = "\n".join(lines)
    if "ResolutionImpossible" in text or "conflict is caused by" in text:
        fix = (
            "the requirements conflict for this target. Pin one side with --pin NAME==VERSION (a constraint "
            "for the resolver), or carry a version an engine's own pin rejects with --override NAME==VERSION "
            "(applied after resolution)."
        )
    elif m := re.search(r"No matching distribution found for (\S+)", text):
        fix = (
            f"no wheel of {m[1]} fits {target.describe()}: add the wheel's platform tag with --platform "
            "(e.g. manylinux_2_35_x86_64), check --python, or --pin a version that has such a wheel; "
            "a package "
            "published only as an sdist cannot be carried."
        )
    elif re.search(r"NewConnectionError|Max retries|Temporary failure in name resolution|timed out", text):
        fix = (
            "pip could not reach the package index: this step needs the network "
            "(or --pip-arg=--index-url=MIRROR)."
        )
    else:
        fix = "read pip's message above; --pip-arg passes options through to pip."
    return WheelhouseError(f"pip {what} failed:\n{msg}\n-> {fix}")


def _run_pip(python: str, args: Sequence[str], log_path: Path, what: str, target: TargetSpec) -> None:
    cmd = [python, "-m", "pip", *args]
    with open(log_path, "w") as log:
        log.write("$ " + " ".join(cmd) + "\n")
        log.flush()
        r = subprocess.run(cmd, stdout=log, stderr=subprocess.STDOUT, text=True)
    if r.returncode != 0:
        raise _pip_error(log_path.read_text(), what, target)


def pip_report(
    requirements: Sequence[str],
    target: TargetSpec,
    *,
    python: str,
    workdir: Path,
    constraints: Sequence[str] = (),
    no_deps: bool = False,
    pip_args: Sequence[str] = (),
    tag: str = "resolve",
) -> dict[str, Any]:
    """pip's installation report for ``requirements`` resolved for ``target`` (nothing installed)."""
    workdir.mkdir(parents=True, exist_ok=True)
    report = workdir / f"pip-report-{tag}.json"
    args = [
        "install",
        "--dry-run",
        "--ignore-installed",
        "--disable-pip-version-check",
        "--progress-bar",
        "off",
        "--report",
        str(report),
        *target.pip_args(),
    ]
    if no_deps:
        args.append("--no-deps")
    if constraints:
        cfile = workdir / f"constraints-{tag}.txt"
        cfile.write_text("".join(c + "\n" for c in constraints))
        args += ["-c", str(cfile)]
    with tempfile.TemporaryDirectory(prefix="wheelhouse-target-") as tdir:
        # pip refuses --platform/--python-version without --target (or a dry run, on newer pips)
        _run_pip(
            python,
            [*args, "--target", tdir, *pip_args, *requirements],
            workdir / f"pip-{tag}.log",
            f"resolution ({tag})",
            target,
        )
    return json.loads(report.read_text())


def fetch_sizes(
    packages: Sequence[ResolvedPackage], workers: int = 8, timeout: float = 30.0
) -> dict[str, int]:
    """Wheel sizes by URL: stat for ``file://`` URLs, one HTTP HEAD each otherwise (failures stay unknown)."""
    import ssl
    import urllib.request
    from concurrent.futures import ThreadPoolExecutor
    from urllib.parse import unquote, urlparse

    # the CA bundle pip is told to use, if any (a proxy with its own CA), else the system's
    ctx = ssl.create_default_context(
        cafile=os.environ.get("PIP_CERT") or os.environ.get("SSL_CERT_FILE") or None
    )

    def one(url: str) -> tuple[str, int | None]:
        u = urlparse(url)
        try:
            if u.scheme == "file":
                return url, os.path.getsize(unquote(u.path))
            req = urllib.request.Request(url, method="HEAD")
            with urllib.request.urlopen(req, timeout=timeout, context=ctx) as r:
                n = r.headers.get("Content-Length")
                return url, int(n) if n else None
        except (OSError, ValueError):
            return url, None

    urls = list(dict.fromkeys(p.url for p in packages if p.url))
    with ThreadPoolExecutor(max_workers=workers) as ex:
        return {u: n for u, n in ex.map(one, urls) if n is not None}


def resolve_and_plan(
    specs: Sequence[str],
    target: TargetSpec,
    *,
    installed: Mapping[str, InstalledPackage] | None = None,
    exclusions: Sequence[Exclusion] = (),
    pins: Sequence[str] = (),
    overrides: Sequence[Override] = (),
    workdir: Path,
    resolver_python: str | None = None,
    report: Mapping[str, Any] | None = None,
    pip_args: Sequence[str] = (),
    sizes: bool = True,
    trusted: Iterable[str] = (),
    notes: Sequence[str] = (),
    say: Callable[[str], None] = _say,
    max_rounds: int = 3,
) -> Plan:
    """Resolve ``specs`` for ``target`` with pip (or read ``report``), apply overrides, and plan.

    When the target-marker walk finds requirements the report lacks (pip ran under another Python),
    they are added as roots and the closure resolved again, at most ``max_rounds`` times."""
    note_list = list(notes)
    trusted = tuple(trusted)
    found: list[str] = [resolver_python] if resolver_python else []

    def python() -> str:  # found on first use: a plan from --report without overrides runs no pip
        if not found:
            exe, note = find_resolver_python(target)
            if note:
                note_list.append(note)
                say(f"note: {note}")
            found.append(exe)
        return found[0]

    roots = list(specs)
    fetched: dict[str, ResolvedPackage] = {}

    def fetch(ov: Override) -> ResolvedPackage:
        if ov.key not in fetched:
            say(f"resolving override {ov.requirement} ...")
            got = parse_report(
                pip_report(
                    [ov.requirement],
                    target,
                    python=python(),
                    workdir=workdir,
                    no_deps=True,
                    pip_args=pip_args,
                    tag=f"override-{ov.key}",
                )
            )
            fetched[ov.key] = next(p for p in got if p.key == ov.key)
        return fetched[ov.key]

    for rnd in range(1, max_rounds + 1):
        if report is not None:
            rep: Mapping[str, Any] = report
        else:
            exe = python()
            say(f"resolving {' '.join(roots)} for {target.describe()} with {exe} (round {rnd}) ...")
            t0 = time.monotonic()
            rep = pip_report(
                roots,
                target,
                python=exe,
                workdir=workdir,
                constraints=pins,
                pip_args=pip_args,
                tag=f"round{rnd}",
            )
            say(f"  {len(rep.get('install', []))} packages in {time.monotonic() - t0:.0f} s")
        packages, overridden, ov_notes = apply_overrides(parse_report(rep), overrides, fetch)
        plan = make_plan(
            packages,
            target,
            roots=roots if specs else (),
            installed=installed,
            exclusions=exclusions,
            overridden=overridden,
            trusted=trusted,
            notes=note_list + ov_notes,
        )
        if not plan.missing or report is not None or rnd == max_rounds:
            break
        extra = list(dict.fromkeys(line.split(" (needed by", 1)[0] for line in plan.missing))
        say("  the target needs what the report lacks (markers): " + ", ".join(extra) + "; resolving again")
        note_list.append("added as roots for the target's markers: " + ", ".join(extra))
        roots += [e for e in extra if e not in roots]
    if sizes:
        say(f"sizing {len(packages)} wheels ...")
        got = fetch_sizes(packages)
        packages = tuple(replace(p, size=got.get(p.url)) for p in packages)
        plan = make_plan(
            packages,
            target,
            roots=roots if specs else (),
            installed=installed,
            exclusions=exclusions,
            overridden=overridden,
            trusted=trusted,
            notes=plan.notes,
        )
    return plan


# ---------------------------------------------------------------------------------------------------
# Repacking a wheel


@dataclass(frozen=True)
class RepackResult:
    source: Path
    wheel: Path
    dropped: tuple[str, ...]
    bytes_before: int
    bytes_after: int

    @property
    def saved(self) -> int:
        return self.bytes_before - self.bytes_after

    def to_dict(self) -> dict[str, Any]:
        return {
            "source": self.source.name,
            "wheel": self.wheel.name,
            "dropped": list(self.dropped),
            "bytes_before": self.bytes_before,
            "bytes_after": self.bytes_after,
            "saved": self.saved,
        }


def _record_hash(h: Any) -> str:
    import base64

    return "sha256=" + base64.urlsafe_b64encode(h.digest()).rstrip(b"=").decode()


def repack_wheel(
    src: Path,
    dest_dir: Path,
    patterns: Sequence[str],
    *,
    build_tag: str | None = "1repack",
) -> RepackResult:
    """Write ``src`` without the members matching ``patterns`` into ``dest_dir``.

    RECORD is rewritten (sha256 and size of every remaining file; signatures dropped, since they
    would no longer verify). With ``build_tag`` the file name gets that wheel build tag
    (``name-ver-1repack-py-abi-plat.whl``, recorded in WHEEL as ``Build:``): pip accepts it, the version
    and its dist-info stay unchanged, and the copy is not mistaken for the index's file. A pattern
    that matches nothing is an error (a typo would otherwise carry the whole wheel)."""
    import csv
    import io
    import zipfile

    parts = src.name[:-4].split("-")
    if not src.name.endswith(".whl") or len(parts) not in (5, 6):
        raise WheelhouseError(
            f"{src.name} is not a wheel file name (name-version[-build]-py-abi-platform.whl)"
        )
    if build_tag is not None and not re.fullmatch(r"\d[A-Za-z0-9_.]*", build_tag):
        raise WheelhouseError(f"build tag {build_tag!r}: it must start with a digit and hold no '-'")
    dist, ver, tags = parts[0], parts[1], parts[-3:]
    name = "-".join([dist, ver, *([build_tag] if build_tag else parts[2:-3]), *tags]) + ".whl"
    dest_dir.mkdir(parents=True, exist_ok=True)
    dest = dest_dir / name
    if dest.resolve() == src.resolve():
        raise WheelhouseError(f"repack of {src} would overwrite it: give another --dest or a build tag")
    with zipfile.ZipFile(src) as zin:
        infos = zin.infolist()
        records = [i.filename for i in infos if re.fullmatch(r"[^/]+\.dist-info/RECORD", i.filename)]
        if len(records) != 1:
            raise WheelhouseError(
                f"{src.name} has {len(records)} top-level */*.dist-info/RECORD; not a valid wheel"
            )
        distinfo = records[0].rsplit("/", 1)[0]
        dropped = [i.filename for i in infos if any(fnmatch.fnmatchcase(i.filename, p) for p in patterns)]
        unmatched = [p for p in patterns if not any(fnmatch.fnmatchcase(i.filename, p) for i in infos)]
        if unmatched:
            tops = sorted({i.filename.split("/")[0] + "/" for i in infos})
            raise WheelhouseError(
                f"repack {src.name}: pattern(s) {unmatched} match no member; its top-level "
                f"entries are {tops} (list all with: unzip -l {src.name})"
            )
        if any(d.startswith(distinfo + "/") for d in dropped):
            raise WheelhouseError(
                f"repack {src.name}: the patterns match {distinfo}/ files; a wheel needs them"
            )
        drop = set(dropped) | {f"{distinfo}/RECORD", f"{distinfo}/RECORD.jws", f"{distinfo}/RECORD.p7s"}
        rows: list[tuple[str, str, str]] = []
        tmp = dest.with_name(dest.name + ".part")
        with zipfile.ZipFile(tmp, "w", zipfile.ZIP_DEFLATED, allowZip64=True) as zout:
            for info in infos:
                if info.filename in drop or info.is_dir():
                    continue
                zi = zipfile.ZipInfo(info.filename, date_time=info.date_time)
                zi.external_attr = info.external_attr
                zi.compress_type = (
                    zipfile.ZIP_DEFLATED if info.compress_type != zipfile.ZIP_STORED else zipfile.ZIP_STORED
                )
                h, n = hashlib.sha256(), 0
                if info.filename == f"{distinfo}/WHEEL" and build_tag is not None:
                    text = zin.read(info).decode()
                    text = re.sub(r"(?m)^Build:.*\n?", "", text).rstrip("\n") + f"\nBuild: {build_tag}\n"
                    data = text.encode()
                    h.update(data)
                    n = len(data)
                    zout.writestr(zi, data)
                else:
                    with (
                        zin.open(info) as fin,
                        zout.open(zi, "w", force_zip64=info.file_size > 0x7FFFFFFF) as fout,
                    ):
                        while chunk := fin.read(4 * MIB):
                            h.update(chunk)
                            n += len(chunk)
                            fout.write(chunk)
                rows.append((info.filename, _record_hash(h), str(n)))
            buf = io.StringIO()
            writer = csv.writer(buf, lineterminator="\n")
            writer.writerows(rows)
            writer.writerow((f"{distinfo}/RECORD", "", ""))
            zout.writestr(
                zipfile.ZipInfo(f"{distinfo}/RECORD", date_time=(2026, 1, 1, 0, 0, 0)),
                buf.getvalue(),
                compress_type=zipfile.ZIP_DEFLATED,
            )
        tmp.replace(dest)
    return RepackResult(src, dest, tuple(dropped), src.stat().st_size, dest.stat().st_size)


# ---------------------------------------------------------------------------------------------------
# Packing and splitting


@dataclass(frozen=True)
class PartInfo:
    file: str
    size: int
    sha256: str


@dataclass(frozen=True)
class PackResult:
    parts: tuple[PartInfo, ...]
    tar_size: int
    tar_sha256: str
    members: tuple[str, ...] = ()


def parse_part_size(text: str | int) -> int:
    """``60M`` (MiB), ``512K``, ``1G`` or a byte count."""
    if isinstance(text, int):
        return text
    m = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([KMG]i?B?|B)?\s*", text, re.IGNORECASE)
    if not m:
        raise WheelhouseError(f"part size {text!r}: write e.g. 60M (MiB), 512K or a byte count")
    mult = {"": 1, "b": 1, "k": 1 << 10, "m": 1 << 20, "g": 1 << 30}[(m[2] or "")[:1].lower()]
    n = int(float(m[1]) * mult)
    if n < 1024:
        raise WheelhouseError(f"part size {text!r} is under 1 KiB; give e.g. 60M")
    return n


class _PartWriter:
    """A write-only stream that cuts what it receives into ``<name>.tar.part-NNN`` files."""

    def __init__(self, out_dir: Path, name: str, part_size: int) -> None:
        self.out_dir, self.name, self.part_size = out_dir, name, part_size
        self.whole = hashlib.sha256()
        self.total = 0
        self.parts: list[PartInfo] = []
        self._f: Any = None
        self._h: Any = None
        self._n = 0

    def _open(self) -> None:
        idx = len(self.parts)
        if idx > 999:
            raise WheelhouseError("more than 1000 parts: raise --part-size")
        self._fname = f"{self.name}.tar.part-{idx:03d}"
        self._f = open(self.out_dir / self._fname, "wb")  # noqa: SIM115 - closed in _close
        self._h, self._n = hashlib.sha256(), 0

    def _close(self) -> None:
        if self._f is not None:
            self._f.close()
            self.parts.append(PartInfo(self._fname, self._n, self._h.hexdigest()))
            self._f = None

    def write(self, data: bytes) -> int:
        view = memoryview(data)
        self.whole.update(view)
        self.total += len(view)
        while view:
            if self._f is None:
                self._open()
            take = min(len(view), self.part_size - self._n)
            self._f.write(view[:take])
            self._h.update(view[:take])
            self._n += take
            view = view[take:]
            if self._n == self.part_size:
                self._close()
        return len(data)

    def close(self) -> PackResult:
        self._close()
        return PackResult(tuple(self.parts), self.total, self.whole.hexdigest())


def _clear_parts(out_dir: Path, name: str) -> None:
    for old in out_dir.glob(f"{glob_escape(name)}.tar.part-*"):
        old.unlink()


def glob_escape(text: str) -> str:
    return re.sub(r"([*?\[])", r"[\1]", text)


def pack_parts(
    files: Sequence[tuple[str, Path]],
    out_dir: Path,
    name: str,
    part_size: int = DEFAULT_PART_SIZE,
    *,
    extra: Mapping[str, bytes] | None = None,
    keep_tar: bool = False,
) -> PackResult:
    """One uncompressed tar of ``files`` ((name in the tar, path) pairs; wheels are zips already) and
    ``extra`` (name -> bytes), written straight into parts of at most ``part_size`` bytes. Members are
    sorted and their metadata fixed, so the same inputs give byte-identical parts."""
    import io
    import tarfile

    out_dir.mkdir(parents=True, exist_ok=True)
    _clear_parts(out_dir, name)
    writer = _PartWriter(out_dir, name, part_size)
    sink: Any = writer
    tar_file: Any = None
    if keep_tar:
        tar_file = open(out_dir / f"{name}.tar", "wb")  # noqa: SIM115 - closed below

        class _Tee:
            def write(self, data: bytes) -> int:
                tar_file.write(data)
                return writer.write(data)

        sink = _Tee()
    members = []
    items: list[tuple[str, Path | bytes]] = [(a, p) for a, p in files] + list((extra or {}).items())
    try:
        with tarfile.open(fileobj=sink, mode="w|", format=tarfile.PAX_FORMAT) as tar:
            for arc, src in sorted(items, key=lambda t: t[0]):
                ti = tarfile.TarInfo(arc)
                ti.mtime, ti.mode, ti.uid, ti.gid, ti.uname, ti.gname = _TAR_MTIME, 0o644, 0, 0, "", ""
                if isinstance(src, bytes):
                    ti.size = len(src)
                    tar.addfile(ti, io.BytesIO(src))
                else:
                    ti.size = src.stat().st_size
                    with open(src, "rb") as f:
                        tar.addfile(ti, f)
                members.append(arc)
    finally:
        if tar_file is not None:
            tar_file.close()
    res = writer.close()
    return replace(res, members=tuple(members))


def split_file(path: Path, out_dir: Path, name: str, part_size: int = DEFAULT_PART_SIZE) -> PackResult:
    """Split an existing file (a tar) into ``<name>.tar.part-NNN`` files of at most ``part_size``."""
    out_dir.mkdir(parents=True, exist_ok=True)
    _clear_parts(out_dir, name)
    writer = _PartWriter(out_dir, name, part_size)
    with open(path, "rb") as f:
        while chunk := f.read(4 * MIB):
            writer.write(chunk)
    return writer.close()


_INSTALL_SH = r"""#!/usr/bin/env bash
# Reassembles, checks and installs the wheelhouse @NAME@ (@N_WHEELS@ wheels, @TAR_MB@ MB)
# on an air-gapped target.
# Generated by `python -m kimi_perf.wheelhouse build` for @TARGET@; MANIFEST.json lists the same hashes.
#
#   bash install.sh           check every part, reassemble and check the tar, install into $SITE
#   bash install.sh --check   only report which parts are here (exit 0: all, 3: some missing, 2: damaged)
#
#   PARTS_DIR  folder holding the parts (default: this script's folder)
#   SITE       where the wheels are installed (default /tmp/site); afterwards: export PYTHONPATH=$SITE
#   PYTHON     interpreter whose pip installs them (default python3)
set -euo pipefail
NAME='@NAME@'
TAR_SHA256='@TAR_SHA256@'
PARTS=(
@PARTS@
)
PARTS_DIR=${PARTS_DIR:-$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)}
SITE=${SITE:-/tmp/site}
PYTHON=${PYTHON:-python3}

files=(); missing=(); damaged=()
for entry in "${PARTS[@]}"; do
  read -r f size sha <<<"$entry"
  p="$PARTS_DIR/$f"
  files+=("$p")
  if [ ! -f "$p" ]; then missing+=("$f"); continue; fi
  have_size=$(wc -c <"$p" | tr -d ' ')
  if [ "$have_size" != "$size" ]; then damaged+=("$f: $have_size bytes, expected $size"); continue; fi
  have_sha=$(sha256sum "$p" | cut -d' ' -f1)
  if [ "$have_sha" != "$sha" ]; then damaged+=("$f: sha256 $have_sha, expected $sha"); fi
done
n_ok=$(( ${#PARTS[@]} - ${#missing[@]} - ${#damaged[@]} ))
echo "wheelhouse $NAME: $n_ok of ${#PARTS[@]} parts present and intact in $PARTS_DIR"
if [ ${#damaged[@]} -gt 0 ]; then
  printf '  damaged (copy again): %s\n' "${damaged[@]}" >&2
  exit 2
fi
if [ ${#missing[@]} -gt 0 ]; then
  printf '  missing: %s\n' "${missing[@]}" >&2
  [ "${1:-}" = "--check" ] && exit 3
  echo "copy the missing parts into $PARTS_DIR (or set PARTS_DIR), then run this again" >&2
  exit 3
fi
[ "${1:-}" = "--check" ] && exit 0

whole=$(cat "${files[@]}" | sha256sum | cut -d' ' -f1)
if [ "$whole" != "$TAR_SHA256" ]; then
  echo "the reassembled tar has sha256 $whole, expected $TAR_SHA256:" \
    "the parts come from different builds; copy all parts of one build" >&2
  exit 2
fi
WORK=$(mktemp -d "${TMPDIR:-/tmp}/wheelhouse.XXXXXX")
trap 'rm -rf "$WORK"' EXIT
cat "${files[@]}" | tar -x -C "$WORK"
wheels=("$WORK"/wheels/*.whl)
mkdir -p "$SITE"
# --upgrade: a second run over the same SITE replaces what the first installed
"$PYTHON" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
  --target "$SITE" "${wheels[@]}"
echo "installed ${#wheels[@]} wheels into $SITE"
echo "use them with:"
echo "  export PYTHONPATH=$SITE\${PYTHONPATH:+:\$PYTHONPATH}"
"""


def write_install_sh(out_dir: Path, name: str, pack: PackResult, n_wheels: int, target: TargetSpec) -> Path:
    """install.sh for the target, with the part and tar hashes embedded (it needs only bash,
    coreutils, tar and the target's pip)."""
    for p in pack.parts:
        if not re.fullmatch(r"[A-Za-z0-9._+-]+", p.file):
            raise WheelhouseError(f"part name {p.file!r}: use letters, digits and . _ + - in --name")
    text = (
        _INSTALL_SH.replace("@NAME@", name)
        .replace("@N_WHEELS@", str(n_wheels))
        .replace("@TAR_MB@", _mb(pack.tar_size))
        .replace("@TARGET@", target.describe())
        .replace("@TAR_SHA256@", pack.tar_sha256)
        .replace("@PARTS@", "\n".join(f"'{p.file} {p.size} {p.sha256}'" for p in pack.parts))
    )
    path = out_dir / "install.sh"
    path.write_text(text)
    path.chmod(0o755)
    return path


# ---------------------------------------------------------------------------------------------------
# Building


@dataclass(frozen=True)
class BuildResult:
    out_dir: Path
    manifest: Path
    install_sh: Path
    parts: tuple[PartInfo, ...]
    wheels: tuple[Path, ...]
    repacks: tuple[RepackResult, ...]
    tar_size: int


def _sha256_file(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(4 * MIB):
            h.update(chunk)
    return h.hexdigest()


def download(
    entries: Sequence[PlanEntry],
    target: TargetSpec,
    cache: Path,
    *,
    python: str = sys.executable,
    pip_args: Sequence[str] = (),
    say: Callable[[str], None] = _say,
) -> dict[str, Path]:
    """The wheels of ``entries`` in ``cache`` (kept between runs), each checked against the report's
    sha256: ``file://`` URLs are copied, the rest fetched by one ``pip download --no-deps`` with the
    target's flags."""
    from urllib.parse import unquote, urlparse

    cache.mkdir(parents=True, exist_ok=True)
    out: dict[str, Path] = {}
    need: list[PlanEntry] = []
    for e in entries:
        dest = cache / e.filename
        if dest.exists() and (e.sha256 is None or _sha256_file(dest) == e.sha256):
            out[e.key] = dest
            continue
        u = urlparse(e.url)
        if u.scheme == "file":
            shutil.copyfile(unquote(u.path), dest)
            out[e.key] = dest
        else:
            need.append(e)
    if need:
        say(f"downloading {len(need)} wheels with pip download into {cache} ...")
        args = [
            "download",
            "--no-deps",
            "--disable-pip-version-check",
            "--progress-bar",
            "off",
            *target.pip_args(),
            "-d",
            str(cache),
            *pip_args,
            *[f"{e.name}=={e.version}" for e in need],
        ]
        _run_pip(python, args, cache.parent / "pip-download.log", "download", target)
        for e in need:
            dest = cache / e.filename
            if not dest.exists():
                raise WheelhouseError(
                    f"pip download did not write {e.filename} for {e.name}=={e.version} (see "
                    f"{cache.parent / 'pip-download.log'}): the index serves other files than the "
                    "resolution saw; run plan again"
                )
            out[e.key] = dest
    for e in entries:
        if e.sha256 and _sha256_file(out[e.key]) != e.sha256:
            bad = out[e.key]
            raise WheelhouseError(
                f"{bad} does not have the sha256 pip's report gives ({e.sha256}); delete it and "
                "build again; if it persists the index changed the file: run plan again"
            )
    return out


def build(
    plan: Plan,
    out_dir: Path,
    *,
    name: str,
    part_size: int = DEFAULT_PART_SIZE,
    repacks: Sequence[RepackRule] = (),
    build_tag: str | None = "1repack",
    python: str = sys.executable,
    pip_args: Sequence[str] = (),
    keep_tar: bool = False,
    extra_manifest: Mapping[str, Any] | None = None,
    say: Callable[[str], None] = _say,
) -> BuildResult:
    """Download the kept wheels, repack, pack into parts and write MANIFEST.json and install.sh.

    Layout of ``out_dir``: ``cache/`` (downloaded wheels, reused by later builds), ``repacked/``,
    ``parts/<name>.tar.part-NNN``, ``install.sh``, ``MANIFEST.json``, ``plan.txt``. The tar holds
    ``wheels/*.whl`` and ``wheelhouse.lock`` (name==version, sha256, file)."""
    if plan.missing:
        raise WheelhouseError(
            "the plan lacks requirements the target needs:\n  "
            + "\n  ".join(plan.missing)
            + "\n-> add them with --spec, or leave them out with --exclude NAME:REASON"
        )
    kept = plan.kept
    if not kept:
        raise WheelhouseError("nothing to carry: the target has everything the closure needs (see the plan)")
    if not re.fullmatch(r"[A-Za-z0-9._+-]+", name):
        raise WheelhouseError(f"--name {name!r}: use letters, digits and . _ + -")
    out_dir.mkdir(parents=True, exist_ok=True)
    (out_dir / "plan.txt").write_text(plan.table() + "\n")
    paths = download(kept, plan.target, out_dir / "cache", python=python, pip_args=pip_args, say=say)

    results: list[RepackResult] = []
    carried: dict[str, Path] = dict(paths)
    repack_notes = []
    for rule in repacks:
        key = canonical_name(rule.package)
        if key not in carried:
            repack_notes.append(
                f"repack {rule.package}: not carried (left out or not in the closure); skipped"
            )
            say(f"note: {repack_notes[-1]}")
            continue
        res = repack_wheel(carried[key], out_dir / "repacked", rule.patterns, build_tag=build_tag)
        say(
            f"repacked {res.source.name} -> {res.wheel.name}: dropped {len(res.dropped)} members, "
            f"{_mb(res.bytes_before)} -> {_mb(res.bytes_after)} MB (saved {_mb(res.saved)} MB)"
        )
        carried[key] = res.wheel
        results.append(res)

    by_key = {e.key: e for e in kept}
    lock_lines, wheel_rows, files = [], [], []
    for key in sorted(carried):
        e, path = by_key[key], carried[key]
        sha = _sha256_file(path)
        lock_lines.append(f"{e.name}=={e.version} sha256={sha} {path.name}")
        files.append((f"wheels/{path.name}", path))
        row = {**e.to_dict(), "file": path.name, "file_size": path.stat().st_size, "file_sha256": sha}
        rep = next((r for r in results if r.wheel == path), None)
        if rep is not None:
            row["repacked"] = rep.to_dict()
        wheel_rows.append(row)
    say(f"packing {len(files)} wheels into parts of at most {part_size / MIB:.1f} MiB ...")
    pack = pack_parts(
        files,
        out_dir / "parts",
        name,
        part_size,
        extra={"wheelhouse.lock": ("\n".join(lock_lines) + "\n").encode()},
        keep_tar=keep_tar,
    )
    install_sh = write_install_sh(out_dir, name, pack, len(files), plan.target)
    manifest = {
        "format": 1,
        "tool": "python -m kimi_perf.wheelhouse",
        "created": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        "name": name,
        "target": {**plan.target.to_dict(), "description": plan.target.describe()},
        **dict(extra_manifest or {}),
        "tar": {
            "file": f"{name}.tar",
            "size": pack.tar_size,
            "sha256": pack.tar_sha256,
            "members": ["wheels/*.whl", "wheelhouse.lock"],
        },
        "part_size": part_size,
        "parts": [{"file": p.file, "size": p.size, "sha256": p.sha256} for p in pack.parts],
        "kept": wheel_rows,
        "left_out": [e.to_dict() for e in plan.left_out],
        "clashes": list(plan.clash_lines),
        "unverified": list(plan.unverified),
        "repacked": [r.to_dict() for r in results],
        "notes": list(plan.notes) + repack_notes,
        "install": (
            "bash install.sh  (PARTS_DIR, SITE=/tmp/site, PYTHON=python3); then export PYTHONPATH=$SITE"
        ),
    }
    mpath = out_dir / "MANIFEST.json"
    mpath.write_text(json.dumps(manifest, indent=1) + "\n")
    return BuildResult(
        out_dir, mpath, install_sh, pack.parts, tuple(p for _, p in files), tuple(results), pack.tar_size
    )


def stage_part(out_dir: Path, index: int, into: Path) -> list[Path]:
    """Put part ``index`` (checked against MANIFEST.json), install.sh and MANIFEST.json into ``into``,
    after removing the parts an earlier ``stage`` left there: one transfer carries one part."""
    mpath = out_dir / "MANIFEST.json"
    if not mpath.exists():
        raise WheelhouseError(
            f"{mpath} not found: run `python -m kimi_perf.wheelhouse build --out {out_dir}` first"
        )
    manifest = json.loads(mpath.read_text())
    parts = manifest["parts"]
    if not 0 <= index < len(parts):
        raise WheelhouseError(f"--part {index}: this build has {len(parts)} parts, 0..{len(parts) - 1}")
    part = parts[index]
    src = out_dir / "parts" / part["file"]
    if not src.exists() or _sha256_file(src) != part["sha256"]:
        raise WheelhouseError(f"{src} is missing or does not match MANIFEST.json: build again")
    into.mkdir(parents=True, exist_ok=True)
    _clear_parts(into, manifest["name"])
    out = []
    for f in (src, out_dir / "install.sh", mpath):
        shutil.copyfile(f, into / f.name)
        out.append(into / f.name)
    (into / "install.sh").chmod(0o755)
    return out


# ---------------------------------------------------------------------------------------------------
# Command line


def _add_plan_args(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--spec",
        action="append",
        default=[],
        metavar="REQ",
        help="engine requirement, e.g. sglang==0.5.17 (repeatable: more roots)",
    )
    p.add_argument(
        "--python", default="3.12", help="target Python version, e.g. 3.12 or 3.12.3 (default 3.12)"
    )
    p.add_argument(
        "--platform",
        action="append",
        default=[],
        metavar="TAG",
        help=f"target platform tag(s); LO..HI ranges expand (default {DEFAULT_PLATFORMS})",
    )
    p.add_argument("--implementation", default="cp", help="target implementation (default cp)")
    p.add_argument(
        "--target-list",
        metavar="FILE|NAME",
        help="the target's `pip list --format=freeze` (or `pip list`) output, or the name of one under "
        "kimi_perf/wheelhouse_targets (e.g. h200-torch2.11-cu130)",
    )
    p.add_argument(
        "--pin",
        action="append",
        default=[],
        metavar="REQ",
        help="constraint for the resolver, e.g. torch==2.11.0 (repeatable)",
    )
    p.add_argument(
        "--override",
        action="append",
        default=[],
        metavar="NAME==VERSION",
        help="carry this version instead of the resolved one, applied after resolution (repeatable)",
    )
    p.add_argument(
        "--exclude",
        action="append",
        default=[],
        metavar="GLOB[:REASON]",
        help="leave out packages matching this name glob as runtime-unused (repeatable)",
    )
    p.add_argument(
        "--keep",
        action="append",
        default=[],
        metavar="NAME",
        help="do not leave NAME out by a default exclusion (repeatable)",
    )
    p.add_argument(
        "--trust-target",
        action="append",
        default=[],
        metavar="NAME",
        help="leave NAME out when the target has it, even at a version the closure rejects (repeatable)",
    )
    p.add_argument(
        "--no-defaults",
        action="store_true",
        help="ignore the built-in exclusions, pins and overrides for known engine releases",
    )
    p.add_argument(
        "--resolver-python",
        metavar="PATH",
        help="interpreter whose pip resolves (default: one of the target's Python version, if found)",
    )
    p.add_argument("--report", metavar="FILE", help="use this pip installation report instead of running pip")
    p.add_argument(
        "--pip-arg",
        action="append",
        default=[],
        metavar="ARG",
        help="extra argument for pip (repeatable; write --pip-arg=--index-url=URL)",
    )
    p.add_argument("--no-sizes", action="store_true", help="do not look up wheel sizes (one HTTP HEAD each)")
    p.add_argument(
        "--work",
        metavar="DIR",
        help="where pip's logs and reports go (default: a temporary folder, or OUT/resolve for build)",
    )


def _plan_from_args(
    a: argparse.Namespace, workdir: Path
) -> tuple[Plan, TargetSpec, list[RepackRule], dict[str, Any]]:
    if not a.spec and not a.report:
        raise WheelhouseError("give --spec (e.g. --spec sglang==0.5.17) or --report FILE")
    try:
        target = TargetSpec(a.python, expand_platforms(a.platform or [DEFAULT_PLATFORMS]), a.implementation)
        cli_overrides = [Override(o) for o in a.override]
    except ValueError as e:
        raise WheelhouseError(str(e)) from e
    installed, target_list = load_target_list(a.target_list)
    notes: list[str] = []
    if not a.target_list:
        notes.append("no --target-list: everything in the closure is carried")
    defaults, dnotes = ([], []) if a.no_defaults else defaults_for(a.spec)
    notes += dnotes
    keep = {canonical_name(k) for k in a.keep}
    exclusions = [x for d in defaults for x in d.excludes if not any(x.matches(k) for k in keep)]
    exclusions += [Exclusion.parse(x) for x in a.exclude]
    pins = [p for d in defaults for p in d.pins] + list(a.pin)
    cli_keys = {o.key for o in cli_overrides}
    overrides = [o for d in defaults for o in d.overrides if o.key not in cli_keys]
    overrides += cli_overrides
    hints = [r for d in defaults for r in d.repack_hints]
    for d in defaults:
        notes.append(
            f"defaults for {d.engine} {d.version} ({d.observed}): {len(d.excludes)} exclusions, "
            f"pins {list(d.pins) or 'none'}, overrides {[o.requirement for o in d.overrides] or 'none'}"
        )
    report = json.loads(Path(a.report).read_text()) if a.report else None
    plan = resolve_and_plan(
        a.spec,
        target,
        installed=installed,
        exclusions=exclusions,
        pins=pins,
        overrides=overrides,
        workdir=workdir,
        resolver_python=a.resolver_python,
        report=report,
        pip_args=a.pip_arg,
        sizes=not a.no_sizes,
        trusted=a.trust_target,
        notes=notes,
    )
    context = {
        "specs": list(a.spec),
        "pins": pins,
        "overrides": [{"requirement": o.requirement, "reason": o.reason} for o in overrides],
        "exclusions": [{"pattern": x.pattern, "reason": x.reason} for x in exclusions],
        "target_list": target_list,
    }
    return plan, target, hints, context


def _print_hints(plan: Plan, hints: Sequence[RepackRule], repacks: Sequence[RepackRule]) -> None:
    chosen = {canonical_name(r.package) for r in repacks}
    kept = {e.key for e in plan.kept}
    for h in hints:
        if canonical_name(h.package) in kept and canonical_name(h.package) not in chosen:
            print(f"hint: --repack '{h.to_cli()}'  ({h.reason})")


def main(argv: Sequence[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m kimi_perf.wheelhouse", description=__doc__.split("\n\n")[0])
    sub = ap.add_subparsers(dest="cmd", required=True)
    p_plan = sub.add_parser("plan", help="resolve and print what would be carried / left out, with sizes")
    _add_plan_args(p_plan)
    p_plan.add_argument("--json", metavar="FILE", help="also write the plan as JSON")
    p_build = sub.add_parser(
        "build", help="plan, download, repack, pack into parts, write MANIFEST.json + install.sh"
    )
    _add_plan_args(p_build)
    p_build.add_argument(
        "--out", required=True, metavar="DIR", help="output folder (keep it outside the repo)"
    )
    p_build.add_argument(
        "--name", help="file name stem of the tar and parts (default: wheelhouse-<first spec>)"
    )
    p_build.add_argument("--part-size", default="60M", help="largest part, e.g. 60M (MiB; default 60M)")
    p_build.add_argument(
        "--repack",
        action="append",
        default=[],
        metavar="PKG:PATTERN[,PATTERN]",
        help="drop wheel members matching the patterns from PKG's wheel (repeatable)",
    )
    p_build.add_argument(
        "--build-tag",
        default="1repack",
        help="wheel build tag of repacked wheels (digit first; '' keeps the original file name)",
    )
    p_build.add_argument("--keep-tar", action="store_true", help="also keep the whole tar next to the parts")
    p_stage = sub.add_parser(
        "stage", help="put one part, install.sh and MANIFEST.json into a transfer folder"
    )
    p_stage.add_argument("--out", required=True, metavar="DIR", help="the build's output folder")
    p_stage.add_argument("--part", required=True, type=int, metavar="N", help="part index, from 0")
    p_stage.add_argument(
        "--into", required=True, metavar="DIR", help="transfer folder, e.g. .carry/wheelhouse"
    )
    p_stage.add_argument(
        "--remote-dir", default="/tmp/wheelhouse", help="folder on the target (default /tmp/wheelhouse)"
    )
    p_repack = sub.add_parser("repack", help="drop members from one wheel and rewrite its RECORD")
    p_repack.add_argument("wheel")
    p_repack.add_argument("--drop", action="append", required=True, metavar="PATTERN")
    p_repack.add_argument("--dest", required=True, metavar="DIR")
    p_repack.add_argument("--build-tag", default="1repack")
    a = ap.parse_args(argv)
    try:
        if a.cmd == "plan":
            with tempfile.TemporaryDirectory(prefix="wheelhouse-") as tmp:
                plan, _target, hints, _ctx = _plan_from_args(a, Path(a.work or tmp))
            print(plan.table())
            _print_hints(plan, hints, [])
            if a.json:
                Path(a.json).write_text(json.dumps(plan.to_dict(), indent=1) + "\n")
            return 1 if plan.missing else 0
        if a.cmd == "build":
            out = Path(a.out)
            part_size = parse_part_size(a.part_size)
            if part_size > 62 * MIB:
                _say(
                    f"note: parts of {part_size / MIB:.1f} MiB: a device transfer carries 64 MiB per call, "
                    "working tree included"
                )
            repacks = [RepackRule.parse(r) for r in a.repack]
            plan, _target, hints, ctx = _plan_from_args(a, Path(a.work) if a.work else out / "resolve")
            print(plan.table())
            _print_hints(plan, hints, repacks)
            stem = a.spec[0] if a.spec else "report"
            name = a.name or "wheelhouse-" + re.sub(r"[^A-Za-z0-9._+-]+", "-", stem).strip("-")
            python = a.resolver_python or sys.executable
            res = build(
                plan,
                out,
                name=name,
                part_size=part_size,
                repacks=repacks,
                build_tag=a.build_tag or None,
                python=python,
                pip_args=a.pip_arg,
                keep_tar=a.keep_tar,
                extra_manifest=ctx,
            )
            print(
                f"\nwheelhouse {name}: {len(res.wheels)} wheels, {_mb(res.tar_size)} MB tar, "
                f"{len(res.parts)} part(s) in {out / 'parts'}"
            )
            for r in res.repacks:
                print(
                    f"  repacked {r.wheel.name}: saved {_mb(r.saved)} MB ({len(r.dropped)} members dropped)"
                )
            for p in res.parts:
                print(f"  {out / 'parts' / p.file}  {p.size / MIB:.1f} MiB  sha256 {p.sha256}")
            print(f"  {res.install_sh}\n  {res.manifest}")
            print(
                f"next: python -m kimi_perf.wheelhouse stage --out {out} --part N --into .carry/wheelhouse, "
                "for N = 0.." + str(len(res.parts) - 1) + ", one transfer each"
            )
            return 0
        if a.cmd == "stage":
            staged = stage_part(Path(a.out), a.part, Path(a.into))
            manifest = json.loads((Path(a.out) / "MANIFEST.json").read_text())
            n, into, rdir = len(manifest["parts"]), a.into.rstrip("/"), a.remote_dir
            print("staged: " + ", ".join(str(s) for s in staged))
            print(
                f"on the target (carry {into}): mkdir -p {rdir} && cp {into}/* {rdir}/ && "
                f"bash {rdir}/install.sh --check"
            )
            if a.part == n - 1:
                print(f"after the last part arrives: bash {rdir}/install.sh && export PYTHONPATH=/tmp/site")
            else:
                print(f"then: stage --part {a.part + 1} (of 0..{n - 1})")
            return 0
        if a.cmd == "repack":
            r = repack_wheel(Path(a.wheel), Path(a.dest), a.drop, build_tag=a.build_tag or None)
            print(
                f"{r.wheel}: dropped {len(r.dropped)} members, "
                f"{_mb(r.bytes_before)} -> {_mb(r.bytes_after)} MB "
                f"(saved {_mb(r.saved)} MB)"
            )
            return 0
    except WheelhouseError as e:
        print(f"wheelhouse: error: {e}", file=sys.stderr)
        return 2
    return 2  # pragma: no cover - argparse requires a command


if __name__ == "__main__":
    sys.exit(main())
