"""Throughput gates: single-stream decode speed and a concurrency sweep, per engine of the profile.

Every engine is measured by the same client with the same pinned workload, so the sweep's table and
plot compare SGLang, vLLM and the reference engine like for like. Workload sizes, concurrency levels,
repeats and gated metrics come from the profile; tolerances from its ``gate`` section.
"""

from __future__ import annotations

import contextlib

import pytest

from kimi_perf.bench import check_errors, measure, samples_of
from kimi_perf.keys import scenario_workload

pytestmark = pytest.mark.perf

REPORTED = ["output_throughput", "steady_output_throughput", "request_throughput", "decode_tok_s",
            "ttft_ms_p50", "ttft_ms_p99", "tpot_ms_p50", "tpot_ms_p90", "tpot_ms_p99", "inter_chunk_ms_p50",
            "inter_chunk_ms_p99", "e2el_ms_p50", "error_rate", "client_cpu_us_per_chunk"]


def _spec(perf_session):
    tp = perf_session.profile.throughput
    if tp is None:
        pytest.skip(f"profile {perf_session.profile.name} defines no throughput section")
    return tp


def test_single_stream_decode(perf_session, perf_server, prompt_factory, perf_gate, target_model):
    """Batch-1 decode tok/s and TTFT: the latency a single user sees."""
    tp = _spec(perf_session)
    w = tp.single_stream

    def run(label):
        samples = samples_of(measure(perf_server, w, prompt_factory, perf_session.repeats, label=label), REPORTED)
        perf_session.cache[("single", perf_server.name)] = samples["decode_tok_s"]  # reused by the floor test
        return samples

    samples = run(f"{perf_server.name} single-stream")
    ready = getattr(perf_server.process, "ready_s", None)
    if ready is not None:  # launch-to-ready of this engine's server, reported (not gated) with its version
        samples["server_ready_s"] = [ready]
    perf_gate.check(scenario="single_stream", engine=perf_server.name, model=target_model.name,
                    workload=scenario_workload(perf_session.profile, "single_stream"),
                    concurrency=1, samples=samples, gated=tp.gated_single,
                    engine_version=perf_server.version,
                    confirm=lambda: run(f"{perf_server.name} single-stream (confirming)"))


def test_concurrency_sweep(perf_session, perf_server, prompt_factory, perf_gate, target_model, perf_concurrency):
    """Output throughput and TPOT at each concurrency level of the profile."""
    tp = _spec(perf_session)
    w = tp.sweep_workload(perf_concurrency)

    def run(label):
        samples = samples_of(measure(perf_server, w, prompt_factory, perf_session.repeats, label=label), REPORTED)
        perf_session.cache[("sweep", perf_server.name, perf_concurrency)] = samples["output_throughput"]
        return samples

    perf_gate.check(scenario="throughput_sweep", engine=perf_server.name, model=target_model.name,
                    workload=scenario_workload(perf_session.profile, "throughput_sweep", perf_concurrency),
                    concurrency=perf_concurrency, samples=run(f"{perf_server.name} sweep"), gated=tp.gated_sweep,
                    engine_version=perf_server.version, confirm=lambda: run(f"{perf_server.name} sweep (confirming)"))


def test_batching_gain(perf_session, perf_server, prompt_factory, perf_gate, target_model):
    """Continuous batching must pay: output tok/s at concurrency C over C=1, measured in this run.

    An engine that serialises requests (or whose scheduler stopped batching) keeps its C=1 speed and
    fails here even if no absolute baseline exists yet.
    """
    tp = _spec(perf_session)
    if tp.batching_gain is None:
        pytest.skip(f"profile {perf_session.profile.name} sets no throughput.batching_gain")
    c, min_ratio = tp.batching_gain
    per_c = {}
    for conc in (1, c):
        cached = perf_session.cache.get(("sweep", perf_server.name, conc))
        if cached is None:  # sweep not run in this process (-k, xdist): measure here
            w = tp.sweep_workload(conc)
            cached = samples_of(measure(perf_server, w, prompt_factory, perf_session.repeats,
                                        label=f"{perf_server.name} batching"), ["output_throughput"])["output_throughput"]
        per_c[conc] = cached
    ratios = [b / a for a, b in zip(per_c[1], per_c[c])]
    perf_gate.check(scenario="batching_gain", engine=perf_server.name, model=target_model.name,
                    workload=scenario_workload(perf_session.profile, "batching_gain", c), concurrency=c,
                    samples={"batching_gain": ratios},
                    gated=["batching_gain"], engine_version=perf_server.version)
    import numpy as np

    med = float(np.median(ratios))
    assert med >= min_ratio, (f"batching_gain (higher is better, x): C={c} gives {med:.2f}x the C=1 output "
                              f"throughput, below the required {min_ratio:.1f}x (ratios per repeat: "
                              f"{', '.join(f'{r:.2f}' for r in ratios)})")


@pytest.mark.gpu
def test_decode_vs_memory_floor(perf_session, perf_server, prompt_factory, perf_gate, target_model):
    """Batch-1 decode speed as a fraction of what the GPU's memory bandwidth allows.

    Bandwidth and decode speed are measured in this run on this GPU, so the ratio says how much of the
    hardware the engine uses, independent of which GPU the runner has.
    """
    from kimi_perf.roofline import DecodeFloor, copy_bandwidth_bytes_s, weight_bytes_from_config

    tp = _spec(perf_session)
    if tp.min_floor_ratio is None:
        pytest.skip(f"profile {perf_session.profile.name} sets no throughput.min_floor_ratio")
    info = {}
    # engines without /server_info: the weight bytes are estimated from the config below
    with contextlib.suppress(Exception):
        info = perf_server.get_json("/server_info", timeout=30)
    wbytes = info.get("weight_bytes") if isinstance(info, dict) else None
    if not wbytes:
        try:
            wbytes = weight_bytes_from_config(target_model.path, str(getattr(perf_server.config, "dtype", None)
                                                                     or "bfloat16"))
        except (KeyError, FileNotFoundError, TypeError, AttributeError) as e:
            pytest.skip(f"{perf_server.name} reports no weight_bytes and the config is not Llama-shaped: {e}")
    bw = copy_bandwidth_bytes_s()
    floor = DecodeFloor(int(wbytes), bw)
    decode = perf_session.cache.get(("single", perf_server.name))
    if decode is None:
        decode = samples_of(measure(perf_server, tp.single_stream, prompt_factory, perf_session.repeats,
                                    label=f"{perf_server.name} floor"), ["decode_tok_s"])["decode_tok_s"]
    ratios = [d / floor.tok_s for d in decode]
    import numpy as np

    med = float(np.median(ratios))
    from kimi_perf.progress import log

    log(f"{perf_server.name}: decode {np.median(decode):.1f} tok/s vs floor {floor.tok_s:.1f} tok/s "
        f"({wbytes / 1e9:.2f} GB weights at {bw / 1e12:.2f} TB/s copy bandwidth): {med:.1%} of the floor")
    perf_gate.check(scenario="decode_floor", engine=perf_server.name, model=target_model.name,
                    workload=scenario_workload(perf_session.profile, "decode_floor"), concurrency=1,
                    samples={"decode_floor_ratio": ratios},
                    gated=["decode_floor_ratio"], engine_version=perf_server.version,
                    extra={"weight_bytes": int(wbytes), "copy_bandwidth_bytes_s": bw, "floor_tok_s": floor.tok_s,
                           "decode_tok_s": list(decode), "cuda_graph_replays": info.get("cuda_graph_replays")})
    assert med >= tp.min_floor_ratio, (
        f"decode_floor_ratio (higher is better, fraction): {perf_server.name} decodes at {med:.1%} of the "
        f"bandwidth floor ({np.median(decode):.1f} of {floor.tok_s:.1f} tok/s), below the profile's "
        f"{tp.min_floor_ratio:.0%}")


@pytest.mark.traffic
def test_slo_knee(perf_session, perf_server, prompt_factory, perf_gate, target_model):
    """Goodput under the profile's latency objectives across a request-rate sweep, and its knee.

    Open-loop arrivals at each rate of ``throughput.slo.rates`` (gamma gaps, vLLM's ``--burstiness``;
    Poisson by default); per rate the request goodput and the fraction of requests within every
    objective (kimi_perf.load.slo); per repeat of the whole sweep the knee, the highest rate still
    served within ``slo.min_attainment``. The knee is gated (higher is better); goodput and attainment
    at every rate are reported."""
    import numpy as np

    from kimi_perf.load.client import run_workload
    from kimi_perf.load.slo import goodput, knee
    from kimi_perf.progress import log

    tp = _spec(perf_session)
    slo = tp.slo
    if slo is None:
        pytest.skip(f"profile {perf_session.profile.name} sets no throughput.slo")
    knees: list[float] = []
    samples: dict[str, list[float]] = {}
    for rep in range(perf_session.repeats):
        att: dict[float, float] = {}
        for rate in slo.rates:
            w = slo.workload(tp.workload, rate)
            warm = list(prompt_factory(w, 10_000))[: w.warmup] if rep == 0 and rate == slo.rates[0] else []
            res = run_workload(perf_server.base_url, perf_server.model, prompt_factory(w, rep), w,
                               warmup_prompts=warm, headers=perf_server.headers,
                               tokenizer=prompt_factory.tokenizer if w.api == "chat" else None)
            check_errors(perf_server, res, f"{perf_server.name} SLO sweep at {rate:g} req/s", max_error_rate=0.5)
            g = goodput(res.records, res.duration_s, slo)
            att[rate] = g["slo_attainment"]
            for k, v in (("request_goodput", g["request_goodput"]), ("slo_attainment", g["slo_attainment"]),
                         ("ttft_ms_p90", res.metrics.get("ttft_ms_p90", float("nan"))),
                         ("tpot_ms_p90", res.metrics.get("tpot_ms_p90", float("nan")))):
                samples.setdefault(f"{k}@{rate:g}rps", []).append(float(v))
            log(f"{perf_server.name} SLO sweep repeat {rep + 1}/{perf_session.repeats} at {rate:g} req/s: goodput "
                f"{g['request_goodput']:.3f} req/s, {g['slo_attainment']:.0%} within {slo.describe()}, TTFT p90 "
                f"{res.metrics.get('ttft_ms_p90', float('nan')):.0f} ms, TPOT p90 "
                f"{res.metrics.get('tpot_ms_p90', float('nan')):.0f} ms")
        knees.append(knee(att, slo.min_attainment))
    log(f"{perf_server.name}: SLO knee {float(np.median(knees)):g} req/s (per repeat {knees}; rates "
        f"{list(slo.rates)}, {slo.describe()}, attainment >= {slo.min_attainment:.0%})")
    perf_gate.check(scenario="slo_knee", engine=perf_server.name, model=target_model.name,
                    workload=scenario_workload(perf_session.profile, "slo_knee"), concurrency=slo.max_concurrency,
                    samples={"slo_knee_rate": knees}, gated=["slo_knee_rate"], engine_version=perf_server.version,
                    extra={"per_rate": samples, "slo": slo.describe(), "rates": list(slo.rates)})


@pytest.mark.traffic
def test_prefix_caching_ttft(perf_session, perf_engine_name, server_pool, prompt_factory, perf_gate, target_model):
    """Prefix caching on prompts that share a long prefix (a system prompt, a few-shot preamble).

    The engine runs with its prefix cache on (vLLM ``--enable-prefix-caching``, SGLang's radix cache);
    per repeat, the same concurrency, lengths and server answer a shared-prefix workload (3/4 of the
    input shared) and a workload of unrelated random prompts, interleaved, and the gate follows the
    ratio of their TTFT medians (lower is better: below 1 when the cache serves the prefix). An engine
    release that stops reusing the cache, or evicts it too early, moves this ratio towards 1."""
    from kimi_perf.keys import prefix_workloads
    from kimi_perf.suite.servers import engine_config

    tp = _spec(perf_session)
    kind = str(perf_session.profile.engines[perf_engine_name]["kind"])
    if kind == "reference":
        pytest.skip("the reference engine has no prefix cache (every request prefills its whole prompt)")
    over = {"enable_prefix_caching": True} if kind == "vllm" else {"disable_radix_cache": False}
    cfg = engine_config(perf_session.server_settings(), perf_engine_name, target_model, tag="prefix-cache", **over)
    srv = server_pool.get(cfg, exclusive=True)
    c = max(tp.concurrency)
    base, shared = prefix_workloads(tp, c)
    ratios, ttft_shared, ttft_random = [], [], []
    for rep in range(perf_session.repeats):
        s = measure(srv, shared, lambda w, i, rep=rep: prompt_factory(w, rep * 100 + i), 1, label=f"{srv.name} shared prefix",
                    tokenizer=prompt_factory.tokenizer)[0]
        r = measure(srv, base, lambda w, i, rep=rep: prompt_factory(w, rep * 100 + i), 1, label=f"{srv.name} random",
                    tokenizer=prompt_factory.tokenizer)[0]
        ttft_shared.append(s.metrics["ttft_ms_p50"])
        ttft_random.append(r.metrics["ttft_ms_p50"])
        ratios.append(s.metrics["ttft_ms_p50"] / r.metrics["ttft_ms_p50"])
    perf_gate.check(scenario="prefix_cache", engine=perf_engine_name, model=target_model.name,
                    workload=scenario_workload(perf_session.profile, "prefix_cache", c), concurrency=c,
                    samples={"prefix_cache_ttft_ratio": ratios}, gated=["prefix_cache_ttft_ratio"],
                    engine_version=srv.version,
                    extra={"ttft_ms_p50_shared": ttft_shared, "ttft_ms_p50_random": ttft_random,
                           "prefix_len": shared.prefix_len, "input_len": base.input_len})
