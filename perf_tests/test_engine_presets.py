"""NCCL preset A/B on a tensor-parallel engine: the same workload under the reference preset and a
tuned one, interleaved in one session, gated on the ratio (and each preset against its baseline).

The seed deployment's vLLM speed came from one NCCL set (all-reduce was 51.5% of decode time on 8
PCIe GPUs); this is the test that notices when an engine release or driver makes that set stop
helping. Needs the profile's GPUs; skipped with the reason otherwise.
"""

from __future__ import annotations

import numpy as np
import pytest

from kimi_perf.bench import measure, samples_of
from kimi_perf.suite.servers import engine_config

pytestmark = [pytest.mark.perf, pytest.mark.gpu]


def test_nccl_preset_ab(perf_session, target_model, server_pool, prompt_factory, perf_gate, perf_nccl_preset,
                        perf_nccl_concurrency):
    nc = perf_session.profile.nccl
    if not nc or perf_nccl_preset is None:
        pytest.skip(f"profile {perf_session.profile.name} defines no NCCL presets to compare")
    if perf_session.profile.throughput is None:
        pytest.skip("the NCCL A/B reuses the profile's throughput workload, and it has none")
    base = nc.reference
    eng = nc.engine or perf_session.engines[0]
    w = perf_session.profile.throughput.sweep_workload(perf_nccl_concurrency)
    cfgs = {p: engine_config(perf_session.server_settings(), eng, target_model, nccl_preset=p) for p in (base, perf_nccl_preset)}
    tput: dict[str, list[float]] = {p: [] for p in cfgs}
    for r in range(perf_session.repeats):
        for p, cfg in cfgs.items():  # interleaved: drift in the machine hits both presets alike
            srv = server_pool.get(cfg, exclusive=True)
            res = measure(srv, w, lambda wl, i, _r=r: prompt_factory(wl, 100 * _r + i), 1, label=f"{eng} [{p}]",
                          tokenizer=prompt_factory.tokenizer)
            tput[p] += samples_of(res, ["output_throughput"])["output_throughput"]
    ratios = [b / a for a, b in zip(tput[base], tput[perf_nccl_preset])]
    perf_gate.check(scenario=f"nccl_ab:{perf_nccl_preset}-vs-{base}", engine=eng, model=target_model.name,
                    workload=w.key, concurrency=perf_nccl_concurrency,
                    samples={"preset_ratio": ratios, "output_throughput": tput[perf_nccl_preset]},
                    gated=["preset_ratio", "output_throughput"],
                    extra={f"output_throughput[{p}]": v for p, v in tput.items()})
    min_ratio = nc.min_ratio
    med = float(np.median(ratios))
    assert med >= min_ratio, (f"preset_ratio (higher is better, x): {perf_nccl_preset} gives {med:.3f}x the "
                              f"throughput of {base} at c={perf_nccl_concurrency}, below {min_ratio}")
