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
"""

from __future__ import annotations

import argparse
import json
import shutil
import sys
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from ..atomic import atomic_write_json
from ..models.embedded import cache_root, file_lock, file_sha256
from ..progress import log

__all__ = ["SHIPPED_ROOT", "ShippedDrafter", "ShippedDrafterError", "compare_with_shipped", "export", "find_shipped",
           "install", "recipe_key"]

SHIPPED_ROOT = Path(__file__).resolve().parent / "shipped_drafters"
FORMAT = "kimi-perf-shipped-drafter/1"
DRAFTER_FILES = ("config.json", "model.safetensors", "report.json")
HELDOUT_FILE = "heldout_samples.jsonl"


class ShippedDrafterError(RuntimeError):
    """A shipped bundle that must not be served (hash mismatch, missing file, bad manifest)."""


@dataclass(frozen=True)
class ShippedDrafter:
    root: Path
    manifest: dict[str, Any]

    @property
    def name(self) -> str:
        return self.root.name


def recipe_key(recipe: Any) -> dict[str, str]:
    """The digests the cached pipeline keys its stages by (kimi_perf.eagle3.pipeline.build_drafter)."""
    return {"data": recipe.data.digest(), "generation": recipe.data.generation_digest(),
            "features": recipe.features.digest(), "train": recipe.train.digest()}


def _manifests(root: Path) -> list[tuple[Path, dict[str, Any]]]:
    out = []
    for m in sorted(root.glob("*/MANIFEST.json")):
        try:
            d = json.loads(m.read_text())
        except ValueError as ex:
            raise ShippedDrafterError(f"{m}: not JSON ({ex}); re-export the bundle") from None
        if d.get("format") != FORMAT:
            raise ShippedDrafterError(f"{m}: format {d.get('format')!r}, expected {FORMAT}; re-export the bundle")
        out.append((m.parent, d))
    return out


def verify(bundle: ShippedDrafter) -> None:
    """Every file of the manifest is there with its sha256, and nothing the drafter needs is missing."""
    files = dict(bundle.manifest.get("files", {}))
    need = {*(f"drafter/{f}" for f in DRAFTER_FILES), HELDOUT_FILE}
    if need - set(files):
        raise ShippedDrafterError(f"shipped drafter {bundle.root}: manifest lists no {sorted(need - set(files))}; "
                                  "re-export it (python -m kimi_perf.eagle3.shipped export)")
    for rel, want in files.items():
        p = bundle.root / rel
        if not p.is_file():
            raise ShippedDrafterError(f"shipped drafter {bundle.root}: {rel} is missing (a partial checkout? a Git "
                                      "LFS pointer?); restore it or pass --perf-train-drafter")
        got = file_sha256(p)
        if got != want:
            raise ShippedDrafterError(f"shipped drafter {bundle.root}: {rel} has sha256 {got[:16]}..., its manifest "
                                      f"says {want[:16]}...: the file is not the one the recipe built. Restore it "
                                      "(git checkout), re-export it, or pass --perf-train-drafter")


def find_shipped(recipe: Any, target_fingerprint: str, root: Path = SHIPPED_ROOT) -> tuple[ShippedDrafter | None, str]:
    """The verified bundle built by ``recipe`` on this target, or None with the reason none applies."""
    want = recipe_key(recipe)
    seen = []
    for path, m in _manifests(root):
        if m.get("target_fingerprint") == target_fingerprint and m.get("recipe_key") == want:
            b = ShippedDrafter(path, m)
            verify(b)
            return b, f"shipped drafter {path.name} (built {m.get('built', {}).get('created', '?')})"
        seen.append(f"{path.name} (target {m.get('target_fingerprint')}, recipe {m.get('recipe_key')})")
    return None, (f"no shipped drafter matches target {target_fingerprint} and recipe {want} "
                  f"(shipped: {'; '.join(seen) or 'none'})")


def install(bundle: ShippedDrafter, recipe: Any, target_dir: Path, target_fingerprint: str, *,
            root: Path | None = None, heldout_features: bool = True) -> Any:
    """Unpack ``bundle`` into the cache (once) and return it as the pipeline's DrafterArtifact.
    ``heldout_features``: also extract the held-out samples' training-style features (the session
    drafter's stored-features alignment test reads them; a matrix row's drafter is only served)."""
    from .data import read_samples
    from .features import extract_features
    from .pipeline import DrafterArtifact

    base = (root or cache_root()) / "eagle3" / target_fingerprint / f"shipped-{bundle.name}"
    out = base / "drafter"
    samples_path = base / "samples.jsonl"
    feat_dir = base / f"features-{recipe.features.digest()}"
    with file_lock(base.parent / ".pipeline.lock", what="installing the shipped EAGLE-3 drafter"):
        if not (out / "COMPLETE").is_file():
            out.mkdir(parents=True, exist_ok=True)
            for f in DRAFTER_FILES:
                shutil.copyfile(bundle.root / "drafter" / f, out / f)
            shutil.copyfile(bundle.root / HELDOUT_FILE, samples_path)
            (out / "COMPLETE").write_text("shipped\n")
        report = json.loads((out / "report.json").read_text())
        samples = list(read_samples(samples_path).values())
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


def export(drafter_dir: Path, samples_path: Path, recipe: Any, target_fingerprint: str, *,
           out_root: Path = SHIPPED_ROOT, commit: str | None = None) -> Path:
    """Write a bundle from a drafter the pipeline built (its report must name ``recipe``)."""
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
    atomic_write_json(tmp / "MANIFEST.json", {
        "format": FORMAT, "target_fingerprint": target_fingerprint, "recipe_key": key, "recipe": _jsonable(recipe),
        "files": files,
        "built": {"created": report.get("created"), "exported_at_commit": commit,
                  "train": {k: report.get("train", {}).get(k) for k in ("steps", "tokens", "seconds", "final_step_acc")},
                  "data": {k: report.get("data", {}).get(k) for k in ("samples", "train", "heldout", "train_tokens",
                                                                        "samples_digest")}},
    })
    shutil.rmtree(dest, ignore_errors=True)
    tmp.rename(dest)
    return dest


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
    ex = sub.add_parser("export", help="bundle a drafter the pipeline built for a profile's recipe")
    ex.add_argument("--profile", default="embedded-cpu")
    ex.add_argument("--drafter-dir", type=Path, default=None,
                    help="the pipeline's drafter directory (default: where build_drafter caches this recipe)")
    ex.add_argument("--row", default=None, metavar="ROW",
                    help="export the drafter of this extraction-matrix row (e.g. reference: the recipe with the "
                         "row's feature path), which the reduced matrix then serves instead of training")
    ck = sub.add_parser("check", help="say whether a shipped drafter applies to a profile's recipe on this target")
    ck.add_argument("--profile", default="embedded-cpu")
    ck.add_argument("--row", default=None, metavar="ROW", help="check the bundle of this extraction-matrix row")
    a = ap.parse_args(argv)
    prof, recipe = _profile_recipe(a.profile)
    if (prof.get("model") or {}).get("source") != "embedded":
        raise SystemExit(f"profile {a.profile}: only the embedded model ships a drafter")
    model = ensure_embedded_model()
    fp = model_fingerprint(model.path)
    if a.row:
        from dataclasses import replace

        from .matrix import parse_row

        recipe = replace(recipe, features=parse_row(a.row).features_of(recipe.features))
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
    dest = export(d, samples, recipe, fp, commit=commit_info().get("id"))
    print(f"exported {dest} ({sum(f.stat().st_size for f in dest.rglob('*') if f.is_file()) / 1e6:.1f} MB)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
