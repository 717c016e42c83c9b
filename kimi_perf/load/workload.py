"""Workload specifications: every parameter that moves a serving number, pinned.

Why frozen dataclasses with all fields explicit: a baseline is only comparable to a run of the *same*
workload. Engines' own benchmark clients default to variable lengths (SGLang's random dataset draws
1..L unless ``--random-range-ratio 1.0``), sampling temperature 1, and stopping at EOS, each of which
moves throughput by tens of percent. Here lengths are fixed, ``ignore_eos`` is on, temperature is 0,
the seed and warm-up count are part of the spec, and :attr:`Workload.key` (part of the baseline key)
changes whenever any of them does.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import asdict, dataclass, field, replace
from typing import Any, Literal

Dataset = Literal["random", "mtbench", "sharegpt", "sharegpt-multiturn", "shared-prefix"]
DATASETS = ("random", "mtbench", "sharegpt", "sharegpt-multiturn", "shared-prefix")
Api = Literal["completions", "chat"]
APIS = ("completions", "chat")
# datasets whose prompts are token ids of no chat template, so "chat" can send their decoded text as one
# user message; the text datasets are already chat-templated ids (kimi_perf.data.chat_prompt_ids), which
# the server would wrap in its template a second time
CHAT_DATASETS = ("random", "shared-prefix")

__all__ = ["APIS", "CHAT_DATASETS", "DATASETS", "Api", "Dataset", "Workload"]


@dataclass(frozen=True)
class Workload:
    name: str
    dataset: Dataset = "random"
    input_len: int = 128  # exact for random prompts; a cap (truncate) for text prompts
    output_len: int = 64
    num_prompts: int = 8
    concurrency: int = 1
    warmup: int = 1
    seed: int = 0
    ignore_eos: bool = True
    temperature: float = 0.0
    request_timeout_s: float = 300.0
    # open-loop arrivals (req/s): inter-arrival times drawn from a gamma distribution with shape
    # ``burstiness`` and mean 1 / request_rate, vLLM's definition (burstiness 1 = a Poisson process,
    # below 1 burstier, above 1 more regular); inf = closed loop, what the throughput gates use.
    # ``concurrency`` still caps the requests in flight (vLLM's --max-concurrency)
    request_rate: float = float("inf")
    burstiness: float = 1.0
    # dataset "shared-prefix": every prompt of a repeat starts with the same prefix_len random ids (a
    # system prompt, a few-shot preamble), the rest is its own: what prefix caching is for
    prefix_len: int = 0
    # per-request output lengths drawn uniformly from [L(1-r), L(1+r)] (vLLM's --random-range-ratio,
    # applied to outputs only), seeded, identical for both sides of an A/B. 0 = every request L tokens.
    # Why: with fixed lengths and ignore_eos a closed-loop batch finishes in synchronised waves, each
    # followed by a burst of prefills, and where a repeat's window cuts those waves moves its throughput
    # (C=128 steady-state pairs swung 5-7% on the H200); staggered ends keep the batch in steady state
    output_len_range_ratio: float = 0.0
    # which OpenAI route the client streams from: "completions" sends the token ids as the prompt (exact
    # input lengths); "chat" decodes them to text and sends one user message to /v1/chat/completions,
    # so the server's chat template and chat pipeline are measured too (input length: the server's usage)
    api: Api = "completions"
    extra: tuple[tuple[str, Any], ...] = field(default_factory=tuple)

    def __post_init__(self) -> None:
        problems = []
        if self.dataset not in DATASETS:
            problems.append(f"dataset {self.dataset!r} (use one of {', '.join(DATASETS)})")
        if self.dataset == "shared-prefix" and not 0 < self.prefix_len < self.input_len:
            problems.append(f"prefix_len={self.prefix_len} (shared-prefix needs 0 < prefix_len < input_len "
                            f"{self.input_len})")
        if self.api not in APIS:
            problems.append(f"api {self.api!r} (use one of {', '.join(APIS)})")
        elif self.api == "chat" and self.dataset not in CHAT_DATASETS:
            problems.append(f"api chat with dataset {self.dataset} (its prompts are already chat-templated "
                            f"ids: use api completions, which sends exactly that chat prompt, or a dataset of "
                            f"{', '.join(CHAT_DATASETS)})")
        if self.dataset != "shared-prefix" and self.prefix_len:
            problems.append(f"prefix_len={self.prefix_len} (only the shared-prefix dataset has a prefix)")
        for f in ("input_len", "output_len", "num_prompts", "concurrency"):
            if getattr(self, f) < 1:
                problems.append(f"{f}={getattr(self, f)} (must be >= 1)")
        if self.warmup < 0:
            problems.append(f"warmup={self.warmup} (must be >= 0)")
        if self.temperature < 0:
            problems.append(f"temperature={self.temperature} (must be >= 0)")
        if not self.request_rate > 0:
            problems.append(f"request_rate={self.request_rate} (req/s, must be > 0; inf = closed loop)")
        if not 0 <= self.output_len_range_ratio < 1:
            problems.append(f"output_len_range_ratio={self.output_len_range_ratio} (in [0, 1): lengths are drawn "
                            "from [output_len * (1 - r), output_len * (1 + r)])")
        if not (0 < self.burstiness < float("inf")):
            problems.append(f"burstiness={self.burstiness} (gamma shape, must be > 0; 1 = Poisson)")
        if problems:
            raise ValueError(f"workload {self.name!r}: invalid " + "; ".join(problems))

    def output_lens(self, n: int) -> list[int]:
        """Each request's ``max_tokens`` for a repeat of ``n`` requests (``output_len_range_ratio``).
        Seeded by the workload's seed alone, so every repeat, and both sides of a pair, ask for the same
        lengths; the mean stays ``output_len``."""
        r = self.output_len_range_ratio
        if not r:
            return [self.output_len] * n
        import numpy as np

        lo, hi = max(1, round(self.output_len * (1 - r))), max(1, round(self.output_len * (1 + r)))
        rng = np.random.default_rng([self.seed, 0x6F75])  # a stream of its own, not the arrival gaps'
        return [int(x) for x in rng.integers(lo, hi + 1, size=n)]

    def with_concurrency(self, c: int, *, num_prompts: int | None = None) -> Workload:
        return replace(self, concurrency=c, num_prompts=num_prompts or self.num_prompts)

    def to_dict(self) -> dict[str, Any]:
        d = asdict(self)
        d["extra"] = dict(self.extra)
        if d["request_rate"] == float("inf"):
            d["request_rate"] = "inf"
        return d

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> Workload:
        d = dict(d)
        if d.get("request_rate") in ("inf", None):
            d["request_rate"] = float("inf")
        d["extra"] = tuple(sorted((d.get("extra") or {}).items()))
        known = set(cls.__dataclass_fields__)
        unknown = set(d) - known
        if unknown:
            raise ValueError(f"unknown workload field(s) {sorted(unknown)}; known: {sorted(known)}")
        return cls(**d)

    @property
    def key(self) -> str:
        """Stable identity for baselines: the name plus a digest of every pinned parameter except
        concurrency (keyed separately) and the client timeout (does not change what is measured)."""
        d = self.to_dict()
        for k in ("concurrency", "request_timeout_s", "name"):
            d.pop(k)
        added_later = (("burstiness", 1.0), ("prefix_len", 0), ("output_len_range_ratio", 0.0), ("api", "completions"))
        for k, default in added_later:  # fields added later: keys that leave them at the default
            if d[k] == default:  # stay as stored
                d.pop(k)
        digest = hashlib.sha256(json.dumps(d, sort_keys=True).encode()).hexdigest()[:8]
        return f"{self.name}-{digest}"
