"""Each engine's EAGLE-3 aux-layer id rule: which layers an engine captures for the ids a drafter names.

Why here, in the capture layer: the same rule names the columns of a captured hidden state
(:mod:`kimi_perf.capture.server`, what alignment compares) and the layers a drafter is trained on and
served with (:mod:`kimi_perf.engines.reference.drafter_model`). Both import it from below; it needs neither torch nor an
engine. The convention throughout is "residual stream entering layer k" (= output of layer k-1).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

__all__ = ["AUX_CONVENTIONS", "SGLANG_AUX_CONVENTIONS", "aux_ids_for_engine", "default_aux_layers",
           "effective_aux_layers", "served_aux_layers", "sglang_aux_convention"]


# Which aux-id convention SGLang applies, by the target's ``architectures`` entry: each model class has
# its own ``set_eagle3_layers_to_capture`` (python/sglang/srt/models/*.py), identical in sglang 0.5.17
# and 0.5.23 for the classes below. Classes not listed are an error, never a guess.
SGLANG_AUX_CONVENTIONS: Mapping[str, str] = {
    "LlamaForCausalLM": "sglang-llama",  # models/llama.py
    "Qwen2ForCausalLM": "sglang-llama",  # models/qwen2.py
    "Qwen3ForCausalLM": "sglang-llama",  # models/qwen3.py
    "DeepseekV2ForCausalLM": "sglang-deepseek",  # models/deepseek_v2.py
    "DeepseekV3ForCausalLM": "sglang-deepseek",  # subclass of DeepseekV2ForCausalLM, same method
    "DeepseekV32ForCausalLM": "sglang-deepseek",
    # models/kimi_k25.py: KimiK25ForConditionalGeneration.set_eagle3_layers_to_capture delegates to its
    # language_model, a DeepseekV3ForCausalLM
    "KimiK25ForConditionalGeneration": "sglang-deepseek",
}
AUX_CONVENTIONS = ("vllm", "reference", "sglang-llama", "sglang-deepseek")


def default_aux_layers(num_layers: int) -> tuple[int, ...]:
    """EAGLE-3's default capture layers [2, N//2, N-3], as "entering layer k" in every engine (SGLang:
    ``set_eagle3_layers_to_capture(None)`` stores them in ``layers_to_capture`` without a shift)."""
    if num_layers < 4:
        raise ValueError(f"a target with {num_layers} layers has no default EAGLE-3 aux layers "
                         "[2, N//2, N-3]")
    return (2, num_layers // 2, num_layers - 3)


def effective_aux_layers(written: list[int], engine: str) -> tuple[int, ...]:
    """The layers (as "entering layer k") an engine actually captures for explicit ids ``written``.

    The suite's convention is "residual stream entering layer k" (= output of layer k-1). vLLM and
    this suite's reference engine use id k in that sense. SGLang (0.5.17 and 0.5.23,
    python/sglang/srt/models/llama.py ``LlamaForCausalLM.set_eagle3_layers_to_capture``) stores
    ``layers_to_capture = [i + 1 for i in ids]`` and ``LlamaModel.forward`` appends
    ``hidden_states + residual`` *before* running layer ``j`` for each ``j`` in that list: SGLang-Llama
    id i = output of layer i = entering layer i + 1. SGLang's DeepSeek/Kimi
    (models/deepseek_v2.py ``DeepseekV2ForCausalLM.set_eagle3_layers_to_capture``) adds 1 only when
    ``ids[0] == 1`` and otherwise captures the ids as given; its capture (layers/communicator.py
    ``LayerCommunicator.prepare_attn``: the fused residual after the input norm) is also the stream
    entering layer j. Getting this wrong by one layer collapses acceptance.
    """
    if engine in ("vllm", "reference"):
        return tuple(written)
    if engine == "sglang-llama":
        return tuple(k + 1 for k in written)
    if engine == "sglang-deepseek":
        return tuple(k + 1 for k in written) if written and written[0] == 1 else tuple(written)
    raise ValueError(f"unknown engine convention {engine!r}: {', '.join(AUX_CONVENTIONS)}")


def served_aux_layers(written: Sequence[int] | None, engine: str, num_layers: int | None) -> tuple[int, ...]:
    """What ``engine`` captures (as "entering layer k") for a drafter config whose
    ``eagle_config.eagle_aux_hidden_state_layer_ids`` is ``written`` (None: the config has none, and
    every engine falls back to [2, N//2, N-3], which needs ``num_layers``)."""
    if written is None:
        if not num_layers:
            raise ValueError("the drafter config names no aux-layer ids, so the engine uses [2, N//2, N-3]: "
                             "the target's layer count N is needed to say which layers those are")
        if engine not in AUX_CONVENTIONS:
            raise ValueError(f"unknown engine convention {engine!r}: {', '.join(AUX_CONVENTIONS)}")
        return default_aux_layers(num_layers)
    return effective_aux_layers(list(written), engine)


def sglang_aux_convention(architectures: Sequence[str]) -> str:
    """"sglang-llama" or "sglang-deepseek" for a target's ``config.json`` ``architectures``."""
    for a in architectures:
        if a in SGLANG_AUX_CONVENTIONS:
            return SGLANG_AUX_CONVENTIONS[a]
    raise ValueError(f"no known SGLang aux-layer convention for architectures {list(architectures)}: read "
                     "that model's set_eagle3_layers_to_capture in sglang/srt/models/ and pass the family "
                     "explicitly (model_family='llama' when it adds 1 to every id, 'deepseek' when only "
                     "for a leading 1)")


def aux_ids_for_engine(layers: tuple[int, ...], engine: str) -> list[int]:
    """Inverse of :func:`effective_aux_layers`: ids to write so ``engine`` captures ``layers``."""
    if engine in ("vllm", "reference"):
        out = list(layers)
    elif engine in ("sglang-llama", "sglang-deepseek"):
        out = [k - 1 for k in layers]
        if engine == "sglang-deepseek" and out[0] != 1:
            # without a leading 1 DeepSeek adds nothing: write the layers themselves
            out = list(layers)
        if min(out) < 0:
            raise ValueError(f"layers {layers} cannot be expressed for {engine} (would need id < 0)")
    else:
        raise ValueError(f"unknown engine convention {engine!r}")
    assert effective_aux_layers(out, engine) == tuple(layers)
    return out
