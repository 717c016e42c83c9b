"""Baseline keys from a profile: the one place the tests (at run time) and the reachability check (in
``tests/test_keys.py``) get the workload part of a key from.

Why: a stored baseline whose key the run never builds is a gate that never fires, silently: the run
finds no baseline and reports NEW. That happened: ``baselines/llama-3.1-8b-1xh100.json`` was keyed
``mtbench-heldout-80x256-k3`` after the profile's ``eagle3.eval.prompts: 80``, while the run keyed it by
the prompts it actually had, the 25 of the stable MT-bench held-out split. Both sides now call
:func:`scenario_workload`, the run checks that it got the prompts the profile asks for
(``kimi_perf/suite/drafters.py``), and :func:`unreachable` says for any stored key why the profile can never
build it.

What is exact and what is a pattern: the throughput scenarios (``single_stream``, ``throughput_sweep``,
``batching_gain``, ``decode_floor``) and the EAGLE-3 ones (``eagle3_acceptance``, ``eagle3_speedup``,
``eagle3_planted_offset``) and the extraction-path matrix cells (``eagle3_matrix``) are determined by the profile alone and are checked exactly. The alignment
scenarios' workloads name layers that come from the model's config and the drafter at run time
(``perf_tests/test_alignment.py``, ``perf_tests/test_engine_alignment.py``), so for them only the
shape, the dtype and the engine are checked against the profile. A scenario this module does not know
is unreachable by definition: whoever stores a baseline for a new scenario adds it here.

Nothing here imports torch or an engine.
"""

from __future__ import annotations

import re

from .baselines import BaselineKey
from .load.workload import Workload
from .profiles import Profile, ThroughputSpec
from .sections import ALIGNMENT_DTYPES, Eagle3Section

__all__ = ["EAGLE3_CODE", "EAGLE3_SCENARIOS", "ENDPOINT_ACCEPTANCE", "THROUGHPUT_SCENARIOS", "eagle3_code_workload", "eagle3_eval", "eagle3_workload",
           "endpoint_acceptance_workload", "matrix_workload", "scenario_workload",
           "prefix_workload", "prefix_workloads", "slo_workload", "throughput_workload", "unreachable"]

# scenario -> which workload of the throughput section it runs (single stream or the sweep at C)
THROUGHPUT_SCENARIOS = {"single_stream": "single", "decode_floor": "single",
                        "throughput_sweep": "sweep", "batching_gain": "sweep"}
EAGLE3_SCENARIOS = frozenset({"eagle3_acceptance", "eagle3_speedup", "eagle3_planted_offset"})
# --perf-url: the acceptance of whatever drafter the existing endpoint serves (its counters), on MT-bench
ENDPOINT_ACCEPTANCE = "eagle3_endpoint_acceptance"
# the session drafter's acceptance on HumanEval code prompts (eagle3.eval.code_prompts), reported
EAGLE3_CODE = "eagle3_acceptance_code"


def eagle3_eval(eagle3: Eagle3Section) -> tuple[int, int, int]:
    """(held-out prompts, max new tokens, draft steps) of an ``eagle3`` section (its defaults are
    kimi_perf.sections', the ones the drafter fixture runs with)."""
    return eagle3.eval.prompts, eagle3.eval.max_new_tokens, eagle3.steps


def _served(eagle3: Eagle3Section, served: bool) -> str:
    # the rows of eagle3.serve's bundle: keyed apart from the recipe drafter's, which CI trains and gates
    # under the plain key (one key holds one baseline entry, and each run would overwrite the other's)
    return f"@{eagle3.serve_tag}" if served else ""


def eagle3_workload(profile: Profile, *, served: bool = False) -> str:
    """The workload key of the EAGLE-3 acceptance/speedup tests: the profile's held-out prompt count,
    output length and draft steps. The prompt count is the configured one; the drafter fixture fails a
    run that gets fewer prompts than configured, so the key never claims prompts that were not run.
    ``served``: the session serves ``eagle3.serve``'s bundle (the key ends ``@DATA_DIGEST``)."""
    if not profile.eagle3:
        raise ValueError(f"profile {profile.name} has no eagle3 section, so no EAGLE-3 workload")
    n, max_new, steps = eagle3_eval(profile.eagle3)
    return f"mtbench-heldout-{n}x{max_new}-k{steps}" + _served(profile.eagle3, served)


def eagle3_code_workload(profile: Profile, *, served: bool = False) -> str:
    """The workload key of the code-prompt acceptance report: ``eagle3.eval.code_prompts`` HumanEval
    tasks (task order), output length and draft steps (``served`` as in :func:`eagle3_workload`)."""
    if not profile.eagle3:
        raise ValueError(f"profile {profile.name} has no eagle3 section, so no EAGLE-3 workload")
    _, max_new, steps = eagle3_eval(profile.eagle3)
    return f"humaneval-{profile.eagle3.eval.code_prompts}x{max_new}-k{steps}" + _served(profile.eagle3, served)


def endpoint_acceptance_workload(profile: Profile) -> str:
    """The workload key of the --perf-url acceptance test: ``eagle3.eval.prompts`` MT-bench questions
    (seeded order, not the drafter's held-out split: the endpoint's drafter is not the suite's) of
    ``eagle3.eval.max_new_tokens`` each; the draft steps are the endpoint's, so not in the key."""
    if not profile.eagle3:
        raise ValueError(f"profile {profile.name} has no eagle3 section, so no endpoint acceptance workload")
    n, max_new, _ = eagle3_eval(profile.eagle3)
    return f"mtbench-{n}x{max_new}-endpoint"


def matrix_workload(profile: Profile, row: str) -> str:
    """The workload key of one extraction-path matrix cell: the EAGLE-3 workload and the row (the
    extraction path; the serving engine is the key's engine)."""
    return f"{eagle3_workload(profile)}:{row}"


def throughput_workload(tp: ThroughputSpec, scenario: str, concurrency: int) -> str:
    """The workload key of a throughput scenario at ``concurrency``."""
    which = THROUGHPUT_SCENARIOS.get(scenario)
    if which is None:
        raise ValueError(f"{scenario!r} is not a throughput scenario ({', '.join(THROUGHPUT_SCENARIOS)})")
    if which == "single":
        return tp.single_stream.key
    return tp.sweep_workload(concurrency).key


def slo_workload(tp: ThroughputSpec) -> str:
    """The workload key of the SLO rate sweep (``slo_knee``): the sweep's workload at its first rate
    plus a digest of the objectives and rates, so a changed objective is a new baseline."""
    import hashlib
    import json
    from dataclasses import asdict

    if tp.slo is None:
        raise ValueError("the throughput section has no slo, so no slo_knee workload")
    digest = hashlib.sha256(json.dumps(asdict(tp.slo), sort_keys=True).encode()).hexdigest()[:8]
    return f"{tp.slo.workload(tp.workload, tp.slo.rates[0]).key}-{digest}"


def prefix_workloads(tp: ThroughputSpec, concurrency: int) -> tuple[Workload, Workload]:
    """(unrelated, shared-prefix) workloads of the prefix-cache test at ``concurrency`` (the sweep's
    top level): at least 512 input tokens, at most 16 new ones, 3/4 of the input shared."""
    from dataclasses import replace

    # at least 512 input tokens: the prefill a cache saves must outweigh queueing, or the ratio
    # measures nothing (vLLM-CPU at 128 tokens with 96 shared: 0.99)
    w = replace(tp.sweep_workload(concurrency), name=f"{tp.workload.name}-prefix",
                output_len=min(16, tp.workload.output_len), input_len=max(512, tp.workload.input_len))
    return w, replace(w, dataset="shared-prefix", prefix_len=w.input_len * 3 // 4)


def prefix_workload(tp: ThroughputSpec, concurrency: int) -> str:
    """The workload key of the prefix-cache test (``prefix_cache``): its shared-prefix workload."""
    return prefix_workloads(tp, concurrency)[1].key


def scenario_workload(profile: Profile, scenario: str, concurrency: int = 1) -> str:
    """The workload key ``scenario`` runs at ``concurrency`` under ``profile`` (throughput and EAGLE-3
    scenarios; the tests build their keys with this)."""
    if scenario in THROUGHPUT_SCENARIOS:
        if profile.throughput is None:
            raise ValueError(f"profile {profile.name} has no throughput section, so no {scenario} workload")
        return throughput_workload(profile.throughput, scenario, concurrency)
    if scenario in EAGLE3_SCENARIOS:
        return eagle3_workload(profile)
    if scenario == ENDPOINT_ACCEPTANCE:
        return endpoint_acceptance_workload(profile)
    if scenario == EAGLE3_CODE:
        return eagle3_code_workload(profile)
    if scenario == "prefix_cache":
        if profile.throughput is None:
            raise ValueError(f"profile {profile.name} has no throughput section, so no prefix_cache workload")
        return prefix_workload(profile.throughput, concurrency)
    if scenario == "slo_knee":
        if profile.throughput is None:
            raise ValueError(f"profile {profile.name} has no throughput section, so no slo_knee workload")
        return slo_workload(profile.throughput)
    raise ValueError(f"no workload rule for scenario {scenario!r}: add it to kimi_perf/keys.py")


def _hardware_problem(profile: Profile, hardware: str) -> str | None:
    pinned = profile.hardware_match.get("key") if profile.hardware_match else None
    if pinned is not None:
        # a machine that matches the profile gets the pinned key; any other gets a detected key, whose
        # baselines would belong to another machine, not to this profile
        return None if hardware == pinned else f"hardware {hardware!r} is not the profile's pinned {pinned!r}"
    prefix = "gpu-" if profile.hardware == "cuda" else "cpu-"
    return None if hardware.startswith(prefix) else f"hardware {hardware!r} is not a {profile.hardware} key"


_LAYER = r"layer-(\d+|final)"


def _alignment_problem(profile: Profile, key: BaselineKey) -> str | None:
    engines, dtypes = profile.alignment.engines, profile.alignment.dtypes
    s, w = key.scenario, key.workload
    if key.concurrency != 1:
        return f"alignment runs at concurrency 1, not {key.concurrency}"
    if s in ("alignment_hf_vs_inference", "alignment_noise_floor"):
        m = re.fullmatch(rf"(\w+):{_LAYER}", w)
        if key.engine != "reference":
            return f"{s} runs on the reference engine, not {key.engine!r}"
        if m is None or m.group(1) not in dtypes:
            return f"workload {w!r} is not DTYPE:layer-N with DTYPE one of alignment.dtypes {list(dtypes)}"
        return None
    if s == "alignment_fp32_vs_bf16":
        return None if (key.engine, w) == ("reference", "hf-fp32:inference-bf16") else \
            f"{s} is keyed reference / hf-fp32:inference-bf16, not {key.engine} / {w}"
    if s == "alignment_stored_vs_inference":
        if not profile.eagle3:
            return f"{s} needs the profile's eagle3 section (it reads the drafter's stored features)"
        return None if (key.engine, w) == ("reference", "bfloat16:eagle3-layers") else \
            f"{s} is keyed reference / bfloat16:eagle3-layers, not {key.engine} / {w}"
    if s == "alignment_engine_vs_hf":
        m = re.fullmatch(rf"(\w+):[\w-]+:{_LAYER}", w)
        if key.engine not in engines:
            return f"engine {key.engine!r} is not in alignment.engines {list(engines)}"
        if m is None or m.group(1) not in ALIGNMENT_DTYPES:
            return f"workload {w!r} is not DTYPE:CAPTURE:layer-N"
        return None
    if s == "alignment_sglang_planted_offset":
        # test_sglang_planted_layer_offset_is_named: SGLang engines of alignment.engines, two captures
        m = re.fullmatch(rf"(\w+):(planted-rule-applied|planted-as-drafter-reads):{_LAYER}", w)
        if key.engine not in engines or profile.engines.get(key.engine, {}).get("kind") != "sglang":
            return f"{s} runs on the SGLang engines of alignment.engines {list(engines)}, not {key.engine!r}"
        if m is None or m.group(1) not in ALIGNMENT_DTYPES:
            return f"workload {w!r} is not DTYPE:planted-rule-applied|planted-as-drafter-reads:layer-N"
        return None
    return f"scenario {s!r} has no rule in kimi_perf/keys.py"


def _matrix_problem(profile: Profile, key: BaselineKey) -> str | None:
    """perf_tests/test_matrix.py: one key per cell, workload EAGLE3_WORKLOAD:ROW, engine = serving engine;
    the retraining-noise keys likewise, ROW being the engine's own-features row."""
    from .eagle3.matrix import own_row

    plan = profile.eagle3.matrix if profile.eagle3 else None
    if plan is None:
        return "the profile has no eagle3.matrix section"
    if key.concurrency != 1:
        return f"{key.scenario} runs at concurrency 1, not {key.concurrency}"
    # test_matrix_retrain_noise: one key per engine of the full matrix, its own-features row
    retrain = key.scenario == "eagle3_matrix_retrain"
    engines = set(plan.engines) if retrain else {*plan.engines, *plan.ci_engines}
    if key.engine not in engines:
        return f"engine {key.engine!r} is not a column of eagle3.matrix ({sorted(engines)})"
    rows = ({own_row(str(profile.engines[key.engine].get("kind")))} if retrain
            else {r.name for r in (*plan.rows, *plan.ci_rows)})
    prefix = eagle3_workload(profile) + ":"
    if not key.workload.startswith(prefix) or key.workload[len(prefix):] not in rows:
        return f"workload {key.workload!r} is not {prefix}ROW with ROW one of eagle3.matrix rows {sorted(rows)}"
    return None


def unreachable(profile: Profile, key: BaselineKey) -> str | None:
    """Why no run of ``profile`` can build ``key`` (None: some run can). Model and hardware are those
    the profile runs with (``--perf-model`` aside); the engine must be one the scenario runs on."""
    if key.model != profile.model.name:
        return f"model {key.model!r} is not the profile's {profile.model.name!r}"
    hw = _hardware_problem(profile, key.hardware)
    if hw is not None:
        return hw
    s = key.scenario
    if s in THROUGHPUT_SCENARIOS:
        tp = profile.throughput
        if tp is None:
            return f"the profile has no throughput section, so no {s}"
        if key.engine not in profile.engines:
            return f"engine {key.engine!r} is not one of the profile's {list(profile.engines)}"
        allowed = {"single_stream": (1,), "decode_floor": (1,), "throughput_sweep": tp.concurrency,
                   "batching_gain": (tp.batching_gain[0],) if tp.batching_gain else ()}[s]
        if key.concurrency not in allowed:
            return f"{s} runs at concurrency {list(allowed)}, not {key.concurrency}"
        if s == "decode_floor" and tp.min_floor_ratio is None:
            return "decode_floor runs only with throughput.min_floor_ratio set"
        want = throughput_workload(tp, s, key.concurrency)
        return None if key.workload == want else f"workload {key.workload!r}: the profile's {s} runs {want!r}"
    if s in EAGLE3_SCENARIOS or s in (ENDPOINT_ACCEPTANCE, EAGLE3_CODE):
        if not profile.eagle3:
            return f"the profile has no eagle3 section, so no {s}"
        if s == EAGLE3_CODE and not profile.eagle3.eval.code_prompts:
            return "eagle3.eval.code_prompts is 0, so no code-prompt acceptance"
        # an endpoint (--perf-url) is measured as any of the profile's engines
        engines = tuple(profile.engines) if s == ENDPOINT_ACCEPTANCE else profile.eagle3.engines
        if s == "eagle3_acceptance" and "vllm" in profile.engines:
            # test_acceptance_in_vllm serves the same drafter on vllm when eagle3.engines leaves it out
            engines = (*engines, "vllm")
        if s == "eagle3_planted_offset":
            # the planted SGLang layer offset runs on the profile's SGLang engines; the one-layer-off
            # serving of test_layer_mismatch_collapses_acceptance_and_is_named on the engine named reference
            engines = tuple(n for n, e in profile.engines.items()
                            if e.get("kind") == "sglang" or (n == "reference" and e.get("kind") == "reference"))
        if key.engine not in engines:
            return f"engine {key.engine!r} does not run {s} under this profile (engines {list(engines)})"
        if key.concurrency != 1:
            return f"{s} runs at concurrency 1, not {key.concurrency}"
        want = scenario_workload(profile, s)
        want_any: tuple[str, ...]
        if s in EAGLE3_SCENARIOS and profile.eagle3.serve:  # eagle3.serve's rows, or the recipe's (CI)
            want_any = (want, eagle3_workload(profile, served=True))
        elif s == EAGLE3_CODE and profile.eagle3.serve:
            want_any = (want, eagle3_code_workload(profile, served=True))
        else:
            want_any = (want,)
        return None if key.workload in want_any else (f"workload {key.workload!r}: the profile's {s} runs "
                                                       f"{' or '.join(map(repr, want_any))}")
    if s == "prefix_cache":
        tp = profile.throughput
        if tp is None:
            return "the profile has no throughput section, so no prefix_cache"
        if profile.engines.get(key.engine, {}).get("kind") not in ("vllm", "sglang"):
            return f"prefix_cache runs on vLLM and SGLang engines, not {key.engine!r}"
        if key.concurrency != max(tp.concurrency):
            return f"prefix_cache runs at the sweep's top concurrency {max(tp.concurrency)}, not {key.concurrency}"
        want = prefix_workload(tp, key.concurrency)
        return None if key.workload == want else f"workload {key.workload!r}: the profile's prefix_cache runs {want!r}"
    if s == "slo_knee":
        tp = profile.throughput
        if tp is None or tp.slo is None:
            return "slo_knee runs only with throughput.slo set"
        if key.engine not in profile.engines:
            return f"engine {key.engine!r} is not one of the profile's {list(profile.engines)}"
        if key.concurrency != tp.slo.max_concurrency:
            return f"slo_knee is keyed at slo.max_concurrency {tp.slo.max_concurrency}, not {key.concurrency}"
        want = slo_workload(tp)
        return None if key.workload == want else f"workload {key.workload!r}: the profile's slo_knee runs {want!r}"
    if s in ("eagle3_matrix", "eagle3_matrix_retrain"):
        return _matrix_problem(profile, key)
    if s.startswith("alignment_"):
        return _alignment_problem(profile, key)
    return f"scenario {s!r} has no rule in kimi_perf/keys.py (add one before storing its baselines)"
