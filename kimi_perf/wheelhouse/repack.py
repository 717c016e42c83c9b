"""Repacking a kernel wheel without the members the target never loads (RECORD rewritten)."""

from __future__ import annotations

import fnmatch
import hashlib
import re
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ._base import MIB, WheelhouseError


@dataclass(frozen=True)
class RepackResult:
    source: Path
    wheel: Path
    dropped: tuple[str, ...]
    bytes_before: int
    bytes_after: int

    @property
    def saved(self) -> int:
        return self.bytes_before - self.bytes_after

    def to_dict(self) -> dict[str, Any]:
        return {
            "source": self.source.name,
            "wheel": self.wheel.name,
            "dropped": list(self.dropped),
            "bytes_before": self.bytes_before,
            "bytes_after": self.bytes_after,
            "saved": self.saved,
        }


def _record_hash(h: Any) -> str:
    import base64

    return "sha256=" + base64.urlsafe_b64encode(h.digest()).rstrip(b"=").decode()


def repack_wheel(
    src: Path,
    dest_dir: Path,
    patterns: Sequence[str],
    *,
    build_tag: str | None = "1repack",
) -> RepackResult:
    """Write ``src`` without the members matching ``patterns`` into ``dest_dir``.

    RECORD is rewritten (sha256 and size of every remaining file; signatures dropped, since they
    would no longer verify). With ``build_tag`` the file name gets that wheel build tag
    (``name-ver-1repack-py-abi-plat.whl``, recorded in WHEEL as ``Build:``): pip accepts it, the version
    and its dist-info stay unchanged, and the copy is not mistaken for the index's file. A pattern
    that matches nothing is an error (a typo would otherwise carry the whole wheel)."""
    import csv
    import io
    import zipfile

    parts = src.name[:-4].split("-")
    if not src.name.endswith(".whl") or len(parts) not in (5, 6):
        raise WheelhouseError(
            f"{src.name} is not a wheel file name (name-version[-build]-py-abi-platform.whl)"
        )
    if build_tag is not None and not re.fullmatch(r"\d[A-Za-z0-9_.]*", build_tag):
        raise WheelhouseError(f"build tag {build_tag!r}: it must start with a digit and hold no '-'")
    dist, ver, tags = parts[0], parts[1], parts[-3:]
    name = "-".join([dist, ver, *([build_tag] if build_tag else parts[2:-3]), *tags]) + ".whl"
    dest_dir.mkdir(parents=True, exist_ok=True)
    dest = dest_dir / name
    if dest.resolve() == src.resolve():
        raise WheelhouseError(f"repack of {src} would overwrite it: give another --dest or a build tag")
    with zipfile.ZipFile(src) as zin:
        infos = zin.infolist()
        records = [i.filename for i in infos if re.fullmatch(r"[^/]+\.dist-info/RECORD", i.filename)]
        if len(records) != 1:
            raise WheelhouseError(
                f"{src.name} has {len(records)} top-level */*.dist-info/RECORD; not a valid wheel"
            )
        distinfo = records[0].rsplit("/", 1)[0]
        dropped = [i.filename for i in infos if any(fnmatch.fnmatchcase(i.filename, p) for p in patterns)]
        unmatched = [p for p in patterns if not any(fnmatch.fnmatchcase(i.filename, p) for i in infos)]
        if unmatched:
            tops = sorted({i.filename.split("/")[0] + "/" for i in infos})
            raise WheelhouseError(
                f"repack {src.name}: pattern(s) {unmatched} match no member; its top-level "
                f"entries are {tops} (list all with: unzip -l {src.name})"
            )
        if any(d.startswith(distinfo + "/") for d in dropped):
            raise WheelhouseError(
                f"repack {src.name}: the patterns match {distinfo}/ files; a wheel needs them"
            )
        drop = set(dropped) | {f"{distinfo}/RECORD", f"{distinfo}/RECORD.jws", f"{distinfo}/RECORD.p7s"}
        rows: list[tuple[str, str, str]] = []
        tmp = dest.with_name(dest.name + ".part")
        with zipfile.ZipFile(tmp, "w", zipfile.ZIP_DEFLATED, allowZip64=True) as zout:
            for info in infos:
                if info.filename in drop or info.is_dir():
                    continue
                zi = zipfile.ZipInfo(info.filename, date_time=info.date_time)
                zi.external_attr = info.external_attr
                zi.compress_type = (
                    zipfile.ZIP_DEFLATED if info.compress_type != zipfile.ZIP_STORED else zipfile.ZIP_STORED
                )
                h, n = hashlib.sha256(), 0
                if info.filename == f"{distinfo}/WHEEL" and build_tag is not None:
                    text = zin.read(info).decode()
                    text = re.sub(r"(?m)^Build:.*\n?", "", text).rstrip("\n") + f"\nBuild: {build_tag}\n"
                    data = text.encode()
                    h.update(data)
                    n = len(data)
                    zout.writestr(zi, data)
                else:
                    with (
                        zin.open(info) as fin,
                        zout.open(zi, "w", force_zip64=info.file_size > 0x7FFFFFFF) as fout,
                    ):
                        while chunk := fin.read(4 * MIB):
                            h.update(chunk)
                            n += len(chunk)
                            fout.write(chunk)
                rows.append((info.filename, _record_hash(h), str(n)))
            buf = io.StringIO()
            writer = csv.writer(buf, lineterminator="\n")
            writer.writerows(rows)
            writer.writerow((f"{distinfo}/RECORD", "", ""))
            zout.writestr(
                zipfile.ZipInfo(f"{distinfo}/RECORD", date_time=(2026, 1, 1, 0, 0, 0)),
                buf.getvalue(),
                compress_type=zipfile.ZIP_DEFLATED,
            )
        tmp.replace(dest)
    return RepackResult(src, dest, tuple(dropped), src.stat().st_size, dest.stat().st_size)
