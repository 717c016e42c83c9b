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
    parse_sglang_hidden_states,
)
from kimi_perf.capture.server import _server_layers

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


REF = {"engine": "kimi-perf-reference", "num_layers": 30}


def test_server_without_hidden_state_flags_names_the_flag():
    with pytest.raises(AlignmentSetupError, match="--enable-return-hidden-states"):
        _server_layers({"version": "0.5.23"})
    with pytest.raises(AlignmentSetupError, match="--enable-return-hidden-states"):
        _server_layers(REF)
    with pytest.raises(AlignmentSetupError, match="mode last returns only the last token"):
        _server_layers({"version": "0.5.17", "return_hidden_states_mode": "last"})
    assert _server_layers({"enable_return_hidden_states": True}) == ["final"]
    assert _server_layers({**REF, "enable_return_hidden_states": True}) == ["final"]
    # the reference engine's ids already are "entering layer k" (and it has a "final" pseudo-layer)
    assert _server_layers({**REF, "enable_return_aux_hidden_states": True,
                           "return_aux_hidden_state_layer_ids": [2, 15, "final"]}) == [2, 15, "final"]


# The suite compares in "residual stream entering layer k". SGLang-Llama id i = output of layer i =
# entering layer i + 1 (LlamaForCausalLM.set_eagle3_layers_to_capture adds 1, LlamaModel.forward captures
# before running the layer); SGLang-DeepSeek/Kimi adds 1 only when the first id is 1; no ids = the
# default [2, N//2, N-3] unshifted. Same rule for 0.5.23's aux mode and for EAGLE-3 serving.
@pytest.mark.parametrize("family, ids, layers", [
    ("llama", [1, 14, 26], (2, 15, 27)),
    ("llama", [2, 15, 27], (3, 16, 28)),
    ("deepseek", [1, 14, 26], (2, 15, 27)),
    ("deepseek", [2, 15, 27], (2, 15, 27)),
    ("kimi", [1, 30, 57], (2, 31, 58)),
    ("llama", None, (2, 15, 27)),
    ("deepseek", None, (2, 15, 27)),
])
def test_sglang_layer_ids_map_to_the_suites_convention(family, ids, layers):
    aux = {"version": "0.5.23", "enable_return_aux_hidden_states": True, "enable_return_hidden_states": True,
           "return_aux_hidden_state_layer_ids": ids, "speculative_algorithm": None}
    assert _server_layers(aux, model_family=family, num_layers=30) == list(layers)
    served = {"version": "0.5.17", "enable_return_hidden_states": True, "speculative_algorithm": "EAGLE3",
              "speculative_draft_model_path": "/nowhere"}
    draft = {"eagle_config": {"eagle_aux_hidden_state_layer_ids": ids}} if ids is not None else {}
    assert _server_layers(served, model_family=family, num_layers=30, draft_config=draft) == list(layers)


def test_sglang_layer_mapping_needs_family_layers_and_drafter(tmp_path):
    aux = {"version": "0.5.23", "enable_return_aux_hidden_states": True,
           "return_aux_hidden_state_layer_ids": [1], "model_path": str(tmp_path)}
    with pytest.raises(AlignmentSetupError, match="pass model_family='llama' or 'deepseek'"):
        _server_layers(aux)
    # the family and layer count come from the target's config.json when it is on this machine
    (tmp_path / "config.json").write_text('{"architectures": ["LlamaForCausalLM"], "num_hidden_layers": 30}')
    assert _server_layers(aux) == [2]
    assert _server_layers({**aux, "return_aux_hidden_state_layer_ids": None}) == [2, 15, 27]
    (tmp_path / "config.json").write_text('{"architectures": ["KimiK25ForConditionalGeneration"], '
                                          '"text_config": {"num_hidden_layers": 61}}')
    assert _server_layers({**aux, "return_aux_hidden_state_layer_ids": None}) == [2, 30, 58]
    (tmp_path / "config.json").write_text('{"architectures": ["MixtralForCausalLM"]}')
    with pytest.raises(AlignmentSetupError, match="no known SGLang aux-layer convention.*MixtralForCausalLM"):
        _server_layers(aux)
    with pytest.raises(AlignmentSetupError, match="layer count N is needed.*pass num_layers"):
        _server_layers({**aux, "return_aux_hidden_state_layer_ids": None}, model_family="llama")
    served = {"version": "0.5.17", "enable_return_hidden_states": True, "speculative_algorithm": "EAGLE3",
              "speculative_draft_model_path": str(tmp_path / "no-drafter")}
    with pytest.raises(AlignmentSetupError, match="drafter's aux layers.*pass draft_config"):
        _server_layers(served, model_family="llama")
    with pytest.raises(AlignmentSetupError, match="NGRAM.*not mapped"):
        _server_layers({**served, "speculative_algorithm": "NGRAM"}, model_family="llama")


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


def test_rows_below_names_the_failing_positions():
    import numpy as np

    from kimi_perf.alignment.diagnose import rows_below

    cos = np.ones(160)
    cos[148:] = 0.4
    assert rows_below(cos, 0.99) == "12/160 rows below threshold: 148-159 (the last 12)"
    cos = np.ones(64)
    cos[[15, 31, 47]] = 0.5
    assert rows_below(cos, 0.99) == "3/64 rows below threshold: 15, 31, 47"
    assert rows_below(np.ones(8), 0.99) == "no row below threshold"
    cos = np.ones(40)
    cos[[3, 30, 31]] = 0.4
    assert rows_below(cos, 0.99, prompt_len=24) == ("3/40 rows below threshold: 3, 30-31; 1 in the prompt "
                                                    "(rows 0-23), 2 in the generated rows (24-39)")


def test_unexplained_mismatch_says_where(tmp_path):
    import numpy as np

    from kimi_perf.alignment.diagnose import check_alignment
    from kimi_perf.alignment.extract import HiddenStates, Provenance

    rng = np.random.default_rng(0)
    x = {k: rng.standard_normal((40, 16)).astype(np.float32) for k in (1, 2, 3)}
    y = {k: v.copy() for k, v in x.items()}
    y[2][-5:] = rng.standard_normal((5, 16))  # the last five rows are garbage, nothing else explains them
    toks = tuple(range(40))
    a = HiddenStates(x, toks, Provenance("a", "1", "float32", (0, 40)))
    b = HiddenStates(y, toks, Provenance("b", "1", "float32", (0, 40)))
    (v,) = check_alignment(a, b, [2], threshold=0.999, norm_ratio_tol=10.0).verdicts
    assert not v.ok and "unexplained mismatch" in v.cause and "35-39 (the last 5)" in v.cause, v.cause


def test_a_mismatch_confined_to_generated_or_prompt_rows_is_named_by_its_side():
    """The vLLM 0.26.0 H200 pattern (118 rows, prompt 87, the last 17 bad) is a decode-path capture fault;
    prompt-only failures are the prefill side; failures on both sides stay unexplained."""
    import dataclasses

    import numpy as np

    from kimi_perf.alignment.diagnose import check_alignment, positional_cause
    from kimi_perf.alignment.extract import HiddenStates, Provenance

    cos = np.ones(118)
    cos[101:] = 0.45
    assert positional_cause(cos, 0.99, 87).startswith("decode-path capture fault: every prompt row agrees, the last 17 generated rows")
    cos = np.ones(118)
    cos[[90, 95]] = 0.5
    assert "2 of 31 generated rows do not" in positional_cause(cos, 0.99, 87)
    cos = np.ones(118)
    cos[:3] = 0.5
    assert positional_cause(cos, 0.99, 87).startswith("prefill-path capture fault: 3 of 87 prompt rows")
    cos[110] = 0.5
    assert positional_cause(cos, 0.99, 87) is None
    assert positional_cause(cos, 0.99, None) is None

    rng = np.random.default_rng(1)
    x = {2: rng.standard_normal((40, 16)).astype(np.float32)}
    y = {2: x[2].copy()}
    y[2][-6:] = rng.standard_normal((6, 16))
    toks = tuple(range(40))
    a = HiddenStates(x, toks, Provenance("hf", "1", "float32", (0, 40)))
    b = dataclasses.replace(HiddenStates(y, toks, Provenance("vllm", "1", "float32", (0, 40))), prompt_len=30)
    (v,) = check_alignment(a, b, [2], threshold=0.999, norm_ratio_tol=10.0).verdicts
    assert v.cause.startswith("decode-path capture fault") and "34-39 (the last 6); 0 in the prompt" in v.cause, v.cause
