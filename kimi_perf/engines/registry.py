"""Build an engine configuration from a profile's ``engines.<name>`` entry.

Why here and not in the profile loader: the entry is data (validated field by field against the
dataclass), while the model path, interpreter and timeouts come from the session (command-line
overrides, installed environments). Unknown fields are errors naming the valid ones.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Any

from .base import EngineConfig, ReferenceEngineConfig, SpecConfig

__all__ = ["EngineConfigError", "build_engine_config", "engine_classes"]


class EngineConfigError(ValueError):
    pass


def engine_classes() -> dict[str, type[EngineConfig]]:
    classes: dict[str, type[EngineConfig]] = {"reference": ReferenceEngineConfig}
    try:
        from .sglang import SGLangConfig
        from .vllm import VLLMConfig

        classes.update({"sglang": SGLangConfig, "vllm": VLLMConfig})
    except ImportError:  # pragma: no cover - both modules ship with kimi-perf
        pass
    return classes


LOOPBACK = ("127.0.0.1", "localhost", "::1")


def build_engine_config(name: str, raw: Mapping[str, Any], *, model_path: str, served_model_name: str,
                        python: str | None = None, ready_timeout_s: float = 600.0,
                        overrides: Mapping[str, Any] | None = None, source: str = "profile",
                        allow_remote_bind: bool = False) -> EngineConfig:
    """``raw`` is data from a profile: it may choose settings, never what runs. The interpreter comes
    from the session (``--perf-<kind>-python``), and a non-loopback ``host`` needs the session's
    explicit ``--perf-allow-remote-bind``: a profile alone cannot expose a server to the network."""
    kind = raw.get("kind")
    if "python" in raw:
        raise EngineConfigError(f"{source}: engines.{name}.python: a profile cannot choose the interpreter that "
                                f"runs; pass --perf-{kind}-python PATH (or KIMI_PERF_{str(kind).upper()}_PYTHON)")
    if "source_root" in raw:
        raise EngineConfigError(f"{source}: engines.{name}.source_root: a profile cannot choose the code that "
                                "runs; compare another commit with --perf-ab git:REF")
    host = {**raw, **(overrides or {})}.get("host", "127.0.0.1")
    if host not in LOOPBACK and not allow_remote_bind:
        raise EngineConfigError(f"{source}: engines.{name}.host {host!r} would serve beyond this machine; servers "
                                "bind 127.0.0.1 unless pytest is run with --perf-allow-remote-bind")
    classes = engine_classes()
    if kind not in classes:
        raise EngineConfigError(f"{source}: engines.{name}.kind {kind!r}: use one of {sorted(classes)}")
    cls = classes[kind]
    fields = {f.name: f for f in dataclasses.fields(cls)}
    values: dict[str, Any] = {}
    for k, v in {**raw, **(overrides or {})}.items():
        if k == "kind":
            continue
        if k not in fields or k in ("name", "model_path"):
            allowed = sorted(set(fields) - {"name", "model_path", "python"})
            raise EngineConfigError(f"{source}: engines.{name}.{k} is not a {kind} engine setting; "
                                    f"settings: {', '.join(allowed)}")
        if k == "spec" and isinstance(v, Mapping):
            v = SpecConfig(**v)
        elif isinstance(v, list):
            v = tuple(tuple(x) if isinstance(x, list) else x for x in v)
        elif k == "env" and isinstance(v, Mapping):
            v = tuple(sorted((str(a), str(b)) for a, b in v.items()))
        values[k] = v
    values.update(name=name, model_path=model_path, served_model_name=served_model_name)
    values.setdefault("ready_timeout_s", ready_timeout_s)  # a profile's own timeout wins
    if python:
        values["python"] = python
    try:
        return cls(**values)
    except (TypeError, ValueError) as e:
        raise EngineConfigError(f"{source}: engines.{name}: {e}") from None
