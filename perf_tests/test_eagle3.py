"""EAGLE-3 gates: acceptance and speedup of the session's drafter, losslessness, and the layer-mismatch
failure mode this suite exists to catch.

The drafter comes from the ``eagle3_drafter`` fixture (trained and cached on the profile's recipe, or
``--perf-drafter``). Speedup is an A/B measured in this run: the same held-out prompts through the same
engine with and without speculative decoding, interleaved over R repeats.
"""

from __future__ import annotations

import json
import shutil

import numpy as np
import pytest

from fixtures.drafters import spec_engine_config
from fixtures.servers import engine_config
from kimi_perf.eagle3.evaluate import WIRING_HINT, measure_generation
from kimi_perf.progress import log

pytestmark = [pytest.mark.perf, pytest.mark.eagle]


def _eval(s):
    e = dict(s.profile.eagle3.get("eval", {}))
    return int(e.get("max_new_tokens", 64)), float(e.get("min_speedup", 1.0)), float(e.get("min_accept_length", 1.0))


@pytest.fixture(scope="session")
def eagle3_ab(perf_session, target_model, server_pool, eagle3_drafter):
    """Plain and speculative servers, same prompts, interleaved repeats at concurrency 1."""
    max_new, _, _ = _eval(perf_session)
    prompts = [list(p) for p in eagle3_drafter.eval_prompts]
    eng = _engine(perf_session)
    small = {"max_running_requests": 4} if perf_session.profile.engines.get(eng, {}).get("kind") == "reference" else {}
    cfgs = {"plain": engine_config(perf_session, eng, target_model, **small),
            "spec": spec_engine_config(perf_session, target_model, eagle3_drafter.path, eagle3_drafter.steps,
                                       engine=eng, **small)}
    out = {"plain": [], "spec": [], "versions": {}}
    for name, cfg in cfgs.items():
        # one unmeasured pass per server over *every* prompt, a few tokens each: each prompt length is
        # a new eager prefill/extend shape, and first-use costs (kernel selection, allocator growth)
        # otherwise land in repeat 1. On the H200 a 2-prompt warm-up still left repeat 1 15-17% slower
        # for plain decoding and 37% for speculative.
        srv = server_pool.get(cfg)
        measure_generation(srv.base_url, srv.model, prompts, min(max_new, 8), name=f"eagle3-{name}-warmup")
    for r in range(perf_session.repeats):
        for name, cfg in cfgs.items():
            srv = server_pool.get(cfg)
            out["versions"][name] = srv.version
            res = measure_generation(srv.base_url, srv.model, prompts, max_new, name=f"eagle3-{name}")
            out[name].append(res)
            log(f"eagle3 A/B repeat {r + 1}/{perf_session.repeats} {name}: {res.output_tok_s:.1f} tok/s"
                + (f", accept length {res.accept_length:.2f}" if name == "spec" else ""))
    for cfg in cfgs.values():
        server_pool.stop(cfg)
    return out


def _engine(perf_session):
    """The engine the profile measures EAGLE-3 on (the reference engine on CPU, SGLang on the Kimi rig)."""
    return str(perf_session.profile.eagle3.get("engine", "reference"))


def _workload(perf_session, drafter):
    max_new, _, _ = _eval(perf_session)
    return f"mtbench-heldout-{len(drafter.eval_prompts)}x{max_new}-k{drafter.steps}"


def test_acceptance(eagle3_ab, eagle3_drafter, perf_gate, perf_session, target_model):
    """Accept length and per-position acceptance of the drafter on held-out MT-bench prompts."""
    spec = eagle3_ab["spec"]
    if any(r.counters is None and r.server_accept_length is None for r in spec):
        pytest.fail("the speculative server reports acceptance neither as vllm:spec_decode_* counters nor in "
                    "/server_info internal_states: acceptance cannot be read")
    if all(abs(r.accept_length - 1.0) < 1e-9 for r in spec):
        pytest.fail(f"accept length 1.00 on every repeat: {WIRING_HINT}")
    eng = _engine(perf_session)
    samples = {"accept_length": [r.accept_length for r in spec]}
    # A metric the profile gates but this engine cannot measure is recorded with its reason, never dropped.
    not_measured: dict[str, str] = {}
    if all(r.counters is not None for r in spec):
        samples["accept_rate"] = [r.accept_rate for r in spec]
    else:
        not_measured["accept_rate"] = (f"{eng} exports no draft-token counters (acceptance from the "
                                       "/server_info window only)")
    for i in range(min(4, eagle3_drafter.steps)):
        if all(len(r.pos_rates()) > i for r in spec):
            samples[f"accept_rate_pos{i}"] = [r.pos_rates()[i] for r in spec]
        else:
            why = next((r.extra["per_position_unavailable"] for r in spec
                        if r.extra.get("per_position_unavailable")), None)
            not_measured[f"accept_rate_pos{i}"] = (f"{eng} exports no per-position counters"
                                                   + (f" ({why})" if why else ""))
    wanted = list(perf_session.profile.eagle3.get("gated", ["accept_length", "accept_rate_pos0"]))
    ungated = {m: not_measured.get(m, "not measured") for m in wanted
               if m not in samples and m != "spec_speedup"}  # spec_speedup: test_speedup_vs_no_spec
    if ungated:
        import warnings

        from kimi_perf.plugin import PerfWarning

        for m, why in ungated.items():
            log(f"eagle3 acceptance: {m} not gated: {why}")
            warnings.warn(PerfWarning(f"{m} not gated: {why}"), stacklevel=1)
    rep = eagle3_drafter.report
    extra = {"drafter": str(eagle3_drafter.path), "train": rep.get("train"), "data": {
        k: v for k, v in (rep.get("data") or {}).items() if k not in ("train_ids", "heldout_ids")},
        "acceptance_source": sorted({r.source for r in spec}), "not_measured": not_measured}
    perf_gate.check(scenario="eagle3_acceptance", engine=eng, model=target_model.name,
                    workload=_workload(perf_session, eagle3_drafter), concurrency=1, samples=samples,
                    gated=[m for m in wanted if m in samples],
                    engine_version=eagle3_ab["versions"].get("spec"), extra=extra)
    log("eagle3 acceptance: " + ", ".join(f"{k} {np.median(v):.3f}" for k, v in samples.items()))
    _, _, min_len = _eval(perf_session)
    med = float(np.median(samples["accept_length"]))
    assert med >= min_len, f"accept_length (higher is better, tok/step): {med:.3f} < the profile's minimum {min_len}"


def test_speedup_vs_no_spec(eagle3_ab, eagle3_drafter, perf_gate, perf_session, target_model):
    """Output tok/s with EAGLE-3 over without, same prompts, same run, batch 1."""
    ratios = [s.output_tok_s / p.output_tok_s for s, p in zip(eagle3_ab["spec"], eagle3_ab["plain"])]
    same = sum(a == b for s, p in zip(eagle3_ab["spec"], eagle3_ab["plain"]) for a, b in zip(s.texts, p.texts))
    total = sum(len(s.texts) for s in eagle3_ab["spec"])
    perf_gate.check(scenario="eagle3_speedup", engine=_engine(perf_session), model=target_model.name,
                    workload=_workload(perf_session, eagle3_drafter), concurrency=1, samples={"spec_speedup": ratios},
                    gated=["spec_speedup"], engine_version=eagle3_ab["versions"].get("spec"),
                    extra={"plain_tok_s": [p.output_tok_s for p in eagle3_ab["plain"]],
                           "spec_tok_s": [s.output_tok_s for s in eagle3_ab["spec"]],
                           "identical_outputs": f"{same}/{total}"})
    _, min_speedup, _ = _eval(perf_session)
    med = float(np.median(ratios))
    log(f"eagle3 speedup: {med:.3f}x (per repeat {', '.join(f'{r:.3f}' for r in ratios)}); "
        f"serving-dtype outputs identical to no-spec for {same}/{total} requests")
    assert med > min_speedup, (f"spec_speedup (higher is better, x): median {med:.3f} is not above {min_speedup} "
                               f"(per repeat: {ratios})")


def test_lossless_in_fp32(eagle3_drafter, server_pool, perf_session, target_model):
    """Speculative decoding must not change greedy output: fp32, batched verification (C=4)."""
    from kimi_perf.load.client import run_workload
    from kimi_perf.load.workload import Workload

    prompts = [list(p) for p in eagle3_drafter.eval_prompts]
    w = Workload(name="lossless", dataset="mtbench", input_len=max(map(len, prompts)), output_len=48,
                 num_prompts=len(prompts), concurrency=4, warmup=0, ignore_eos=True)
    texts = {}
    for name, cfg in (("plain", engine_config(perf_session, "reference", target_model, dtype="float32")),
                      ("spec", spec_engine_config(perf_session, target_model, eagle3_drafter.path,
                                                  eagle3_drafter.steps, dtype="float32"))):
        srv = server_pool.get(cfg)
        res = run_workload(srv.base_url, srv.model, prompts, w)
        assert res.metrics["error_rate"] == 0, res.errors[:3]
        texts[name] = [r.text for r in res.records]
        server_pool.stop(cfg)
    diff = [i for i, (a, b) in enumerate(zip(texts["plain"], texts["spec"])) if a != b]
    assert not diff, (f"speculative decoding changed greedy output for {len(diff)}/{len(prompts)} prompts; first "
                      f"#{diff[0]}:\n plain: {texts['plain'][diff[0]][:200]!r}\n spec:  {texts['spec'][diff[0]][:200]!r}")


def _stored_and_live(eagle3_drafter, alignment, dtype="bfloat16", n=2):
    from kimi_perf.alignment.extract import server_hidden_states, stored_hidden_states
    from kimi_perf.eagle3.features import FeatureStore

    if eagle3_drafter.feature_dir is None:
        pytest.skip("--perf-drafter was given: no stored features of this session to compare")
    ids = [i for i in eagle3_drafter.heldout_ids if i in set(FeatureStore(eagle3_drafter.feature_dir).sample_ids)][:n]
    stored = [stored_hidden_states(eagle3_drafter.feature_dir, i) for i in ids]
    srv = alignment.server(dtype)
    live = server_hidden_states(srv.base_url, [list(s.token_ids) for s in stored], 1, hidden=alignment.st.hidden)
    return stored, live


@pytest.mark.alignment
def test_stored_features_match_inference(eagle3_drafter, alignment, perf_gate, target_model):
    """The drafter's training shards (with their manifest provenance) vs the serving path, same tokens."""
    from kimi_perf.alignment.diagnose import check_alignment

    stored, live = _stored_and_live(eagle3_drafter, alignment)
    layers = [*json.loads((eagle3_drafter.feature_dir / "manifest.json").read_text())["layers"], "final"]
    worst = None
    for s, lv in zip(stored, live):
        lv = type(lv)(lv.layers, lv.token_ids[: len(s.token_ids)], lv.provenance)
        thr = min(alignment.threshold("bfloat16", k)[0] for k in layers)
        rep = check_alignment(s, lv, layers, threshold=thr, norm_ratio_tol=0.02,
                              final_norm_weight=alignment.hf("bfloat16").final_norm_weight,
                              num_layers=alignment.st.num_layers)
        if worst is None or min(v.comparison.cos_min for v in rep.verdicts) < min(v.comparison.cos_min for v in worst.verdicts):
            worst = rep
    perf_gate.check(scenario="alignment_stored_vs_inference", engine="reference", model=target_model.name,
                    workload="bfloat16:eagle3-layers", concurrency=1,
                    samples={"cosine_min": [v.comparison.cos_min for v in worst.verdicts],
                             "cosine_mean": [v.comparison.cos_mean for v in worst.verdicts]},
                    gated=[], extra={"markdown": worst.markdown()})
    worst.raise_if_failed()


@pytest.mark.alignment
def test_layer_mismatch_collapses_acceptance_and_is_named(eagle3_ab, eagle3_drafter, alignment, server_pool,
                                                          perf_session, target_model, tmp_path):
    """The real-world failure: a checkpoint whose aux-layer ids are in another engine's convention
    (written for SGLang's Llama, read by a vLLM-convention engine) feeds every feature one layer off.
    Acceptance must drop, and the alignment check must say "off-by-one layer id"."""
    from kimi_perf.alignment.diagnose import AlignmentError, check_served_layers
    from kimi_perf.eagle3.model import Eagle3Config, aux_ids_for_engine, effective_aux_layers

    cfg = json.loads((eagle3_drafter.path / "config.json").read_text())
    trained = Eagle3Config.from_hf_config(cfg, engine="reference",
                                          target_num_layers=alignment.st.num_layers).aux_layers
    written = aux_ids_for_engine(trained, "sglang-llama")
    served = effective_aux_layers(written, "reference")
    bad = tmp_path / "drafter-sglang-ids"
    shutil.copytree(eagle3_drafter.path, bad)
    cfg["eagle_config"] = {"eagle_aux_hidden_state_layer_ids": written, "use_aux_hidden_state": True}
    (bad / "config.json").write_text(json.dumps(cfg, indent=1))
    # 1) the alignment check names the cause from the features alone (no acceptance run needed)
    stored, live = _stored_and_live(eagle3_drafter, alignment, n=1)
    lv = type(live[0])(live[0].layers, live[0].token_ids[: len(stored[0].token_ids)], live[0].provenance)
    rep = check_served_layers(stored[0], lv, trained, served, threshold=alignment.threshold("bfloat16", trained[1])[0],
                              norm_ratio_tol=0.02)
    with pytest.raises(AlignmentError) as ei:
        rep.raise_if_failed()
    log("eagle3 layer mismatch, alignment says: " + str(ei.value).replace("\n", " |"))
    assert "off-by-one layer id" in str(ei.value)
    # 2) and acceptance drops when it is served that way -- measurable only for a drafter that accepts
    # enough to begin with: a weak one (the CPU CI drafter, ~170 samples) predicts mostly from token
    # embeddings, so a layer shift moves its acceptance less than retraining noise (measured x0.93 to
    # x1.13 over three CI retrains). Then only the alignment half above is asserted, and the numbers
    # are reported.
    max_new, _, _ = _eval(perf_session)
    ev = perf_session.profile.eagle3.get("eval", {})
    max_ratio = float(ev.get("mismatch_max_accept_ratio", 0.6))
    resolvable = float(ev.get("mismatch_min_accept_length", 1.5))
    good = float(np.median([r.accept_length for r in eagle3_ab["spec"]]))
    prompts = [list(p) for p in eagle3_drafter.eval_prompts]
    scfg = spec_engine_config(perf_session, target_model, bad, eagle3_drafter.steps, max_running_requests=4)
    srv = server_pool.get(scfg)
    res = measure_generation(srv.base_url, srv.model, prompts, max_new, name="eagle3-mismatch")
    server_pool.stop(scfg)
    ratio = (res.accept_length - 1) / (good - 1) if good > 1 else float("nan")
    log(f"eagle3 layer mismatch: trained on {list(trained)}, served {list(served)}: accept length "
        f"{res.accept_length:.3f} vs {good:.3f} served right (accepted drafts x{ratio:.3f})")
    if good < resolvable:
        import warnings

        from kimi_perf.plugin import PerfWarning

        warnings.warn(PerfWarning(
            f"eagle3 layer mismatch: the correctly served drafter's accept length {good:.3f} is below "
            f"{resolvable} (eval.mismatch_min_accept_length), too weak to resolve an acceptance drop; only the "
            f"alignment check was asserted (accepted drafts x{ratio:.3f} when served one layer off)"), stacklevel=1)
        return
    assert ratio < max_ratio, (
        f"serving layers {list(served)} instead of {list(trained)}: accepted drafts per step should fall below "
        f"{max_ratio:.2f}x of the correctly served drafter's; got {res.accept_length:.3f} vs {good:.3f} (x{ratio:.3f})")


def test_acceptance_in_vllm(eagle3_drafter, eagle3_ab, perf_session, target_model, server_pool, perf_gate):
    """The suite's drafter served by real vLLM (its eagle3 loader, its counters), next to the
    reference engine's numbers for the same drafter and prompts."""
    if "vllm" not in perf_session.profile.engines:
        pytest.skip(f"profile {perf_session.profile.name} has no vllm engine")
    from kimi_perf.engines.base import SpecConfig

    cfg = engine_config(perf_session, "vllm", target_model,
                        spec=SpecConfig(draft_model_path=str(eagle3_drafter.path), steps=eagle3_drafter.steps))
    max_new, _, _ = _eval(perf_session)
    srv = server_pool.get(cfg, exclusive=True)
    res = measure_generation(srv.base_url, srv.model, [list(p) for p in eagle3_drafter.eval_prompts], max_new,
                             name="eagle3-vllm")
    server_pool.stop(cfg)
    if res.counters is None:
        pytest.fail("vLLM exported no vllm:spec_decode_* counters: was --speculative-config applied?")
    if res.counters.accepted == 0:
        pytest.fail(f"vLLM accepted no draft token over {res.counters.drafts:.0f} drafts: {WIRING_HINT}")
    ref = eagle3_ab["spec"][0]
    samples = {"accept_length": [res.accept_length], "accept_rate": [res.accept_rate]}
    for i, r in enumerate(res.pos_rates()[:4]):
        samples[f"accept_rate_pos{i}"] = [r]
    table = ("| engine | accept length | accept rate | pos0 | pos1 | pos2 |\n|---|---|---|---|---|---|\n"
             + "\n".join(f"| {n} | {r.accept_length:.3f} | {r.accept_rate:.3f} | "
                         + " | ".join(f"{x:.3f}" for x in r.pos_rates()[:3]) + " |" for n, r in (("reference", ref), ("vllm", res))))
    log("eagle3 same drafter, two engines:\n" + table)
    perf_gate.check(scenario="eagle3_acceptance", engine="vllm", model=target_model.name,
                    workload=_workload(perf_session, eagle3_drafter), concurrency=1, samples=samples,
                    gated=["accept_length"], engine_version=srv.version, extra={"markdown": table})
