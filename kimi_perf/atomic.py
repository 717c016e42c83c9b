"""Atomic JSON writes: the one file-writing primitive the baselines, run reports and the EAGLE-3
pipeline share.

Why a module of its own: it used to live in ``baselines``, so the drafter pipeline (``eagle3``) and
anything else that only wanted a crash-safe write imported the gate's baseline store to get it. A
leaf module keeps those layers apart; ``kimi_perf.baselines`` re-exports the name for old callers.
"""

from __future__ import annotations

import json
import os
import tempfile
from pathlib import Path
from typing import Any

__all__ = ["atomic_write_json"]


def atomic_write_json(path: Path, data: Any) -> None:
    """Write ``data`` as JSON to ``path`` so a reader sees the old file or the new one, never a torn
    one: temp file in the same directory, fsync, rename, fsync of the directory."""
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=str(path.parent))
    try:
        with os.fdopen(fd, "w") as f:
            json.dump(data, f, indent=1, sort_keys=False)
            f.write("\n")
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
        dfd = os.open(str(path.parent), os.O_RDONLY)
        try:
            os.fsync(dfd)
        finally:
            os.close(dfd)
    except BaseException:
        if os.path.exists(tmp):
            os.unlink(tmp)
        raise
