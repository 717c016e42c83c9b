"""Shared helpers for tests that need the embedded model (skips with the install hint if absent)."""

from __future__ import annotations

from pathlib import Path

import pytest

PROMPTS = [
    "What is the capital of France? Explain briefly.",
    "Write a haiku about the sea.",
    "List three prime numbers and say why they are prime.",
    "Translate 'good morning' into Spanish and German.",
    "Why is the sky blue?",
    "Give me a short recipe for pancakes.",
]


def embedded_path() -> Path:
    from kimi_perf.models.embedded import ensure_embedded_model

    try:
        return ensure_embedded_model().path
    except FileNotFoundError as e:
        pytest.skip(str(e))


def chat_ids(tok, text: str) -> list[int]:
    from kimi_perf.data import chat_prompt_ids

    return chat_prompt_ids(tok, [text])
