"""Building a wheelhouse end to end (download, check, repack, pack) and staging one part for a transfer."""

from __future__ import annotations

import hashlib
import json
import re
import shutil
import sys
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ._base import DEFAULT_PART_SIZE, MIB, WheelhouseError, _mb, _say, canonical_name
from .parts import PartInfo, _clear_parts, pack_parts, write_install_sh
from .plan import Plan, PlanEntry
from .repack import RepackResult, repack_wheel
from .resolve import _run_pip
from .rules import RepackRule
from .target import TargetSpec


@dataclass(frozen=True)
class BuildResult:
    out_dir: Path
    manifest: Path
    install_sh: Path
    parts: tuple[PartInfo, ...]
    wheels: tuple[Path, ...]
    repacks: tuple[RepackResult, ...]
    tar_size: int


def _sha256_file(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(4 * MIB):
            h.update(chunk)
    return h.hexdigest()


def download(
    entries: Sequence[PlanEntry],
    target: TargetSpec,
    cache: Path,
    *,
    python: str = sys.executable,
    pip_args: Sequence[str] = (),
    say: Callable[[str], None] = _say,
) -> dict[str, Path]:
    """The wheels of ``entries`` in ``cache`` (kept between runs), each checked against the report's
    sha256: ``file://`` URLs are copied, the rest fetched by one ``pip download --no-deps`` with the
    target's flags."""
    from urllib.parse import unquote, urlparse

    cache.mkdir(parents=True, exist_ok=True)
    out: dict[str, Path] = {}
    need: list[PlanEntry] = []
    for e in entries:
        dest = cache / e.filename
        if dest.exists() and (e.sha256 is None or _sha256_file(dest) == e.sha256):
            out[e.key] = dest
            continue
        u = urlparse(e.url)
        if u.scheme == "file":
            shutil.copyfile(unquote(u.path), dest)
            out[e.key] = dest
        else:
            need.append(e)
    if need:
        say(f"downloading {len(need)} wheels with pip download into {cache} ...")
        args = [
            "download",
            "--no-deps",
            "--disable-pip-version-check",
            "--progress-bar",
            "off",
            *target.pip_args(),
            "-d",
            str(cache),
            *pip_args,
            *[f"{e.name}=={e.version}" for e in need],
        ]
        _run_pip(python, args, cache.parent / "pip-download.log", "download", target)
        for e in need:
            dest = cache / e.filename
            if not dest.exists():
                raise WheelhouseError(
                    f"pip download did not write {e.filename} for {e.name}=={e.version} (see "
                    f"{cache.parent / 'pip-download.log'}): the index serves other files than the "
                    "resolution saw; run plan again"
                )
            out[e.key] = dest
    for e in entries:
        if e.sha256 and _sha256_file(out[e.key]) != e.sha256:
            bad = out[e.key]
            raise WheelhouseError(
                f"{bad} does not have the sha256 pip's report gives ({e.sha256}); delete it and "
                "build again; if it persists the index changed the file: run plan again"
            )
    return out


def build(
    plan: Plan,
    out_dir: Path,
    *,
    name: str,
    part_size: int = DEFAULT_PART_SIZE,
    repacks: Sequence[RepackRule] = (),
    build_tag: str | None = "1repack",
    python: str = sys.executable,
    pip_args: Sequence[str] = (),
    keep_tar: bool = False,
    extra_manifest: Mapping[str, Any] | None = None,
    say: Callable[[str], None] = _say,
) -> BuildResult:
    """Download the kept wheels, repack, pack into parts and write MANIFEST.json and install.sh.

    Layout of ``out_dir``: ``cache/`` (downloaded wheels, reused by later builds), ``repacked/``,
    ``parts/<name>.tar.part-NNN``, ``install.sh``, ``MANIFEST.json``, ``plan.txt``. The tar holds
    ``wheels/*.whl`` and ``wheelhouse.lock`` (name==version, sha256, file)."""
    if plan.missing:
        raise WheelhouseError(
            "the plan lacks requirements the target needs:\n  "
            + "\n  ".join(plan.missing)
            + "\n-> add them with --spec, or leave them out with --exclude NAME:REASON"
        )
    kept = plan.kept
    if not kept:
        raise WheelhouseError("nothing to carry: the target has everything the closure needs (see the plan)")
    if not re.fullmatch(r"[A-Za-z0-9._+-]+", name):
        raise WheelhouseError(f"--name {name!r}: use letters, digits and . _ + -")
    out_dir.mkdir(parents=True, exist_ok=True)
    (out_dir / "plan.txt").write_text(plan.table() + "\n")
    paths = download(kept, plan.target, out_dir / "cache", python=python, pip_args=pip_args, say=say)

    results: list[RepackResult] = []
    carried: dict[str, Path] = dict(paths)
    repack_notes = []
    for rule in repacks:
        key = canonical_name(rule.package)
        if key not in carried:
            repack_notes.append(
                f"repack {rule.package}: not carried (left out or not in the closure); skipped"
            )
            say(f"note: {repack_notes[-1]}")
            continue
        res = repack_wheel(carried[key], out_dir / "repacked", rule.patterns, build_tag=build_tag)
        say(
            f"repacked {res.source.name} -> {res.wheel.name}: dropped {len(res.dropped)} members, "
            f"{_mb(res.bytes_before)} -> {_mb(res.bytes_after)} MB (saved {_mb(res.saved)} MB)"
        )
        carried[key] = res.wheel
        results.append(res)

    by_key = {e.key: e for e in kept}
    lock_lines, wheel_rows, files = [], [], []
    for key in sorted(carried):
        e, path = by_key[key], carried[key]
        sha = _sha256_file(path)
        lock_lines.append(f"{e.name}=={e.version} sha256={sha} {path.name}")
        files.append((f"wheels/{path.name}", path))
        row = {**e.to_dict(), "file": path.name, "file_size": path.stat().st_size, "file_sha256": sha}
        rep = next((r for r in results if r.wheel == path), None)
        if rep is not None:
            row["repacked"] = rep.to_dict()
        wheel_rows.append(row)
    say(f"packing {len(files)} wheels into parts of at most {part_size / MIB:.1f} MiB ...")
    pack = pack_parts(
        files,
        out_dir / "parts",
        name,
        part_size,
        extra={"wheelhouse.lock": ("\n".join(lock_lines) + "\n").encode()},
        keep_tar=keep_tar,
    )
    install_sh = write_install_sh(out_dir, name, pack, len(files), plan.target)
    manifest = {
        "format": 1,
        "tool": "python -m kimi_perf.wheelhouse",
        "created": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        "name": name,
        "target": {**plan.target.to_dict(), "description": plan.target.describe()},
        **dict(extra_manifest or {}),
        "tar": {
            "file": f"{name}.tar",
            "size": pack.tar_size,
            "sha256": pack.tar_sha256,
            "members": ["wheels/*.whl", "wheelhouse.lock"],
        },
        "part_size": part_size,
        "parts": [{"file": p.file, "size": p.size, "sha256": p.sha256} for p in pack.parts],
        "kept": wheel_rows,
        "left_out": [e.to_dict() for e in plan.left_out],
        "clashes": list(plan.clash_lines),
        "unverified": list(plan.unverified),
        "repacked": [r.to_dict() for r in results],
        "notes": list(plan.notes) + repack_notes,
        "install": (
            "bash install.sh  (PARTS_DIR, SITE=/tmp/site, PYTHON=python3); then export PYTHONPATH=$SITE"
        ),
    }
    mpath = out_dir / "MANIFEST.json"
    mpath.write_text(json.dumps(manifest, indent=1) + "\n")
    return BuildResult(
        out_dir, mpath, install_sh, pack.parts, tuple(p for _, p in files), tuple(results), pack.tar_size
    )


def stage_part(out_dir: Path, index: int, into: Path) -> list[Path]:
    """Put part ``index`` (checked against MANIFEST.json), install.sh and MANIFEST.json into ``into``,
    after removing the parts an earlier ``stage`` left there: one transfer carries one part."""
    mpath = out_dir / "MANIFEST.json"
    if not mpath.exists():
        raise WheelhouseError(
            f"{mpath} not found: run `python -m kimi_perf.wheelhouse build --out {out_dir}` first"
        )
    manifest = json.loads(mpath.read_text())
    parts = manifest["parts"]
    if not 0 <= index < len(parts):
        raise WheelhouseError(f"--part {index}: this build has {len(parts)} parts, 0..{len(parts) - 1}")
    part = parts[index]
    src = out_dir / "parts" / part["file"]
    if not src.exists() or _sha256_file(src) != part["sha256"]:
        raise WheelhouseError(f"{src} is missing or does not match MANIFEST.json: build again")
    into.mkdir(parents=True, exist_ok=True)
    _clear_parts(into, manifest["name"])
    out = []
    for f in (src, out_dir / "install.sh", mpath):
        shutil.copyfile(f, into / f.name)
        out.append(into / f.name)
    (into / "install.sh").chmod(0o755)
    return out
