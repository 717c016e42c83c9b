"""The drafter shipped with kimi-perf: it applies to the embedded-cpu recipe as it is now, a file that is
not the one the recipe built is refused, and an installed bundle gives the fixture what a trained one does.

The first test is the tripwire for "the main job retrains on every fresh machine again": change the
embedded-cpu recipe (or the target) without re-exporting, and it fails with the command that fixes it.
"""

from __future__ import annotations

import json
import shutil
from dataclasses import replace
from pathlib import Path

import pytest

from kimi_perf.eagle3.shipped import SHIPPED_ROOT, ShippedDrafterError, find_shipped, install
from kimi_perf.models.embedded import model_fingerprint

ROOT = Path(__file__).resolve().parents[1]


def _recipe():
    # through the typed profile section, as the drafter fixture reads it: its digests must be the manifest's
    from kimi_perf.profiles import load_profile

    return load_profile(ROOT / "profiles" / "embedded-cpu.json").eagle3.drafter_recipe()


def _target() -> tuple[Path, str]:
    from engine_helpers import embedded_path

    p = embedded_path()
    return p, model_fingerprint(p)


def test_a_shipped_drafter_matches_the_embedded_cpu_recipe_and_target():
    _, fp = _target()
    bundle, why = find_shipped(_recipe(), fp)
    assert bundle is not None, (f"{why}. The main job would retrain the drafter (~8.5 min on 2 cores). Fix: train it "
                                "(pytest -m eagle --perf-train-drafter) and run python -m kimi_perf.eagle3.shipped "
                                "export, then commit kimi_perf/eagle3/shipped_drafters/ (and remove the stale bundle)")
    size = sum(f.stat().st_size for f in bundle.root.rglob("*") if f.is_file())
    assert size < 20e6, f"shipped drafter is {size / 1e6:.1f} MB; keep bundles small (one layer at hidden 576)"


def test_a_changed_recipe_finds_no_shipped_drafter_and_says_why():
    _, fp = _target()
    r = _recipe()
    changed = replace(r, train=replace(r.train, epochs=r.train.epochs + 1))
    bundle, why = find_shipped(changed, fp)
    assert bundle is None
    assert "no shipped drafter matches" in why and changed.train.digest() in why
    assert find_shipped(r, "0" * 16)[0] is None


def test_a_tampered_file_is_refused_with_the_file_named(tmp_path):
    _, fp = _target()
    src, _ = find_shipped(_recipe(), fp)
    assert src is not None
    root = tmp_path / "shipped"
    shutil.copytree(src.root, root / src.root.name)
    f = root / src.root.name / "drafter" / "model.safetensors"
    raw = bytearray(f.read_bytes())
    raw[-1] ^= 0xFF
    f.write_bytes(bytes(raw))
    with pytest.raises(ShippedDrafterError, match="model.safetensors has sha256"):
        find_shipped(_recipe(), fp, root=root)
    f.unlink()
    with pytest.raises(ShippedDrafterError, match="model.safetensors is missing"):
        find_shipped(_recipe(), fp, root=root)


def test_the_fingerprint_ignores_where_the_gguf_was_installed(tmp_path):
    a, b = tmp_path / "a", tmp_path / "b"
    for d, where in ((a, "/one/venv"), (b, "/another/checkout/.venv")):
        d.mkdir()
        (d / "config.json").write_text('{"hidden_size": 576}')
        (d / "COMPLETE").write_text(json.dumps({"gguf": f"{where}/m.gguf", "sha256": "ab" * 32}))
        (d / "model.safetensors").write_bytes(b"x" * 10)
    assert model_fingerprint(a) == model_fingerprint(b)
    (b / "COMPLETE").write_text(json.dumps({"gguf": "/one/venv/m.gguf", "sha256": "cd" * 32}))
    assert model_fingerprint(a) != model_fingerprint(b)


@pytest.mark.slow
def test_an_installed_bundle_gives_held_out_prompts_and_their_stored_features(tmp_path):
    from transformers import AutoTokenizer

    from kimi_perf.eagle3.features import FeatureStore
    from kimi_perf.eagle3.pipeline import heldout_prompts

    path, fp = _target()
    recipe = _recipe()
    bundle, _ = find_shipped(recipe, fp)
    assert bundle is not None
    art = install(bundle, recipe, path, fp, root=tmp_path)
    assert (art.path / "COMPLETE").is_file() and art.path.is_relative_to(tmp_path)
    assert json.loads((art.path / "config.json").read_text())["architectures"] == ["LlamaForCausalLMEagle3"]
    prompts = heldout_prompts(art.samples_path, art.heldout_ids)
    assert len(prompts) == recipe.data.max_heldout_items
    tok = AutoTokenizer.from_pretrained(str(path))
    assert "<|im_start|>user" in tok.decode(prompts[0])
    store = FeatureStore(art.feature_dir)
    assert set(store.sample_ids) == set(art.heldout_ids)
    assert store.layers == tuple(art.report["features"]["layers"])
    assert art.report["shipped"]["bundle"] == bundle.name
    # a second install reuses what the first unpacked and extracted
    again = install(bundle, recipe, path, fp, root=tmp_path)
    assert again.feature_dir == art.feature_dir and (art.feature_dir / "COMPLETE").is_file()
    assert not set(art.heldout_ids) & set(art.train_ids)
    assert SHIPPED_ROOT in bundle.root.parents


def test_a_trained_drafter_is_compared_with_the_shipped_one_file_by_file(tmp_path):
    """CI trains the recipe (--perf-train-drafter); the fixture then says whether the result is the shipped
    artifact byte for byte (it was, on the box that exported it) or not (reported, never failed)."""
    from kimi_perf.eagle3.shipped import compare_with_shipped

    _, fp = _target()
    bundle, _ = find_shipped(_recipe(), fp)
    assert bundle is not None
    d = tmp_path / "drafter"
    shutil.copytree(bundle.root / "drafter", d)
    assert compare_with_shipped(bundle, d) == {"bundle": bundle.name, "config.json": "identical",
                                               "model.safetensors": "identical", "identical": True}
    raw = bytearray((d / "model.safetensors").read_bytes())
    raw[-1] ^= 0x01
    (d / "model.safetensors").write_bytes(bytes(raw))
    got = compare_with_shipped(bundle, d)
    assert got["model.safetensors"] == "differs" and got["config.json"] == "identical" and not got["identical"]


def _row_recipe(name: str):
    from kimi_perf.eagle3.matrix import parse_row

    r = _recipe()
    return replace(r, features=parse_row(name).features_of(r.features))


def test_every_trained_row_of_the_reduced_matrix_is_shipped():
    """The reduced matrix (main job) trains a drafter for each row whose feature path is not the recipe's;
    the reference row cost ~6.5 of the main job's minutes on 2 cores until it shipped too. Tripwire: a
    recipe change without re-exporting the rows fails here with the command that fixes it."""
    from kimi_perf.profiles import load_profile

    _, fp = _target()
    plan = load_profile(ROOT / "profiles" / "embedded-cpu.json").eagle3.matrix
    trained = [r for r in plan.ci_rows if r.backend != _recipe().features.backend or r.planted]
    assert trained, "the reduced matrix has no row of its own feature path: this test guards nothing"
    for row in trained:
        bundle, why = find_shipped(_row_recipe(row.name), fp)
        assert bundle is not None, (f"matrix row {row.name}: {why}. Fix: run the reduced matrix "
                                    "(pytest -m perf perf_tests/test_matrix.py: a row without a matching bundle trains), then python -m "
                                    f"kimi_perf.eagle3.shipped export --row {row.name}, and commit the bundle")


def test_a_row_drafter_exports_although_its_features_name_the_server_they_came_through(tmp_path):
    """A matrix row's recipe carries the capture server's URL (a port of that run), which the pipeline's
    digests leave out: export identifies the recipe by its digests, and the bundle stores no URL."""
    from kimi_perf.eagle3.pipeline import _jsonable
    from kimi_perf.eagle3.shipped import export

    _, fp = _target()
    bundle, _ = find_shipped(_row_recipe("reference"), fp)
    assert bundle is not None
    d = tmp_path / "drafter"
    shutil.copytree(bundle.root / "drafter", d)
    (d / "COMPLETE").write_text("ok\n")
    served = replace(_row_recipe("reference"), features=replace(_row_recipe("reference").features,
                                                                 server_url="http://127.0.0.1:41234"))
    rep = json.loads((d / "report.json").read_text())
    (d / "report.json").write_text(json.dumps({**rep, "recipe": _jsonable(served)}))
    out = export(d, bundle.root / "heldout_samples.jsonl", _row_recipe("reference"), fp, out_root=tmp_path / "out")
    assert "41234" not in (out / "drafter" / "report.json").read_text()
    assert find_shipped(_row_recipe("reference"), fp, root=tmp_path / "out")[0] is not None
    other = replace(served, train=replace(served.train, epochs=served.train.epochs + 1))
    (d / "report.json").write_text(json.dumps({**rep, "recipe": _jsonable(other)}))
    with pytest.raises(ShippedDrafterError, match="another recipe"):
        export(d, bundle.root / "heldout_samples.jsonl", _row_recipe("reference"), fp, out_root=tmp_path / "out2")
