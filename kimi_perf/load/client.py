"""Asyncio streaming load generator: the one client every engine is measured with.

Why our own client instead of ``vllm bench serve`` / ``sglang.benchmark.serving``: the two disagree on
defaults and on what they call TPOT (chunk-based vs token-based), and the suite must measure SGLang,
vLLM and the reference engine *identically* (mission point 1). The client sends token-id prompts to
``/v1/completions`` (so input lengths are exact on every engine), streams with
``stream_options.include_usage`` (so completion tokens come from the server), timestamps every content
chunk, and turns every failure -- HTTP error, reset connection, truncated stream, timeout -- into a
counted error with its cause; metrics are computed from completed requests only and say how many
failed.

A workload with ``api="chat"`` streams from ``/v1/chat/completions`` instead, as vLLM's own benchmark
client does (vllm 0.32 ``vllm/benchmarks/lib/endpoint_request_func.py``
``async_request_openai_chat_completions``): the prompt ids decoded by the tokenizer they were drawn
from, sent as one user message; ``max_completion_tokens``, ``ignore_eos`` (vLLM, SGLang and the
reference engine take it on chat too) and ``stream_options.include_usage``; the content is
``choices[0].delta.content``. Two deliberate differences from that client: the first token is the first
chunk with content (vLLM's chat stream opens with a role-only delta whose content is "", which its
client counts as the first token), and token counts come from the usage chunk only, so TPOT divides by
the server's completion tokens, never by chunks (docs/metrics.md). The server applies its chat template,
so the input length is the server's ``usage.prompt_tokens``, not ``input_len``; decoding happens before
the measured window, never in it.
"""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from ..progress import log
from .results import BenchResult, RequestRecord, compute_metrics
from .sse import SSEParser
from .workload import Workload

__all__ = ["StreamOutcome", "arrival_gaps", "request_bodies", "run_workload", "stream_completion"]


@dataclass
class StreamOutcome:
    ok: bool = False
    error: str | None = None
    t_send: float = 0.0
    t_first: float | None = None
    t_end: float = 0.0
    chunk_times: list[float] = field(default_factory=list)
    completion_tokens: int | None = None
    prompt_tokens: int | None = None
    text_parts: list[str] = field(default_factory=list)
    n_events: int = 0


def _content(choice: dict[str, Any]) -> str:
    if "text" in choice:
        return choice.get("text") or ""
    delta = choice.get("delta") or {}
    # a reasoning model's thinking tokens stream as delta.reasoning (vLLM >= 0.10; reasoning_content
    # before, and SGLang's): tokens all the same, so they time TTFT and ITL like content
    return delta.get("content") or delta.get("reasoning_content") or delta.get("reasoning") or ""


def handle_event(out: StreamOutcome, data: str, now: float) -> bool:
    """Apply one SSE ``data`` payload to ``out``; True for the ``[DONE]`` sentinel. This is the
    client's whole per-chunk cost, which the overhead benchmark measures."""
    out.n_events += 1
    if data == "[DONE]":
        return True
    try:
        ev = json.loads(data)
    except json.JSONDecodeError:
        out.error = f"malformed SSE data: {data[:120]!r}"
        return False
    if "error" in ev:
        err = ev["error"]
        out.error = f"in-stream error: {err.get('message', err) if isinstance(err, dict) else err}"
        return False
    usage = ev.get("usage")
    if usage:
        out.completion_tokens = usage.get("completion_tokens")
        out.prompt_tokens = usage.get("prompt_tokens")
    choices = ev.get("choices")
    if choices:
        text = _content(choices[0])
        if text:
            if out.t_first is None:
                out.t_first = now
            out.chunk_times.append(now)
            out.text_parts.append(text)
    return False


async def stream_completion(
    session: Any,
    url: str,
    payload: dict[str, Any],
    *,
    timeout_s: float,
) -> StreamOutcome:
    """POST one streaming completion and record its timeline. Never raises for server faults."""
    import aiohttp

    out = StreamOutcome()
    parser = SSEParser()
    done = False

    async def _do() -> None:
        nonlocal done
        async with session.post(url, json=payload) as resp:
            if resp.status != 200:
                body = (await resp.text())[:300]
                out.error = f"HTTP {resp.status}: {body}"
                return
            async for chunk in resp.content.iter_any():
                now = time.perf_counter()
                for data in parser.feed(chunk):
                    if handle_event(out, data, now):
                        done = True

    out.t_send = time.perf_counter()
    try:
        await asyncio.wait_for(_do(), timeout_s)
    except asyncio.TimeoutError:
        out.error = f"timeout after {timeout_s:.0f}s (client-side)"
    except aiohttp.ClientPayloadError as e:
        out.error = f"truncated response body: {e}"
    except (aiohttp.ClientConnectionError, ConnectionResetError, aiohttp.ServerDisconnectedError) as e:
        out.error = f"connection error: {type(e).__name__}: {e}"
    except aiohttp.ClientError as e:
        out.error = f"client error: {type(e).__name__}: {e}"
    out.t_end = time.perf_counter()
    if out.error is None:
        if not done:
            out.error = "stream ended without [DONE] (truncated SSE)" + (" mid-event" if parser.pending else "")
        elif out.completion_tokens is None:
            out.error = "no usage in stream: the server ignored stream_options.include_usage"
        elif out.t_first is None and out.completion_tokens > 0:
            out.error = "no content chunk although usage reports completion tokens"
        else:
            out.ok = True
    return out


def _body(model: str, w: Workload, route_fields: dict[str, Any]) -> dict[str, Any]:
    """A streamed request of ``w``: ``route_fields`` are what the route names its own way (the prompt
    and its token budget); sampling, ``ignore_eos``, usage and the workload's extras are the same on both."""
    return {
        "model": model,
        **route_fields,
        "temperature": w.temperature,
        "ignore_eos": w.ignore_eos,
        "stream": True,
        "stream_options": {"include_usage": True},
        **({"seed": w.seed} if w.temperature > 0 else {}),
        **dict(w.extra),
    }


def request_bodies(model: str, prompts: Sequence[Sequence[int]], w: Workload, tokenizer: Any = None,
                   max_tokens: Sequence[int] | None = None) -> tuple[str, list[dict[str, Any]]]:
    """The route and one request body per prompt of ``w``, asking for ``max_tokens[i]`` tokens (default
    ``output_len`` each). ``api="chat"`` decodes the ids with ``tokenizer`` (the one the prompts were
    drawn from; ValueError without it)."""
    lens = list(max_tokens) if max_tokens is not None else [w.output_len] * len(prompts)
    if w.api != "chat":
        return "/v1/completions", [_body(model, w, {"prompt": list(p), "max_tokens": n}) for p, n in zip(prompts, lens)]
    if tokenizer is None:
        raise ValueError(f"workload {w.name!r}: api chat sends text, so the client needs the tokenizer the "
                         "prompts were drawn from (run_workload(..., tokenizer=...); a PromptFactory has one)")
    texts = tokenizer.batch_decode([list(p) for p in prompts], skip_special_tokens=False)
    return "/v1/chat/completions", [
        _body(model, w, {"messages": [{"role": "user", "content": t}], "max_completion_tokens": n})
        for t, n in zip(texts, lens)]


HEARTBEAT_S = 10.0


def arrival_gaps(w: Workload) -> list[float] | None:
    """Seconds between consecutive request sends of an open-loop workload (None: closed loop).

    vLLM's ``vllm bench serve`` (``--request-rate``, ``--burstiness``): gamma-distributed gaps with
    shape ``burstiness`` and scale ``1 / (rate * burstiness)``, so the mean gap is ``1 / rate`` and the
    coefficient of variation ``1 / sqrt(burstiness)``; seeded by the workload's seed, so base and
    candidate of an A/B (and every repeat) see the same arrival pattern."""
    if w.request_rate == float("inf"):
        return None
    import numpy as np

    rng = np.random.default_rng(w.seed)
    return [float(g) for g in rng.gamma(shape=w.burstiness, scale=1.0 / (w.request_rate * w.burstiness),
                                        size=max(0, w.num_prompts - 1))]


async def _heartbeat(w: Workload, state: dict[str, Any], every: float = HEARTBEAT_S) -> None:
    """A progress line every ``every`` seconds while a repeat runs (a CPU-box EAGLE-3 repeat takes ~20 s,
    a vLLM-CPU warm-up longer): printed from the event loop, i.e. the main thread, where the plugin's
    sink can suspend pytest's capture; one line per 10 s costs the client nothing measurable."""
    t0 = time.monotonic()
    while True:
        await asyncio.sleep(every)
        log(f"{w.name} c={w.concurrency}: {state['phase']}, {state['done']}/{state['n']} requests done "
            f"({time.monotonic() - t0:.0f}s)")


async def _run(base_url: str, model: str, prompts: Sequence[Sequence[int]], w: Workload,
               warmup_prompts: Sequence[Sequence[int]], headers: dict[str, str] | None = None,
               tokenizer: Any = None) -> BenchResult:
    import aiohttp

    lens = w.output_lens(len(prompts))
    route, bodies = request_bodies(model, prompts, w, tokenizer, lens)
    _, warm_bodies = request_bodies(model, warmup_prompts, w, tokenizer)
    url = base_url.rstrip("/") + route
    connector = aiohttp.TCPConnector(limit=0, force_close=False)
    timeout = aiohttp.ClientTimeout(total=None, sock_connect=30)
    state: dict[str, Any] = {"phase": "warm-up", "done": 0, "n": len(warmup_prompts)}
    beat = asyncio.create_task(_heartbeat(w, state, HEARTBEAT_S))
    async with aiohttp.ClientSession(connector=connector, timeout=timeout, headers=headers or None) as session:
        warm_errors = []
        for body in warm_bodies:
            o = await stream_completion(session, url, body, timeout_s=w.request_timeout_s)
            state["done"] += 1
            if not o.ok:
                warm_errors.append(o.error)
        state.update(phase="measuring", done=0, n=len(prompts))
        sem = asyncio.Semaphore(w.concurrency)
        outcomes: list[StreamOutcome | None] = [None] * len(prompts)
        gaps = arrival_gaps(w)

        async def one(i: int, body: dict[str, Any]) -> None:
            async with sem:
                outcomes[i] = await stream_completion(session, url, body, timeout_s=w.request_timeout_s)
            state["done"] += 1

        cpu0 = time.process_time()
        t0 = time.perf_counter()
        tasks = []
        for i, body in enumerate(bodies):
            tasks.append(asyncio.create_task(one(i, body)))
            if gaps is not None and i + 1 < len(prompts):
                await asyncio.sleep(gaps[i])
        await asyncio.gather(*tasks)
        t1 = time.perf_counter()
        cpu = time.process_time() - cpu0
    beat.cancel()
    records = []
    for i, (oc, p) in enumerate(zip(outcomes, prompts)):
        assert oc is not None
        o = oc
        records.append(RequestRecord(
            index=i, prompt_len=len(p), max_tokens=lens[i], ok=o.ok, error=o.error,
            t_send=o.t_send - t0, t_first=(o.t_first - t0) if o.t_first is not None else None,
            t_end=o.t_end - t0, chunk_times=tuple(t - t0 for t in o.chunk_times),
            completion_tokens=o.completion_tokens, server_prompt_tokens=o.prompt_tokens,
            text="".join(o.text_parts),
        ))
    metrics = compute_metrics(records, w.concurrency, duration_s=t1 - t0, client_cpu_s=cpu)
    return BenchResult(workload=w, records=tuple(records), metrics=metrics, duration_s=t1 - t0,
                       client_cpu_s=cpu, warmup_errors=tuple(e for e in warm_errors if e))


def run_workload(
    base_url: str,
    model: str,
    prompts: Sequence[Sequence[int]],
    workload: Workload,
    *,
    warmup_prompts: Sequence[Sequence[int]] | None = None,
    headers: dict[str, str] | None = None,
    tokenizer: Any = None,
) -> BenchResult:
    """Run one measured repeat of ``workload`` (warm-ups first, not measured) and compute metrics.
    ``headers`` go with every request (an existing endpoint's Authorization, ``--perf-url``);
    ``tokenizer`` decodes the prompts of an ``api="chat"`` workload (unused otherwise)."""
    if len(prompts) != workload.num_prompts:
        raise ValueError(f"got {len(prompts)} prompts for a workload of num_prompts={workload.num_prompts}")
    warm = list(warmup_prompts if warmup_prompts is not None else prompts[: workload.warmup])
    return asyncio.run(_run(base_url, model, prompts, workload, warm, headers, tokenizer))
