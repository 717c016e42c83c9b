"""Which engines the EAGLE-3 and alignment tests run on, which layers each engine's serving path hands
back, how far another engine may sit from transformers, and the planted SGLang layer offset.

Why a module of its own: these decisions are made at collection time (parametrization) and again when
a test runs (server configs, layer labels), and they must be the same both times and unit-testable
without a GPU, an engine or torch. Nothing here imports torch or an engine at module level (the plugin
promises a torch-free collection); the layer-convention rules themselves live in
:mod:`kimi_perf.engines.reference.drafter_model` and are imported where used.

The profile sections these decisions read (``eagle3``, ``alignment``) are parsed and validated once,
when the profile loads, into :mod:`kimi_perf.sections`; their defaults live there.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

__all__ = ["ALIGNMENT_DTYPES", "ENGINE_NOISE_FACTOR", "PlanError", "PlantedOffset", "diagnosis_layers",
           "drafter_aux_layers", "engine_threshold", "planted_sglang_offset", "selected_engines", "serving_dtype"]


ALIGNMENT_DTYPES = ("float32", "bfloat16")

# Another engine vs transformers, in the serving dtype, is two independent reduced-precision
# implementations of the same network. The reference engine's noise floor (kimi_perf/suite/alignment.py
# ``noise_floor``) is how far *one* bf16 implementation sits from another computation of itself or from
# fp32. Independent rounding errors add in squared angle, and 1 - cos ~ angle^2 / 2, so two bf16
# implementations each a floor away from fp32 sit about 2x the floor's cosine distance from each other
# (4x only if their errors pointed the same way, the triangle-inequality worst case). 2 keeps an
# off-by-one layer detectable on SmolLM2-135M bf16: adjacent residual streams there have per-token cos
# min 0.87 (layers 2/3), 0.925 (15/16), 0.88 (27/28) (transformers, 2 MT-bench prompts), while the
# stored h200-embedded floors give 0.9994 / 0.948 / 0.988 at margin 5 x 2; at 4x layer 15's threshold
# (0.896) would let an off-by-one through on cosine. The tests report per layer whether an off-by-one
# would still fail ("resolves off-by-one"), so a profile that widens the factor sees what it gave up.
ENGINE_NOISE_FACTOR = 2.0


class PlanError(ValueError):
    """A profile value or drafter config the plan cannot use; ``key``, ``problem`` and ``fix`` are
    the pieces of kimi_perf.profiles' error format (``profile P: key: problem. Fix: fix``)."""

    def __init__(self, key: str, problem: str, fix: str) -> None:
        super().__init__(f"{key}: {problem}. Fix: {fix}")
        self.key, self.problem, self.fix = key, problem, fix


def selected_engines(listed: Sequence[str], session_engines: Sequence[str], what: str) -> tuple[list[str], str]:
    """The engines of ``listed`` that ``--perf-engine`` selected, in the profile's order, and the skip
    reason to use when none is (so the parametrized test is reported skipped with its cause)."""
    names = [e for e in listed if e in session_engines]
    why = "" if names else (f"{what} lists {list(listed) or 'no engine'}, --perf-engine selected "
                            f"{list(session_engines)}: nothing to run (select one with --perf-engine)")
    return names, why


def serving_dtype(engine_cfg: Mapping[str, Any]) -> str:
    """The dtype the alignment comparison runs in for an engine: its serving dtype, in the names the
    noise floor is measured for ("auto" is the checkpoint's bf16 for the models this suite serves)."""
    d = str(engine_cfg.get("dtype", "bfloat16"))
    if d in ("auto", "bfloat16", "bf16"):
        return "bfloat16"
    if d in ("float32", "fp32"):
        return "float32"
    raise PlanError("dtype", f"{d!r} has no measured alignment noise floor",
                    f"serve in one of {list(ALIGNMENT_DTYPES)} for the alignment tests")


def engine_threshold(thr: float, tol: float, kind: str, factor: float = ENGINE_NOISE_FACTOR) -> tuple[float, float]:
    """Scale the reference engine's (cosine threshold, norm-ratio tolerance) for an engine of ``kind``:
    unchanged for the reference engine, the cosine *distance* and the tolerance ``factor`` times wider
    for another one (:data:`ENGINE_NOISE_FACTOR` says why)."""
    if kind == "reference":
        return thr, tol
    return 1.0 - factor * (1.0 - thr), factor * tol


def drafter_aux_layers(draft_config: Mapping[str, Any], num_layers: int) -> tuple[int, ...]:
    """The layers (as "residual stream entering layer k") an EAGLE-3 drafter was trained on.

    The suite's drafters say so in ``kimi_perf.trained_aux_layers``; a config without explicit
    ``eagle_config.eagle_aux_hidden_state_layer_ids`` was trained on EAGLE-3's default [2, N//2, N-3].
    Explicit ids without the kimi_perf block are in an unknown engine's convention (SpecForge writes
    SGLang's, speculators vLLM's): an error, never a guess."""
    meta = draft_config.get("kimi_perf") or {}
    trained = meta.get("trained_aux_layers")
    if trained is not None:
        return tuple(int(k) for k in trained)
    ids = (draft_config.get("eagle_config") or {}).get("eagle_aux_hidden_state_layer_ids")
    if ids is None:
        if num_layers < 4:
            raise PlanError("num_hidden_layers", f"{num_layers}", "a target with at least 4 layers")
        return (2, num_layers // 2, num_layers - 3)
    raise PlanError("drafter config.json", f"names aux-layer ids {list(ids)} but not the convention they are in",
                    'add "kimi_perf": {"trained_aux_layers": [...]} with the layers as "residual stream '
                    'entering layer k" (what vLLM calls them)')


def diagnosis_layers(layers: Sequence[Any], num_layers: int) -> list[Any]:
    """What to capture on the transformers side so a mismatch can be named: each layer and its
    neighbours +-2 (off-by-one/-two), the pre-norm last layer N and the final-norm output."""
    out: set[int] = {num_layers}
    for k in layers:
        if isinstance(k, int):
            out |= {j for j in range(k - 2, k + 3) if 0 <= j <= num_layers}
    return [*sorted(out), "final"]


@dataclass(frozen=True)
class PlantedOffset:
    """A drafter copy whose explicit aux ids are one layer off in SGLang's convention."""

    trained: tuple[int, ...]  # what the drafter was trained on ("entering layer k")
    correct_ids: tuple[int, ...]  # the ids SGLang needs to capture ``trained``
    written: tuple[int, ...]  # the ids written into the planted copy
    served: tuple[int, ...]  # what SGLang then captures ("entering layer k")
    convention: str  # "sglang-llama" / "sglang-deepseek"
    why: str

    def draft_config(self, original: Mapping[str, Any]) -> dict[str, Any]:
        """``original`` with the planted ids; the kimi_perf block (trained layers) is kept, so the
        copy still says what it was trained on."""
        cfg = dict(original)
        cfg["eagle_config"] = {**(original.get("eagle_config") or {}),
                               "eagle_aux_hidden_state_layer_ids": list(self.written), "use_aux_hidden_state": True}
        return cfg


def planted_sglang_offset(trained: Sequence[int], convention: str) -> PlantedOffset:
    """The ids a user who forgot SGLang's layer-id rule writes, and the layers SGLang then captures.

    SGLang's Llama adds 1 to every explicit id (sglang 0.5.17 python/sglang/srt/models/llama.py
    ``LlamaForCausalLM.set_eagle3_layers_to_capture``: ``layers_to_capture = [val + 1 for val in
    layer_ids]``), so the right ids for layers [2, 15, 27] are [1, 14, 26]; writing the layers
    themselves (vLLM's convention, what someone who forgot the +1 writes) makes SGLang capture [3, 16, 28].
    DeepSeek adds 1 only when the first id is 1 (models/deepseek_v2.py), so there the layers themselves
    are captured as written and the planted mistake is ids one layer late. Raises :class:`PlanError`
    when no candidate gives a one-layer offset on every layer."""
    from ..engines.reference.drafter_model import aux_ids_for_engine, effective_aux_layers

    t = tuple(int(k) for k in trained)
    try:
        correct = tuple(aux_ids_for_engine(t, convention))
    except ValueError as e:
        raise PlanError("planted offset", str(e), "use a drafter whose aux layers are >= 1") from None
    candidates = [(t, "the layers themselves (vLLM's convention): SGLang's +1 rule forgotten"),
                  (tuple(k + 1 for k in correct), "SGLang's ids shifted by one"),
                  (tuple(k + 1 for k in t), "ids one layer late")]
    for written, why in candidates:
        served = effective_aux_layers(list(written), convention)
        if all(abs(s - k) == 1 for s, k in zip(served, t)):
            return PlantedOffset(t, correct, tuple(written), tuple(served), convention, why)
    raise PlanError("planted offset", f"no id list one layer off from {list(t)} exists in {convention}",
                    "plant the offset by hand for this model family")
