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
def test_ab_accept_length(perf_ab, perf_engine_name, perf_session, eagle3_drafter, perf_gate, target_model):
    """EAGLE-3 accept length of the session drafter vs the base (another commit, engine, flag or
    drafter), prompt by prompt, on the engine under test: a variant that tunes an engine (SGLang's
    continuous decode steps, vLLM's graphs) is judged on acceptance next to its speed.

    Accept length is deterministic for a prompt under greedy decoding, so each held-out prompt is one
    pair and the interval runs over prompts (:func:`kimi_perf.ab.runner.run_ab_prompts`)."""
    from dataclasses import replace

    from kimi_perf.ab.runner import ABSideError, run_ab_prompts
    from kimi_perf.eagle3.evaluate import measure_generation
    from kimi_perf.engines.base import SpecConfig
    from kimi_perf.suite.ab import PoolSide

    engine = perf_engine_name
    max_new = perf_session.profile.eagle3.eval.max_new_tokens
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


@pytest.mark.alignment
def test_ab_alignment(perf_ab, perf_engine_name, perf_session, alignment, request):
    """The candidate's hidden states vs the base's, layer by layer on the engine's thresholds.

    A flag that speeds serving up (CUDA graphs, continuous decode steps, async scheduling, a kernel
    backend) can also move the states the drafter is fed, and a drafter trained on the base's states
    then loses acceptance on the candidate. So next to the speed verdict of a variant A/B stands this
    one: both sides capture the alignment prompts the way the engine's alignment test does (reference:
    aux mode; SGLang: the session drafter's speculative server with return_hidden_states; vLLM:
    extract_hidden_states, prefilled), and every layer of the candidate must agree with the base's on
    the tokens both generated. With ``--perf-ab same`` or ``git:REF`` it checks that the change did not
    move the states."""
    import numpy as np

    from kimi_perf.alignment.diagnose import check_alignment
    from kimi_perf.alignment.plan import PlanError, serving_dtype
    from kimi_perf.capture.hidden import HiddenStates
    from kimi_perf.engines.base import SpecConfig
    from kimi_perf.progress import log
    from kimi_perf.suite.alignment import common_prefix

    engine = perf_engine_name
    raw = perf_session.profile.engines[engine]
    kind = str(raw["kind"])
    st = alignment.st
    try:
        dtype = serving_dtype(raw)
    except PlanError as e:
        raise pytest.UsageError(f"profile {perf_session.profile.path}: engines.{engine}.{e}") from None
    if kind == "reference":
        over = dict(aux_hidden_states=True, aux_layer_ids=tuple(st.served), max_running_requests=8)
    elif kind == "sglang":
        d = request.getfixturevalue("eagle3_drafter")
        over = dict(spec=SpecConfig(draft_model_path=str(d.path), steps=d.steps), return_hidden_states=True)
    elif kind == "vllm":
        import tempfile

        layers = (*st.aux, st.num_layers)
        over = dict(extract_hidden_layers=layers, extract_dir=tempfile.mkdtemp(prefix="kimi-perf-ab-hs-"))
    else:
        pytest.skip(f"engine {engine}: kind {kind} has no hidden-state capture")
    base_cfg, cand_cfg = perf_ab.configs(engine, **over)
    perf_ab.pool.stop_all()
    caps = {}
    for role, cfg in (("base", base_cfg), ("candidate", cand_cfg)):
        caps[role] = (alignment.vllm_capture_config(cfg, layers) if kind == "vllm" else alignment.capture(cfg))
    base, cand = caps["base"], caps["candidate"]
    gated = [k for k in cand.layers if k in base.layers and k in st.layers]
    assert gated, f"no common gated layer: base {base.layers}, candidate {cand.layers}"
    msgs, rows = [], []
    for i, (b, c) in enumerate(zip(base.states, cand.states)):
        n = common_prefix(b.token_ids, c.token_ids)
        if n < len(b.token_ids) or n < len(c.token_ids):
            log(f"A/B alignment prompt {i}: the sides generated the same first {n} tokens; compared there")

        def cut(h: HiddenStates, n: int = n) -> HiddenStates:
            return HiddenStates({k: v[:n] for k, v in h.layers.items()}, h.token_ids[:n], h.provenance,
                                prompt_len=h.prompt_len)

        for k in gated:
            thr, tol, _ = alignment.engine_threshold(engine, dtype, k)
            rep = check_alignment(cut(c), cut(b), [k], threshold=thr, norm_ratio_tol=tol, num_layers=st.num_layers)
            v = rep.verdicts[0]
            rows.append((k, v.comparison.cos_min, thr))
            if not v.ok:
                msgs.append(f"prompt {i}: {v.message}")
    worst = {k: min(c for kk, c, _ in rows if kk == k) for k in gated}
    log(f"A/B alignment {engine} candidate vs base [{perf_ab.base.label}]: "
        + ", ".join(f"layer {k} cos min {worst[k]:.5f}" for k in gated))
    assert np.isfinite(list(worst.values())).all()
    if msgs:
        pytest.fail(f"{engine}: the candidate's configuration moves the hidden states the drafter is fed, vs the "
                    f"base [{perf_ab.base.label}] (a drafter trained on the base's states would lose acceptance):"
                    "\n  " + "\n  ".join(msgs[:12]), pytrace=False)
