"""pip's installation report (format version 1), read into resolved packages."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from ._base import WheelhouseError, canonical_name


@dataclass(frozen=True)
class ResolvedPackage:
    """One item of the resolved closure (one ``install`` entry of pip's report)."""

    name: str
    version: str
    url: str
    sha256: str | None = None
    requires_dist: tuple[str, ...] = ()
    requested: bool = False
    requested_extras: tuple[str, ...] = ()
    size: int | None = None  # bytes of the wheel, when known (the report does not say)

    @property
    def key(self) -> str:
        return canonical_name(self.name)

    @property
    def filename(self) -> str:
        from urllib.parse import unquote, urlparse

        return unquote(urlparse(self.url).path.rsplit("/", 1)[-1])

    @property
    def label(self) -> str:
        return f"{self.name} {self.version}"


def parse_report(report: Mapping[str, Any]) -> tuple[ResolvedPackage, ...]:
    """The ``install`` items of a pip installation report (format version 1, pip >= 22.2)."""
    version = str(report.get("version"))
    if version != "1":
        raise WheelhouseError(
            f"pip installation report version {version!r}; this reads version 1 "
            "(pip 22.2 or newer writes it): upgrade or downgrade the resolving pip"
        )
    out = []
    for item in report.get("install", []):
        md = item.get("metadata", {})
        di = item.get("download_info", {})
        name, ver, url = md.get("name", "?"), md.get("version", "?"), di.get("url", "")
        if "dir_info" in di or "vcs_info" in di or not url.endswith(".whl"):
            raise WheelhouseError(
                f"{name} {ver} resolved to {url!r}, not a wheel from an index; a wheelhouse "
                "carries released wheels only: --pin it to a version that has one"
            )
        ai = di.get("archive_info", {})
        sha = (ai.get("hashes") or {}).get("sha256")
        if sha is None and str(ai.get("hash", "")).startswith("sha256="):
            sha = ai["hash"].split("=", 1)[1]
        out.append(
            ResolvedPackage(
                name=name,
                version=ver,
                url=url,
                sha256=sha,
                requires_dist=tuple(md.get("requires_dist") or ()),
                requested=bool(item.get("requested")),
                requested_extras=tuple(item.get("requested_extras") or ()),
            )
        )
    return tuple(out)
