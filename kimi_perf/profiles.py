"""Profiles: what to measure where, as data files (``profiles/<name>.json``).

Why data and not code: a profile names a deployment (model, hardware, engines with their exact flags
and env, workloads, repeats, gate tolerances). Teams add one per cluster by copying a file, and the
suite never executes anything from it -- values are parsed into frozen dataclasses and validated, and
a mistake is a :class:`ProfileError` naming the file, the key and the fix (``pytest.UsageError`` at
the plugin level).
"""

from __future__ import annotations

import json
import math
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from .ab.config import ABConfigError, ABSpec, Variant, parse_ab, parse_variants
from .load.slo import SLOSpec, parse_slo
from .load.workload import Workload
from .metrics import METRICS
from .models.shapes import DUMMY_SHAPES  # re-exported: profiles name these shapes, callers import them here
from .sections import (
    AlignmentSection,
    AllReduceSection,
    Eagle3Section,
    NcclSection,
    SectionError,
    parse_alignment,
    parse_allreduce,
    parse_eagle3,
    parse_nccl,
)
from .stats import GateConfig

__all__ = ["GateSpec", "ModelSpec", "Profile", "ProfileError", "ThroughputSpec", "find_profile", "load_profile"]

class ProfileError(ValueError):
    pass


@dataclass(frozen=True)
class ModelSpec:
    source: str  # "embedded" | "path" | "dummy"
    name: str
    path: str | None = None
    dummy_shape: str | None = None


@dataclass(frozen=True)
class ThroughputSpec:
    workload: Workload
    concurrency: tuple[int, ...]
    prompts_per_concurrency: int
    single_stream: Workload
    gated_single: tuple[str, ...]
    gated_sweep: tuple[str, ...]
    batching_gain: tuple[int, float] | None = None  # (concurrency C, minimum tok/s ratio C vs 1)
    # GPU profiles: minimum single-stream decode speed as a fraction of the memory-bandwidth floor
    min_floor_ratio: float | None = None
    # latency objectives and the request-rate sweep that finds the knee (kimi_perf.load.slo)
    slo: SLOSpec | None = None

    def sweep_workload(self, c: int) -> Workload:
        return self.workload.with_concurrency(c, num_prompts=max(self.workload.num_prompts, self.prompts_per_concurrency * c))


@dataclass(frozen=True)
class GateSpec:
    default: GateConfig
    floors: Mapping[str, float] = field(default_factory=dict)

    def for_metric(self, name: str) -> GateConfig:
        if name in self.floors:
            return GateConfig(floor=self.floors[name], noise_mult=self.default.noise_mult, alpha=self.default.alpha)
        return self.default


@dataclass(frozen=True)
class Profile:
    name: str
    path: Path
    description: str
    hardware: str  # "cpu" | "cuda"
    min_gpus: int
    model: ModelSpec
    engines: Mapping[str, Mapping[str, Any]]
    default_engines: tuple[str, ...]
    repeats: int
    throughput: ThroughputSpec | None
    gate: GateSpec
    # the typed sections (kimi_perf.sections): None where the profile has none; alignment has defaults
    eagle3: Eagle3Section | None = None
    alignment: AlignmentSection = field(default_factory=AlignmentSection)
    nccl: NcclSection | None = None
    # all-reduce micro-benchmark (kimi_perf.nccl): AllReduceSpec fields plus presets / preferred / min_ratio
    allreduce: AllReduceSection | None = None
    sources: Mapping[str, str] = field(default_factory=dict)
    # pin the baseline hardware key when the detected machine matches (GPU product names vary by SKU
    # and driver: "RTX PRO 6000 Blackwell Server Edition" vs "... Workstation Edition")
    hardware_match: Mapping[str, Any] = field(default_factory=dict)
    # same-run A/B (--perf-ab): how to run and decide it here, and the named bases it can compare against
    ab: ABSpec = field(default_factory=ABSpec)
    variants: Mapping[str, Variant] = field(default_factory=dict)

    def hardware_key(self, detected_key: str, gpus: list[dict[str, str]]) -> str:
        m = self.hardware_match
        if not m:
            return detected_key
        want = str(m.get("gpu_name_contains", "")).lower()
        n = int(m.get("count", len(gpus)))
        if gpus and len(gpus) == n and all(want in g["name"].lower() for g in gpus):
            return str(m["key"])
        return detected_key


_TOP = {"name", "description", "hardware", "min_gpus", "model", "engines", "default_engines", "repeats",
        "throughput", "gate", "eagle3", "alignment", "nccl", "sources", "hardware_match", "allreduce",
        "ab", "variants"}


def _e(path: Path, key: str, problem: str, fix: str) -> ProfileError:
    return ProfileError(f"profile {path}: {key}: {problem}. Fix: {fix}")


# Bounds of every number a profile gives, (low, high) inclusive. Why bounds at all: a value no check
# bounded ran until it failed late or never ended (repeats 10**9, concurrency 10**6), and a bool passed
# as an integer (``true`` is 1 to Python) produced a baseline file the loader then rejected. The highs
# are far above any real deployment, low enough to catch a typo's extra digits.
MAX_CONCURRENCY = 4096
_INT_BOUNDS = {"repeats": (1, 100), "min_gpus": (0, 64), "prompts_per_concurrency": (1, 10_000),
               "concurrency": (1, MAX_CONCURRENCY)}
_WORKLOAD_INT = {"input_len": (1, 1 << 20), "output_len": (1, 1 << 20), "num_prompts": (1, 100_000),
                 "concurrency": (1, MAX_CONCURRENCY), "warmup": (0, 1000), "seed": (0, 2**63 - 1)}
_WORKLOAD_NUM = {"temperature": (0.0, 100.0), "request_timeout_s": (0.001, 86_400.0),
                 "request_rate": (1e-6, math.inf), "output_len_range_ratio": (0.0, 0.99)}


def _int(path: Path, key: str, v: Any, lo: int, hi: int) -> int:
    """``v`` as a bounded integer: a bool is not one (``true`` would count as 1), nor is 12.5."""
    if isinstance(v, bool) or not isinstance(v, int) or not lo <= v <= hi:
        raise _e(path, key, f"{v!r}", f"an integer in [{lo}, {hi}] (not a boolean, not a fraction)")
    return v


def _number(path: Path, key: str, v: Any, lo: float, hi: float) -> float:
    """``v`` as a bounded finite number (``hi`` may be inf: then inf itself is allowed, NaN never)."""
    ok = not isinstance(v, bool) and isinstance(v, (int, float)) and not math.isnan(v) and lo <= v <= hi
    if not ok or (math.isinf(v) and not math.isinf(hi)):
        raise _e(path, key, f"{v!r}", f"a number in [{lo}, {hi}]")
    return float(v)


def _check_workload_fields(path: Path, key: str, raw: Mapping[str, Any]) -> None:
    for f, (lo, hi) in _WORKLOAD_INT.items():
        if f in raw:
            _int(path, f"{key}.{f}", raw[f], lo, hi)
    for f, (flo, fhi) in _WORKLOAD_NUM.items():
        if f in raw and not (f == "request_rate" and raw[f] in ("inf", None)):
            _number(path, f"{key}.{f}", raw[f], flo, fhi)
    if "ignore_eos" in raw and not isinstance(raw["ignore_eos"], bool):
        raise _e(path, f"{key}.ignore_eos", f"{raw['ignore_eos']!r}", "true or false (a JSON boolean)")
    if "dataset" in raw and not isinstance(raw["dataset"], str):
        raise _e(path, f"{key}.dataset", f"{raw['dataset']!r}", '"random", "mtbench" or "sharegpt"')


def _workload(path: Path, key: str, raw: Any, name: str) -> Workload:
    if not isinstance(raw, dict):
        raise _e(path, key, "must be an object of workload fields", "see kimi_perf.load.workload.Workload")
    _check_workload_fields(path, key, raw)
    try:
        return Workload.from_dict({"name": name, **raw})
    except (TypeError, ValueError, AttributeError) as ex:
        raise _e(path, key, str(ex), "see kimi_perf.load.workload.Workload for the fields") from None


def _metrics_list(path: Path, key: str, raw: Any) -> tuple[str, ...]:
    if not isinstance(raw, list) or not all(isinstance(m, str) for m in raw):
        raise _e(path, key, "must be a list of metric names", "e.g. [\"output_throughput\"]")
    for m in raw:
        if m not in METRICS:
            raise _e(path, key, f"unknown metric {m!r}", f"use one of: {', '.join(sorted(METRICS))}")
    return tuple(raw)


def load_profile(path: Path) -> Profile:
    """Parse and validate a profile file; every problem is a :class:`ProfileError` naming file and key."""
    try:
        return _load_profile(path)
    except ProfileError as ex:
        raise ProfileError(f"{ex} {REFERENCE_HINT}") from None
    except (TypeError, ValueError, AttributeError, KeyError) as ex:
        # a value of a type no check above anticipated: still the file's fault, still named
        raise ProfileError(f"profile {path}: malformed value ({type(ex).__name__}: {ex}). "
                           f"Fix: compare with profiles/embedded-cpu.json {REFERENCE_HINT}") from None


# every error of a profile names where the whole format is described (generated from the parser)
REFERENCE_HINT = "(every key, its type and default: docs/profiles.md; python -m kimi_perf.profiles check FILE)"


def _load_profile(path: Path) -> Profile:
    try:
        raw = json.loads(Path(path).read_text())
    except FileNotFoundError:
        raise ProfileError(f"profile file {path} does not exist") from None
    except json.JSONDecodeError as ex:
        raise ProfileError(f"profile {path}: not valid JSON (line {ex.lineno} col {ex.colno}: {ex.msg})") from None
    if not isinstance(raw, dict):
        raise _e(path, "top level", "must be a JSON object", "see profiles/embedded-cpu.json")
    unknown = set(raw) - _TOP
    if unknown:
        raise _e(path, "top level", f"unknown key(s) {sorted(unknown)}", f"allowed keys: {sorted(_TOP)}")
    name = raw.get("name")
    if name != Path(path).stem:
        raise _e(path, "name", f"is {name!r} but the file is {Path(path).name}", f'set "name": "{Path(path).stem}"')
    hw = raw.get("hardware", "cpu")
    if hw not in ("cpu", "cuda"):
        raise _e(path, "hardware", f"{hw!r}", 'use "cpu" or "cuda"')
    min_gpus = _int(path, "min_gpus", raw.get("min_gpus", 0 if hw == "cpu" else 1), *_INT_BOUNDS["min_gpus"])
    m = raw.get("model")
    if not isinstance(m, dict) or m.get("source") not in ("embedded", "path", "dummy"):
        got = m.get("source") if isinstance(m, dict) else m
        raise _e(path, "model.source", f"{got!r}", 'use "embedded", "path" (with "path") or "dummy" (with "shape")')
    if m["source"] == "path" and not isinstance(m.get("path"), str):
        raise _e(path, "model.path", "missing", "give the checkpoint directory, or override with --perf-model")
    if m["source"] == "dummy" and (not isinstance(m.get("shape"), str) or m["shape"] not in DUMMY_SHAPES):
        raise _e(path, "model.shape", f"{m.get('shape')!r}", f"one of {sorted(DUMMY_SHAPES)}")
    model = ModelSpec(source=m["source"], name=str(m.get("name") or m.get("shape") or "model"),
                      path=m.get("path"), dummy_shape=m.get("shape"))
    engines = raw.get("engines")
    if not isinstance(engines, dict) or not engines:
        raise _e(path, "engines", "missing or empty", 'map engine name -> {"kind": "reference"|"vllm"|"sglang", ...}')
    for en, ec in engines.items():
        if not isinstance(ec, dict) or ec.get("kind") not in ("reference", "vllm", "sglang"):
            got = ec.get("kind") if isinstance(ec, dict) else ec
            raise _e(path, f"engines.{en}.kind", f"{got!r}", 'use "reference", "vllm" or "sglang"')
    default = raw.get("default_engines", [next(iter(engines))])
    if not isinstance(default, list) or not all(isinstance(d, str) and d in engines for d in default):
        raise _e(path, "default_engines", f"{default!r} names an engine not under 'engines'", f"choose from {sorted(engines)}")
    repeats = _int(path, "repeats", raw.get("repeats", 3), *_INT_BOUNDS["repeats"])
    tp = None
    if "throughput" in raw:
        t = raw["throughput"]
        if not isinstance(t, dict):
            raise _e(path, "throughput", "must be an object", "see profiles/embedded-cpu.json")
        bad = set(t) - {"workload", "concurrency", "prompts_per_concurrency", "single_stream", "gated_single",
                        "gated_sweep", "batching_gain", "min_floor_ratio", "slo"}
        if bad:
            raise _e(path, "throughput", f"unknown key(s) {sorted(bad)}", "see profiles/embedded-cpu.json")
        conc = t.get("concurrency", [1])
        if not isinstance(conc, list) or not conc:
            raise _e(path, "throughput.concurrency", f"{conc!r}", "a list of integers >= 1, e.g. [1, 4, 8]")
        for i, c in enumerate(conc):
            _int(path, f"throughput.concurrency[{i}]", c, *_INT_BOUNDS["concurrency"])
        wl = _workload(path, "throughput.workload", t.get("workload", {}), "random")
        ss_over = t.get("single_stream", {})
        if not isinstance(ss_over, dict):
            raise _e(path, "throughput.single_stream", "must be an object of workload fields", "e.g. {\"num_prompts\": 3}")
        base = {k: v for k, v in wl.to_dict().items() if k != "name"}
        ss = _workload(path, "throughput.single_stream", {**base, **ss_over, "concurrency": 1}, wl.name + "-single")
        ppc = _int(path, "throughput.prompts_per_concurrency", t.get("prompts_per_concurrency", 2),
                   *_INT_BOUNDS["prompts_per_concurrency"])
        bg = t.get("batching_gain")
        if bg is not None and (not isinstance(bg, dict) or set(bg) != {"concurrency", "min_ratio"}
                               or isinstance(bg["concurrency"], bool) or bg["concurrency"] not in conc
                               or isinstance(bg["min_ratio"], bool) or not isinstance(bg["min_ratio"], (int, float))
                               or not 0 < bg["min_ratio"] <= 1000):
            raise _e(path, "throughput.batching_gain", f"{bg!r}",
                     '{"concurrency": C, "min_ratio": R} with C one of throughput.concurrency')
        mfr = t.get("min_floor_ratio")
        if mfr is not None and (isinstance(mfr, bool) or not isinstance(mfr, (int, float)) or not 0 < mfr <= 1):
            raise _e(path, "throughput.min_floor_ratio", f"{mfr!r}",
                     "a fraction in (0, 1]: decode tok/s over the bandwidth floor, e.g. 0.5")
        slo = None
        if t.get("slo") is not None:
            try:
                slo = parse_slo(t["slo"])
            except ValueError as ex:
                raise _e(path, "throughput.slo", str(ex).removeprefix("throughput.slo: "),
                         "see kimi_perf/load/slo.py (SLOSpec) and profiles/embedded-cpu.json") from None
        tp = ThroughputSpec(
            workload=wl, concurrency=tuple(conc), prompts_per_concurrency=ppc,
            single_stream=ss,
            gated_single=_metrics_list(path, "throughput.gated_single", t.get("gated_single", ["decode_tok_s", "ttft_ms_p50"])),
            gated_sweep=_metrics_list(path, "throughput.gated_sweep", t.get("gated_sweep", ["output_throughput", "tpot_ms_p50"])),
            batching_gain=(int(bg["concurrency"]), float(bg["min_ratio"])) if bg else None,
            min_floor_ratio=float(mfr) if mfr is not None else None, slo=slo,
        )
    g = raw.get("gate", {})
    if not isinstance(g, dict):
        raise _e(path, "gate", f"must be an object, got {g!r}", '{"floor": 0.1, "noise_mult": 3, "alpha": 0.05}')
    if set(g) - {"floor", "noise_mult", "alpha", "floors"}:
        raise _e(path, "gate", f"unknown key(s) {sorted(set(g) - {'floor', 'noise_mult', 'alpha', 'floors'})}",
                 "allowed: floor, noise_mult, alpha, floors")
    nums = {k: g.get(k, d) for k, d in (("floor", 0.10), ("noise_mult", 3.0), ("alpha", 0.05))}
    for k, v in nums.items():
        if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v):
            raise _e(path, f"gate.{k}", f"must be a number, got {v!r}", "floor is a fraction (0.10 = 10%)")
    try:
        gcfg = GateConfig(floor=float(nums["floor"]), noise_mult=float(nums["noise_mult"]), alpha=float(nums["alpha"]))
    except ValueError as ex:
        raise _e(path, "gate", str(ex), "floor is a fraction (0.10 = 10%)") from None
    floors = g.get("floors", {})
    if not isinstance(floors, dict):
        raise _e(path, "gate.floors", f"must be an object, got {floors!r}", '{"metric_name": 0.15}')
    for k, v in floors.items():
        if k not in METRICS:
            raise _e(path, f"gate.floors.{k}", "unknown metric", f"use one of: {', '.join(sorted(METRICS))}")
        if isinstance(v, bool) or not isinstance(v, (int, float)) or not 0 <= v < 10:
            raise _e(path, f"gate.floors.{k}", f"must be a fraction, got {v!r}", "e.g. 0.15 for 15%")
    hm = raw.get("hardware_match", {})
    if hm and (not isinstance(hm, dict) or set(hm) - {"gpu_name_contains", "count", "key"} or "key" not in hm):
        raise _e(path, "hardware_match", f"{hm!r}", '{"gpu_name_contains": "H200", "count": 1, "key": "gpu-h200-x1"}')
    if hm and "count" in hm:
        _int(path, "hardware_match.count", hm["count"], 1, 64)
    for section in ("eagle3", "alignment", "nccl", "sources", "allreduce"):
        if section in raw and not isinstance(raw[section], dict):
            raise _e(path, section, "must be an object", "see profiles/embedded-cpu.json")
    try:
        # each section parsed once, here: the tests read the typed result (kimi_perf.sections)
        eagle3 = parse_eagle3(raw.get("eagle3"), engines)
        alignment = parse_alignment(raw.get("alignment"), engines)
        nccl = parse_nccl(raw.get("nccl"), engines)
        allreduce = parse_allreduce(raw.get("allreduce"))
    except SectionError as ex:
        raise _e(path, ex.key, ex.problem, ex.fix) from None
    for section in ("ab", "variants"):
        if section in raw and not isinstance(raw[section], dict):
            raise _e(path, section, "must be an object", "see profiles/embedded-cpu.json")
    try:
        ab = parse_ab(raw.get("ab"), hardware=hw)
    except ABConfigError as ex:
        raise _e(path, "ab", str(ex), "see docs/ab-gate.md") from None
    try:
        variants = parse_variants(raw.get("variants"), engines)
    except ABConfigError as ex:
        raise _e(path, "variants", str(ex), "see docs/ab-gate.md") from None
    return Profile(
        name=name, path=Path(path), description=str(raw.get("description", "")), hardware=hw, min_gpus=min_gpus,
        model=model, engines=engines, default_engines=tuple(default), repeats=repeats, throughput=tp,
        gate=GateSpec(gcfg, {k: float(v) for k, v in floors.items()}), eagle3=eagle3,
        alignment=alignment, nccl=nccl, sources=raw.get("sources", {}),
        hardware_match=hm, allreduce=allreduce, ab=ab, variants=variants,
    )


def find_profile(name_or_path: str, roots: list[Path]) -> Path:
    p = Path(name_or_path)
    if p.suffix == ".json" or "/" in name_or_path:
        if not p.is_file():
            raise ProfileError(f"--perf-profile {name_or_path}: no such file")
        return p
    for root in roots:
        cand = root / f"{name_or_path}.json"
        if cand.is_file():
            return cand
    known = sorted({f.stem for r in roots if r.is_dir() for f in r.glob("*.json")})
    raise ProfileError(f"unknown profile {name_or_path!r}; known profiles: {', '.join(known) or '(none)'} "
                       f"(looked in {', '.join(str(r) for r in roots)})")


def main(argv: list[str] | None = None) -> int:
    """``python -m kimi_perf.profiles check FILE... | schema | docs | new --model DIR --name N``: load
    profiles with this parser, print the generated schema or reference page, scaffold a profile."""
    import argparse
    import sys

    from .profile_schema import markdown, scaffold, schema

    ap = argparse.ArgumentParser(prog="python -m kimi_perf.profiles", description="Check, describe or scaffold "
                                 "kimi-perf profiles (the format: docs/profiles.md).")
    sub = ap.add_subparsers(dest="verb", required=True)
    c = sub.add_parser("check", help="load each FILE with the suite's parser; exit 1 on the first bad one")
    c.add_argument("files", nargs="+")
    sub.add_parser("schema", help="print the profile JSON Schema (kimi_perf/profile.schema.json)")
    sub.add_parser("docs", help="print the profile reference (docs/profiles.md)")
    n = sub.add_parser("new", help="write a starting profile for a model directory")
    n.add_argument("--model", required=True, help="transformers model directory (config.json, tokenizer)")
    n.add_argument("--name", required=True, help="profile name (also the file name)")
    n.add_argument("--hardware", choices=("cpu", "cuda"), default="cpu")
    n.add_argument("--engine", choices=("reference", "vllm", "sglang"), default="reference")
    n.add_argument("--out", default=None, help="where to write it (default profiles/NAME.json)")
    ns = ap.parse_args(argv)
    if ns.verb == "schema":
        sys.stdout.write(json.dumps(schema(), indent=2) + "\n")
        return 0
    if ns.verb == "docs":
        sys.stdout.write(markdown())
        return 0
    if ns.verb == "check":
        for f in ns.files:
            try:
                p = load_profile(Path(f))
            except ProfileError as e:
                print(f"FAIL {f}: {e}", file=sys.stderr)
                return 1
            print(f"ok   {f}: profile {p.name} ({p.hardware}), engines {', '.join(p.engines)}")
        return 0
    out = Path(ns.out or f"profiles/{ns.name}.json")
    if out.exists():
        raise SystemExit(f"new: {out} exists; pick another --name or --out")
    if out.stem != ns.name:
        raise SystemExit(f"new: the file must be named after the profile: {ns.name}.json, not {out.name}")
    doc = scaffold(ns.model, ns.name, hardware=ns.hardware, engine=ns.engine)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(doc, indent=2) + "\n")
    try:
        load_profile(out)
    except ProfileError as e:  # the scaffold must load; say so rather than leave a broken file
        out.unlink()
        raise SystemExit(f"new: the scaffold did not load ({e}); this is a bug") from None
    print(f"wrote {out}: edit the workload and gates, then run pytest -m perf --perf-profile {out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
