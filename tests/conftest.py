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


def pytest_collection_modifyitems(config, items):
    """This repository's own unit tests marked ``gpu`` skip on a machine without one. The plugin skips
    only the suite's tests (those using its fixtures), so that a host repository's own ``gpu`` marker is
    left alone; these unit tests use none of its fixtures and say here what they need."""
    gpu = [i for i in items if i.get_closest_marker("gpu") is not None and "perf_session" not in i.fixturenames]
    if not gpu:
        return
    from kimi_perf.machine import gpu_info

    if not gpu_info():
        for i in gpu:
            i.add_marker(pytest.mark.skip(reason="needs a CUDA GPU; nvidia-smi lists none on this machine"))
