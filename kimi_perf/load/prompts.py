"""Prompts for workloads: seeded random ids or chat-templated real text, tokenised once per process.

Why in the library: the pytest fixtures, the A/B runner and the power study (``python -m
kimi_perf.power``) must send the same prompts for the same workload and repeat, on every machine.
"""

from __future__ import annotations

from collections.abc import Sequence
from functools import cached_property
from pathlib import Path
from typing import Any

from .workload import Workload

__all__ = ["PromptFactory"]


class PromptFactory:
    """``factory(workload, repeat)`` -> token-id prompts. Same inputs, same prompts, on every machine.

    Text datasets that are not in the cache raise FileNotFoundError naming the setup command."""

    def __init__(self, model_dir: Path | str) -> None:
        self.model_dir = Path(model_dir)
        self._pools: dict[str, list[list[int]]] = {}

    @cached_property
    def tokenizer(self) -> Any:
        from transformers import AutoTokenizer

        return AutoTokenizer.from_pretrained(str(self.model_dir))

    @cached_property
    def id_range(self) -> tuple[int, int]:
        tok = self.tokenizer
        special = set(tok.all_special_ids or [])
        low = max(special) + 1 if special and max(special) < 1000 else 0
        return low, len(tok)

    def text_prompts(self, dataset: str) -> list[list[int]]:
        from ..data import chat_prompt_ids, load_mtbench, load_sharegpt

        convs = load_mtbench() if dataset == "mtbench" else load_sharegpt()
        return [chat_prompt_ids(self.tokenizer, [c.turns[0]]) for c in convs]

    def __call__(self, w: Workload, repeat: int) -> Sequence[Sequence[int]]:
        from ..data import random_token_prompts

        seed = w.seed * 1_000_003 + repeat
        if w.dataset == "random":
            low, high = self.id_range
            return random_token_prompts(w.num_prompts, w.input_len, seed=seed, low=low, high=high)
        pool = self._text_pool(w.dataset)
        import numpy as np

        order = np.random.default_rng(seed).permutation(len(pool))
        picked = [pool[i][-w.input_len:] if len(pool[i]) > w.input_len else pool[i] for i in order[: w.num_prompts]]
        while len(picked) < w.num_prompts:  # fewer texts than prompts: cycle deterministically
            picked.append(picked[len(picked) % max(1, len(order))])
        return picked

    def _text_pool(self, dataset: str) -> list[list[int]]:
        if dataset not in self._pools:
            self._pools[dataset] = self.text_prompts(dataset)
        return self._pools[dataset]
