"""Response shapes of the reference server: OpenAI completions/chat (as vLLM serves them) and SGLang's
native ``meta_info``, plus the error body both use and the SSE framing.

Split out of ``server.py``: these are the bytes clients parse and the suite's metric code depends
on, kept apart from the routing so a change of shape is a change of this file only.
"""

from __future__ import annotations

import json
import time
from typing import Any

from aiohttp import web

__all__ = ["chat_message_choice", "completion_choice", "error", "meta_info", "openai_body", "sse", "usage"]


def error(status: int, message: str, param: str | None = None, etype: str | None = None) -> web.Response:
    """The OpenAI error body (vLLM's ``ErrorResponse``), JSON with the HTTP status."""
    etype = etype or {400: "BadRequestError", 404: "NotFoundError", 503: "ServiceUnavailableError"}.get(
        status, "InternalServerError")
    return web.json_response({"error": {"message": message, "type": etype, "param": param, "code": status}},
                             status=status)


def sse(payload: dict[str, Any] | str) -> bytes:
    """One server-sent event: ``data: <compact JSON or the literal string>`` and a blank line."""
    data = payload if isinstance(payload, str) else json.dumps(payload, separators=(",", ":"))
    return f"data: {data}\n\n".encode()


def usage(seq: Any) -> dict[str, int]:
    pt, ct = len(seq.prompt), len(seq.output)
    return {"prompt_tokens": pt, "completion_tokens": ct, "total_tokens": pt + ct}


def completion_choice(chat: bool, text: str, finish: str | None) -> dict[str, Any]:
    """A streamed choice: a chat ``delta`` or a completions ``text``."""
    if chat:
        return {"index": 0, "delta": {"content": text} if text else {}, "finish_reason": finish}
    return {"index": 0, "text": text, "logprobs": None, "finish_reason": finish}


def chat_message_choice(chat: bool, text: str, finish: str | None) -> dict[str, Any]:
    """The one choice of a non-streamed response."""
    if chat:
        return {"index": 0, "message": {"role": "assistant", "content": text}, "finish_reason": finish}
    return {"index": 0, "text": text, "logprobs": None, "finish_reason": finish}


def openai_body(cid: str, obj: str, created: int, model: str, choices: list[dict[str, Any]],
                **extra: Any) -> dict[str, Any]:
    """The envelope every OpenAI response and chunk shares."""
    return {"id": cid, "object": obj, "created": created, "model": model, "choices": choices, **extra}


def meta_info(seq: Any, t_start: float, spec_steps: int) -> dict[str, Any]:
    """SGLang 0.5.23's ``meta_info`` of one /generate result: finish reason, token counts, latency, the
    speculative-decoding counters when the server drafts, and hidden states when asked."""
    s = seq
    reason: dict[str, Any] | None = None
    if s.finish_reason == "length":
        reason = {"type": "length", "length": len(s.output)}
    elif s.finish_reason == "stop":
        reason = {"type": "stop", "matched": s.finish_matched}
    elif s.finish_reason == "abort":
        reason = {"type": "abort"}
    meta: dict[str, Any] = {
        "id": s.rid, "finish_reason": reason, "prompt_tokens": len(s.prompt),
        "completion_tokens": len(s.output), "cached_tokens": 0,
        "e2e_latency": time.monotonic() - t_start,
    }
    if spec_steps:
        meta.update({
            "spec_verify_ct": s.spec_verify_ct,
            "spec_num_correct_drafts": s.spec_accepted,
            "spec_num_proposed_drafts": s.spec_proposed,
            "spec_accept_rate": (s.spec_accepted / s.spec_proposed) if s.spec_proposed else 0.0,
            "spec_accept_length": (len(s.output) / s.spec_verify_ct) if s.spec_verify_ct else 0.0,
            "spec_accept_token_num_per_pos": list(s.spec_accepted_per_pos),
        })
    if s.want_hidden and s.finished:
        rows = s.hidden_rows
        out: list[Any] = []
        if rows:
            out.append(rows[0].tolist())  # 2-D prefill block
            out += [r.tolist() for r in rows[1:]]  # 1-D rows (decode) or 2-D blocks (spec verify)
        meta["hidden_states"] = out
    return meta
