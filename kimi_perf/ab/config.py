"""A/B configuration as data: the profile's ``ab`` policy and its named ``variants``.

Why in the profile: how hard to look (threshold, blocks, repeats, whether to relaunch servers between
blocks) depends on the machine's noise, and what to compare against (a second engine release, an NCCL
preset, a flag, a retrained drafter) depends on the deployment -- both are properties of a profile,
reviewed like the rest of it. The command line only picks the base: ``--perf-ab NAME`` (a variant),
``--perf-ab same`` (A/A: the candidate's own configuration twice) or ``--perf-ab git:REF`` (this
repository at another commit, for the reference engine).

A variant never chooses what runs: like an engine entry it may set engine settings and environment,
but its interpreter comes from the command line (``--perf-ab-python``) and its source tree from git.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

__all__ = ["TOP_MAX_GROWTH", "ABConfigError", "ABSpec", "Variant", "describe_launches", "parallel_launch_problem",
           "parse_ab", "parse_variants", "probe_role"]


# the most ab.top_min_steady_s may grow the top probe: a window far too short (a probe that never fills
# its batch, a server that answers instantly) must not turn one repeat into minutes
TOP_MAX_GROWTH = 8


class ABConfigError(ValueError):
    """A malformed ``ab`` / ``variants`` section or ``--perf-ab`` value; the message names the fix."""


@dataclass(frozen=True)
class ABSpec:
    """How an A/B comparison is run and decided on this profile's machine."""

    threshold: float = 0.05  # a regression this large must FAIL (CPU 5% catches 10%; GPU 2.5% catches 5%)
    # per-metric overrides of `threshold`: a metric whose pairs are too noisy to decide `threshold`
    # within the job's time gets the smallest threshold it can decide there, chosen from a power
    # study's replay (python -m kimi_perf.power --replay-only) and written into the profile's sources
    thresholds: Mapping[str, float] = field(default_factory=dict)
    alpha: float = 0.05  # family-wise: each of m gated metrics gets a 1 - alpha/m interval
    repeats_per_block: int = 3  # pairs per block, in ABBA order (odd: the block summary is their median)
    # per-probe overrides of repeats_per_block ("single_stream", "top"): a cheap probe whose pairs are
    # noisy can take more pairs per block than an expensive one (a C=128 pair costs ~6x a single-stream
    # pair on one GPU), chosen from a replay (python -m kimi_perf.power --replay-only --set repeats=...)
    repeats: Mapping[str, int] = field(default_factory=dict)
    min_blocks: int = 3
    max_blocks: int = 8
    # blocks that share one launch of each side: 1 = fresh servers every block (the launch effect is
    # part of every block's noise); k >= 2 = launch rounds of k blocks whose launch order alternates
    # (base first, then candidate first: ABBA over launches), decided only after whole ABBA cycles of
    # 2k blocks, so neither side is always the one launched second; 0 = one launch per side for the
    # whole comparison (the base launches first: an order effect cannot cancel, see docs/ab-gate.md)
    blocks_per_launch: int = 1
    max_steal: float = 0.05  # redo a pair whose repeats saw more host steal time than this fraction
    max_redo: int = 3  # redone pairs per block before a noisy pair is accepted (and flagged)
    time_budget_s: float | None = None  # stop adding blocks after this much wall time
    # metrics decided per probe: the headline family by default (the accept-length A/B gates
    # accept_length on its own); every other client metric is recorded and reported, not decided
    gated: Mapping[str, tuple[str, ...]] = field(default_factory=lambda: {
        "single_stream": ("decode_tok_s",), "top": ("output_throughput",)})
    # short repeats: workload fields overriding the profile's throughput workloads in A/B runs
    single_stream: Mapping[str, Any] = field(default_factory=dict)
    top: Mapping[str, Any] = field(default_factory=dict)
    top_concurrency: int | None = None  # default: the largest of throughput.concurrency
    accept_prompts: int = 16  # held-out prompts for the accept-length A/B (each prompt is a pair)
    # pin each side's server and the client to disjoint CPU sets (engines on a GPU box are host-CPU
    # bound, and two servers plus the client sharing cores is a noise source); client_cpus cores go
    # to the client, the rest is split evenly between the two sides (kimi_perf.ab.pinning)
    pin_cpus: bool = False
    client_cpus: int = 2
    # start both sides' servers at the same time (the side due first is spawned first) and warm them
    # up after both are ready: an 8B launch on the H200 takes 15-30 s, and launched one after the other
    # the four launches of a two-round comparison were ~40% of its wall time (docs/ab-gate.md)
    parallel_launch: bool = False
    # stop measuring a probe once every metric it gates has PASSED at a decision point (its verdicts
    # stand, as a FAIL already ends the comparison at its first crossing). On one GPU the C=128 repeat
    # is ~85% of a block while single-stream decode is the metric that needs the most blocks, so the
    # blocks after C=128 is decided cost a fraction of the first ones (docs/ab-gate.md)
    retire_decided: bool = False
    # size the top probe on the machine it runs on: after the first launch round, one discarded repeat
    # per side measures the probe's steady window (C requests in flight, kimi_perf.load.results); when
    # the shorter of the two lasts less than this many seconds, num_prompts grows so that it would last
    # this long (at most TOP_MAX_GROWTH x). Why not a fixed size: one size is a 0.9-1.1 s window for
    # vLLM 0.26 on an H100 (~19K tok/s; 13.8% between blocks at C=128) and 1.5-1.7 s for SGLang 0.5.17
    # (3.6%), and longer still for a slower deployment; pyperf calibrates its loops to a minimum time
    # for the same reason. None: the size ab.top gives
    top_min_steady_s: float | None = None
    # measure each pair as 2k segments of 1/k of the probe's output length in Thue-Morse side order
    # (k=2: A B B A; k=4: A B B A B A A B), each side's value the mean of its k segments. Why: on a
    # host whose CPU speed wanders on a scale of seconds (the 2-core CI VM: consecutive pairs ~10 s apart
    # correlate 0.22, the two sides of a pair 0.56; vLLM on one GPU follows its CPU time per token), a
    # drift across the pair lands on the side measured second; with both sides' segments centred on the
    # same moment a linear drift cancels and the sides are measured closer in time. An OU model fitted
    # to those correlations cuts a pair's SD by ~40% at k=2 (docs/ab-gate.md). 1: one request stream a side
    pair_segments: int = 1

    @property
    def launch_schedule(self) -> str:
        """The launch schedule in words, for reports (and whether decided probes are retired)."""
        return (describe_launches(self.blocks_per_launch, self.pin_cpus, self.parallel_launch)
                + (", a probe stops once its metrics PASS" if self.retire_decided else "")
                + (f", top probe sized to a {self.top_min_steady_s:g} s steady window" if self.top_min_steady_s else "")
                + (f", pairs in {2 * self.pair_segments} interleaved segments" if self.pair_segments > 1 else ""))

    def repeats_for(self, probe: str) -> int:
        """Pairs per block of ``probe`` (a probe name, "single_stream" or "c128", or its role "top")."""
        return int(self.repeats.get(probe_role(probe), self.repeats_per_block))

    def describe_repeats(self) -> str:
        """``3 pairs`` or ``3 pairs (top 1)``, for headers and reports."""
        extra = ", ".join(f"{p} {n}" for p, n in sorted(self.repeats.items()))
        return f"{self.repeats_per_block} pairs" + (f" ({extra})" if extra else "")

    def threshold_for(self, metric: str) -> float:
        """The regression threshold ``metric`` is decided at."""
        return float(self.thresholds.get(metric, self.threshold))

    def describe_thresholds(self) -> str:
        """``2.5%`` or ``2.5% (steady_output_throughput 7.5%)``, for headers and reports."""
        extra = ", ".join(f"{m} {t:.1%}" for m, t in sorted(self.thresholds.items()))
        return f"{self.threshold:.1%}" + (f" ({extra})" if extra else "")

    @property
    def relaunch(self) -> bool:
        """Whether servers are launched more than once per comparison (reports, older readers)."""
        return self.blocks_per_launch != 0

    def launch_round(self, block: int) -> int:
        """Index of the launch round ``block`` (0-based) belongs to (0 for a single launch)."""
        return block // self.blocks_per_launch if self.blocks_per_launch else 0

    def balanced(self, blocks: int) -> bool:
        """Whether ``blocks`` completed blocks end an ABBA launch cycle, so a launch-order effect
        cancels in the estimate: always with fresh servers every block (launch order alternates with
        the block) or a single launch (nothing to balance), else after 2k, 4k, ... blocks."""
        k = self.blocks_per_launch
        return k <= 1 or blocks % (2 * k) == 0

    def __post_init__(self) -> None:
        problems = []
        if not 0 < self.threshold < 1:
            problems.append(f"threshold {self.threshold} (a fraction in (0, 1), e.g. 0.05)")
        bad = {m: t for m, t in self.thresholds.items()
               if isinstance(t, bool) or not isinstance(t, (int, float)) or not 0 < t < 1}
        if bad:
            problems.append(f"thresholds {bad} (fractions in (0, 1), e.g. {{\"steady_output_throughput\": 0.075}})")
        if not 0 < self.alpha < 1:
            problems.append(f"alpha {self.alpha} (in (0, 1), e.g. 0.05)")
        if self.repeats_per_block < 1:
            problems.append(f"repeats_per_block {self.repeats_per_block} (>= 1)")
        bad_r = {k: v for k, v in self.repeats.items()
                 if k not in ("single_stream", "top") or isinstance(v, bool) or not isinstance(v, int) or v < 1}
        if bad_r:
            problems.append(f"repeats {bad_r} (probe \"single_stream\" or \"top\" -> pairs per block >= 1, "
                            'e.g. {"single_stream": 3, "top": 1})')
        if not 2 <= self.min_blocks <= self.max_blocks:
            problems.append(f"min_blocks {self.min_blocks} / max_blocks {self.max_blocks} (2 <= min <= max)")
        if not 0 < self.max_steal <= 1:
            problems.append(f"max_steal {self.max_steal} (a fraction in (0, 1])")
        if self.max_redo < 0:
            problems.append(f"max_redo {self.max_redo} (>= 0)")
        if self.time_budget_s is not None and self.time_budget_s <= 0:
            problems.append(f"time_budget_s {self.time_budget_s} (> 0 or null)")
        k = self.blocks_per_launch
        if isinstance(k, bool) or not isinstance(k, int) or k < 0:
            problems.append(f"blocks_per_launch {k!r} (an integer >= 0: 1 relaunches every block, 0 launches once)")
        elif k >= 2 and (self.max_blocks % (2 * k) or self.min_blocks > self.max_blocks):
            problems.append(f"max_blocks {self.max_blocks} with blocks_per_launch {k} (max_blocks must be a multiple "
                            f"of 2 x {k} = {2 * k}: the comparison decides only after whole ABBA launch cycles)")
        if isinstance(self.client_cpus, bool) or not isinstance(self.client_cpus, int) or self.client_cpus < 1:
            problems.append(f"client_cpus {self.client_cpus!r} (an integer >= 1)")
        m = self.top_min_steady_s
        if m is not None and (isinstance(m, bool) or not isinstance(m, (int, float)) or not 0 < m <= 60):
            problems.append(f"top_min_steady_s {m!r} (seconds in (0, 60], e.g. 3, or null to keep ab.top's size)")
        k = self.pair_segments
        if isinstance(k, bool) or not isinstance(k, int) or not 1 <= k <= 8:
            problems.append(f"pair_segments {k!r} (an integer in [1, 8]: 2 measures a pair as A B B A halves)")
        if self.accept_prompts < 2:
            problems.append(f"accept_prompts {self.accept_prompts} (>= 2)")
        if problems:
            raise ABConfigError("invalid " + "; ".join(problems))


def probe_role(probe: str) -> str:
    """The role of an A/B probe by name: "single_stream", else the top-concurrency probe ("top")."""
    return "single_stream" if probe == "single_stream" else "top"


def describe_launches(blocks_per_launch: int, pin_cpus: bool = False, parallel: bool = False) -> str:
    """``ABSpec.blocks_per_launch`` in words (also for stored power-study entries)."""
    k = blocks_per_launch
    what = ("one launch per side (base first)" if k == 0 else "fresh servers every block" if k == 1
            else f"launch rounds of {k} blocks in ABBA order")
    return what + (", both sides launched together" if parallel else "") + (", CPUs pinned" if pin_cpus else "")


def parallel_launch_problem(cfg: Any) -> str | None:
    """Why ``cfg``'s engine cannot start at the same time as the other side (``ab.parallel_launch``),
    or None. Engines that size their KV cache from the GPU memory free while they start count a peer
    that is loading at the same moment as their own use: vLLM derives its non-torch memory from
    whole-device free-memory deltas (vllm-project/vllm#55827: two instances started together shrink
    each other's cache or fail with "No available memory for the cache blocks") unless
    ``kv_cache_memory_bytes`` fixes the cache (its worker then skips that profiling); SGLang's pool is
    the memory available after loading (``mem_fraction_static``). The reference engine sizes its cache
    from its own settings."""
    kind = getattr(cfg, "kind", "")
    if kind == "reference":
        return None
    if kind == "vllm":
        if getattr(cfg, "kv_cache_memory_bytes", None):
            return None
        return (f"{cfg.name}: vLLM sizes its KV cache from the memory free while it starts, so two started together "
                "mis-size each other (vllm-project/vllm#55827); give the vLLM engine kv_cache_memory_bytes (the "
                "same on both sides) or set ab.parallel_launch false")
    return (f"{getattr(cfg, 'name', kind)}: {kind or 'this engine'} sizes its memory from what is free while it "
            "starts; launch its sides one after the other: set ab.parallel_launch false")


_WORKLOAD_OVERRIDES = {"num_prompts", "output_len", "input_len", "warmup", "output_len_range_ratio"}


def parse_ab(raw: Mapping[str, Any] | None, *, hardware: str) -> ABSpec:
    """The profile's ``ab`` section (missing: the defaults for its hardware, GPU threshold 2.5%)."""
    raw = dict(raw or {})
    fields = set(ABSpec.__dataclass_fields__) | {"relaunch"}
    unknown = set(raw) - fields
    if unknown:
        raise ABConfigError(f"unknown key(s) {sorted(unknown)}; allowed: {sorted(fields)}")
    for k in ("single_stream", "top"):
        v = raw.get(k, {})
        if not isinstance(v, Mapping) or set(v) - _WORKLOAD_OVERRIDES:
            raise ABConfigError(f"{k}: {v!r} must be an object with keys from {sorted(_WORKLOAD_OVERRIDES)}")
    if "gated" in raw:
        from ..metrics import METRICS

        g = raw["gated"]
        ok = (isinstance(g, Mapping) and g and set(g) <= {"single_stream", "top"}
              and all(isinstance(v, list) and all(isinstance(m, str) and m in METRICS for m in v) for v in g.values()))
        if not ok:
            raise ABConfigError(f"gated: {g!r} must map probe (single_stream, top) to a list of metric names, "
                                'e.g. {"single_stream": ["decode_tok_s"], "top": ["output_throughput"]}')
        raw["gated"] = {k: tuple(v) for k, v in g.items()}
    if "repeats" in raw:
        if not isinstance(raw["repeats"], Mapping):
            raise ABConfigError(f"repeats: {raw['repeats']!r} must map a probe (single_stream, top) to pairs per block, "
                                'e.g. {"single_stream": 3, "top": 1}')
        raw["repeats"] = dict(raw["repeats"])
    if "thresholds" in raw:
        from ..metrics import METRICS

        th = raw["thresholds"]
        if not isinstance(th, Mapping) or not all(isinstance(m, str) for m in th):
            raise ABConfigError(f"thresholds: {th!r} must map metric names to fractions, "
                                'e.g. {"steady_output_throughput": 0.075}')
        unknown_m = sorted(set(th) - set(METRICS))
        if unknown_m:
            raise ABConfigError(f"thresholds: unknown metric(s) {unknown_m}; metrics are defined in "
                                "kimi_perf/metrics.py and docs/metrics.md")
        raw["thresholds"] = dict(th)
    raw.setdefault("threshold", 0.025 if hardware == "cuda" else 0.05)
    if "relaunch" in raw:  # the older spelling: true = every block, false = once
        if "blocks_per_launch" in raw:
            raise ABConfigError("give blocks_per_launch or relaunch (its older spelling), not both")
        r = raw.pop("relaunch")
        if not isinstance(r, bool):
            raise ABConfigError(f"relaunch: {r!r} must be true (fresh servers every block) or false; "
                                "blocks_per_launch (an integer) says more")
        raw["blocks_per_launch"] = 1 if r else 0
    for k in ("repeats_per_block", "min_blocks", "max_blocks", "max_redo", "accept_prompts", "top_concurrency",
              "blocks_per_launch", "client_cpus"):
        if k in raw and raw[k] is not None and (isinstance(raw[k], bool) or not isinstance(raw[k], int)):
            raise ABConfigError(f"{k}: {raw[k]!r} must be an integer")
    for k in ("pin_cpus", "parallel_launch", "retire_decided"):
        if k in raw and not isinstance(raw[k], bool):
            raise ABConfigError(f"{k}: {raw[k]!r} must be true or false")
    try:
        return ABSpec(**raw)
    except TypeError as e:
        raise ABConfigError(str(e)) from None


@dataclass(frozen=True)
class Variant:
    """A named way to run an engine, used as the base side of an A/B comparison."""

    name: str
    engine: str | None = None  # profile engine name; None = the candidate's engine
    settings: Mapping[str, Any] = field(default_factory=dict)  # engine setting overrides
    env: Mapping[str, str] = field(default_factory=dict)
    drafter: str | None = None  # EAGLE-3 checkpoint served by this side (accept-length A/B)
    git_ref: str | None = None  # this repository at another commit (reference engine only)
    interpreter: str = "candidate"  # "candidate" (the engine's usual env) or "cli" (--perf-ab-python)
    description: str = ""

    def describe(self) -> dict[str, Any]:
        d: dict[str, Any] = {"name": self.name}
        for k in ("engine", "drafter", "git_ref", "description"):
            if getattr(self, k):
                d[k] = getattr(self, k)
        if self.settings:
            d["settings"] = dict(self.settings)
        if self.env:
            d["env"] = dict(self.env)
        if self.interpreter != "candidate":
            d["interpreter"] = self.interpreter
        return d


SAME = "same"  # built-in: the candidate's own configuration (A/A)
_VARIANT_KEYS = {"engine", "settings", "env", "drafter", "git", "interpreter", "description"}


def parse_variants(raw: Mapping[str, Any] | None, engines: Mapping[str, Any]) -> dict[str, Variant]:
    """The profile's ``variants`` section, validated against its engines."""
    out: dict[str, Variant] = {}
    for name, v in dict(raw or {}).items():
        where = f"variants.{name}"
        if name == SAME or name.startswith("git:"):
            raise ABConfigError(f"{where}: the name {name!r} is reserved (--perf-ab same / git:REF are built in)")
        if not isinstance(v, Mapping):
            raise ABConfigError(f"{where}: must be an object with keys from {sorted(_VARIANT_KEYS)}")
        unknown = set(v) - _VARIANT_KEYS
        if unknown:
            raise ABConfigError(f"{where}: unknown key(s) {sorted(unknown)}; allowed: {sorted(_VARIANT_KEYS)}")
        if "python" in dict(v.get("settings") or {}) or "source_root" in dict(v.get("settings") or {}):
            raise ABConfigError(f"{where}.settings: a profile cannot choose what runs; give the base side's "
                                "interpreter with --perf-ab-python (\"interpreter\": \"cli\")")
        eng = v.get("engine")
        if eng is not None and eng not in engines:
            raise ABConfigError(f"{where}.engine {eng!r} is not an engine of this profile ({', '.join(engines)})")
        interp = v.get("interpreter", "candidate")
        if interp not in ("candidate", "cli"):
            raise ABConfigError(f"{where}.interpreter {interp!r}: use \"candidate\" or \"cli\" (--perf-ab-python)")
        env = v.get("env") or {}
        settings = v.get("settings") or {}
        if not isinstance(env, Mapping) or not isinstance(settings, Mapping):
            raise ABConfigError(f"{where}: env and settings must be objects")
        out[name] = Variant(name=name, engine=eng, settings=dict(settings),
                            env={str(a): str(b) for a, b in env.items()}, drafter=v.get("drafter"),
                            git_ref=v.get("git"), interpreter=interp, description=str(v.get("description", "")))
    return out
