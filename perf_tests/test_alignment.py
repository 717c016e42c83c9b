"""Hidden-state alignment: does the serving path compute the features the drafter was trained on?

Pairs measured on the embedded model: transformers offline (one full-sequence forward, how training
features are captured) vs the reference engine's inference path (prefill + incremental decode with a
KV cache, batched with other requests), per EAGLE-3 aux layer, the pre-norm last layer and the
final-norm output; fp32 vs bf16; stored drafter features vs live inference. Thresholds come from the
engine's own noise floor (alone vs batched, prefill vs decode), stored per profile and dtype. Each
planted fault must fail with its cause named.

Run one alone on a laptop: ``pytest perf_tests/test_alignment.py -k "extraction and float32"``.

These tests measure the reference engine (the vLLM one also vLLM) and skip when --perf-engine leaves
it out; SGLang's and vLLM's serving paths against transformers per engine are test_engine_alignment.py.
"""

from __future__ import annotations

import numpy as np
import pytest

from kimi_perf.alignment.diagnose import AlignmentError, check_alignment, check_layers, heatmap_png
from kimi_perf.alignment.extract import HiddenStates
from kimi_perf.progress import log

pytestmark = [pytest.mark.perf, pytest.mark.alignment]

DTYPES = ["float32", "bfloat16"]
LAYER_IDS = ["eagle-low", "eagle-mid", "eagle-high", "last-prenorm", "final"]


def _engines(*names):
    """The engines a test measures (default: the reference engine), read by :func:`_selected`."""
    def deco(f):
        f.kimi_perf_engines = names
        return f
    return deco


@pytest.fixture(autouse=True)
def _selected(request, perf_session):
    """Skip a test whose engines --perf-engine left out: a per-engine GPU run must not pay for them."""
    need = getattr(request.function, "kimi_perf_engines", ("reference",))
    left_out = [e for e in need if e not in perf_session.engines]
    if left_out:
        pytest.skip(f"measures {', '.join(left_out)}; --perf-engine selected {', '.join(perf_session.engines)}")


def _layer(alignment, name):
    st = alignment.st
    return dict(zip(LAYER_IDS, st.layers))[name]


def _record(perf_gate, alignment, scenario, workload, report, extra=None):
    v = report.verdicts
    samples = {"cosine_min": [x.comparison.cos_min for x in v], "cosine_p1": [x.comparison.cos_p1 for x in v],
               "cosine_mean": [x.comparison.cos_mean for x in v], "rel_l2_max": [x.comparison.rel_l2_max for x in v]}
    perf_gate.check(scenario=scenario, engine="reference", model=alignment.target.name, workload=workload,
                    concurrency=1, samples=samples, gated=[], extra={"markdown": report.markdown(), **(extra or {})})


@pytest.mark.parametrize("dtype", DTYPES)
def test_noise_floor(alignment, perf_gate, dtype):
    """The engine against itself: alone vs batched, prefill vs decode. Records the floor per layer
    (``--perf-update-baselines`` stores it; later runs derive thresholds from the stored floor)."""
    floor = alignment.noise_floor(dtype)
    rows = []
    for k in alignment.st.layers:
        f = floor[k]
        perf_gate.check(scenario="alignment_noise_floor", engine="reference", model=alignment.target.name,
                        workload=f"{dtype}:layer-{k}", concurrency=1,
                        samples={"cosine_min": [f["cosine_min"]], "cosine_p1": [f["cosine_p1"]],
                                 "cosine_mean": [f["cosine_mean"]], "rel_l2_max": [f["rel_l2_max"]]}, gated=[])
        rows.append(f"layer {k}: cos min {f['cosine_min']:.7f} mean {f['cosine_mean']:.7f} norm dev {f['norm_dev']:.2e}")
        assert f["cosine_min"] > 0.99, f"{dtype} layer {k}: the engine disagrees with itself (cos {f['cosine_min']:.4f})"
    log(f"alignment noise floor [{dtype}]: " + "; ".join(rows))


@pytest.mark.parametrize("layer", LAYER_IDS)
@pytest.mark.parametrize("dtype", DTYPES)
def test_extraction_vs_inference(alignment, perf_gate, dtype, layer, perf_session):
    """Training-style capture (transformers, full sequence) == serving-path hidden states."""
    k = _layer(alignment, layer)
    hf = alignment.hf(dtype)
    thr, tol, src = alignment.threshold(dtype, k)
    reports = []
    for inf in alignment.inference(dtype):
        ext = hf.hidden_states(inf.token_ids, [k])
        reports.append(check_alignment(ext, inf, [k], threshold=thr, norm_ratio_tol=tol,
                                       final_norm_weight=hf.final_norm_weight, num_layers=alignment.st.num_layers))
    worst = min(reports, key=lambda r: r.verdicts[0].comparison.cos_min)
    png = perf_session.report_dir / f"alignment-hf-vs-inference-{dtype}-{layer}.png"
    png.parent.mkdir(parents=True, exist_ok=True)
    heatmap_png(worst, str(png))
    _record(perf_gate, alignment, "alignment_hf_vs_inference", f"{dtype}:layer-{k}", worst,
            {"threshold": thr, "threshold_source": src, "heatmap": str(png)})
    for r in reports:
        r.raise_if_failed()


def test_fp32_vs_bf16(alignment, perf_gate):
    """The serving dtype's effect on the features, on the tokens both dtypes generated identically."""
    hf32 = alignment.hf("float32")
    inf16 = alignment.inference("bfloat16")
    # each layer on its own bf16 threshold: the bf16 noise floor already holds the fp32-vs-bf16 distance
    # of both the engine and transformers per layer (AlignmentContext.noise_floor)
    thr = {k: (t, max(tol, 0.02)) for k in alignment.st.layers for t, tol, _ in [alignment.threshold("bfloat16", k)]}
    worst = None
    for inf in inf16:
        ext = hf32.hidden_states(inf.token_ids, list(alignment.st.layers))
        rep = check_layers([(ext, inf)], thr, final_norm_weight=hf32.final_norm_weight,
                           num_layers=alignment.st.num_layers)
        if worst is None or min(v.comparison.cos_min for v in rep.verdicts) < min(v.comparison.cos_min for v in worst.verdicts):
            worst = rep
    _record(perf_gate, alignment, "alignment_fp32_vs_bf16", "hf-fp32:inference-bf16", worst)
    worst.raise_if_failed()


def _planted(ext: HiddenStates, fault: str, alignment) -> tuple[HiddenStates, object, str]:
    st = alignment.st
    mid = st.layers[1]
    L = dict(ext.layers)
    if fault == "layer-offset":
        L[mid] = ext.layers[mid + 1]  # captured one layer late, labelled as the intended layer
        return HiddenStates(L, ext.token_ids, ext.provenance), mid, "off-by-one layer id"
    if fault == "post-norm":
        L[st.num_layers] = ext.layers["final"]  # the "last layer" taken after the final norm
        return HiddenStates(L, ext.token_ids, ext.provenance), st.num_layers, "post-norm vs pre-norm"
    if fault == "token-shift":
        x = ext.layers[mid]
        L[mid] = np.vstack([x[1:], x[-1:]])
        return HiddenStates(L, ext.token_ids, ext.provenance), mid, "one-token shift"
    if fault == "int8":
        x = ext.layers[mid]
        s = np.abs(x).max(1, keepdims=True) / 127.0
        L[mid] = np.round(x / s) * s
        return HiddenStates(L, ext.token_ids, ext.provenance), mid, "precision loss: extracted values are rounded to int8"
    if fault == "fp8":
        import torch

        # saturate to e4m3's finite range first, as fp8 quantizers do: a bare cast of a value beyond
        # +-448 is NaN in some torch releases (2.11 on the H200) and saturates in others (2.13)
        L[mid] = torch.from_numpy(ext.layers[mid]).clamp(-448.0, 448.0).to(torch.float8_e4m3fn).float().numpy()
        return HiddenStates(L, ext.token_ids, ext.provenance), mid, "precision loss: extracted values are rounded to fp8"
    raise ValueError(fault)


# int8/fp8 rounding of *fp32* features is a real precision drop; in bf16 its error is below the bf16
# noise floor itself (per-token int8 ~0.9999 cosine vs bf16's ~0.997), so only fp32 can flag it.
FAULTS = [("layer-offset", "float32"), ("post-norm", "float32"), ("token-shift", "float32"), ("int8", "float32"),
          ("fp8", "float32"), ("layer-offset", "bfloat16"), ("post-norm", "bfloat16"), ("token-shift", "bfloat16")]


@pytest.mark.parametrize("fault, dtype", FAULTS, ids=[f"{f}-{d}" for f, d in FAULTS])
def test_planted_fault_is_caught_with_its_cause(alignment, fault, dtype):
    """Each classic capture bug must FAIL the alignment check, and the message must name it."""
    hf = alignment.hf(dtype)
    inf = alignment.inference(dtype)[0]
    ext = hf.hidden_states(inf.token_ids, list(alignment.st.served))
    bad, layer, cause = _planted(ext, fault, alignment)
    thr, tol, src = alignment.threshold(dtype, layer)
    rep = check_alignment(bad, inf, [layer], threshold=thr, norm_ratio_tol=tol, final_norm_weight=hf.final_norm_weight,
                          num_layers=alignment.st.num_layers)
    if rep.ok:
        c = rep.verdicts[0].comparison
        pytest.fail(f"planted {fault} fault [{dtype}] passed the alignment check: layer {layer} cos min "
                    f"{c.cos_min:.7f} >= threshold {thr:.7f} ({src}), norm ratio {c.norm_ratio_median:.5f} "
                    f"within +-{tol:.4f}; the noise floor is as wide as the fault, so the check cannot see it")
    with pytest.raises(AlignmentError) as ei:
        rep.raise_if_failed()
    log(f"planted {fault} [{dtype}]: " + str(ei.value).replace("\n", " |"))
    assert cause in str(ei.value), f"the {fault} fault was caught but its cause was misnamed: {ei.value}"


@_engines("vllm", "reference")
def test_vllm_extraction_vs_hf_and_reference(alignment, perf_session, perf_gate):
    """vLLM's extract_hidden_states path (CPU-safe connector) against transformers offline and the
    reference engine, on the tokens vLLM generated. vLLM's last layer is *pre*-final-norm: it must
    match the other paths' pre-norm layer N, and the diagnosis must say so if compared with 'final'."""
    if "vllm" not in perf_session.profile.engines:
        pytest.skip(f"profile {perf_session.profile.name} has no vllm engine")
    from kimi_perf.alignment.extract import server_hidden_states

    st = alignment.st
    layers = [k for k in st.layers if isinstance(k, int)]  # [2, N//2, N-3, N]
    # one extract_hidden_states server per session: test_engine_alignment.py's vLLM case reads the same capture
    got = alignment.vllm_capture("vllm", tuple(layers)).states
    hf = alignment.hf("bfloat16")
    ref_srv = alignment.server("bfloat16")
    worst = {}
    for v in got:
        ext = hf.hidden_states(v.token_ids, [*layers, "final"])
        ref = server_hidden_states(ref_srv.base_url, [list(v.token_ids)], 1, hidden=st.hidden)[0]
        # each layer on its own threshold: the bf16 noise floor of layer 2 is ~100x tighter than the
        # last layer's, and the loosest layer's threshold applied to all would blind the early ones
        thr = {k: (alignment.threshold("bfloat16", k)[0], 0.03) for k in layers}
        for name, other in (("hf-offline", ext), ("reference-inference", ref)):
            rep = check_layers([(v, other)], thr, final_norm_weight=hf.final_norm_weight, num_layers=st.num_layers)
            if name not in worst or min(x.comparison.cos_min for x in rep.verdicts) < min(
                    x.comparison.cos_min for x in worst[name].verdicts):
                worst[name] = rep
        # vLLM's layer N compared with a post-norm 'final' must be diagnosed as the norm difference
        mixed = type(v)({**v.layers, "final": v.layers[st.num_layers]}, v.token_ids, v.provenance)
        rep = check_alignment(mixed, ext, ["final"], threshold=0.99, norm_ratio_tol=0.03,
                              final_norm_weight=hf.final_norm_weight, num_layers=st.num_layers)
        assert not rep.ok and "norm" in (rep.verdicts[0].cause or ""), rep.verdicts[0].message
    for name, rep in worst.items():
        perf_gate.check(scenario="alignment_vllm_vs_" + name.replace("-", "_"), engine="vllm",
                        model=alignment.target.name, workload="bfloat16:eagle3-layers+N", concurrency=1,
                        samples={"cosine_min": [x.comparison.cos_min for x in rep.verdicts],
                                 "cosine_mean": [x.comparison.cos_mean for x in rep.verdicts]},
                        gated=[], extra={"markdown": rep.markdown()})
        log(f"alignment vLLM vs {name}: " + ", ".join(f"layer {x.layer} cos min {x.comparison.cos_min:.5f}"
                                                       for x in rep.verdicts))
    for rep in worst.values():
        rep.raise_if_failed()
