"""Fixtures the reference-engine unit tests share: the embedded model's directory and tokenizer.

The suite's own plugin and fixtures come from the root ``conftest.py``; these are for the library's
tests only, module-scoped so each test module loads the tokenizer once."""

from __future__ import annotations

import pytest
from engine_helpers import embedded_path


@pytest.fixture(scope="module")
def model_dir():
    return embedded_path()


@pytest.fixture(scope="module")
def tok(model_dir):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(model_dir))
