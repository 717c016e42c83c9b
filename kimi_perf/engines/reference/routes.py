"""The reference server's routes: the HTTP handlers, the hop from engine thread to asyncio, shutdown.

Split out of ``server.py`` (the command line and process lifecycle stay there): :class:`ReferenceServer`
owns the pending requests and routes; loading is :mod:`.loading`, the response bodies :mod:`.shapes`.

Shutdown (:meth:`ReferenceServer.begin_shutdown`): every open request is ended at once -- a stream with
an in-band error event (no ``[DONE]``), a plain request with 503 -- so the HTTP runner's cleanup finds
no handler waiting and the process exits within its grace period. Before, ``engine.stop()`` ran first:
open streams waited on a queue nothing would fill, and the server outlived SIGTERM by the runner's
60-second shutdown timeout while the client's stream stalled without an error.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import time
import uuid
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from aiohttp import web

from ... import __version__
from . import shapes
from .protocol import BadRequest, ParsedRequest, parse_chat, parse_completion, parse_generate

__all__ = ["ENGINE_NAME", "Pending", "ReferenceServer", "ServerClosing"]

ENGINE_NAME = "kimi-perf-reference"


class ServerClosing(RuntimeError):
    """The server is shutting down: the request was ended before it finished (503, or an error event)."""


# put into each open request's queue by begin_shutdown: _events raises ServerClosing on it
_CLOSING = object()


@dataclass
class Pending:
    """The HTTP side of one request: its queue of step events and detokeniser."""

    seq: Any
    queue: asyncio.Queue[Any]
    detok: Any
    t_start: float = field(default_factory=time.monotonic)


class ReferenceServer:
    def __init__(self, args: argparse.Namespace) -> None:
        self.args = args
        self.ready = False
        self.closing = False
        self.load_error: str | None = None
        self.engine: Any = None
        self.tokenizer: Any = None
        self.hf_tokenizer: Any = None
        self.vocab_size = 0
        self.tok_vocab = 0
        self.model_name = args.served_model_name or Path(args.model_path).name
        self.loop: asyncio.AbstractEventLoop | None = None
        self.pending: dict[int, Pending] = {}
        self.started = time.time()
        self.info: dict[str, Any] = {}
        self.aux_ids: tuple[int | str, ...] = ()

    # -- loading ------------------------------------------------------------------------------

    def load(self) -> None:
        """Runs in a worker thread while /health answers 503."""
        from .loading import load_engine

        t0 = time.monotonic()
        got = load_engine(self.args, on_step=self._on_step, on_fatal=self._on_fatal)
        self.engine, self.hf_tokenizer, self.tokenizer = got.engine, got.hf_tokenizer, got.tokenizer
        self.tok_vocab, self.vocab_size, self.aux_ids, self.info = got.tok_vocab, got.vocab_size, got.aux_ids, got.info
        self.ready = True
        print(f"[kimi-ref] ready in {time.monotonic() - t0:.1f}s", flush=True)

    # -- engine -> HTTP -----------------------------------------------------------------------

    def _on_step(self, events: list[Any]) -> None:
        loop = self.loop
        if loop is not None and not loop.is_closed():
            loop.call_soon_threadsafe(self._dispatch, events)

    def _dispatch(self, events: list[Any]) -> None:
        for ev in events:
            p = self.pending.get(id(ev.seq))
            if p is not None:
                p.queue.put_nowait(ev)

    def _on_fatal(self, msg: str) -> None:
        # A dead engine must not look healthy: clients got their errors; now exit non-zero so the
        # launcher reports an exit code instead of a server that hangs.
        import os

        if self.loop is not None:
            self.loop.call_soon_threadsafe(self.loop.call_later, 0.5, os._exit, 3)

    def begin_shutdown(self) -> int:
        """Refuse new requests and end every open one now (see the module docstring); returns how many
        were open. Runs on the event loop."""
        self.closing = True
        for p in list(self.pending.values()):
            p.queue.put_nowait(_CLOSING)
        return len(self.pending)

    # -- helpers ------------------------------------------------------------------------------

    error = staticmethod(shapes.error)

    def _not_ready(self) -> web.Response | None:
        if self.closing:
            return self.error(503, "the server is shutting down")
        if self.load_error:
            return self.error(503, f"model failed to load: {self.load_error}")
        if not self.ready:
            return self.error(503, "model is loading")
        if not self.engine.alive():
            return self.error(503, f"engine is dead: {self.engine.fatal}")
        return None

    async def _json(self, request: web.Request) -> Any:
        try:
            return await request.json()
        except (json.JSONDecodeError, UnicodeDecodeError) as e:
            raise BadRequest(f"request body is not valid JSON: {e}") from None

    def _tokenize(self, pr: ParsedRequest) -> list[int]:
        if pr.prompt_ids is not None:
            return pr.prompt_ids
        if pr.messages is not None:
            ids = self.hf_tokenizer.apply_chat_template(pr.messages, add_generation_prompt=True, tokenize=True)
            if isinstance(ids, dict) or hasattr(ids, "keys"):
                ids = ids["input_ids"]
            return list(ids)
        return list(self.hf_tokenizer(pr.prompt_text)["input_ids"])

    def _make_seq(self, pr: ParsedRequest, ids: list[int]) -> Any:
        from .detok import IncrementalDetokenizer
        from .engine import SamplingParams, Sequence

        ctx = self.args.context_length
        if len(ids) >= ctx:
            raise BadRequest(f"prompt has {len(ids)} tokens; this server's context length is {ctx}", "prompt")
        if len(ids) + pr.max_tokens > ctx:
            raise BadRequest(
                f"This model's maximum context length is {ctx} tokens. However, you requested "
                f"{len(ids) + pr.max_tokens} tokens ({len(ids)} in the prompt, {pr.max_tokens} for the "
                "completion). Reduce the prompt or max_tokens.", "max_tokens")
        if pr.temperature > 0 and self.engine.spec_steps:
            raise BadRequest("this server runs EAGLE-3 speculative decoding, which the reference engine "
                             "implements for greedy sampling only: send temperature 0", "temperature")
        if pr.return_hidden_states and not (self.args.enable_return_hidden_states
                                            or self.args.enable_return_aux_hidden_states):
            raise BadRequest("return_hidden_states needs a server started with --enable-return-hidden-states "
                             "(or --enable-return-aux-hidden-states)", "return_hidden_states")
        seq = Sequence(
            rid=pr.rid or uuid.uuid4().hex, prompt=ids,
            params=SamplingParams(max_new_tokens=pr.max_tokens, temperature=pr.temperature,
                                  ignore_eos=pr.ignore_eos, seed=pr.seed, min_new_tokens=pr.min_tokens),
            want_hidden=pr.return_hidden_states,
        )
        det = IncrementalDetokenizer(self.tokenizer, self.tok_vocab, skip_special_tokens=pr.skip_special_tokens)
        return Pending(seq, asyncio.Queue(), det)

    def _submit(self, p: Pending) -> None:
        if self.closing:
            raise ServerClosing("the server is shutting down")
        self.pending[id(p.seq)] = p
        try:
            self.engine.submit(p.seq)
        except RuntimeError:
            self.pending.pop(id(p.seq), None)
            raise

    async def _events(self, p: Pending):  # type: ignore[no-untyped-def]
        """Yield (text_delta, new_tokens, finished) until the sequence finishes; aborts on cancel."""
        try:
            while True:
                ev = await p.queue.get()
                if ev is _CLOSING:
                    raise ServerClosing("the server is shutting down (SIGTERM): request ended before it finished")
                if p.seq.error:
                    raise RuntimeError(p.seq.error)
                delta = p.detok.add(ev.new_tokens) if ev.new_tokens else ""
                if ev.finished:
                    delta += p.detok.flush()
                yield delta, ev.new_tokens, ev.finished
                if ev.finished:
                    return
        finally:
            self.pending.pop(id(p.seq), None)
            if not p.seq.finished:
                self.engine.abort(p.seq)

    @staticmethod
    def _failed(e: RuntimeError) -> web.Response:
        """A request the engine could not finish: 503 when the server is closing, 500 otherwise."""
        return shapes.error(503 if isinstance(e, ServerClosing) else 500, str(e))

    @staticmethod
    def _error_event(e: RuntimeError) -> dict[str, Any]:
        closing = isinstance(e, ServerClosing)
        return {"error": {"message": str(e), "type": "ServiceUnavailableError" if closing else "InternalServerError",
                          "code": 503 if closing else 500}}

    def _usage(self, p: Pending) -> dict[str, int]:
        return shapes.usage(p.seq)

    def _meta(self, p: Pending) -> dict[str, Any]:
        return shapes.meta_info(p.seq, p.t_start, self.engine.spec_steps)

    # -- handlers -----------------------------------------------------------------------------

    async def health(self, request: web.Request) -> web.Response:
        bad = self._not_ready()
        return bad if bad is not None else web.Response(text="ok")

    async def health_generate(self, request: web.Request) -> web.Response:
        bad = self._not_ready()
        if bad is not None:
            return bad
        pr = ParsedRequest(None, [self.hf_tokenizer.bos_token_id or 0], 1, 0.0, True, None, 0, False, False, True)
        p = self._make_seq(pr, pr.prompt_ids or [0])
        try:
            self._submit(p)
            async for _ in self._events(p):
                pass
        except RuntimeError as e:
            return self._failed(e)
        return web.Response(text="ok")

    async def models(self, request: web.Request) -> web.Response:
        return web.json_response({"object": "list", "data": [{
            "id": self.model_name, "object": "model", "created": int(self.started), "owned_by": "kimi-perf",
            "root": self.args.model_path, "max_model_len": self.args.context_length}]})

    async def server_info(self, request: web.Request) -> web.Response:
        bad = self._not_ready()
        if bad is not None:
            return bad
        st = self.engine.stats
        accept_len = (st.window_tokens / st.window_verify_ct) if st.window_verify_ct else None
        return web.json_response({
            **self.info, "version": __version__, "engine": ENGINE_NAME,
            # which checkout this server runs (an A/B base runs from a worktree of another commit)
            "source_root": str(Path(__file__).resolve().parents[3]),
            "planted_slowdown": self.engine.plant,
            "internal_states": [{"avg_spec_accept_length": accept_len,
                                 "last_gen_throughput": st.last_gen_throughput}],
            **({"cuda_graph_replays": g.replays, "cuda_graph_fallbacks": g.fallbacks}
               if (g := self.engine.runner.graphs) is not None else {}),
        })

    async def version(self, request: web.Request) -> web.Response:
        return web.json_response({"version": __version__, "engine": ENGINE_NAME})

    async def flush_cache(self, request: web.Request) -> web.Response:
        bad = self._not_ready()
        if bad is not None:
            return bad
        self.engine.flush()
        return web.Response(text="Cache flushed.")

    async def metrics(self, request: web.Request) -> web.Response:
        from .metrics import render_metrics

        body = render_metrics(self) if self.ready else b""
        return web.Response(body=body, content_type="text/plain", charset="utf-8")

    async def completions(self, request: web.Request) -> web.StreamResponse:
        return await self._openai(request, chat=False)

    async def chat_completions(self, request: web.Request) -> web.StreamResponse:
        return await self._openai(request, chat=True)

    async def _openai(self, request: web.Request, *, chat: bool) -> web.StreamResponse:
        bad = self._not_ready()
        if bad is not None:
            return bad
        try:
            body = await self._json(request)
            parse = parse_chat if chat else parse_completion
            pr = parse(body, vocab_size=self.vocab_size)
            model = body.get("model")
            if model is not None and model not in (self.model_name, self.args.model_path):
                return self.error(404, f"The model `{model}` does not exist; this server serves `{self.model_name}`",
                                  "model", "NotFoundError")
            p = self._make_seq(pr, self._tokenize(pr))
        except BadRequest as e:
            return self.error(400, str(e), e.param)
        cid = ("chatcmpl-" if chat else "cmpl-") + uuid.uuid4().hex
        created = int(time.time())
        obj = "chat.completion" if chat else "text_completion"
        try:
            self._submit(p)
        except RuntimeError as e:
            return self.error(503, str(e))

        if not pr.stream:
            text = []
            try:
                async for delta, _, _ in self._events(p):
                    text.append(delta)
            except RuntimeError as e:
                return self._failed(e)
            ch = shapes.chat_message_choice(chat, "".join(text), p.seq.finish_reason)
            return web.json_response(shapes.openai_body(cid, obj, created, self.model_name, [ch],
                                                        usage=self._usage(p)))

        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream", "Cache-Control": "no-cache"})
        await resp.prepare(request)
        chunk_obj = "chat.completion.chunk" if chat else "text_completion"

        async def send(payload: dict[str, Any] | str) -> None:
            await resp.write(shapes.sse(payload))

        def chunk(choices: list[dict[str, Any]], **extra: Any) -> dict[str, Any]:
            return shapes.openai_body(cid, chunk_obj, created, self.model_name, choices, **extra)

        try:
            if chat:
                await send(chunk([{"index": 0, "delta": {"role": "assistant", "content": ""}, "finish_reason": None}]))
            async for delta, _, finished in self._events(p):
                if delta:
                    await send(chunk([shapes.completion_choice(chat, delta, None)]))
                if finished:
                    await send(chunk([shapes.completion_choice(chat, "", p.seq.finish_reason)]))
            if pr.include_usage:
                await send(chunk([], usage=self._usage(p)))
            await send("[DONE]")
        except RuntimeError as e:
            # headers are gone: report in-band as vLLM does, and end the stream without [DONE]
            await send(self._error_event(e))
        except (ConnectionResetError, asyncio.CancelledError):
            raise
        await resp.write_eof()
        return resp

    async def generate(self, request: web.Request) -> web.StreamResponse:
        bad = self._not_ready()
        if bad is not None:
            return bad
        try:
            body = await self._json(request)
            prs = parse_generate(body, vocab_size=self.vocab_size)
            pendings = [self._make_seq(pr, self._tokenize(pr)) for pr in prs]
        except BadRequest as e:
            return self.error(400, str(e), e.param)
        batched = isinstance(body.get("text", body.get("input_ids")), list) and (
            "text" in body or (body["input_ids"] and isinstance(body["input_ids"][0], list)))
        try:
            for p in pendings:
                self._submit(p)
        except RuntimeError as e:
            return self.error(503, str(e))
        if prs[0].stream:
            if len(pendings) != 1:
                return self.error(400, "streaming /generate takes one prompt", "stream")
            p = pendings[0]
            resp = web.StreamResponse(headers={"Content-Type": "text/event-stream", "Cache-Control": "no-cache"})
            await resp.prepare(request)
            try:
                async for _delta, _new, _fin in self._events(p):
                    payload = {"text": p.detok.text, "output_ids": list(p.seq.output), "meta_info": self._meta(p)}
                    await resp.write(f"data: {json.dumps(payload)}\n\n".encode())
                await resp.write(b"data: [DONE]\n\n")
            except RuntimeError as e:
                err = self._error_event(e)
                err["error"].pop("type")  # SGLang's in-band error has message and code only
                await resp.write(f"data: {json.dumps(err)}\n\n".encode())
            await resp.write_eof()
            return resp

        async def run(p: Pending) -> dict[str, Any]:
            async for _ in self._events(p):
                pass
            return {"text": p.detok.text, "output_ids": list(p.seq.output), "meta_info": self._meta(p)}

        try:
            results = await asyncio.gather(*(run(p) for p in pendings))
        except RuntimeError as e:
            return self._failed(e)
        body_out: Any = results if batched else results[0]
        return web.Response(text=json.dumps(body_out), content_type="application/json")

    # -- app ----------------------------------------------------------------------------------

    def app(self) -> web.Application:
        app = web.Application(client_max_size=64 * 1024 * 1024)
        r = app.router
        r.add_get("/health", self.health)
        r.add_get("/health_generate", self.health_generate)
        r.add_get("/v1/models", self.models)
        r.add_get("/server_info", self.server_info)
        r.add_get("/get_server_info", self.server_info)
        r.add_get("/version", self.version)
        r.add_get("/metrics", self.metrics)
        r.add_post("/flush_cache", self.flush_cache)
        r.add_get("/flush_cache", self.flush_cache)
        r.add_post("/v1/completions", self.completions)
        r.add_post("/v1/chat/completions", self.chat_completions)
        r.add_post("/generate", self.generate)
        app.middlewares.append(self._errors_middleware)
        return app

    @web.middleware
    async def _errors_middleware(self, request: web.Request, handler: Any) -> web.StreamResponse:
        try:
            return await handler(request)
        except web.HTTPException as e:
            if e.status == 405:
                return self.error(405, f"{request.method} is not allowed on {request.path}", etype="MethodNotAllowed")
            if e.status == 404:
                return self.error(404, f"no route {request.path}")
            if e.status == 413:
                return self.error(413, "request body too large (64 MiB max)", etype="PayloadTooLarge")
            raise
        except BadRequest as e:
            return self.error(400, str(e), e.param)
