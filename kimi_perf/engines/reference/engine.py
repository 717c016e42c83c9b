"""Continuous-batching scheduler of the reference engine.

One thread owns the model runner and loops: admit waiting requests into free cache slots (one batched
prefill), then advance *every* running sequence by one decode step (or one EAGLE-3 draft-and-verify
step) in a single batched forward. Requests therefore join and leave the batch at step boundaries --
the behaviour of SGLang and vLLM that makes throughput grow with concurrency, which is what the
suite's concurrency sweep measures.

The HTTP layer (``server.py``) talks to this thread through :meth:`Engine.submit` (thread-safe) and a
per-step callback scheduled onto its asyncio loop, so a step costs one cross-thread hop for the whole
batch, not one per token.
"""

from __future__ import annotations

import itertools
import os
import threading
import time
import traceback
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch

from . import PLANT_ENV, planted_fraction
from .model import CaptureSpec, LlamaRunner

__all__ = ["PLANT_ENV", "Engine", "EngineStats", "SamplingParams", "Sequence", "StepEvent"]

# Test hook for proving the gate's power (python -m kimi_perf.power, the A/B planted-slowdown tests):
# make every decode step X (a fraction: 0.10 = 10%) slower by burning CPU for X times the step's own
# measured duration, right after the step. Busy work proportional to the step -- not a fixed sleep --
# is what a real regression looks like: it scales with batch size and model, costs CPU time (so the
# engine's CPU-per-token metric sees it too) and holds the GIL like the engine's own Python does.
# Read once at engine start; never set in normal runs. (The name lives in the torch-free package
# __init__ so the A/B planner can clear it for the base side.)


@dataclass(frozen=True)
class SamplingParams:
    max_new_tokens: int = 16
    temperature: float = 0.0
    ignore_eos: bool = False
    seed: int | None = None
    min_new_tokens: int = 0


@dataclass
class Sequence:
    """One request's state inside the scheduler."""

    rid: str
    prompt: list[int]
    params: SamplingParams
    want_hidden: bool = False
    output: list[int] = field(default_factory=list)
    slot: int = -1
    cache_len: int = 0  # tokens whose K/V are in the target cache
    next_token: int = -1  # last sampled token, not yet fed to the target
    hidden_rows: list[torch.Tensor] = field(default_factory=list)  # CPU fp32 blocks, SGLang layout
    t_arrival: float = field(default_factory=time.monotonic)
    t_first: float | None = None
    finished: bool = False
    finish_reason: str | None = None
    finish_matched: int | None = None
    cancelled: bool = False
    error: str | None = None
    generator: torch.Generator | None = None
    # speculative-decoding counters (SGLang meta_info / vLLM Prometheus definitions, docs/metrics.md)
    spec_verify_ct: int = 0
    spec_proposed: int = 0
    spec_accepted: int = 0
    spec_accepted_per_pos: list[int] = field(default_factory=list)
    # drafter inputs not yet in the drafter cache: target features and the tokens they pair with
    draft_feats: torch.Tensor | None = None
    draft_tokens: list[int] = field(default_factory=list)
    draft_cache_len: int = 0

    @property
    def total_len(self) -> int:
        return len(self.prompt) + len(self.output)


@dataclass(frozen=True)
class StepEvent:
    """What one scheduler step produced for one sequence."""

    seq: Sequence
    new_tokens: tuple[int, ...]
    finished: bool


@dataclass
class EngineStats:
    """Counters exported on ``/metrics``; written by the engine thread only."""

    prompt_tokens: int = 0
    generation_tokens: int = 0
    requests_finished: int = 0
    requests_aborted: int = 0
    steps: int = 0
    prefill_batches: int = 0
    # vLLM-style spec-decode counters (monotonic) and SGLang-style window (reset by /flush_cache)
    spec_drafts: int = 0
    spec_draft_tokens: int = 0
    spec_accepted_tokens: int = 0
    spec_accepted_per_pos: list[int] = field(default_factory=list)
    window_verify_ct: int = 0
    window_tokens: int = 0
    window_proposed: int = 0
    window_accepted: int = 0
    last_step_s: float = 0.0
    last_gen_throughput: float = 0.0
    decode_s: float = 0.0  # time in decode/spec steps, planted slowdown included
    planted_s: float = 0.0  # of which the planted slowdown (PLANT_ENV), for its own test


class Engine:
    """The scheduler. ``on_step`` is called (from the engine thread) with each step's events."""

    def __init__(
        self,
        runner: LlamaRunner,
        *,
        eos_token_ids: set[int],
        max_running: int,
        max_prefill_tokens: int = 4096,
        prefill_wait_s: float = 0.0,
        hidden_layers: tuple[int | str, ...] = (),
        hidden_final_norm: bool = True,
        drafter: Any | None = None,
        spec_steps: int = 0,
        on_step: Callable[[list[StepEvent]], None] | None = None,
        on_fatal: Callable[[str], None] | None = None,
    ) -> None:
        if max_running > runner.max_slots:
            raise ValueError(f"max_running={max_running} exceeds the cache's {runner.max_slots} slots")
        self.runner = runner
        self.eos = set(eos_token_ids)
        self.max_running = max_running
        self.max_prefill_tokens = max_prefill_tokens
        self.prefill_wait_s = prefill_wait_s
        self.hidden_layers = hidden_layers
        self.hidden_final_norm = hidden_final_norm
        self.drafter = drafter
        self.spec_steps = spec_steps if drafter is not None else 0
        self.on_step = on_step
        self.on_fatal = on_fatal
        self.stats = EngineStats(spec_accepted_per_pos=[0] * self.spec_steps)
        self.running: list[Sequence] = []
        self._inbox: deque[Sequence] = deque()
        self._waiting: deque[Sequence] = deque()
        self._cv = threading.Condition()
        self._stop = False
        self._thread: threading.Thread | None = None
        self.fatal: str | None = None
        self.plant = planted_fraction(os.environ)
        self._ids = itertools.count()
        self._flush_requested = False

    # -- control (any thread) -----------------------------------------------------------------

    def start(self) -> None:
        self._thread = threading.Thread(target=self._loop, name="kimi-ref-engine", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        with self._cv:
            self._stop = True
            self._cv.notify_all()
        if self._thread is not None:
            self._thread.join(timeout=10)

    def submit(self, seq: Sequence) -> None:
        if self.fatal is not None:
            raise RuntimeError(f"engine is dead: {self.fatal}")
        if seq.params.temperature > 0:
            seq.generator = torch.Generator(device=self.runner.device)
            if seq.params.seed is not None:
                seq.generator.manual_seed(seq.params.seed)
            else:
                seq.generator.seed()
        with self._cv:
            self._inbox.append(seq)
            self._cv.notify_all()

    def abort(self, seq: Sequence) -> None:
        seq.cancelled = True  # the engine thread drops it at the next step boundary
        with self._cv:
            self._cv.notify_all()

    def flush(self) -> None:
        """SGLang's /flush_cache: no prefix cache to drop here, but it resets the acceptance window."""
        with self._cv:
            self._flush_requested = True
            self._cv.notify_all()

    @property
    def num_waiting(self) -> int:
        return len(self._inbox) + len(self._waiting)

    def alive(self) -> bool:
        return self.fatal is None and self._thread is not None and self._thread.is_alive()

    # -- engine thread ------------------------------------------------------------------------

    def _loop(self) -> None:
        try:
            while True:
                with self._cv:
                    while not self._stop and not self._inbox and not self._waiting and not self.running:
                        self._cv.wait(timeout=1.0)
                    if self._stop:
                        return
                    while self._inbox:
                        self._waiting.append(self._inbox.popleft())
                    if self._flush_requested:
                        s = self.stats
                        s.window_verify_ct = s.window_tokens = s.window_proposed = s.window_accepted = 0
                        self._flush_requested = False
                self.step()
        except Exception:  # noqa: BLE001 - any engine error is fatal and must reach the clients
            msg = traceback.format_exc()
            self.fatal = msg.strip().splitlines()[-1]
            print(f"[kimi-ref] FATAL engine error:\n{msg}", flush=True)
            failed = [*self.running, *self._waiting, *self._inbox]
            for seq in failed:
                seq.error = f"engine failure: {self.fatal}"
                seq.finished = True
            if self.on_step and failed:
                self.on_step([StepEvent(s, (), True) for s in failed])
            if self.on_fatal:
                self.on_fatal(self.fatal)

    def step(self) -> None:
        """One scheduler iteration: a prefill of newly admitted requests if any (prefill first, as
        SGLang schedules), otherwise one decode/spec step for every running sequence."""
        t0 = time.perf_counter()
        events: list[StepEvent] = []
        self._drop_cancelled()
        self._retire()
        admitted = self._admit()
        if admitted:
            events += self._prefill(admitted)
        elif self.running:
            events += self._spec_step() if self.spec_steps else self._decode_step()
            if self.plant:
                self._burn(self.plant * (time.perf_counter() - t0))
            self.stats.decode_s += time.perf_counter() - t0
        self._retire()
        dt = time.perf_counter() - t0
        st = self.stats
        st.steps += 1
        st.last_step_s = dt
        new = sum(len(e.new_tokens) for e in events)
        if dt > 0 and new:
            st.last_gen_throughput = new / dt
        if events and self.on_step:
            self.on_step(events)

    def _burn(self, seconds: float) -> None:
        """The planted slowdown (``PLANT_ENV``): spin on the CPU for ``seconds``."""
        end = time.perf_counter() + seconds
        while time.perf_counter() < end:
            pass
        self.stats.planted_s += seconds

    def _drop_cancelled(self) -> None:
        if any(s.cancelled for s in self._waiting):
            self.stats.requests_aborted += sum(1 for s in self._waiting if s.cancelled)
            keep = [s for s in self._waiting if not s.cancelled]
            self._waiting.clear()
            self._waiting.extend(keep)
        for s in self.running:
            if s.cancelled and not s.finished:
                s.finished = True
                s.finish_reason = "abort"
                self.stats.requests_aborted += 1

    def _prefill_due(self) -> bool:
        """Whether to prefill now or let waiting requests gather for one batched prefill.

        Every prefill pauses decoding of all running sequences for a step. At high concurrency requests
        finish (and their successors arrive) nearly every step, and a prefill per arrival would halve
        decode throughput on a GPU, where a one-prompt prefill costs about what a many-prompt one does.
        So with sequences running, waiting requests are admitted once there are ``running / 8`` of
        them or the oldest has waited ``prefill_wait_s``. At concurrency <= 8, and whenever nothing
        is running, that is "immediately", the behaviour CPU runs and single-stream TTFT see.
        """
        if not self.running or self.prefill_wait_s <= 0:
            return True
        if len(self._waiting) >= max(1, len(self.running) // 8):
            return True
        return time.monotonic() - self._waiting[0].t_arrival >= self.prefill_wait_s

    def _admit(self) -> list[Sequence]:
        admitted: list[Sequence] = []
        if not self._waiting or not self._prefill_due():
            return admitted
        budget = self.max_prefill_tokens
        width = 0
        while self._waiting and len(self.running) + len(admitted) < self.max_running:
            nxt = self._waiting[0]
            w = max(width, len(nxt.prompt))
            # padded batch cost, not the sum of lengths: right padding is computed too
            if admitted and w * (len(admitted) + 1) > budget:
                break
            admitted.append(self._waiting.popleft())
            width = w
        for s in admitted:
            s.slot = len(self.running)
            self.running.append(s)
        return admitted

    def _capture_for(self, seqs: list[Sequence]) -> CaptureSpec:
        want = any(s.want_hidden for s in seqs)
        layers: set[int] = set()
        if self.drafter is not None:
            layers |= set(self.drafter.aux_layers)
        if want:
            layers |= {k for k in self.hidden_layers if isinstance(k, int)}
        final = want and (self.hidden_final_norm or "final" in self.hidden_layers)
        return CaptureSpec(layers=tuple(sorted(layers)), final_norm=final)

    def _hidden_rows(self, out_hidden: dict[Any, torch.Tensor], b: int, n: int) -> torch.Tensor:
        """Rows [n, D] of one batch row in the response layout: the final norm output, or the
        requested aux layers concatenated (SGLang's aux mode; "final" = the final norm output, an
        extension of the reference engine so one server serves every alignment comparison)."""
        if self.hidden_final_norm:
            return out_hidden["final"][b, :n].float().cpu()
        return torch.cat([out_hidden[k][b, :n] for k in self.hidden_layers], dim=-1).float().cpu()

    def _sample(self, logits: torch.Tensor, seqs: list[Sequence]) -> list[int]:
        """Greedy rows by argmax; sampled rows by the Gumbel-max trick on noise from each request's own
        generator (so a seeded request is reproducible whatever batch it lands in). One device->host
        read for the whole batch: per-row ``multinomial(...).item()`` synchronised the GPU once per
        sampled request and capped batched throughput."""
        hot = [i for i, s in enumerate(seqs) if s.params.temperature > 0]
        if not hot:
            return logits.argmax(dim=-1).tolist()
        lg = logits.float()
        idx = torch.tensor(hot, device=lg.device)
        temps = torch.tensor([seqs[i].params.temperature for i in hot], device=lg.device)
        u = torch.stack([torch.rand(lg.shape[-1], device=lg.device, generator=seqs[i].generator) for i in hot])
        gumbel = -torch.log(-torch.log(u.clamp_(1e-20, 1.0)))
        picked = (torch.log_softmax(lg[idx] / temps[:, None], dim=-1) + gumbel).argmax(dim=-1)
        out = lg.argmax(dim=-1)
        out[idx] = picked
        return out.tolist()

    def _prefill(self, seqs: list[Sequence]) -> list[StepEvent]:
        r = self.runner
        width = max(len(s.prompt) for s in seqs)
        tokens = torch.zeros(len(seqs), width, dtype=torch.long)
        for i, s in enumerate(seqs):
            tokens[i, : len(s.prompt)] = torch.tensor(s.prompt)
        lens = [len(s.prompt) for s in seqs]
        cap = self._capture_for(seqs)
        out = r.forward(seqs[0].slot, tokens.to(r.device), [0] * len(seqs), lens, capture=cap, logits="last")
        assert out.logits is not None
        firsts = self._sample(out.logits, seqs)
        now = time.monotonic()
        self.stats.prefill_batches += 1
        events = []
        for i, s in enumerate(seqs):
            s.cache_len = lens[i]
            s.next_token = firsts[i]
            s.t_first = now
            self.stats.prompt_tokens += lens[i]
            if s.want_hidden:
                s.hidden_rows.append(self._hidden_rows(out.hidden, i, lens[i]))
            if self.drafter is not None:
                feats = torch.cat([out.hidden[k][i, : lens[i]] for k in self.drafter.aux_layers], dim=-1)
                s.draft_feats = feats
                s.draft_tokens = s.prompt[1:] + [firsts[i]]
                s.draft_cache_len = 0
            events.append(self._emit(s, [firsts[i]]))
        return events

    def _decode_step(self) -> list[StepEvent]:
        r = self.runner
        seqs = self.running
        tokens = torch.tensor([[s.next_token] for s in seqs], dtype=torch.long, device=r.device)
        cap = self._capture_for(seqs)
        logits_mode = "all" if cap.final_norm else "last"  # q=1: "all" is one row, same cost
        out = r.forward(0, tokens, [s.cache_len for s in seqs], [1] * len(seqs), capture=cap, logits=logits_mode)
        assert out.logits is not None
        lg = out.logits if logits_mode == "last" else out.logits[:, 0, :]
        toks = self._sample(lg, seqs)
        events = []
        for i, s in enumerate(seqs):
            s.cache_len += 1
            if s.want_hidden:
                s.hidden_rows.append(self._hidden_rows(out.hidden, i, 1)[0])
            s.next_token = toks[i]
            events.append(self._emit(s, [toks[i]]))
        return events

    def _spec_step(self) -> list[StepEvent]:
        """One EAGLE-3 round for every running sequence: draft k tokens, verify them in one target
        forward, keep the longest prefix that equals the target's greedy choice plus one bonus token."""
        r = self.runner
        seqs = self.running
        k = self.spec_steps
        assert self.drafter is not None, "speculative step without a drafter"
        drafts = self.drafter.propose(seqs, k)  # [B, k] target-vocab ids, python lists
        tokens = torch.tensor([[s.next_token, *d] for s, d in zip(seqs, drafts)], dtype=torch.long, device=r.device)
        cap = self._capture_for(seqs)
        out = r.forward(0, tokens, [s.cache_len for s in seqs], [k + 1] * len(seqs), capture=cap, logits="all")
        assert out.logits is not None
        greedy = out.logits.argmax(dim=-1).tolist()  # [B, k+1]
        st = self.stats
        events = []
        for i, s in enumerate(seqs):
            d, g = drafts[i], greedy[i]
            a = 0
            while a < k and d[a] == g[a]:
                a += 1
            new = d[:a] + [g[a]]
            if s.want_hidden:
                s.hidden_rows.append(self._hidden_rows(out.hidden, i, a + 1))
            feats = torch.cat([out.hidden[j][i, : a + 1] for j in self.drafter.aux_layers], dim=-1)
            s.draft_feats = feats
            s.draft_tokens = new
            s.cache_len += a + 1
            s.next_token = new[-1]
            ev = self._emit(s, new)
            # Count what was emitted, not what was verified: when EOS or max_tokens truncates the
            # step, accepted drafts past the cut (and the bonus) never reach the client. A step that
            # emitted e tokens counts e - 1 accepted (a when nothing was cut), so 1 + accepted / drafts
            # is exactly emitted tokens per verify step, the same figure as the SGLang-shaped window.
            acc = len(ev.new_tokens) - 1
            s.spec_verify_ct += 1
            s.spec_proposed += k
            s.spec_accepted += acc
            if not s.spec_accepted_per_pos:
                s.spec_accepted_per_pos = [0] * k
            for j in range(acc):
                s.spec_accepted_per_pos[j] += 1
                st.spec_accepted_per_pos[j] += 1
            st.spec_drafts += 1
            st.spec_draft_tokens += k
            st.spec_accepted_tokens += acc
            st.window_verify_ct += 1
            st.window_proposed += k
            st.window_accepted += acc
            st.window_tokens += len(ev.new_tokens)
            events.append(ev)
        return events

    def _emit(self, s: Sequence, new: list[int]) -> StepEvent:
        """Append new tokens, applying max_new_tokens, EOS and the context limit (in that order, token
        by token, so a multi-token speculative step stops exactly where plain decoding would)."""
        kept: list[int] = []
        limit = self.runner.max_len - (self.spec_steps + 1)
        for t in new:
            s.output.append(t)
            kept.append(t)
            n = len(s.output)
            if n >= s.params.max_new_tokens:
                s.finished, s.finish_reason = True, "length"
            elif not s.params.ignore_eos and t in self.eos and n >= s.params.min_new_tokens:
                s.finished, s.finish_reason, s.finish_matched = True, "stop", t
            elif s.total_len >= limit:
                s.finished, s.finish_reason = True, "length"
            if s.finished:
                break
        self.stats.generation_tokens += len(kept)
        return StepEvent(s, tuple(kept), s.finished)

    def _retire(self) -> None:
        """Drop finished sequences and keep the running ones compacted in slots [0, n).

        Each hole below n is filled by one survivor from above n, so a retirement costs one cache copy
        per finished sequence, whatever its slot. Shifting every later sequence down by one instead
        cost ~n/2 copies (of every layer's K and V) per retirement: with EOS-terminated requests at
        C=128 something retires nearly every step, and those copies, not the model, set the speed.
        """
        if not any(s.finished for s in self.running):
            return
        keep = [s for s in self.running if not s.finished]
        for s in self.running:
            if s.finished and s.finish_reason != "abort":
                self.stats.requests_finished += 1
        n = len(keep)
        holes = sorted(s.slot for s in self.running if s.finished and s.slot < n)
        movers = [s for s in keep if s.slot >= n]  # as many as there are holes
        for dst, s in zip(holes, movers):
            self.runner.move_slot(s.slot, dst, s.cache_len)
            if self.drafter is not None:
                self.drafter.move_slot(s.slot, dst, s.draft_cache_len)
            s.slot = dst
        keep.sort(key=lambda s: s.slot)  # batch row i is slot i
        self.running = keep
