"""The GPU's SM clock and power draw during each A/B repeat, sampled by ``nvidia-smi``'s loop mode.

Why: a GPU's SM clock follows its load and power state, and a small model served one stream at a time
barely loads it, so two identical servers can decode at different speeds because the GPU ran at
different clocks. On an H100 vLLM's single-stream decode read either ~650 or ~490-540 tok/s per
request, on both sides of an A/A (docs/ab-gate.md); without the clock next to each repeat, the noise
table cannot tell a clock effect from the engine's own. The fix, when it is the clock, belongs to the
runner (``nvidia-smi --lock-gpu-clocks``, as MLPerf and NVIDIA's benchmarking guides do), and the
verdict's noise note names it.

Why ``nvidia-smi --loop-ms`` in one child process and not NVML from Python: the runner's interpreter need
not have nvidia-ml-py (torch does not depend on it, and an air-gapped runner installs nothing), a
sampling thread in the client's interpreter would compete for the GIL with the load generator being
timed, and one child for the whole comparison costs the same on both sides. Lines are stamped with
``time.monotonic()`` as they arrive (nvidia-smi's own timestamp is local wall time at 1 s resolution in
older drivers), so a repeat's window is the samples that arrived within it. Without ``nvidia-smi``
(a CPU box) :meth:`GpuClocks.start` returns None and the metrics are absent.
"""

from __future__ import annotations

import math
import os
import shutil
import statistics
import subprocess
import threading
import time
from collections.abc import Sequence

__all__ = ["GpuClocks", "visible_gpus"]

QUERY = "index,clocks.sm,power.draw"


def visible_gpus(env: dict[str, str] | None = None) -> tuple[int, ...] | None:
    """GPU indices the servers see (``CUDA_VISIBLE_DEVICES`` as numbers), or None for all of them.
    UUID or MIG forms are not mapped to indices: then every GPU is sampled."""
    raw = (env if env is not None else os.environ).get("CUDA_VISIBLE_DEVICES")
    if raw is None or not raw.strip():
        return None
    try:
        return tuple(int(x) for x in raw.split(",") if x.strip())
    except ValueError:
        return None


def _num(s: str) -> float:
    try:
        return float(s.strip())
    except ValueError:  # "[N/A]", "[Not Supported]"
        return math.nan


class GpuClocks:
    """One ``nvidia-smi --query-gpu=index,clocks.sm,power.draw --loop-ms=N`` child for a whole comparison.

    :meth:`window` gives the median SM clock (MHz) and power (W) over the samples that arrived between
    two ``time.monotonic()`` stamps, over the GPUs in ``gpus`` (None: all)."""

    def __init__(self, proc: subprocess.Popen[str], gpus: Sequence[int] | None) -> None:
        self._proc = proc
        self._gpus = None if gpus is None else frozenset(gpus)
        self._lock = threading.Lock()
        self._samples: list[tuple[float, float, float]] = []  # (monotonic, sm MHz, power W)
        self._reader = threading.Thread(target=self._read, name="gpu-clocks", daemon=True)
        self._reader.start()

    @classmethod
    def start(cls, *, interval_ms: int = 50, gpus: Sequence[int] | None = None,
              exe: str | None = None) -> GpuClocks | None:
        """Start sampling, or None where there is no ``nvidia-smi`` (or it cannot start)."""
        exe = exe or shutil.which("nvidia-smi")
        if exe is None:
            return None
        try:
            proc = subprocess.Popen([exe, f"--query-gpu={QUERY}", "--format=csv,noheader,nounits",
                                     f"--loop-ms={interval_ms}"], stdout=subprocess.PIPE,
                                    stderr=subprocess.DEVNULL, text=True, bufsize=1)
        except OSError:
            return None
        return cls(proc, gpus if gpus is not None else visible_gpus())

    def _read(self) -> None:
        assert self._proc.stdout is not None
        for line in self._proc.stdout:
            parts = line.split(",")
            if len(parts) < 3:
                continue
            try:
                idx = int(parts[0])
            except ValueError:
                continue
            if self._gpus is not None and idx not in self._gpus:
                continue
            with self._lock:
                self._samples.append((time.monotonic(), _num(parts[1]), _num(parts[2])))

    def window(self, t0: float, t1: float) -> dict[str, float]:
        """``gpu_sm_clock_mhz`` and ``gpu_power_w``: medians of the samples in [t0, t1]; empty when
        none arrived (a repeat shorter than the interval, or nvidia-smi ended)."""
        with self._lock:
            got = [(sm, w) for t, sm, w in self._samples if t0 <= t <= t1]
        sm = [s for s, _ in got if math.isfinite(s)]
        pw = [w for _, w in got if math.isfinite(w)]
        out: dict[str, float] = {}
        if sm:
            out["gpu_sm_clock_mhz"] = float(statistics.median(sm))
        if pw:
            out["gpu_power_w"] = float(statistics.median(pw))
        return out

    def close(self) -> None:
        if self._proc.poll() is None:
            self._proc.terminate()
            try:
                self._proc.wait(timeout=5)
            except subprocess.TimeoutExpired:
                self._proc.kill()
                self._proc.wait()
        self._reader.join(timeout=5)
