"""The target model under test, resolved once per session from the profile (or ``--perf-model``);
the ``target_model`` fixture (fixtures/models.py) hands it out."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import pytest

from kimi_perf.missing import MissingPolicy, missing
from kimi_perf.models.embedded import model_fingerprint
from kimi_perf.profiles import ModelSpec


@dataclass(frozen=True)
class TargetModel:
    name: str
    path: Path
    source: str  # embedded | path | dummy
    fingerprint: str

    @property
    def load_format(self) -> str:
        return "dummy" if self.source == "dummy" else "auto"


def resolve_target(spec: ModelSpec, profile_name: str, policy: MissingPolicy, *, override: str | None = None,
                   tokenizer: Path | None = None) -> TargetModel:
    """The profile's model ``spec`` as a local directory. ``override`` is ``--perf-model``; ``tokenizer``
    the ``--perf-url`` endpoint's tokenizer directory (the model then runs elsewhere); ``policy`` the
    skip-or-fail rule for a model that is not there."""
    if tokenizer is not None:
        # --perf-url serves the model elsewhere: only its tokenizer is needed here (prompts are token
        # ids); the profile's model name keys the baselines
        return TargetModel(spec.name, tokenizer, "tokenizer", model_fingerprint(tokenizer))
    if override:
        p = Path(override).expanduser()
        if not (p / "config.json").is_file():
            raise pytest.UsageError(f"--perf-model {override}: not a model directory (no config.json)")
        return TargetModel(p.name, p, "path", model_fingerprint(p))
    if spec.source == "embedded":
        from kimi_perf.models.embedded import ensure_embedded_model

        try:
            m = ensure_embedded_model()
        except FileNotFoundError as e:
            missing(policy, f"embedded model unavailable: {e}")
        return TargetModel(m.name, m.path, "embedded", model_fingerprint(m.path))
    if spec.source == "dummy":
        from kimi_perf.models.dummy import ensure_dummy_model
        from kimi_perf.profiles import DUMMY_SHAPES

        assert spec.dummy_shape is not None
        try:
            p = ensure_dummy_model(spec.dummy_shape, DUMMY_SHAPES[spec.dummy_shape])
        except FileNotFoundError as e:
            missing(policy, f"dummy model needs the embedded tokenizer: {e}")
        return TargetModel(spec.name, p, "dummy", model_fingerprint(p))
    p = Path(spec.path or "").expanduser()
    if not (p / "config.json").is_file():
        missing(policy, f"profile {profile_name}: model {spec.name} not found at {spec.path} "
                "(mount it there or pass --perf-model PATH)")
    return TargetModel(spec.name, p, "path", model_fingerprint(p))


