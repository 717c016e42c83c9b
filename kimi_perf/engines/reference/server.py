"""HTTP server of the reference engine: ``python -m kimi_perf.engines.reference.server --model-path DIR``.

Why a server at all (and not an in-process engine): the suite measures engines the way users run
them -- a separate process behind HTTP, streamed by a client -- so the reference engine, SGLang and
vLLM go through the same launcher, client and metric code. The endpoints copy the shapes of SGLang
0.5.23 and vLLM (their http_server.py / api_server.py): ``/health`` (503 while loading), ``/v1/models``,
``/server_info``, ``/v1/completions`` and ``/v1/chat/completions`` (SSE with ``[DONE]`` and
``stream_options.include_usage``), SGLang-native ``/generate`` (``meta_info``, hidden states, spec
fields), ``/flush_cache`` and Prometheus ``/metrics`` with vLLM's spec-decode counter names.

The port is bound before the model loads, so a launcher sees 503 (not connection refused) during the
load, exactly as with SGLang.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import signal
import sys
import time
import uuid
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from aiohttp import web

from ... import __version__
from .protocol import BadRequest, ParsedRequest, parse_chat, parse_completion, parse_generate

ENGINE_NAME = "kimi-perf-reference"


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python -m kimi_perf.engines.reference.server",
        description="kimi-perf reference engine (transformers weights, own continuous-batching scheduler)",
    )
    p.add_argument("--model-path", required=True, help="transformers Llama checkpoint directory")
    p.add_argument("--served-model-name", default=None)
    p.add_argument("--host", default="127.0.0.1",
                   help="bind address (default loopback; pass 0.0.0.0 explicitly to serve other hosts)")
    p.add_argument("--port", type=int, default=30000)
    p.add_argument("--dtype", default="auto", choices=["auto", "bfloat16", "float16", "float32"])
    p.add_argument("--device", default="auto", choices=["auto", "cpu", "cuda"])
    p.add_argument("--load-format", default="auto", choices=["auto", "dummy"])
    p.add_argument("--context-length", type=int, default=2048)
    p.add_argument("--max-running-requests", type=int, default=16)
    p.add_argument("--max-prefill-tokens", type=int, default=4096)
    p.add_argument("--prefill-wait-ms", type=float, default=20.0,
                   help="with sequences running, let new requests gather up to this long (or until running/8 "
                        "are waiting) for one batched prefill; 0 = prefill every arrival at once")
    p.add_argument("--random-seed", type=int, default=0)
    p.add_argument("--torch-threads", type=int, default=0, help="torch intra-op threads (0: all cores)")
    p.add_argument("--enable-return-hidden-states", action="store_true",
                   help="allow return_hidden_states on /generate (final-norm output, SGLang layout)")
    p.add_argument("--enable-return-aux-hidden-states", action="store_true",
                   help="return_hidden_states rows are the aux layers concatenated (SGLang 0.5.23 aux mode)")
    p.add_argument("--return-aux-hidden-state-layer-ids", default=None,
                   help="comma-separated ids k: residual stream entering layer k (default 2,N//2,N-3); "
                        "'final' adds the final-norm output (reference-engine extension)")
    p.add_argument("--speculative-algorithm", default=None, choices=[None, "EAGLE3"])
    p.add_argument("--speculative-draft-model-path", default=None)
    p.add_argument("--speculative-num-steps", type=int, default=3)
    p.add_argument("--speculative-eagle-topk", type=int, default=1)
    p.add_argument("--speculative-num-draft-tokens", type=int, default=None)
    p.add_argument("--disable-cuda-graph", action="store_true")
    p.add_argument("--cuda-graph-max-bs", type=int, default=None, help=argparse.SUPPRESS)
    p.add_argument("--cuda-graph-max-bs-decode", type=int, default=128)
    p.add_argument("--log-requests", action="store_true")
    return p


def validate_args(args: argparse.Namespace) -> None:
    """Reject bad launches before loading anything; messages name the fix."""
    errors = []
    mp = Path(args.model_path)
    if not mp.is_dir() or not (mp / "config.json").is_file():
        errors.append(f"--model-path {args.model_path}: not a model directory (needs config.json)")
    if args.cuda_graph_max_bs is not None:
        errors.append("--cuda-graph-max-bs was removed (as in SGLang 0.5.23): use --cuda-graph-max-bs-decode")
    if args.speculative_algorithm:
        if not args.speculative_draft_model_path:
            errors.append("--speculative-algorithm EAGLE3 needs --speculative-draft-model-path")
        elif not (Path(args.speculative_draft_model_path) / "config.json").is_file():
            errors.append(f"--speculative-draft-model-path {args.speculative_draft_model_path}: no config.json there")
        if args.speculative_eagle_topk != 1:
            errors.append("--speculative-eagle-topk: the reference engine drafts a chain (topk 1) only")
        if args.speculative_num_steps < 1:
            errors.append("--speculative-num-steps must be >= 1")
        if args.speculative_num_draft_tokens not in (None, args.speculative_num_steps + 1):
            errors.append("--speculative-num-draft-tokens must equal steps + 1 for a topk-1 chain")
    if args.max_running_requests < 1:
        errors.append("--max-running-requests must be >= 1")
    if args.context_length < 8:
        errors.append("--context-length must be >= 8")
    if errors:
        raise SystemExit("invalid arguments:\n  " + "\n  ".join(errors))


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
        t0 = time.monotonic()
        import torch
        from transformers import AutoTokenizer

        from .engine import Engine
        from .model import LlamaRunner

        a = self.args
        if a.torch_threads:
            torch.set_num_threads(a.torch_threads)
        torch.manual_seed(a.random_seed)
        device = a.device
        if device == "auto":
            device = "cuda" if torch.cuda.is_available() else "cpu"
        if device == "cuda" and not torch.cuda.is_available():
            raise RuntimeError("--device cuda but torch.cuda.is_available() is False")
        dtype = {"auto": torch.bfloat16, "bfloat16": torch.bfloat16, "float16": torch.float16,
                 "float32": torch.float32}[a.dtype]
        print(f"[kimi-ref] loading {a.model_path} ({a.load_format}, {dtype}, {device})", flush=True)
        self.hf_tokenizer = AutoTokenizer.from_pretrained(a.model_path)
        self.tokenizer = getattr(self.hf_tokenizer, "backend_tokenizer", None) or self.hf_tokenizer
        self.tok_vocab = len(self.hf_tokenizer)
        spec_k = a.speculative_num_steps if a.speculative_algorithm else 0
        runner = LlamaRunner.from_pretrained(
            a.model_path, device=device, dtype=dtype, max_slots=a.max_running_requests,
            max_len=a.context_length + spec_k + 1, load_format=a.load_format, seed=a.random_seed,
        )
        self.vocab_size = runner.shape.vocab_size
        n = runner.shape.num_layers
        if a.return_aux_hidden_state_layer_ids:
            self.aux_ids = tuple(x.strip() if x.strip() == "final" else int(x)
                                 for x in a.return_aux_hidden_state_layer_ids.split(","))
        elif a.enable_return_aux_hidden_states:
            self.aux_ids = runner.shape.eagle3_aux_layers
        # the default ids [2, N//2, N-3] only exist from 4 layers on: checked only when they are used
        bad = [k for k in self.aux_ids if k != "final" and not 0 <= int(k) <= n]
        if bad:
            raise ValueError(f"--return-aux-hidden-state-layer-ids {bad}: ids must be in [0, {n}] or 'final'")
        drafter = None
        if a.speculative_algorithm:
            from ...eagle3.runtime import DrafterRuntime

            drafter = DrafterRuntime.from_pretrained(a.speculative_draft_model_path, runner)
            print(f"[kimi-ref] EAGLE-3 drafter {a.speculative_draft_model_path}: aux layers "
                  f"{drafter.aux_layers}, {spec_k} steps", flush=True)
        if device == "cuda" and not a.disable_cuda_graph:
            from .cuda_graphs import enable_cuda_graphs

            print(f"[kimi-ref] capturing CUDA graphs (batch <= {min(a.cuda_graph_max_bs_decode, a.max_running_requests)})",
                  flush=True)
            enable_cuda_graphs(runner, max_bs=min(a.cuda_graph_max_bs_decode, a.max_running_requests),
                               q_lens=sorted({1, spec_k + 1}),
                               aux_layers=drafter.aux_layers if drafter is not None else (),
                               log=lambda m: print(m, flush=True))
            if drafter is not None:
                drafter.enable_cuda_graphs(max_bs=min(a.cuda_graph_max_bs_decode, a.max_running_requests), k=spec_k,
                                           log=lambda m: print(m, flush=True))
        eos = set()
        for src in (getattr(self.hf_tokenizer, "eos_token_id", None),):
            if isinstance(src, int):
                eos.add(src)
        gen_cfg = Path(a.model_path) / "generation_config.json"
        if gen_cfg.is_file():
            e = json.loads(gen_cfg.read_text()).get("eos_token_id")
            eos |= set(e if isinstance(e, list) else [e] if isinstance(e, int) else [])
        self.engine = Engine(
            runner, eos_token_ids=eos, max_running=a.max_running_requests,
            max_prefill_tokens=a.max_prefill_tokens, prefill_wait_s=a.prefill_wait_ms / 1000.0,
            hidden_layers=self.aux_ids if a.enable_return_aux_hidden_states else (),
            hidden_final_norm=not a.enable_return_aux_hidden_states,
            drafter=drafter, spec_steps=spec_k, on_step=self._on_step, on_fatal=self._on_fatal,
        )
        self.engine.start()
        self.info = {
            "model_path": a.model_path, "served_model_name": self.model_name, "dtype": str(dtype).replace("torch.", ""),
            "device": device, "load_format": a.load_format, "context_length": a.context_length,
            "max_running_requests": a.max_running_requests, "random_seed": a.random_seed,
            "speculative_algorithm": a.speculative_algorithm, "speculative_num_steps": spec_k or None,
            "speculative_eagle_topk": 1 if spec_k else None,
            "speculative_num_draft_tokens": spec_k + 1 if spec_k else None,
            "speculative_draft_model_path": a.speculative_draft_model_path,
            "enable_return_hidden_states": a.enable_return_hidden_states or a.enable_return_aux_hidden_states,
            "enable_return_aux_hidden_states": a.enable_return_aux_hidden_states,
            "return_aux_hidden_state_layer_ids": list(self.aux_ids),
            "cuda_graph": bool(getattr(runner, "graphs", None)),
            "num_layers": n, "hidden_size": runner.shape.hidden_size, "vocab_size": runner.shape.vocab_size,
            "weight_bytes": runner.w.nbytes(), "torch_threads": torch.get_num_threads(),
            "torch_version": torch.__version__,
        }
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
        if self.loop is not None:
            self.loop.call_soon_threadsafe(self.loop.call_later, 0.5, os._exit, 3)

    # -- helpers ------------------------------------------------------------------------------

    @staticmethod
    def error(status: int, message: str, param: str | None = None, etype: str | None = None) -> web.Response:
        etype = etype or {400: "BadRequestError", 404: "NotFoundError", 503: "ServiceUnavailableError"}.get(
            status, "InternalServerError")
        return web.json_response({"error": {"message": message, "type": etype, "param": param, "code": status}},
                                 status=status)

    def _not_ready(self) -> web.Response | None:
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

    def _usage(self, p: Pending) -> dict[str, int]:
        pt, ct = len(p.seq.prompt), len(p.seq.output)
        return {"prompt_tokens": pt, "completion_tokens": ct, "total_tokens": pt + ct}

    def _meta(self, p: Pending) -> dict[str, Any]:
        s = p.seq
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
            "e2e_latency": time.monotonic() - p.t_start,
        }
        if self.engine.spec_steps:
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
        self._submit(p)
        async for _ in self._events(p):
            pass
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

        def choice(text: str, finish: str | None) -> dict[str, Any]:
            if chat:
                return {"index": 0, "delta": {"content": text} if text else {}, "finish_reason": finish}
            return {"index": 0, "text": text, "logprobs": None, "finish_reason": finish}

        if not pr.stream:
            text = []
            try:
                async for delta, _, _ in self._events(p):
                    text.append(delta)
            except RuntimeError as e:
                return self.error(500, str(e))
            full = "".join(text)
            ch: dict[str, Any] = ({"index": 0, "message": {"role": "assistant", "content": full},
                                   "finish_reason": p.seq.finish_reason} if chat else
                                  {"index": 0, "text": full, "logprobs": None, "finish_reason": p.seq.finish_reason})
            return web.json_response({"id": cid, "object": obj, "created": created, "model": self.model_name,
                                      "choices": [ch], "usage": self._usage(p)})

        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream", "Cache-Control": "no-cache"})
        await resp.prepare(request)
        chunk_obj = "chat.completion.chunk" if chat else "text_completion"

        async def send(payload: dict[str, Any] | str) -> None:
            data = payload if isinstance(payload, str) else json.dumps(payload, separators=(",", ":"))
            await resp.write(f"data: {data}\n\n".encode())

        try:
            if chat:
                await send({"id": cid, "object": chunk_obj, "created": created, "model": self.model_name,
                            "choices": [{"index": 0, "delta": {"role": "assistant", "content": ""},
                                         "finish_reason": None}]})
            async for delta, _, finished in self._events(p):
                if delta:
                    await send({"id": cid, "object": chunk_obj, "created": created, "model": self.model_name,
                                "choices": [choice(delta, None)]})
                if finished:
                    await send({"id": cid, "object": chunk_obj, "created": created, "model": self.model_name,
                                "choices": [choice("", p.seq.finish_reason)]})
            if pr.include_usage:
                await send({"id": cid, "object": chunk_obj, "created": created, "model": self.model_name,
                            "choices": [], "usage": self._usage(p)})
            await send("[DONE]")
        except RuntimeError as e:
            # headers are gone: report in-band as vLLM does, and end the stream without [DONE]
            await send({"error": {"message": str(e), "type": "InternalServerError", "code": 500}})
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
                await resp.write(f"data: {json.dumps({'error': {'message': str(e), 'code': 500}})}\n\n".encode())
            await resp.write_eof()
            return resp

        async def run(p: Pending) -> dict[str, Any]:
            async for _ in self._events(p):
                pass
            return {"text": p.detok.text, "output_ids": list(p.seq.output), "meta_info": self._meta(p)}

        try:
            results = await asyncio.gather(*(run(p) for p in pendings))
        except RuntimeError as e:
            return self.error(500, str(e))
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


async def _amain(args: argparse.Namespace) -> None:
    srv = ReferenceServer(args)
    srv.loop = asyncio.get_running_loop()
    runner = web.AppRunner(srv.app(), access_log=None, handle_signals=False)
    await runner.setup()
    site = web.TCPSite(runner, args.host, args.port, reuse_address=False)
    try:
        await site.start()
    except OSError as e:
        print(f"[kimi-ref] cannot bind {args.host}:{args.port}: {e}", file=sys.stderr, flush=True)
        raise SystemExit(98) from None
    print(f"[kimi-ref] listening on http://{args.host}:{args.port} (pid {os.getpid()}); loading model", flush=True)
    stop = asyncio.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        srv.loop.add_signal_handler(sig, stop.set)
    load = asyncio.ensure_future(asyncio.to_thread(srv.load))

    def _loaded(f: asyncio.Future[Any]) -> None:
        if f.exception() is not None:
            srv.load_error = f"{type(f.exception()).__name__}: {f.exception()}"
            print(f"[kimi-ref] model load failed: {srv.load_error}", file=sys.stderr, flush=True)
            srv.loop.call_later(0.2, stop.set)  # type: ignore[union-attr]

    load.add_done_callback(_loaded)
    await stop.wait()
    print("[kimi-ref] shutting down", flush=True)
    if srv.engine is not None:
        srv.engine.stop()
    await runner.cleanup()
    if srv.load_error:
        raise SystemExit(2)


def main(argv: list[str] | None = None) -> None:
    args = build_parser().parse_args(argv)
    validate_args(args)
    asyncio.run(_amain(args))


if __name__ == "__main__":
    main()
