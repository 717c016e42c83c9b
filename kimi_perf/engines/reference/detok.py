"""Incremental detokenisation for streaming.

Decoding the whole output on every token is quadratic; decoding tokens one by one breaks multi-byte
characters and merges. This keeps vLLM's two offsets: text is decoded over a short window
``ids[prefix:]`` and only the part beyond ``ids[prefix:read]`` is emitted, and nothing is emitted
while the window ends in an incomplete UTF-8 sequence (U+FFFD).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

__all__ = ["IncrementalDetokenizer"]


@dataclass
class IncrementalDetokenizer:
    tokenizer: Any  # a ``tokenizers.Tokenizer`` (fast, GIL-light) or anything with ``decode``
    vocab_size: int
    skip_special_tokens: bool = True
    ids: list[int] | None = None
    prefix: int = 0
    read: int = 0
    text: str = ""

    def _decode(self, ids: list[int]) -> str:
        # dummy-weight models may sample ids beyond the tokenizer's vocabulary: they have no text
        ids = [i for i in ids if 0 <= i < self.vocab_size]
        return self.tokenizer.decode(ids, skip_special_tokens=self.skip_special_tokens)

    def add(self, new_ids: list[int] | tuple[int, ...]) -> str:
        """Feed newly generated ids; return the text delta that is now safe to emit."""
        if self.ids is None:
            self.ids = []
        self.ids.extend(new_ids)
        prefix_text = self._decode(self.ids[self.prefix : self.read])
        full = self._decode(self.ids[self.prefix :])
        if len(full) > len(prefix_text) and not full.endswith("\ufffd"):
            delta = full[len(prefix_text) :]
            self.prefix, self.read = self.read, len(self.ids)
            self.text += delta
            return delta
        return ""

    def flush(self) -> str:
        """At the end of a request: whatever is still held back (a dangling partial character)."""
        if self.ids is None:
            return ""
        prefix_text = self._decode(self.ids[self.prefix : self.read])
        full = self._decode(self.ids[self.prefix :])
        delta = full[len(prefix_text) :] if len(full) > len(prefix_text) else ""
        self.prefix = self.read = len(self.ids)
        self.text += delta
        return delta
