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
    f = root / src.root.name / "drafter" / "model.safetensors.xz"
    raw = bytearray(f.read_bytes())
    raw[-1] ^= 0xFF
    f.write_bytes(bytes(raw))
    with pytest.raises(ShippedDrafterError, match="model.safetensors.xz has sha256"):
        find_shipped(_recipe(), fp, root=root)
    f.unlink()
    with pytest.raises(ShippedDrafterError, match="model.safetensors.xz is missing"):
        find_shipped(_recipe(), fp, root=root)


def test_weights_stored_compressed_are_written_out_and_checked_as_trained(tmp_path):
    """The weights ship xz-compressed; what install writes must be the trained file (the manifest's
    ``files`` hash), also when the compressed file matches its own (edited) stored hash."""
    import lzma

    from kimi_perf.eagle3.shipped import ShippedDrafter, materialize
    from kimi_perf.models.embedded import file_sha256

    _, fp = _target()
    src, _ = find_shipped(_recipe(), fp)
    assert src is not None
    assert not (src.root / "drafter" / "model.safetensors").exists()  # only the .xz travels
    out = materialize(src, tmp_path / "plain")
    assert file_sha256(out / "model.safetensors") == src.manifest["files"]["drafter/model.safetensors"]
    assert sorted(p.name for p in out.iterdir()) == ["config.json", "model.safetensors", "report.json"]
    root = tmp_path / "shipped" / src.name
    shutil.copytree(src.root, root)
    raw = bytearray((out / "model.safetensors").read_bytes())
    raw[-1] ^= 0x01
    (root / "drafter" / "model.safetensors.xz").write_bytes(lzma.compress(bytes(raw), preset=0))
    m = json.loads((root / "MANIFEST.json").read_text())
    m["stored"]["drafter/model.safetensors"]["sha256"] = file_sha256(root / "drafter" / "model.safetensors.xz")
    (root / "MANIFEST.json").write_text(json.dumps(m))
    bundle, _ = find_shipped(_recipe(), fp, root=tmp_path / "shipped")  # stored hashes agree
    assert bundle is not None
    with pytest.raises(ShippedDrafterError, match="model.safetensors unpacks to sha256"):
        materialize(ShippedDrafter(root, m), tmp_path / "bad")
    assert not (tmp_path / "bad" / "model.safetensors").exists()


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


def test_a_few_held_out_features_are_stored_apart_from_the_whole_set(tmp_path):
    """The session fixture asks a served bundle for its first few held-out samples' features; ``score``
    asks for all of them. A partial set stored under the whole set's name was found complete by the
    second caller, which then scored 4 of 189 samples: each set now has its own folder, and a partial
    set an earlier version left under the whole name is extracted again."""
    import shutil

    from kimi_perf.eagle3.features import FeatureStore

    path, fp = _target()
    recipe = _recipe()
    bundle, _ = find_shipped(recipe, fp)
    few = install(bundle, recipe, path, fp, root=tmp_path, heldout_features=2)
    assert len(FeatureStore(few.feature_dir).sample_ids) == 2
    whole = install(bundle, recipe, path, fp, root=tmp_path)
    assert whole.feature_dir != few.feature_dir
    assert set(FeatureStore(whole.feature_dir).sample_ids) == set(whole.heldout_ids)
    # an older cache: the partial set under the whole set's name, marked complete
    shutil.rmtree(whole.feature_dir)
    shutil.copytree(few.feature_dir, whole.feature_dir)
    again = install(bundle, recipe, path, fp, root=tmp_path)
    assert set(FeatureStore(again.feature_dir).sample_ids) == set(whole.heldout_ids)


def test_a_trained_drafter_is_compared_with_the_shipped_one_file_by_file(tmp_path):
    """CI trains the recipe (--perf-train-drafter); the fixture then says whether the result is the shipped
    artifact byte for byte (it was, on the box that exported it) or not (reported, never failed)."""
    from kimi_perf.eagle3.shipped import compare_with_shipped, materialize

    _, fp = _target()
    bundle, _ = find_shipped(_recipe(), fp)
    assert bundle is not None
    d = materialize(bundle, tmp_path / "drafter")
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
    from kimi_perf.eagle3.shipped import export, materialize

    _, fp = _target()
    bundle, _ = find_shipped(_row_recipe("reference"), fp)
    assert bundle is not None
    d = materialize(bundle, tmp_path / "drafter")
    (d / "COMPLETE").write_text("ok\n")
    served = replace(_row_recipe("reference"), features=replace(_row_recipe("reference").features,
                                                                 server_url="http://127.0.0.1:41234"))
    rep = json.loads((d / "report.json").read_text())
    (d / "report.json").write_text(json.dumps({**rep, "recipe": _jsonable(served)}))
    out = export(d, bundle.root / "heldout_samples.jsonl", _row_recipe("reference"), fp, out_root=tmp_path / "out",
                 preset=0)
    assert "41234" not in (out / "drafter" / "report.json").read_text()
    assert find_shipped(_row_recipe("reference"), fp, root=tmp_path / "out")[0] is not None
    other = replace(served, train=replace(served.train, epochs=served.train.epochs + 1))
    (d / "report.json").write_text(json.dumps({**rep, "recipe": _jsonable(other)}))
    with pytest.raises(ShippedDrafterError, match="another recipe"):
        export(d, bundle.root / "heldout_samples.jsonl", _row_recipe("reference"), fp, out_root=tmp_path / "out2")


def test_a_packed_bundle_comes_back_whole_and_is_found(tmp_path):
    """A GPU lease returns its drafter cut into parts (at most 16 MiB a file): unpacking here gives the same
    bundle, which find_shipped then serves; the parts are byte-identical when packed twice."""
    from kimi_perf.eagle3.shipped import pack_bundle, unpack_bundle

    _, fp = _target()
    src, _ = find_shipped(_recipe(), fp)
    assert src is not None
    ix = pack_bundle(src.root, tmp_path / "parts", part_mib=4)
    assert len(ix["parts"]) >= 3 and all(p["size"] <= 4 << 20 for p in ix["parts"])
    again = pack_bundle(src.root, tmp_path / "parts2", part_mib=4)
    assert again["tar_sha256"] == ix["tar_sha256"]
    dest = unpack_bundle(tmp_path / "parts", tmp_path / "root")
    assert dest == tmp_path / "root" / src.name
    got, _ = find_shipped(_recipe(), fp, root=tmp_path / "root")
    assert got is not None and got.manifest == src.manifest
    assert sorted(p.name for p in (tmp_path / "root").iterdir()) == [src.name]  # no temporary folder left


def test_a_damaged_missing_or_foreign_part_is_refused_and_nothing_is_installed(tmp_path):
    from kimi_perf.eagle3.shipped import main, pack_bundle, unpack_bundle

    _, fp = _target()
    src, _ = find_shipped(_recipe(), fp)
    assert src is not None
    parts = tmp_path / "parts"
    ix = pack_bundle(src.root, parts, part_mib=4)
    first, second = (parts / p["file"] for p in ix["parts"][:2])
    keep = second.read_bytes()
    second.write_bytes(keep[:-1] + bytes([keep[-1] ^ 1]))
    with pytest.raises(ShippedDrafterError, match=f"{second.name} damaged"):
        unpack_bundle(parts, tmp_path / "root")
    second.unlink()
    with pytest.raises(ShippedDrafterError, match=f"{second.name} missing"):
        unpack_bundle(parts, tmp_path / "root")
    second.write_bytes(keep)
    # an index of another build: every part intact by its own entry, the whole tar not the index's
    index = json.loads((parts / "drafter-bundle.json").read_text())
    (parts / "drafter-bundle.json").write_text(json.dumps({**index, "tar_sha256": "0" * 64}))
    with pytest.raises(ShippedDrafterError, match="different builds"):
        unpack_bundle(parts, tmp_path / "root")
    assert not (tmp_path / "root").exists() or not any((tmp_path / "root").iterdir())
    assert main(["unpack", str(parts), "--into", str(tmp_path / "root")]) == 1
    assert first.is_file()


def test_a_bundle_that_fails_its_own_manifest_is_not_put_in_place(tmp_path):
    """The parts are intact but a file inside is not the one the manifest names (a hand edit before
    packing): the unpacked copy is removed, not served."""
    from kimi_perf.eagle3.shipped import pack_bundle, unpack_bundle
    from kimi_perf.wheelhouse.parts import pack_parts

    _, fp = _target()
    src, _ = find_shipped(_recipe(), fp)
    assert src is not None
    pack_bundle(src.root, tmp_path / "good", part_mib=64)
    edited = tmp_path / "edited"
    shutil.copytree(src.root, edited)
    (edited / "drafter" / "config.json").write_text("{}")
    files = [(f"{src.name}/{p.relative_to(edited)}", p) for p in sorted(edited.rglob("*")) if p.is_file()]
    res = pack_parts(files, tmp_path / "bad", "drafter-bundle", 64 << 20)
    index = json.loads((tmp_path / "good" / "drafter-bundle.json").read_text())
    index.update(tar_size=res.tar_size, tar_sha256=res.tar_sha256, parts=[vars(p) for p in res.parts])
    (tmp_path / "bad" / "drafter-bundle.json").write_text(json.dumps(index))
    with pytest.raises(ShippedDrafterError, match="config.json has sha256"):
        unpack_bundle(tmp_path / "bad", tmp_path / "root")
    assert list((tmp_path / "root").iterdir()) == []


def test_pack_and_unpack_on_the_command_line_as_the_build_lease_runs_them(tmp_path, capsys):
    """The build job runs ``pack --profile P --drafter-dir D --out DIR`` after training; ``merge`` runs
    ``unpack DIR`` here. A drafter laid out as the pipeline caches it goes through both."""
    from kimi_perf.eagle3.shipped import main, materialize

    _, fp = _target()
    src, _ = find_shipped(_recipe(), fp)
    assert src is not None
    d = materialize(src, tmp_path / "work" / "x" / "y" / "drafter")  # <data>/<features>/<train>/drafter
    (d / "COMPLETE").write_text("ok\n")
    shutil.copyfile(src.root / "heldout_samples.jsonl", tmp_path / "work" / "samples.jsonl")
    assert main(["pack", "--profile", "embedded-cpu", "--drafter-dir", str(d), "--out", str(tmp_path / "parts"),
                 "--part-mib", "4"]) == 0
    assert "into 3 parts" in capsys.readouterr().out
    assert main(["unpack", str(tmp_path / "parts"), "--into", str(tmp_path / "root")]) == 0
    got, _ = find_shipped(_recipe(), fp, root=tmp_path / "root")
    assert got is not None
    for f in ("drafter/model.safetensors", "drafter/config.json", "heldout_samples.jsonl"):
        assert got.manifest["files"][f] == src.manifest["files"][f], f


def test_perf_drafter_takes_a_bundle_folder_and_serves_it_written_out_once(tmp_path):
    """``--perf-drafter`` names a checkpoint or a shipped bundle (its folder or the drafter folder in it);
    the bundle's compressed weights are written out under the cache once and served from there."""
    from kimi_perf.eagle3.shipped import bundle_at, served_path

    _, fp = _target()
    src, _ = find_shipped(_recipe(), fp)
    assert src is not None
    assert bundle_at(src.root).name == src.name and bundle_at(src.root / "drafter").name == src.name
    out = served_path(src, root=tmp_path)
    assert out == tmp_path / "eagle3" / "bundles" / src.name / "drafter" and (out / "COMPLETE").is_file()
    assert json.loads((out / "config.json").read_text())["architectures"] == ["LlamaForCausalLMEagle3"]
    stamp = (out / "model.safetensors").stat().st_mtime_ns
    assert served_path(src, root=tmp_path) == out and (out / "model.safetensors").stat().st_mtime_ns == stamp
    assert bundle_at(out) is None  # a plain checkpoint: served as it is
    bad = tmp_path / "bad" / src.name
    shutil.copytree(src.root, bad)
    (bad / "heldout_samples.jsonl").write_text("")
    with pytest.raises(ShippedDrafterError, match="heldout_samples.jsonl has sha256"):
        bundle_at(bad / "drafter")


def test_every_reader_of_perf_drafter_reads_the_bundles_checkpoint(tmp_path, monkeypatch):
    """The alignment plan reads the served drafter's aux layers from its config: given a bundle folder
    (which holds no config.json at its top) it reads the written-out checkpoint's, as the server loads it."""
    from kimi_perf.eagle3.shipped import checkpoint_dir
    from kimi_perf.profiles import load_profile
    from kimi_perf.suite.alignment import build_alignment_settings
    from kimi_perf.suite.models import TargetModel

    monkeypatch.setenv("KIMI_PERF_CACHE", str(tmp_path))
    path, fp = _target()
    src, _ = find_shipped(_recipe(), fp)
    assert src is not None
    target = TargetModel("smollm2", path, "embedded", fp)
    section = load_profile(ROOT / "profiles" / "embedded-cpu.json").alignment
    got = build_alignment_settings(section, target, str(src.root))
    assert got.aux == (2, 15, 27)
    assert checkpoint_dir(src.root).is_relative_to(tmp_path)
    assert checkpoint_dir(tmp_path / "plain") == tmp_path / "plain"
    with pytest.raises(pytest.UsageError, match="--perf-drafter"):
        build_alignment_settings(section, target, str(tmp_path / "plain"))


@pytest.fixture(scope="module")
def score_cache(tmp_path_factory) -> Path:
    """One cache for the two ``score`` tests below: both score the CPU bundle, and each computing its
    held-out features again in a cache of its own cost ~20 s of CI time on the 2-core box."""
    return tmp_path_factory.mktemp("score-cache")


def test_score_predicts_the_served_chain_from_the_held_out_rows(tmp_path, monkeypatch, capsys, score_cache):
    """``shipped score``: teacher-forced top-1 per draft step and the chain walk's accept length on the
    bundle's held-out samples, without an engine. Measured on the 2-core box: predicted 1.296
    (0.218 / 0.060 / 0.018) where the reference engine served 1.283 (0.220 / 0.048 / 0.015)."""
    from kimi_perf.eagle3.shipped import main

    monkeypatch.setenv("KIMI_PERF_CACHE", str(score_cache))
    assert main(["score", "--json", str(tmp_path / "s.json")]) == 0
    assert "a 3-draft chain accepts" in capsys.readouterr().out
    doc = json.loads((tmp_path / "s.json").read_text())
    ev = doc["scores"]["mtbench"]
    ch = ev["chain"]
    assert ev["samples"] == _recipe().data.max_heldout_items and ch["steps"] == 3
    assert ch["accept_length"] == pytest.approx(1 + sum(ch["per_position"]))
    assert ch["per_position"] == sorted(ch["per_position"], reverse=True)
    # every verify step consumes 1 + accepted response tokens: the steps and the positions agree
    assert ch["verify_steps"] * ch["accept_length"] == pytest.approx(ev["positions"], rel=0.05)
    # measured 1.296 on the 2-core box (served: 1.283); another CPU's fp32 features may flip a few
    # argmaxes, not more: a walk that starts, advances or cuts a chain wrongly moves it by more than 0.05
    assert ch["accept_length"] == pytest.approx(1.296, abs=0.05), ch


def test_score_takes_a_bundle_by_name_whatever_the_profiles_recipe(tmp_path, monkeypatch, capsys, score_cache):
    """``score --bundle NAME`` scores a bundle by the recipe in its manifest: a GPU lease's bundle names
    another target conversion and, once a recipe warm-starts from it, a recipe the profile has left.
    Here the CPU bundle is named while the profile is h200-embedded, whose recipe is not the bundle's."""
    from kimi_perf.eagle3.shipped import main

    monkeypatch.setenv("KIMI_PERF_CACHE", str(score_cache))
    name = find_shipped(_recipe(), _target()[1])[0].name
    assert main(["score", "--profile", "h200-embedded", "--bundle", name, "--json", str(tmp_path / "s.json")]) == 0
    doc = json.loads((tmp_path / "s.json").read_text())
    assert doc["bundle"] == name
    assert doc["scores"]["mtbench"]["chain"]["accept_length"] == pytest.approx(1.296, abs=0.05)
    capsys.readouterr()
    assert main(["score", "--bundle", "no-such-bundle"]) == 1
    assert "'no-such-bundle' is not a drafter bundle shipped in" in capsys.readouterr().out


@pytest.mark.parametrize("bundle_kind", ["cpu", "gpu"])
def test_a_drafter_is_measured_on_the_same_prompts_served_by_recipe_or_as_a_bundle(bundle_kind):
    """--perf-drafter and eagle3.serve take the held-out MT-bench prompts from the stable split, a
    recipe's drafter from its held-out samples: the two must be the same prompts in the same order, or
    one drafter reads 1.837 served one way and 2.077 the other (the 47K drafter's predictions on 8
    prompts x 64 tokens: per prompt acceptance varies that much)."""
    from transformers import AutoTokenizer

    from kimi_perf.eagle3.pipeline import heldout_prompts
    from kimi_perf.profiles import load_profile
    from kimi_perf.suite.drafters import heldout_mtbench_prompts

    path, fp = _target()
    tok = AutoTokenizer.from_pretrained(str(path))
    profile = load_profile(ROOT / "profiles" / ("embedded-cpu.json" if bundle_kind == "cpu" else "h200-embedded.json"))
    name = (find_shipped(_recipe(), fp)[0].name if bundle_kind == "cpu"
            else "c6777fd6e43c3e90-002c71e6c1a8-03d0b33f6cff-2272382829dc")
    root = SHIPPED_ROOT / name
    report = json.loads((root / "drafter" / "report.json").read_text())
    recipe_side = heldout_prompts(root / "heldout_samples.jsonl", tuple(report["data"]["heldout_ids"]))
    # the prompts the profile measures (eval.prompts: 8 on the CPU box, 20 on a GPU); the CPU recipe
    # holds out 12 MT-bench turns, the first 12 of the split, so past its 8 the two sets part
    n = profile.eagle3.eval.prompts
    assert len(recipe_side) >= n
    assert [list(p) for p in heldout_mtbench_prompts(tok, n)] == [list(p) for p in recipe_side[:n]]


def test_a_drafter_is_named_alike_served_trained_or_passed_and_a_foreign_one_by_its_bytes(tmp_path):
    """Baselines name the drafter that measured them (PerfGate.check's ``measured_with``): by the recipe's
    digests whether the bundle is served, the recipe trained (CI) or the bundle passed with --perf-drafter
    (its folder or its drafter folder), so a retrain compares with the shipped copy's baseline; a plain
    checkpoint is named by its weights. The embedded-cpu baselines of the session drafter name the
    recipe as the run names it now, or the run would report them NEW and gate nothing."""
    from kimi_perf.eagle3.shipped import drafter_identity, identity_of_checkpoint, recipe_key, served_path
    from kimi_perf.models.embedded import file_sha256

    _, fp = _target()
    r = _recipe()
    src, _ = find_shipped(r, fp)
    assert src is not None
    key = recipe_key(r)
    want = drafter_identity(key)
    assert want == f"recipe {key['data']}-{key['generation']}-{key['features']}-{key['train']}"
    assert identity_of_checkpoint(src.root) == identity_of_checkpoint(src.root / "drafter") == want
    out = served_path(src, root=tmp_path)
    assert identity_of_checkpoint(out) == "weights " + file_sha256(out / "model.safetensors")[:16]
    stored = json.loads((ROOT / "baselines" / "embedded-cpu.json").read_text())["entries"]
    named = {f"{e['key']['scenario']}[{e['key']['engine']}]": e.get("extra", {}).get("measured_with", {}).get("drafter")
             for e in stored if e["key"]["scenario"] in ("eagle3_acceptance", "eagle3_speedup")}
    assert named and set(named.values()) == {want}, named


def test_a_served_bundle_gets_its_recipes_features_for_a_few_held_out_samples(tmp_path, monkeypatch):
    """``eagle3.serve`` (embedded-cpu serves the GPU-built 47K drafter in the main job): the bundle's own
    recipe makes the features of its first held-out samples on this machine's device, so the
    stored-features and layer-offset tests run on the served drafter; four, not its 189 (~80 s on 2
    cores)."""
    from types import SimpleNamespace

    from kimi_perf.eagle3.features import FeatureStore
    from kimi_perf.eagle3.shipped import bundle_at
    from kimi_perf.profiles import load_profile
    from kimi_perf.suite.drafters import _served_features

    path, fp = _target()
    monkeypatch.setenv("KIMI_PERF_CACHE", str(tmp_path))
    served = load_profile(ROOT / "profiles" / "embedded-cpu.json").eagle3.serve
    feat_dir, ids = _served_features(bundle_at(SHIPPED_ROOT / served), SimpleNamespace(path=path, fingerprint=fp))
    assert feat_dir is not None and str(feat_dir).startswith(str(tmp_path)) and len(ids) == 4
    assert set(FeatureStore(feat_dir).sample_ids) == set(ids)
    held = [json.loads(line)["id"] for line in (SHIPPED_ROOT / served / "heldout_samples.jsonl").read_text().splitlines()]
    assert set(ids) <= set(held[:4]) and len(held) > 100


def test_a_served_bundle_does_not_stand_in_for_the_matrix_row_of_the_recipes_own_features(tmp_path, monkeypatch):
    """The reduced matrix compares drafters of one recipe that differ only in their feature path. The
    session's drafter stands in for the row of the recipe's own features, but not when the session serves
    ``eagle3.serve``'s bundle (another recipe): then the row gets the recipe's shipped drafter. Served in
    its place once, the 47K drafter read "hf -> reference 1.782 vs 1.287 for the own-features drafter"."""
    from types import SimpleNamespace

    from kimi_perf.suite.drafters import DrafterHandle
    from kimi_perf.suite.matrix import ExtractionMatrix

    path, fp = _target()
    monkeypatch.setenv("KIMI_PERF_CACHE", str(tmp_path))
    recipe = _recipe()
    own, _ = find_shipped(recipe, fp)
    assert own is not None
    m = ExtractionMatrix.__new__(ExtractionMatrix)
    m.recipe, m.target, m._reports = recipe, SimpleNamespace(path=path, fingerprint=fp), {}
    row = SimpleNamespace(name="hf", describe=lambda: "hf")
    session = Path("/drafters/session")
    m.drafter = DrafterHandle(session, 3, (), None, (), {"source": "trained"})
    assert m._build(row, recipe.features) == session
    m.drafter = DrafterHandle(session, 3, (), None, (), {"source": "served"}, served=True)
    got = m._build(row, recipe.features)
    assert got != session and str(got).startswith(str(tmp_path))
    assert m._reports["hf"]["shipped"]["bundle"] == own.name
