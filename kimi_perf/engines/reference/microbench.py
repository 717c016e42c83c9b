"""In-process decode micro-benchmark of the reference engine's runner: eager vs CUDA graphs, per batch.

Why, next to the HTTP perf tests: when ``test_decode_vs_memory_floor`` fails, the first question is
whether the model step itself got slower or the server around it did. This times exactly the
scheduler's decode call (``runner.forward`` for every running sequence, then the argmax read back to
the host) with no HTTP, tokenizer or client in the loop, and prints the same bandwidth-floor ratio.

    python -m kimi_perf.engines.reference.microbench --shape llama-3.1-8b --batches 1,8,32,128

``--shape`` builds a random-weight model of a published shape (no checkpoint needed); ``--model-path``
loads a real one.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any


def _runner(args: argparse.Namespace, max_slots: int) -> Any:
    import torch

    from .model import LlamaRunner

    dtype = getattr(torch, args.dtype)
    if args.model_path:
        return LlamaRunner.from_pretrained(args.model_path, device=args.device, dtype=dtype, max_slots=max_slots,
                                           max_len=args.context + args.steps + 8)
    # the shapes live below the engines (kimi_perf.models.shapes): an engine does not import the gate's
    # profile loader
    from ...models.shapes import DUMMY_SHAPES

    d = Path(tempfile.mkdtemp(prefix="kimi-microbench-"))
    (d / "config.json").write_text(json.dumps(DUMMY_SHAPES[args.shape]))
    return LlamaRunner.from_pretrained(d, device=args.device, dtype=dtype, max_slots=max_slots,
                                       max_len=args.context + args.steps + 8, load_format="dummy")


def bench(runner: Any, batch: int, context: int, steps: int) -> dict[str, float]:
    import torch

    gen = torch.Generator().manual_seed(batch)
    vocab = min(runner.shape.vocab_size, 32000)
    for i in range(batch):  # prefill one row at a time: the cache state a decode step sees
        ids = torch.randint(0, vocab, (1, context), generator=gen)
        runner.forward(i, ids.to(runner.device), [0], [context], logits="none")
    lens = [context] * batch
    nxt = torch.randint(0, vocab, (batch, 1), generator=gen).to(runner.device)
    times = []
    for _ in range(steps):
        t0 = time.perf_counter()
        out = runner.forward(0, nxt, lens, [1] * batch, logits="last")
        toks = out.logits.argmax(-1).tolist()  # the engine reads tokens back every step: include it
        times.append(time.perf_counter() - t0)
        nxt = torch.tensor(toks, device=runner.device)[:, None]
        lens = [n + 1 for n in lens]
    times = times[max(1, steps // 8):]  # first steps: allocator and kernel-selection warm-up
    step = statistics.median(times)
    return {"batch": batch, "step_ms_p50": step * 1e3, "step_ms_min": min(times) * 1e3,
            "tok_s": batch / step}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m kimi_perf.engines.reference.microbench", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--shape", default="llama-3.1-8b", help="dummy shape (kimi_perf.models.shapes.DUMMY_SHAPES)")
    ap.add_argument("--model-path", default=None, help="a transformers Llama checkpoint instead of --shape")
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--batches", default="1,8,32,128")
    ap.add_argument("--context", type=int, default=512, help="tokens already in each sequence's cache")
    ap.add_argument("--steps", type=int, default=64)
    ap.add_argument("--modes", default="eager,graphs")
    ap.add_argument("--json", default=None, help="also write the results here")
    a = ap.parse_args(argv)
    batches = [int(b) for b in a.batches.split(",")]
    runner = _runner(a, max(batches))
    res: dict[str, Any] = {"shape": a.model_path or a.shape, "dtype": a.dtype, "context": a.context,
                           "weight_bytes": runner.w.nbytes(), "results": []}
    if a.device == "cuda":
        from ...roofline import DecodeFloor, copy_bandwidth_bytes_s

        bw = copy_bandwidth_bytes_s()
        floor = DecodeFloor(runner.w.nbytes(), bw)
        res.update(copy_bandwidth_bytes_s=bw, floor_tok_s=floor.tok_s)
        print(f"weights {runner.w.nbytes() / 1e9:.2f} GB, copy bandwidth {bw / 1e12:.2f} TB/s, batch-1 floor "
              f"{floor.tok_s:.1f} tok/s", flush=True)
    for mode in a.modes.split(","):
        if mode == "graphs":
            from .cuda_graphs import enable_cuda_graphs

            t0 = time.monotonic()
            enable_cuda_graphs(runner, max_bs=max(batches), q_lens=[1], log=lambda m: None)
            print(f"captured {len(runner.graphs.graphs)} graphs in {time.monotonic() - t0:.1f}s", flush=True)
        for b in batches:
            r = {"mode": mode, **bench(runner, b, a.context, a.steps)}
            if "floor_tok_s" in res and b == 1:
                r["floor_ratio"] = r["tok_s"] / res["floor_tok_s"]
            res["results"].append(r)
            print(json.dumps(r), flush=True)
    if a.json:
        Path(a.json).write_text(json.dumps(res, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
