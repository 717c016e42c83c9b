"""Comparison math and misuse errors of the alignment library (no model needed)."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from hypothesis.extra.numpy import arrays

from kimi_perf.alignment.compare import AlignmentInputError, compare_layer, threshold_from_floor
from kimi_perf.alignment.diagnose import AlignmentError, check_alignment, quantization_signature
from kimi_perf.alignment.extract import (
    AlignmentSetupError,
    HiddenStates,
    Provenance,
    _server_layers,
    parse_sglang_hidden_states,
)

finite = st.floats(-1e3, 1e3, allow_nan=False, allow_infinity=False, width=32)
mats = arrays(np.float32, st.tuples(st.integers(1, 12), st.integers(2, 16)), elements=finite).filter(
    lambda a: np.all(np.linalg.norm(a.astype(np.float64), axis=1) > 1e-3))


@settings(max_examples=150, deadline=None)
@given(mats)
def test_identical_inputs_give_cosine_one(a):
    c = compare_layer(a, a.copy())
    assert np.allclose(c.cos, 1.0, atol=1e-9) and np.allclose(c.rel_l2, 0.0) and np.allclose(c.norm_ratio, 1.0)


@settings(max_examples=150, deadline=None)
@given(mats, st.floats(1e-3, 1e3))
def test_cosine_is_scale_invariant_but_norm_ratio_is_not(a, k):
    c = compare_layer(a * k, a)
    assert np.allclose(c.cos, 1.0, atol=1e-6)
    assert np.allclose(c.norm_ratio, k, rtol=1e-4)


@settings(max_examples=100, deadline=None)
@given(mats)
def test_cosine_bounds_and_symmetry(a):
    b = a[::-1].copy() if len(a) > 1 else -a
    c1, c2 = compare_layer(a, b), compare_layer(b, a)
    assert np.all(c1.cos <= 1.0) and np.all(c1.cos >= -1.0)
    assert np.allclose(c1.cos, c2.cos)


def test_shape_nan_and_empty_errors():
    a = np.ones((3, 4))
    with pytest.raises(AlignmentInputError, match="token counts differ.*output\\[:-1\\]"):
        compare_layer(a, np.ones((4, 4)))
    with pytest.raises(AlignmentInputError, match="hidden sizes differ"):
        compare_layer(a, np.ones((3, 5)))
    bad = a.copy()
    bad[1, 2] = np.nan
    with pytest.raises(AlignmentInputError, match="non-finite values \\(first at token 1\\)"):
        compare_layer(bad, a)
    with pytest.raises(AlignmentInputError, match="no tokens"):
        compare_layer(np.ones((0, 4)), np.ones((0, 4)))
    with pytest.raises(AlignmentInputError, match="expected \\[tokens, hidden\\]"):
        compare_layer(np.ones((2, 2, 2)), np.ones((2, 2, 2)))


def test_zero_rows():
    z = np.zeros((2, 4))
    assert np.allclose(compare_layer(z, z).cos, 1.0)
    assert compare_layer(z, np.ones((2, 4))).cos_min == 0.0


def test_threshold_scales_the_distance_from_one():
    assert threshold_from_floor(0.9996, 5) == pytest.approx(0.998)
    assert threshold_from_floor(1.0, 5, min_gap=1e-6) == pytest.approx(1 - 5e-6)


def hs(layers, ids=(1, 2, 3)):
    return HiddenStates(layers, tuple(ids), Provenance("t", "0", "float32", (0, len(ids))))


def test_missing_layer_and_token_mismatch_errors():
    a = hs({2: np.ones((3, 4))})
    with pytest.raises(AlignmentSetupError, match="provides layers \\[2\\], not 15"):
        check_alignment(a, a, [15], threshold=0.9, norm_ratio_tol=0.1)
    b = hs({2: np.ones((3, 4))}, ids=(1, 9, 3))
    with pytest.raises(AlignmentError, match="different tokens from position 1"):
        check_alignment(a, b, [2], threshold=0.9, norm_ratio_tol=0.1)


def test_server_without_hidden_state_flags_names_the_flag():
    with pytest.raises(AlignmentSetupError, match="--enable-return-hidden-states"):
        _server_layers({"version": "0.5.23"})
    assert _server_layers({"enable_return_hidden_states": True}) == ["final"]
    assert _server_layers({"enable_return_aux_hidden_states": True, "return_aux_hidden_state_layer_ids": [2, 15, "final"]}) == [2, 15, "final"]


def test_parse_sglang_layout():
    block = np.arange(12, dtype=np.float32).reshape(2, 6).tolist()  # prefill of 2 tokens, 2 layers x 3
    rows = [block, list(range(6)), np.zeros((2, 6)).tolist()]  # a decode row, then a 2-token verify block
    parts = parse_sglang_hidden_states(rows, [2, 15], 3)
    assert parts[2].shape == (5, 3) and parts[15][0].tolist() == [3.0, 4.0, 5.0]
    with pytest.raises(AlignmentSetupError, match="6 wide, expected 3 layers"):
        parse_sglang_hidden_states(rows, [2, 15, 27], 3)


def test_quantization_signature():
    x = np.random.default_rng(0).standard_normal((8, 64)).astype(np.float32)
    s = np.abs(x).max(1, keepdims=True) / 127
    assert quantization_signature(np.round(x / s) * s).startswith("int8")
    assert quantization_signature(x) is None
