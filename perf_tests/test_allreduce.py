"""All-reduce latency for decode-sized messages under NCCL presets, one process per GPU.

The seed deployment spent 51.5% of decode time in all-reduce and tuned it with NCCL variables; an
engine A/B (test_engine_presets.py) shows the effect on throughput, this isolates the collective so a
driver, NCCL or topology change that makes the tuned preset stop paying is caught by itself. The
presets run interleaved in one session (kimi_perf.nccl.compare_presets) and the preferred one is
gated twice: its latency against the stored baseline, and its ratio to the reference preset measured
in the same run.
"""

from __future__ import annotations

import numpy as np
import pytest

pytestmark = [pytest.mark.perf, pytest.mark.gpu]


@pytest.fixture(scope="session")
def allreduce_ab(perf_session):
    from kimi_perf.nccl import AllReduceError, compare_presets
    from kimi_perf.progress import log

    sec = perf_session.profile.allreduce
    if sec is None:
        pytest.skip(f"profile {perf_session.profile.name} has no allreduce section")
    gpus = len(perf_session.gpus)
    world = sec.world_size or gpus
    if gpus < 2 or world > gpus:
        pytest.skip(f"an all-reduce across {max(world, 2)} GPUs needs that many; this machine has {gpus}")
    presets, preferred, min_ratio, timeout = list(sec.presets), sec.preferred_preset, sec.min_ratio, sec.timeout_s
    spec = sec.spec(world, backend="nccl")
    log(f"all-reduce: {world} ranks, {spec.hidden} x {spec.dtype}, tokens {list(spec.tokens)}, presets "
        f"{presets} x {perf_session.repeats} repeats (interleaved)")
    try:
        res = compare_presets(spec, presets, perf_session.repeats, timeout_s=timeout,
                              log_dir=perf_session.report_dir / "logs")
    except AllReduceError as e:
        pytest.fail(str(e), pytrace=False)
    return {"spec": spec, "presets": presets, "preferred": preferred, "min_ratio": min_ratio, "results": res}


def test_allreduce_preset(allreduce_ab, perf_allreduce_tokens, perf_gate, perf_session):
    """Latency of the preferred preset at one message size, and its speed relative to the reference."""
    ab = allreduce_ab
    t = perf_allreduce_tokens
    spec, base, pref = ab["spec"], ab["presets"][0], ab["preferred"]
    res = ab["results"]
    p50 = {p: [r.by_tokens()[t].us_p50 for r in rs] for p, rs in res.items()}
    ratios = [b / a for b, a in zip(p50[base], p50[pref])]  # >1: the preferred preset is faster
    nccl = res[pref][0].nccl_version
    perf_gate.check(scenario=f"allreduce:{pref}-vs-{base}", engine=f"nccl-{spec.world_size}rank",
                    model=f"hidden{spec.hidden}-{spec.dtype}", workload=f"allreduce-i{spec.iters}", concurrency=t,
                    samples={"allreduce_us_p50": p50[pref],
                             "allreduce_us_p99": [r.by_tokens()[t].us_p99 for r in res[pref]],
                             "preset_ratio": ratios},
                    gated=["allreduce_us_p50", "preset_ratio"], engine_version=nccl,
                    extra={f"allreduce_us_p50[{p}]": v for p, v in p50.items()} | {"env": dict(res[pref][0].env)})
    med = float(np.median(ratios))
    assert med >= ab["min_ratio"], (
        f"preset_ratio (higher is better, x): {pref} all-reduces {t} x {spec.hidden} in {np.median(p50[pref]):.1f} us "
        f"vs {np.median(p50[base]):.1f} us for {base} ({med:.3f}x), below the profile's {ab['min_ratio']}")
