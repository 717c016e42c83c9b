"""The plan: the closure walked for the target, what is carried, what is left out, and why."""

from __future__ import annotations

from collections import defaultdict, deque
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, replace
from enum import Enum
from typing import TYPE_CHECKING, Any

from ._base import WheelhouseError, _mb, _packaging, canonical_name
from .report import ResolvedPackage
from .rules import Exclusion, Override
from .target import InstalledPackage, TargetSpec

if TYPE_CHECKING:  # packaging is imported lazily: `import kimi_perf.wheelhouse` stays cheap
    from packaging.requirements import Requirement


class Status(str, Enum):
    CARRY = "carry"  # kept: needed and not on the target
    CLASH = "clash"  # kept: on the target, at a version the closure rejects
    OVERRIDE = "override"  # kept: an --override version instead of the resolved one
    ON_TARGET = "on-target"  # left out: the target's version satisfies the closure
    UNUSED = "unused"  # left out: documented runtime-unused
    PRUNED = "pruned"  # left out: only needed by left-out packages
    NOT_NEEDED = "not-needed"  # left out: no requirement whose marker holds on the target leads to it

    @property
    def kept(self) -> bool:
        return self in (Status.CARRY, Status.CLASH, Status.OVERRIDE)


@dataclass(frozen=True)
class PlanEntry:
    name: str
    version: str
    status: Status
    reason: str
    size: int | None = None
    requested_by: tuple[str, ...] = ()
    url: str = ""
    sha256: str | None = None

    @property
    def key(self) -> str:
        return canonical_name(self.name)

    @property
    def filename(self) -> str:
        return ResolvedPackage(self.name, self.version, self.url).filename

    def to_dict(self) -> dict[str, Any]:
        return {
            "name": self.name,
            "version": self.version,
            "status": self.status.value,
            "reason": self.reason,
            "size": self.size,
            "requested_by": list(self.requested_by),
            "url": self.url,
            "sha256": self.sha256,
        }


@dataclass(frozen=True)
class Plan:
    target: TargetSpec
    entries: tuple[PlanEntry, ...]
    missing: tuple[str, ...] = ()  # requirements the target needs that neither the closure nor the target has
    unverified: tuple[str, ...] = ()  # left out as on the target, but its version there is unknown
    notes: tuple[str, ...] = ()

    @property
    def kept(self) -> tuple[PlanEntry, ...]:
        return tuple(e for e in self.entries if e.status.kept)

    @property
    def left_out(self) -> tuple[PlanEntry, ...]:
        return tuple(e for e in self.entries if not e.status.kept)

    @property
    def clash_lines(self) -> tuple[str, ...]:
        return tuple(e.reason for e in self.entries if e.status in (Status.CLASH, Status.OVERRIDE))

    def entry(self, name: str) -> PlanEntry:
        key = canonical_name(name)
        for e in self.entries:
            if e.key == key:
                return e
        raise KeyError(name)

    @staticmethod
    def _total(entries: Iterable[PlanEntry]) -> tuple[int, bool]:
        sizes = [e.size for e in entries]
        return sum(s or 0 for s in sizes), any(s is None for s in sizes)

    def table(self) -> str:
        """The kept / left-out table with sizes (MB = 10^6 bytes), biggest first within each status."""
        order = list(Status)
        rows = sorted(self.entries, key=lambda e: (order.index(e.status), -(e.size or 0), e.key))
        w = max([len(e.name) for e in rows] + [7])
        lines = [f"{'status':<10}  {'package':<{w}}  {'version':<22}  {'MB':>8}  reason / needed by"]
        for e in rows:
            why = e.reason
            if e.status is Status.CARRY and len(e.requested_by) > 4:
                why = (
                    why.split(", needed by ")[0]
                    if why.startswith("requested")
                    else "needed by " + ", ".join(e.requested_by[:4]) + f" ... ({len(e.requested_by)})"
                )
            lines.append(f"{e.status.value:<10}  {e.name:<{w}}  {e.version:<22}  {_mb(e.size):>8}  {why}")
        kept_b, kept_q = self._total(self.kept)
        out_b, out_q = self._total(self.left_out)
        by_status = ", ".join(
            f"{s.value} {n}" for s in Status if (n := sum(e.status is s for e in self.entries))
        )
        lines.append("")
        lines.append(
            f"target {self.target.describe()}: carry {len(self.kept)} wheels, {_mb(kept_b)} MB"
            f"{' + unknown' if kept_q else ''}; leave out {len(self.left_out)}, {_mb(out_b)} MB"
            f"{' + unknown' if out_q else ''} ({by_status})"
        )
        for line in self.clash_lines:
            lines.append(line)
        if self.unverified:
            import textwrap

            lines += textwrap.wrap(
                f"unverified ({len(self.unverified)} listed on the target without a version, "
                f"assumed to satisfy): " + ", ".join(self.unverified),
                110,
                subsequent_indent="  ",
            )
        for line in self.missing:
            lines.append(f"missing: {line}")
        for line in self.notes:
            lines.append(f"note: {line}")
        return "\n".join(lines)

    def to_dict(self) -> dict[str, Any]:
        kept_b, _ = self._total(self.kept)
        return {
            "target": self.target.to_dict(),
            "kept": [e.to_dict() for e in self.kept],
            "left_out": [e.to_dict() for e in self.left_out],
            "clashes": list(self.clash_lines),
            "unverified": list(self.unverified),
            "missing": list(self.missing),
            "notes": list(self.notes),
            "kept_bytes": kept_b,
        }


def _spec_text(req: Requirement) -> str:
    return str(req.specifier) or "any version"


def make_plan(
    packages: Sequence[ResolvedPackage],
    target: TargetSpec,
    *,
    roots: Sequence[str] = (),
    installed: Mapping[str, InstalledPackage] | None = None,
    exclusions: Sequence[Exclusion] = (),
    overridden: Mapping[str, tuple[str, Override]] | None = None,
    trusted: Iterable[str] = (),
    notes: Sequence[str] = (),
) -> Plan:
    """Decide, for every package of the resolved closure, whether it is carried and why.

    The closure is walked from ``roots`` (requirement strings; default: the report's requested
    packages) along ``Requires-Dist`` whose markers hold on the target (with the extras requested on
    the way). The walk does not go through a package that is left out -- documented unused, or on the
    target at a version satisfying every specifier the carried packages put on it -- so what only those
    need is left out too. A target version that stops satisfying once another carried package adds a
    specifier turns the package into a carried clash and the walk continues through it.
    ``overridden`` maps canonical names to (the resolved version, the Override now in ``packages``);
    ``trusted`` names target packages left out even where their version misses a specifier (an
    over-strict upper bound, say), reported as such.
    """
    pk = _packaging()
    Requirement_ = pk.requirements.Requirement
    env = target.marker_env()
    installed = dict(installed or {})
    overridden = dict(overridden or {})
    trusted = {canonical_name(t) for t in trusted}
    by_key = {p.key: p for p in packages}
    note_list = list(notes)

    def deps(p: ResolvedPackage, extras: frozenset[str]) -> list[Requirement]:
        out = []
        for s in p.requires_dist:
            try:
                r = Requirement_(s)
            except pk.requirements.InvalidRequirement:
                note_list.append(f"{p.label}: unreadable requirement {s!r} skipped")
                continue
            if r.marker is None or any(r.marker.evaluate({**env, "extra": e}) for e in ("", *sorted(extras))):
                out.append(r)
        return out

    root_reqs: list[tuple[str, Requirement]] = []
    for s in roots or [
        p.name + (f"[{','.join(p.requested_extras)}]" if p.requested_extras else "")
        for p in packages
        if p.requested
    ]:
        try:
            r = Requirement_(s)
        except pk.requirements.InvalidRequirement as e:
            raise WheelhouseError(f"{s!r} is not a requirement ({e}); write e.g. sglang==0.5.17") from e
        if r.marker is None or r.marker.evaluate(env):
            root_reqs.append(("requested", r))

    def excluded_by(key: str) -> Exclusion | None:
        return next((x for x in exclusions if x.matches(key)), None)

    def unmet(key: str, specs: Iterable[tuple[str, Requirement]]) -> list[tuple[str, Requirement]]:
        have = installed[key].version
        if have is None:
            return []
        try:
            v = pk.version.Version(have)
        except pk.version.InvalidVersion:
            return []  # unparseable target version: treated like an unknown one
        return [(who, r) for who, r in specs if not r.specifier.contains(v, prereleases=True)]

    def walk(
        stopping: bool,
    ) -> tuple[
        dict[str, set[str]], set[str], dict[str, list[tuple[str, Requirement]]], list[tuple[str, Requirement]]
    ]:
        visited: dict[str, set[str]] = {}
        expanded: set[str] = set()
        specs: dict[str, list[tuple[str, Requirement]]] = defaultdict(list)
        missing: list[tuple[str, Requirement]] = []
        queue: deque[tuple[str, frozenset[str]]] = deque()
        for who, r in root_reqs:
            k = canonical_name(r.name)
            specs[k].append((who, r))
            queue.append((k, frozenset(canonical_name(e) for e in r.extras)))
        while queue:
            key, extras = queue.popleft()
            if key not in by_key:
                continue
            seen = visited.get(key)
            if seen is not None and key in expanded and extras <= seen:
                continue
            visited[key] = (seen or set()) | extras
            if stopping and left_out(key, specs[key]):
                continue
            expanded.add(key)
            p = by_key[key]
            for r in deps(p, frozenset(visited[key])):
                k = canonical_name(r.name)
                specs[k].append((p.label, r))
                if k in by_key:
                    queue.append((k, frozenset(canonical_name(e) for e in r.extras)))
                elif stopping and excluded_by(k) is None and (k not in installed or unmet(k, [(p.label, r)])):
                    missing.append((p.label, r))
        return visited, expanded, specs, missing

    def left_out(key: str, specs: list[tuple[str, Requirement]]) -> bool:
        if excluded_by(key) is not None:
            return True
        if key not in installed:
            return False
        if key in overridden:
            return installed[key].version == by_key[key].version
        return key in trusted or not unmet(key, specs)

    full_visited, _, full_specs, _ = walk(stopping=False)
    visited, expanded, specs, missing = walk(stopping=True)

    parents: dict[str, list[str]] = defaultdict(list)
    for k, lst in full_specs.items():
        own = by_key[k].label if k in by_key else None
        for who, _r in lst:
            if who not in parents[k] and who != own:  # pkg[extra] -> pkg is no parent
                parents[k].append(who)
    status_of: dict[str, Status] = {}
    for p in packages:
        if p.key in expanded:
            status_of[p.key] = (
                Status.OVERRIDE
                if p.key in overridden
                else (Status.CLASH if p.key in installed else Status.CARRY)
            )
        elif p.key in visited:
            status_of[p.key] = Status.UNUSED if excluded_by(p.key) else Status.ON_TARGET
        elif p.key in full_visited:
            status_of[p.key] = Status.PRUNED
        else:
            status_of[p.key] = Status.NOT_NEEDED
    label_status = {by_key[k].label: s for k, s in status_of.items()}

    entries, unverified = [], []
    for p in packages:
        st = status_of[p.key]
        mine = specs[p.key] if p.key in visited else full_specs[p.key]
        spec_txt = ", ".join(f"{_spec_text(r)} ({who})" for who, r in mine) or "any version"
        have = installed.get(p.key)
        if st is Status.CARRY:
            others = [w for w in parents[p.key] if w != "requested"]
            reason = ", ".join(
                (["requested"] if "requested" in parents[p.key] else [])
                + (["needed by " + ", ".join(others)] if others else [])
            )
        elif st is Status.CLASH:
            bad = unmet(p.key, mine)
            need = ",".join(sorted({str(r.specifier) for _, r in bad}))
            who = ", ".join(dict.fromkeys(w for w, _ in bad))
            reason = (
                f"clash: the target's {p.name} {have.version if have else '?'} does not satisfy {need}, "
                f"carried {p.version} (required by {who})"
            )
        elif st is Status.OVERRIDE:
            old, ov = overridden[p.key]
            v = pk.version.Version(p.version)
            broken = [
                f"{who} requires {_spec_text(r)}" for who, r in mine if not r.specifier.contains(v, True)
            ]
            reason = (
                f"override: carried {p.name} {p.version} instead of the resolved {old}"
                f"{' although ' + '; '.join(broken) if broken else ''} -- {ov.reason}"
            )
        elif st is Status.UNUSED:
            x = excluded_by(p.key)
            reason = f"unused ({x.pattern}): {x.reason}" if x else "unused"
        elif st is Status.ON_TARGET and have is not None and have.version is None:
            reason = f"on the target (version not listed; assumed to satisfy {spec_txt})"
            clauses = sorted({str(c) for _, r in mine for c in r.specifier})
            unverified.append(f"{p.name} {','.join(clauses) or '(any)'}")
        elif st is Status.ON_TARGET and (bad := unmet(p.key, mine)):
            need = ",".join(sorted({str(r.specifier) for _, r in bad}))
            reason = (
                f"on the target: {p.name} {have.version if have else '?'} trusted (--trust-target) although "
                f"{', '.join(dict.fromkeys(w for w, _ in bad))} require {need}"
            )
        elif st is Status.ON_TARGET:
            reason = f"on the target: {p.name} {have.version if have else '?'} satisfies {spec_txt}"
        elif st is Status.PRUNED:
            why = [f"{w} ({label_status[w].value})" for w in parents[p.key] if w in label_status]
            reason = "only needed by left-out packages: " + ", ".join(why)
        else:
            reason = "no requirement whose marker holds on the target leads to it"
        entries.append(
            PlanEntry(p.name, p.version, st, reason, p.size, tuple(parents[p.key]), p.url, p.sha256)
        )

    missing_lines = []
    for who, r in dict.fromkeys(missing):
        k = canonical_name(r.name)
        on = f"; the target has {installed[k].version}" if k in installed else ""
        missing_lines.append(f"{_req_text(r)} (needed by {who}{on}) is not in the resolved closure")
    return Plan(
        target,
        tuple(entries),
        tuple(dict.fromkeys(missing_lines)),
        tuple(unverified),
        tuple(dict.fromkeys(note_list)),
    )


def _req_text(r: Requirement) -> str:
    """The requirement without its marker: what to resolve as an extra root."""
    return r.name + (f"[{','.join(sorted(r.extras))}]" if r.extras else "") + str(r.specifier)


def apply_overrides(
    packages: Sequence[ResolvedPackage],
    overrides: Sequence[Override],
    fetch: Callable[[Override], ResolvedPackage],
) -> tuple[tuple[ResolvedPackage, ...], dict[str, tuple[str, Override]], list[str]]:
    """Replace resolved packages by their ``--override`` versions; ``fetch`` resolves one override
    alone (pip with ``--no-deps``). Returns the packages, {key: (resolved version, override)}, notes.
    An override of a package that is not in the closure is added as a requested package."""
    out = list(packages)
    done: dict[str, tuple[str, Override]] = {}
    notes = []
    for ov in overrides:
        idx = next((i for i, p in enumerate(out) if p.key == ov.key), None)
        if idx is not None and out[idx].version == ov.version:
            notes.append(f"override {ov.requirement}: the resolver already chose it")
            continue
        new = fetch(ov)
        if idx is None:
            out.append(replace(new, requested=True))
            notes.append(f"override {ov.requirement}: not in the closure, carried as requested")
            done[ov.key] = ("(none)", ov)
        else:
            done[ov.key] = (out[idx].version, ov)
            out[idx] = replace(new, requested=out[idx].requested, requested_extras=out[idx].requested_extras)
    return tuple(out), done, notes
