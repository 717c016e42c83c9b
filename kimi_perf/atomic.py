"""Atomic JSON writes and the directory lock: the file-writing primitives the baselines, run reports
and the EAGLE-3 pipeline share.

Why a module of its own: it used to live in ``baselines``, so the drafter pipeline (``eagle3``) and
anything else that only wanted a crash-safe write imported the gate's baseline store to get it. A
leaf module keeps those layers apart; ``kimi_perf.baselines`` re-exports the name for old callers.

Why the mode is set by hand: ``tempfile.mkstemp`` creates the file 0600 whatever the umask, and the
rename keeps that mode, so every baseline and run file came out owner-only (a CI artifact the next job
under another user cannot read). The file gets what ``open()`` would have given it: 0666 less the
process umask.
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import os
import tempfile
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

__all__ = ["atomic_write_json", "locked_dir", "process_umask"]


def process_umask() -> int:
    """The process umask, read without changing it (``os.umask`` can only be read by setting it,
    which races with other threads creating files); falls back to the set-and-restore dance where
    ``/proc`` has no ``Umask:`` line."""
    with contextlib.suppress(OSError, ValueError):
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith("Umask:"):
                return int(line.split()[1], 8)
    old = os.umask(0o022)
    os.umask(old)
    return old


def atomic_write_json(path: Path, data: Any, *, validate: Callable[[Path], None] | None = None) -> None:
    """Write ``data`` as JSON to ``path`` so a reader sees the old file or the new one, never a torn
    one: temp file in the same directory, fsync, rename, fsync of the directory. ``validate`` is called
    with the temp file before the rename: if it raises, ``path`` is left as it was (a write that its
    own loader would reject must not replace a good file)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=str(path.parent))
    try:
        os.fchmod(fd, 0o666 & ~process_umask())
        with os.fdopen(fd, "w") as f:
            json.dump(data, f, indent=1, sort_keys=False)
            f.write("\n")
            f.flush()
            os.fsync(f.fileno())
        if validate is not None:
            validate(Path(tmp))
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


@contextlib.contextmanager
def locked_dir(directory: Path) -> Iterator[None]:
    """An exclusive ``flock`` on ``directory`` for the duration of the block (blocking).

    Why the directory and not a ``.lock`` file beside the data: a lock file would be left in
    ``baselines/`` for git to show; ``flock`` works on a directory's descriptor, is released by the
    kernel when the holder dies (a SIGKILLed run never leaves a stale lock), and the writers it
    serialises (read, merge, replace) hold it for milliseconds."""
    directory.mkdir(parents=True, exist_ok=True)
    fd = os.open(str(directory), os.O_RDONLY)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        yield
    finally:
        os.close(fd)  # closing the last descriptor releases the lock
