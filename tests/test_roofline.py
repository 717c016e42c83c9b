"""The bandwidth floor's arithmetic (the GPU measurement itself runs in test_decode_vs_memory_floor)."""

from __future__ import annotations

import json

import pytest

from kimi_perf.profiles import DUMMY_SHAPES
from kimi_perf.roofline import DecodeFloor, weight_bytes_from_config


def test_llama_8b_weight_bytes_and_floor(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps(DUMMY_SHAPES["llama-3.1-8b"]))
    wb = weight_bytes_from_config(tmp_path, "bfloat16")
    assert wb == 16_060_522_496  # 8.03B parameters in bf16: docs/sources.md "16.06 GB"
    assert weight_bytes_from_config(tmp_path, "float32") == 2 * wb
    floor = DecodeFloor(wb, 4.26e12)  # the H200 copy bandwidth this suite measured (docs/sources.md)
    assert floor.step_s == pytest.approx(3.77e-3, rel=1e-2) and floor.tok_s == pytest.approx(265, rel=1e-2)
