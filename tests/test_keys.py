"""Every stored baseline key of every profile is one its runs can build (issue 16 item 3).

A key no run builds is a gate that never fires: the run reports NEW and nobody notices. The keys come
from kimi_perf.keys, the module the tests build their keys with.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from kimi_perf.baselines import BaselineKey, BaselineStore
from kimi_perf.keys import EAGLE3_CODE, eagle3_workload, scenario_workload, unreachable
from kimi_perf.profiles import load_profile

ROOT = Path(__file__).resolve().parents[1]
PROFILES = sorted((ROOT / "profiles").glob("*.json"))


@pytest.mark.parametrize("path", PROFILES, ids=[p.stem for p in PROFILES])
def test_every_stored_key_is_reachable_from_its_profile(path):
    profile = load_profile(path)
    bpath = ROOT / "baselines" / f"{profile.name}.json"
    if not bpath.exists():
        pytest.skip(f"no baselines/{profile.name}.json")
    store = BaselineStore(bpath, profile.name)
    bad = {kid: why for kid, e in store.entries.items() if (why := unreachable(profile, e.key)) is not None}
    assert not bad, "stored keys no run of this profile builds:\n" + "\n".join(f"{k}: {w}" for k, w in bad.items())


def test_every_baseline_file_has_its_profile():
    names = {p.stem for p in PROFILES}
    orphans = [p.name for p in (ROOT / "baselines").glob("*.json") if p.stem not in names]
    assert not orphans, f"baseline files without a profile: {orphans}"


def test_the_h100_speedup_key_is_the_runtime_key():
    profile = load_profile(ROOT / "profiles" / "llama-3.1-8b-1xh100.json")
    assert eagle3_workload(profile) == "mtbench-heldout-25x256-k3"
    key = BaselineKey("eagle3_speedup", "sglang", "Llama-3.1-8B-Instruct", "gpu-h100-x1", eagle3_workload(profile), 1)
    assert unreachable(profile, key) is None
    assert "mtbench-heldout-25x256-k3" in unreachable(profile, BaselineKey(
        "eagle3_speedup", "sglang", "Llama-3.1-8B-Instruct", "gpu-h100-x1", "mtbench-heldout-80x256-k3", 1))


def test_unreachable_names_why():
    profile = load_profile(ROOT / "profiles" / "embedded-cpu.json")
    w = scenario_workload(profile, "throughput_sweep", profile.throughput.concurrency[0])
    ok = BaselineKey("throughput_sweep", "reference", profile.model.name, "cpu-x86_64-2c", w,
                     profile.throughput.concurrency[0])
    assert unreachable(profile, ok) is None
    from dataclasses import replace

    assert "concurrency" in unreachable(profile, replace(ok, concurrency=999))
    assert "workload" in unreachable(profile, replace(ok, workload="random-00000000"))
    assert "model" in unreachable(profile, replace(ok, model="other"))
    assert "engine" in unreachable(profile, replace(ok, engine="sglang"))
    assert "no rule" in unreachable(profile, replace(ok, scenario="brand_new"))


def test_a_served_bundles_rows_are_keyed_apart_from_the_recipes():
    """embedded-cpu serves a shipped bundle (eagle3.serve) in the main job while CI trains the recipe:
    one key holds one baseline, so the served drafter's rows end ``@DATA_DIGEST`` and both are reachable;
    another bundle's tag is not."""
    from dataclasses import replace

    from kimi_perf.keys import eagle3_code_workload

    profile = load_profile(ROOT / "profiles" / "embedded-cpu.json")
    assert profile.eagle3.serve and profile.eagle3.serve_tag == profile.eagle3.serve.split("-")[1]
    plain, served = eagle3_workload(profile), eagle3_workload(profile, served=True)
    assert served == f"{plain}@{profile.eagle3.serve_tag}"
    key = BaselineKey("eagle3_acceptance", "reference", profile.model.name, "cpu-x86_64-2c", plain, 1)
    assert unreachable(profile, key) is None
    assert unreachable(profile, replace(key, workload=served)) is None
    assert "runs" in unreachable(profile, replace(key, workload=f"{plain}@000000000000"))
    code = replace(key, scenario=EAGLE3_CODE, workload=eagle3_code_workload(profile, served=True))
    assert unreachable(profile, code) is None
    # a profile that serves nothing has the plain keys only
    bare = replace(profile, eagle3=replace(profile.eagle3, serve=None))
    assert "runs" in unreachable(bare, replace(key, workload=served))
    with pytest.raises(ValueError, match="eagle3.serve is not set"):
        eagle3_workload(bare, served=True)


@pytest.mark.parametrize("path", PROFILES, ids=[p.stem for p in PROFILES])
def test_eagle3_eval_prompts_fit_the_held_out_split(path):
    """The drafter fixture fails a run with fewer held-out prompts than eagle3.eval.prompts (the key
    names that count); this catches it without a GPU. Needs the MT-bench file (python -m kimi_perf.data)."""
    profile = load_profile(path)
    if not profile.eagle3:
        pytest.skip("no eagle3 section")
    from kimi_perf.data import load_mtbench, stable_split

    try:
        convs = load_mtbench()
    except (FileNotFoundError, RuntimeError, OSError) as e:
        pytest.skip(f"MT-bench data not fetched: {e}")
    from kimi_perf.eagle3.data import DataConfig

    # the --perf-drafter path uses the default fraction (0.25); a recipe its own data config
    data = profile.eagle3.drafter_recipe().data if profile.eagle3.recipe is not None else DataConfig()
    held = sum(1 for c in convs if stable_split(c.id, data.held_out_fraction) == "heldout")
    if data.max_heldout_items is not None:
        held = min(held, data.max_heldout_items)
    want = profile.eagle3.eval.prompts
    assert want <= held, (f"{path.name}: eagle3.eval.prompts {want} > {held} held-out MT-bench prompts; "
                          f"set it to at most {held}")


def test_matrix_retrain_noise_keys_are_the_engines_own_rows():
    from kimi_perf.keys import matrix_workload

    profile = load_profile(ROOT / "profiles" / "embedded-cpu.json")
    for engine, row in (("reference", "reference"), ("vllm", "vllm")):
        key = BaselineKey("eagle3_matrix_retrain", engine, profile.model.name, "cpu-x86_64-2c",
                          matrix_workload(profile, row), 1)
        assert unreachable(profile, key) is None
    wrong = BaselineKey("eagle3_matrix_retrain", "reference", profile.model.name, "cpu-x86_64-2c",
                        matrix_workload(profile, "hf"), 1)
    assert "workload" in unreachable(profile, wrong)


def test_the_endpoint_acceptance_key_is_built_and_checked_by_its_own_rule():
    # --perf-url: the endpoint's own drafter on MT-bench; its key names no draft steps and no held-out split
    from dataclasses import replace

    from kimi_perf.keys import ENDPOINT_ACCEPTANCE

    profile = load_profile(ROOT / "profiles" / "embedded-cpu.json")
    n, max_new = profile.eagle3.eval.prompts, profile.eagle3.eval.max_new_tokens
    w = scenario_workload(profile, ENDPOINT_ACCEPTANCE)
    assert w == f"mtbench-{n}x{max_new}-endpoint"
    ok = BaselineKey(ENDPOINT_ACCEPTANCE, "vllm", profile.model.name, "cpu-x86_64-2c", w, 1)
    assert unreachable(profile, ok) is None
    assert "workload" in unreachable(profile, replace(ok, workload=eagle3_workload(profile)))
    assert "concurrency" in unreachable(profile, replace(ok, concurrency=4))


def test_code_prompt_acceptance_is_keyed_by_its_own_prompts_and_only_where_the_profile_asks():
    """HumanEval acceptance is filed under its own workload (task count, length, steps), never under
    MT-bench's key; a profile with code_prompts 0 builds no such key."""
    from dataclasses import replace

    profile = load_profile(ROOT / "profiles" / "embedded-cpu.json")
    assert profile.eagle3.eval.code_prompts == 4
    w = scenario_workload(profile, EAGLE3_CODE)
    assert w == "humaneval-4x64-k3" and w != eagle3_workload(profile)
    key = BaselineKey(EAGLE3_CODE, "reference", profile.model.name, "cpu-x86_64-2c", w, 1)
    assert unreachable(profile, key) is None
    assert "engine" in unreachable(profile, replace(key, engine="sglang"))
    off = replace(profile, eagle3=replace(profile.eagle3, eval=replace(profile.eagle3.eval, code_prompts=0)))
    assert "code_prompts is 0" in unreachable(off, key)
