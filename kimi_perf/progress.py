"""Progress lines that reach the terminal even while pytest captures output.

Why: server launches and drafter training take minutes; under pytest's default capture a ``print``
inside a fixture is invisible until the test fails, so a healthy run looks hung. The plugin installs
a sink that suspends capture around each line (pytest's own capture manager API); outside pytest the
lines go to stderr.
"""

from __future__ import annotations

import sys
import threading
import time
from collections.abc import Callable

__all__ = ["log", "set_sink"]

_sink: Callable[[str], None] | None = None
_lock = threading.Lock()
_t0 = time.monotonic()


def set_sink(sink: Callable[[str], None] | None) -> Callable[[str], None] | None:
    """Route progress lines to ``sink`` (None: stderr); returns the previous sink, which a caller that
    borrows the sink (a test) must put back -- the session's sink is what makes long steps visible."""
    global _sink
    prev, _sink = _sink, sink
    return prev


def log(msg: str) -> None:
    line = f"[kimi-perf {time.monotonic() - _t0:7.1f}s] {msg}"
    with _lock:
        if _sink is not None and threading.current_thread() is threading.main_thread():
            _sink(line)
        else:
            print(line, file=sys.stderr, flush=True)
