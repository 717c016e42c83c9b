"""Shared by every wheelhouse module: the error type, constants, name normalisation, lazy packaging."""

from __future__ import annotations

import re
import sys
from pathlib import Path
from typing import Any

# the bundled target lists stay at kimi_perf/wheelhouse_targets/ (package-data in pyproject.toml)
TARGETS_DIR = Path(__file__).resolve().parent.parent / "wheelhouse_targets"
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


def _mb(n: int | None) -> str:
    return "?" if n is None else f"{n / 1e6:.1f}"
