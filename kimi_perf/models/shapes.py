"""Model shapes without torch: the Llama decoder's numbers and the published configs the dummy
profiles serve.

Why here, below the engines and the profiles: the reference engine builds its runner from
:class:`LlamaShape`, the bandwidth floor (:mod:`kimi_perf.roofline`) counts weight bytes with it, and
the engine's micro-benchmark builds a random-weight model from :data:`DUMMY_SHAPES`, which profiles
also name (``"model": {"source": "dummy", "shape": ...}``). When the shape lived in the engine's torch
module and the configs in ``profiles``, the roofline imported the engine, the engine's micro-benchmark
imported the roofline, and the engine imported the gate's profile loader.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

__all__ = ["DUMMY_SHAPES", "LlamaShape"]

DUMMY_SHAPES: dict[str, dict[str, Any]] = {
    # a Llama small enough that the gate's own end-to-end tests (a planted slowdown must FAIL, an A/A
    # must PASS) run a real server in seconds on a 2-core CPU; the embedded tokenizer's vocabulary
    "tiny-llama": {
        "architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": 64,
        "intermediate_size": 128, "num_hidden_layers": 2, "num_attention_heads": 4,
        "num_key_value_heads": 2, "head_dim": 16, "vocab_size": 49152, "rms_norm_eps": 1e-5,
        "max_position_embeddings": 2048, "tie_word_embeddings": True, "hidden_act": "silu",
        "rope_theta": 10000.0, "bos_token_id": 1, "eos_token_id": 2,
    },
    # Llama-3.1-8B's published shape; weights are random (--load-format dummy), the tokenizer is the
    # embedded model's (random-id workloads only need a vocabulary).
    "llama-3.1-8b": {
        "architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": 4096,
        "intermediate_size": 14336, "num_hidden_layers": 32, "num_attention_heads": 32,
        "num_key_value_heads": 8, "head_dim": 128, "vocab_size": 128256, "rms_norm_eps": 1e-5,
        "max_position_embeddings": 131072, "tie_word_embeddings": False, "hidden_act": "silu",
        "rope_theta": 500000.0,
        "rope_scaling": {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                         "original_max_position_embeddings": 8192},
        "bos_token_id": 1, "eos_token_id": 2,
    },
}


@dataclass(frozen=True)
class LlamaShape:
    """The numbers that define a Llama decoder, read from a transformers config."""

    hidden_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    intermediate_size: int
    vocab_size: int
    rms_norm_eps: float
    tie_word_embeddings: bool
    max_position_embeddings: int

    @classmethod
    def from_config(cls, cfg: Any) -> LlamaShape:
        heads = int(cfg.num_attention_heads)
        head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // heads
        return cls(
            hidden_size=int(cfg.hidden_size),
            num_layers=int(cfg.num_hidden_layers),
            num_heads=heads,
            num_kv_heads=int(getattr(cfg, "num_key_value_heads", None) or heads),
            head_dim=int(head_dim),
            intermediate_size=int(cfg.intermediate_size),
            vocab_size=int(cfg.vocab_size),
            rms_norm_eps=float(cfg.rms_norm_eps),
            tie_word_embeddings=bool(getattr(cfg, "tie_word_embeddings", False)),
            max_position_embeddings=int(getattr(cfg, "max_position_embeddings", 4096)),
        )

    @property
    def eagle3_aux_layers(self) -> tuple[int, int, int]:
        """EAGLE-3's default feature layers: the residual stream entering [2, N//2, N-3]."""
        n = self.num_layers
        return (2, n // 2, n - 3)

    @property
    def weight_bytes_per_param(self) -> int:  # pragma: no cover - trivial
        return 2

    def num_params(self) -> int:
        h, i, v = self.hidden_size, self.intermediate_size, self.vocab_size
        qkv = h * (self.num_heads + 2 * self.num_kv_heads) * self.head_dim
        o = self.num_heads * self.head_dim * h
        per_layer = qkv + o + 3 * h * i + 2 * h
        lm_head = 0 if self.tie_word_embeddings else v * h
        return v * h + self.num_layers * per_layer + h + lm_head
