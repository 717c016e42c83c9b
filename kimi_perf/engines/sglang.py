"""SGLang 0.5.23 as a measured engine: command line, flag checks, and response parsing.

Why flag checks before launch: an SGLang launch on the Kimi-K2.5 profile costs ~10 minutes (weights +
CUDA-graph capture) before a misspelt or removed flag is reported, if at all (argparse prefix matching
makes ``--cuda-graph-max-bs`` *ambiguous* in 0.5.23, not unknown). Removed and renamed flags are
rejected here with the replacement named; CI additionally parses every command line the suite builds
with the real ``sglang==0.5.23`` ``ServerArgs`` parser (tests/test_engine_configs.py).

Hidden-state and speculative responses share the reference engine's parsers (SGLang's layout is the
reference engine's), see :mod:`kimi_perf.alignment.extract` and :mod:`kimi_perf.eagle3.evaluate`.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any, ClassVar

from .base import EngineConfig, SpecConfig
from .presets import nccl_env

__all__ = ["SGLANG_REMOVED_FLAGS", "SGLangConfig", "check_sglang_flags", "parse_generate_response"]

SGLANG_VERSION = "0.5.23"

# flag -> (replacement or None, why): what 0.5.23 no longer accepts or only accepts with a warning
SGLANG_REMOVED_FLAGS: dict[str, tuple[str | None, str]] = {
    "--cuda-graph-max-bs": ("--cuda-graph-max-bs-decode", "split into -decode/-prefill in 0.5.23 (now ambiguous)"),
    "--cuda-graph-bs": ("--cuda-graph-bs-decode", "split into -decode/-prefill in 0.5.23 (now ambiguous)"),
    "--return-hidden-states": ("--enable-return-hidden-states", "server flag is --enable-return-hidden-states; "
                               "the request field is return_hidden_states"),
}
SGLANG_DEPRECATED_FLAGS = {"--disable-cuda-graph": "deprecated in 0.5.23 (still accepted): prefer "
                           "--disable-decode-cuda-graph and --disable-prefill-cuda-graph"}


class SGLangFlagError(ValueError):
    pass


def check_sglang_flags(argv: list[str]) -> list[str]:
    """Raise for removed/renamed flags (naming the replacement); return warnings for deprecated ones."""
    problems, warnings = [], []
    for a in argv:
        flag = a.split("=", 1)[0]
        if flag in SGLANG_REMOVED_FLAGS:
            new, why = SGLANG_REMOVED_FLAGS[flag]
            problems.append(f"{flag} is not accepted by SGLang {SGLANG_VERSION} ({why})" + (f": use {new}" if new else ""))
        elif flag in SGLANG_DEPRECATED_FLAGS:
            warnings.append(f"{flag}: {SGLANG_DEPRECATED_FLAGS[flag]}")
    if problems:
        raise SGLangFlagError("; ".join(problems))
    return warnings


@dataclass(frozen=True)
class SGLangConfig(EngineConfig):
    kind: ClassVar[str] = "sglang"
    tp_size: int = 1
    dtype: str = "auto"
    load_format: str = "auto"
    random_seed: int = 0  # SGLang draws a random seed when unset: always pinned here
    context_length: int | None = None
    mem_fraction_static: float | None = None
    attention_backend: str | None = None
    cuda_graph_max_bs_decode: int | None = None
    disable_cuda_graph: bool = False
    num_continuous_decode_steps: int | None = None
    disable_custom_all_reduce: bool = False
    enable_metrics: bool = True
    spec: SpecConfig | None = None
    return_hidden_states: bool = False
    aux_hidden_states: bool = False
    aux_layer_ids: tuple[int, ...] | None = None
    disable_radix_cache: bool = False
    chunked_prefill_size: int | None = None
    trust_remote_code: bool = False
    nccl_preset: str | None = None

    def argv(self, port: int) -> list[str]:
        a = [self.python, "-m", "sglang.launch_server", "--model-path", self.model_path,
             "--served-model-name", self.served_model_name, "--host", self.host, "--port", str(port),
             "--tp-size", str(self.tp_size), "--dtype", self.dtype, "--load-format", self.load_format,
             "--random-seed", str(self.random_seed)]
        if self.context_length:
            a += ["--context-length", str(self.context_length)]
        if self.mem_fraction_static is not None:
            a += ["--mem-fraction-static", str(self.mem_fraction_static)]
        if self.attention_backend:
            a += ["--attention-backend", self.attention_backend]
        if self.cuda_graph_max_bs_decode:
            a += ["--cuda-graph-max-bs-decode", str(self.cuda_graph_max_bs_decode)]
        if self.disable_cuda_graph:
            a.append("--disable-cuda-graph")
        if self.num_continuous_decode_steps:
            a += ["--num-continuous-decode-steps", str(self.num_continuous_decode_steps)]
        if self.disable_custom_all_reduce:
            a.append("--disable-custom-all-reduce")
        if self.enable_metrics:
            a.append("--enable-metrics")
        if self.spec is not None:
            a += ["--speculative-algorithm", "EAGLE3", "--speculative-draft-model-path", self.spec.draft_model_path,
                  "--speculative-num-steps", str(self.spec.steps), "--speculative-eagle-topk", str(self.spec.topk),
                  "--speculative-num-draft-tokens", str(self.spec.num_draft_tokens)]
        if self.return_hidden_states or self.aux_hidden_states:
            # hidden states are only complete without prefix reuse and with one prefill chunk (NOTES s.2)
            a += ["--disable-radix-cache", "--chunked-prefill-size", "-1"]
        elif self.disable_radix_cache:
            a.append("--disable-radix-cache")
        if self.chunked_prefill_size is not None and not (self.return_hidden_states or self.aux_hidden_states):
            a += ["--chunked-prefill-size", str(self.chunked_prefill_size)]
        if self.return_hidden_states:
            a.append("--enable-return-hidden-states")
        if self.aux_hidden_states:
            a.append("--enable-return-aux-hidden-states")
            if self.spec is None:  # aux mode needs the EAGLE3 algorithm flag even with no drafter loaded
                a += ["--speculative-algorithm", "EAGLE3"]
            if self.aux_layer_ids is not None:
                a += ["--return-aux-hidden-state-layer-ids", *map(str, self.aux_layer_ids)]
        if self.trust_remote_code:
            a.append("--trust-remote-code")
        a += list(self.extra_args)
        check_sglang_flags(a)
        return a

    def environ(self) -> dict[str, str]:
        return {**nccl_env(self.nccl_preset), **dict(self.env)}


def parse_generate_response(body: str | dict[str, Any] | list[Any]) -> list[dict[str, Any]]:
    """Normalise an SGLang ``/generate`` response (one object or a batch list) into records with the
    fields the suite uses, validating the documented shape."""
    data = json.loads(body) if isinstance(body, str) else body
    items = data if isinstance(data, list) else [data]
    out = []
    for i, d in enumerate(items):
        if not isinstance(d, dict) or "meta_info" not in d:
            raise ValueError(f"/generate item {i}: no meta_info (got keys {sorted(d) if isinstance(d, dict) else type(d).__name__})")
        m = d["meta_info"]
        for k in ("prompt_tokens", "completion_tokens"):
            if not isinstance(m.get(k), int):
                raise ValueError(f"/generate item {i}: meta_info.{k} missing or not an integer")
        rec = {"text": d.get("text"), "output_ids": d.get("output_ids"), "prompt_tokens": m["prompt_tokens"],
               "completion_tokens": m["completion_tokens"], "e2e_latency": m.get("e2e_latency"),
               "finish_reason": m.get("finish_reason")}
        if "spec_verify_ct" in m:
            ver = int(m["spec_verify_ct"])
            rec.update(spec_verify_ct=ver, spec_accept_length=m.get("spec_accept_length",
                       (m["completion_tokens"] / ver) if ver else None),
                       spec_accept_rate=m.get("spec_accept_rate"),
                       spec_num_correct_drafts=m.get("spec_num_correct_drafts"),
                       spec_num_proposed_drafts=m.get("spec_num_proposed_drafts"))
        out.append(rec)
    return out


def server_info_accept_length(info: dict[str, Any]) -> float | None:
    """``/server_info`` -> ``internal_states[0].avg_spec_accept_length`` (None when absent)."""
    st = info.get("internal_states") or []
    if st and isinstance(st[0], dict) and st[0].get("avg_spec_accept_length") is not None:
        return float(st[0]["avg_spec_accept_length"])
    return None
