"""Packing wheels into one deterministic tar split into parts, and the install.sh that reassembles them."""

from __future__ import annotations

import hashlib
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

from ._base import _TAR_MTIME, DEFAULT_PART_SIZE, MIB, WheelhouseError, _mb
from .target import TargetSpec


@dataclass(frozen=True)
class PartInfo:
    file: str
    size: int
    sha256: str


@dataclass(frozen=True)
class PackResult:
    parts: tuple[PartInfo, ...]
    tar_size: int
    tar_sha256: str
    members: tuple[str, ...] = ()


def parse_part_size(text: str | int) -> int:
    """``60M`` (MiB), ``512K``, ``1G`` or a byte count."""
    if isinstance(text, int):
        return text
    m = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([KMG]i?B?|B)?\s*", text, re.IGNORECASE)
    if not m:
        raise WheelhouseError(f"part size {text!r}: write e.g. 60M (MiB), 512K or a byte count")
    mult = {"": 1, "b": 1, "k": 1 << 10, "m": 1 << 20, "g": 1 << 30}[(m[2] or "")[:1].lower()]
    n = int(float(m[1]) * mult)
    if n < 1024:
        raise WheelhouseError(f"part size {text!r} is under 1 KiB; give e.g. 60M")
    return n


class _PartWriter:
    """A write-only stream that cuts what it receives into ``<name>.tar.part-NNN`` files."""

    def __init__(self, out_dir: Path, name: str, part_size: int) -> None:
        self.out_dir, self.name, self.part_size = out_dir, name, part_size
        self.whole = hashlib.sha256()
        self.total = 0
        self.parts: list[PartInfo] = []
        self._f: Any = None
        self._h: Any = None
        self._n = 0

    def _open(self) -> None:
        idx = len(self.parts)
        if idx > 999:
            raise WheelhouseError("more than 1000 parts: raise --part-size")
        self._fname = f"{self.name}.tar.part-{idx:03d}"
        self._f = open(self.out_dir / self._fname, "wb")  # noqa: SIM115 - closed in _close
        self._h, self._n = hashlib.sha256(), 0

    def _close(self) -> None:
        if self._f is not None:
            self._f.close()
            self.parts.append(PartInfo(self._fname, self._n, self._h.hexdigest()))
            self._f = None

    def write(self, data: bytes) -> int:
        view = memoryview(data)
        self.whole.update(view)
        self.total += len(view)
        while view:
            if self._f is None:
                self._open()
            take = min(len(view), self.part_size - self._n)
            self._f.write(view[:take])
            self._h.update(view[:take])
            self._n += take
            view = view[take:]
            if self._n == self.part_size:
                self._close()
        return len(data)

    def close(self) -> PackResult:
        self._close()
        return PackResult(tuple(self.parts), self.total, self.whole.hexdigest())


def _clear_parts(out_dir: Path, name: str) -> None:
    for old in out_dir.glob(f"{glob_escape(name)}.tar.part-*"):
        old.unlink()


def glob_escape(text: str) -> str:
    return re.sub(r"([*?\[])", r"[\1]", text)


def pack_parts(
    files: Sequence[tuple[str, Path]],
    out_dir: Path,
    name: str,
    part_size: int = DEFAULT_PART_SIZE,
    *,
    extra: Mapping[str, bytes] | None = None,
    keep_tar: bool = False,
) -> PackResult:
    """One uncompressed tar of ``files`` ((name in the tar, path) pairs; wheels are zips already) and
    ``extra`` (name -> bytes), written straight into parts of at most ``part_size`` bytes. Members are
    sorted and their metadata fixed, so the same inputs give byte-identical parts."""
    import io
    import tarfile

    out_dir.mkdir(parents=True, exist_ok=True)
    _clear_parts(out_dir, name)
    writer = _PartWriter(out_dir, name, part_size)
    sink: Any = writer
    tar_file: Any = None
    if keep_tar:
        tar_file = open(out_dir / f"{name}.tar", "wb")  # noqa: SIM115 - closed below

        class _Tee:
            def write(self, data: bytes) -> int:
                tar_file.write(data)
                return writer.write(data)

        sink = _Tee()
    members = []
    items: list[tuple[str, Path | bytes]] = [(a, p) for a, p in files] + list((extra or {}).items())
    try:
        with tarfile.open(fileobj=sink, mode="w|", format=tarfile.PAX_FORMAT) as tar:
            for arc, src in sorted(items, key=lambda t: t[0]):
                ti = tarfile.TarInfo(arc)
                ti.mtime, ti.mode, ti.uid, ti.gid, ti.uname, ti.gname = _TAR_MTIME, 0o644, 0, 0, "", ""
                if isinstance(src, bytes):
                    ti.size = len(src)
                    tar.addfile(ti, io.BytesIO(src))
                else:
                    ti.size = src.stat().st_size
                    with open(src, "rb") as f:
                        tar.addfile(ti, f)
                members.append(arc)
    finally:
        if tar_file is not None:
            tar_file.close()
    res = writer.close()
    return replace(res, members=tuple(members))


def split_file(path: Path, out_dir: Path, name: str, part_size: int = DEFAULT_PART_SIZE) -> PackResult:
    """Split an existing file (a tar) into ``<name>.tar.part-NNN`` files of at most ``part_size``."""
    out_dir.mkdir(parents=True, exist_ok=True)
    _clear_parts(out_dir, name)
    writer = _PartWriter(out_dir, name, part_size)
    with open(path, "rb") as f:
        while chunk := f.read(4 * MIB):
            writer.write(chunk)
    return writer.close()


_INSTALL_SH = r"""#!/usr/bin/env bash
# Reassembles, checks and installs the wheelhouse @NAME@ (@N_WHEELS@ wheels, @TAR_MB@ MB)
# on an air-gapped target.
# Generated by `python -m kimi_perf.wheelhouse build` for @TARGET@; MANIFEST.json lists the same hashes.
#
#   bash install.sh           check every part, reassemble and check the tar, install into $SITE
#   bash install.sh --check   only report which parts are here (exit 0: all, 3: some missing, 2: damaged)
#
#   PARTS_DIR  folder holding the parts (default: this script's folder)
#   SITE       where the wheels are installed (default /tmp/site); afterwards: export PYTHONPATH=$SITE
#   PYTHON     interpreter whose pip installs them (default python3)
set -euo pipefail
NAME='@NAME@'
TAR_SHA256='@TAR_SHA256@'
PARTS=(
@PARTS@
)
PARTS_DIR=${PARTS_DIR:-$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)}
SITE=${SITE:-/tmp/site}
PYTHON=${PYTHON:-python3}

files=(); missing=(); damaged=()
for entry in "${PARTS[@]}"; do
  read -r f size sha <<<"$entry"
  p="$PARTS_DIR/$f"
  files+=("$p")
  if [ ! -f "$p" ]; then missing+=("$f"); continue; fi
  have_size=$(wc -c <"$p" | tr -d ' ')
  if [ "$have_size" != "$size" ]; then damaged+=("$f: $have_size bytes, expected $size"); continue; fi
  have_sha=$(sha256sum "$p" | cut -d' ' -f1)
  if [ "$have_sha" != "$sha" ]; then damaged+=("$f: sha256 $have_sha, expected $sha"); fi
done
n_ok=$(( ${#PARTS[@]} - ${#missing[@]} - ${#damaged[@]} ))
echo "wheelhouse $NAME: $n_ok of ${#PARTS[@]} parts present and intact in $PARTS_DIR"
if [ ${#damaged[@]} -gt 0 ]; then
  printf '  damaged (copy again): %s\n' "${damaged[@]}" >&2
  exit 2
fi
if [ ${#missing[@]} -gt 0 ]; then
  printf '  missing: %s\n' "${missing[@]}" >&2
  [ "${1:-}" = "--check" ] && exit 3
  echo "copy the missing parts into $PARTS_DIR (or set PARTS_DIR), then run this again" >&2
  exit 3
fi
[ "${1:-}" = "--check" ] && exit 0

whole=$(cat "${files[@]}" | sha256sum | cut -d' ' -f1)
if [ "$whole" != "$TAR_SHA256" ]; then
  echo "the reassembled tar has sha256 $whole, expected $TAR_SHA256:" \
    "the parts come from different builds; copy all parts of one build" >&2
  exit 2
fi
WORK=$(mktemp -d "${TMPDIR:-/tmp}/wheelhouse.XXXXXX")
trap 'rm -rf "$WORK"' EXIT
cat "${files[@]}" | tar -x -C "$WORK"
wheels=("$WORK"/wheels/*.whl)
mkdir -p "$SITE"
# --upgrade: a second run over the same SITE replaces what the first installed
"$PYTHON" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
  --target "$SITE" "${wheels[@]}"
echo "installed ${#wheels[@]} wheels into $SITE"
echo "use them with:"
echo "  export PYTHONPATH=$SITE\${PYTHONPATH:+:\$PYTHONPATH}"
"""


def write_install_sh(out_dir: Path, name: str, pack: PackResult, n_wheels: int, target: TargetSpec) -> Path:
    """install.sh for the target, with the part and tar hashes embedded (it needs only bash,
    coreutils, tar and the target's pip)."""
    for p in pack.parts:
        if not re.fullmatch(r"[A-Za-z0-9._+-]+", p.file):
            raise WheelhouseError(f"part name {p.file!r}: use letters, digits and . _ + - in --name")
    text = (
        _INSTALL_SH.replace("@NAME@", name)
        .replace("@N_WHEELS@", str(n_wheels))
        .replace("@TAR_MB@", _mb(pack.tar_size))
        .replace("@TARGET@", target.describe())
        .replace("@TAR_SHA256@", pack.tar_sha256)
        .replace("@PARTS@", "\n".join(f"'{p.file} {p.size} {p.sha256}'" for p in pack.parts))
    )
    path = out_dir / "install.sh"
    path.write_text(text)
    path.chmod(0o755)
    return path
