"""All-reduce micro-benchmark for decode-sized messages, one process per GPU, under named NCCL presets.

Why: on the seed deployment (Kimi-K2.5, TP 8 over PCIe) all-reduce was 51.5% of decode time and the
engine's speed came from one set of NCCL variables (``engines/presets.py``). Engine throughput mixes
that with everything else; this isolates it. A tensor-parallel decode step all-reduces a
``[batch, hidden]`` activation twice per layer, so the sizes that matter are ``batch x hidden x dtype``
for batch 1..128 (7168 x bf16 for Kimi/DeepSeek: 14 KB to 1.8 MB), where latency, not bus bandwidth,
decides. Presets are compared interleaved in one run, so the ratio survives a noisy shared host.

The harness launches ``torch.distributed.run`` (torchrun) in its own process group with the preset's
environment -- the multicast switches of ``SAFETY_ENV`` always set, also in the children -- and reads
one JSON file that rank 0 writes. ``backend="gloo"`` runs the same code on CPUs (the unit tests do,
with 2 processes), so the harness is exercised where there is no GPU.

    python -m kimi_perf.nccl --nproc 2 --presets default,seed-pcie-tuned --tokens 1,8,32,128 --hidden 7168
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from .engines.presets import SAFETY_ENV, nccl_env
from .launcher import die_with_parent, free_port, stop_process_group

__all__ = ["AllReduceError", "AllReduceResult", "AllReduceSpec", "SizeResult", "compare_presets", "run_allreduce"]

_ROOT = Path(__file__).resolve().parents[1]


class AllReduceError(RuntimeError):
    pass


@dataclass(frozen=True)
class AllReduceSpec:
    """One benchmark: message sizes ``tokens x hidden`` of ``dtype``, timed ``iters`` times each."""

    tokens: tuple[int, ...] = (1, 8, 32, 128)
    hidden: int = 7168
    dtype: str = "bfloat16"
    iters: int = 200
    warmup: int = 20
    world_size: int = 2
    backend: str = "nccl"  # "gloo" runs on CPUs

    def __post_init__(self) -> None:
        bad = []
        if not self.tokens or any(t < 1 for t in self.tokens):
            bad.append(f"tokens {self.tokens} (non-empty, each >= 1)")
        if self.hidden < 1 or self.iters < 1 or self.warmup < 0:
            bad.append(f"hidden {self.hidden} / iters {self.iters} / warmup {self.warmup}")
        if self.world_size < 2:
            bad.append(f"world_size {self.world_size} (an all-reduce needs >= 2 processes)")
        if self.backend not in ("nccl", "gloo"):
            bad.append(f"backend {self.backend!r} (nccl or gloo)")
        if self.dtype not in ("bfloat16", "float16", "float32"):
            bad.append(f"dtype {self.dtype!r} (bfloat16, float16 or float32)")
        if bad:
            raise ValueError("AllReduceSpec: invalid " + "; ".join(bad))

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> AllReduceSpec:
        known = set(cls.__dataclass_fields__)
        unknown = set(d) - known
        if unknown:
            raise ValueError(f"unknown all-reduce field(s) {sorted(unknown)}; known: {sorted(known)}")
        d = dict(d)
        if "tokens" in d:
            d["tokens"] = tuple(int(t) for t in d["tokens"])
        return cls(**d)


@dataclass(frozen=True)
class SizeResult:
    tokens: int
    bytes: int
    us_p50: float
    us_p99: float
    us_mean: float
    busbw_gb_s: float  # nccl-tests' bus bandwidth: bytes * 2(n-1)/n / time, at the median


@dataclass(frozen=True)
class AllReduceResult:
    spec: AllReduceSpec
    preset: str
    env: Mapping[str, str]  # the NCCL_* / multicast variables the ranks actually saw
    sizes: tuple[SizeResult, ...]
    torch_version: str
    nccl_version: str | None
    wall_s: float
    log_path: str
    extra: Mapping[str, Any] = field(default_factory=dict)

    def by_tokens(self) -> dict[int, SizeResult]:
        return {s.tokens: s for s in self.sizes}


def run_allreduce(spec: AllReduceSpec, preset: str | None = "default", *, python: str = sys.executable,
                  timeout_s: float = 600.0, log_dir: Path | None = None,
                  extra_env: Mapping[str, str] | None = None) -> AllReduceResult:
    """Run one benchmark under ``preset`` and return rank 0's results.

    Raises :class:`AllReduceError` naming the exit code and the log file when the ranks fail or time
    out; in either case the whole process group is gone when this returns.
    """
    log_dir = Path(log_dir or tempfile.mkdtemp(prefix="kimi-allreduce-"))
    log_dir.mkdir(parents=True, exist_ok=True)
    name = preset or "default"
    stamp = time.strftime("%H%M%S")
    out = log_dir / f"allreduce-{name}-{stamp}-{os.getpid()}.json"
    log_path = out.with_suffix(".log")
    env = {**os.environ, **nccl_env(preset), **dict(extra_env or {})}
    env["PYTHONPATH"] = os.pathsep.join(x for x in (str(_ROOT), env.get("PYTHONPATH", "")) if x)
    if spec.backend == "gloo":
        env.setdefault("OMP_NUM_THREADS", "1")
    argv = [python, "-m", "torch.distributed.run", "--nnodes", "1", "--nproc-per-node", str(spec.world_size),
            "--master-addr", "127.0.0.1", "--master-port", str(free_port()),
            "-m", "kimi_perf.nccl", "worker", "--spec", json.dumps(asdict(spec)), "--out", str(out)]
    t0 = time.monotonic()
    with open(log_path, "wb") as logf:
        # the launcher's process handling: own group, SIGTERM on our death, group kill after any outcome
        proc = subprocess.Popen(argv, stdout=logf, stderr=subprocess.STDOUT, env=env, start_new_session=True,
                                preexec_fn=die_with_parent)
        try:
            rc = proc.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            rc = None
        finally:
            stop_process_group(proc, grace_s=5.0)
    wall = time.monotonic() - t0
    if rc != 0 or not out.is_file():
        tail = "\n".join(log_path.read_text(errors="replace").splitlines()[-15:])
        what = f"timed out after {timeout_s:.0f}s" if rc is None else f"exited with code {rc}"
        raise AllReduceError(f"all-reduce benchmark ({spec.backend}, {spec.world_size} ranks, preset {name}) {what}; "
                             f"log: {log_path}\nlast log lines:\n{tail}")
    raw = json.loads(out.read_text())
    return AllReduceResult(spec=spec, preset=name, env=raw["env"], sizes=tuple(SizeResult(**s) for s in raw["sizes"]),
                           torch_version=raw["torch"], nccl_version=raw.get("nccl"), wall_s=wall,
                           log_path=str(log_path), extra={"devices": raw.get("devices")})


def compare_presets(spec: AllReduceSpec, presets: Sequence[str], repeats: int, **kw: Any) -> dict[str, list[AllReduceResult]]:
    """Each preset ``repeats`` times, interleaved (A B A B ...) so machine drift hits all presets alike."""
    out: dict[str, list[AllReduceResult]] = {p: [] for p in presets}
    for _ in range(repeats):
        for p in presets:
            out[p].append(run_allreduce(spec, p, **kw))
    return out


# -- the rank process (run by torchrun) -----------------------------------------------------------


def _worker(spec: AllReduceSpec, out: Path) -> None:
    import torch
    import torch.distributed as dist

    if spec.backend == "nccl":
        local = int(os.environ.get("LOCAL_RANK", "0"))
        torch.cuda.set_device(local)
        dev = torch.device("cuda", local)
    else:
        dev = torch.device("cpu")
    dist.init_process_group(spec.backend, device_id=dev if spec.backend == "nccl" else None)
    rank, world = dist.get_rank(), dist.get_world_size()
    if world != spec.world_size:
        raise RuntimeError(f"world size {world} != spec.world_size {spec.world_size}")
    dtype = getattr(torch, spec.dtype)
    cuda = dev.type == "cuda"

    def sync() -> None:
        if cuda:
            torch.cuda.synchronize(dev)

    sizes = []
    for tokens in spec.tokens:
        src = torch.full((tokens, spec.hidden), 1.0, dtype=dtype, device=dev)
        x = src.clone()
        for _ in range(spec.warmup):
            dist.all_reduce(x)
        lat = torch.zeros(spec.iters, dtype=torch.float64)
        for i in range(spec.iters):
            x.copy_(src)
            sync()
            dist.barrier()  # start together: the op's time, not the ranks' skew
            t0 = time.perf_counter()
            dist.all_reduce(x)
            sync()
            lat[i] = time.perf_counter() - t0
        if not bool((x == float(world)).all()):
            raise RuntimeError(f"all-reduce of ones over {world} ranks did not give {world} at {tokens} tokens")
        # an op is done when its slowest rank is: max over ranks, per iteration
        dist.all_reduce(lat_t := lat.to(dev), op=dist.ReduceOp.MAX)
        lat = lat_t.cpu()
        us = (lat * 1e6).sort().values
        nbytes = tokens * spec.hidden * src.element_size()
        p50 = float(us[len(us) // 2])
        sizes.append({"tokens": tokens, "bytes": nbytes, "us_p50": p50,
                      "us_p99": float(us[min(len(us) - 1, int(round(0.99 * (len(us) - 1))))]),
                      "us_mean": float(us.mean()), "busbw_gb_s": nbytes * 2 * (world - 1) / world / (p50 * 1e-6) / 1e9})
    if rank == 0:
        seen = {k: v for k, v in os.environ.items() if k.startswith("NCCL_") or k in SAFETY_ENV}
        nccl = None
        if cuda:
            v = torch.cuda.nccl.version()
            nccl = ".".join(map(str, v)) if isinstance(v, tuple) else str(v)
        devices = [torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())] if cuda else ["cpu"]
        tmp = out.with_suffix(".tmp")
        tmp.write_text(json.dumps({"env": seen, "sizes": sizes, "torch": torch.__version__, "nccl": nccl,
                                   "devices": devices}))
        tmp.replace(out)
    dist.barrier()
    dist.destroy_process_group()


def _table(results: Mapping[str, list[AllReduceResult]]) -> str:
    import statistics

    presets = list(results)
    tokens = results[presets[0]][0].spec.tokens
    head = "| tokens | bytes | " + " | ".join(f"{p} p50 us | {p} p99 us" for p in presets)
    if len(presets) > 1:
        head += f" | {presets[0]} / {presets[1]} p50"
    lines = [head + " |", "|" + "---|" * (2 + 2 * len(presets) + (1 if len(presets) > 1 else 0))]
    for t in tokens:
        cells = [str(t), str(results[presets[0]][0].by_tokens()[t].bytes)]
        med = {}
        for p in presets:
            med[p] = statistics.median(r.by_tokens()[t].us_p50 for r in results[p])
            cells += [f"{med[p]:.1f}", f"{statistics.median(r.by_tokens()[t].us_p99 for r in results[p]):.1f}"]
        if len(presets) > 1:
            cells.append(f"{med[presets[0]] / med[presets[1]]:.3f}")
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv[:1] == ["worker"]:
        ap = argparse.ArgumentParser(prog="python -m kimi_perf.nccl worker")
        ap.add_argument("--spec", required=True)
        ap.add_argument("--out", required=True)
        a = ap.parse_args(argv[1:])
        _worker(AllReduceSpec.from_dict(json.loads(a.spec)), Path(a.out))
        return 0
    ap = argparse.ArgumentParser(prog="python -m kimi_perf.nccl", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--nproc", type=int, default=2, help="ranks (one per GPU)")
    ap.add_argument("--backend", default="nccl", choices=["nccl", "gloo"])
    ap.add_argument("--presets", default="default,seed-pcie-tuned", help="comma-separated, see engines/presets.py")
    ap.add_argument("--tokens", default="1,8,32,128", help="decode batch sizes (rows of the message)")
    ap.add_argument("--hidden", type=int, default=7168, help="model hidden size (7168: Kimi-K2.5 / DeepSeek-V3)")
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--iters", type=int, default=200)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--json", default=None, help="also write all results here")
    a = ap.parse_args(argv)
    spec = AllReduceSpec(tokens=tuple(int(t) for t in a.tokens.split(",")), hidden=a.hidden, dtype=a.dtype,
                         iters=a.iters, world_size=a.nproc, backend=a.backend)
    res = compare_presets(spec, [p.strip() for p in a.presets.split(",") if p.strip()], a.repeats)
    print(_table(res))
    if a.json:
        Path(a.json).write_text(json.dumps({p: [asdict(r) for r in rs] for p, rs in res.items()}, indent=1, default=str))
    return 0


if __name__ == "__main__":
    sys.exit(main())
