"""Same-run A/B gates: the candidate (this checkout) against ``--perf-ab BASE``, measured in this job.

These are the merge gate's verdicts: machines differ more than the regressions worth catching (the
2-core CI box moves ~12% run to run, two H200 hosts -12% / -27% on one commit), so the headline metrics
are decided on the interval of the candidate/base ratio measured side by side, interleaved in ABBA
blocks (see :mod:`kimi_perf.ab.decide` for the statistics). The stored-baseline tests stay as
gross-breakage floors and history. Without ``--perf-ab`` these tests are deselected.

Headline family (the profile's ``ab.gated``): single-stream decode tok/s and output tok/s at the top
concurrency of the sweep; EAGLE-3 accept length has its own test, its pairs are prompts.
"""

from __future__ import annotations

import pytest

pytestmark = [pytest.mark.perf, pytest.mark.ab]


def test_ab_throughput(perf_ab, perf_engine_name, perf_gate):
    """Single-stream decode speed and top-concurrency output throughput vs the base, same run."""
    perf_ab.run(perf_engine_name, perf_ab.throughput_probes(), perf_gate, scenario="ab_throughput")


@pytest.mark.eagle
def test_ab_accept_length(perf_ab, perf_session, eagle3_drafter, perf_gate, target_model):
    """EAGLE-3 accept length vs the base (another commit, engine or drafter), prompt by prompt.

    Accept length is deterministic for a prompt under greedy decoding, so each held-out prompt is one
    pair and the interval runs over prompts (:func:`kimi_perf.ab.runner.run_ab_prompts`)."""
    from dataclasses import replace

    from fixtures.ab import PoolSide
    from kimi_perf.ab.runner import ABSideError, run_ab_prompts
    from kimi_perf.eagle3.evaluate import measure_generation
    from kimi_perf.engines.base import SpecConfig

    e = perf_session.profile.eagle3
    engine = str(e.get("engine", "reference"))
    max_new = int(dict(e.get("eval", {})).get("max_new_tokens", 64))
    spec = SpecConfig(draft_model_path=str(eagle3_drafter.path), steps=eagle3_drafter.steps)
    small = {"max_running_requests": 4} if perf_session.profile.engines[engine]["kind"] == "reference" else {}
    base_cfg, cand_cfg = perf_ab.configs(engine, spec=spec, **small)
    prompts = [list(p) for p in eagle3_drafter.eval_prompts][: perf_session.profile.ab.accept_prompts]
    if len(prompts) < 2:
        pytest.skip(f"{len(prompts)} held-out prompt(s): an interval over prompts needs at least 2")

    def accept_length(srv, prompt):
        return measure_generation(srv.base_url, srv.model, [prompt], max_new, name="ab-accept").accept_length

    perf_ab.pool.stop_all()
    sides = (PoolSide("base", perf_ab.base.label, perf_ab.pool, base_cfg),
             PoolSide("candidate", f"{engine} (this checkout)", perf_ab.pool, cand_cfg))
    ab_spec = replace(perf_session.profile.ab, min_blocks=2)
    try:
        out = run_ab_prompts(sides[0], sides[1], prompts, "accept_length", ab_spec, accept_length,
                             probe=f"mtbench-heldout-{len(prompts)}x{max_new}-k{eagle3_drafter.steps}")
    except ABSideError as err:
        perf_gate.check_ab(err.outcome, scenario="ab_accept_length", engine=engine, model=target_model.name,
                           extra={"error": str(err)}, fail=False)
        pytest.fail(str(err), pytrace=False)
    perf_gate.check_ab(out, scenario="ab_accept_length", engine=engine, model=target_model.name,
                       extra={"drafter": str(eagle3_drafter.path), "base_config": base_cfg.describe()})
