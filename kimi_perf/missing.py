"""Skip or fail: one policy for every missing piece a perf test needs.

Why one module: a missing model, GPU, engine environment, drafter or a server that could not start is
a *skip* on a developer's laptop (with the reason and the fix), but a run that asked for those
pieces -- CI (``CI=true``) or a user who named the profile with ``--perf-profile`` -- must not come back
green with nothing measured. Every fixture and the collection hook ask this module, so the rule cannot
drift between them. ``KIMI_PERF_SKIP_<KIND>=1`` keeps an engine's missing environment a skip (the
opt-out for CI machines without that engine, docs/gpu-runners.md).
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import NoReturn

import pytest

__all__ = ["MissingPolicy", "missing", "strict_reason"]


@dataclass(frozen=True)
class MissingPolicy:
    """What the rule reads of a session: the profile named with ``--perf-profile`` (None: the default
    was used). The suite's services take this instead of the pytest config. ``CI`` is read from the
    environment when the rule is applied, as it was when the services read the config."""

    named_profile: str | None = None

    @classmethod
    def of(cls, config: pytest.Config) -> MissingPolicy:
        try:
            named = config.getoption("--perf-profile")
        except ValueError:  # the option group is not registered (plugin disabled)
            named = None
        return cls(None if named is None else str(named))


def strict_reason(where: pytest.Config | MissingPolicy) -> str | None:
    """Why a missing piece fails instead of skipping in this session (None: it skips)."""
    if os.environ.get("CI", "").strip().lower() == "true":
        return "CI=true"
    named = (where if isinstance(where, MissingPolicy) else MissingPolicy.of(where)).named_profile
    if named is not None:
        return f"--perf-profile {named} was named explicitly"
    return None


def missing(where: pytest.Config | MissingPolicy, reason: str, *, engine_kind: str | None = None) -> NoReturn:
    """Skip for a missing piece, with ``reason`` naming the fix; fail instead when
    :func:`strict_reason` says the run asked for it."""
    strict = strict_reason(where)
    if engine_kind is not None and os.environ.get(f"KIMI_PERF_SKIP_{engine_kind.upper()}") == "1":
        strict = None
        reason += f" (KIMI_PERF_SKIP_{engine_kind.upper()}=1)"
    if strict is not None:
        pytest.fail(f"{reason} [a failure, not a skip: {strict}; set KIMI_PERF_SKIP_"
                    f"{(engine_kind or 'ENGINE').upper()}=1 or deselect the test to run without it]", pytrace=False)
    pytest.skip(reason)
