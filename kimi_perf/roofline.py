"""The memory-bandwidth floor of decode: how fast a batch-1 decode step *could* be on this GPU.

Why: an absolute tok/s baseline says whether the engine got slower, not whether it is any good. A
batch-1 decode step must read every weight once, so ``weight bytes / copy bandwidth`` is a hard floor
on its time; the ratio of measured decode speed to that floor says how much of the hardware the
engine uses, and it transfers across GPUs (an H100 and an H200 differ in bandwidth, not in what a
good engine reaches). Both numbers are measured in the same run: the bandwidth with a device-to-device
copy on the GPU the server uses, the weight bytes from the engine (``/server_info``) or, for engines
that do not report them, from the model's ``config.json``.

torch is imported lazily: collecting or running CPU-only tests never loads it.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

# the torch-free shape, not the engine's model module: the engine's micro-benchmark imports this
# module for the floor, so importing the engine from here made the two depend on each other
from .models.shapes import LlamaShape

__all__ = ["DecodeFloor", "copy_bandwidth_bytes_s", "weight_bytes_from_config"]

_DTYPE_BYTES = {"bfloat16": 2, "float16": 2, "float32": 4, "auto": 2}


@dataclass(frozen=True)
class DecodeFloor:
    weight_bytes: int
    bandwidth_bytes_s: float  # bytes read + written per second by a device-to-device copy

    @property
    def step_s(self) -> float:
        return self.weight_bytes / self.bandwidth_bytes_s

    @property
    def tok_s(self) -> float:
        """Batch-1 decode tok/s if every step only had to read the weights."""
        return 1.0 / self.step_s


def copy_bandwidth_bytes_s(nbytes: int = 2 << 30, iters: int = 20, device: str = "cuda") -> float:
    """Device-to-device copy bandwidth, counting bytes read plus bytes written (the convention of the
    4.26 TB/s H200 figure in docs/sources.md). Median of ``iters`` timed copies after warm-up."""
    import torch

    if not torch.cuda.is_available():
        raise RuntimeError("copy bandwidth needs a CUDA device")
    src = torch.empty(nbytes // 2, dtype=torch.bfloat16, device=device)
    src.fill_(1.0)
    dst = torch.empty_like(src)
    for _ in range(3):
        dst.copy_(src)
    torch.cuda.synchronize()
    times = []
    for _ in range(iters):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        dst.copy_(src)
        b.record()
        b.synchronize()
        times.append(a.elapsed_time(b) / 1000.0)
    del src, dst
    torch.cuda.empty_cache()
    times.sort()
    return 2 * (nbytes // 2) * 2 / times[len(times) // 2]


def weight_bytes_from_config(model_dir: str | Path, dtype: str = "bfloat16") -> int:
    """Parameter bytes of a Llama-family checkpoint from its config.json (what a decode step reads)."""
    from types import SimpleNamespace

    cfg = json.loads((Path(model_dir) / "config.json").read_text())
    shape = LlamaShape.from_config(SimpleNamespace(**cfg))
    return shape.num_params() * _DTYPE_BYTES.get(dtype, 2)
