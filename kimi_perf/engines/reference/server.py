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

This module is the command line and the process lifecycle (bind, signals, shutdown, parent watch); the
server itself is split by concern: :mod:`.loading` (weights, tokenizer, engine), :mod:`.shapes`
(OpenAI / SGLang response bodies) and :mod:`.routes` (:class:`ReferenceServer`, the HTTP handlers).

Lifecycle: SIGTERM/SIGINT end every open request at once (streams with an error event) and the
process exits within ``--shutdown-grace-s``. Launched by kimi-perf's launcher (which names itself in
``KIMI_PERF_PARENT_PID``), the server also exits at once when that parent is gone: ``PR_SET_PDEATHSIG``
covers the direct child only, and a server that outlived a SIGKILLed pytest by a minute held its GPU.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import signal
import sys
from pathlib import Path
from typing import Any

from aiohttp import web

from ...launcher import PARENT_ENV
from .routes import ENGINE_NAME, Pending, ReferenceServer

__all__ = ["ENGINE_NAME", "PARENT_ENV", "Pending", "ReferenceServer", "build_parser", "main", "validate_args"]


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
    p.add_argument("--shutdown-grace-s", type=float, default=5.0,
                   help="on SIGTERM/SIGINT, how long open connections get to close after their requests were "
                        "ended with an error (default 5)")
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
    if not 0 <= args.shutdown_grace_s <= 600:
        errors.append("--shutdown-grace-s must be in [0, 600]")
    if errors:
        raise SystemExit("invalid arguments:\n  " + "\n  ".join(errors))


async def _watch_parent(parent: int) -> None:
    """Exit at once when the launching process is gone (re-parented: getppid() changes)."""
    while True:
        if os.getppid() != parent:
            print(f"[kimi-ref] parent {parent} is gone; exiting", file=sys.stderr, flush=True)
            os._exit(1)
        await asyncio.sleep(0.25)


async def _amain(args: argparse.Namespace) -> None:
    srv = ReferenceServer(args)
    srv.loop = asyncio.get_running_loop()
    runner = web.AppRunner(srv.app(), access_log=None, handle_signals=False, shutdown_timeout=args.shutdown_grace_s)
    await runner.setup()
    site = web.TCPSite(runner, args.host, args.port, reuse_address=False)
    try:
        await site.start()
    except OSError as e:
        print(f"[kimi-ref] cannot bind {args.host}:{args.port}: {e}", file=sys.stderr, flush=True)
        raise SystemExit(98) from None
    print(f"[kimi-ref] listening on http://{args.host}:{args.port} (pid {os.getpid()}); loading model", flush=True)
    watch = None
    parent = os.environ.get(PARENT_ENV, "")
    if parent.isdigit():
        watch = asyncio.ensure_future(_watch_parent(int(parent)))
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
    # end the open requests first (streams get an error event), then close the HTTP side within the
    # grace period, then stop the engine: stopping the engine first left streams waiting forever
    n = srv.begin_shutdown()
    print(f"[kimi-ref] shutting down ({n} open request(s) ended)", flush=True)
    await runner.cleanup()
    if srv.engine is not None:
        srv.engine.stop()
    if watch is not None:
        watch.cancel()
    if srv.load_error:
        raise SystemExit(2)
    if not load.done():
        # still loading (SIGTERM during the load): the loader thread cannot be interrupted, and
        # asyncio.run would wait for it; the process has nothing left to finish
        os._exit(0)


def main(argv: list[str] | None = None) -> None:
    args = build_parser().parse_args(argv)
    validate_args(args)
    asyncio.run(_amain(args))


if __name__ == "__main__":
    main()
