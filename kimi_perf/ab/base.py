"""What ``--perf-ab BASE`` names, resolved before anything runs, and the base side's engine config.

Three kinds of base, one rule: the base is the candidate's engine configuration with exactly one
thing changed, so the comparison measures that one thing.

- ``same``: nothing changed (A/A). The gate must PASS it; it is how the false-fail rate is measured.
- a profile variant: settings, environment (an NCCL preset), interpreter (another engine release,
  ``--perf-ab-python``), engine (SGLang vs vLLM) or drafter changed.
- ``git:REF``: the reference engine's code changed -- it runs from a worktree of REF.

The base side never inherits the planted slowdown (``KIMI_PERF_PLANT_SLOWDOWN``) from the test
process, so setting it plants a regression in the candidate only.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ..engines.reference import PLANT_ENV
from .config import SAME, ABConfigError, Variant
from .gitref import GitBase, ensure_worktree, resolve_ref

__all__ = ["ABBase", "PLANT_ENV", "base_engine_config", "resolve_base"]



@dataclass(frozen=True)
class ABBase:
    spec: str  # as given on the command line
    kind: str  # "same" | "variant" | "git"
    variant: Variant | None = None
    git: GitBase | None = None
    python: str | None = None  # --perf-ab-python

    @property
    def label(self) -> str:
        if self.kind == "git":
            assert self.git is not None
            return f"git:{self.git.ref} ({self.git.sha[:10]} {self.git.subject[:50]})"
        if self.kind == "same":
            return "same (A/A: the candidate's own configuration)"
        return f"variant {self.spec}" + (f" ({self.variant.description})" if self.variant and self.variant.description else "")

    def describe(self) -> dict[str, Any]:
        d: dict[str, Any] = {"spec": self.spec, "kind": self.kind, "label": self.label}
        if self.variant is not None:
            d["variant"] = self.variant.describe()
        if self.git is not None:
            d["git"] = {"ref": self.git.ref, "sha": self.git.sha, "subject": self.git.subject}
        if self.python:
            d["python"] = self.python
        return d


def resolve_base(spec: str, variants: dict[str, Variant], repo: Path, *, python: str | None = None) -> ABBase:
    """Parse ``--perf-ab``; every mistake is an :class:`ABConfigError` naming the fix."""
    spec = spec.strip()
    if python is not None and not Path(python).exists():
        raise ABConfigError(f"--perf-ab-python {python}: no such file")
    if spec == SAME:
        return ABBase(spec, "same", python=python)
    if spec.startswith("git:"):
        return ABBase(spec, "git", git=resolve_ref(repo, spec[4:].strip()), python=python)
    if spec in variants:
        v = variants[spec]
        if v.interpreter == "cli" and not python:
            raise ABConfigError(f"--perf-ab {spec}: this variant runs another environment's engine; give its "
                                "interpreter with --perf-ab-python PATH")
        if v.git_ref:
            return ABBase(spec, "variant", variant=v, git=resolve_ref(repo, v.git_ref), python=python)
        return ABBase(spec, "variant", variant=v, python=python)
    known = ", ".join([SAME, "git:REF", *variants]) if variants else f"{SAME}, git:REF"
    raise ABConfigError(f"--perf-ab {spec!r}: not a variant of this profile; choose one of: {known} "
                        "(variants are declared under \"variants\" in the profile)")


def base_engine_config(candidate: Any, base: ABBase, *, build: Any, cache_dir: Path) -> Any:
    """The base side's engine config. ``build(engine_name, **settings)`` builds a profile engine's
    config the way the candidate's was built (kimi_perf.suite.servers.engine_config)."""
    from ..engines.base import ReferenceEngineConfig

    engine = candidate.name
    cfg = candidate
    v = base.variant
    if v is not None and (v.engine or v.settings):
        cfg = build(v.engine or engine, **dict(v.settings))
    env = dict(cfg.env)
    env[PLANT_ENV] = "0"  # the candidate alone carries a planted slowdown (a variant may still set one)
    if v is not None:
        env.update(v.env)
    changes: dict[str, Any] = {"env": tuple(sorted(env.items())), "name": f"{cfg.name}-base"}
    if v is not None and v.drafter:
        if getattr(cfg, "spec", None) is None:
            raise ABConfigError(f"--perf-ab {base.spec}: the variant sets a drafter, but engine {cfg.name} is not "
                                "serving speculative decoding here (drafter variants apply to the EAGLE-3 A/B)")
        changes["spec"] = dataclasses.replace(cfg.spec, draft_model_path=v.drafter)
    if base.python and (v is None or v.interpreter == "cli"):
        changes["python"] = base.python
    if base.git is not None:
        if not isinstance(cfg, ReferenceEngineConfig):
            raise ABConfigError(f"--perf-ab {base.spec}: a git base changes this repository's code, which only the "
                                f"reference engine runs; engine {engine} is {cfg.kind}. Compare {cfg.kind} releases "
                                "with a variant that has \"interpreter\": \"cli\" and --perf-ab-python")
        changes["source_root"] = str(ensure_worktree(base.git, cache_dir))
        # the base server starts inside the worktree: paths given relative to the candidate's
        # working directory must not change meaning
        changes["model_path"] = str(Path(cfg.model_path).resolve())
        spec = changes.get("spec", getattr(cfg, "spec", None))
        if spec is not None:
            changes["spec"] = dataclasses.replace(spec, draft_model_path=str(Path(spec.draft_model_path).resolve()))
    return dataclasses.replace(cfg, **changes)
