"""Each engine's serving path against transformers at the drafter's aux layers, and SGLang's layer-id
rule checked with a planted one-layer offset.

Why per engine: the reference engine, SGLang and vLLM compute the residual stream with their own kernels
and name layers by their own rules, and a drafter trained on transformers features is only served right
when the engine feeds it those same layers. For every engine of ``alignment.engines`` the tokens it
generated (greedy, prompts batched) go through one full-sequence transformers forward (how training
features are captured) and are compared layer by layer, each layer gated on its own threshold: the
reference engine's noise floor for that layer, with the cosine distance widened by
``alignment.engine_noise_factor`` for another engine's kernels (kimi_perf.alignment.plan says why 2).

Layer convention throughout: "residual stream entering layer k" (= output of layer k-1; vLLM's and
transformers' hidden_states[k]); "final" = output of the final RMSNorm.

Where each engine's states come from, and what that costs in launches:

- reference: its aux mode (AlignmentContext.inference; the server test_alignment.py already uses);
- SGLang 0.5.17 has no capture-only aux mode: the EAGLE-3 A/B's speculative server (the session's
  drafter, ``--enable-return-hidden-states``) returns the drafter's aux layers (ids from the drafter's
  ``eagle_config``, or SGLang's default [2, N//2, N-3]; for Llama an explicit id i is entering layer i+1)
  and its plain server the final-norm output. Both are captured while the A/B runs, so this test
  launches nothing when test_eagle3.py ran first in the session (file order does that);
- vLLM: its extract_hidden_states method with the suite's connector, shared with test_alignment.py's
  vLLM test (one launch for both), used as upstream documents it: the generated ids are prefilled as a
  prompt with ``max_tokens=1`` (kimi_perf.capture.vllm). The decode-path capture of the same
  positions is compared with that prefill capture by its own test, which names the upstream fault
  when it reproduces (``scripts/repro_vllm_decode_capture.py`` reproduces it without the suite).

The planted test serves a drafter copy whose explicit aux ids are what someone who forgot SGLang's +1
writes ([2, 15, 27] for layers [2, 15, 27], so SGLang captures [3, 16, 28]) and asserts the check names
"off-by-one layer id"; its accept length is reported next to the correctly served drafter's.
"""

from __future__ import annotations

import json
import shutil
import warnings
from typing import Any

import numpy as np
import pytest

from kimi_perf.alignment.diagnose import AlignmentError, AlignmentReport, check_layers
from kimi_perf.alignment.extract import HiddenStates, Provenance
from kimi_perf.keys import eagle3_workload
from kimi_perf.progress import log
from kimi_perf.suite.alignment import EngineCapture, wants_capture
from kimi_perf.suite.drafters import eval_settings, planted_sglang_config, require_engine

pytestmark = [pytest.mark.perf, pytest.mark.alignment]

CONVENTION = ("residual stream entering layer k (= output of layer k-1; transformers hidden_states[k], vLLM's "
              "ids); 'final' = output of the final RMSNorm")
SGLANG_RULE = ("SGLang Llama: explicit drafter id i captures the output of layer i = entering layer i+1 "
               "(sglang 0.5.17 python/sglang/srt/models/llama.py LlamaForCausalLM.set_eagle3_layers_to_capture: "
               "layers_to_capture = [i + 1 for i in ids], appended before layer j runs in LlamaModel.forward); "
               "no ids: [2, N//2, N-3] unshifted; DeepSeek/Kimi adds 1 only when the first id is 1 "
               "(models/deepseek_v2.py)")


def _dtype(s: Any, engine: str) -> str:
    from kimi_perf.alignment.plan import PlanError, serving_dtype

    try:
        return serving_dtype(s.profile.engines[engine])
    except PlanError as e:
        raise pytest.UsageError(f"profile {s.profile.path}: engines.{engine}.{e}") from None


def _threshold(alignment: Any, engine: str, dtype: str, layer: Any) -> tuple[float, float, str]:
    """The engine's threshold for ``layer``; a layer without a measured noise floor (one a planted
    offset moved to) borrows its nearest measured layer's."""
    if layer in alignment.st.layers:
        return alignment.engine_threshold(engine, dtype, layer)
    near = min((k for k in alignment.st.layers if isinstance(k, int)), key=lambda k: abs(k - layer))
    thr, tol, src = alignment.engine_threshold(engine, dtype, near)
    return thr, tol, f"{src} (layer {near}'s, the nearest measured)"


def _only(h: HiddenStates, layers: list[Any], note: str = "") -> HiddenStates:
    p = h.provenance
    return HiddenStates({k: h.get(k) for k in layers}, h.token_ids, Provenance(
        p.backend, p.version, p.dtype, p.positions, p.layer_convention, p.note + note), h.output_ids, h.prompt_len)


def _relabel(h: HiddenStates, mapping: dict[Any, Any], note: str) -> HiddenStates:
    """Columns ``mapping[new] = old``: the engine's rows named as someone else (the drafter) reads them."""
    p = h.provenance
    return HiddenStates({new: h.get(old) for new, old in mapping.items()}, h.token_ids, Provenance(
        p.backend, p.version, p.dtype, p.positions, p.layer_convention, f"{p.note}; {note}"), h.output_ids,
        h.prompt_len)


def _neighbours(k: Any, n: int) -> list[Any]:
    if k == "final":
        return [n]
    return [j for j in (k - 1, k + 1) if 0 <= j <= n]


def _compare(alignment: Any, engine: str, dtype: str, cap: EngineCapture, gated: list[Any], *,
             label: str, ids: dict[Any, str], relabel: dict[Any, Any] | None = None
             ) -> tuple[AlignmentReport, list[dict[str, Any]]]:
    """Per-layer verdicts of ``cap`` (columns ``gated``, or ``relabel[new] = old``) against transformers
    on the same tokens, each layer on its own threshold; plus one row per layer for the table, with
    whether an off-by-one would still fail at that threshold (transformers' own adjacent layers)."""
    from kimi_perf.alignment.compare import compare_layer
    from kimi_perf.alignment.plan import diagnosis_layers

    st = alignment.st
    hf = alignment.hf(dtype)
    thr = {k: _threshold(alignment, engine, dtype, k) for k in gated}
    pairs, adj = [], {k: {} for k in gated}
    for h in cap.states:
        side = (_relabel(h, relabel, "columns labelled as the drafter consumes them") if relabel
                else _only(h, gated))
        ref = hf.hidden_states(h.token_ids, diagnosis_layers(gated, st.num_layers))
        pairs.append((side, ref))
        for k in gated:
            for j in _neighbours(k, st.num_layers):
                c = compare_layer(ref.get(j), ref.get(k)).cos_min
                adj[k][j] = min(adj[k].get(j, 1.0), c)
    rep = check_layers(pairs, {k: (t[0], t[1]) for k, t in thr.items()}, final_norm_weight=hf.final_norm_weight,
                       num_layers=st.num_layers, pair=f"{engine} {label} vs transformers [{dtype}]")
    rows = []
    for v in rep.verdicts:
        k = v.layer
        a = max(adj[k].values()) if adj[k] else float("nan")
        t, tol, src = thr[k]
        rows.append({"layer": k, "engine_id": ids.get(k, str(k)), "capture": label, "v": v, "threshold": t,
                     "norm_tol": tol, "threshold_source": src, "adjacent_cos_min": a, "resolves_off_by_one": a < t})
    return rep, rows


def _table(engine: str, dtype: str, rows: list[dict[str, Any]], provenance: dict[str, Any]) -> str:
    head = (f"**alignment: {engine} serving path vs transformers [{dtype}]**\n\n"
            f"layer convention: {CONVENTION}\n\n"
            "| capture | layer | engine's id | cos min | cos p1 | cos mean | rel L2 max | norm ratio | threshold "
            "| norm tol | resolves off-by-one (adjacent cos min) | ok |\n"
            "|---|---|---|---|---|---|---|---|---|---|---|---|")
    lines = [head]
    for r in rows:
        c, v = r["v"].comparison, r["v"]
        lines.append(f"| {r['capture']} | {r['layer']} | {r['engine_id']} | {c.cos_min:.6f} | {c.cos_p1:.6f} | "
                     f"{c.cos_mean:.6f} | {c.rel_l2_max:.4f} | {c.norm_ratio_median:.4f} | {r['threshold']:.6f} | "
                     f"{r['norm_tol']:.4f} | {'yes' if r['resolves_off_by_one'] else '**no**'} "
                     f"({r['adjacent_cos_min']:.4f}) | {'yes' if v.ok else '**no**: ' + (v.cause or '')} |")
    lines += ["", *[f"- {k}: {v}" for k, v in provenance.items() if k != "layer convention"]]  # in the head
    return "\n".join(lines)


def _record(perf_gate: Any, alignment: Any, engine: str, dtype: str, rows: list[dict[str, Any]],
            provenance: dict[str, Any], version: str | None, scenario: str, table: str) -> None:
    for i, r in enumerate(rows):
        c = r["v"].comparison
        extra = {"capture": r["capture"], "engine_id": r["engine_id"], "threshold": r["threshold"],
                 "norm_tol": r["norm_tol"], "threshold_source": r["threshold_source"],
                 "adjacent_cos_min": r["adjacent_cos_min"], "resolves_off_by_one": bool(r["resolves_off_by_one"]),
                 "ok": r["v"].ok, "cause": r["v"].cause, "provenance": provenance}
        if i == len(rows) - 1:
            extra["markdown"] = table  # once per test: report.py appends every record's markdown
        perf_gate.check(scenario=scenario, engine=engine, model=alignment.target.name,
                        workload=f"{dtype}:{r['capture']}:layer-{r['layer']}", concurrency=1,
                        samples={"cosine_min": [c.cos_min], "cosine_p1": [c.cos_p1], "cosine_mean": [c.cos_mean],
                                 "rel_l2_max": [c.rel_l2_max]}, gated=[], engine_version=version, extra=extra)


def _warn_unresolved(engine: str, rows: list[dict[str, Any]]) -> None:
    from kimi_perf.plugin import PerfWarning

    for r in rows:
        if not r["resolves_off_by_one"]:
            msg = (f"alignment [{engine}] layer {r['layer']}: threshold {r['threshold']:.5f} is below transformers' "
                   f"own adjacent-layer cos min {r['adjacent_cos_min']:.5f}, so an off-by-one layer id would pass "
                   "there on cosine (only the norm ratio could catch it); lower alignment.engine_noise_factor or "
                   "alignment.margin if the measured cosines allow")
            log(msg)
            warnings.warn(PerfWarning(msg), stacklevel=2)


def _sglang_ids(cap: EngineCapture) -> dict[Any, str]:
    if cap.layers == ("final",):
        return {"final": "final-norm rows (plain --enable-return-hidden-states)"}
    if cap.server_ids is None:
        return {k: f"default (SGLang's [2, N//2, N-3] -> {k})" for k in cap.layers}
    return {k: f"{i} ({cap.convention}: -> {k})" for k, i in zip(cap.layers, cap.server_ids)}


def test_engine_alignment_vs_hf(align_engine, alignment, perf_session, perf_gate, request):
    """The engine's serving-path hidden states == transformers' training-style capture, on the tokens the
    engine generated, at the drafter's aux layers (SGLang's id rule applied), plus the last pre-norm
    layer and the final-norm output where the engine offers them; every layer on its own threshold."""
    s, name = perf_session, align_engine
    kind = require_engine(s.eagle3_settings(), name)
    dtype = _dtype(s, name)
    st = alignment.st
    n = st.num_layers
    aux = list(st.aux)
    work: list[tuple[str, EngineCapture, list[Any], dict[Any, str]]] = []
    provenance: dict[str, Any] = {"layer convention": CONVENTION, "transformers": None}
    served_vs_trained = None
    if kind == "reference":
        inf = alignment.inference(dtype)  # cached from test_alignment.py: no server needed when it ran
        cap = EngineCapture(inf, tuple(st.served), tuple(st.served), "reference",
                            "reference engine aux mode: ids are entering-layer-k already",
                            alignment.server_config(dtype).name, inf[0].provenance.version)
        work.append(("aux-mode", cap, [*aux, n, "final"], {k: str(k) for k in [*aux, n, "final"]}))
    elif kind == "sglang":
        runs = request.getfixturevalue("eagle3_runs")
        cfgs = runs.configs(name)
        # the planted test needs the correct drafter's acceptance; without an A/B in this session its one
        # pass reuses the speculative server, so keep it up rather than pay a second launch
        keep = wants_capture(request.session, "planted_engine", name) and runs.cached(name) is None
        spec = alignment.capture(cfgs["spec"], stop=not keep)
        plain = alignment.capture(cfgs["plain"])
        from kimi_perf.alignment.plan import drafter_aux_layers

        trained = drafter_aux_layers(json.loads((runs.drafter.path / "config.json").read_text()), n)
        served_vs_trained = (tuple(spec.layers), trained, spec.server_ids)
        work.append(("spec-hs", spec, list(spec.layers), _sglang_ids(spec)))
        work.append(("plain-hs", plain, ["final"], _sglang_ids(plain)))
        provenance["SGLang id rule"] = SGLANG_RULE
        provenance["drafter"] = f"{runs.drafter.path} (trained on entering layers {list(trained)})"
    elif kind == "vllm":
        cap = alignment.vllm_capture(name, (*aux, n))
        work.append(("extract", cap, [*aux, n], {k: f"{k} (vLLM id = entering layer)" for k in [*aux, n]}))
        provenance["final"] = "not offered: vLLM's extract_hidden_states returns pre-final-norm layers only"
    else:
        pytest.fail(f"engine {name}: kind {kind} has no serving-path capture here", pytrace=False)
    rows: list[dict[str, Any]] = []
    reports = []
    for label, cap, gated, ids in work:
        provenance[f"{label} capture"] = f"{cap.config_name} ({cap.version}): {cap.how}"
        rep, r = _compare(alignment, name, dtype, cap, gated, label=label, ids=ids)
        reports.append(rep)
        rows += r
    provenance["transformers"] = (f"{alignment.hf(dtype).version}, one full-sequence forward per prompt, "
                                  "pre-hooks on each decoder layer (training-style capture)")
    table = _table(name, dtype, rows, provenance)
    log(table)
    version = work[0][1].version
    _record(perf_gate, alignment, name, dtype, rows, provenance, version, "alignment_engine_vs_hf", table)
    _warn_unresolved(name, rows)
    failed = [v.message or "" for rep in reports for v in rep.failures()]
    if served_vs_trained is not None and served_vs_trained[0] != served_vs_trained[1]:
        got, trained, ids = served_vs_trained
        failed.append(f"SGLang feeds the drafter entering layers {list(got)} (its ids {ids}) but it was trained on "
                      f"{list(trained)}: the drafter config's eagle_aux_hidden_state_layer_ids are in another "
                      f"convention ({'off-by-one layer id' if all(abs(a - b) == 1 for a, b in zip(got, trained)) else 'layer id mismatch'})")
    if failed:
        raise AlignmentError(f"{name} serving path vs transformers [{dtype}]:\n  " + "\n  ".join(failed))


UPSTREAM_DECODE_FAULTS = (
    "vLLM #43805 (blocks freed before the hidden-states save completed; merged 2026-05-27) and #56417 / "
    "PR #56442 (the extraction path reads only the first column of sampled tokens on multi-token outputs)")


def test_vllm_decode_path_capture(decode_engine, alignment, perf_session):
    """vLLM's decode-path capture (``include_output_tokens``) against its own prefill capture of the
    same ids, layer by layer on the engine's thresholds.

    Its own verdict, apart from the alignment gate (which uses the prefill capture): agreement passes;
    generated rows that disagree while every prompt row agrees are the upstream decode-path fault, an
    expected failure (xfail) that names it and the standalone reproduction; any other disagreement
    (prompt rows too) fails, because then the prefill capture the gate relies on is in doubt."""
    from kimi_perf.alignment.diagnose import check_alignment

    s, name = perf_session, decode_engine
    require_engine(s.eagle3_settings(), name)
    dtype = _dtype(s, name)
    st = alignment.st
    layers = [*st.aux, st.num_layers]
    cap = alignment.vllm_capture(name, tuple(layers))
    assert len(cap.decode_path) == len(cap.states), "the capture kept no decode-path rows to check"
    msgs, causes = [], []
    for i, (dec, pre) in enumerate(zip(cap.decode_path, cap.states)):
        for k in layers:
            thr, tol, _ = _threshold(alignment, name, dtype, k)
            rep = check_alignment(dec, pre, [k], threshold=thr, norm_ratio_tol=tol, num_layers=st.num_layers)
            for v in rep.failures():
                msgs.append(f"prompt {i}: {v.message}")
                causes.append(v.cause or "")
    log(f"{name}: decode-path capture vs prefill capture of the same ids ({cap.version}): "
        + ("agree at every layer" if not msgs else f"{len(msgs)} layer(s) disagree"))
    if not msgs:
        return
    if all("decode-path capture fault" in c for c in causes):
        pytest.xfail(f"{name} ({cap.version}): upstream decode-path capture fault reproduced, the alignment gate "
                     f"uses the prefill capture; candidates {UPSTREAM_DECODE_FAULTS}; reproduce without the suite: "
                     f"python scripts/repro_vllm_decode_capture.py --help. First: {msgs[0]}")
    pytest.fail(f"{name}: vLLM's decode-path and prefill captures of the same ids disagree beyond the decode "
                "rows:\n  " + "\n  ".join(msgs[:12]), pytrace=False)


@pytest.mark.eagle
def test_sglang_planted_layer_offset_is_named(planted_engine, alignment, perf_session, perf_gate, server_pool,
                                              target_model, request, tmp_path_factory):
    """A drafter copy with explicit aux ids one layer off in SGLang's convention (the +1 rule forgotten):
    the capture must (1) sit at the layers SGLang's rule says (the rule itself, from data) and (2) fail
    the alignment check as the drafter consumes it, naming "off-by-one layer id"; its accept length is
    reported next to the correctly served drafter's."""
    from kimi_perf.alignment.plan import PlanError, drafter_aux_layers, planted_sglang_offset
    from kimi_perf.eagle3.evaluate import measure_generation
    from kimi_perf.engines.reference.drafter_model import sglang_aux_convention
    from kimi_perf.plugin import PerfWarning

    s, name = perf_session, planted_engine
    require_engine(s.eagle3_settings(), name)
    runs = request.getfixturevalue("eagle3_runs")
    dtype = _dtype(s, name)
    st = alignment.st
    src_cfg = json.loads((runs.drafter.path / "config.json").read_text())
    try:
        trained = drafter_aux_layers(src_cfg, st.num_layers)
        plant = planted_sglang_offset(trained, sglang_aux_convention(st.architectures))
    except (PlanError, ValueError) as e:
        pytest.fail(f"cannot plant an SGLang layer offset for this drafter/target: {e}", pytrace=False)
    # the correct drafter first (cached from the A/B, or one pass), so two SGLang servers never overlap here
    good, good_src = runs.accept_length(name)
    bad = tmp_path_factory.mktemp("drafter-planted-offset") / "drafter"
    shutil.copytree(runs.drafter.path, bad)
    (bad / "config.json").write_text(json.dumps(plant.draft_config(src_cfg), indent=1))
    max_new, _, _ = eval_settings(s.eagle3_settings())
    cfg = planted_sglang_config(s.eagle3_settings(), target_model, name, bad, runs.drafter.steps)
    srv = server_pool.get(cfg)
    try:
        cap = alignment.capture(cfg, srv, stop=False)
        acc = measure_generation(srv.base_url, srv.model, [list(p) for p in runs.drafter.eval_prompts], max_new,
                                 name=f"eagle3-{name}-planted")
    finally:
        server_pool.stop(cfg)
    assert tuple(cap.layers) == plant.served, (
        f"the suite's SGLang mapping (kimi_perf.alignment.extract.server_layers) names the planted ids "
        f"{list(plant.written)} entering layers {list(cap.layers)}, the plan expected {list(plant.served)}")
    ids = {k: f"{i} (-> {s_})" for k, i, s_ in zip(trained, plant.written, plant.served)}
    # (1) the rule from data: columns named by SGLang's rule match transformers at those layers
    rule_rep, rule_rows = _compare(alignment, name, dtype, cap, list(plant.served), label="planted-rule-applied",
                                   ids={s_: f"{i} ({plant.convention} rule)"
                                        for i, s_ in zip(plant.written, plant.served)})
    # (2) as served: the drafter reads column j as trained[j]
    as_served, rows = _compare(alignment, name, dtype, cap, list(trained), label="planted-as-drafter-reads",
                               ids=ids, relabel=dict(zip(trained, plant.served)))
    ratio = (acc.accept_length - 1) / (good.accept_length - 1) if good.accept_length > 1 else float("nan")
    acc_table = ("| drafter | aux ids written | SGLang captures (entering) | accept length | accept rate | pos0 | pos1 "
                 "| pos2 |\n|---|---|---|---|---|---|---|---|\n"
                 + "\n".join(f"| {lbl} | {w} | {c} | {r.accept_length:.3f} | {r.accept_rate:.3f} | "
                             + " | ".join(f"{x:.3f}" for x in (r.pos_rates()[:3] or [float('nan')] * 3)) + " |"
                             for lbl, w, c, r in (
                                 (f"correct ({good_src})", (src_cfg.get("eagle_config") or {}).get(
                                     "eagle_aux_hidden_state_layer_ids") or "none (SGLang's default)",
                                  list(trained), good),
                                 ("planted", list(plant.written), list(plant.served), acc)))
                 + f"\n\naccepted drafts per step, planted / correct: x{ratio:.3f}")
    provenance = {"layer convention": CONVENTION, "SGLang id rule": SGLANG_RULE,
                  "planted": f"{plant.why}: ids {list(plant.written)} for a drafter trained on {list(trained)} "
                             f"(correct ids {list(plant.correct_ids)}, {plant.convention})",
                  "capture": f"{cap.config_name} ({cap.version}): {cap.how}"}
    table = _table(name, dtype, rule_rows + rows, provenance) + "\n\n" + acc_table
    log(table)
    _record(perf_gate, alignment, name, dtype, rule_rows + rows, provenance, cap.version,
            "alignment_sglang_planted_offset", table)
    perf_gate.check(scenario="eagle3_planted_offset", engine=name, model=target_model.name,
                    workload=eagle3_workload(s.profile),
                    concurrency=1, samples={"accept_length": [acc.accept_length]}, gated=[],
                    engine_version=cap.version,
                    extra={"correct_accept_length": good.accept_length, "correct_source": good_src,
                           "accepted_drafts_ratio": ratio, "written_ids": list(plant.written),
                           "served_layers": list(plant.served), "trained_layers": list(trained)})
    if not rule_rep.ok:
        pytest.fail(f"SGLang {cap.version} does not capture what its layer-id rule says for explicit ids "
                    f"{list(plant.written)} (expected entering layers {list(plant.served)}): the suite's mapping "
                    "(kimi_perf.engines.reference.drafter_model.effective_aux_layers) is wrong for this release:\n  "
                    + "\n  ".join(v.message or "" for v in rule_rep.failures()), pytrace=False)
    if as_served.ok:
        pytest.fail(f"planted offset not detected [{name}]: SGLang feeds entering layers {list(plant.served)} to a "
                    f"drafter trained on {list(trained)} and every layer passed: "
                    + "; ".join(f"layer {r['layer']} cos min {r['v'].comparison.cos_min:.5f} >= threshold "
                                f"{r['threshold']:.5f} (transformers' adjacent-layer cos min "
                                f"{r['adjacent_cos_min']:.5f})" for r in rows), pytrace=False)
    with pytest.raises(AlignmentError) as ei:
        as_served.raise_if_failed()
    msg = str(ei.value)
    log(f"planted SGLang offset [{name}]: " + msg.replace("\n", " |"))
    misnamed = [v for v in as_served.failures() if "off-by-one layer id" not in (v.cause or "")]
    assert not misnamed, ("the planted offset was caught but its cause misnamed: "
                          + "; ".join(f"layer {v.layer}: {v.cause}" for v in misnamed))
    assert "off-by-one layer id" in msg
    missed = [v.layer for v in as_served.verdicts if v.ok]
    if missed:
        warnings.warn(PerfWarning(f"planted SGLang offset [{name}]: layer(s) {missed} passed one layer off (their "
                                  "thresholds cannot resolve adjacent layers); the others named it"), stacklevel=1)
    ev = s.profile.eagle3.eval
    max_ratio, resolvable = ev.mismatch_max_accept_ratio, ev.mismatch_min_accept_length
    log(f"planted SGLang offset [{name}]: accept length {acc.accept_length:.3f} vs {good.accept_length:.3f} "
        f"served right (accepted drafts x{ratio:.3f})")
    # null: the profile measured that an offset costs its drafter little acceptance, so the drop is
    # reported (above) and not compared with a bound
    if max_ratio is not None and good.accept_length >= resolvable and not ratio < max_ratio:
        warnings.warn(PerfWarning(
            f"planted SGLang offset [{name}]: accepted drafts per step x{ratio:.3f} of the correct drafter's, not "
            f"below eval.mismatch_max_accept_ratio {max_ratio}: serving one layer off barely hurts this drafter"),
            stacklevel=1)
    assert np.isfinite(acc.accept_length), "the planted server reported no acceptance"
