"""A drafter built by this project's own pipeline and shipped inside the package, so a fresh machine
does not retrain one whose recipe and target did not change.

Why: on a 2-core box the embedded-cpu recipe costs about 8.5 minutes (regenerating data ~205 s, features
~65 s, training ~243 s) before the first EAGLE-3 figure, and every fresh clone paid it. The recipe is
small (one decoder layer at hidden size 576, 12.6 MB in fp32), so the artifact ships with the code.

It is trusted only where it is what the recipe makes. Its ``MANIFEST.json`` names the target's
fingerprint (:func:`kimi_perf.models.embedded.model_fingerprint`, which hashes the model's config and
the source GGUF's sha256), the recipe's digests (data, generation, features, train: the keys the cached
pipeline uses) and the sha256 of every file:

* a recipe or target that differs -> the bundle does not apply; the fixture says so and trains
  (``tests/test_shipped_drafter.py`` fails until the bundle is re-exported, so the main job stays fast);
* a file whose hash differs from the manifest -> :class:`ShippedDrafterError`, never served (a corrupt
  checkout or a hand edit must not be measured as "the drafter");
* ``--perf-train-drafter`` ignores the session drafter's bundle and runs the pipeline (CI passes it, so
  training stays tested end to end on every merge); the reduced matrix's row bundles are served either
  way (``kimi_perf.suite.matrix``, ``_shipped``, says why).

The bundle carries the held-out samples the pipeline generated (prompt and response ids), so acceptance
is measured on the same held-out prompts as a trained drafter's; their training-style features are
re-extracted on first use (seconds: 12 samples through transformers) for the stored-features alignment
test. Re-export after retraining: ``python -m kimi_perf.eagle3.shipped export --profile embedded-cpu``.

The weights are stored xz-compressed (``model.safetensors.xz``; the manifest's ``stored`` names the file
and its sha256, ``files`` keeps the sha256 of the weights as trained): trained floats compress to ~70%
(12.6 -> 8.9 MB for the fp32 CPU drafter, ~70% for bf16), and the repository travels whole to every
leased GPU call, 64 MiB in all with the wheelhouse part it carries. :func:`install` and
:func:`materialize` write the plain file and check it against ``files``. A drafter built on a leased GPU
comes back cut into parts (:func:`pack_bundle`, :func:`unpack_bundle`): the lease's disk does not outlive
it, and a call returns files of at most 16 MiB.
"""

from __future__ import annotations

import argparse
import json
import shutil
import sys
from dataclasses import asdict
from pathlib import Path
from typing import Any

from ..atomic import atomic_write_json
from ..models.embedded import cache_root, file_lock, file_sha256
from ..progress import log
from .bundle import (
    COMPRESSED,
    DRAFTER_FILES,
    FORMAT,
    HELDOUT_FILE,
    SHIPPED_ROOT,
    ShippedDrafter,
    ShippedDrafterError,
    bundle_at,
    checkpoint_dir,
    drafter_identity,
    identity_of_checkpoint,
    manifests,
    materialize,
    on_disk,
    read_manifest,
    restore,
    retired,
    served_path,
    verify,
)

# the bundle's own names (kimi_perf.eagle3.bundle) are re-exported: callers keep this one import path
__all__ = ["SHIPPED_ROOT", "ShippedDrafter", "ShippedDrafterError", "bundle_at", "checkpoint_dir",
           "bundle_recipe", "compare_with_shipped", "drafter_identity", "export", "find_shipped", "identity_of_checkpoint", "install",
           "materialize", "on_disk", "pack_bundle", "recipe_key", "restore", "retired", "served_path", "unpack_bundle",
           "verify"]

PACK_FORMAT = "kimi-perf-drafter-pack/1"
PACK_NAME = "drafter-bundle"


def recipe_key(recipe: Any) -> dict[str, str]:
    """The digests the cached pipeline keys its stages by (kimi_perf.eagle3.pipeline.build_drafter)."""
    return {"data": recipe.data.digest(), "generation": recipe.data.generation_digest(),
            "features": recipe.features.digest(), "train": recipe.train.digest()}


def find_shipped(recipe: Any, target_fingerprint: str, root: Path = SHIPPED_ROOT) -> tuple[ShippedDrafter | None, str]:
    """The verified bundle built by ``recipe`` on this target, or None with the reason none applies."""
    want = recipe_key(recipe)
    seen = []
    for path, m in manifests(root):
        if m.get("target_fingerprint") == target_fingerprint and m.get("recipe_key") == want:
            b = ShippedDrafter(path, m)
            verify(b)
            return b, f"shipped drafter {path.name} (built {m.get('built', {}).get('created', '?')})"
        seen.append(f"{path.name} (target {m.get('target_fingerprint')}, recipe {m.get('recipe_key')})")
    return None, (f"no shipped drafter matches target {target_fingerprint} and recipe {want} "
                  f"(shipped: {'; '.join(seen) or 'none'})")


def install(bundle: ShippedDrafter, recipe: Any, target_dir: Path, target_fingerprint: str, *,
            root: Path | None = None, heldout_features: bool | int = True) -> Any:
    """Unpack ``bundle`` into the cache (once) and return it as the pipeline's DrafterArtifact.
    ``heldout_features``: also extract the held-out samples' training-style features (the session
    drafter's stored-features alignment test reads them; a matrix row's drafter is only served); a
    number: the first that many only (a GPU-built bundle holds 189 held-out samples, ~80 s of CPU
    extraction, where the tests read two)."""
    from .data import read_samples
    from .features import FeatureStore, extract_features
    from .pipeline import DrafterArtifact

    base = (root or cache_root()) / "eagle3" / target_fingerprint / f"shipped-{bundle.name}"
    samples_path = base / "samples.jsonl"
    # a partial set (the first n samples) is stored apart from the whole one, so that a later caller
    # asking for every held-out sample (``score --bundle``) does not find the partial set complete
    part = "" if heldout_features is True or not heldout_features else f"-first{int(heldout_features)}"
    feat_dir = base / f"features-{recipe.features.digest()}{part}"
    with file_lock(base.parent / ".pipeline.lock", what="installing the shipped EAGLE-3 drafter"):
        # the drafter is written out where --perf-drafter with the bundle's folder finds it too
        out = served_path(bundle, root)
        if not samples_path.is_file():
            base.mkdir(parents=True, exist_ok=True)
            shutil.copyfile(bundle.root / HELDOUT_FILE, base / f".{HELDOUT_FILE}.tmp")
            (base / f".{HELDOUT_FILE}.tmp").replace(samples_path)
        report = json.loads((out / "report.json").read_text())
        samples = list(read_samples(samples_path).values())
        if heldout_features is not True:
            samples = samples[:int(heldout_features)]
        if heldout_features and (feat_dir / "COMPLETE").is_file() and \
                len(FeatureStore(feat_dir).sample_ids) < len(samples):
            shutil.rmtree(feat_dir)  # a partial set an earlier version stored under the whole set's name
        if heldout_features and not (feat_dir / "COMPLETE").is_file():
            log(f"drafter: extracting training-style features of the {len(samples)} shipped held-out samples "
                f"(for the stored-features alignment test) into {feat_dir}")
            extract_features(samples, target_dir, feat_dir, recipe.features, model_fingerprint=target_fingerprint,
                             max_len=recipe.train.max_seq_len)
            (feat_dir / "COMPLETE").write_text("ok\n")
    report = {**report, "shipped": {"bundle": bundle.name, **bundle.manifest.get("built", {})}}
    data = report.get("data", {})
    return DrafterArtifact(out, feat_dir, samples_path, tuple(data.get("train_ids", ())),
                           tuple(data.get("heldout_ids", ())), report)


def compare_with_shipped(bundle: ShippedDrafter, drafter_dir: Path) -> dict[str, Any]:
    """A freshly trained drafter of the bundle's recipe against the bundle, file by file.

    Why: on the box that exported it, the pipeline retrained the embedded-cpu recipe byte for byte (the
    clean-clone CI run's model.safetensors had the shipped sha256), so CI's training run doubles as a
    check that the shipped artifact is what the recipe makes. On another CPU or torch build the floats
    may differ; that is reported, not failed (the acceptance gates judge the trained drafter itself)."""
    files = dict(bundle.manifest.get("files", {}))
    out: dict[str, Any] = {"bundle": bundle.name}
    for f in ("config.json", "model.safetensors"):
        p = Path(drafter_dir) / f
        out[f] = "identical" if p.is_file() and file_sha256(p) == files.get(f"drafter/{f}") else "differs"
    out["identical"] = all(out[f] == "identical" for f in ("config.json", "model.safetensors"))
    return out


def _xz(src: Path, dst: Path, preset: int = 6) -> str:
    """Compress ``src`` into ``dst`` -> its sha256. xz's default preset 6: on the fp32 CPU drafter 8.85 MB
    in 8.6 s on the 2-core box, preset 0 9.21 MB in 1.3 s, 9 no smaller than 6; paid once per export."""
    import lzma

    with src.open("rb") as f, lzma.open(dst, "wb", preset=preset) as z:
        shutil.copyfileobj(f, z, 1 << 22)
    return file_sha256(dst)


def export(drafter_dir: Path, samples_path: Path, recipe: Any, target_fingerprint: str, *,
           out_root: Path = SHIPPED_ROOT, commit: str | None = None, preset: int = 6) -> Path:
    """Write a bundle from a drafter the pipeline built (its report must name ``recipe``); ``preset``:
    the weights' xz preset (tests pass 0)."""
    from .data import read_samples
    from .pipeline import _jsonable

    drafter_dir, samples_path = Path(drafter_dir), Path(samples_path)
    if not (drafter_dir / "COMPLETE").is_file():
        raise ShippedDrafterError(f"{drafter_dir}: not a finished pipeline drafter (no COMPLETE)")
    from .pipeline import DrafterRecipe

    report = json.loads((drafter_dir / "report.json").read_text())
    # the pipeline's identity of a recipe is its digests: a matrix row's features name the server they were
    # captured through (server_url, a port of that run), which the digests leave out and so does this check
    try:
        same = recipe_key(DrafterRecipe.from_dict(report.get("recipe") or {})) == recipe_key(recipe)
    except (TypeError, ValueError):
        same = False
    if not same:
        raise ShippedDrafterError(f"{drafter_dir} was trained by another recipe than the profile's: "
                                  f"{report.get('recipe')} vs {_jsonable(recipe)}")
    report = {**report, "recipe": _jsonable(recipe)}
    held = set(report["data"]["heldout_ids"])
    samples = [s for sid, s in read_samples(samples_path).items() if sid in held]
    if len(samples) != len(held):
        raise ShippedDrafterError(f"{samples_path}: has {len(samples)} of the drafter's {len(held)} held-out samples")
    key = recipe_key(recipe)
    name = f"{target_fingerprint}-{key['data']}-{key['features']}-{key['train']}"
    dest = out_root / name
    tmp = out_root / f".{name}.tmp"
    shutil.rmtree(tmp, ignore_errors=True)
    (tmp / "drafter").mkdir(parents=True)
    shutil.copyfile(drafter_dir / "config.json", tmp / "drafter" / "config.json")
    shutil.copyfile(drafter_dir / "model.safetensors", tmp / "drafter" / "model.safetensors")
    # the report's feature directory is a path on the machine that trained it: keep the facts, not the path
    rep = {**report, "features": {k: v for k, v in report.get("features", {}).items() if k != "dir"}}
    (tmp / "drafter" / "report.json").write_text(json.dumps(rep, indent=1, sort_keys=True) + "\n")
    with (tmp / HELDOUT_FILE).open("w") as f:
        for s in sorted(samples, key=lambda s: s.id):
            f.write(json.dumps(asdict(s), sort_keys=True) + "\n")
    files = {rel: file_sha256(tmp / rel) for rel in (*(f"drafter/{f}" for f in DRAFTER_FILES), HELDOUT_FILE)}
    stored = {}
    for rel in COMPRESSED:
        stored[rel] = {"file": f"{rel}.xz", "sha256": _xz(tmp / rel, tmp / f"{rel}.xz", preset)}
        (tmp / rel).unlink()
    atomic_write_json(tmp / "MANIFEST.json", {
        "format": FORMAT, "target_fingerprint": target_fingerprint, "recipe_key": key, "recipe": _jsonable(recipe),
        "files": files, "stored": stored,
        "built": {"created": report.get("created"), "exported_at_commit": commit,
                  "train": {k: report.get("train", {}).get(k) for k in ("steps", "tokens", "seconds", "final_step_acc")},
                  "data": {k: report.get("data", {}).get(k) for k in ("samples", "train", "heldout", "train_tokens",
                                                                        "samples_digest")}},
    })
    shutil.rmtree(dest, ignore_errors=True)
    tmp.rename(dest)
    return dest


def pack_bundle(bundle_dir: Path, out_dir: Path, *, part_mib: float = 12.0) -> dict[str, Any]:
    """One verified bundle as a deterministic tar in parts of at most ``part_mib`` MiB, plus
    ``drafter-bundle.json`` (the parts' sizes and sha256, the whole tar's sha256, the manifest).

    Why: a GPU drafter is built on a leased machine whose disk is gone when the lease ends, and a lease
    returns files of at most 16 MiB each (8 files, 64 MiB a call). The bf16 drafter of ``h200-embedded``
    is 19.7 MB, so it comes back cut; :func:`unpack_bundle` puts it back together here and refuses a
    part that is missing, damaged or from another build."""
    from ..wheelhouse.parts import pack_parts

    bundle_dir, out_dir = Path(bundle_dir), Path(out_dir)
    manifest = read_manifest(bundle_dir / "MANIFEST.json")
    b = ShippedDrafter(bundle_dir, manifest)
    verify(b)
    files = [(f"{b.name}/{rel}", bundle_dir / rel) for rel in (*on_disk(manifest), "MANIFEST.json")]
    res = pack_parts(files, out_dir, PACK_NAME, int(part_mib * (1 << 20)))
    index = {"format": PACK_FORMAT, "bundle": b.name, "tar_size": res.tar_size, "tar_sha256": res.tar_sha256,
             "parts": [asdict(p) for p in res.parts], "manifest": manifest}
    atomic_write_json(out_dir / f"{PACK_NAME}.json", index)
    return index


def unpack_bundle(parts_dir: Path, root: Path = SHIPPED_ROOT) -> Path:
    """Reassemble a :func:`pack_bundle` output into ``root``, check every part, the tar and the bundle's
    own manifest, and only then put it in place (a bundle of the same name is replaced: the same recipe
    rebuilt, which on a GPU is not bit-reproducible). Returns the bundle's folder."""
    import hashlib
    import io
    import tarfile

    parts_dir, root = Path(parts_dir), Path(root)
    ix_path = parts_dir / f"{PACK_NAME}.json"
    if not ix_path.is_file():
        raise ShippedDrafterError(f"{parts_dir}: no {PACK_NAME}.json (the lease's collect did not bring the "
                                  "pack back; collect the folder the build job packed into)")
    ix = json.loads(ix_path.read_text())
    if ix.get("format") != PACK_FORMAT:
        raise ShippedDrafterError(f"{ix_path}: format {ix.get('format')!r}, expected {PACK_FORMAT}")
    buf = io.BytesIO()
    bad = []
    for p in ix["parts"]:
        f = parts_dir / p["file"]
        if not f.is_file():
            bad.append(f"{p['file']} missing")
            continue
        data = f.read_bytes()
        if len(data) != p["size"] or hashlib.sha256(data).hexdigest() != p["sha256"]:
            bad.append(f"{p['file']} damaged ({len(data)} bytes, expected {p['size']})")
            continue
        buf.write(data)
    if bad:
        raise ShippedDrafterError(f"{parts_dir}: {'; '.join(bad)}: collect the parts of this build again")
    if hashlib.sha256(buf.getvalue()).hexdigest() != ix["tar_sha256"]:
        raise ShippedDrafterError(f"{parts_dir}: the reassembled tar's sha256 is not the index's: the parts "
                                  "come from different builds")
    name = ix["bundle"]
    tmp = root / f".{name}.unpack"
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    buf.seek(0)
    with tarfile.open(fileobj=buf, mode="r:") as tar:
        for m in tar.getmembers():
            # members written by pack_bundle only: plain files under the bundle's own folder
            if not m.isfile() or not m.name.startswith(f"{name}/") or ".." in Path(m.name).parts:
                shutil.rmtree(tmp, ignore_errors=True)
                raise ShippedDrafterError(f"{parts_dir}: tar member {m.name!r} is not a file of bundle {name}")
        tar.extractall(tmp, filter="data")
    got = tmp / name
    try:
        verify(ShippedDrafter(got, read_manifest(got / "MANIFEST.json")))
    except (ShippedDrafterError, OSError) as ex:
        shutil.rmtree(tmp, ignore_errors=True)
        raise ShippedDrafterError(f"{parts_dir}: the unpacked bundle {name} is not served: {ex}") from None
    dest = root / name
    shutil.rmtree(dest, ignore_errors=True)
    got.rename(dest)
    shutil.rmtree(tmp, ignore_errors=True)
    return dest


def bundle_recipe(bundle: ShippedDrafter) -> Any:
    """The :class:`~kimi_perf.eagle3.pipeline.DrafterRecipe` in ``bundle``'s manifest, its features made on
    this machine's device (the device is left out of the features digest, kimi_perf.eagle3.features: the
    same features). Raises KeyError, TypeError or ValueError for a manifest of an older recipe format."""
    from dataclasses import replace

    import torch

    from .pipeline import DrafterRecipe

    recipe = DrafterRecipe.from_dict(dict(bundle.manifest["recipe"]))
    return replace(recipe, features=replace(recipe.features, device="cuda" if torch.cuda.is_available() else "cpu"))


def _score_bundle(name: str, target_dir: Path, fp: str, json_out: Path | None) -> int:
    """``score --bundle NAME``: a bundle scored by the recipe in its own manifest, its features made on
    this machine's device. Why: a bundle built on a GPU lease names the target conversion of that lease
    (another fingerprint than the CPU box's, :func:`drafter_identity` says why) and a recipe the profile
    may since have moved on from (a warm start names it in ``init_from``), so :func:`find_shipped` does
    not find it here, while its prediction is what its served acceptance should be read against."""
    b = bundle_at(SHIPPED_ROOT / name) if "/" not in name else None
    if b is None:
        print(f"error: {name!r} is not a drafter bundle shipped in {SHIPPED_ROOT}")
        return 1
    return _score(bundle_recipe(b), target_dir, fp, json_out, bundle=b)


def _score(recipe: Any, target_dir: Path, fp: str, json_out: Path | None, *,
           bundle: ShippedDrafter | None = None) -> int:
    from .pipeline import score_heldout

    b, why = (bundle, "") if bundle is not None else find_shipped(recipe, fp)
    if b is None:
        print(f"error: {why}")
        return 1
    scores = score_heldout(install(b, recipe, target_dir, fp), recipe, target_dir)
    for src, ev in scores.items():
        ch = ev["chain"]
        print(f"{src}: {ev['samples']} samples, {ev['positions']} positions; top-1 per draft step "
              f"{' / '.join(f'{x:.3f}' for x in ev['acc'])} where draftable, "
              f"{' / '.join(f'{x:.3f}' for x in ev['all_acc'])} over all; a {ch['steps']}-draft chain accepts "
              f"{ch['accept_length']:.3f} ({' / '.join(f'{x:.3f}' for x in ch['per_position'])}, "
              f"{ch['verify_steps']} verify steps)")
    if json_out:
        atomic_write_json(json_out, {"bundle": b.name, "scores": scores})
    return 0


def _profile_recipe(name: str) -> tuple[dict[str, Any], Any]:
    """The profile's JSON and its drafter recipe. Read as plain JSON on purpose: kimi_perf.profiles is
    gate configuration, which the drafter pipeline does not import (the recipe is validated by
    DrafterRecipe.from_dict, as the fixture does)."""
    from .pipeline import DrafterRecipe

    p = Path(name)
    if not (p.suffix == ".json" or "/" in name):
        roots = [Path.cwd() / "profiles", Path(__file__).resolve().parents[2] / "profiles"]
        p = next((r / f"{name}.json" for r in roots if (r / f"{name}.json").is_file()), roots[0] / f"{name}.json")
    if not p.is_file():
        raise SystemExit(f"profile {name}: no such file {p}")
    prof = json.loads(p.read_text())
    recipe = (prof.get("eagle3") or {}).get("recipe")
    if recipe is None:
        raise SystemExit(f"profile {p}: no eagle3.recipe")
    return prof, DrafterRecipe.from_dict(recipe)


def main(argv: list[str] | None = None) -> int:
    from ..machine import commit_info
    from ..models.embedded import ensure_embedded_model, model_fingerprint

    ap = argparse.ArgumentParser(prog="python -m kimi_perf.eagle3.shipped", description=__doc__.split("\n\n")[0])
    sub = ap.add_subparsers(dest="cmd", required=True)
    # export, check, score and pack name a profile's recipe (or one matrix row of it) the same way
    which = argparse.ArgumentParser(add_help=False)
    which.add_argument("--profile", default="embedded-cpu")
    which.add_argument("--row", default=None, metavar="ROW",
                       help="the drafter of this extraction-matrix row (e.g. reference: the recipe with the row's "
                            "feature path), which the reduced matrix serves instead of training")
    built = argparse.ArgumentParser(add_help=False)
    built.add_argument("--drafter-dir", type=Path, default=None,
                       help="the pipeline's drafter directory (default: where build_drafter caches this recipe)")
    sub.add_parser("export", parents=[which, built], help="bundle a drafter the pipeline built for a profile's recipe")
    sub.add_parser("check", parents=[which],
                   help="say whether a shipped drafter applies to a profile's recipe on this target")
    sc = sub.add_parser("score", parents=[which],
                        help="a shipped drafter's teacher-forced held-out scores and the accept length its chain "
                             "walk predicts, by source, without an engine")
    sc.add_argument("--json", type=Path, default=None, metavar="PATH", help="also write the scores here")
    sc.add_argument("--bundle", default=None, metavar="NAME",
                    help="score this shipped bundle (its folder name) by its own recipe, whatever the profile's "
                         "recipe is and whichever target conversion built it (a GPU lease's bundle on a CPU box)")
    pk = sub.add_parser("pack", parents=[which, built],
                        help="export a profile's drafter as a bundle cut into parts a lease can return")
    pk.add_argument("--out", type=Path, required=True, help="folder for the parts and drafter-bundle.json")
    pk.add_argument("--part-mib", type=float, default=12.0,
                    help="largest part in MiB (default 12: a lease returns files of at most 16 MiB)")
    rs = sub.add_parser("restore", help="put a bundle retired from the tree (RETIRED.json) back from the history")
    rs.add_argument("name", help="the retired bundle's folder name")
    up = sub.add_parser("unpack", help="reassemble and verify a packed bundle and put it where the suite finds it")
    up.add_argument("parts_dir", type=Path, help="the folder pack wrote (drafter-bundle.json and its parts)")
    up.add_argument("--into", type=Path, default=SHIPPED_ROOT, help=f"bundle root (default {SHIPPED_ROOT})")
    a = ap.parse_args(argv)
    if a.cmd == "restore":
        try:
            dest = restore(a.name)
        except ShippedDrafterError as e:
            print(f"error: {e}")
            return 1
        print(f"restored {dest} from commit {retired()[a.name]['commit'][:12]} (untracked: it stays out of the tree)")
        return 0
    if a.cmd == "unpack":
        try:
            dest = unpack_bundle(a.parts_dir, a.into)
        except ShippedDrafterError as e:
            print(f"error: {e}")
            return 1
        print(f"unpacked {dest} ({sum(f.stat().st_size for f in dest.rglob('*') if f.is_file()) / 1e6:.1f} MB)")
        return 0
    prof, recipe = _profile_recipe(a.profile)
    if (prof.get("model") or {}).get("source") != "embedded":
        raise SystemExit(f"profile {a.profile}: only the embedded model ships a drafter")
    model = ensure_embedded_model()
    fp = model_fingerprint(model.path)
    if a.row:
        from dataclasses import replace

        from .matrix import parse_row

        recipe = replace(recipe, features=parse_row(a.row).features_of(recipe.features))
    if a.cmd == "score":
        if a.bundle:
            return _score_bundle(a.bundle, model.path, fp, a.json)
        return _score(recipe, model.path, fp, a.json)
    if a.cmd == "check":
        try:
            b, why = find_shipped(recipe, fp)
        except ShippedDrafterError as e:
            print(f"error: {e}")
            return 1
        print(why)
        return 0 if b else 1
    from .pipeline import cache_dirs

    data_dir, _, work = cache_dirs(recipe, fp)
    d = a.drafter_dir or work / "drafter"
    samples = d.parent.parent.parent / "samples.jsonl" if a.drafter_dir else data_dir / "samples.jsonl"
    if a.cmd == "pack":
        import tempfile

        with tempfile.TemporaryDirectory(prefix="kimi-perf-bundle-") as tmp:
            dest = export(d, samples, recipe, fp, out_root=Path(tmp), commit=commit_info().get("id"))
            ix = pack_bundle(dest, a.out, part_mib=a.part_mib)
        print(f"packed {ix['bundle']} into {len(ix['parts'])} parts under {a.out} ({ix['tar_size'] / 1e6:.1f} MB)")
        return 0
    dest = export(d, samples, recipe, fp, commit=commit_info().get("id"))
    print(f"exported {dest} ({sum(f.stat().st_size for f in dest.rglob('*') if f.is_file()) / 1e6:.1f} MB)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
