"""Running pip for the target: the resolver interpreter, dry-run reports, sizes, and resolve-and-plan."""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import replace
from pathlib import Path
from typing import Any

from ._base import WheelhouseError, _say
from .plan import Plan, apply_overrides, make_plan
from .report import ResolvedPackage, parse_report
from .rules import Exclusion, Override
from .target import InstalledPackage, TargetSpec


def find_resolver_python(target: TargetSpec) -> tuple[str, str | None]:
    """An interpreter of the target's major.minor that has pip (so pip evaluates markers as the target
    would), else this one with a note."""
    want = target.python_short
    if f"{sys.version_info[0]}.{sys.version_info[1]}" == want:
        return sys.executable, None
    cands: list[str] = []
    if w := shutil.which(f"python{want}"):
        cands.append(w)
    pyenv = Path(os.environ.get("PYENV_ROOT", Path.home() / ".pyenv"))
    cands += [str(p) for p in sorted(pyenv.glob(f"versions/{want}.*/bin/python{want}"), reverse=True)]
    cands += [f"/usr/bin/python{want}", f"/usr/local/bin/python{want}"]
    for c in dict.fromkeys(cands):
        if not Path(c).exists():
            continue
        try:
            r = subprocess.run(
                [c, "-c", "import sys, pip; print('%d.%d' % sys.version_info[:2])"],
                capture_output=True,
                text=True,
                timeout=60,
            )
        except (OSError, subprocess.TimeoutExpired):
            continue
        if r.returncode == 0 and r.stdout.strip() == want:
            return c, None
    return sys.executable, (
        f"no Python {want} with pip found here: pip ran under Python "
        f"{sys.version_info[0]}.{sys.version_info[1]}, "
        "which evaluates markers for itself (pypa/pip#11010); the closure was re-checked with the target's "
        "markers. Pass --resolver-python PATH for an exact resolution"
    )


def _pip_error(log: str, what: str, target: TargetSpec) -> WheelhouseError:
    lines = [ln for ln in log.splitlines() if not ln.startswith("WARNING: Location")]
    first = next((i for i, ln in enumerate(lines) if ln.startswith("ERROR:")), max(0, len(lines) - 30))
    msg = "\n".join(lines[max(0, first - 15) :][:60])
    text = "\n".join(lines)
    if "ResolutionImpossible" in text or "conflict is caused by" in text:
        fix = (
            "the requirements conflict for this target. Pin one side with --pin NAME==VERSION (a constraint "
            "for the resolver), or carry a version an engine's own pin rejects with --override NAME==VERSION "
            "(applied after resolution)."
        )
    elif m := re.search(r"No matching distribution found for (\S+)", text):
        fix = (
            f"no wheel of {m[1]} fits {target.describe()}: add the wheel's platform tag with --platform "
            "(e.g. manylinux_2_35_x86_64), check --python, or --pin a version that has such a wheel; "
            "a package "
            "published only as an sdist cannot be carried."
        )
    elif re.search(r"NewConnectionError|Max retries|Temporary failure in name resolution|timed out", text):
        fix = (
            "pip could not reach the package index: this step needs the network "
            "(or --pip-arg=--index-url=MIRROR)."
        )
    else:
        fix = "read pip's message above; --pip-arg passes options through to pip."
    return WheelhouseError(f"pip {what} failed:\n{msg}\n-> {fix}")


def _run_pip(python: str, args: Sequence[str], log_path: Path, what: str, target: TargetSpec) -> None:
    cmd = [python, "-m", "pip", *args]
    with open(log_path, "w") as log:
        log.write("$ " + " ".join(cmd) + "\n")
        log.flush()
        r = subprocess.run(cmd, stdout=log, stderr=subprocess.STDOUT, text=True)
    if r.returncode != 0:
        raise _pip_error(log_path.read_text(), what, target)


def pip_report(
    requirements: Sequence[str],
    target: TargetSpec,
    *,
    python: str,
    workdir: Path,
    constraints: Sequence[str] = (),
    no_deps: bool = False,
    pip_args: Sequence[str] = (),
    tag: str = "resolve",
) -> dict[str, Any]:
    """pip's installation report for ``requirements`` resolved for ``target`` (nothing installed)."""
    workdir.mkdir(parents=True, exist_ok=True)
    report = workdir / f"pip-report-{tag}.json"
    args = [
        "install",
        "--dry-run",
        "--ignore-installed",
        "--disable-pip-version-check",
        "--progress-bar",
        "off",
        "--report",
        str(report),
        *target.pip_args(),
    ]
    if no_deps:
        args.append("--no-deps")
    if constraints:
        cfile = workdir / f"constraints-{tag}.txt"
        cfile.write_text("".join(c + "\n" for c in constraints))
        args += ["-c", str(cfile)]
    with tempfile.TemporaryDirectory(prefix="wheelhouse-target-") as tdir:
        # pip refuses --platform/--python-version without --target (or a dry run, on newer pips)
        _run_pip(
            python,
            [*args, "--target", tdir, *pip_args, *requirements],
            workdir / f"pip-{tag}.log",
            f"resolution ({tag})",
            target,
        )
    return json.loads(report.read_text())


def fetch_sizes(
    packages: Sequence[ResolvedPackage], workers: int = 8, timeout: float = 30.0
) -> dict[str, int]:
    """Wheel sizes by URL: stat for ``file://`` URLs, one HTTP HEAD each otherwise (failures stay unknown)."""
    import ssl
    import urllib.request
    from concurrent.futures import ThreadPoolExecutor
    from urllib.parse import unquote, urlparse

    # the CA bundle pip is told to use, if any (a proxy with its own CA), else the system's
    ctx = ssl.create_default_context(
        cafile=os.environ.get("PIP_CERT") or os.environ.get("SSL_CERT_FILE") or None
    )

    def one(url: str) -> tuple[str, int | None]:
        u = urlparse(url)
        try:
            if u.scheme == "file":
                return url, os.path.getsize(unquote(u.path))
            req = urllib.request.Request(url, method="HEAD")
            with urllib.request.urlopen(req, timeout=timeout, context=ctx) as r:
                n = r.headers.get("Content-Length")
                return url, int(n) if n else None
        except (OSError, ValueError):
            return url, None

    urls = list(dict.fromkeys(p.url for p in packages if p.url))
    with ThreadPoolExecutor(max_workers=workers) as ex:
        return {u: n for u, n in ex.map(one, urls) if n is not None}


def resolve_and_plan(
    specs: Sequence[str],
    target: TargetSpec,
    *,
    installed: Mapping[str, InstalledPackage] | None = None,
    exclusions: Sequence[Exclusion] = (),
    pins: Sequence[str] = (),
    overrides: Sequence[Override] = (),
    workdir: Path,
    resolver_python: str | None = None,
    report: Mapping[str, Any] | None = None,
    pip_args: Sequence[str] = (),
    sizes: bool = True,
    trusted: Iterable[str] = (),
    notes: Sequence[str] = (),
    say: Callable[[str], None] = _say,
    max_rounds: int = 3,
) -> Plan:
    """Resolve ``specs`` for ``target`` with pip (or read ``report``), apply overrides, and plan.

    When the target-marker walk finds requirements the report lacks (pip ran under another Python),
    they are added as roots and the closure resolved again, at most ``max_rounds`` times."""
    note_list = list(notes)
    trusted = tuple(trusted)
    found: list[str] = [resolver_python] if resolver_python else []

    def python() -> str:  # found on first use: a plan from --report without overrides runs no pip
        if not found:
            exe, note = find_resolver_python(target)
            if note:
                note_list.append(note)
                say(f"note: {note}")
            found.append(exe)
        return found[0]

    roots = list(specs)
    fetched: dict[str, ResolvedPackage] = {}

    def fetch(ov: Override) -> ResolvedPackage:
        if ov.key not in fetched:
            say(f"resolving override {ov.requirement} ...")
            got = parse_report(
                pip_report(
                    [ov.requirement],
                    target,
                    python=python(),
                    workdir=workdir,
                    no_deps=True,
                    pip_args=pip_args,
                    tag=f"override-{ov.key}",
                )
            )
            fetched[ov.key] = next(p for p in got if p.key == ov.key)
        return fetched[ov.key]

    def planned(packages: Sequence[ResolvedPackage], overridden: Mapping[str, tuple[str, Override]],
                notes: Sequence[str]) -> Plan:
        """The plan of these packages under this call's target and rules (after a round, after sizing)."""
        return make_plan(packages, target, roots=roots if specs else (), installed=installed,
                         exclusions=exclusions, overridden=overridden, trusted=trusted, notes=notes)

    for rnd in range(1, max_rounds + 1):
        if report is not None:
            rep: Mapping[str, Any] = report
        else:
            exe = python()
            say(f"resolving {' '.join(roots)} for {target.describe()} with {exe} (round {rnd}) ...")
            t0 = time.monotonic()
            rep = pip_report(
                roots,
                target,
                python=exe,
                workdir=workdir,
                constraints=pins,
                pip_args=pip_args,
                tag=f"round{rnd}",
            )
            say(f"  {len(rep.get('install', []))} packages in {time.monotonic() - t0:.0f} s")
        packages, overridden, ov_notes = apply_overrides(parse_report(rep), overrides, fetch)
        plan = planned(packages, overridden, note_list + ov_notes)
        if not plan.missing or report is not None or rnd == max_rounds:
            break
        extra = list(dict.fromkeys(line.split(" (needed by", 1)[0] for line in plan.missing))
        say("  the target needs what the report lacks (markers): " + ", ".join(extra) + "; resolving again")
        note_list.append("added as roots for the target's markers: " + ", ".join(extra))
        roots += [e for e in extra if e not in roots]
    if sizes:
        say(f"sizing {len(packages)} wheels ...")
        got = fetch_sizes(packages)
        packages = tuple(replace(p, size=got.get(p.url)) for p in packages)
        plan = planned(packages, overridden, plan.notes)
    return plan
