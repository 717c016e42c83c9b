"""The typed profile sections ``eagle3``, ``alignment``, ``nccl`` and ``allreduce``.

Why a module of its own: these sections used to reach the tests as raw JSON objects read with
``.get(key, default)`` in some thirty places, so one default (``eval.mismatch_min_accept_length`` 1.5,
``steps`` 3) was written in three files and the eagle3/alignment sections were validated twice (at load
and again by the fixtures). Here each section is a frozen dataclass, parsed ONCE when the profile loads
(:func:`kimi_perf.profiles.load_profile`), and every field carries its type, its default and a one-line
doc in ``metadata={"doc": ...}`` (:func:`field_docs` reads them back): the JSON Schema and the profile
reference page are generated from these, so the docs cannot drift from the parser.

A mistake is a :class:`SectionError` with the key, the problem and the fix; ``kimi_perf.profiles``
prefixes the file (``profile P: key: problem. Fix: fix``). Booleans are refused where numbers are
expected (``true`` is an int to Python, never to a profile author).

The JSON key of a field is its name. Fields typed by another module keep that module's parser:
``eagle3.matrix`` is :class:`kimi_perf.eagle3.matrix.MatrixPlan`, and the all-reduce message sizes are
:class:`kimi_perf.nccl.AllReduceSpec`'s (its defaults are the section's). ``eagle3.recipe`` stays JSON
here (:meth:`Eagle3Section.drafter_recipe` builds the typed recipe): its config classes live in modules
that import torch, which profile loading and collection must not; the shipped drafter's manifest digests
the recipe those classes build, so it is parsed by them alone.

Nothing here imports torch or an engine.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import MISSING, dataclass, field, fields
from types import MappingProxyType
from typing import Any

# the alignment plan holds the serving dtypes with a measured noise floor and the engine noise factor
# (its comment says why 2): the section's choices and default, read from there
from .alignment.plan import ALIGNMENT_DTYPES, ENGINE_NOISE_FACTOR
from .eagle3.matrix import MatrixPlan
from .engines.presets import NCCL_PRESETS
from .nccl import AllReduceSpec

__all__ = ["ALIGNMENT_DTYPES", "EAGLE3_GATEABLE", "ENGINE_NOISE_FACTOR", "AlignmentSection", "AllReduceSection",
           "Eagle3Eval", "Eagle3Section", "NcclSection", "SectionError", "field_docs", "parse_alignment",
           "parse_allreduce", "parse_eagle3", "parse_nccl"]

EAGLE3_GATEABLE = ("accept_length", "accept_rate", "accept_rate_pos0", "accept_rate_pos1", "accept_rate_pos2",
                   "accept_rate_pos3", "spec_speedup")


class SectionError(ValueError):
    """A section value the suite cannot use; ``key``, ``problem`` and ``fix`` are the pieces of
    kimi_perf.profiles' error format (``profile P: key: problem. Fix: fix``)."""

    def __init__(self, key: str, problem: str, fix: str) -> None:
        super().__init__(f"{key}: {problem}. Fix: {fix}")
        self.key, self.problem, self.fix = key, problem, fix


def _f(default: Any, doc: str, **meta: Any) -> Any:
    """A dataclass field with its doc (and, where the default depends on another key, ``default_doc``)."""
    return field(default=default, metadata={"doc": doc, **meta})


def field_docs(cls: type) -> list[dict[str, Any]]:
    """``[{"name", "type", "default", "doc"}, ...]`` of a section class, in declaration order: what the
    schema and docs generators read. ``name`` is the JSON key (``metadata["json"]`` where it differs, e.g.
    MatrixPlan's ``ci.rows``; None: no profile key), ``default`` the JSON default, or ``default_doc``
    where the default is derived from another key."""
    out = []
    for f in fields(cls):
        name = f.metadata.get("json", f.name)
        if name is None:
            continue
        if "default_doc" in f.metadata:
            default: Any = f.metadata["default_doc"]
        elif f.default is not MISSING:
            default = list(f.default) if isinstance(f.default, tuple) else f.default
        elif f.default_factory is not MISSING:
            default = "{}"
        else:
            default = "(required)"
        out.append({"name": name, "type": str(f.type), "default": default, "doc": f.metadata.get("doc", "")})
    return out


# -- shared checks ---------------------------------------------------------------------------------------

def _object(raw: Any, where: str) -> Mapping[str, Any]:
    if not isinstance(raw, Mapping):
        raise SectionError(where, "must be an object", "see profiles/embedded-cpu.json")
    return raw


def _known_keys(raw: Mapping[str, Any], cls: type, where: str) -> None:
    allowed = {f.name for f in fields(cls)}
    bad = set(raw) - allowed
    if bad:
        raise SectionError(where, f"unknown key(s) {sorted(bad)}", f"allowed keys: {sorted(allowed)}")


def _number(sec: Mapping[str, Any], key: str, where: str, lo: float, default: Any, *, integer: bool = False,
            strict: bool = False, nullable: bool = False) -> Any:
    """``sec[key]`` (``default`` when absent) checked: a number (an int for ``integer``; never a bool),
    finite, >= lo (> lo for ``strict``); null too for ``nullable`` (None)."""
    if key not in sec:
        return default
    v = sec[key]
    if v is None and nullable:
        return None
    ok = not isinstance(v, bool) and (isinstance(v, int) if integer else isinstance(v, (int, float)))
    if ok and (not math.isfinite(float(v)) or (v <= lo if strict else v < lo)):
        ok = False
    if not ok:
        kind = "an integer" if integer else "a number"
        raise SectionError(f"{where}.{key}", f"{v!r}", f"{kind} {'>' if strict else '>='} {lo:g}")
    return int(v) if integer else float(v)


def _engine_list(raw: Any, key: str, engines: Mapping[str, Any]) -> tuple[str, ...]:
    if not isinstance(raw, list) or not raw or not all(isinstance(e, str) for e in raw):
        raise SectionError(key, f"{raw!r} is not a non-empty list of engine names",
                           f"e.g. {list(engines)[:3]!r} (names under 'engines')")
    unknown = [e for e in raw if e not in engines]
    if unknown:
        raise SectionError(key, f"names engine(s) {unknown} the profile does not define",
                           f"choose from {sorted(engines)}")
    if len(set(raw)) != len(raw):
        raise SectionError(key, f"{raw!r} lists an engine twice", "list each engine once")
    return tuple(raw)


def _presets(raw: Any, key: str) -> tuple[str, ...]:
    if (not isinstance(raw, list) or len(raw) < 2
            or not all(isinstance(p, str) and p in NCCL_PRESETS for p in raw)):
        raise SectionError(key, f"{raw!r}",
                           f"a list of >= 2 preset names, the reference first; presets: {', '.join(NCCL_PRESETS)}")
    return tuple(raw)


def _frozen_json(v: Any) -> Any:
    """A read-only copy of a JSON value (objects become mappingproxies, lists stay lists of copies)."""
    if isinstance(v, Mapping):
        return MappingProxyType({k: _frozen_json(x) for k, x in v.items()})
    if isinstance(v, list):
        return [_frozen_json(x) for x in v]
    return v


# -- eagle3 ----------------------------------------------------------------------------------------------

@dataclass(frozen=True)
class Eagle3Eval:
    """``eagle3.eval``: how the drafter is evaluated and what the EAGLE-3 tests require of it."""

    prompts: int = _f(8, "held-out MT-bench prompts the acceptance and speedup are measured on (the baseline "
                         "key names this count; a run with fewer fails)")
    max_new_tokens: int = _f(64, "tokens generated per prompt")
    min_speedup: float = _f(1.0, "minimum speculative over plain decode tok/s")
    min_accept_length: float = _f(1.0, "minimum mean accept length (tokens per target step, 1 = no draft "
                                       "accepted)")
    mismatch_max_accept_ratio: float | None = _f(0.6, "a drafter served one layer off must accept fewer than "
                                                      "this fraction of the correctly served drafter's accepted "
                                                      "drafts; null: the drop is measured and reported, not "
                                                      "asserted (a model whose adjacent layers are close enough "
                                                      "that an offset costs little acceptance)")
    mismatch_min_accept_length: float = _f(1.5, "below this accept length the correctly served drafter is too "
                                                "weak to resolve an acceptance drop; the layer-mismatch tests "
                                                "then assert only the alignment half")
    code_prompts: int = _f(0, "HumanEval code prompts (python -m kimi_perf.data fetch --humaneval; held out of "
                              "every recipe) on which each engine's served accept length is also measured and "
                              "reported, not gated: a drafter trained on chat can accept much less on code; 0: none")


@dataclass(frozen=True)
class Eagle3Section:
    """``eagle3``: the EAGLE-3 drafter, where it is served and what is gated (perf_tests/test_eagle3.py,
    test_matrix.py)."""

    engine: str = _f("reference", "the primary EAGLE-3 engine (what test_acceptance_in_vllm compares with)")
    engines: tuple[str, ...] = _f(("reference",), "the engines the acceptance/speedup A/B runs on",
                                  default_doc="[eagle3.engine]")
    steps: int = _f(3, "draft tokens per step (the speculative depth)")
    recipe: Mapping[str, Any] | None = _f(None, "the drafter recipe {data, features, train} the pipeline trains "
                                                "(kimi_perf.eagle3.pipeline.DrafterRecipe); none: --perf-drafter")
    eval: Eagle3Eval = field(default_factory=Eagle3Eval, metadata={"doc": "evaluation and thresholds "
                                                                           "(Eagle3Eval)"})
    gated: tuple[str, ...] = _f(("accept_length", "accept_rate_pos0"),
                                f"metrics gated against baselines, of: {', '.join(EAGLE3_GATEABLE)}")
    matrix: MatrixPlan | None = _f(None, "the extraction-path matrix (kimi_perf.eagle3.matrix.MatrixPlan)")
    serve: str | None = _f(None, "a drafter bundle shipped in kimi_perf/eagle3/shipped_drafters/ (its folder "
                                 "name) that the session serves as --perf-drafter would, instead of the recipe's "
                                 "drafter; --perf-train-drafter trains and serves the recipe's, --perf-drafter "
                                 "overrides both. Its rows are keyed apart (workload ...@DATA_DIGEST)")

    @property
    def serve_tag(self) -> str:
        """What the served bundle's rows carry after ``@`` in their workload key: its data digest (the
        bundle name's second field), so they and the recipe drafter's rows are two baselines."""
        if not self.serve:
            raise ValueError("eagle3.serve is not set")
        return self.serve.split("-")[1]

    def drafter_recipe(self) -> Any:
        """The typed :class:`~kimi_perf.eagle3.pipeline.DrafterRecipe` (imports torch); ValueError when the
        profile has none or it is malformed."""
        from .eagle3.pipeline import DrafterRecipe

        if self.recipe is None:
            raise ValueError("the profile has no eagle3.recipe")
        return DrafterRecipe.from_dict(dict(self.recipe))


def _shipped_bundle(name: Any, where: str, otherwise: str, *, retired_ok: bool = False) -> None:
    """``name`` is a drafter bundle shipped in kimi_perf/eagle3/shipped_drafters/ (its folder name), or with
    ``retired_ok`` one retired from the tree (a warm start's parent: the trainer says how to restore it).
    Checked here, at load, so a typo is a usage error before any server starts or any data is made
    (kimi_perf.eagle3.bundle imports no torch)."""
    from .eagle3.bundle import SHIPPED_ROOT as shipped
    from .eagle3.bundle import retired, shipped_names

    have = shipped_names()
    if retired_ok:
        have += sorted(retired())
    if not isinstance(name, str) or name not in have or len(name.split("-")) != 4:
        raise SectionError(where, f"{name!r} is not a drafter bundle shipped in {shipped}",
                           f"name one of {have}, {otherwise}")


def parse_eagle3(raw: Any, engines: Mapping[str, Any]) -> Eagle3Section | None:
    """The ``eagle3`` section, validated; None for a profile without one (or an empty one)."""
    if raw is None or (isinstance(raw, Mapping) and not raw):
        return None
    raw = _object(raw, "eagle3")
    _known_keys(raw, Eagle3Section, "eagle3")
    eng = raw.get("engine", "reference")
    if "engine" in raw and (not isinstance(eng, str) or eng not in engines):
        raise SectionError("eagle3.engine", f"{eng!r} is not an engine of the profile",
                           f"choose from {sorted(engines)}")
    listed = _engine_list(raw["engines"], "eagle3.engines", engines) if "engines" in raw else (str(eng),)
    steps = _number(raw, "steps", "eagle3", 1, Eagle3Section.steps, integer=True)
    ev = _object(raw.get("eval", {}), "eagle3.eval")
    _known_keys(ev, Eagle3Eval, "eagle3.eval")
    d = Eagle3Eval()
    evs = Eagle3Eval(
        prompts=_number(ev, "prompts", "eagle3.eval", 1, d.prompts, integer=True),
        max_new_tokens=_number(ev, "max_new_tokens", "eagle3.eval", 1, d.max_new_tokens, integer=True),
        code_prompts=_number(ev, "code_prompts", "eagle3.eval", 0, d.code_prompts, integer=True),
        # null: measured, not asserted (field doc)
        mismatch_max_accept_ratio=_number(ev, "mismatch_max_accept_ratio", "eagle3.eval", 0,
                                          d.mismatch_max_accept_ratio, nullable=True),
        **{k: _number(ev, k, "eagle3.eval", 0, getattr(d, k))
           for k in ("min_speedup", "min_accept_length", "mismatch_min_accept_length")})
    matrix = None
    if "matrix" in raw:
        m = _object(raw["matrix"], "eagle3.matrix")
        try:
            matrix = MatrixPlan.from_section(m, engines)
        except ValueError as e:
            raise SectionError("eagle3.matrix", str(e), "see kimi_perf/eagle3/matrix.py for rows and gates") from None
    gated = raw.get("gated", list(Eagle3Section.gated))
    if not isinstance(gated, list) or any(g not in EAGLE3_GATEABLE for g in gated):
        raise SectionError("eagle3.gated", f"{gated!r}", f"a list of: {', '.join(EAGLE3_GATEABLE)}")
    recipe = raw.get("recipe")
    if recipe is not None:
        recipe = _frozen_json(_object(recipe, "eagle3.recipe"))
        train = recipe.get("train")
        if isinstance(train, Mapping) and train.get("init_from"):
            _shipped_bundle(train["init_from"], "eagle3.recipe.train.init_from",
                            "or leave it out to train the drafter from scratch", retired_ok=True)
    serve = raw.get("serve")
    if serve is not None:
        _shipped_bundle(serve, "eagle3.serve", "or leave it out to serve the recipe's drafter")
    return Eagle3Section(engine=str(eng), engines=listed, steps=steps, recipe=recipe, eval=evs, gated=tuple(gated),
                         matrix=matrix, serve=serve)


# -- alignment -------------------------------------------------------------------------------------------

@dataclass(frozen=True)
class AlignmentSection:
    """``alignment``: the hidden-state agreement tests (perf_tests/test_alignment.py,
    test_engine_alignment.py). A profile without the section gets these defaults."""

    dtypes: tuple[str, ...] = _f(ALIGNMENT_DTYPES, f"dtypes the reference engine is compared in, of "
                                                   f"{list(ALIGNMENT_DTYPES)}")
    prompts: int = _f(3, "MT-bench prompts whose hidden states are compared")
    max_new_tokens: int = _f(24, "tokens generated per prompt (their positions are compared too)")
    margin: float = _f(5.0, "threshold = noise floor widened this many times (> 0)")
    min_gap: float = _f(1e-6, "smallest cosine distance a threshold allows below 1")
    norm_tol_min: float = _f(0.01, "smallest norm-ratio tolerance")
    engines: tuple[str, ...] = _f(("reference",), "engines whose serving-path hidden states are compared with "
                                                  "transformers at the drafter's aux layers")
    engine_noise_factor: float = _f(ENGINE_NOISE_FACTOR, "how much wider than the reference engine's noise floor "
                                                         "another engine's distance from transformers may be (>= 1)")


def parse_alignment(raw: Any, engines: Mapping[str, Any]) -> AlignmentSection:
    """The ``alignment`` section, validated; the defaults for a profile without one."""
    d = AlignmentSection()
    if raw is None:
        return d
    raw = _object(raw, "alignment")
    _known_keys(raw, AlignmentSection, "alignment")
    dt = raw.get("dtypes", list(d.dtypes))
    if not isinstance(dt, list) or not dt or any(x not in ALIGNMENT_DTYPES for x in dt):
        raise SectionError("alignment.dtypes", f"{dt!r}", f"a non-empty list of {list(ALIGNMENT_DTYPES)}")
    return AlignmentSection(
        dtypes=tuple(dt),
        prompts=_number(raw, "prompts", "alignment", 1, d.prompts, integer=True),
        max_new_tokens=_number(raw, "max_new_tokens", "alignment", 1, d.max_new_tokens, integer=True),
        margin=_number(raw, "margin", "alignment", 0, d.margin, strict=True),
        min_gap=_number(raw, "min_gap", "alignment", 0, d.min_gap),
        norm_tol_min=_number(raw, "norm_tol_min", "alignment", 0, d.norm_tol_min),
        engines=_engine_list(raw["engines"], "alignment.engines", engines) if "engines" in raw else d.engines,
        engine_noise_factor=_number(raw, "engine_noise_factor", "alignment", 1, d.engine_noise_factor))


# -- nccl ------------------------------------------------------------------------------------------------

@dataclass(frozen=True)
class NcclSection:
    """``nccl``: the engine-level NCCL preset A/B (perf_tests/test_engine_presets.py). Validated like
    every other section: a typo such as ``"min_ration"`` would otherwise fall back to the default
    silently and gate on a threshold nobody chose."""

    presets: tuple[str, ...] = _f((), "NCCL presets compared (kimi_perf.engines.presets), the reference first; "
                                      ">= 2, required")
    engine: str | None = _f(None, "the engine served with each preset", default_doc="the first selected engine")
    concurrency: tuple[int, ...] = _f((1,), "concurrencies the throughput is compared at")
    # 0: the test asserted no ratio when the key was left out (its own default); validation had assumed 1.0
    min_ratio: float = _f(0.0, "each other preset's minimum median throughput ratio over the reference (0: only "
                               "the baseline gate)")

    @property
    def reference(self) -> str:
        return self.presets[0]


def parse_nccl(raw: Any, engines: Mapping[str, Any]) -> NcclSection | None:
    if raw is None or (isinstance(raw, Mapping) and not raw):
        return None
    raw = _object(raw, "nccl")
    _known_keys(raw, NcclSection, "nccl")
    eng = raw.get("engine")
    if eng is not None and eng not in engines:
        raise SectionError("nccl.engine", f"{eng!r} is not an engine of the profile", f"one of {sorted(engines)}")
    conc = raw.get("concurrency", list(NcclSection.concurrency))
    if not isinstance(conc, list) or not conc or not all(isinstance(c, int) and not isinstance(c, bool)
                                                         and 1 <= c <= 4096 for c in conc):
        raise SectionError("nccl.concurrency", f"{conc!r}", "a list of concurrencies in [1, 4096], e.g. [1, 128]")
    mr = raw.get("min_ratio", NcclSection.min_ratio)
    if isinstance(mr, bool) or not isinstance(mr, (int, float)) or not 0 <= mr < 10:
        raise SectionError("nccl.min_ratio", f"{mr!r}", "the preferred preset's minimum throughput ratio, e.g. 1.0")
    return NcclSection(presets=_presets(raw.get("presets", []), "nccl.presets"), engine=eng,
                       concurrency=tuple(conc), min_ratio=float(mr))


# -- allreduce -------------------------------------------------------------------------------------------

_SPEC = AllReduceSpec()  # the message sizes' defaults are AllReduceSpec's, not repeated here


@dataclass(frozen=True)
class AllReduceSection:
    """``allreduce``: the all-reduce micro-benchmark (kimi_perf.nccl, perf_tests/test_allreduce.py). The
    message fields are :class:`kimi_perf.nccl.AllReduceSpec`'s; the backend is always NCCL there."""

    tokens: tuple[int, ...] = _f(_SPEC.tokens, "message sizes in tokens (x hidden elements each)")
    hidden: int = _f(_SPEC.hidden, "hidden size: elements per token")
    dtype: str = _f(_SPEC.dtype, "element dtype: bfloat16, float16 or float32")
    iters: int = _f(_SPEC.iters, "timed all-reduces per size")
    warmup: int = _f(_SPEC.warmup, "untimed all-reduces per size first")
    world_size: int | None = _f(None, "ranks (one per GPU)", default_doc="every visible GPU")
    presets: tuple[str, ...] = _f(("default", "seed-pcie-tuned"), "NCCL presets compared, the reference first")
    preferred: str | None = _f(None, "the preset expected to win", default_doc="presets[1]")
    min_ratio: float = _f(0.0, "the preferred preset's minimum bus-bandwidth ratio over the reference")
    timeout_s: float = _f(600.0, "seconds one benchmark run may take")

    @property
    def preferred_preset(self) -> str:
        return self.preferred or self.presets[1]

    def spec(self, world_size: int, backend: str = "nccl") -> AllReduceSpec:
        return AllReduceSpec(tokens=self.tokens, hidden=self.hidden, dtype=self.dtype, iters=self.iters,
                             warmup=self.warmup, world_size=world_size, backend=backend)


def parse_allreduce(raw: Any) -> AllReduceSection | None:
    if raw is None or (isinstance(raw, Mapping) and not raw):
        return None
    raw = _object(raw, "allreduce")
    _known_keys(raw, AllReduceSection, "allreduce")
    d = AllReduceSection()
    ws = raw.get("world_size")
    if ws is not None and (isinstance(ws, bool) or not isinstance(ws, int) or ws < 2):
        raise SectionError("allreduce.world_size", f"{ws!r}", "an integer >= 2 (an all-reduce needs two ranks), or "
                           "leave it out for every visible GPU")
    for k in ("hidden", "iters", "warmup"):
        _number(raw, k, "allreduce", 0, None, integer=True)
    tokens = raw.get("tokens", list(d.tokens))
    if not isinstance(tokens, list) or not all(isinstance(t, int) and not isinstance(t, bool) for t in tokens):
        raise SectionError("allreduce.tokens", f"{tokens!r}", "a list of integers >= 1, e.g. [1, 8, 32, 128]")
    sec = {k: raw[k] for k in ("hidden", "dtype", "iters", "warmup") if k in raw}
    try:
        # world_size is checked against the visible GPUs at run time; 2 only validates the rest here
        AllReduceSpec.from_dict({**sec, "tokens": tokens, "world_size": 2})
    except (TypeError, ValueError) as ex:
        raise SectionError("allreduce", str(ex), "see kimi_perf.nccl.AllReduceSpec for the fields") from None
    presets = _presets(raw.get("presets", list(d.presets)), "allreduce.presets")
    pref = raw.get("preferred", presets[1])
    if pref not in presets[1:]:
        raise SectionError("allreduce.preferred", f"{pref!r} is not one of the compared presets after the "
                           "reference", f"one of {list(presets[1:])}")
    return AllReduceSection(tokens=tuple(tokens), **sec, world_size=ws, presets=presets, preferred=pref,
                            min_ratio=_number(raw, "min_ratio", "allreduce", 0, d.min_ratio),
                            timeout_s=_number(raw, "timeout_s", "allreduce", 0, d.timeout_s, strict=True))
