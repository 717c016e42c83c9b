"""The EAGLE-3 drafter of a session (train-or-load once), the configs of the servers that use it,
and the per-engine plain-vs-speculative A/B that several test modules read; the ``eagle3_drafter``
and ``eagle3_runs`` fixtures (fixtures/drafters.py) hand them out.

:func:`session_drafter` serves the drafter shipped with kimi-perf when its manifest says the profile's recipe
built it on this target (kimi_perf.eagle3.shipped: a fresh machine need not spend ~8.5 CPU minutes
retraining it); otherwise, or with ``--perf-train-drafter`` (CI), it builds the recipe through the cached
pipeline (regenerate -> vocab -> features -> train -> export), keyed by (target fingerprint, data config,
feature spec, train config), so a second session reuses it and a changed recipe retrains only what changed.
``--perf-drafter PATH`` serves an existing checkpoint, or a shipped bundle's folder, instead (its held-out
prompts then come from the stable MT-bench split).

Why the A/B lives here (``eagle3_runs``) and not in one test module: an SGLang launch costs ~1.5 min and
a vLLM one ~3 min on the H200, so the servers the A/B starts are also what the alignment tests read
(SGLang returns the drafter's aux layers only while serving it, sglang 0.5.17 having no capture-only aux
mode) and what the planted-offset test compares against. :func:`eagle3_server_configs` is the one
place those configs are built, so every user asks the ServerPool for the *same* config.

Missing pieces (an engine's environment, a drafter) skip with the reason and the fix, but fail under
``CI=true`` or when the profile was named with ``--perf-profile`` (:func:`missing`): a run that asked for
an engine must not come back green with nothing measured.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any, NoReturn

import numpy as np
import pytest

from kimi_perf.missing import missing as _missing
from kimi_perf.missing import strict_reason
from kimi_perf.progress import log
from kimi_perf.sections import Eagle3Section
from kimi_perf.session import Eagle3Settings

from .models import TargetModel
from .servers import ServerPool, engine_config, require_engine_python


@dataclass(frozen=True)
class DrafterHandle:
    path: Path
    steps: int
    eval_prompts: tuple[tuple[int, ...], ...]
    feature_dir: Path | None
    heldout_ids: tuple[str, ...]
    report: dict[str, Any]
    # HumanEval prompts (eagle3.eval.code_prompts) whose served acceptance is reported next to MT-bench's,
    # or why there are none (the data is not fetched): only the code-prompt test skips for that
    code_prompts: tuple[tuple[int, ...], ...] = ()
    code_missing: str = ""
    # what baselines call this drafter (kimi_perf.eagle3.shipped.drafter_identity): a baseline measured
    # with another one is not compared (PerfGate.check's measured_with)
    identity: str = ""
    # the profile's eagle3.serve bundle is served: its rows are keyed apart (kimi_perf.keys.eagle3_workload)
    served: bool = False


def _eagle_section(s: Eagle3Settings) -> Eagle3Section:
    """The profile's eagle3 section (validated when the profile loaded), or a skip without one."""
    if s.eagle3 is None:
        pytest.skip(f"profile {s.servers.profile_name} has no eagle3 section")
    return s.eagle3


def strict_missing(s: Eagle3Settings) -> str | None:
    """Why a missing piece fails instead of skipping in this session (None: it skips)."""
    return strict_reason(s.servers.policy)


def missing(s: Eagle3Settings, reason: str, *, engine_kind: str | None = None) -> NoReturn:
    """:func:`kimi_perf.missing.missing` for this session: skip with the fix, or fail under ``CI=true``
    or an explicitly named profile."""
    _missing(s.servers.policy, reason, engine_kind=engine_kind)


def require_engine(s: Eagle3Settings, name: str) -> str:
    """The engine's kind, after checking its environment is there (:func:`missing` otherwise)."""
    raw = s.servers.engines.get(name)
    if raw is None:
        raise pytest.UsageError(f"profile {s.servers.profile_path} defines no engine {name!r} (engines: "
                                f"{', '.join(s.servers.engines)})")
    kind = str(raw["kind"])
    require_engine_python(s.servers, name, kind)
    return kind


def session_drafter(s: Eagle3Settings, target: TargetModel, pool: ServerPool) -> DrafterHandle:
    """The profile's EAGLE-3 drafter: loaded from --perf-drafter, served from the shipped bundle, or
    trained (cached) on this target; what the ``eagle3_drafter`` session fixture hands out."""
    from transformers import AutoTokenizer

    e = _eagle_section(s)
    if target.source == "dummy":
        pytest.skip("EAGLE-3 needs real target weights (the profile's model is --load-format dummy)")
    steps, n_eval = e.steps, e.eval.prompts
    tok = AutoTokenizer.from_pretrained(str(target.path))
    given, what, served = s.drafter_path, "--perf-drafter", False
    if not given and e.serve and not s.train_drafter:
        # the profile serves a shipped bundle (built by another recipe, e.g. on a GPU) exactly as
        # --perf-drafter would; --perf-train-drafter keeps CI training and gating the profile's own recipe
        from kimi_perf.eagle3.shipped import SHIPPED_ROOT

        given, what, served = str(SHIPPED_ROOT / e.serve), "eagle3.serve", True
        log(f"drafter: serving eagle3.serve {e.serve}; --perf-train-drafter trains the recipe's drafter instead")
    if given:
        from kimi_perf.eagle3.shipped import (
            ShippedDrafterError,
            bundle_at,
            drafter_identity,
            identity_of_checkpoint,
            served_path,
        )

        # resolved (and its files hashed) once here: the path served, the identity and the served
        # features below all read this bundle
        try:  # a shipped bundle (its weights stored compressed) is written out once and served from there
            bundle = bundle_at(Path(given))
            p = served_path(bundle) if bundle is not None else Path(given)
        except ShippedDrafterError as ex:
            raise pytest.UsageError(f"{what} {given}: {ex}") from None
        identity = drafter_identity(bundle.manifest["recipe_key"]) if bundle is not None else identity_of_checkpoint(p)
        if p != Path(given):
            log(f"drafter: serving the shipped bundle {given}, written out into {p}")
        cfg = p / "config.json"
        if not cfg.is_file() or "LlamaForCausalLMEagle3" not in json.loads(cfg.read_text()).get("architectures", []):
            raise pytest.UsageError(f"{what} {p}: not an EAGLE-3 checkpoint (config.json with "
                                    "architectures [LlamaForCausalLMEagle3])")
        prompts = heldout_mtbench_prompts(tok, n_eval)
        _check_prompt_count(s, len(prompts), n_eval, "the stable MT-bench held-out split")
        feature_dir, heldout_ids = _served_features(bundle, target) if served and bundle is not None else (None, ())
        return DrafterHandle(p, steps, prompts, feature_dir, heldout_ids, {"source": str(p)}, *code_prompts(s, tok),
                             identity=identity, served=served)
    from kimi_perf.eagle3.pipeline import build_drafter, heldout_prompts

    if e.recipe is None:
        missing(s, f"profile {s.servers.profile_name} has no eagle3.recipe to train a drafter: pass "
                "--perf-drafter PATH (an EAGLE-3 checkpoint, e.g. one the embedded-cpu recipe trained)")
    try:
        recipe = e.drafter_recipe()
    except (TypeError, ValueError) as ex:
        raise pytest.UsageError(f"profile {s.servers.profile_path}: eagle3.recipe: {ex}") from None
    log(f"eagle3: drafter recipe data {recipe.data.digest()}, features {recipe.features.digest()}, "
        f"train {recipe.train.digest()}")
    from kimi_perf.eagle3.shipped import (
        ShippedDrafterError,
        compare_with_shipped,
        drafter_identity,
        find_shipped,
        install,
        recipe_key,
    )

    art = None
    try:
        bundle, why = find_shipped(recipe, target.fingerprint)
    except ShippedDrafterError as ex:
        if not s.train_drafter:
            pytest.fail(str(ex), pytrace=False)
        bundle, why = None, f"the shipped drafter is unusable ({ex})"
    if not s.train_drafter:
        if bundle is not None:
            log(f"drafter: serving the {why}; --perf-train-drafter trains the recipe instead")
            art = install(bundle, recipe, target.path, target.fingerprint)
        else:
            log(f"drafter: {why}: training the recipe")
    if art is None:
        from kimi_perf.eagle3.data import build_items

        try:
            build_items(recipe.data)  # the recipe's prompt sources are on disk (setup fetches them)
        except FileNotFoundError as ex:
            missing(s, f"the drafter recipe's prompt data is missing: {ex}")
        generator_name(s, recipe.data)  # a misnamed generator is a usage error now, not after minutes
        # the generation server starts only if samples are missing (a cached drafter, or a lease that
        # carried every sample, needs none): so its environment (--perf-sglang-python) is asked for then too
        gen: list[Any] = []

        def gen_url() -> str:
            if not gen:
                gen.append(generator_config(s, recipe.data, target))
            return str(pool.get(gen[0]).base_url)

        art = build_drafter(recipe, target.path, target.fingerprint, gen_url=gen_url, tokenizer=tok)
        if gen:
            pool.stop(gen[0])
        if bundle is not None:
            cmp = compare_with_shipped(bundle, art.path)
            log(f"drafter: the trained drafter is {'byte-identical to' if cmp['identical'] else 'not identical to'} "
                f"the {why} ({', '.join(f'{k} {v}' for k, v in cmp.items() if k.endswith(('.json', '.safetensors')))})")
            art = replace(art, report={**art.report, "shipped_comparison": cmp})
    held_out = heldout_prompts(art.samples_path, art.heldout_ids)[:n_eval]
    if not held_out:
        pytest.skip("no held-out MT-bench prompts were generated for evaluation")
    _check_prompt_count(s, len(held_out), n_eval, "the recipe's held-out samples")
    return DrafterHandle(art.path, steps, tuple(tuple(p) for p in held_out), art.feature_dir, art.heldout_ids,
                         art.report, *code_prompts(s, tok), identity=drafter_identity(recipe_key(recipe)))


def code_prompts(s: Eagle3Settings, tokenizer: Any) -> tuple[tuple[tuple[int, ...], ...], str]:
    """The first ``eagle3.eval.code_prompts`` HumanEval tasks as chat prompts, in task order, and ""; or
    no prompts and why (the data is not fetched: its fetch command).

    Why HumanEval for every drafter, trained here or passed with --perf-drafter: it is evaluation-only
    in every recipe (kimi_perf.eagle3.data.EVAL_ONLY_SOURCES), so no drafter trained by the suite saw
    it, and the chat template is the one the recipe's own held-out samples get, so the prompts are the
    same ids either way. Missing data is not the drafter's problem: the MT-bench tests run, and the
    code-prompt test skips with the reason (fails under ``CI=true`` or a named profile)."""
    n = _eagle_section(s).eval.code_prompts
    if n == 0:
        return (), ""
    from kimi_perf.data import chat_prompt_ids, load_humaneval

    try:
        tasks = load_humaneval()
    except FileNotFoundError as e:
        return (), f"eagle3.eval.code_prompts is {n}: {e}"
    if len(tasks) < n:
        raise pytest.UsageError(f"profile {s.servers.profile_path}: eagle3.eval.code_prompts is {n} but HumanEval has "
                                f"{len(tasks)} tasks; set it to {len(tasks)} or fewer")
    return tuple(tuple(chat_prompt_ids(tokenizer, [t.turns[0]])) for t in tasks[:n]), ""


def generator_name(s: Eagle3Settings, data: Any) -> str:
    """``eagle3.recipe.data.generator``, checked to be an engine of the profile (UsageError naming them)."""
    name = str(data.generator)
    if name not in s.servers.engines:
        raise pytest.UsageError(f"profile {s.servers.profile_path}: eagle3.recipe.data.generator {name!r} is not an "
                                f"engine of the profile (engines: {', '.join(s.servers.engines)})")
    return name


def generator_config(s: Eagle3Settings, data: Any, target: TargetModel) -> Any:
    """The server that regenerates the recipe's responses (``eagle3.recipe.data.generator``, default the
    reference engine), launched with :meth:`~kimi_perf.eagle3.data.DataConfig.generator_overrides`."""
    name = generator_name(s, data)
    try:
        over = data.generator_overrides(require_engine(s, name))
    except ValueError as e:
        raise pytest.UsageError(f"profile {s.servers.profile_path}: eagle3.recipe.data.{e}") from None
    return engine_config(s.servers, name, target, **over)


def heldout_mtbench_prompts(tok: Any, n: int) -> tuple[tuple[int, ...], ...]:
    """The first ``n`` held-out MT-bench first turns, chat templated: what a drafter passed with
    --perf-drafter or served as a bundle is measured on.

    The held-out fraction is the one a recipe without its own data config uses (one default,
    DataConfig's), and the order is the one a recipe's drafter is served its held-out prompts in
    (:func:`kimi_perf.eagle3.pipeline.heldout_prompts`: the sample ids sorted, ``<conversation id>-t1``),
    so one drafter is measured on the same prompts whichever way it is served. Per prompt acceptance
    varies widely: the 47K drafter's chain walk predicts 2.077 on the recipe's first 8 prompts x 64
    tokens and 1.837 on the first 8 in MT-bench's own order, which this path used to take."""
    from kimi_perf.data import chat_prompt_ids, load_mtbench, stable_split
    from kimi_perf.eagle3.data import DataConfig

    held = sorted((c for c in load_mtbench() if stable_split(c.id, DataConfig.held_out_fraction) == "heldout"),
                  key=lambda c: f"{c.id}-t1")
    return tuple(tuple(chat_prompt_ids(tok, [c.turns[0]])) for c in held[:n])


def _served_features(bundle: Any, target: TargetModel, n: int = 4) -> tuple[Path | None, tuple[str, ...]]:
    """Training-style features of the first ``n`` held-out samples an ``eagle3.serve`` bundle carries, made
    the way its recipe made them (backend, layers, dtype) on this machine's device, so the stored-features
    and layer-offset tests check the served drafter as they check a trained one. ``bundle``: the
    verified :class:`~kimi_perf.eagle3.shipped.ShippedDrafter` the caller resolved (a foreign
    ``--perf-drafter`` checkpoint names no recipe: the caller passes none, and those tests skip)."""

    from kimi_perf.eagle3.features import FeatureStore
    from kimi_perf.eagle3.shipped import bundle_recipe, install

    try:
        recipe = bundle_recipe(bundle)
    except (KeyError, TypeError, ValueError) as ex:  # a bundle of an older recipe format: served, not checked
        log(f"drafter: {bundle.name}'s manifest recipe does not load here ({ex}): no features to compare")
        return None, ()
    art = install(bundle, recipe, target.path, target.fingerprint, heldout_features=n)
    return art.feature_dir, tuple(FeatureStore(art.feature_dir).sample_ids)


def _check_prompt_count(s: Eagle3Settings, have: int, want: int, where: str) -> None:
    """The EAGLE-3 baseline key names ``eagle3.eval.prompts`` (kimi_perf.keys.eagle3_workload, the key
    the stored baselines are checked against); a run with fewer prompts would file its numbers under a
    workload it did not run, so it fails and says how to make the profile honest."""
    if have != want:
        pytest.fail(f"profile {s.servers.profile_path}: eagle3.eval.prompts is {want} but {where} has {have} prompts, "
                    f"so the baseline key would name prompts that were not run. Fix: set eagle3.eval.prompts to "
                    f"{have} (and re-key its stored eagle3 baselines)", pytrace=False)


def spec_engine_config(s: Eagle3Settings, target: TargetModel, drafter_path: Path, steps: int, *,
                       engine: str = "reference", **overrides: Any) -> Any:
    from kimi_perf.engines.base import SpecConfig

    return engine_config(s.servers, engine, target, spec=SpecConfig(draft_model_path=str(drafter_path), steps=steps),
                         **overrides)


def eval_settings(s: Eagle3Settings) -> tuple[int, float, float]:
    """(max new tokens, minimum speedup, minimum accept length) of ``eagle3.eval``."""
    e = _eagle_section(s).eval
    return e.max_new_tokens, e.min_speedup, e.min_accept_length


def serves_alignment(s: Eagle3Settings, engine: str) -> bool:
    """Whether ``engine``'s EAGLE-3 servers also answer ``return_hidden_states`` for the alignment
    tests: SGLang engines listed in ``alignment.engines`` (sglang 0.5.17 returns a served drafter's aux
    layers only that way, and the plain side must run with the same flags to be a fair no-spec
    baseline; SGLangConfig then adds --disable-radix-cache --chunked-prefill-size -1 to both)."""
    if s.servers.engines[engine]["kind"] != "sglang":
        return False
    return engine in s.alignment_engines


def eagle3_server_configs(s: Eagle3Settings, target: TargetModel, engine: str, drafter_path: Path,
                          steps: int) -> dict[str, Any]:
    """The A/B's {"plain": cfg, "spec": cfg} for ``engine``; every test that needs one of these servers
    builds it here, so the ServerPool hands out the running one instead of launching a twin."""
    kind = s.servers.engines[engine]["kind"]
    over: dict[str, Any] = {}
    if kind == "reference":
        over["max_running_requests"] = 4
    tags: tuple[str | None, str | None] = (None, None)
    if serves_alignment(s, engine):
        over["return_hidden_states"] = True
        tags = ("hs", "spec-hs")
    return {"plain": engine_config(s.servers, engine, target, tag=tags[0], **over),
            "spec": spec_engine_config(s, target, drafter_path, steps, engine=engine, tag=tags[1], **over)}


def planted_sglang_config(s: Eagle3Settings, target: TargetModel, engine: str, drafter_path: Path,
                          steps: int) -> Any:
    """The planted-offset drafter copy served like the A/B's speculative side (same flags)."""
    return spec_engine_config(s, target, drafter_path, steps, engine=engine, tag="spec-planted-hs",
                              return_hidden_states=True)


@dataclass
class ABResult:
    """One engine's plain-vs-speculative A/B: R interleaved repeats per side, same prompts."""

    engine: str
    plain: list[Any] = field(default_factory=list)  # AcceptanceResult per repeat
    spec: list[Any] = field(default_factory=list)
    versions: dict[str, str | None] = field(default_factory=dict)
    configs: dict[str, str] = field(default_factory=dict)  # side -> config name (server log name)
    code: Any = None  # AcceptanceResult of one pass over the drafter's code prompts (eagle3.eval.code_prompts)

    def median_accept_length(self) -> float:
        return float(np.median([r.accept_length for r in self.spec]))


class Eagle3Runs:
    """Per-session, per-engine EAGLE-3 measurements of the session's drafter, each made once."""

    def __init__(self, s: Eagle3Settings, target: TargetModel, pool: ServerPool, drafter: DrafterHandle) -> None:
        self.settings, self.target, self.pool, self.drafter = s, target, pool, drafter
        self._ab: dict[str, ABResult] = {}
        self._failed: dict[str, str] = {}
        self._single: dict[str, Any] = {}

    def configs(self, engine: str) -> dict[str, Any]:
        return eagle3_server_configs(self.settings, self.target, engine, self.drafter.path, self.drafter.steps)

    def cached(self, engine: str) -> ABResult | None:
        return self._ab.get(engine)

    def ab(self, engine: str, *, while_up: Callable[[Mapping[str, Any]], None] | None = None) -> ABResult:
        """Plain and speculative servers, same prompts, interleaved repeats at concurrency 1; both
        servers are stopped afterwards. ``while_up(servers)`` runs after the measured repeats, before
        the stop (the alignment captures of the same servers)."""
        if engine in self._ab:
            return self._ab[engine]
        if engine in self._failed:
            # like a failed session fixture: every later test of this engine reports the first failure
            # instead of relaunching the servers
            pytest.fail(f"the EAGLE-3 A/B on {engine} failed earlier in this session: {self._failed[engine]}",
                        pytrace=False)
        from kimi_perf.eagle3.evaluate import measure_generation

        require_engine(self.settings, engine)
        max_new, _, _ = eval_settings(self.settings)
        prompts = [list(p) for p in self.drafter.eval_prompts]
        cfgs = self.configs(engine)
        out = ABResult(engine, configs={k: c.name for k, c in cfgs.items()})
        try:
            for name, cfg in cfgs.items():
                # one unmeasured pass per server over *every* prompt, a few tokens each: each prompt length
                # is a new eager prefill/extend shape, and first-use costs (kernel selection, allocator
                # growth) otherwise land in repeat 1. On the H200 a 2-prompt warm-up still left repeat 1
                # 15-17% slower for plain decoding and 37% for speculative.
                srv = self.pool.get(cfg)
                measure_generation(srv.base_url, srv.model, prompts, min(max_new, 8), name=f"eagle3-{engine}-{name}-warmup")
            for r in range(self.settings.repeats):
                for name, cfg in cfgs.items():
                    srv = self.pool.get(cfg)
                    out.versions[name] = srv.version
                    res = measure_generation(srv.base_url, srv.model, prompts, max_new, name=f"eagle3-{engine}-{name}")
                    getattr(out, name).append(res)
                    log(f"eagle3 A/B [{engine}] repeat {r + 1}/{self.settings.repeats} {name}: {res.output_tok_s:.1f} tok/s"
                        + (f", accept length {res.accept_length:.2f}" if name == "spec" else ""))
            if self.drafter.code_prompts:
                # acceptance is deterministic under greedy decoding: one pass reads it; the speed of
                # this pass is not compared (no plain side), so one pass is all it costs
                srv = self.pool.get(cfgs["spec"])
                out.code = measure_generation(srv.base_url, srv.model, [list(p) for p in self.drafter.code_prompts],
                                              max_new, name=f"eagle3-{engine}-spec-code")
                log(f"eagle3 [{engine}] code prompts ({len(self.drafter.code_prompts)} HumanEval): accept length "
                    f"{out.code.accept_length:.2f}")
            if while_up is not None:
                while_up({name: self.pool.get(cfg) for name, cfg in cfgs.items()})
        except Exception as e:
            self._failed[engine] = f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"
            raise
        finally:
            for cfg in cfgs.values():
                self.pool.stop(cfg)
        self._ab[engine] = out
        return out

    def accept_length(self, engine: str) -> tuple[Any, str]:
        """The correctly served drafter's acceptance on ``engine``: the A/B's median repeat when the A/B
        ran in this session, else one pass on the A/B's speculative server (reused if running, stopped
        afterwards). Returns (AcceptanceResult, where it came from)."""
        ab = self._ab.get(engine)
        if ab is not None:
            med = ab.median_accept_length()
            best = min(ab.spec, key=lambda r: abs(r.accept_length - med))
            return best, f"median of the {len(ab.spec)} A/B repeats"
        if engine not in self._single:
            require_engine(self.settings, engine)
            self._single[engine] = measure_once(self.settings, self.pool, self.configs(engine)["spec"],
                                                self.drafter.eval_prompts, f"eagle3-{engine}-spec-single")
        return self._single[engine], "one pass (the A/B did not run in this session)"


def measure_once(s: Eagle3Settings, pool: ServerPool, cfg: Any, prompts: Any, name: str, *,
                 exclusive: bool = False) -> Any:
    """One greedy pass of ``prompts`` (``eagle3.eval.max_new_tokens`` each) on ``cfg``'s server, which is
    started if needed and stopped afterwards; the AcceptanceResult."""
    from kimi_perf.eagle3.evaluate import measure_generation

    max_new, _, _ = eval_settings(s)
    srv = pool.get(cfg, exclusive=exclusive)
    try:
        return measure_generation(srv.base_url, srv.model, [list(p) for p in prompts], max_new, name=name)
    finally:
        pool.stop(cfg)


