"""Engine servers for the session: a pool that starts each configuration once, and the profile's
engine configs (the ``server_pool`` and ``perf_server`` fixtures in fixtures/servers.py hand them out).

Why a pool: starting a server costs seconds (reference engine) to ten minutes (Kimi-K2.5 on 8 GPUs),
so a server is started once per configuration and reused by every test that needs that
configuration. Measurements must not share the machine with another *busy* server, so throughput
tests ask for ``exclusive=True``, which stops every other server first. A server that died (killed,
OOM, crashed) is noticed on the next ``get`` and restarted with a message, so one crash fails the
test it happened in and the rest of the session continues.
"""

from __future__ import annotations

import dataclasses
import sys
from pathlib import Path
from typing import Any

import pytest

from kimi_perf.bench import RunningServer, fetch_version
from kimi_perf.engines.base import EngineConfig
from kimi_perf.launcher import ServerError, ServerProcess
from kimi_perf.missing import MissingPolicy, missing
from kimi_perf.progress import log
from kimi_perf.session import ServerSettings

from .models import TargetModel


def engine_python(s: ServerSettings, kind: str) -> str | None:
    """The interpreter that runs an engine: ours for the reference engine, the engine's own env else."""
    if kind == "reference":
        return sys.executable
    return s.engine_pythons.get(kind)


def require_engine_python(s: ServerSettings, name: str, kind: str) -> str:
    """:func:`engine_python`, or the one skip-or-fail policy (kimi_perf.missing) when the engine's own
    environment is not there: a skip on a laptop, a failure under CI=true or a named profile."""
    py = engine_python(s, kind)
    if py is None:
        made = " (scripts/setup.sh --full makes .venv-vllm)" if kind == "vllm" else ""
        missing(s.policy, f"engine {name} ({kind}) needs its own environment: pass --perf-{kind}-python PATH or "
                          f"set KIMI_PERF_{kind.upper()}_PYTHON{made} (see docs/gpu-runners.md, 'Engine environments')", engine_kind=kind)
    return py


class ServerPool:
    def __init__(self, log_dir: Path, policy: MissingPolicy | None = None, *, no_launch: str | None = None) -> None:
        self.policy = policy
        self.log_dir = log_dir
        self.servers: dict[EngineConfig, RunningServer] = {}
        self.failed: dict[EngineConfig, str] = {}
        # --perf-url: the server under test is someone else's; a test that needs launches of its own skips
        self.no_launch = no_launch

    @classmethod
    def for_settings(cls, settings: ServerSettings, *, no_launch: str | None = None) -> ServerPool:
        """The session's pool: logs under ``settings.log_dir``, earlier failures by ``settings.policy``."""
        return cls(settings.log_dir, settings.policy, no_launch=no_launch)

    def get(self, cfg: EngineConfig, *, exclusive: bool = False) -> RunningServer:
        if self.no_launch:
            pytest.skip(f"{cfg.name}: {self.no_launch}")
        if cfg in self.failed:
            # the first test that needed it failed with the whole error; later ones say so in one line,
            # and under CI=true / a named profile they fail too instead of turning green as skips
            reason = f"{cfg.name} failed to start earlier in this session: {self.failed[cfg].splitlines()[0]}"
            if self.policy is None:
                pytest.skip(reason)
            missing(self.policy, reason)
        if exclusive:
            for other in [c for c in self.servers if c != cfg]:
                self.stop(other)
        srv = self.servers.get(cfg)
        if srv is not None and srv.process.alive():
            return srv
        if srv is not None:
            log(f"{cfg.name} died (exit code {srv.process.returncode}, log {srv.process.log_path}); restarting")
            self.servers.pop(cfg)
        try:
            return self.launch(cfg)
        except ServerError as e:
            self.failed[cfg] = str(e)
            raise

    def launch(self, cfg: EngineConfig) -> RunningServer:
        """Start a fresh server for ``cfg`` (stopping the one it has), with no memory of earlier
        failures: the A/B runner relaunches both sides every block and reports failures itself."""
        if self.no_launch:
            pytest.skip(f"{cfg.name}: {self.no_launch}")
        self.stop(cfg)
        proc = ServerProcess(cfg.launch_spec(self.log_dir))
        proc.start()
        srv = RunningServer(name=cfg.name, kind=cfg.kind, base_url=proc.base_url, model=cfg.served_model_name,
                            process=proc, config=cfg)
        srv.version = fetch_version(srv)
        self.servers[cfg] = srv
        return srv

    def stop(self, cfg: EngineConfig) -> None:
        srv = self.servers.pop(cfg, None)
        if srv is not None:
            rc = srv.process.stop()
            log(f"{cfg.name}: stopped (exit code {rc})")

    def stop_all(self) -> None:
        for cfg in list(self.servers):
            self.stop(cfg)


def engine_config(s: ServerSettings, name: str, target: TargetModel, *, tag: str | None = None,
                  **overrides: Any) -> EngineConfig:
    """The profile's engine ``name`` for ``target``, with optional setting overrides. ``tag`` names the
    variant in logs (``reference-spec``); baselines key on the profile's engine name."""
    from kimi_perf.engines.registry import EngineConfigError, build_engine_config

    if name not in s.engines:
        pytest.skip(f"profile {s.profile_name} defines no engine {name!r} (engines: {', '.join(s.engines)})")
    raw = s.engines[name]
    kind = raw["kind"]
    py = require_engine_python(s, name, kind)
    extra: dict[str, Any] = dict(overrides)
    if kind == "reference":
        extra.setdefault("load_format", target.load_format)
    elif target.source == "dummy":
        extra.setdefault("load_format", "dummy")
    try:
        cfg = build_engine_config(name, raw, model_path=str(target.path), served_model_name=target.name,
                                  python=py, ready_timeout_s=s.server_timeout_s, overrides=extra,
                                  source=str(s.profile_path), allow_remote_bind=s.allow_remote_bind)
    except EngineConfigError as e:
        raise pytest.UsageError(str(e)) from None
    if tag is None:
        parts = ["spec"] if overrides.get("spec") is not None else []
        parts += [n for k, n in (("aux_hidden_states", "aux"), ("extract_hidden_layers", "extract")) if overrides.get(k)]
        parts += [str(overrides[k]) for k in ("dtype", "nccl_preset") if overrides.get(k)]
        tag = "-".join(parts)
    return dataclasses.replace(cfg, name=f"{name}-{tag}") if tag else cfg


