"""The run's :class:`PerfSession` (profile, baselines, options) and the inert switch that builds it.

Split out of :mod:`kimi_perf.plugin`: building and activating the session is what every fixture and
hook reaches for, and it reads only options, profiles and baselines, never the gate or the reports.
"""

from __future__ import annotations

import os
import signal
import threading
import time
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest

from .ab.base import ABBase
from .ab.config import ABConfigError
from .baselines import BaselineError, BaselineStore
from .endpoint import Endpoint
from .machine import gpu_info, hardware_key
from .missing import MissingPolicy
from .options import OPTION_BOUNDS, _opt
from .profiles import GateSpec, Profile, ProfileError, find_profile, load_profile
from .sections import Eagle3Section


@dataclass
class PerfSession:
    config: pytest.Config
    profile: Profile
    store: BaselineStore
    report_dir: Path
    repeats: int
    update: bool
    engines: tuple[str, ...]
    hardware: str
    rootdir: Path
    json_path: Path | None
    server_timeout_s: float
    model_override: str | None
    drafter_path: str | None
    engine_pythons: dict[str, str]
    allow_remote_bind: bool = False
    train_drafter: bool = False  # --perf-train-drafter: ignore a matching shipped drafter
    ab: ABBase | None = None  # --perf-ab: the base the ab-marked tests compare against
    history_path: Path | None = None  # <history dir>/<profile>.jsonl (kimi_perf.history), None = off
    endpoint: Endpoint | None = None  # --perf-url: an existing server is the engine under test
    results: list[dict[str, Any]] = field(default_factory=list)
    started: float = field(default_factory=time.time)
    gpus: list[dict[str, str]] = field(default_factory=list)
    # measurements later tests of this process may reuse (e.g. the sweep's medians for the batching
    # gain); a test that finds nothing here measures for itself, so -k and xdist stay correct
    cache: dict[Any, Any] = field(default_factory=dict)

    def gate_config(self, metric: str):  # type: ignore[no-untyped-def]
        return self.profile.gate.for_metric(metric)

    @property
    def is_worker(self) -> bool:
        return hasattr(self.config, "workerinput")


    def gate_context(self) -> GateContext:
        """What a test's ``perf_gate`` needs of the session, and nothing else."""
        return GateContext(store=self.store, hardware=self.hardware, report_dir=self.report_dir, update=self.update,
                           gate=self.profile.gate, ab_base=self.ab.describe() if self.ab else None)

    def missing_policy(self) -> MissingPolicy:
        """What the skip-or-fail rule (:mod:`kimi_perf.missing`) reads of this session."""
        return MissingPolicy.of(self.config)

    def server_settings(self) -> ServerSettings:
        """What the engine servers (``kimi_perf.suite.servers``) need of the session, and nothing else."""
        return ServerSettings(profile_name=self.profile.name, profile_path=self.profile.path,
                              engines=self.profile.engines, engine_pythons=dict(self.engine_pythons),
                              server_timeout_s=self.server_timeout_s, allow_remote_bind=self.allow_remote_bind,
                              log_dir=self.report_dir / "logs", policy=self.missing_policy())

    def eagle3_settings(self) -> Eagle3Settings:
        """What the EAGLE-3 drafter and A/B (``kimi_perf.suite.drafters``) need of the session."""
        return Eagle3Settings(servers=self.server_settings(), eagle3=self.profile.eagle3,
                              alignment_engines=self.profile.alignment.engines, repeats=self.repeats,
                              drafter_path=self.drafter_path, train_drafter=self.train_drafter)


@dataclass(frozen=True)
class GateContext:
    """The part of a session the ``perf_gate`` recorder (:class:`kimi_perf.recorder.PerfGate`) reads.

    Why not the session: PerfSession is a 20-field mutable object (config, engines, caches, the
    endpoint, ...), and a recorder handed all of it can come to depend on any of it; pytest-benchmark
    hands its fixture only what it uses (storage, options, the node). Here: where baselines live and
    whether this run updates them, the hardware key of every baseline key, the profile's gate
    tolerances, where request files go, and the A/B base the run compares against (for the record)."""

    store: BaselineStore
    hardware: str
    report_dir: Path
    update: bool
    gate: GateSpec
    ab_base: dict[str, Any] | None = None


@dataclass(frozen=True)
class ServerSettings:
    """What the server pool and ``engine_config`` (:mod:`kimi_perf.suite.servers`) read: the profile's
    engine entries (and its name and path, for messages), the engine interpreters, the launch timeout,
    whether a non-loopback bind is allowed, where server logs go, and the skip-or-fail policy for an
    engine environment or a server that is not there. Built by :meth:`PerfSession.server_settings`."""

    profile_name: str
    profile_path: Path
    engines: Mapping[str, Mapping[str, Any]]
    engine_pythons: Mapping[str, str]
    server_timeout_s: float
    allow_remote_bind: bool = False
    log_dir: Path = Path("logs")
    policy: MissingPolicy = MissingPolicy()


@dataclass(frozen=True)
class Eagle3Settings:
    """What the EAGLE-3 drafter and its A/B (:mod:`kimi_perf.suite.drafters`) read: the servers'
    settings, the profile's ``eagle3`` section (None: the profile has none, the tests skip), the
    ``alignment.engines`` whose SGLang servers also return hidden states, the repeats, and the
    ``--perf-drafter`` / ``--perf-train-drafter`` options. Built by :meth:`PerfSession.eagle3_settings`."""

    servers: ServerSettings
    eagle3: Eagle3Section | None
    alignment_engines: tuple[str, ...]
    repeats: int
    drafter_path: str | None = None
    train_drafter: bool = False


SESSION_KEY = pytest.StashKey[PerfSession]()


def get_session(config: pytest.Config) -> PerfSession:
    return activate(config)


def _endpoint(config: pytest.Config, engines: tuple[str, ...], profile: str) -> Endpoint | None:
    """``--perf-url`` and its companions, checked before anything runs."""
    from .endpoint import EndpointError, parse_endpoint

    try:
        ep = parse_endpoint(config.getoption("--perf-url"), tokenizer=config.getoption("--perf-tokenizer"),
                            api_key_env=config.getoption("--perf-api-key-env"),
                            served_model=config.getoption("--perf-served-model"))
    except EndpointError as e:
        raise pytest.UsageError(str(e)) from None
    if ep is not None and len(engines) != 1:
        raise pytest.UsageError(f"--perf-url {ep.url}: name the one engine of profile {profile} it runs with "
                                f"--perf-engine NAME (its baselines are keyed by that name); selected: "
                                f"{', '.join(engines) or 'none'}")
    return ep


def _build_session(config: pytest.Config) -> PerfSession:
    """The run's profile, baselines and options; pytest.UsageError on misconfiguration."""
    rootdir = Path(str(config.rootpath))
    try:
        prof_path = find_profile(str(_opt(config, "perf_profile")), [rootdir / "profiles", Path.cwd() / "profiles"])
        profile = load_profile(prof_path)
    except ProfileError as e:
        raise pytest.UsageError(f"{e}") from None
    engines_opt = str(_opt(config, "perf_engine")).strip()
    if engines_opt in ("", "default"):
        engines = profile.default_engines
    elif engines_opt == "all":
        engines = tuple(profile.engines)
    else:
        engines = tuple(e.strip() for e in engines_opt.split(",") if e.strip())
        unknown = [e for e in engines if e not in profile.engines]
        if unknown:
            raise pytest.UsageError(f"--perf-engine {engines_opt}: profile {profile.name} ({profile.path}) has no engine "
                                    f"{', '.join(unknown)}; its engines: {', '.join(profile.engines)}")
    repeats = int(_bounded(config, "perf_repeats", int))
    timeout = _bounded(config, "perf_server_timeout", float)
    update = bool(config.getoption("--perf-update-baselines"))
    baseline_dir = Path(str(_opt(config, "perf_baseline_dir")))
    if not baseline_dir.is_absolute():
        baseline_dir = rootdir / baseline_dir
    if update:
        _check_writable_dir(baseline_dir, "--perf-baseline-dir (ini perf_baseline_dir), written by --perf-update-baselines")
    try:
        store = BaselineStore(baseline_dir / f"{profile.name}.json", profile.name)
    except BaselineError as e:
        raise pytest.UsageError(str(e)) from None
    report_dir = Path(str(_opt(config, "perf_report_dir")))
    if not report_dir.is_absolute():
        report_dir = rootdir / report_dir
    _check_writable_dir(report_dir, "--perf-report-dir (ini perf_report_dir)")
    ab = None
    ab_opt = config.getoption("--perf-ab")
    if ab_opt:
        from .ab.base import resolve_base

        try:
            ab = resolve_base(ab_opt, dict(profile.variants), rootdir, python=config.getoption("--perf-ab-python"))
        except ABConfigError as e:
            raise pytest.UsageError(str(e)) from None
    from .history import history_file

    history_path = history_file(str(config.getoption("--perf-history") or config.getini("perf_history_dir")),
                                rootdir=rootdir, report_dir=report_dir, profile=profile.name)
    if history_path is not None:
        _check_writable_dir(history_path.parent, "--perf-history (ini perf_history_dir; 'off' disables it)")
    endpoint = _endpoint(config, engines, profile.name)
    gpus = gpu_info()
    json_opt = config.getoption("--perf-json")
    if json_opt:
        if Path(json_opt).is_dir():
            raise pytest.UsageError(f"--perf-json {json_opt}: is a directory; give the path of a file to write")
        _check_writable_dir(Path(json_opt).absolute().parent, f"--perf-json {json_opt} (its directory)")
    pythons = {}
    for eng in ("vllm", "sglang"):
        # flag, then env, then the venv scripts/setup.sh creates beside the checkout
        cand = (config.getoption(f"--perf-{eng}-python") or os.environ.get(f"KIMI_PERF_{eng.upper()}_PYTHON", "")
                or (str(rootdir / f".venv-{eng}" / "bin" / "python")
                    if (rootdir / f".venv-{eng}" / "bin" / "python").exists() else ""))
        if cand and not Path(cand).exists():
            raise pytest.UsageError(f"--perf-{eng}-python / KIMI_PERF_{eng.upper()}_PYTHON: {cand} does not exist")
        pythons[eng] = cand
    return PerfSession(
        endpoint=endpoint, config=config, profile=profile, store=store, report_dir=report_dir,
        repeats=repeats or profile.repeats, update=update,
        engines=engines, hardware=profile.hardware_key(hardware_key(gpus, use_gpu=profile.hardware == "cuda"), gpus),
        rootdir=rootdir,
        json_path=Path(json_opt) if json_opt else None, server_timeout_s=timeout,
        model_override=config.getoption("--perf-model"), drafter_path=config.getoption("--perf-drafter"),
        engine_pythons={k: v for k, v in pythons.items() if v}, gpus=gpus,
        allow_remote_bind=bool(config.getoption("--perf-allow-remote-bind")), ab=ab, history_path=history_path,
        train_drafter=bool(config.getoption("--perf-train-drafter")),
    )


def _bounded(config: pytest.Config, name: str, kind: type) -> float:
    """A numeric option (or its ini value) within :data:`OPTION_BOUNDS`, else a UsageError naming it."""
    lo, hi = OPTION_BOUNDS[name]
    flag = "--" + name.replace("_", "-")
    raw = _opt(config, name)
    try:
        v = kind(raw)
    except (TypeError, ValueError):
        raise pytest.UsageError(f"{flag} (ini {name}): {raw!r} is not a number; give one in [{lo:g}, {hi:g}]") from None
    if not lo <= v <= hi:  # NaN fails this too
        zero = " (0 = the profile's repeats)" if name == "perf_repeats" else ""
        raise pytest.UsageError(f"{flag} (ini {name}): {raw} is out of range; give a value in [{lo:g}, {hi:g}]{zero}")
    return v


def _check_writable_dir(path: Path, option: str) -> None:
    """Refuse, before anything runs, a directory the run will write but cannot: the path or one of its
    parents is a file, or the nearest existing directory is not writable. Found after the run, this was
    a raw NotADirectoryError/PermissionError naming no option, and the measurements were lost."""
    p = path
    while not p.exists():
        if p.parent == p:
            break
        p = p.parent
    if not p.is_dir():
        what = "is a file" if p == path else f"has a file in its path ({p})"
        raise pytest.UsageError(f"{option}: {path} {what}; it must be a directory. Fix: point the option elsewhere "
                                "or move the file")
    if not os.access(p, os.W_OK | os.X_OK):
        raise pytest.UsageError(f"{option}: {path} is not writable by this user ({p} is read-only). Fix: point "
                                "the option at a writable directory or fix its permissions")


_FAILED_KEY = pytest.StashKey[str]()
# fixtures pytest_generate_tests parametrizes from the profile: a test that asks for one needs the session
_PARAM_FIXTURES = frozenset({"perf_engine_name", "perf_nccl_preset", "perf_nccl_concurrency",
                             "perf_allreduce_tokens", "perf_concurrency",
                             "eagle3_engine", "align_engine", "planted_engine", "decode_engine"})
# every fixture of fixtures/ reaches the session through perf_session, so the closure names it
_SESSION_FIXTURES = _PARAM_FIXTURES | {"perf_session", "perf_gate"}


def activate(config: pytest.Config) -> PerfSession:
    """The run's :class:`PerfSession`, built on first use. A misconfiguration raises the same
    ``pytest.UsageError`` every time it is asked, so the test that needed it is never run half-set-up."""
    s = config.stash.get(SESSION_KEY, None)
    if s is not None:
        return s
    failed = config.stash.get(_FAILED_KEY, None)
    if failed is not None:
        raise pytest.UsageError(failed)
    try:
        s = _build_session(config)
    except pytest.UsageError as e:
        config.stash[_FAILED_KEY] = str(e)
        raise
    config.stash[SESSION_KEY] = s
    return s


def session_for_params(config: pytest.Config) -> PerfSession | None:
    """:func:`activate` for ``pytest_generate_tests``: the session, built here if no earlier module needed
    it, or None when the configuration is broken. The test is then left unparametrized; if it is
    selected, ``_switch`` raises the same error as a usage error (here it would only be a collection
    error of this module, and a deselected test needs nothing)."""
    try:
        return activate(config)
    except pytest.UsageError:
        return None


def needs_session(item: pytest.Item) -> bool:
    """A test of the suite: it uses the plugin's fixtures (every fixture of fixtures/ reaches perf_session).
    A marker alone does not make one: a host repository's own ``perf``/``gpu``/``matrix`` tests are left
    alone (issue 25 item 5)."""
    return not _SESSION_FIXTURES.isdisjoint(getattr(item, "fixturenames", ()))


def _switch(config: pytest.Config, items: list[pytest.Item]) -> PerfSession | None:
    """The inert switch, run after ``-m``/``-k`` deselection: build the session if a selected test needs
    it (a broken profile or baseline file stops the run here as a usage error) and return it; otherwise
    load nothing and touch nothing."""
    if any(needs_session(i) for i in items):
        return activate(config)
    return None


def server_affine_order(items: list[pytest.Item], engines: tuple[str, ...] | list[str]) -> list[pytest.Item]:
    """The selected perf tests in the order that launches each engine server once: modules in the order
    pytest gives them, within a module one engine at a time (the profile's engine order), then the
    tests as written with their parameters in declaration order. Tests not marked ``perf`` keep the
    place pytest gave them within their module.

    Why: pytest reorders items to share higher-scoped fixtures, and its choice moves between releases
    (9.1 moved ``test_concurrency_sweep[c8..c128]`` behind every other module, 9.2 does not). The
    engine server is a pooled resource the fixtures cannot declare, so that move stopped the server
    for the EAGLE-3 and alignment servers and relaunched it for the sweep -- 60-180 s per real engine
    on the H200."""
    first: dict[Any, int] = {}
    for i in items:
        first.setdefault(getattr(i, "module", None) or i.parent, len(first))
    rank = {e: n for n, e in enumerate(engines)}

    def key(t: tuple[int, pytest.Item]) -> tuple[Any, ...]:
        pos, item = t
        cs = getattr(item, "callspec", None)
        params = dict(getattr(cs, "params", {}) or {})
        indices = tuple(dict(getattr(cs, "indices", {}) or {}).values())
        mod = first[getattr(item, "module", None) or item.parent]
        if item.get_closest_marker("perf") is None:
            return (mod, -1, pos, (), pos)
        # the engine a test talks to: perf_engine_name, or an engine-parametrized fixture (align_engine, ...)
        engine = next((v for v in params.values() if isinstance(v, str) and v in rank), None)
        line = item.reportinfo()[1]
        # a test that names no engine runs with the first engine's group, where it was written
        return (mod, rank[engine] if engine is not None else 0, line if isinstance(line, int) else pos, indices, pos)

    return [item for _, item in sorted(enumerate(items), key=key)]


# -- SIGTERM / SIGHUP -----------------------------------------------------------------------------

# the signal that ended the session, if one did: the exit code says it (128 + signal number)
SIGNAL_KEY = pytest.StashKey[int]()
END_SIGNALS = (signal.SIGTERM, signal.SIGHUP)


def end_session_on_signals(config: pytest.Config) -> None:
    """SIGTERM and SIGHUP end the session the way SIGINT does: a KeyboardInterrupt unwinds the running
    test, pytest tears the fixtures down (servers and ranks stopped), the collector writes run.json and
    the summary with what was measured, and the exit code is 128 + the signal number.

    Why: the launcher's handler alone raised SystemExit inside the running test, which pytest records
    as that test's failure and carries on with the next one (a fresh server included): a CI cancel was
    ignored until the runner escalated to SIGKILL and lost the run's results. Installed only once a
    perf session is active (on the xdist controller: at the first result), so plain unit-test runs
    keep Python's default handling."""
    if threading.current_thread() is not threading.main_thread() or SIGNAL_KEY in config.stash:
        return
    config.stash[SIGNAL_KEY] = 0
    previous = {sig: signal.getsignal(sig) for sig in END_SIGNALS}

    def handler(signum: int, frame: object) -> None:
        if config.stash.get(SIGNAL_KEY, 0):
            return  # already unwinding: a repeated signal must not interrupt the teardown and reports
        config.stash[SIGNAL_KEY] = signum
        raise KeyboardInterrupt(f"{signal.Signals(signum).name} received: ending the kimi-perf session")

    for sig in END_SIGNALS:
        signal.signal(sig, handler)

    def restore() -> None:
        for sig, prev in previous.items():
            signal.signal(sig, prev)

    config.add_cleanup(restore)
