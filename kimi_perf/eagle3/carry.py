"""Generated drafter samples as small compressed parts, so a recipe's data outlives one GPU lease.

Why: a GPU recipe needs >= 50K regenerated samples, and the machine that makes them is lent in calls of
at most 10 minutes and starts bare whenever it has been given back: what a call generated is gone
unless it comes back (at most 8 files of 16 MiB from a call) and travels to the next lease inside the
working tree (64 MiB with the tree). Samples are JSON lines of token ids; xz shrinks them ~10x (the
embedded-cpu recipe's 249 KB of samples are 25 KB), so 50K samples of ~550 tokens (~150 MB) come back
as one or two parts. Standard ``lzma`` and JSON lines, not a custom format: a part is readable with
``xz -dc``.

- ``pack SAMPLES.jsonl --out DIR``: parts ``samples-NNN.jsonl.xz`` of at most ``--part-mib`` MiB each
  plus ``MANIFEST.json`` (count, sha256 of each part, and where the file sat under the cache root:
  ``eagle3/<target>/gen-<generation digest>/samples.jsonl``). ``--only-new DIR`` leaves out the ids an
  earlier pack already holds, so each call brings back only what it made.
- ``unpack DIR [DIR ...] [--cache ROOT]``: checks every part's sha256 and appends the samples whose ids
  the cache's file lacks, at the manifest's place under ROOT (default ``$KIMI_PERF_CACHE``), where the
  drafter pipeline (:func:`kimi_perf.eagle3.pipeline.cache_dirs`) looks for them: the next build
  reuses them and generates only what is missing.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import lzma
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from ..atomic import atomic_write_json
from ..progress import log

__all__ = ["CarryError", "pack", "unpack"]

MANIFEST = "MANIFEST.json"


class CarryError(RuntimeError):
    """A pack that cannot come back as asked, or parts that do not check out."""


def _cache_tail(path: Path) -> str | None:
    """``eagle3/<target>/gen-<digest>/samples.jsonl`` when ``path`` sits in a kimi-perf cache, else None."""
    parts = path.resolve().parts
    if len(parts) >= 4 and parts[-4] == "eagle3" and parts[-2].startswith("gen-"):
        return "/".join(parts[-4:])
    return None


def _lines(path: Path) -> list[tuple[str, bytes]]:
    """(id, line) of every complete sample line, in file order (a torn last line is left out). The raw
    lines, not parsed samples, so a part holds the bytes the generator wrote."""
    from .data import complete_lines

    out = []
    for line, d in complete_lines(path.read_bytes()):
        if not isinstance(d, dict) or "id" not in d:
            break
        out.append((str(d["id"]), line))
    return out


def _packed_ids(dirs: Sequence[Path]) -> set[str]:
    ids: set[str] = set()
    for d in dirs:
        m = json.loads((d / MANIFEST).read_text())
        ids.update(m.get("ids", []))
    return ids


def pack(samples: Path, out: Path, *, part_mib: float = 15.0, max_parts: int = 7,
         only_new: Sequence[Path] = ()) -> dict[str, Any]:
    """Write ``samples``' lines as xz parts of at most ``part_mib`` MiB into ``out``; return the manifest.
    Parts are cut on line boundaries: a chunk of lines is compressed, and one that comes out too large is
    split in two until it fits (a single line larger than a part is an error)."""
    if not samples.is_file():
        raise CarryError(f"no samples file at {samples}")
    skip = _packed_ids(only_new)
    lines = [(i, ln) for i, ln in _lines(samples) if i not in skip]
    limit = int(part_mib * 2**20)
    out.mkdir(parents=True, exist_ok=True)
    for old in out.glob("samples-*.jsonl.xz"):
        old.unlink()
    blobs: list[tuple[bytes, int]] = []
    # xz makes JSON id lists ~10x smaller: start from chunks of 8x the limit, halve what overflows
    pending: list[list[tuple[str, bytes]]] = []
    chunk: list[tuple[str, bytes]] = []
    size = 0
    for item in lines:
        if chunk and size + len(item[1]) > 8 * limit:
            pending.append(chunk)
            chunk, size = [], 0
        chunk.append(item)
        size += len(item[1])
    if chunk:
        pending.append(chunk)
    while pending:
        c = pending.pop(0)
        blob = lzma.compress(b"".join(ln for _, ln in c), preset=6)
        if len(blob) <= limit:
            blobs.append((blob, len(c)))
        elif len(c) == 1:
            raise CarryError(f"sample {c[0][0]} alone compresses to {len(blob)} bytes, over --part-mib {part_mib}")
        else:
            pending[:0] = [c[: len(c) // 2], c[len(c) // 2:]]
    if len(blobs) > max_parts:
        raise CarryError(f"{len(lines)} samples need {len(blobs)} parts of {part_mib} MiB, over --max-parts "
                         f"{max_parts} (a device call returns at most 8 files): pack in several calls with "
                         "--only-new, each after the previous pack came back")
    files: list[dict[str, Any]] = []
    for n, (blob, count) in enumerate(blobs):
        name = f"samples-{n:03d}.jsonl.xz"
        (out / name).write_bytes(blob)
        files.append({"file": name, "samples": count, "bytes": len(blob), "sha256": hashlib.sha256(blob).hexdigest()})
    manifest = {"source": str(samples), "cache_tail": _cache_tail(samples), "samples": len(lines),
                "skipped_as_packed": len(skip), "parts": files, "ids": [i for i, _ in lines]}
    atomic_write_json(out / MANIFEST, manifest)
    raw = sum(len(ln) for _, ln in lines)
    log(f"samples pack: {len(lines)} samples ({raw / 2**20:.1f} MiB) -> {len(files)} part(s), "
        f"{sum(f['bytes'] for f in files) / 2**20:.1f} MiB in {out}")
    return manifest


def unpack(dirs: Sequence[Path], *, cache: Path | None = None, into: Path | None = None) -> dict[str, int]:
    """Append the packed samples of ``dirs`` that ``into`` (default: the manifest's place under ``cache``)
    lacks; every part's sha256 is checked before anything is written. Returns {target file: added}."""
    added: dict[str, int] = {}
    for d in dirs:
        mpath = d / MANIFEST
        if not mpath.is_file():
            raise CarryError(f"{d}: no {MANIFEST} (pack a samples file with: python -m kimi_perf.eagle3.carry pack)")
        m = json.loads(mpath.read_text())
        dest = into
        if dest is None:
            if not m.get("cache_tail"):
                raise CarryError(f"{d}: packed from {m.get('source')}, outside a kimi-perf cache; pass --into FILE")
            if cache is None:
                from ..models.embedded import cache_root

                cache = cache_root()
            dest = cache / m["cache_tail"]
        blobs = []
        for f in m["parts"]:
            blob = (d / f["file"]).read_bytes()
            if hashlib.sha256(blob).hexdigest() != f["sha256"]:
                raise CarryError(f"{d / f['file']}: sha256 differs from {MANIFEST} (a part broke on the way: fetch it "
                                 "again)")
            blobs.append(blob)
        from .data import read_samples

        # read_samples also truncates a torn last line, so appended lines start on a line of their own
        have = set(read_samples(dest))
        dest.parent.mkdir(parents=True, exist_ok=True)
        n = 0
        with dest.open("ab") as fh:
            for blob in blobs:
                for line in lzma.decompress(blob).splitlines(keepends=True):
                    sid = str(json.loads(line)["id"])
                    if sid not in have:
                        fh.write(line)
                        have.add(sid)
                        n += 1
        added[str(dest)] = added.get(str(dest), 0) + n
        log(f"samples unpack: {n} of {m['samples']} samples from {d} added to {dest} ({len(have)} there now)")
    return added


def _cli(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m kimi_perf.eagle3.carry",
                                 description="pack generated drafter samples into small xz parts, and unpack them "
                                             "into a cache (to carry a recipe's data from one GPU lease to the next)")
    sub = ap.add_subparsers(dest="cmd", required=True)
    p = sub.add_parser("pack", help="write a samples file as xz parts + MANIFEST.json")
    p.add_argument("samples", type=Path, help="samples.jsonl (under <cache>/eagle3/<target>/gen-<digest>/)")
    p.add_argument("--out", type=Path, required=True, help="folder for the parts (e.g. $OUT/samples)")
    p.add_argument("--part-mib", type=float, default=15.0, help="largest part in MiB (a device call returns 16 MiB "
                                                                "files; default 15)")
    p.add_argument("--max-parts", type=int, default=7, help="most parts (a device call returns 8 files; default 7)")
    p.add_argument("--only-new", type=Path, action="append", default=[],
                   help="an earlier pack's folder: leave out the samples it holds (repeatable)")
    u = sub.add_parser("unpack", help="append packed samples a cache lacks")
    u.add_argument("dirs", type=Path, nargs="+", help="folders written by pack")
    u.add_argument("--cache", type=Path, default=None, help="cache root (default: $KIMI_PERF_CACHE or ~/.cache/kimi-perf)")
    u.add_argument("--into", type=Path, default=None, help="samples file to append to (default: the manifest's place "
                                                           "under the cache root)")
    ns = ap.parse_args(argv)
    if ns.cmd == "pack" and (ns.part_mib <= 0 or ns.max_parts < 1):
        ap.error("--part-mib must be > 0 and --max-parts >= 1")
    try:
        if ns.cmd == "pack":
            pack(ns.samples, ns.out, part_mib=ns.part_mib, max_parts=ns.max_parts, only_new=ns.only_new)
        else:
            unpack(ns.dirs, cache=ns.cache, into=ns.into)
    except (CarryError, FileNotFoundError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(_cli())
