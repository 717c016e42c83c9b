"""Loading the reference engine for its HTTP server: tokenizer, weights, drafter, CUDA graphs, engine.

Split out of ``server.py`` (which was one 470-line class): what a load produces (:class:`Loaded`) is
all the routes need from it, and loading is the one part that imports torch and transformers, so the
routes and response shapes can be read (and their request handling tested) without either.
"""

from __future__ import annotations

import argparse
import json
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

__all__ = ["Loaded", "load_engine"]


@dataclass
class Loaded:
    """What a finished load hands the server: the running engine, the tokenizers and /server_info."""

    engine: Any
    hf_tokenizer: Any
    tokenizer: Any  # the fast backend tokenizer where there is one (the detokeniser uses it)
    tok_vocab: int
    vocab_size: int
    aux_ids: tuple[int | str, ...]
    info: dict[str, Any] = field(default_factory=dict)


def load_engine(a: argparse.Namespace, *, on_step: Callable[[list[Any]], None],
                on_fatal: Callable[[str], None]) -> Loaded:
    """Load everything ``a`` (the server's parsed arguments) names and start the engine thread. Runs in
    a worker thread while /health answers 503."""
    import torch
    from transformers import AutoTokenizer

    from .engine import Engine
    from .model import LlamaRunner

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
    hf_tokenizer = AutoTokenizer.from_pretrained(a.model_path)
    tokenizer = getattr(hf_tokenizer, "backend_tokenizer", None) or hf_tokenizer
    tok_vocab = len(hf_tokenizer)
    spec_k = a.speculative_num_steps if a.speculative_algorithm else 0
    runner = LlamaRunner.from_pretrained(
        a.model_path, device=device, dtype=dtype, max_slots=a.max_running_requests,
        max_len=a.context_length + spec_k + 1, load_format=a.load_format, seed=a.random_seed,
    )
    n = runner.shape.num_layers
    aux_ids: tuple[int | str, ...] = ()
    if a.return_aux_hidden_state_layer_ids:
        aux_ids = tuple(x.strip() if x.strip() == "final" else int(x)
                        for x in a.return_aux_hidden_state_layer_ids.split(","))
    elif a.enable_return_aux_hidden_states:
        aux_ids = runner.shape.eagle3_aux_layers
    # the default ids [2, N//2, N-3] only exist from 4 layers on: checked only when they are used
    bad = [k for k in aux_ids if k != "final" and not 0 <= int(k) <= n]
    if bad:
        raise ValueError(f"--return-aux-hidden-state-layer-ids {bad}: ids must be in [0, {n}] or 'final'")
    drafter = None
    if a.speculative_algorithm:
        from .drafting import DrafterRuntime

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
    for src in (getattr(hf_tokenizer, "eos_token_id", None),):
        if isinstance(src, int):
            eos.add(src)
    gen_cfg = Path(a.model_path) / "generation_config.json"
    if gen_cfg.is_file():
        e = json.loads(gen_cfg.read_text()).get("eos_token_id")
        eos |= set(e if isinstance(e, list) else [e] if isinstance(e, int) else [])
    engine = Engine(
        runner, eos_token_ids=eos, max_running=a.max_running_requests,
        max_prefill_tokens=a.max_prefill_tokens, prefill_wait_s=a.prefill_wait_ms / 1000.0,
        hidden_layers=aux_ids if a.enable_return_aux_hidden_states else (),
        hidden_final_norm=not a.enable_return_aux_hidden_states,
        drafter=drafter, spec_steps=spec_k, on_step=on_step, on_fatal=on_fatal,
    )
    engine.start()
    info = {
        "model_path": a.model_path, "served_model_name": a.served_model_name or Path(a.model_path).name,
        "dtype": str(dtype).replace("torch.", ""),
        "device": device, "load_format": a.load_format, "context_length": a.context_length,
        "max_running_requests": a.max_running_requests, "random_seed": a.random_seed,
        "speculative_algorithm": a.speculative_algorithm, "speculative_num_steps": spec_k or None,
        "speculative_eagle_topk": 1 if spec_k else None,
        "speculative_num_draft_tokens": spec_k + 1 if spec_k else None,
        "speculative_draft_model_path": a.speculative_draft_model_path,
        "enable_return_hidden_states": a.enable_return_hidden_states or a.enable_return_aux_hidden_states,
        "enable_return_aux_hidden_states": a.enable_return_aux_hidden_states,
        "return_aux_hidden_state_layer_ids": list(aux_ids),
        "cuda_graph": bool(getattr(runner, "graphs", None)),
        "num_layers": n, "hidden_size": runner.shape.hidden_size, "vocab_size": runner.shape.vocab_size,
        "weight_bytes": runner.w.nbytes(), "torch_threads": torch.get_num_threads(),
        "torch_version": torch.__version__,
    }
    return Loaded(engine=engine, hf_tokenizer=hf_tokenizer, tokenizer=tokenizer, tok_vocab=tok_vocab,
                  vocab_size=runner.shape.vocab_size, aux_ids=aux_ids, info=info)
