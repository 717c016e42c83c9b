"""CUDA graphs for the reference engine's decode and verify forwards.

Why: at batch 1 a decode step of an 8B Llama reads 16 GB of weights (3.8 ms on an H200) but issues
~1,300 small kernels; launched one by one from Python that launch overhead, not the GPU, sets the
speed, and the suite would be measuring its own engine's overhead instead of the hardware. SGLang and
vLLM capture decode into CUDA graphs for the same reason (``--cuda-graph-max-bs-decode``).

What is captured: :meth:`LlamaRunner.forward_batch` for every (batch bucket, query length, key window)
triple, on static input buffers. A step pads its batch up to the next bucket with rows whose
``n_t = 0`` (their cache writes land in the scratch position, their outputs are never read) and picks
the smallest key window that covers its longest sequence, so attention reads only the cache it needs
(at C=128 a full-context window would read more bytes than the weights). The query lengths are 1
(plain decode, logits of the last token) and ``k + 1`` (EAGLE-3 verify: logits of every position plus
the drafter's aux layers). Anything else -- prefill, hidden-state requests, shapes beyond the largest
bucket -- runs eagerly; the results are the same, only slower.

Outputs of a replay live in the graph's static buffers and are overwritten by the next replay: the
engine consumes them (argmax, copies of hidden rows) before the next forward.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, TypeVar

import torch

from .model import CaptureSpec, LlamaRunner, RunnerOutput, slot_batch_from_tensors

__all__ = ["GraphRunner", "batch_buckets", "capture_graph", "enable_cuda_graphs", "window_buckets"]


def batch_buckets(max_bs: int) -> list[int]:
    """1, 2, 4, 8, then steps of 8 to 32, of 16 to 128, of 32 beyond (SGLang's spacing, coarser)."""
    out = [b for b in (1, 2, 4) if b <= max_bs]
    b = 8
    while b <= max_bs:
        out.append(b)
        b += 8 if b < 32 else 16 if b < 128 else 32
    if out[-1] != max_bs:
        out.append(max_bs)
    return out


def window_buckets(max_len: int, smallest: int = 256) -> list[int]:
    """Key windows: powers of two from ``smallest``, then ``max_len`` itself."""
    out = []
    t = smallest
    while t < max_len:
        out.append(t)
        t *= 2
    out.append(max_len)
    return out


T = TypeVar("T")


def capture_graph(body: Callable[[], T], *, pool: Any, stream: torch.cuda.Stream) -> tuple[torch.cuda.CUDAGraph, T]:
    """Run ``body`` once on ``stream`` as a warm-up, then capture it into a graph sharing ``pool``.

    The warm-up runs outside the capture so lazy kernel selection and first allocations never end up
    in the graph; the returned output tensors are the graph's static outputs.
    """
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        body()
    torch.cuda.current_stream().wait_stream(stream)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g, pool=pool, stream=stream):
        out = body()
    return g, out


@dataclass
class _Static:
    tokens: torch.Tensor  # [B, q]
    c_t: torch.Tensor  # [B]
    n_t: torch.Tensor  # [B]


@dataclass
class _Graph:
    graph: torch.cuda.CUDAGraph
    out: RunnerOutput


class GraphRunner:
    """Captured forwards of one runner, keyed by (batch bucket, q, window)."""

    def __init__(self, runner: LlamaRunner, *, max_bs: int, modes: dict[int, tuple[CaptureSpec, str]]) -> None:
        self.runner = runner
        self.modes = dict(modes)  # q -> (capture spec, logits mode) the graphs of that q were captured with
        self.buckets = batch_buckets(min(max_bs, runner.max_slots))
        self.windows = window_buckets(runner.max_len)
        self.graphs: dict[tuple[int, int, int], _Graph] = {}
        self.static: dict[tuple[int, int], _Static] = {}
        self.pool = torch.cuda.graph_pool_handle()
        self.replays = 0
        self.fallbacks = 0

    def capture_all(self, log: Any = print) -> None:
        r = self.runner
        t0 = time.monotonic()
        total = len(self.buckets) * len(self.modes) * len(self.windows)
        done = 0
        stream = torch.cuda.Stream()
        # largest first: later (smaller) graphs reuse the pool's blocks
        for q in sorted(self.modes, reverse=True):
            capture, logits = self.modes[q]
            for b in sorted(self.buckets, reverse=True):
                st = _Static(tokens=torch.zeros(b, q, dtype=torch.long, device=r.device),
                             c_t=torch.zeros(b, dtype=torch.long, device=r.device),
                             n_t=torch.zeros(b, dtype=torch.long, device=r.device))
                self.static[(b, q)] = st
                for t in sorted(self.windows, reverse=True):
                    self.graphs[(b, q, t)] = self._capture(st, q, t, capture, logits, stream)
                    done += 1
                    if done % 16 == 0 or done == total:
                        log(f"[kimi-ref] CUDA graphs: captured {done}/{total} (batch <= {b}, q={q}, window {t}) "
                            f"in {time.monotonic() - t0:.1f}s")
        torch.cuda.synchronize()

    @torch.inference_mode()
    def _capture(self, st: _Static, q: int, t: int, capture: CaptureSpec, logits: str,
                 stream: torch.cuda.Stream) -> _Graph:
        r = self.runner

        def body() -> RunnerOutput:
            sb = slot_batch_from_tensors(0, st.c_t, st.n_t, q, t, max_len=r.max_len, cos_table=r.cos,
                                         sin_table=r.sin, kpos=r._kpos)
            return r.forward_batch(st.tokens, sb, capture=capture, logits=logits)

        st.n_t.zero_()  # every row a padding row while capturing: all cache writes go to scratch
        return _Graph(*capture_graph(body, pool=self.pool, stream=stream))

    def run(self, tokens: torch.Tensor, cache_lens: Sequence[int], q_lens: Sequence[int], capture: CaptureSpec,
            logits: str) -> RunnerOutput | None:
        """Replay the matching graph, or ``None`` (the caller runs eagerly)."""
        bsz, q = tokens.shape
        mode = self.modes.get(q)
        if mode is None:
            return None  # a prefill: never graphed
        if mode != (capture, logits) or any(n != q for n in q_lens):
            self.fallbacks += 1  # a decode/verify step that could not replay (e.g. hidden states requested)
            return None
        b = next((x for x in self.buckets if x >= bsz), None)
        need = max(cache_lens) + q
        t = next((x for x in self.windows if x >= need), None)
        if b is None or t is None:
            self.fallbacks += 1
            return None
        st = self.static[(b, q)]
        g = self.graphs[(b, q, t)]
        st.tokens[:bsz].copy_(tokens, non_blocking=True)
        lens = torch.tensor(list(cache_lens) + [0] * (b - bsz), dtype=torch.long)
        st.c_t.copy_(lens, non_blocking=True)
        st.n_t.fill_(0)
        st.n_t[:bsz] = q
        g.graph.replay()
        self.replays += 1
        out = g.out
        hidden = {k: v[:bsz] for k, v in out.hidden.items()}
        return RunnerOutput(logits=out.logits[:bsz] if out.logits is not None else None, hidden=hidden)


def enable_cuda_graphs(runner: LlamaRunner, *, max_bs: int, q_lens: Sequence[int],
                       aux_layers: Sequence[int] = (), log: Any = print) -> GraphRunner:
    """Capture decode (q=1) and, when speculative decoding is on, verify (q=k+1) graphs for ``runner``.

    ``aux_layers``: the drafter's feature layers, captured by the verify graphs (the engine reads them
    after every verify step).
    """
    if runner.device.type != "cuda":
        raise ValueError("CUDA graphs need a CUDA runner")
    modes: dict[int, tuple[CaptureSpec, str]] = {}
    for q in sorted(set(q_lens)):
        if q == 1 and len(set(q_lens)) > 1:
            continue  # with a drafter every step is a verify step: plain decode is never run
        modes[q] = (CaptureSpec(), "last") if q == 1 else (CaptureSpec(layers=tuple(sorted(aux_layers))), "all")
    gr = GraphRunner(runner, max_bs=max_bs, modes=modes)
    gr.capture_all(log=log)
    runner.graphs = gr
    return gr
