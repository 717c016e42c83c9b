"""The per-engine EAGLE-3 / alignment plan without a GPU or an engine: profile keys and their validation,
which engines the tests are parametrized by, the server configs they share (the launch count on the
H200 depends on it), SGLang's layer-id mapping and the planted offset, per-layer thresholds, and the
skip-or-fail rule for missing pieces. SGLang answers come from tests/data/sglang_0_5_17 (shapes read in
sglang 0.5.17's source, see its README) served by an in-process HTTP server.
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import numpy as np
import pytest
from test_sglang_adapter import fixture, serve

from kimi_perf import plugin
from kimi_perf.alignment.diagnose import check_layers
from kimi_perf.alignment.extract import HiddenStates, Provenance, server_hidden_states, server_layers
from kimi_perf.alignment.plan import (
    ENGINE_NOISE_FACTOR,
    PlanError,
    diagnosis_layers,
    drafter_aux_layers,
    engine_threshold,
    planted_sglang_offset,
    selected_engines,
    serving_dtype,
)
from kimi_perf.missing import MissingPolicy
from kimi_perf.plugin import SESSION_KEY
from kimi_perf.profiles import ProfileError, load_profile
from kimi_perf.sections import SectionError, parse_alignment, parse_eagle3
from kimi_perf.session import Eagle3Settings, ServerSettings
from kimi_perf.suite.alignment import AlignmentContext, AlignmentSettings
from kimi_perf.suite.drafters import (
    DrafterHandle,
    Eagle3Runs,
    eagle3_server_configs,
    generator_config,
    missing,
    planted_sglang_config,
)
from kimi_perf.suite.models import TargetModel
from kimi_perf.suite.servers import engine_config

ROOT = Path(__file__).resolve().parents[1]
H200 = load_profile(ROOT / "profiles" / "h200-engines.json")
CPU = load_profile(ROOT / "profiles" / "embedded-cpu.json")
# a drafter config as the suite's CPU recipe writes it: default layers, so no explicit ids
DRAFTER = {"architectures": ["LlamaForCausalLMEagle3"], "kimi_perf": {"target_num_layers": 30,
                                                                       "trained_aux_layers": [2, 15, 27]}}


class FakeConfig:
    def __init__(self, explicit_profile: str | None = None) -> None:
        self.stash: dict[Any, Any] = {}
        self._opts = {"--perf-profile": explicit_profile}

    def getoption(self, name: str) -> Any:
        return self._opts.get(name)


def session(profile: Any = H200, engines: tuple[str, ...] | None = None, *, explicit: bool = False,
            pythons: dict[str, str] | None = None) -> Any:
    cfg = FakeConfig(profile.name if explicit else None)
    s = SimpleNamespace(profile=profile, engines=tuple(engines or profile.default_engines), config=cfg,
                        engine_pythons={"sglang": "/venv-sglang/bin/python", "vllm": "/venv-vllm/bin/python"}
                        if pythons is None else pythons, server_timeout_s=600.0, allow_remote_bind=False,
                        repeats=2, drafter_path=None)
    s.missing_policy = lambda: MissingPolicy(profile.name if explicit else None)
    s.server_settings = lambda: settings(s)
    s.eagle3_settings = lambda: eagle3(s)
    cfg.stash[SESSION_KEY] = s
    return s


def settings(s: Any) -> ServerSettings:
    """What ``PerfSession.server_settings`` builds, for the fake session above."""
    return ServerSettings(profile_name=s.profile.name, profile_path=s.profile.path, engines=s.profile.engines,
                          engine_pythons=s.engine_pythons, server_timeout_s=s.server_timeout_s,
                          allow_remote_bind=s.allow_remote_bind, policy=s.missing_policy())


def eagle3(s: Any) -> Eagle3Settings:
    """What ``PerfSession.eagle3_settings`` builds, for the fake session above."""
    return Eagle3Settings(servers=settings(s), eagle3=s.profile.eagle3, alignment_engines=s.profile.alignment.engines,
                          repeats=s.repeats, drafter_path=s.drafter_path)


TARGET = TargetModel("SmolLM2-135M-Instruct", Path("/models/smollm2"), "embedded", "fp")


# -- profile keys ----------------------------------------------------------------------------------------

@pytest.mark.parametrize("path", sorted((ROOT / "profiles").glob("*.json")), ids=lambda p: p.stem)
def test_every_shipped_profile_loads_its_sections_typed(path):
    p = load_profile(path)
    assert p.eagle3 is None or p.eagle3.engines
    assert p.alignment.engines and p.alignment.dtypes


def test_engine_lists_default_and_come_from_the_profile():
    assert H200.eagle3.engines == ("reference", "sglang", "vllm")
    assert H200.alignment.engines == ("reference", "sglang", "vllm")
    assert CPU.eagle3.engines == ("reference",)  # [eagle3.engine], default reference
    assert CPU.alignment.engines == ("reference",)
    assert parse_eagle3({"engine": "vllm", "steps": 3}, CPU.engines).engines == ("vllm",)
    assert parse_eagle3({}, CPU.engines) is None


@pytest.mark.parametrize("section, raw, match", [
    ("eagle3", {"engines": ["reference", "sglang"]}, r"eagle3.engines: names engine\(s\) \['sglang'\].*choose from"),
    ("eagle3", {"engine_list": ["reference"]}, r"eagle3: unknown key\(s\) \['engine_list'\].*allowed keys"),
    ("eagle3", {"eval": {"max_new": 3}}, r"eagle3.eval: unknown key\(s\) \['max_new'\]"),
    ("eagle3", {"engines": "reference"}, r"not a non-empty list of engine names"),
    ("eagle3", {"engines": ["reference", "reference"]}, r"lists an engine twice"),
    ("eagle3", {"gated": ["accept_len"]}, r"eagle3.gated.*a list of: accept_length"),
    ("alignment", {"engine": ["vllm"]}, r"alignment: unknown key\(s\) \['engine'\]"),
    ("alignment", {"engines": []}, r"alignment.engines: \[\] is not a non-empty list"),
    ("alignment", {"engine_noise_factor": 0.5}, r"alignment.engine_noise_factor: 0.5. Fix: a number >= 1"),
    ("alignment", {"dtypes": ["float16"]}, r"alignment.dtypes"),
])
def test_section_errors_name_the_key_and_the_fix(section, raw, match):
    parse = parse_eagle3 if section == "eagle3" else parse_alignment
    with pytest.raises(SectionError, match=match):
        parse(raw, CPU.engines)


def test_perf_engine_narrows_the_engines_and_an_empty_choice_says_why():
    assert selected_engines(["reference", "sglang", "vllm"], ("sglang",), "eagle3.engines") == (["sglang"], "")
    names, why = selected_engines(["reference"], ("vllm",), "eagle3.engines")
    assert names == [] and "eagle3.engines lists ['reference'], --perf-engine selected ['vllm']" in why


def test_serving_dtype_and_engine_thresholds():
    assert serving_dtype(H200.engines["sglang"]) == "bfloat16" and serving_dtype({"dtype": "auto"}) == "bfloat16"
    with pytest.raises(PlanError, match="no measured alignment noise floor"):
        serving_dtype({"dtype": "float16"})
    assert engine_threshold(0.974, 0.02, "reference") == (0.974, 0.02)
    thr, tol = engine_threshold(0.974, 0.02, "sglang")
    assert ENGINE_NOISE_FACTOR == 2.0 and thr == pytest.approx(0.948) and tol == pytest.approx(0.04)
    # the adjacent-layer cosines an off-by-one produces on SmolLM2 bf16 (15/16: 0.925) still fail there
    assert thr > 0.925


# -- parametrization (the plugin's pytest_generate_tests, the only one, called directly) -------------------

class FakeMetafunc:
    def __init__(self, s: Any, *names: str) -> None:
        self.fixturenames, self.config, self.calls = list(names), s.config, []

    def parametrize(self, argname: str, values: list[Any], ids: list[str] | None = None) -> None:
        self.calls.append((argname, values, ids))


def _ids(mf: FakeMetafunc) -> dict[str, list[Any]]:
    return {a: (ids if ids != ["none"] else [v.marks[0].kwargs["reason"] for v in values])
            for a, values, ids in mf.calls}


def test_eagle3_tests_are_parametrized_by_the_profiles_engines(tmp_path):
    mod = plugin
    mf = FakeMetafunc(session(), "eagle3_engine")
    mod.pytest_generate_tests(mf)
    assert _ids(mf) == {"eagle3_engine": ["reference", "sglang", "vllm"]}
    mf = FakeMetafunc(session(engines=("sglang",)), "eagle3_engine")
    mod.pytest_generate_tests(mf)
    assert _ids(mf) == {"eagle3_engine": ["sglang"]}
    mf = FakeMetafunc(session(CPU), "eagle3_engine")  # CI: the reference engine only, as before
    mod.pytest_generate_tests(mf)
    assert _ids(mf) == {"eagle3_engine": ["reference"]}
    mf = FakeMetafunc(session(CPU, ("vllm",)), "eagle3_engine")
    mod.pytest_generate_tests(mf)
    (reason,) = _ids(mf)["eagle3_engine"]
    assert "--perf-engine selected ['vllm']" in reason
    # an engine list naming an undefined engine no longer reaches parametrization: the profile does not load
    raw = json.loads((ROOT / "profiles" / "embedded-cpu.json").read_text())
    raw["eagle3"]["engines"] = ["sglang"]
    (tmp_path / "embedded-cpu.json").write_text(json.dumps(raw))
    with pytest.raises(ProfileError, match="embedded-cpu.json: eagle3.engines: names engine"):
        load_profile(tmp_path / "embedded-cpu.json")
    mf = FakeMetafunc(session(dataclasses.replace(CPU, eagle3=None)), "eagle3_engine")
    mod.pytest_generate_tests(mf)
    assert "has no eagle3 section" in _ids(mf)["eagle3_engine"][0]


def test_alignment_tests_are_parametrized_and_the_planted_one_runs_on_sglang_only():
    mod = plugin
    mf = FakeMetafunc(session(), "align_engine", "planted_engine")
    mod.pytest_generate_tests(mf)
    assert _ids(mf) == {"align_engine": ["reference", "sglang", "vllm"], "planted_engine": ["sglang"]}
    mf = FakeMetafunc(session(CPU), "align_engine", "planted_engine")
    mod.pytest_generate_tests(mf)
    got = _ids(mf)
    assert got["align_engine"] == ["reference"] and "SGLang engines" in got["planted_engine"][0]


# -- shared server configs: what the H200 run launches ---------------------------------------------------

def test_sglang_ab_servers_return_hidden_states_and_are_the_ones_alignment_asks_for():
    s = session()
    cfgs = eagle3_server_configs(eagle3(s), TARGET, "sglang", Path("/drafters/d"), 3)
    plain, spec = cfgs["plain"], cfgs["spec"]
    assert (plain.name, spec.name) == ("sglang-hs", "sglang-spec-hs")
    assert plain.return_hidden_states and spec.return_hidden_states and plain.spec is None
    assert plain.version == "0.5.17" and spec.spec.draft_model_path == "/drafters/d"
    a = spec.argv(30000)
    for flag in ("--enable-return-hidden-states", "--disable-radix-cache", "--speculative-draft-model-path"):
        assert flag in a
    assert a[a.index("--chunked-prefill-size") + 1] == "-1"
    # both sides run with the same flags (the no-spec baseline is fair): only the speculative ones differ
    i, rest = 0, []
    while i < len(a):
        if a[i].startswith("--speculative-"):
            i += 2
            continue
        rest.append(a[i])
        i += 1
    assert rest == plain.argv(30000)
    # a second build is equal, so the ServerPool hands out the running server instead of a twin
    assert eagle3_server_configs(eagle3(s), TARGET, "sglang", Path("/drafters/d"), 3) == cfgs
    planted = planted_sglang_config(eagle3(s), TARGET, "sglang", Path("/tmp/planted"), 3)
    assert planted.name == "sglang-spec-planted-hs" and planted.return_hidden_states
    assert dataclasses.replace(planted, name=spec.name, spec=spec.spec) == spec  # same flags otherwise


def test_vllm_plain_side_is_the_throughput_config_and_sglang_without_alignment_is_unchanged():
    s = session()
    cfgs = eagle3_server_configs(eagle3(s), TARGET, "vllm", Path("/d"), 3)
    assert cfgs["plain"] == engine_config(settings(s), "vllm", TARGET)  # reused when the throughput server still runs
    assert cfgs["spec"].name == "vllm-spec" and cfgs["spec"].spec is not None
    ref = eagle3_server_configs(eagle3(s), TARGET, "reference", Path("/d"), 3)
    assert ref["plain"].max_running_requests == 4 == ref["spec"].max_running_requests
    no_align = dataclasses.replace(H200, alignment=dataclasses.replace(H200.alignment, engines=("reference",)))
    sg = eagle3_server_configs(eagle3(session(no_align)), TARGET, "sglang", Path("/d"), 3)
    assert not sg["plain"].return_hidden_states and sg["plain"] == engine_config(settings(session(no_align)), "sglang", TARGET)


def test_the_recipe_generator_is_the_reference_engine_or_sglang():
    """eagle3.recipe.data.generator picks the server that regenerates responses: the reference engine
    batches to the recipe's concurrency, SGLang as the profile has it, vLLM (no /generate on token ids)
    and an engine the profile lacks are usage errors naming the key."""
    from kimi_perf.eagle3.data import DataConfig

    e = eagle3(session())
    ref = generator_config(e, DataConfig(concurrency=24), TARGET)
    assert ref.kind == "reference" and ref.max_running_requests == 24
    assert generator_config(e, DataConfig(generator="sglang"), TARGET) == engine_config(settings(session()), "sglang",
                                                                                         TARGET)
    with pytest.raises(pytest.UsageError, match=r"generator 'vllm' is a vllm engine.*reference engine or SGLang"):
        generator_config(e, DataConfig(generator="vllm"), TARGET)
    with pytest.raises(pytest.UsageError, match=r"eagle3.recipe.data.generator 'tgi' is not an engine"):
        generator_config(e, DataConfig(generator="tgi"), TARGET)


class FakePool:
    def __init__(self) -> None:
        self.running: dict[Any, Any] = {}
        self.launches: list[str] = []

    def get(self, cfg: Any, *, exclusive: bool = False) -> Any:
        if cfg not in self.running:
            self.launches.append(cfg.name)
            self.running[cfg] = SimpleNamespace(base_url="http://x", model="m", version="0.5.17", config=cfg,
                                                name=cfg.name)
        return self.running[cfg]

    def stop(self, cfg: Any) -> None:
        self.running.pop(cfg, None)


def test_ab_launches_each_server_once_captures_while_up_and_is_reused(monkeypatch):
    import kimi_perf.eagle3.evaluate as ev

    calls: list[str] = []

    def fake_measure(url, model, prompts, max_new, *, name="", **_kw):
        calls.append(name)
        return SimpleNamespace(output_tok_s=100.0, accept_length=2.0 if "spec" in name else float("nan"))

    monkeypatch.setattr(ev, "measure_generation", fake_measure)
    pool = FakePool()
    drafter = DrafterHandle(Path("/drafters/d"), 3, ((1, 2, 3),), None, (), {})
    runs = Eagle3Runs(eagle3(session()), TARGET, pool, drafter)  # type: ignore[arg-type]
    seen: list[list[str]] = []
    ab = runs.ab("sglang", while_up=lambda servers: seen.append(sorted(s.name for s in servers.values())))
    assert pool.launches == ["sglang-hs", "sglang-spec-hs"] and not pool.running
    assert seen == [["sglang-hs", "sglang-spec-hs"]]  # the alignment capture ran before the stop
    assert len(ab.spec) == len(ab.plain) == 2 and ab.configs == {"plain": "sglang-hs", "spec": "sglang-spec-hs"}
    assert runs.ab("sglang") is ab and runs.accept_length("sglang")[0].accept_length == 2.0
    assert pool.launches == ["sglang-hs", "sglang-spec-hs"]  # nothing relaunched

    def boom(*_a, **_k):
        raise RuntimeError("server answered 500")

    monkeypatch.setattr(ev, "measure_generation", boom)
    with pytest.raises(RuntimeError):
        runs.ab("vllm")
    n = len(pool.launches)
    with pytest.raises(pytest.fail.Exception, match="A/B on vllm failed earlier.*answered 500"):
        runs.ab("vllm")
    assert len(pool.launches) == n and not pool.running


# -- SGLang's layer ids and the planted offset -----------------------------------------------------------

def test_planted_offset_is_the_forgotten_plus_one_and_sglang_reads_it_one_layer_late():
    p = planted_sglang_offset((2, 15, 27), "sglang-llama")
    assert (p.correct_ids, p.written, p.served) == ((1, 14, 26), (2, 15, 27), (3, 16, 28))
    cfg = p.draft_config(DRAFTER)
    assert cfg["eagle_config"] == {"eagle_aux_hidden_state_layer_ids": [2, 15, 27], "use_aux_hidden_state": True}
    assert cfg["kimi_perf"]["trained_aux_layers"] == [2, 15, 27] and "eagle_config" not in DRAFTER
    info = fixture("server_info_eagle3.json")
    # the suite's mapping of the served columns, as the test reads them from a running server
    assert server_layers(info, model_family="llama", draft_config=cfg).layers == (3, 16, 28)
    assert server_layers(info, model_family="llama", draft_config=DRAFTER, num_layers=30).layers == (2, 15, 27)
    right = p.draft_config(DRAFTER) | {"eagle_config": {"eagle_aux_hidden_state_layer_ids": list(p.correct_ids)}}
    assert server_layers(info, model_family="llama", draft_config=right).layers == (2, 15, 27)
    d = planted_sglang_offset((2, 15, 27), "sglang-deepseek")  # DeepSeek shifts only a leading 1
    assert d.written == (3, 16, 28) == d.served


def test_drafter_layers_and_what_transformers_captures_for_the_diagnosis():
    assert drafter_aux_layers(DRAFTER, 30) == (2, 15, 27)
    assert drafter_aux_layers({"architectures": ["LlamaForCausalLMEagle3"]}, 30) == (2, 15, 27)
    with pytest.raises(PlanError, match="kimi_perf.*trained_aux_layers"):
        drafter_aux_layers({"eagle_config": {"eagle_aux_hidden_state_layer_ids": [1, 14, 26]}}, 30)
    assert diagnosis_layers([2, 15, 27], 30) == [0, 1, 2, 3, 4, 13, 14, 15, 16, 17, 25, 26, 27, 28, 29, 30, "final"]


def _hs(layers: dict[Any, np.ndarray], backend: str) -> HiddenStates:
    n = next(iter(layers.values())).shape[0]
    return HiddenStates(layers, tuple(range(n)), Provenance(backend, "t", "bfloat16", (0, n)))


def test_each_layer_on_its_own_threshold_and_an_offset_is_named():
    rng = np.random.default_rng(0)
    base = rng.normal(size=(12, 64))
    ref = {k: base + 0.6 * k * rng.normal(size=(12, 64)) for k in range(0, 7)}  # a drifting residual stream
    good = {2: ref[2] + 1e-4 * rng.normal(size=(12, 64)), 4: ref[5]}  # layer 4 is really layer 5
    rep = check_layers([(_hs(good, "engine"), _hs(ref, "hf"))], {2: (0.9999, 0.01), 4: (0.999, 0.01)},
                       num_layers=6, pair="engine vs hf")
    v2, v4 = rep.verdicts
    assert v2.ok and v2.threshold == 0.9999 and not v4.ok and v4.threshold == 0.999
    assert "off-by-one layer id" in (v4.cause or "")
    # the worst prompt decides: a second pair that fails layer 2 makes it fail
    bad2 = {2: ref[3], 4: ref[4]}
    rep = check_layers([(_hs(good, "engine"), _hs(ref, "hf")), (_hs(bad2, "engine"), _hs(ref, "hf"))],
                       {2: (0.9999, 0.01), 4: (0.999, 0.01)}, num_layers=6)
    assert [v.ok for v in rep.verdicts] == [False, False]


# -- captures from an SGLang 0.5.17-shaped server --------------------------------------------------------

def _fake_sglang(tmp_path: Path, resp: dict[str, Any], *, spec: bool = True) -> tuple[dict[str, Any], Any]:
    (tmp_path / "target").mkdir(exist_ok=True)
    (tmp_path / "target" / "config.json").write_text(json.dumps({"architectures": ["LlamaForCausalLM"],
                                                                  "num_hidden_layers": 30}))
    (tmp_path / "drafter").mkdir(exist_ok=True)
    (tmp_path / "drafter" / "config.json").write_text(json.dumps(
        {**DRAFTER, "eagle_config": {"eagle_aux_hidden_state_layer_ids": [1, 14, 26]}}))
    info = {**fixture("server_info_eagle3.json"), "model_path": str(tmp_path / "target"),
            "speculative_draft_model_path": str(tmp_path / "drafter")}
    if not spec:
        info["speculative_algorithm"] = None

    def handle(_r, path, _q, body):
        if path == "/server_info":
            return 200, "application/json", json.dumps(info)
        return 200, "application/json", json.dumps(resp)

    return info, handle


def test_speculative_rows_past_the_returned_tokens_are_dropped_and_counted(tmp_path):
    resp = fixture("generate_eagle3_return_hidden_states.json")
    extra = [108.0 + c / 10 for c in range(4)] + [208.0 + c / 10 for c in range(4)] + [308.0 + c / 10 for c in range(4)]
    resp["meta_info"]["hidden_states"].append(extra)  # a verify step's row for a token cut off by max_new_tokens
    _, handle = _fake_sglang(tmp_path, resp)
    with serve(handle) as url:
        (hs,) = server_hidden_states(url, [[1, 3923, 374, 279, 6864]], 4, hidden=4)
    # target config read from model_path: Llama, so ids [1, 14, 26] are entering [2, 15, 27]
    assert sorted(hs.layers) == [2, 15, 27] and hs.get(27).shape == (8, 4)
    assert "1 trailing row(s) past the returned tokens dropped" in hs.provenance.note
    plain = {**resp, "meta_info": {**resp["meta_info"], "hidden_states": [[0.0] * 4] * 9}}
    _, handle = _fake_sglang(tmp_path, plain, spec=False)
    with serve(handle) as url, pytest.raises(Exception, match="9 hidden-state rows for 8 positions"):
        server_hidden_states(url, [[1, 3923, 374, 279, 6864]], 4, hidden=4)


def test_alignment_capture_names_columns_and_a_failed_prefetch_is_reported_not_raised(tmp_path):
    resp = fixture("generate_eagle3_return_hidden_states.json")
    _, handle = _fake_sglang(tmp_path, resp)
    st = AlignmentSettings(dtypes=("bfloat16",), prompts=1, max_new_tokens=4, margin=5.0, min_gap=1e-6,
                           norm_tol_min=0.01, layers=(2, 15, 27, 30, "final"), served=(), num_layers=30, hidden=4,
                           aux=(2, 15, 27), engines=("reference", "sglang", "vllm"))
    s = session()
    cfgs = eagle3_server_configs(eagle3(s), TARGET, "sglang", tmp_path / "drafter", 3)
    ctx = AlignmentContext(TARGET, FakePool(), st, servers=settings(s), store=None,  # type: ignore[arg-type]
                           hardware="cpu")
    ctx._prompts = [[1, 3923, 374, 279, 6864]]
    with serve(handle) as url:
        srv = SimpleNamespace(base_url=url, version="0.5.17", config=cfgs["spec"])
        broken = SimpleNamespace(base_url="http://127.0.0.1:9", version="0.5.17", config=cfgs["plain"])
        ctx.prefetch({"spec": srv, "plain": broken})  # the dead one must not raise here
    cap = ctx.capture(cfgs["spec"])  # cached: no server needed any more
    assert cap.layers == (2, 15, 27) and cap.server_ids == (1, 14, 26) and cap.convention == "sglang-llama"
    assert "-> entering layers [2, 15, 27]" in cap.how and cap.config_name == "sglang-spec-hs"
    with pytest.raises(AssertionError, match="sglang-hs: the hidden-state capture failed earlier"):
        ctx.capture(cfgs["plain"])


# -- missing pieces --------------------------------------------------------------------------------------

def test_missing_piece_skips_but_fails_under_ci_or_an_explicit_profile(monkeypatch):
    monkeypatch.delenv("CI", raising=False)
    monkeypatch.delenv("KIMI_PERF_SKIP_SGLANG", raising=False)
    with pytest.raises(pytest.skip.Exception, match="pass --perf-sglang-python"):
        missing(eagle3(session()), "engine sglang needs its own environment: pass --perf-sglang-python PATH",
                engine_kind="sglang")
    with pytest.raises(pytest.fail.Exception, match="--perf-profile h200-engines was named explicitly"):
        missing(eagle3(session(explicit=True)), "no drafter: pass --perf-drafter PATH")
    monkeypatch.setenv("CI", "true")
    with pytest.raises(pytest.fail.Exception, match="a failure, not a skip: CI=true"):
        missing(eagle3(session()), "no drafter: pass --perf-drafter PATH")
    monkeypatch.setenv("KIMI_PERF_SKIP_SGLANG", "1")  # the README's explicit opt-out keeps it a skip
    with pytest.raises(pytest.skip.Exception, match=r"KIMI_PERF_SKIP_SGLANG=1"):
        missing(eagle3(session(explicit=True)), "engine sglang needs its own environment", engine_kind="sglang")


def test_a_missing_engine_environment_for_a_server_follows_the_same_policy(monkeypatch):
    """engine_config (every server of every test) asks kimi_perf.missing like the EAGLE-3 fixtures do: a
    skip on a laptop, a failure under CI=true, unless KIMI_PERF_SKIP_<KIND>=1."""
    monkeypatch.delenv("CI", raising=False)
    monkeypatch.delenv("KIMI_PERF_SKIP_VLLM", raising=False)
    with pytest.raises(pytest.skip.Exception, match="scripts/setup.sh --full makes .venv-vllm"):
        engine_config(settings(session(pythons={})), "vllm", TARGET)
    monkeypatch.setenv("CI", "true")
    with pytest.raises(pytest.fail.Exception, match="a failure, not a skip: CI=true"):
        engine_config(settings(session(pythons={})), "vllm", TARGET)
    monkeypatch.setenv("KIMI_PERF_SKIP_VLLM", "1")
    with pytest.raises(pytest.skip.Exception, match="KIMI_PERF_SKIP_VLLM=1"):
        engine_config(settings(session(pythons={})), "vllm", TARGET)


def test_a_recipe_whose_samples_are_all_stored_needs_no_generator_environment(monkeypatch, tmp_path):
    """The H200 matrix's lease carries every sample of its SGLang-generated recipe and installs no
    SGLang: the session's drafter must train without --perf-sglang-python (the first lease run stopped
    at setup asking for it). The environment is asked for only when the pipeline wants a server."""
    import transformers

    import kimi_perf.eagle3.data as data
    import kimi_perf.eagle3.pipeline as pipeline
    import kimi_perf.suite.drafters as drafters
    from kimi_perf.eagle3.pipeline import DrafterArtifact

    matrix = load_profile(ROOT / "profiles" / "h200-matrix.json")
    assert matrix.eagle3.recipe["data"]["generator"] == "sglang"
    s = eagle3(session(matrix, explicit=True, pythons={}))  # a named profile: a missing engine FAILs
    n = matrix.eagle3.eval.prompts
    monkeypatch.setattr(transformers.AutoTokenizer, "from_pretrained", lambda *a, **k: None)
    monkeypatch.setattr(data, "build_items", lambda cfg: [])
    monkeypatch.setattr(pipeline, "heldout_prompts", lambda path, ids: [[1, 2, 3]] * n)
    monkeypatch.setattr(drafters, "code_prompts", lambda s, tok: ((), ""))
    art = DrafterArtifact(tmp_path / "drafter", tmp_path, tmp_path / "samples.jsonl", ("a",), ("b",), {})

    def build(recipe, *a, gen_url, **k):  # every sample stored: no server asked for
        return art

    monkeypatch.setattr(pipeline, "build_drafter", build)
    assert drafters.session_drafter(s, TARGET, FakePool()).path == art.path

    def build_missing(recipe, *a, gen_url, **k):  # samples missing: the generator is resolved now
        gen_url()

    monkeypatch.setattr(pipeline, "build_drafter", build_missing)
    with pytest.raises(pytest.fail.Exception, match="engine sglang .* needs its own environment"):
        drafters.session_drafter(s, TARGET, FakePool())
