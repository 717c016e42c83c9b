"""The profile format as data: a JSON Schema and a reference page generated from the typed sections.

Why generated: the format used to live only in the parser and its error messages (``name`` must equal
the file name, defaults only in code, engine knobs found by trial). Here every key of a profile is
described once, from the classes the parser builds: the typed sections' ``metadata={"doc": ...}``
(:mod:`kimi_perf.sections`), and, for the classes whose docs are comments (the A/B policy, the SLO sweep,
workloads, engine settings), the one-line docs in this module next to the class they describe. From that
come ``kimi_perf/profile.schema.json`` (shipped in the package; editors and ``check-jsonschema`` validate
a profile with it) and ``docs/profiles.md``. A test regenerates both and fails when they differ from the
committed files, and another fails when a class gains a field that has no doc here.

``python -m kimi_perf.profiles check FILE...`` loads profiles with the real parser (whose errors point at
``docs/profiles.md``), ``schema`` / ``docs`` print the generated files, ``new`` scaffolds a profile from a
model directory.
"""

from __future__ import annotations

import dataclasses
import json
import re
from collections.abc import Mapping
from typing import Any

__all__ = ["DOCS_PATH", "SCHEMA_NAME", "engine_docs", "json_default", "markdown", "scaffold", "schema", "top_level"]

SCHEMA_NAME = "profile.schema.json"
DOCS_PATH = "docs/profiles.md"

# -- docs for classes whose fields carry no metadata ------------------------------------------------------

TOP: dict[str, str] = {
    "name": "the profile's name; must equal the file name without .json (baselines/<name>.json is keyed by it)",
    "description": "one line: what this profile measures, on what",
    "hardware": "\"cpu\" or \"cuda\": which machines the profile is for (a cuda profile fails without a GPU under CI)",
    "min_gpus": "GPUs the profile needs (default 0 on cpu, 1 on cuda)",
    "model": "the target model: embedded (SmolLM2 from its PyPI wheel), a local path, or a dummy shape",
    "engines": "engine name -> settings; \"kind\" picks reference, vllm or sglang, the other keys are that engine's settings",
    "default_engines": "engines measured when --perf-engine is not given (default: the first engine)",
    "repeats": "measured repeats per point (3 on CPU, 5 on GPU is typical); --perf-repeats overrides it",
    "throughput": "single-stream decode, the concurrency sweep, batching gain and the SLO sweep",
    "gate": "stored-baseline gate tolerances: floor, noise multiplier, alpha, per-metric floors",
    "eagle3": "EAGLE-3 drafter recipe, held-out evaluation, acceptance gates and the extraction-path matrix",
    "alignment": "hidden-state alignment: dtypes, engines, prompts and tolerances",
    "nccl": "NCCL preset comparison on multi-GPU profiles",
    "allreduce": "all-reduce micro-benchmark on multi-GPU profiles",
    "sources": "key -> where a number or choice in this profile comes from (free text, reviewed like code)",
    "hardware_match": "pin the baseline hardware key when the GPUs match: {gpu_name_contains, count, key}",
    "ab": "how the same-run A/B gate (--perf-ab) is run and decided on this profile's machine",
    "variants": "named bases for --perf-ab NAME: engine settings, env, drafter, engine or interpreter that differ",
}

MODEL = {
    "source": "\"embedded\", \"path\" (with path) or \"dummy\" (with shape)",
    "name": "model name used in baseline keys (default: the shape, or \"model\")",
    "path": "source path: the local checkpoint directory (--perf-model overrides it)",
    "shape": "source dummy: a named shape of random weights (config + tokenizer only)",
}

THROUGHPUT = {
    "workload": "the sweep's workload: dataset, input_len, output_len, num_prompts, warmup, seed, ... (see workload)",
    "concurrency": "concurrency levels of the sweep",
    "prompts_per_concurrency": "requests per repeat at concurrency C: max(num_prompts, this x C)",
    "single_stream": "overrides of the workload for the single-stream (C=1) test",
    "gated_single": "metrics the single-stream test gates",
    "gated_sweep": "metrics the sweep gates at each concurrency",
    "batching_gain": "{concurrency: C, min_ratio: R}: output tok/s at C must be at least R x that at C=1",
    "min_floor_ratio": "GPU profiles: minimum single-stream decode speed as a fraction of the memory-bandwidth floor",
    "slo": "latency objectives and the request-rate sweep that finds the knee (pytest -m traffic)",
}

GATE = {
    "floor": "smallest relative change that can FAIL (0.10 = 10%)",
    "noise_mult": "a FAIL must also exceed this many times the measured noise",
    "alpha": "significance level of the one-sided Mann-Whitney test that must agree",
    "floors": "metric -> its own floor (e.g. TTFT moves more than decode speed)",
}

WORKLOAD = {
    "dataset": "\"random\" token ids (exact input length), \"shared-prefix\", \"mtbench\", \"sharegpt\" text, or "
               "\"sharegpt-multiturn\" (ShareGPT V3 turns with their history)",
    "input_len": "prompt tokens: exact for random prompts, a cap for text",
    "output_len": "tokens generated per request (max_tokens; with ignore_eos, exact)",
    "num_prompts": "requests per repeat",
    "concurrency": "requests in flight at most",
    "warmup": "unmeasured requests before the first repeat",
    "seed": "prompt and arrival seed",
    "ignore_eos": "generate output_len tokens whatever the model says (pins the work per request)",
    "temperature": "sampling temperature (0 = greedy)",
    "request_timeout_s": "client-side timeout per request",
    "request_rate": "open-loop arrivals per second; \"inf\" = closed loop",
    "burstiness": "gamma shape of the arrival gaps (1 = Poisson), vLLM's --burstiness",
    "prefix_len": "dataset shared-prefix: ids every prompt of a repeat shares at its start",
    "output_len_range_ratio": "r: each request's max_tokens drawn from [output_len(1-r), output_len(1+r)] "
                              "(vLLM's --random-range-ratio, outputs only; 0 = fixed); staggers the ends of a "
                              "closed-loop batch",
    "api": "\"completions\" (token-id prompts, exact input lengths) or \"chat\" (the prompts decoded to text, one "
           "user message to /v1/chat/completions; random and shared-prefix datasets)",
    "extra": "extra request fields sent with every request",
}

AB = {
    "threshold": "a regression this large must FAIL (default 5% on cpu, 2.5% on cuda)",
    "thresholds": "metric -> its own threshold, for a metric too noisy to decide `threshold` in the job's time "
                  "(choose from a power study: python -m kimi_perf.power --replay-only)",
    "alpha": "family-wise error: each of m gated metrics gets a 1 - alpha/m interval",
    "repeats_per_block": "pairs per block, in ABBA order (odd: the block summary is their median)",
    "repeats": "probe (single_stream, top) -> its own pairs per block (a cheap noisy probe can take more)",
    "min_blocks": "blocks before a verdict may be reached",
    "max_blocks": "block budget; then INCONCLUSIVE",
    "blocks_per_launch": "blocks sharing one launch of each side: 1 every block, k >= 2 ABBA launch rounds, 0 once",
    "max_steal": "redo a pair whose repeats saw more host steal time than this fraction",
    "max_redo": "redone pairs per block before a noisy pair is accepted (and flagged)",
    "time_budget_s": "stop adding blocks after this much wall time (null: no limit)",
    "gated": "probe (single_stream, top) -> metrics decided; the rest are reported",
    "single_stream": "workload overrides for the single-stream probe (short repeats)",
    "top": "workload overrides for the top-concurrency probe",
    "top_concurrency": "concurrency of the top probe (default: the largest of throughput.concurrency)",
    "accept_prompts": "held-out prompts for the accept-length A/B (each prompt is a pair)",
    "pin_cpus": "pin each side's server and the client to disjoint cores",
    "client_cpus": "CPUs given to the client when pinning",
    "parallel_launch": "start both sides' servers at once and warm them up after (launches of tens of seconds)",
    "retire_decided": "stop measuring a probe once all its gated metrics PASSED (its verdicts stand)",
    "top_min_steady_s": "seconds the top probe's steady window must last: one repeat per side after the first "
                        "launch sets num_prompts (grows only, at most 8x; null: ab.top's size)",
    "pair_segments": "k: each pair measured as 2k segments of 1/k the output length, sides in Thue-Morse order "
                     "(2: A B B A), each side the mean of its k (1: one stream a side)",
    "relaunch": "older spelling of blocks_per_launch: true = 1, false = 0",
}

SLO = {
    "ttft_ms": "time-to-first-token objective per request, ms",
    "tpot_ms": "time-per-output-token objective per request, ms",
    "e2el_ms": "end-to-end latency objective per request, ms",
    "min_attainment": "fraction of requests that must meet every objective for a rate to count as served",
    "rates": "request rates swept, increasing (req/s)",
    "burstiness": "gamma shape of the arrivals (1 = Poisson)",
    "num_prompts": "requests per rate and repeat",
    "max_concurrency": "requests in flight at most",
    "dataset": "\"random\" ids or \"sharegpt-multiturn\" conversations replayed turn by turn",
}

VARIANT = {
    "engine": "profile engine this base runs (default: the candidate's engine)",
    "settings": "engine settings that differ from the candidate's",
    "env": "environment variables of the base's server",
    "drafter": "EAGLE-3 checkpoint served by the base (accept-length A/B)",
    "git": "run the reference engine from this repository at another commit",
    "interpreter": "\"candidate\" (the engine's usual environment) or \"cli\" (--perf-ab-python)",
    "description": "what the variant changes, for reports",
}

HARDWARE_MATCH = {"gpu_name_contains": "substring of every GPU's name", "count": "number of GPUs",
                  "key": "hardware key to use when they match"}

# engine settings: the name renders the engine's own flag unless said otherwise
ENGINE_COMMON = {
    "host": "bind address (loopback unless pytest runs with --perf-allow-remote-bind)",
    "served_model_name": "model name the server answers to",
    "extra_args": "more command-line arguments, checked against the engine's own parser in CI",
    "env": "environment variables of the server",
    "ready_timeout_s": "seconds the launch may take to answer its health check",
    "health_path": "readiness endpoint",
}


def engine_docs(cls: type) -> dict[str, str]:
    """One line per profile-settable field of an engine config class (not name, model_path, python,
    source_root or cpus: those come from the run, never from a profile)."""
    out = {}
    for f in dataclasses.fields(cls):
        if f.name in ("name", "model_path", "python", "source_root", "cpus"):
            continue
        if f.name in ENGINE_COMMON:
            out[f.name] = ENGINE_COMMON[f.name]
        elif f.name == "spec":
            out[f.name] = "EAGLE-3 serving: {draft_model_path, steps (3), topk (1)}"
        elif f.name == "nccl_preset":
            out[f.name] = "a named NCCL environment preset (kimi_perf.engines.presets)"
        elif f.name == "version" and cls.__name__ == "SGLangConfig":
            out[f.name] = "the SGLang release the interpreter runs: picks its flag table"
        else:
            out[f.name] = f"--{f.name.replace('_', '-')}" if cls.__name__ != "ReferenceEngineConfig" else \
                f"the reference engine's --{f.name.replace('_', '-')}"
    return out


# -- JSON types from annotations ---------------------------------------------------------------------------

def _json_type(annotation: str) -> dict[str, Any]:
    a = annotation.replace(" ", "")
    nullable = a.endswith("|None") or a.startswith("None|") or a.startswith("Optional[")
    a = re.sub(r"\|None$|^None\||^Optional\[(.*)\]$", r"\1", a)
    base: dict[str, Any]
    if a in ("int",):
        base = {"type": "integer"}
    elif a in ("float",):
        base = {"type": "number"}
    elif a == "bool":
        base = {"type": "boolean"}
    elif a == "str" or a.startswith("Literal["):
        base = {"type": "string"}
    elif a.startswith(("tuple[", "list[", "Sequence[")):
        inner = a[a.index("[") + 1: -1].split(",")[0]
        item = _json_type(inner) if inner not in ("Any", "...") else {}
        base = {"type": "array", **({"items": item} if item else {})}
    elif a.startswith(("Mapping[", "dict[")):
        base = {"type": "object"}
    elif a.startswith("int|float") or a == "float|int":
        base = {"type": "number"}
    else:
        base = {}
    if nullable and base.get("type"):
        base = {**base, "type": [base["type"], "null"]}
    return base


def json_default(f: dataclasses.Field) -> Any:  # type: ignore[type-arg]
    """A dataclass field's default as it appears in JSON (tuples as lists, mappings as dicts, an
    infinite float as "inf", as ``Workload.to_dict`` writes it), or ``dataclasses.MISSING`` when it has
    none or the default is not JSON."""
    if f.default is not dataclasses.MISSING:
        d = f.default
    elif f.default_factory is not dataclasses.MISSING:  # type: ignore[misc]
        d = f.default_factory()  # type: ignore[misc]
    else:
        return dataclasses.MISSING
    if isinstance(d, tuple):
        d = list(d)
    if isinstance(d, Mapping):
        d = dict(d)
    if isinstance(d, float) and d == float("inf"):
        d = "inf"
    try:
        json.dumps(d)
    except TypeError:
        return dataclasses.MISSING
    return d


def _props_from(cls: type, docs: Mapping[str, str], *, extra: Mapping[str, dict[str, Any]] | None = None,
                only: Any = None) -> dict[str, Any]:
    """JSON Schema properties of a dataclass's fields that ``docs`` names (each field must have a doc)."""
    props: dict[str, Any] = {}
    for f in dataclasses.fields(cls):
        if f.name not in docs or (only is not None and f.name not in only):
            continue
        p = {**_json_type(str(f.type)), "description": docs[f.name]}
        d = json_default(f)
        if d is not dataclasses.MISSING:
            p["default"] = d
        props[f.name] = p
    for k, v in (extra or {}).items():
        props[k] = {**props.get(k, {}), **v}
    return props


def _section_props(cls: type) -> dict[str, Any]:
    from .sections import field_docs

    props = {}
    for d in field_docs(cls):
        p = {**_json_type(d["type"]), "description": d["doc"]}
        if d["default"] not in ("(required)", "{}"):
            p["default"] = d["default"]
        props[d["name"]] = p
    return props


def _obj(props: dict[str, Any], description: str, *, additional: bool = False, required: list[str] | None = None) -> dict[str, Any]:
    o: dict[str, Any] = {"type": "object", "description": description, "properties": props,
                         "additionalProperties": additional}
    if required:
        o["required"] = required
    return o


def top_level() -> dict[str, tuple[str, dict[str, Any]]]:
    """Each top-level key: (its doc, its schema)."""
    from .ab.config import ABSpec
    from .engines.base import ReferenceEngineConfig
    from .engines.sglang import SGLangConfig
    from .engines.vllm import VLLMConfig
    from .load.slo import SLOSpec
    from .load.workload import APIS, Workload
    from .sections import AlignmentSection, AllReduceSection, Eagle3Section, NcclSection

    workload = _obj(_props_from(Workload, WORKLOAD, extra={"request_rate": {"type": ["number", "string"]},
                                                            "api": {"enum": list(APIS)}}),
                    "a pinned workload (kimi_perf.load.workload.Workload)")
    engine_variants = []
    for kind, cls in (("reference", ReferenceEngineConfig), ("vllm", VLLMConfig), ("sglang", SGLangConfig)):
        props = {"kind": {"const": kind, "description": f"a {kind} engine"}, **_props_from(cls, engine_docs(cls))}
        engine_variants.append(_obj(props, f"{kind} engine settings ({cls.__module__}.{cls.__name__})",
                                    required=["kind"]))
    ab_props = _props_from(ABSpec, AB)
    ab_props["relaunch"] = {"type": "boolean", "description": AB["relaunch"]}
    ab_props["thresholds"] = {"type": "object", "description": AB["thresholds"],
                              "additionalProperties": {"type": "number", "exclusiveMinimum": 0, "exclusiveMaximum": 1}}
    for k in ("single_stream", "top"):
        ab_props[k] = {"type": "object", "description": AB[k],
                       "properties": {**{w: {"type": "integer", "description": WORKLOAD[w]}
                                         for w in ("num_prompts", "output_len", "input_len", "warmup")},
                                      "output_len_range_ratio": {"type": "number", "minimum": 0, "exclusiveMaximum": 1,
                                                                 "description": WORKLOAD["output_len_range_ratio"]}},
                       "additionalProperties": False}
    return {
        "name": (TOP["name"], {"type": "string"}),
        "description": (TOP["description"], {"type": "string"}),
        "hardware": (TOP["hardware"], {"enum": ["cpu", "cuda"]}),
        "min_gpus": (TOP["min_gpus"], {"type": "integer", "minimum": 0}),
        "model": (TOP["model"], _obj({k: {"type": "string", "description": v} for k, v in MODEL.items()}, TOP["model"],
                                     required=["source"])),
        "engines": (TOP["engines"], {"type": "object", "minProperties": 1, "additionalProperties": {"oneOf": engine_variants}}),
        "default_engines": (TOP["default_engines"], {"type": "array", "items": {"type": "string"}}),
        "repeats": (TOP["repeats"], {"type": "integer", "minimum": 1, "default": 3}),
        "throughput": (TOP["throughput"], _obj({
            "workload": {**workload, "description": THROUGHPUT["workload"]},
            "concurrency": {"type": "array", "items": {"type": "integer", "minimum": 1}, "default": [1],
                            "description": THROUGHPUT["concurrency"]},
            "prompts_per_concurrency": {"type": "integer", "minimum": 1, "default": 2,
                                        "description": THROUGHPUT["prompts_per_concurrency"]},
            "single_stream": {"type": "object", "description": THROUGHPUT["single_stream"]},
            "gated_single": {"type": "array", "items": {"type": "string"}, "default": ["decode_tok_s", "ttft_ms_p50"],
                             "description": THROUGHPUT["gated_single"]},
            "gated_sweep": {"type": "array", "items": {"type": "string"}, "default": ["output_throughput", "tpot_ms_p50"],
                            "description": THROUGHPUT["gated_sweep"]},
            "batching_gain": {"type": "object", "description": THROUGHPUT["batching_gain"],
                              "properties": {"concurrency": {"type": "integer", "description": "the concurrency C"},
                                             "min_ratio": {"type": "number", "description": "the minimum ratio R"}},
                              "required": ["concurrency", "min_ratio"], "additionalProperties": False},
            "min_floor_ratio": {"type": "number", "description": THROUGHPUT["min_floor_ratio"]},
            "slo": _obj(_props_from(SLOSpec, SLO), THROUGHPUT["slo"]),
        }, TOP["throughput"])),
        "gate": (TOP["gate"], _obj({"floor": {"type": "number", "default": 0.10, "description": GATE["floor"]},
                                    "noise_mult": {"type": "number", "default": 3.0, "description": GATE["noise_mult"]},
                                    "alpha": {"type": "number", "default": 0.05, "description": GATE["alpha"]},
                                    "floors": {"type": "object", "additionalProperties": {"type": "number"},
                                               "description": GATE["floors"]}}, TOP["gate"])),
        "eagle3": (TOP["eagle3"], _obj(_section_props(Eagle3Section), TOP["eagle3"])),
        "alignment": (TOP["alignment"], _obj(_section_props(AlignmentSection), TOP["alignment"])),
        "nccl": (TOP["nccl"], _obj(_section_props(NcclSection), TOP["nccl"])),
        "allreduce": (TOP["allreduce"], _obj(_section_props(AllReduceSection), TOP["allreduce"])),
        "sources": (TOP["sources"], {"type": "object", "additionalProperties": {"type": "string"}}),
        "hardware_match": (TOP["hardware_match"], _obj({k: {"description": v, **({"type": "integer"} if k == "count"
                                                                                 else {"type": "string"})}
                                                        for k, v in HARDWARE_MATCH.items()}, TOP["hardware_match"])),
        "ab": (TOP["ab"], _obj(ab_props, TOP["ab"])),
        "variants": (TOP["variants"], {"type": "object", "additionalProperties": _obj(
            {k: {"description": v, **({"type": "object"} if k in ("settings", "env") else {"type": "string"})}
             for k, v in VARIANT.items()}, "a named A/B base")}),
    }


def schema() -> dict[str, Any]:
    """The profile JSON Schema (draft 2020-12), as JSON data (tuples become lists)."""
    top = top_level()
    return json.loads(json.dumps({"$schema": "https://json-schema.org/draft/2020-12/schema", "$id": "kimi-perf/profile.schema.json",
            "title": "kimi-perf profile", "description": "A kimi-perf profile: what to measure, where, and how to "
            "gate it. Generated by python -m kimi_perf.profiles schema from the parser's classes; docs/profiles.md "
            "is the same in prose.", "type": "object",
            "properties": {k: {**s, "description": d} for k, (d, s) in top.items()},
            "required": ["name", "hardware", "model", "engines"], "additionalProperties": False}))


def _rows(props: Mapping[str, Any], prefix: str = "") -> list[str]:
    rows = []
    for k, p in props.items():
        t = p.get("type") or ("enum " + "/".join(map(str, p["enum"])) if "enum" in p else
                              ("const " + str(p["const"]) if "const" in p else "object"))
        t = "/".join(t) if isinstance(t, list) else t
        d = json.dumps(p["default"]) if "default" in p else ""
        rows.append(f"| `{prefix}{k}` | {t} | {d.replace('|', '/')} | {p.get('description', '').replace('|', '/')} |")
        if p.get("type") == "object" and p.get("properties") and k not in ("engines",):
            rows += _rows(p["properties"], f"{prefix}{k}.")
    return rows


def markdown() -> str:
    """docs/profiles.md."""
    s = schema()
    lines = ["# Profile reference", "",
             "<!-- generated by `python -m kimi_perf.profiles docs`: edit kimi_perf/profile_schema.py or "
             "kimi_perf/sections.py, not this file -->", "",
             "A profile is a JSON file under `profiles/` (or any path given to `--perf-profile`) that says what to "
             "measure, on which machine, and how to gate it. Every key, its type, its default and what it does is "
             "below; the same content as a JSON Schema ships in the package as `kimi_perf/profile.schema.json` "
             "(point an editor or `check-jsonschema --schemafile` at it). `python -m kimi_perf.profiles check FILE` "
             "loads a profile with the suite's own parser; `python -m kimi_perf.profiles new --model DIR --name N` "
             "writes a starting profile for a model directory.", "",
             "## Top level", "", "| key | type | default | what it is |", "|---|---|---|---|"]
    for k, p in s["properties"].items():
        t = p.get("type") or ("enum " + "/".join(p["enum"]) if "enum" in p else "object")
        lines.append(f"| `{k}` | {t} | {json.dumps(p['default']) if 'default' in p else ''} | {p['description']} |")
    for k, p in s["properties"].items():
        if k == "engines":
            lines += ["", "## engines", "", "Each engine is an object whose `kind` picks its settings:"]
            for v in p["additionalProperties"]["oneOf"]:
                lines += ["", f"### {v['description']}", "", "| key | type | default | what it is |", "|---|---|---|---|"]
                lines += _rows(v["properties"])
        elif p.get("properties"):
            lines += ["", f"## {k}", "", p["description"], "", "| key | type | default | what it is |", "|---|---|---|---|"]
            lines += _rows(p["properties"])
    return "\n".join(lines) + "\n"


# -- command line ------------------------------------------------------------------------------------------

def scaffold(model_dir: str, name: str, *, hardware: str = "cpu", engine: str = "reference") -> dict[str, Any]:
    """A starting profile for a local model directory: its engine, a random-token throughput workload,
    the default gates, and sources that say which numbers still need measuring."""
    from pathlib import Path

    cfg_path = Path(model_dir).expanduser() / "config.json"
    if not cfg_path.is_file():
        raise SystemExit(f"new: {model_dir} has no config.json: point --model at a transformers model directory")
    cfg = json.loads(cfg_path.read_text())
    eng: dict[str, Any] = {"kind": engine, "dtype": "bfloat16"}
    if engine == "reference":
        eng["device"] = "cuda" if hardware == "cuda" else "cpu"
    return {
        "name": name,
        "description": f"{cfg.get('architectures', ['model'])[0]} from {model_dir} served by {engine} on {hardware}",
        "hardware": hardware,
        "model": {"source": "path", "path": str(Path(model_dir).expanduser()), "name": name + "-model"},
        "engines": {engine: eng},
        "repeats": 3 if hardware == "cpu" else 5,
        "throughput": {"workload": {"dataset": "random", "input_len": 128, "output_len": 64, "num_prompts": 4,
                                    "warmup": 1, "seed": 0, "ignore_eos": True, "temperature": 0.0},
                       "concurrency": [1, 4, 8] if hardware == "cpu" else [1, 8, 32, 128]},
        "gate": {"floor": 0.10, "noise_mult": 3.0, "alpha": 0.05},
        "sources": {"scaffold": "written by python -m kimi_perf.profiles new: the workload sizes and gate floors "
                                "are starting values; measure this machine's noise (pytest -m ab --perf-ab same) "
                                "and record baselines (--perf-update-baselines) before gating on them"},
    }
