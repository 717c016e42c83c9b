"""Measure EAGLE-3 acceptance and speedup on a running engine, the same way for every engine.

Acceptance comes from vLLM's Prometheus counters (``vllm:spec_decode_num_drafts_total`` and friends,
also exported by the reference engine) read before and after the measured window, so warm-up and
earlier tests never leak in:

- accept length = 1 + accepted / drafts (tokens per verify step, bonus included);
- acceptance rate = accepted / draft tokens (no bonus);
- per-position rate i = accepted at position i / drafts.

SGLang exports none of those counters. Its acceptance comes from a second, unmeasured pass over the
same prompts through ``/generate``, whose finished responses carry per-request ``meta_info``
(``spec_verify_ct``, ``spec_num_correct_drafts``, ``spec_num_proposed_drafts`` and the
``spec_correct_drafts_histogram``; sglang 0.5.17 managers/tokenizer_manager.py
``_calculate_spec_decoding_metrics``). Summed over requests they give the same three numbers as the
counters: accept length = 1 + correct / verify steps, acceptance rate = correct / proposed, and, for
chain drafting, accepted at position i = verify steps that accepted more than i drafts. SGLang's own
per-request ``spec_accept_length`` (completion_tokens / spec_verify_ct, which also counts the token the
prefill produced) and the ``/server_info`` window (``internal_states[0].avg_spec_accept_length`` since
the last flush) are reported next to it. Why a second pass rather than ``/generate`` for the timed one:
speed is measured by the suite's one streaming client (``/v1/completions``), identically on every engine.

Windows start with ``/flush_cache``. SGLang refuses it (HTTP 400) while requests are running or
waiting, so :func:`flush_cache` asks the server to wait for idle (``?timeout=``, sglang 0.5.17
entrypoints/http_server.py ``flush_cache`` and managers/scheduler_components/flush_wrapper.py
``SchedulerFlushWrapper``), retries with backoff up to a deadline, and then fails with the server's
answer: a swallowed refusal would make SGLang's window silently lifetime-cumulative. vLLM has no
``/flush_cache`` (404), which is fine: its counters are differenced.

Every call takes ``headers``: against an existing endpoint (``--perf-url``) they carry its bearer token
(:meth:`kimi_perf.endpoint.Endpoint.headers`), which SGLang's ``--api-key`` asks for on every route and
vLLM's on ``/v1`` (sending it to ``/metrics`` too costs nothing). Launched servers need none.
"""

from __future__ import annotations

import asyncio
import json
import time
import urllib.error
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from ..httpjson import get_json, get_text, post
from ..load.client import run_workload
from ..load.workload import Workload
from ..promparse import counter_sum, parse_prometheus
from ..results import note as note_repeat

__all__ = ["AcceptanceResult", "FlushError", "FlushOutcome", "SGLangAcceptance", "SpecCounters",
           "WIRING_HINT", "flush_cache", "measure_generation", "read_spec_counters", "sglang_acceptance",
           "speculation_evidence"]

WIRING_HINT = (
    "accept length exactly 1.00 means no draft token was ever accepted -- a wiring fault, not drafter "
    "quality. Likely causes: aux-layer ids in another engine's convention (off by one: vLLM uses the input "
    "of layer k, SGLang Llama adds 1), features captured pre/post final norm differently from serving, "
    "a d2t/t2d map that does not match the draft vocab, the wrong --speculative-algorithm (EAGLE vs "
    "EAGLE3), or a drafter trained for another target")


@dataclass(frozen=True)
class SpecCounters:
    drafts: float
    draft_tokens: float
    accepted: float
    per_pos: tuple[float, ...]

    def __sub__(self, o: SpecCounters) -> SpecCounters:
        n = max(len(self.per_pos), len(o.per_pos))
        a = list(self.per_pos) + [0.0] * (n - len(self.per_pos))
        b = list(o.per_pos) + [0.0] * (n - len(o.per_pos))
        return SpecCounters(self.drafts - o.drafts, self.draft_tokens - o.draft_tokens, self.accepted - o.accepted,
                            tuple(x - y for x, y in zip(a, b)))


def read_spec_counters(base_url: str, headers: Mapping[str, str] | None = None) -> SpecCounters | None:
    """vLLM's speculative-decoding counters on ``/metrics`` (the reference engine exports the same);
    None when the server exports none (vLLM registers them only with a ``--speculative-config``; SGLang
    never). Differencing two reads gives a window's acceptance."""
    try:
        m = parse_prometheus(get_text(base_url.rstrip("/") + "/metrics", headers, timeout=30))
    except urllib.error.HTTPError as e:
        if e.code == 404:  # SGLang started without --enable-metrics: no counters, same as none exported
            return None
        raise
    drafts = counter_sum(m, "vllm:spec_decode_num_drafts_total")
    if drafts is None:
        return None
    per = []
    i = 0
    while True:
        v = counter_sum(m, "vllm:spec_decode_num_accepted_tokens_per_pos_total", position=str(i))
        if v is None:
            break
        per.append(v)
        i += 1
    return SpecCounters(drafts, counter_sum(m, "vllm:spec_decode_num_draft_tokens_total") or 0.0,
                        counter_sum(m, "vllm:spec_decode_num_accepted_tokens_total") or 0.0, tuple(per))


def speculation_evidence(base_url: str, headers: Mapping[str, str] | None = None) -> str | None:
    """How a running server shows it decodes speculatively, or None when it shows nothing: vLLM (and the
    reference engine) register the ``vllm:spec_decode_*`` counters only with a drafter; SGLang names its
    ``speculative_algorithm`` in ``/server_info``. What an existing endpoint (``--perf-url``) is asked
    before its acceptance is measured: without either, there is no acceptance to read."""
    c = read_spec_counters(base_url, headers)
    if c is not None:
        return f"vllm:spec_decode_* counters on /metrics ({c.drafts:.0f} drafts so far)"
    info = _get_json(base_url.rstrip("/") + "/server_info", headers)
    alg = str((info or {}).get("speculative_algorithm") or "").upper()
    if alg not in ("", "NONE"):
        return f"speculative_algorithm {alg} in /server_info"
    return None


@dataclass(frozen=True)
class AcceptanceResult:
    counters: SpecCounters | None
    output_tok_s: float
    texts: tuple[str, ...]
    completion_tokens: int
    extra: dict[str, Any] = field(default_factory=dict)
    server_accept_length: float | None = None  # SGLang /server_info window (its definition, bonus incl.)
    # where ``counters`` come from: "prometheus" (vLLM, reference engine), "sglang-meta_info" (summed
    # per-request /generate meta_info), or "none"
    source: str = "prometheus"

    @property
    def accept_length(self) -> float:
        c = self.counters
        if c is None or c.drafts <= 0:
            return self.server_accept_length if self.server_accept_length is not None else float("nan")
        return 1.0 + c.accepted / c.drafts

    @property
    def accept_rate(self) -> float:
        c = self.counters
        return float("nan") if c is None or c.draft_tokens <= 0 else c.accepted / c.draft_tokens

    def pos_rates(self) -> list[float]:
        c = self.counters
        return [] if c is None or c.drafts <= 0 else [p / c.drafts for p in c.per_pos]


# -- /flush_cache ------------------------------------------------------------------------------------


class FlushError(RuntimeError):
    """The server kept refusing /flush_cache until the deadline; the message carries its last answer."""


@dataclass(frozen=True)
class FlushOutcome:
    flushed: bool  # False: the server has no /flush_cache (vLLM); its counters are differenced instead
    status: int
    answer: str
    attempts: int
    waited_s: float

    def describe(self) -> dict[str, Any]:
        return {"flushed": self.flushed, "status": self.status, "answer": self.answer.strip()[:200],
                "attempts": self.attempts, "waited_s": round(self.waited_s, 3)}


def flush_cache(base_url: str, *, deadline_s: float = 300.0, server_wait_s: float = 30.0,
                first_backoff_s: float = 0.5, max_backoff_s: float = 8.0,
                sleep: Callable[[float], None] = time.sleep,
                clock: Callable[[], float] = time.monotonic,
                headers: Mapping[str, str] | None = None) -> FlushOutcome:
    """POST /flush_cache until the server flushes, waiting for idle; raise :class:`FlushError` with the
    server's answer when it still refuses after ``deadline_s``.

    Each attempt passes ``?timeout=`` (at most ``server_wait_s``, never past the deadline): sglang
    0.5.17 then defers the flush until the scheduler is fully idle instead of refusing at once. Servers
    without that parameter (older SGLang, the reference engine) ignore it. Refusals (400: "Flush cache
    failed.", "Timed out waiting for idle state.", "Another flush_cache is already in progress.") and
    5xx are retried with exponential backoff; 404/405 means the engine has no such endpoint (vLLM).
    """
    url = base_url.rstrip("/") + "/flush_cache"
    t0 = clock()
    backoff = first_backoff_s
    attempts = 0
    last = (0, "")
    while True:
        attempts += 1
        wait = max(0.0, min(server_wait_s, deadline_s - (clock() - t0)))
        q = f"?timeout={wait:g}" if wait >= 0.5 else ""
        try:
            status, body = post(url + q, b"", headers, wait + 30.0)
        except (TimeoutError, urllib.error.URLError, OSError) as e:
            reason = e.reason if isinstance(e, urllib.error.URLError) else e
            if not isinstance(reason, TimeoutError):
                raise FlushError(f"POST {url}: {type(reason).__name__}: {reason} "
                                 "(is the server running?)") from None
            # the server may still be holding a deferred flush: the retry is answered "already in progress"
            status, body = 0, f"client-side timeout after {wait + 30.0:.0f}s"
        if status == 200:
            return FlushOutcome(True, status, body, attempts, clock() - t0)
        if status in (404, 405):
            return FlushOutcome(False, status, body, attempts, clock() - t0)
        last = (status, body)
        if status not in (0, 400) and status < 500:
            break
        left = deadline_s - (clock() - t0)
        if left <= 0:
            break
        sleep(min(backoff, left))
        backoff = min(backoff * 2, max_backoff_s)
    raise FlushError(f"POST {url} refused {attempts} times over {clock() - t0:.1f}s (deadline "
                     f"{deadline_s:g}s); last answer HTTP {last[0]}: {last[1].strip()[:300]!r}. SGLang "
                     "flushes only when no request is running or waiting: something else is still sending "
                     "requests to this server, or a request is stuck (see its log)")


# -- SGLang per-request acceptance -------------------------------------------------------------------


@dataclass(frozen=True)
class SGLangAcceptance:
    """Per-request SGLang ``meta_info`` spec fields, summed over the requests of one pass."""

    requests: int
    completion_tokens: int
    verify_ct: int
    correct_drafts: int
    proposed_drafts: int
    histogram: tuple[int, ...] | None  # summed spec_correct_drafts_histogram; None: not usable (see why)
    histogram_unusable: str | None = None
    without_spec_fields: int = 0  # requests that finished in prefill (no verify step, no spec fields)

    @property
    def accept_length(self) -> float:
        """1 + correct drafts per verify step: the counters' definition (and /server_info's)."""
        return 1.0 + self.correct_drafts / self.verify_ct if self.verify_ct else float("nan")

    @property
    def accept_length_sglang(self) -> float:
        """SGLang's per-request definition, summed: completion tokens / verify steps (which counts the
        token the prefill produced)."""
        return self.completion_tokens / self.verify_ct if self.verify_ct else float("nan")

    def counters(self) -> SpecCounters:
        per: tuple[float, ...] = ()
        if self.histogram is not None and self.verify_ct and self.proposed_drafts % self.verify_ct == 0:
            steps = self.proposed_drafts // self.verify_ct
            h = list(self.histogram) + [0] * max(0, steps + 1 - len(self.histogram))
            # chain drafting: the draft at position i is accepted iff the step accepted more than i drafts
            per = tuple(float(sum(h[i + 1 :])) for i in range(steps))
        return SpecCounters(float(self.verify_ct), float(self.proposed_drafts), float(self.correct_drafts),
                            per)


def sglang_acceptance(records: Sequence[Mapping[str, Any]]) -> SGLangAcceptance:
    """Sum :func:`kimi_perf.engines.sglang.parse_generate_response` records of a speculative server.

    A request with more than one completion token but no spec fields means the server did not report
    them (not a speculative server, or another layout): that is an error, never a zero.
    """
    comp = ver = corr = prop = missing = 0
    hist: list[int] | None = []
    unusable = None
    for i, r in enumerate(records):
        comp += int(r["completion_tokens"])
        if "spec_verify_ct" not in r:
            if int(r["completion_tokens"]) > 1:
                raise ValueError(f"request {i}: {r['completion_tokens']} completion tokens but no "
                                 "spec_verify_ct in meta_info: the server is not speculative or reports "
                                 "acceptance elsewhere")
            missing += 1
            continue
        if r.get("spec_num_correct_drafts") is None or r.get("spec_num_proposed_drafts") is None:
            raise ValueError(f"request {i}: meta_info has spec_verify_ct but no spec_num_correct_drafts/"
                             "spec_num_proposed_drafts")
        v, c = int(r["spec_verify_ct"]), int(r["spec_num_correct_drafts"])
        ver, corr, prop = ver + v, corr + c, prop + int(r["spec_num_proposed_drafts"])
        h = r.get("spec_correct_drafts_histogram")
        if hist is None:
            continue
        if h is None:
            hist, unusable = None, f"request {i} has no spec_correct_drafts_histogram"
            continue
        if sum(h) != v or sum(k * n for k, n in enumerate(h)) != c:
            hist, unusable = None, (f"request {i}: histogram {list(h)} does not add up to its {v} verify "
                                    f"steps and {c} correct drafts")
            continue
        hist += [0] * (len(h) - len(hist))
        for k, n in enumerate(h):
            hist[k] += int(n)
    return SGLangAcceptance(len(records), comp, ver, corr, prop, tuple(hist) if hist is not None else None,
                            unusable, missing)


def _get_json(url: str, headers: Mapping[str, str] | None = None) -> dict[str, Any] | None:
    """The JSON object at ``url``; None only when the server has no such route (404/405: vLLM has no
    /server_info). Any other failure is raised: a /server_info that errors must not quietly turn
    SGLang's acceptance window or the engine detection into "not available"."""
    try:
        data = get_json(url, headers, timeout=30)
    except urllib.error.HTTPError as e:
        if e.code in (404, 405):
            return None
        raise RuntimeError(f"GET {url} answered HTTP {e.code}: {e.reason} (see the server's log)") from None
    except (OSError, ValueError) as e:
        raise RuntimeError(f"GET {url} failed: {e} (is the server still up? see its log)") from None
    return data if isinstance(data, dict) else None


def _server_kind(info: Mapping[str, Any] | None) -> str:
    """"reference", "sglang" or "other" from /server_info (None: the engine has none, e.g. vLLM)."""
    from ..capture.server import REFERENCE_ENGINE_NAME

    if info is None:
        return "other"
    if info.get("engine") == REFERENCE_ENGINE_NAME:
        return "reference"
    # SGLang's /server_info: its server args plus internal_states and version, and no "engine" key
    if "engine" not in info and "internal_states" in info and "version" in info:
        return "sglang"
    return "other"


def _generate_all(base_url: str, prompts: Sequence[Sequence[int]], max_new_tokens: int, concurrency: int,
                  timeout_s: float, headers: Mapping[str, str] | None = None) -> list[dict[str, Any]]:
    """Greedy non-streaming SGLang ``/generate`` for each prompt (stop at EOS, like the timed pass)."""
    import aiohttp

    url = base_url.rstrip("/") + "/generate"

    async def run() -> list[dict[str, Any]]:
        sem = asyncio.Semaphore(concurrency)

        async def one(s: Any, ids: Sequence[int]) -> dict[str, Any]:
            body = {"input_ids": list(ids),
                    "sampling_params": {"max_new_tokens": max_new_tokens, "temperature": 0.0}}
            async with sem, s.post(url, json=body) as r:
                text = await r.text()
                if r.status != 200:
                    raise RuntimeError(f"/generate: HTTP {r.status}: {text[:300]}")
                return json.loads(text)

        async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=timeout_s),
                                         headers=dict(headers or {}) or None) as s:
            return list(await asyncio.gather(*(one(s, p) for p in prompts)))

    return asyncio.run(run())


def _sglang_acceptance_pass(base_url: str, prompts: Sequence[Sequence[int]], max_new_tokens: int, *,
                            concurrency: int, timed_texts: Sequence[str], timed_tokens: int, name: str,
                            flush_deadline_s: float, timeout_s: float, headers: Mapping[str, str] | None = None
                            ) -> tuple[SpecCounters | None, dict[str, Any]]:
    from ..engines.sglang import parse_generate_response, server_info_accept_length
    from ..progress import log

    fl = flush_cache(base_url, deadline_s=flush_deadline_s, headers=headers)
    answers = _generate_all(base_url, prompts, max_new_tokens, concurrency, timeout_s, headers)
    recs = [parse_generate_response(r)[0] for r in answers]
    info = _get_json(base_url.rstrip("/") + "/server_info", headers)
    window = server_info_accept_length(info) if info is not None else None
    texts = [r.get("text") or "" for r in recs]
    out: dict[str, Any] = {
        "flush": fl.describe(), "server_info_window_accept_length": window,
        "same_texts_as_timed_pass": f"{sum(a == b for a, b in zip(texts, timed_texts))}/{len(texts)}",
        "completion_tokens": {"acceptance_pass": sum(int(r["completion_tokens"]) for r in recs),
                              "timed_pass": timed_tokens}}
    try:
        acc = sglang_acceptance(recs)
    except ValueError as e:
        out["per_request_unavailable"] = str(e)
        log(f"{name}: SGLang per-request acceptance unavailable ({e}); the /server_info window is what "
            "remains")
        return None, out
    c = acc.counters()
    out.update(requests=acc.requests, verify_ct=acc.verify_ct, correct_drafts=acc.correct_drafts,
               proposed_drafts=acc.proposed_drafts, requests_without_spec_fields=acc.without_spec_fields,
               accept_length=acc.accept_length, accept_length_sglang_definition=acc.accept_length_sglang,
               correct_drafts_histogram=list(acc.histogram) if acc.histogram is not None else None)
    if not c.per_pos:
        out["per_position_unavailable"] = (acc.histogram_unusable
                                           or "no spec_correct_drafts_histogram in meta_info")
    if window is not None and acc.verify_ct:
        # The window lags: SGLang folds its counters in every decode_log_interval (40) decode steps.
        out["server_info_window_vs_per_request"] = window - acc.accept_length
    log(f"{name}: SGLang /generate meta_info over {acc.requests} requests: accept length "
        f"{acc.accept_length:.3f} (1 + correct/verify; SGLang's completion/verify "
        f"{acc.accept_length_sglang:.3f}), /server_info window "
        + (f"{window:.3f}" if window is not None else "n/a"))
    return c, out


def measure_generation(base_url: str, model: str, prompts: Sequence[Sequence[int]], max_new_tokens: int,
                       *, name: str = "eagle3-eval", concurrency: int = 1, engine: str | None = None,
                       flush_deadline_s: float = 300.0, request_timeout_s: float = 1800.0,
                       headers: Mapping[str, str] | None = None) -> AcceptanceResult:
    """Greedy generation of ``prompts`` (stop at EOS, as users run it) with counters around it.

    ``engine``: "sglang", "reference" or "vllm"; None detects it from ``/server_info``. On a speculative
    SGLang server the per-request acceptance pass follows the timed one (module docstring). ``headers``
    go with every request (an existing endpoint's token).
    """
    fl = flush_cache(base_url, deadline_s=flush_deadline_s, headers=headers)
    info = _get_json(base_url.rstrip("/") + "/server_info", headers)
    kind = engine or _server_kind(info)
    before = read_spec_counters(base_url, headers)
    w = Workload(name=name, dataset="mtbench", input_len=max(len(p) for p in prompts), output_len=max_new_tokens,
                 num_prompts=len(prompts), concurrency=concurrency, warmup=0, ignore_eos=False)
    res = run_workload(base_url, model, prompts, w, headers=dict(headers or {}))
    note_repeat(res)  # the running test's per-request records (kimi_perf.results)
    if res.metrics["error_rate"] > 0:
        raise RuntimeError(f"{name}: {int(res.metrics['num_failed'])} requests failed: {res.errors[:3]}")
    after = read_spec_counters(base_url, headers)
    delta = after - before if (after is not None and before is not None) else None
    source = "prometheus" if delta is not None else "none"
    extra: dict[str, Any] = {"flush": fl.describe()}
    server_len = None
    texts = tuple(r.text for r in res.records)
    tokens = int(res.metrics["total_output_tokens"])
    if delta is None:  # SGLang: the window since /flush_cache, from /server_info
        from ..engines.sglang import server_info_accept_length

        now = _get_json(base_url.rstrip("/") + "/server_info", headers)
        server_len = server_info_accept_length(now) if now is not None else None
        alg = str((info or {}).get("speculative_algorithm") or "").upper()
        spec_on = alg not in ("", "NONE")
        if kind == "sglang" and spec_on:
            per_req, extra["sglang"] = _sglang_acceptance_pass(
                base_url, prompts, max_new_tokens, concurrency=concurrency, timed_texts=texts,
                timed_tokens=tokens, name=name, flush_deadline_s=flush_deadline_s,
                timeout_s=request_timeout_s, headers=headers)
            if per_req is not None:
                delta, source = per_req, "sglang-meta_info"
            if not (per_req is not None and per_req.per_pos):
                extra["per_position_unavailable"] = (extra["sglang"].get("per_position_unavailable")
                                                     or extra["sglang"].get("per_request_unavailable"))
    return AcceptanceResult(delta, res.metrics["output_throughput"], texts, tokens, extra=extra,
                            server_accept_length=server_len, source=source)
