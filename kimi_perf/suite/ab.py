"""Same-run A/B behind the ``perf_ab`` fixture: the two sides (candidate = this checkout, base =
``--perf-ab``) as servers of the session's pool, and the probes the profile gates.

Both sides are built from the same profile engine entry by the same code (:func:`engine_config`);
the base then gets exactly what ``--perf-ab`` names changed (:mod:`kimi_perf.ab.base`). Servers are
launched through the pool, so a failing test or an interrupted session still stops them.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Any

import pytest

from kimi_perf.ab.base import ABBase, base_engine_config
from kimi_perf.ab.config import ABConfigError, ABSpec, parallel_launch_problem
from kimi_perf.ab.runner import ABOutcome, ABSideError, Probe, run_ab
from kimi_perf.bench import RunningServer
from kimi_perf.engines.base import EngineConfig
from kimi_perf.load.workload import Workload
from kimi_perf.models.embedded import cache_root
from kimi_perf.profiles import ThroughputSpec
from kimi_perf.recorder import PerfGate
from kimi_perf.session import ServerSettings

from .models import TargetModel
from .servers import ServerPool, engine_config
from .workloads import PromptFactory

REPORTED = ("decode_tok_s", "output_throughput", "ttft_ms_p50", "tpot_ms_p50", "engine_cpu_ms_per_tok",
            "host_steal_fraction")


@dataclass
class PoolSide:
    """A side of the comparison whose server lives in the session's pool."""

    role: str
    label: str
    pool: ServerPool
    cfg: EngineConfig
    launched: EngineConfig | None = None  # the config of the running server (cfg with its CPU set)

    def start(self, cpus: tuple[int, ...] = ()) -> RunningServer:
        self.stop()
        self.launched = replace(self.cfg, cpus=tuple(cpus))
        return self.pool.launch(self.launched)

    def stop(self) -> None:
        if self.launched is not None:
            self.pool.stop(self.launched)
            self.launched = None


class PerfAB:
    """What the ab-marked tests use: side configs, probes, and a run that records even a failure.

    Reads the ``--perf-ab`` ``base``, the servers' settings, the profile's ``ab`` section (``spec``) and
    its ``throughput`` section (the probes' workloads; None: the throughput probes skip)."""

    def __init__(self, pool: ServerPool, target: TargetModel, prompts: PromptFactory, *, base: ABBase,
                 servers: ServerSettings, spec: ABSpec, throughput: ThroughputSpec | None) -> None:
        self.pool, self.target, self.prompts = pool, target, prompts
        self.base, self.servers, self.spec, self.throughput = base, servers, spec, throughput

    def configs(self, engine: str, **overrides: Any) -> tuple[EngineConfig, EngineConfig]:
        """(base, candidate) engine configs for the profile's ``engine``."""
        cand = engine_config(self.servers, engine, self.target, **overrides)
        cand = replace(cand, name=f"{engine}-candidate")
        if self.base.kind == "git" and cand.kind != "reference":
            pytest.skip(f"--perf-ab {self.base.spec} compares this repository's code; {engine} ({cand.kind}) does not "
                        "run it. Compare engine releases with a variant (\"interpreter\": \"cli\")")

        def build(name: str, **settings: Any) -> EngineConfig:
            return engine_config(self.servers, name, self.target, **{**overrides, **settings})

        try:
            base = base_engine_config(cand, self.base, build=build, cache_dir=cache_root())
        except ABConfigError as e:
            raise pytest.UsageError(str(e)) from None
        v = self.base.variant
        return replace(base, name=f"{(v.engine if v is not None and v.engine else engine)}-base"), cand

    def throughput_probes(self) -> list[Probe]:
        """The headline throughput probes: single stream and the top concurrency of the sweep, as short
        repeats (the profile's ``ab.single_stream`` / ``ab.top`` overrides)."""
        tp = self.throughput
        if tp is None:
            pytest.skip(f"profile {self.servers.profile_name} defines no throughput section to A/B")
        ab = self.spec
        top_c = ab.top_concurrency or max(tp.concurrency)
        single = replace(tp.single_stream, **dict(ab.single_stream))
        top = replace(tp.sweep_workload(top_c), **dict(ab.top))
        probes = []
        for name, w in (("single_stream", single), ("top", top)):
            gated = tuple(ab.gated.get(name, ()))
            if gated:
                probes.append(Probe(name=name if name == "single_stream" else f"c{top_c}", workload=w,
                                    gated=gated, reported=REPORTED))
        if not probes:
            pytest.skip("the profile's ab.gated names no throughput metric")
        return probes

    def run(self, engine: str, probes: list[Probe], gate: PerfGate, *, scenario: str,
            **overrides: Any) -> ABOutcome:
        """Run the interleaved comparison for ``engine`` and gate it; a side that fails is a test
        failure naming the side and the fix, with everything measured until then in run.json."""
        base_cfg, cand_cfg = self.configs(engine, **overrides)
        if self.spec.parallel_launch:
            for why in filter(None, map(parallel_launch_problem, (base_cfg, cand_cfg))):
                raise pytest.UsageError(f"profile {self.servers.profile_name}: ab.parallel_launch: {why}")
        self.pool.stop_all()  # nothing else may share the machine with the two sides
        sides = (PoolSide("base", self.base.label, self.pool, base_cfg),
                 PoolSide("candidate", f"{engine} (this checkout)", self.pool, cand_cfg))
        try:
            out = run_ab(sides[0], sides[1], probes, self.spec, self._prompts)
        except ABSideError as e:
            gate.check_ab(e.outcome, scenario=scenario, engine=engine, model=self.target.name,
                          extra={"error": str(e)}, fail=False)
            pytest.fail(str(e), pytrace=False)
        gate.check_ab(out, scenario=scenario, engine=engine, model=self.target.name,
                      extra={"base_config": base_cfg.describe(), "candidate_config": cand_cfg.describe()})
        return out

    def _prompts(self, w: Workload, i: int) -> Any:
        return self.prompts(w, i)


