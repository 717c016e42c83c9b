"""What a user or the built-in per-engine defaults ask for: exclusions, pins, overrides, repacks."""

from __future__ import annotations

import fnmatch
import re
from collections.abc import Sequence
from dataclasses import dataclass

from ._base import WheelhouseError, _packaging, canonical_name
from .target import _NAME


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
