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

__all__ = ["MULTITURN_CONVERSATIONS", "PromptFactory"]

# conversations tokenized for the multi-turn dataset: enough for thousands of distinct requests, few
# enough that tokenizing them (with their histories) takes seconds, not the minutes all 16K would
MULTITURN_CONVERSATIONS = 2000


class PromptFactory:
    """``factory(workload, repeat)`` -> token-id prompts. Same inputs, same prompts, on every machine.

    Text datasets that are not in the cache raise FileNotFoundError naming the setup command."""

    def __init__(self, model_dir: Path | str) -> None:
        self.model_dir = Path(model_dir)
        self._pools: dict[str, list[list[int]]] = {}
        self._convs: dict[str, list[list[list[int]]]] = {}

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

    def conversation_turns(self, max_len: int) -> list[list[list[int]]]:
        """ShareGPT V3 conversations as chat prompts, one per user turn: turn t carries the user turns
        before it and the conversation's recorded answers, as a returning user's request does. Turns
        longer than ``max_len`` tokens end their conversation (a cut chat prompt is no real turn); the
        first ``MULTITURN_CONVERSATIONS`` conversations with at least one turn that fits are used."""
        from ..data import chat_prompt_ids, load_sharegpt_v3

        out: list[list[list[int]]] = []
        for c in load_sharegpt_v3():
            turns: list[list[int]] = []
            for t in range(1, len(c.turns) + 1):
                ids = chat_prompt_ids(self.tokenizer, list(c.turns[:t]), list(c.reference_replies[: t - 1]))
                if len(ids) > max_len:
                    break
                turns.append(ids)
            if turns:
                out.append(turns)
            if len(out) >= MULTITURN_CONVERSATIONS:
                break
        return out

    def __call__(self, w: Workload, repeat: int) -> Sequence[Sequence[int]]:
        from ..data import random_token_prompts

        seed = w.seed * 1_000_003 + repeat
        if w.dataset == "random":
            low, high = self.id_range
            return random_token_prompts(w.num_prompts, w.input_len, seed=seed, low=low, high=high)
        if w.dataset == "shared-prefix":
            low, high = self.id_range
            prefix = random_token_prompts(1, w.prefix_len, seed=seed, low=low, high=high)[0]
            tails = random_token_prompts(w.num_prompts, w.input_len - w.prefix_len, seed=seed + 7, low=low, high=high)
            return [prefix + t for t in tails]
        if w.dataset == "sharegpt-multiturn":
            return self._multiturn(w, seed)
        pool = self._text_pool(w.dataset)
        import numpy as np

        order = np.random.default_rng(seed).permutation(len(pool))
        picked = [pool[i][-w.input_len:] if len(pool[i]) > w.input_len else pool[i] for i in order[: w.num_prompts]]
        while len(picked) < w.num_prompts:  # fewer texts than prompts: cycle deterministically
            picked.append(picked[len(picked) % max(1, len(order))])
        return picked

    def _multiturn(self, w: Workload, seed: int) -> list[list[int]]:
        """Whole conversations in a seeded order, each turn after the one before it, until
        ``num_prompts`` turns: later turns share their conversation's earlier prompt as a prefix. The
        turns are sent without waiting for the previous answer (the client is closed- or open-loop over
        requests, not sessions); the history is the recorded one, so the prefix structure is real."""
        import numpy as np

        key = f"multiturn:{w.input_len}"
        if key not in self._convs:
            self._convs[key] = self.conversation_turns(w.input_len)
        convs = self._convs[key]
        if not convs:
            raise FileNotFoundError(f"no ShareGPT V3 turn fits input_len {w.input_len}")
        out: list[list[int]] = []
        for i in np.random.default_rng(seed).permutation(len(convs)):
            out += convs[int(i)]
            if len(out) >= w.num_prompts:
                break
        while len(out) < w.num_prompts:  # fewer turns than requests: cycle deterministically
            out.append(out[len(out) % max(1, len(convs))])
        return out[: w.num_prompts]

    def _text_pool(self, dataset: str) -> list[list[int]]:
        if dataset not in self._pools:
            self._pools[dataset] = self.text_prompts(dataset)
        return self._pools[dataset]
