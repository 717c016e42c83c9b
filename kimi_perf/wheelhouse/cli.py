"""The ``python -m kimi_perf.wheelhouse plan|build|stage|repack`` command line."""

from __future__ import annotations

import argparse
import json
import re
import sys
import tempfile
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from ._base import DEFAULT_PLATFORMS, MIB, WheelhouseError, _mb, _say, canonical_name
from .build import build, stage_part
from .parts import parse_part_size
from .plan import Plan
from .repack import repack_wheel
from .resolve import resolve_and_plan
from .rules import Exclusion, Override, RepackRule, defaults_for
from .target import TargetSpec, expand_platforms, load_target_list


def _add_plan_args(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--spec",
        action="append",
        default=[],
        metavar="REQ",
        help="engine requirement, e.g. sglang==0.5.17 (repeatable: more roots)",
    )
    p.add_argument(
        "--python", default="3.12", help="target Python version, e.g. 3.12 or 3.12.3 (default 3.12)"
    )
    p.add_argument(
        "--platform",
        action="append",
        default=[],
        metavar="TAG",
        help=f"target platform tag(s); LO..HI ranges expand (default {DEFAULT_PLATFORMS})",
    )
    p.add_argument("--implementation", default="cp", help="target implementation (default cp)")
    p.add_argument(
        "--target-list",
        metavar="FILE|NAME",
        help="the target's `pip list --format=freeze` (or `pip list`) output, or the name of one under "
        "kimi_perf/wheelhouse_targets (e.g. h200-torch2.11-cu130)",
    )
    p.add_argument(
        "--pin",
        action="append",
        default=[],
        metavar="REQ",
        help="constraint for the resolver, e.g. torch==2.11.0 (repeatable)",
    )
    p.add_argument(
        "--override",
        action="append",
        default=[],
        metavar="NAME==VERSION",
        help="carry this version instead of the resolved one, applied after resolution (repeatable)",
    )
    p.add_argument(
        "--exclude",
        action="append",
        default=[],
        metavar="GLOB[:REASON]",
        help="leave out packages matching this name glob as runtime-unused (repeatable)",
    )
    p.add_argument(
        "--keep",
        action="append",
        default=[],
        metavar="NAME",
        help="do not leave NAME out by a default exclusion (repeatable)",
    )
    p.add_argument(
        "--trust-target",
        action="append",
        default=[],
        metavar="NAME",
        help="leave NAME out when the target has it, even at a version the closure rejects (repeatable)",
    )
    p.add_argument(
        "--no-defaults",
        action="store_true",
        help="ignore the built-in exclusions, pins and overrides for known engine releases",
    )
    p.add_argument(
        "--resolver-python",
        metavar="PATH",
        help="interpreter whose pip resolves (default: one of the target's Python version, if found)",
    )
    p.add_argument("--report", metavar="FILE", help="use this pip installation report instead of running pip")
    p.add_argument(
        "--pip-arg",
        action="append",
        default=[],
        metavar="ARG",
        help="extra argument for pip (repeatable; write --pip-arg=--index-url=URL)",
    )
    p.add_argument("--no-sizes", action="store_true", help="do not look up wheel sizes (one HTTP HEAD each)")
    p.add_argument(
        "--work",
        metavar="DIR",
        help="where pip's logs and reports go (default: a temporary folder, or OUT/resolve for build)",
    )


def _plan_from_args(
    a: argparse.Namespace, workdir: Path
) -> tuple[Plan, TargetSpec, list[RepackRule], dict[str, Any]]:
    if not a.spec and not a.report:
        raise WheelhouseError("give --spec (e.g. --spec sglang==0.5.17) or --report FILE")
    try:
        target = TargetSpec(a.python, expand_platforms(a.platform or [DEFAULT_PLATFORMS]), a.implementation)
        cli_overrides = [Override(o) for o in a.override]
    except ValueError as e:
        raise WheelhouseError(str(e)) from e
    installed, target_list = load_target_list(a.target_list)
    notes: list[str] = []
    if not a.target_list:
        notes.append("no --target-list: everything in the closure is carried")
    defaults, dnotes = ([], []) if a.no_defaults else defaults_for(a.spec)
    notes += dnotes
    keep = {canonical_name(k) for k in a.keep}
    exclusions = [x for d in defaults for x in d.excludes if not any(x.matches(k) for k in keep)]
    exclusions += [Exclusion.parse(x) for x in a.exclude]
    pins = [p for d in defaults for p in d.pins] + list(a.pin)
    cli_keys = {o.key for o in cli_overrides}
    overrides = [o for d in defaults for o in d.overrides if o.key not in cli_keys]
    overrides += cli_overrides
    hints = [r for d in defaults for r in d.repack_hints]
    for d in defaults:
        notes.append(
            f"defaults for {d.engine} {d.version} ({d.observed}): {len(d.excludes)} exclusions, "
            f"pins {list(d.pins) or 'none'}, overrides {[o.requirement for o in d.overrides] or 'none'}"
        )
    report = json.loads(Path(a.report).read_text()) if a.report else None
    plan = resolve_and_plan(
        a.spec,
        target,
        installed=installed,
        exclusions=exclusions,
        pins=pins,
        overrides=overrides,
        workdir=workdir,
        resolver_python=a.resolver_python,
        report=report,
        pip_args=a.pip_arg,
        sizes=not a.no_sizes,
        trusted=a.trust_target,
        notes=notes,
    )
    context = {
        "specs": list(a.spec),
        "pins": pins,
        "overrides": [{"requirement": o.requirement, "reason": o.reason} for o in overrides],
        "exclusions": [{"pattern": x.pattern, "reason": x.reason} for x in exclusions],
        "target_list": target_list,
    }
    return plan, target, hints, context


def _print_hints(plan: Plan, hints: Sequence[RepackRule], repacks: Sequence[RepackRule]) -> None:
    chosen = {canonical_name(r.package) for r in repacks}
    kept = {e.key for e in plan.kept}
    for h in hints:
        if canonical_name(h.package) in kept and canonical_name(h.package) not in chosen:
            print(f"hint: --repack '{h.to_cli()}'  ({h.reason})")


def _package_summary() -> str:
    """The package docstring's first paragraph (the tool's one-line purpose) for ``--help``."""
    import kimi_perf.wheelhouse as pkg

    return (pkg.__doc__ or "").split("\n\n")[0]


def main(argv: Sequence[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m kimi_perf.wheelhouse", description=_package_summary())
    sub = ap.add_subparsers(dest="cmd", required=True)
    p_plan = sub.add_parser("plan", help="resolve and print what would be carried / left out, with sizes")
    _add_plan_args(p_plan)
    p_plan.add_argument("--json", metavar="FILE", help="also write the plan as JSON")
    p_build = sub.add_parser(
        "build", help="plan, download, repack, pack into parts, write MANIFEST.json + install.sh"
    )
    _add_plan_args(p_build)
    p_build.add_argument(
        "--out", required=True, metavar="DIR", help="output folder (keep it outside the repo)"
    )
    p_build.add_argument(
        "--name", help="file name stem of the tar and parts (default: wheelhouse-<first spec>)"
    )
    p_build.add_argument("--part-size", default="60M", help="largest part, e.g. 60M (MiB; default 60M)")
    p_build.add_argument(
        "--repack",
        action="append",
        default=[],
        metavar="PKG:PATTERN[,PATTERN]",
        help="drop wheel members matching the patterns from PKG's wheel (repeatable)",
    )
    p_build.add_argument(
        "--build-tag",
        default="1repack",
        help="wheel build tag of repacked wheels (digit first; '' keeps the original file name)",
    )
    p_build.add_argument("--keep-tar", action="store_true", help="also keep the whole tar next to the parts")
    p_stage = sub.add_parser(
        "stage", help="put one part, install.sh and MANIFEST.json into a transfer folder"
    )
    p_stage.add_argument("--out", required=True, metavar="DIR", help="the build's output folder")
    p_stage.add_argument("--part", required=True, type=int, metavar="N", help="part index, from 0")
    p_stage.add_argument(
        "--into", required=True, metavar="DIR", help="transfer folder, e.g. .carry/wheelhouse"
    )
    p_stage.add_argument(
        "--remote-dir", default="/tmp/wheelhouse", help="folder on the target (default /tmp/wheelhouse)"
    )
    p_repack = sub.add_parser("repack", help="drop members from one wheel and rewrite its RECORD")
    p_repack.add_argument("wheel")
    p_repack.add_argument("--drop", action="append", required=True, metavar="PATTERN")
    p_repack.add_argument("--dest", required=True, metavar="DIR")
    p_repack.add_argument("--build-tag", default="1repack")
    a = ap.parse_args(argv)
    try:
        if a.cmd == "plan":
            with tempfile.TemporaryDirectory(prefix="wheelhouse-") as tmp:
                plan, _target, hints, _ctx = _plan_from_args(a, Path(a.work or tmp))
            print(plan.table())
            _print_hints(plan, hints, [])
            if a.json:
                Path(a.json).write_text(json.dumps(plan.to_dict(), indent=1) + "\n")
            return 1 if plan.missing else 0
        if a.cmd == "build":
            out = Path(a.out)
            part_size = parse_part_size(a.part_size)
            if part_size > 62 * MIB:
                _say(
                    f"note: parts of {part_size / MIB:.1f} MiB: a device transfer carries 64 MiB per call, "
                    "working tree included"
                )
            repacks = [RepackRule.parse(r) for r in a.repack]
            plan, _target, hints, ctx = _plan_from_args(a, Path(a.work) if a.work else out / "resolve")
            print(plan.table())
            _print_hints(plan, hints, repacks)
            stem = a.spec[0] if a.spec else "report"
            name = a.name or "wheelhouse-" + re.sub(r"[^A-Za-z0-9._+-]+", "-", stem).strip("-")
            python = a.resolver_python or sys.executable
            res = build(
                plan,
                out,
                name=name,
                part_size=part_size,
                repacks=repacks,
                build_tag=a.build_tag or None,
                python=python,
                pip_args=a.pip_arg,
                keep_tar=a.keep_tar,
                extra_manifest=ctx,
            )
            print(
                f"\nwheelhouse {name}: {len(res.wheels)} wheels, {_mb(res.tar_size)} MB tar, "
                f"{len(res.parts)} part(s) in {out / 'parts'}"
            )
            for r in res.repacks:
                print(
                    f"  repacked {r.wheel.name}: saved {_mb(r.saved)} MB ({len(r.dropped)} members dropped)"
                )
            for p in res.parts:
                print(f"  {out / 'parts' / p.file}  {p.size / MIB:.1f} MiB  sha256 {p.sha256}")
            print(f"  {res.install_sh}\n  {res.manifest}")
            print(
                f"next: python -m kimi_perf.wheelhouse stage --out {out} --part N --into .carry/wheelhouse, "
                "for N = 0.." + str(len(res.parts) - 1) + ", one transfer each"
            )
            return 0
        if a.cmd == "stage":
            staged = stage_part(Path(a.out), a.part, Path(a.into))
            manifest = json.loads((Path(a.out) / "MANIFEST.json").read_text())
            n, into, rdir = len(manifest["parts"]), a.into.rstrip("/"), a.remote_dir
            print("staged: " + ", ".join(str(s) for s in staged))
            print(
                f"on the target (carry {into}): mkdir -p {rdir} && cp {into}/* {rdir}/ && "
                f"bash {rdir}/install.sh --check"
            )
            if a.part == n - 1:
                print(f"after the last part arrives: bash {rdir}/install.sh && export PYTHONPATH=/tmp/site")
            else:
                print(f"then: stage --part {a.part + 1} (of 0..{n - 1})")
            return 0
        if a.cmd == "repack":
            r = repack_wheel(Path(a.wheel), Path(a.dest), a.drop, build_tag=a.build_tag or None)
            print(
                f"{r.wheel}: dropped {len(r.dropped)} members, "
                f"{_mb(r.bytes_before)} -> {_mb(r.bytes_after)} MB "
                f"(saved {_mb(r.saved)} MB)"
            )
            return 0
    except WheelhouseError as e:
        print(f"wheelhouse: error: {e}", file=sys.stderr)
        return 2
    return 2  # pragma: no cover - argparse requires a command
