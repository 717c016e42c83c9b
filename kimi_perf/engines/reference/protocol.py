"""Request validation for the reference engine's HTTP API.

A benchmark that silently accepts a misspelt field (``max_token``) measures the wrong thing, so the
server is strict: unknown fields, wrong types and out-of-range values are HTTP 400 with a message that
names the field and the accepted values. Field names and meanings follow the OpenAI completions API
as vLLM implements it, and SGLang's native ``/generate``.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

__all__ = ["BadRequest", "ParsedRequest", "parse_chat", "parse_completion", "parse_generate"]


class BadRequest(ValueError):
    """Maps to HTTP 400; ``param`` is the offending field."""

    def __init__(self, message: str, param: str | None = None) -> None:
        super().__init__(message)
        self.param = param


@dataclass(frozen=True)
class ParsedRequest:
    prompt_text: str | None
    prompt_ids: list[int] | None
    max_tokens: int
    temperature: float
    ignore_eos: bool
    seed: int | None
    min_tokens: int
    stream: bool
    include_usage: bool
    skip_special_tokens: bool
    return_hidden_states: bool = False
    messages: list[dict[str, str]] | None = None
    rid: str | None = None


_COMMON = {
    "model": str, "max_tokens": int, "temperature": (int, float), "top_p": (int, float), "top_k": int,
    "stream": bool, "stream_options": dict, "ignore_eos": bool, "seed": int, "n": int, "stop": (list, str, type(None)),
    "logprobs": (type(None), int, bool), "min_tokens": int, "user": str, "presence_penalty": (int, float),
    "frequency_penalty": (int, float), "best_of": (int, type(None)), "skip_special_tokens": bool,
    "echo": bool, "repetition_penalty": (int, float),
}
_COMPLETION = {**_COMMON, "prompt": (str, list)}
_CHAT = {**_COMMON, "messages": list, "max_completion_tokens": int}
_SAMPLING = {
    "max_new_tokens": int, "temperature": (int, float), "ignore_eos": bool, "top_p": (int, float),
    "top_k": int, "min_new_tokens": int, "stop": (list, str, type(None)), "skip_special_tokens": bool,
    "sampling_seed": int, "n": int, "stop_token_ids": (list, type(None)),
}
_GENERATE = {
    "text": (str, list), "input_ids": list, "sampling_params": dict, "stream": bool,
    "return_hidden_states": bool, "rid": str,
}


def _type_name(t: Any) -> str:
    ts = t if isinstance(t, tuple) else (t,)
    names = {int: "integer", float: "number", str: "string", bool: "boolean", list: "array", dict: "object",
             type(None): "null"}
    return " or ".join(dict.fromkeys(names.get(x, x.__name__) for x in ts))


def _check_fields(body: Any, schema: dict[str, Any], where: str) -> None:
    if not isinstance(body, dict):
        raise BadRequest(f"{where} must be a JSON object, got {type(body).__name__}")
    for key, value in body.items():
        if key not in schema:
            raise BadRequest(
                f"unknown field {key!r} in {where}; supported fields: {', '.join(sorted(schema))}", key)
        want = schema[key]
        # bool is an int subclass in Python: never accept true/false where a number is meant
        ok = isinstance(value, want) and not (isinstance(value, bool) and bool not in (want if isinstance(want, tuple) else (want,)))
        if not ok:
            raise BadRequest(f"field {key!r} in {where} must be {_type_name(want)}, got {type(value).__name__}", key)


def _check_text(text: str, field: str) -> str:
    """A prompt string the tokenizer can take: JSON may carry a lone surrogate (``"\\ud800"``), which
    Python decodes into a str that no UTF-8 tokenizer accepts (it was a 500 from inside tokenization)."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as e:
        raise BadRequest(f"{field} is not valid Unicode text ({e.reason} at index {e.start})", field) from None
    return text


def _check_token_ids(ids: list[Any], field: str, vocab_size: int) -> list[int]:
    if not ids:
        raise BadRequest(f"{field} is empty: give at least one token", field)
    for t in ids:
        if isinstance(t, bool) or not isinstance(t, int):
            raise BadRequest(f"{field} must be a list of integer token ids, found {type(t).__name__}", field)
        if not 0 <= t < vocab_size:
            raise BadRequest(f"token id {t} in {field} is outside the vocabulary [0, {vocab_size})", field)
    return list(ids)


# torch.Generator.manual_seed takes a 64-bit value; a larger seed was a plain-text 500 ("Overflow when
# unpacking long long") from inside the engine. vLLM and SGLang take non-negative seeds.
SEED_MAX = 2**63 - 1


def _seed(body: dict[str, Any], key: str) -> int | None:
    seed = body.get(key)
    if seed is not None and not 0 <= seed <= SEED_MAX:
        raise BadRequest(f"{key} must be an integer in [0, 2**63 - 1], got {seed}", key)
    return seed


def _common_sampling(body: dict[str, Any], *, max_key: str, default_max: int) -> dict[str, Any]:
    max_tokens = body.get(max_key, default_max)
    if max_tokens is None:
        max_tokens = default_max
    if max_tokens < 1:
        raise BadRequest(f"{max_key} must be >= 1, got {max_tokens}", max_key)
    # JSON as Python parses it admits NaN and Infinity: a NaN temperature passed every comparison below
    for k in ("temperature", "top_p", "presence_penalty", "frequency_penalty", "repetition_penalty"):
        if k in body and not math.isfinite(body[k]):
            raise BadRequest(f"{k} must be a finite number, got {body[k]}", k)
    temperature = float(body.get("temperature", 1.0 if max_key != "max_new_tokens" else 1.0))
    if temperature < 0:
        raise BadRequest(f"temperature must be >= 0, got {temperature}", "temperature")
    top_p = float(body.get("top_p", 1.0))
    if top_p != 1.0:
        raise BadRequest("top_p other than 1.0 is not supported by the reference engine", "top_p")
    top_k = body.get("top_k", -1)
    if top_k not in (-1, 0):
        raise BadRequest("top_k is not supported by the reference engine (use -1)", "top_k")
    if body.get("n", 1) != 1:
        raise BadRequest("n > 1 is not supported: send separate requests", "n")
    if body.get("best_of") not in (None, 1):
        raise BadRequest("best_of is not supported", "best_of")
    stop = body.get("stop")
    if stop not in (None, [], ""):
        raise BadRequest("stop strings are not supported by the reference engine; use ignore_eos/max tokens", "stop")
    if body.get("stop_token_ids") not in (None, []):
        raise BadRequest("stop_token_ids is not supported by the reference engine", "stop_token_ids")
    for pen in ("presence_penalty", "frequency_penalty"):
        if float(body.get(pen, 0.0)) != 0.0:
            raise BadRequest(f"{pen} is not supported (must be 0)", pen)
    if float(body.get("repetition_penalty", 1.0)) != 1.0:
        raise BadRequest("repetition_penalty is not supported (must be 1.0)", "repetition_penalty")
    if body.get("logprobs") not in (None, False, 0):
        raise BadRequest("logprobs are not supported by the reference engine", "logprobs")
    if body.get("echo"):
        raise BadRequest("echo is not supported by the reference engine", "echo")
    min_tokens = body.get("min_tokens", body.get("min_new_tokens", 0))
    min_key = "min_tokens" if "min_tokens" in body else "min_new_tokens"
    if min_tokens < 0:
        raise BadRequest(f"{min_key} must be >= 0", min_key)
    if min_tokens > max_tokens:
        raise BadRequest(f"{min_key} ({min_tokens}) must not exceed {max_key} ({max_tokens})", min_key)
    return {"max_tokens": int(max_tokens), "temperature": temperature, "min_tokens": int(min_tokens)}


def _stream_opts(body: dict[str, Any]) -> bool:
    opts = body.get("stream_options")
    if opts is None:
        return False
    _check_fields(opts, {"include_usage": bool, "continuous_usage_stats": bool}, "stream_options")
    if opts and not body.get("stream", False):
        raise BadRequest("stream_options is only allowed when stream is true", "stream_options")
    return bool(opts.get("include_usage", False))


def parse_completion(body: Any, *, vocab_size: int, default_max: int = 16) -> ParsedRequest:
    _check_fields(body, _COMPLETION, "the completions request")
    if "prompt" not in body:
        raise BadRequest("missing required field 'prompt' (a string or a list of token ids)", "prompt")
    prompt = body["prompt"]
    text: str | None = None
    ids: list[int] | None = None
    if isinstance(prompt, str):
        text = _check_text(prompt, "prompt")
        if not text:
            raise BadRequest("prompt is empty", "prompt")
    elif prompt and all(isinstance(p, str) for p in prompt):
        if len(prompt) != 1:
            raise BadRequest("batched prompts are not supported: send one request per prompt", "prompt")
        text = _check_text(prompt[0], "prompt")
    elif prompt and isinstance(prompt[0], list):
        if len(prompt) != 1:
            raise BadRequest("batched prompts are not supported: send one request per prompt", "prompt")
        ids = _check_token_ids(prompt[0], "prompt", vocab_size)
    else:
        ids = _check_token_ids(prompt, "prompt", vocab_size)
    s = _common_sampling(body, max_key="max_tokens", default_max=default_max)
    return ParsedRequest(
        prompt_text=text, prompt_ids=ids, max_tokens=s["max_tokens"], temperature=s["temperature"],
        ignore_eos=bool(body.get("ignore_eos", False)), seed=_seed(body, "seed"), min_tokens=s["min_tokens"],
        stream=bool(body.get("stream", False)), include_usage=_stream_opts(body),
        skip_special_tokens=bool(body.get("skip_special_tokens", True)),
    )


def parse_chat(body: Any, *, vocab_size: int, default_max: int = 16) -> ParsedRequest:
    _check_fields(body, _CHAT, "the chat completions request")
    msgs = body.get("messages")
    if not msgs:
        raise BadRequest("missing or empty field 'messages'", "messages")
    for i, m in enumerate(msgs):
        _check_fields(m, {"role": str, "content": str, "name": str}, f"messages[{i}]")
        if m.get("role") not in ("system", "user", "assistant"):
            raise BadRequest(f"messages[{i}].role must be system, user or assistant", "messages")
        if "content" not in m:
            raise BadRequest(f"messages[{i}] has no content", "messages")
        for k in ("content", "name"):
            if k in m:
                _check_text(m[k], "messages")
    key = "max_completion_tokens" if "max_completion_tokens" in body else "max_tokens"
    s = _common_sampling(body, max_key=key, default_max=default_max)
    return ParsedRequest(
        prompt_text=None, prompt_ids=None, max_tokens=s["max_tokens"], temperature=s["temperature"],
        ignore_eos=bool(body.get("ignore_eos", False)), seed=_seed(body, "seed"), min_tokens=s["min_tokens"],
        stream=bool(body.get("stream", False)), include_usage=_stream_opts(body),
        skip_special_tokens=bool(body.get("skip_special_tokens", True)),
        messages=[{"role": m["role"], "content": m["content"]} for m in msgs],
    )


def parse_generate(body: Any, *, vocab_size: int, default_max: int = 128) -> list[ParsedRequest]:
    """SGLang ``/generate``: one request or a batch (``text`` or ``input_ids`` as a list)."""
    _check_fields(body, _GENERATE, "the /generate request")
    has_text, has_ids = "text" in body, "input_ids" in body
    if has_text == has_ids:
        raise BadRequest("give exactly one of 'text' or 'input_ids'", "text" if has_text else "input_ids")
    sp = body.get("sampling_params") or {}
    _check_fields(sp, _SAMPLING, "sampling_params")
    spd = dict(sp)
    spd.setdefault("temperature", 1.0)
    s = _common_sampling(spd, max_key="max_new_tokens", default_max=default_max)
    rhs = body.get("return_hidden_states", False)
    prompts: list[tuple[str | None, list[int] | None]] = []
    if has_text:
        t = body["text"]
        texts = [t] if isinstance(t, str) else t
        if not texts or not all(isinstance(x, str) and x for x in texts):
            raise BadRequest("text must be a non-empty string or a list of non-empty strings", "text")
        for x in texts:
            _check_text(x, "text")
        prompts = [(x, None) for x in texts]
    else:
        ids = body["input_ids"]
        if ids and isinstance(ids[0], list):
            prompts = [(None, _check_token_ids(x, "input_ids", vocab_size)) for x in ids]
        else:
            prompts = [(None, _check_token_ids(ids, "input_ids", vocab_size))]
    return [
        ParsedRequest(
            prompt_text=pt, prompt_ids=pi, max_tokens=s["max_tokens"], temperature=s["temperature"],
            ignore_eos=bool(sp.get("ignore_eos", False)), seed=_seed(sp, "sampling_seed"), min_tokens=s["min_tokens"],
            stream=bool(body.get("stream", False)), include_usage=True,
            skip_special_tokens=bool(sp.get("skip_special_tokens", True)), return_hidden_states=bool(rhs),
            rid=body.get("rid"),
        )
        for pt, pi in prompts
    ]
