"""A shipped EAGLE-3 drafter bundle as a thing on disk: where bundles live, their manifest, verification,
writing the weights out where an engine loads them, and bundles retired from the tree.

Why apart from :mod:`kimi_perf.eagle3.shipped`: that module also builds, installs and scores bundles,
for which it needs the drafter pipeline, and the pipeline's trainer needs a bundle's weights to warm-start
from (``train.init_from``): with both in one module the trainer, the pipeline and the shipping code
imported each other. This one needs nothing of the pipeline, so the trainer, the profile loader
(which checks ``eagle3.serve`` and ``init_from`` names at load, without torch) and the shipping code
all import it. :mod:`kimi_perf.eagle3.shipped` re-exports every name, so callers keep one import path.
"""

from __future__ import annotations

import json
import shutil
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ..models.embedded import cache_root, file_lock, file_sha256

__all__ = ["COMPRESSED", "DRAFTER_FILES", "FORMAT", "HELDOUT_FILE", "READS", "RETIRED_FILE", "SHIPPED_ROOT",
           "ShippedDrafter", "ShippedDrafterError", "bundle_at", "checkpoint_dir", "drafter_identity",
           "identity_of_checkpoint", "manifests", "materialize", "on_disk", "read_manifest", "restore", "retired",
           "served_path", "shipped_names", "verify"]

SHIPPED_ROOT = Path(__file__).resolve().parent / "shipped_drafters"
RETIRED_FILE = "RETIRED.json"  # beside the bundles: those retired from the tree (:func:`retired`)
FORMAT = "kimi-perf-shipped-drafter/2"
READS = ("kimi-perf-shipped-drafter/1", FORMAT)  # /1: every file stored as trained
COMPRESSED = ("drafter/model.safetensors",)  # stored as <name>.xz
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


def drafter_identity(key: Mapping[str, str]) -> str:
    """How a baseline names the drafter it was measured with, from a recipe key
    (:func:`kimi_perf.eagle3.shipped.recipe_key`, which needs the pipeline this module stays clear of, or
    a bundle manifest's ``recipe_key``): ``recipe DATA-GENERATION-FEATURES-TRAIN``, the digests the cached
    pipeline's folders carry (``gen-GENERATION/features-FEATURES/drafter-DATA-TRAIN``).

    Why not the fingerprint too: it hashes the converted model's ``config.json``, which the converting
    library's version rewrites (the same SmolLM2-135M GGUF gives a114c67ab3aea404 on the CPU box and
    c6777fd6e43c3e90 on the GPU lease), while the key's ``model`` already names the target. Why not the
    weights' hash: a recipe retrained (CI retrains embedded-cpu's every run) gives other bytes for the
    same drafter, and the profile's floors are set for that retrain spread."""
    return f"recipe {key['data']}-{key['generation']}-{key['features']}-{key['train']}"


def identity_of_checkpoint(path: str | Path) -> str:
    """The identity of what ``--perf-drafter`` names: a shipped bundle's recipe (:func:`drafter_identity`),
    else the sha256 of the weights (``weights <16 hex>``): a checkpoint from elsewhere is known by its
    bytes (a pipeline drafter's folder too: its report keeps the recipe's settings, not their digests)."""
    bundle = bundle_at(Path(path))
    if bundle is not None:
        return drafter_identity(bundle.manifest["recipe_key"])
    p = Path(path)
    weights = sorted(p.glob("*.safetensors"))
    if not weights:
        return f"checkpoint {p.name} (no weights to hash)"
    return "weights " + "+".join(file_sha256(w)[:16] for w in weights)


def read_manifest(m: Path) -> dict[str, Any]:
    try:
        d = json.loads(m.read_text())
    except ValueError as ex:
        raise ShippedDrafterError(f"{m}: not JSON ({ex}); re-export the bundle") from None
    if d.get("format") not in READS:
        raise ShippedDrafterError(f"{m}: format {d.get('format')!r}, expected {FORMAT}; re-export the bundle")
    return d


def manifests(root: Path) -> list[tuple[Path, dict[str, Any]]]:
    return [(root / name, read_manifest(root / name / "MANIFEST.json")) for name in shipped_names(root)]


def on_disk(manifest: dict[str, Any]) -> dict[str, str]:
    """The bundle's files as stored (a compressed one under its ``.xz`` name) and their sha256."""
    stored = manifest.get("stored", {})
    return {(stored[rel]["file"] if rel in stored else rel): (stored[rel]["sha256"] if rel in stored else sha)
            for rel, sha in manifest.get("files", {}).items()}


def verify(bundle: ShippedDrafter) -> None:
    """Every file of the manifest is there with its sha256 as stored, and nothing the drafter needs is
    missing (a compressed file's content is checked when it is written out: :func:`materialize`)."""
    files = dict(bundle.manifest.get("files", {}))
    need = {*(f"drafter/{f}" for f in DRAFTER_FILES), HELDOUT_FILE}
    if need - set(files):
        raise ShippedDrafterError(f"shipped drafter {bundle.root}: manifest lists no {sorted(need - set(files))}; "
                                  "re-export it (python -m kimi_perf.eagle3.shipped export)")
    for rel, want in on_disk(bundle.manifest).items():
        p = bundle.root / rel
        if not p.is_file():
            raise ShippedDrafterError(f"shipped drafter {bundle.root}: {rel} is missing (a partial checkout? a Git "
                                      "LFS pointer?); restore it or pass --perf-train-drafter")
        got = file_sha256(p)
        if got != want:
            raise ShippedDrafterError(f"shipped drafter {bundle.root}: {rel} has sha256 {got[:16]}..., its manifest "
                                      f"says {want[:16]}...: the file is not the one the recipe built. Restore it "
                                      "(git checkout), re-export it, or pass --perf-train-drafter")


def materialize(bundle: ShippedDrafter, out: Path) -> Path:
    """Write the bundle's drafter (config, weights, report) into ``out`` as the engines read it, each file
    checked against the sha256 the recipe's build gave it. Returns ``out``."""
    import lzma

    files, stored = bundle.manifest["files"], bundle.manifest.get("stored", {})
    out.mkdir(parents=True, exist_ok=True)
    for f in DRAFTER_FILES:
        rel = f"drafter/{f}"
        tmp = out / f".{f}.tmp"
        if rel in stored:
            with lzma.open(bundle.root / stored[rel]["file"]) as src, tmp.open("wb") as dst:
                shutil.copyfileobj(src, dst, 1 << 22)
        else:
            shutil.copyfile(bundle.root / rel, tmp)
        got = file_sha256(tmp)
        if got != files[rel]:
            tmp.unlink()
            raise ShippedDrafterError(f"shipped drafter {bundle.root}: {rel} unpacks to sha256 {got[:16]}..., its "
                                      f"manifest says {files[rel][:16]}...: re-export the bundle")
        tmp.replace(out / f)
    return out


def bundle_at(path: Path) -> ShippedDrafter | None:
    """The verified bundle at ``path`` (its folder, or the ``drafter`` folder inside it), None when
    ``path`` is not a bundle: ``--perf-drafter`` takes either a checkpoint or a shipped bundle."""
    path = Path(path)
    root = path.parent if path.name == "drafter" and (path.parent / "MANIFEST.json").is_file() else path
    if not (root / "MANIFEST.json").is_file():
        return None
    b = ShippedDrafter(root, read_manifest(root / "MANIFEST.json"))
    verify(b)
    return b


def served_path(bundle: ShippedDrafter, root: Path | None = None) -> Path:
    """The bundle's drafter written out once under the cache (``<cache>/eagle3/bundles/<name>/drafter``),
    where an engine can load it: the weights ship compressed."""
    out = (root or cache_root()) / "eagle3" / "bundles" / bundle.name / "drafter"
    with file_lock(out.parent.parent / ".bundles.lock", what="writing out a shipped EAGLE-3 drafter"):
        if not (out / "COMPLETE").is_file():
            materialize(bundle, out)
            (out / "COMPLETE").write_text("shipped\n")
    return out


def checkpoint_dir(path: str | Path) -> Path:
    """Where to load the drafter ``--perf-drafter`` names: a checkpoint folder as it is, a shipped bundle
    (its folder or its ``drafter`` folder) written out by :func:`served_path`. Every reader of the
    option resolves it here, so the server and the alignment plan read the same checkpoint."""
    bundle = bundle_at(Path(path))
    return Path(path) if bundle is None else served_path(bundle)


def shipped_names(root: Path = SHIPPED_ROOT) -> list[str]:
    """The folder names of the bundles under ``root`` (those with a manifest), sorted; no file is read or
    hashed, so the profile loader can list them at load."""
    return sorted(m.parent.name for m in Path(root).glob("*/MANIFEST.json"))


def retired(root: Path = SHIPPED_ROOT) -> dict[str, dict[str, str]]:
    """Bundles retired from the working tree: name -> {"commit": where the tree last held it, "why"}.

    Why: the tree travels with every leased GPU call, 64 MiB with the wheelhouse part the call carries,
    and a bf16 GPU drafter stores 16 MB. A bundle nothing serves any more but that a recipe still names
    as its warm start's parent (``train.init_from``) leaves the tree, as the sample packs did
    (``benchmarks/h200-drafter-lease/3-data/packs.txt``), and stays one :func:`restore` away."""
    f = Path(root) / RETIRED_FILE
    if not f.is_file():
        return {}
    return {str(k): dict(v) for k, v in json.loads(f.read_text()).get("bundles", {}).items()}


def restore(name: str, into: Path = SHIPPED_ROOT) -> Path:
    """Put the retired bundle ``name`` back under ``into`` from the commit :func:`retired` names (``git
    archive`` of this checkout's history), verified against its own manifest. Returns its folder."""
    import io
    import subprocess
    import tarfile
    import tempfile

    info = retired().get(name)
    if info is None:
        raise ShippedDrafterError(f"{name!r} is not a retired bundle (retired: {sorted(retired()) or 'none'})")
    repo = Path(__file__).resolve().parents[2]
    rel = f"kimi_perf/eagle3/shipped_drafters/{name}"
    proc = subprocess.run(["git", "-C", str(repo), "archive", "--format=tar", info["commit"], rel],
                          capture_output=True, check=False)
    if proc.returncode != 0:
        raise ShippedDrafterError(f"git archive {info['commit']} {rel} failed ({proc.stderr.decode().strip()}): "
                                  "restore from a clone with the project's history (not a shallow clone or "
                                  "an installed package)")
    Path(into).mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix="kimi-perf-restore-", dir=into) as tmp:
        with tarfile.open(fileobj=io.BytesIO(proc.stdout), mode="r:") as tar:
            tar.extractall(tmp, filter="data")
        got = Path(tmp) / rel
        verify(ShippedDrafter(got, read_manifest(got / "MANIFEST.json")))
        dest = Path(into) / name
        shutil.rmtree(dest, ignore_errors=True)
        got.rename(dest)
    return dest
