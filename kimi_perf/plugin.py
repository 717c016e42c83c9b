"""The kimi-perf pytest plugin: options, markers, session state, result transport, gate, summary.

Registered by the ``pytest11`` entry point named ``kimi_perf.plugin`` (``pip install kimi-perf`` makes
``--perf-*`` available in any repository); the repository's ``conftest.py`` lists the module under the
same name, which pytest then skips, so it registers once either way. Design follows pytest-benchmark
and pytest-xdist:

- one option group ``kimi-perf``; every flag is ``--perf-*`` and falls back to an ini value under
  ``[tool.pytest.ini_options]`` (so a runner's defaults live in ``pyproject.toml``);
- inert until a selected test needs it: the :class:`PerfSession` (profile, baselines) is built when a
  collected test asks for a profile-parametrized fixture or, after ``-m``/``-k`` deselection, a
  selected test is marked ``perf``/``ab`` or uses ``perf_session``/``perf_gate``. Installed in every
  repository by the entry point, the plugin must not make ``pytest tests/`` depend on a profile or a
  baseline file those tests never read;
- one :class:`PerfSession` in ``config.stash``; misconfiguration (unknown profile or engine, malformed
  profile or baseline file) is a ``pytest.UsageError`` raised when the session is built, at collection,
  before anything runs;
- tests record results through the ``perf_gate`` fixture, which gates in the test (a regression is
  an assertion failure of that test) and attaches the JSON record to ``report.user_properties``; the
  summary table, run file and baseline update are built from the reports in
  ``pytest_runtest_logreport``, which runs on the xdist controller, so the same path works with and
  without ``-n``.

Nothing here imports torch or an engine.
"""

from __future__ import annotations

import json
import math
import os
import sys
import time
import warnings
from collections.abc import Callable, Collection, Mapping, Sequence
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import TYPE_CHECKING, Any

import pytest

from .ab.base import ABBase
from .ab.config import ABConfigError
from .baselines import (
    BaselineError,
    BaselineKey,
    BaselineStore,
    entries_from_results,
)
from .machine import commit_info, gpu_info, hardware_key, machine_info
from .metrics import METRICS, get_metric
from .profiles import Profile, ProfileError, find_profile, load_profile
from .stats import GateDecision, confirm_gate, gate

if TYPE_CHECKING:
    from .ab.decide import ABDecision
    from .ab.runner import ABOutcome

PROP = "kimi_perf"
MARKERS = {
    "perf": "performance measurement gated against stored baselines (starts engines)",
    "alignment": "hidden-state agreement between an extraction path and an inference path",
    "eagle": "EAGLE-3 drafter acceptance and speedup",
    "gpu": "needs a CUDA GPU (skipped with a reason when none is visible)",
    "ab": "same-run A/B against the base named by --perf-ab (deselected without it)",
}


class PerfWarning(UserWarning):
    """A metric moved beyond tolerance without statistical support (verdict WARN)."""


class PerfRegression(AssertionError):
    """A gated metric regressed (verdict FAIL)."""


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
    ab: ABBase | None = None  # --perf-ab: the base the ab-marked tests compare against
    history_path: Path | None = None  # baselines/history/<profile>.jsonl, None = off
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


SESSION_KEY = pytest.StashKey[PerfSession]()


def get_session(config: pytest.Config) -> PerfSession:
    return activate(config)


# -- options --------------------------------------------------------------------------------------

_INI: list[tuple[str, str, str]] = [
    ("perf_profile", "profile name (profiles/<name>.json) or path", "embedded-cpu"),
    ("perf_engine", "engine name(s) of the profile, comma-separated, 'default' or 'all'", "default"),
    ("perf_repeats", "measured repeats per point; 0 = the profile's value", "0"),
    ("perf_report_dir", "directory for the summary, run file, plots and server logs", "perf-report"),
    ("perf_baseline_dir", "directory of baselines/<profile>.json", "baselines"),
    ("perf_server_timeout", "seconds a server may take to become ready", "600"),
    ("perf_history_dir", "directory of <profile>.jsonl run histories ('off' = none)", "baselines/history"),
]
# the one place the defaults live: addini gets them and every --perf-* help text quotes them from here
_DEFAULT = {name: default for name, _, default in _INI}
DEFAULT_ENGINES_HELP = "'default' = the profile's default_engines"


def _ini_help(name: str, default: str | None = None) -> str:
    return f"ini: {name}; default {default if default is not None else _DEFAULT[name]}"


def pytest_addhooks(pluginmanager: pytest.PytestPluginManager) -> None:
    from . import hookspecs

    pluginmanager.add_hookspecs(hookspecs)


def pytest_addoption(parser: pytest.Parser) -> None:
    g = parser.getgroup("kimi-perf", "kimi-perf: LLM serving performance gates")
    g.addoption("--perf-profile", default=None, metavar="NAME",
                help=f"profile to run: a name under profiles/ or a JSON path ({_ini_help('perf_profile')})")
    g.addoption("--perf-engine", default=None, metavar="NAMES",
                help="engines of the profile to measure, comma-separated, or 'all' "
                     f"({_ini_help('perf_engine', DEFAULT_ENGINES_HELP)})")
    g.addoption("--perf-model", default=None, metavar="PATH",
                help="serve this model directory instead of the profile's model")
    g.addoption("--perf-repeats", default=None, type=int, metavar="N",
                help="measured repeats per point; the gate compares medians and runs a Mann-Whitney test over them "
                     f"({_ini_help('perf_repeats', _DEFAULT['perf_repeats'] + ': the profile repeats')})")
    g.addoption("--perf-update-baselines", action="store_true", default=False,
                help="record this run's samples as the new baselines (atomic rewrite of baselines/<profile>.json); "
                     "nothing fails on regression")
    g.addoption("--perf-json", default=None, metavar="PATH",
                help="also write the run file (results, machine, commit) to PATH")
    g.addoption("--perf-report-dir", default=None, metavar="DIR",
                help=f"where the summary (markdown), run file, PNG plots and server logs go ({_ini_help('perf_report_dir')})")
    g.addoption("--perf-baseline-dir", default=None, metavar="DIR",
                help=f"directory holding <profile>.json baselines ({_ini_help('perf_baseline_dir')})")
    g.addoption("--perf-server-timeout", default=None, type=float, metavar="SECONDS",
                help=f"how long a server may take to become ready ({_ini_help('perf_server_timeout')})")
    g.addoption("--perf-allow-remote-bind", action="store_true", default=False,
                help="let a profile's engine bind a non-loopback host (default: every server binds 127.0.0.1)")
    g.addoption("--perf-drafter", default=None, metavar="PATH",
                help="use this EAGLE-3 drafter checkpoint instead of training one")
    g.addoption("--perf-vllm-python", default=None, metavar="PATH",
                help="python interpreter of the environment that has vLLM (env KIMI_PERF_VLLM_PYTHON; default "
                     ".venv-vllm/bin/python when scripts/setup.sh made it)")
    g.addoption("--perf-sglang-python", default=None, metavar="PATH",
                help="python interpreter of the environment that has SGLang (env KIMI_PERF_SGLANG_PYTHON; default "
                     ".venv-sglang/bin/python when present)")
    g.addoption("--perf-ab", default=None, metavar="BASE",
                help="compare the candidate (this checkout, the selected engines) with BASE in the same run, "
                     "interleaved, and gate the headline metrics on the interval of their ratio; BASE is a "
                     "variant of the profile, 'same' (A/A) or git:REF (this repository at REF, e.g. git:HEAD~1; "
                     "reference engine). Runs the tests marked ab, which are deselected without it")
    g.addoption("--perf-ab-python", default=None, metavar="PATH",
                help="interpreter of the A/B base side, for variants with \"interpreter\": \"cli\" (e.g. a venv "
                     "with another engine release)")
    g.addoption("--perf-history", default=None, metavar="DIR|off",
                help="append every run's medians (with commit, host, engine versions) to DIR/<profile>.jsonl for "
                     "'python -m kimi_perf.history'; 'off' disables it "
                     f"({_ini_help('perf_history_dir')})")
    for name, help_, default in _INI:
        parser.addini(name, help_, default=default)


def _opt(config: pytest.Config, name: str) -> Any:
    v = config.getoption("--" + name.replace("_", "-"))
    return v if v is not None else config.getini(name)


# -- configure ------------------------------------------------------------------------------------


def pytest_configure(config: pytest.Config) -> None:
    for name, desc in MARKERS.items():
        config.addinivalue_line("markers", f"{name}: {desc}")
    if config.option.help or config.option.version:
        return  # --help must work even where the default profile does not exist
    # nothing is loaded here: the session is built by activate() when a selected test needs it
    if not hasattr(config, "workerinput"):
        config.pluginmanager.register(PerfCollector(config), "kimi-perf-collector")
    _install_progress_sink(config)


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
    try:
        repeats = int(_opt(config, "perf_repeats"))
        timeout = float(_opt(config, "perf_server_timeout"))
    except ValueError as e:
        raise pytest.UsageError(f"kimi-perf: bad number in perf_repeats/perf_server_timeout: {e}") from None
    if repeats < 0:
        raise pytest.UsageError("--perf-repeats must be >= 0 (0 = the profile's repeats)")
    baseline_dir = Path(str(_opt(config, "perf_baseline_dir")))
    if not baseline_dir.is_absolute():
        baseline_dir = rootdir / baseline_dir
    try:
        store = BaselineStore(baseline_dir / f"{profile.name}.json", profile.name)
    except BaselineError as e:
        raise pytest.UsageError(str(e)) from None
    report_dir = Path(str(_opt(config, "perf_report_dir")))
    if not report_dir.is_absolute():
        report_dir = rootdir / report_dir
    ab = None
    ab_opt = config.getoption("--perf-ab")
    if ab_opt:
        from .ab.base import resolve_base

        try:
            ab = resolve_base(ab_opt, dict(profile.variants), rootdir, python=config.getoption("--perf-ab-python"))
        except ABConfigError as e:
            raise pytest.UsageError(str(e)) from None
    hist = str(config.getoption("--perf-history") or config.getini("perf_history_dir")).strip()
    history_path = None
    if hist and hist.lower() != "off":
        history_path = (Path(hist) if Path(hist).is_absolute() else rootdir / hist) / f"{profile.name}.jsonl"
    gpus = gpu_info()
    json_opt = config.getoption("--perf-json")
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
        config=config, profile=profile, store=store, report_dir=report_dir,
        repeats=repeats or profile.repeats, update=bool(config.getoption("--perf-update-baselines")),
        engines=engines, hardware=profile.hardware_key(hardware_key(gpus, use_gpu=profile.hardware == "cuda"), gpus),
        rootdir=rootdir,
        json_path=Path(json_opt) if json_opt else None, server_timeout_s=timeout,
        model_override=config.getoption("--perf-model"), drafter_path=config.getoption("--perf-drafter"),
        engine_pythons={k: v for k, v in pythons.items() if v}, gpus=gpus,
        allow_remote_bind=bool(config.getoption("--perf-allow-remote-bind")), ab=ab, history_path=history_path,
    )


_FAILED_KEY = pytest.StashKey[str]()
# fixtures pytest_generate_tests parametrizes from the profile: a test that asks for one needs the session
_PARAM_FIXTURES = frozenset({"perf_engine_name", "perf_nccl_preset", "perf_nccl_concurrency",
                             "perf_allreduce_tokens", "perf_concurrency"})
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


def needs_session(item: pytest.Item) -> bool:
    return (item.get_closest_marker("perf") is not None or item.get_closest_marker("ab") is not None
            or not _SESSION_FIXTURES.isdisjoint(getattr(item, "fixturenames", ())))


def _switch(config: pytest.Config, items: list[pytest.Item]) -> PerfSession | None:
    """The inert switch, run after ``-m``/``-k`` deselection: build the session if a selected test needs
    it (a broken profile or baseline file stops the run here as a usage error) and return it; otherwise
    load nothing and only skip ``gpu`` tests on a machine without one, as the session would have."""
    if any(needs_session(i) for i in items):
        return activate(config)
    gpu_items = [i for i in items if i.get_closest_marker("gpu") is not None]
    if gpu_items and not gpu_info():
        for i in gpu_items:
            i.add_marker(pytest.mark.skip(reason="needs a CUDA GPU; nvidia-smi lists none on this machine"))
    return None


def _install_progress_sink(config: pytest.Config) -> None:
    from . import progress

    def sink(line: str) -> None:
        # looked up per line: the terminal reporter registers after this plugin configures
        tr = config.pluginmanager.getplugin("terminalreporter")
        capman = config.pluginmanager.getplugin("capturemanager")
        if tr is None:
            print(line, file=sys.stderr, flush=True)
        elif capman is None:
            tr.write_line(line)
        else:
            with capman.global_and_fixture_disabled():
                tr.write_line(line)

    progress.set_sink(sink)
    config.add_cleanup(lambda: progress.set_sink(None))


def pytest_report_collectionfinish(config: pytest.Config) -> list[str]:
    # after "collected N items", not in the header: the session exists only once a collected test needed it
    s = config.stash.get(SESSION_KEY, None)
    if s is None:
        return []
    base = f"{len(s.store.entries)} entries" if s.store.path.exists() else "none yet"
    return [f"kimi-perf: profile {s.profile.name} ({s.profile.hardware}), engines {','.join(s.engines)}, "
            f"repeats {s.repeats}, hardware {s.hardware}, baselines {s.store.path.name} ({base})"
            + (", UPDATING baselines" if s.update else "")] + (
        [f"kimi-perf A/B: candidate = this checkout, base = {s.ab.label}; threshold {s.profile.ab.threshold:.1%}, "
         f"blocks {s.profile.ab.min_blocks}-{s.profile.ab.max_blocks} x {s.profile.ab.repeats_per_block} pairs"
         + (", relaunching servers every block" if s.profile.ab.relaunch else "")] if s.ab else [])


def pytest_generate_tests(metafunc: pytest.Metafunc) -> None:
    if _PARAM_FIXTURES.isdisjoint(metafunc.fixturenames):
        return
    try:
        s = activate(metafunc.config)
    except pytest.UsageError:
        # left unparametrized: if the test is selected, _switch raises the error as a usage error
        # (here it would only be a collection error of this module, and a deselected test needs nothing)
        return
    if "perf_engine_name" in metafunc.fixturenames:
        kinds = getattr(metafunc.function, "perf_engine_kinds", None)
        names = [e for e in s.engines if kinds is None or s.profile.engines[e]["kind"] in kinds]
        metafunc.parametrize("perf_engine_name", names, ids=names, scope="session")
    if "perf_nccl_preset" in metafunc.fixturenames:
        presets = list(s.profile.nccl.get("presets", []))[1:]  # the first is the reference of the A/B
        ids = [f"{p}-vs-{s.profile.nccl['presets'][0]}" for p in presets]
        metafunc.parametrize("perf_nccl_preset", presets or [None], ids=ids or ["no-presets"])
    if "perf_nccl_concurrency" in metafunc.fixturenames:
        conc = list(s.profile.nccl.get("concurrency", [1]))
        metafunc.parametrize("perf_nccl_concurrency", conc, ids=[f"c{c}" for c in conc])
    if "perf_allreduce_tokens" in metafunc.fixturenames:
        toks = list(s.profile.allreduce.get("tokens", [1, 8, 32, 128])) if s.profile.allreduce else [None]
        metafunc.parametrize("perf_allreduce_tokens", toks, ids=[f"t{t}" if t else "none" for t in toks])
    if "perf_concurrency" in metafunc.fixturenames:
        conc = s.profile.throughput.concurrency if s.profile.throughput else (1,)
        metafunc.parametrize("perf_concurrency", list(conc), ids=[f"c{c}" for c in conc])


@pytest.hookimpl(trylast=True)  # after -m/-k deselection: only the selected tests decide
def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    s = _switch(config, items)
    if s is None:
        return
    if s.ab is None:
        # the A/B tests compare against a base only --perf-ab names; without it they are not part of the run
        ab_items = [i for i in items if i.get_closest_marker("ab") is not None]
        if ab_items:
            items[:] = [i for i in items if i.get_closest_marker("ab") is None]
            config.hook.pytest_deselected(items=ab_items)
            if not items and "ab" in str(config.getoption("markexpr", "") or "").replace("(", " ").split():
                raise pytest.UsageError("-m ab selects the same-run A/B tests, which need a base to compare "
                                        "against: add --perf-ab BASE (a profile variant, 'same' or git:REF)")
    need = s.profile.min_gpus if s.profile.hardware == "cuda" else 0
    missing = []
    if len(s.gpus) < need:
        missing.append(f"{need} CUDA GPU(s) (this machine has {len(s.gpus)})")
    m = s.profile.model
    if m.source == "path" and not s.model_override and not (Path(m.path or "") / "config.json").is_file():
        missing.append(f"model {m.name} at {m.path} (or --perf-model PATH)")
    if need and len(s.gpus) < need:
        from .machine import gpu_probe_error

        err = gpu_probe_error()
        if err:
            missing[0] += f"; {err}"
    from .missing import strict_reason

    strict = strict_reason(config)
    for item in items:
        if item.get_closest_marker("perf") is not None and missing:
            reason = f"profile {s.profile.name} needs " + " and ".join(missing)
            if strict is not None:
                # a run that asked for this profile (CI, or --perf-profile by name) must not pass as skips
                item.stash[MISSING_KEY] = f"{reason} [a failure, not a skip: {strict}]"
            else:
                item.add_marker(pytest.mark.skip(reason=reason))
        elif item.get_closest_marker("gpu") is not None and not s.gpus:
            item.add_marker(pytest.mark.skip(reason="needs a CUDA GPU; nvidia-smi lists none on this machine"))


MISSING_KEY = pytest.StashKey[str]()


def pytest_runtest_setup(item: pytest.Item) -> None:
    why = item.stash.get(MISSING_KEY, None)
    if why is not None:
        pytest.fail(why, pytrace=False)


# -- recording and gating -------------------------------------------------------------------------


def _finite(v: float) -> bool:
    return isinstance(v, (int, float)) and math.isfinite(v)


class PerfGate:
    """Per-test recorder: ``perf_gate.check(...)`` gates metrics against the stored baseline."""

    def __init__(self, session: PerfSession, node: pytest.Item) -> None:
        self.session = session
        self.node = node
        self.decisions: list[GateDecision] = []

    def key(self, *, scenario: str, engine: str, model: str, workload: str, concurrency: int) -> BaselineKey:
        return BaselineKey(scenario=scenario, engine=engine, model=model, hardware=self.session.hardware,
                           workload=workload, concurrency=concurrency)

    def check(
        self,
        *,
        scenario: str,
        engine: str,
        model: str,
        workload: str,
        concurrency: int,
        samples: Mapping[str, Sequence[float]],
        gated: Sequence[str],
        engine_version: str | None = None,
        extra: Mapping[str, Any] | None = None,
        fail: bool = True,
        confirm: Callable[[], Mapping[str, Sequence[float]]] | None = None,
        dependent: Collection[str] = (),
        decided: Sequence[GateDecision] = (),
    ) -> list[GateDecision]:
        """Gate ``samples`` against the stored baseline; raise :class:`PerfRegression` on a FAIL.

        ``confirm``: re-measures the same workload. When a gated metric FAILs, it is called once and
        the first and fresh samples are pooled (``stats.confirm_gate``): a FAIL must show in both
        measurements, and a first FAIL that does not repeat is a WARN with that reason. Shared CI
        runners have slowdowns that last tens of seconds (measured on a 2-core VM: single-stream decode
        at 11.4 tok/s for two repeats, then 16.6, same code), longer than one test's repeats, which no
        within-run statistic can see; a real regression shows in both measurements. The first
        measurement's samples and verdicts are kept in the run file.

        ``dependent``: gated metrics whose repeats are not independent samples (one deterministic
        decode read R times); gated as n=1 by magnitude (``stats.gate(independent=False)``).
        ``decided``: decisions the test made itself against a fixed bound (e.g. a same-run ratio's
        interval vs 1.0); recorded and reported with the others, FAIL raises, INCONCLUSIVE warns.
        """
        s = self.session
        for m in [*samples, *gated]:
            get_metric(m)  # unknown metric name: a KeyError that lists the known ones
        missing = [m for m in gated if m not in samples]
        if missing:
            raise ValueError(f"gated metric(s) {missing} were not measured")
        key = self.key(scenario=scenario, engine=engine, model=model, workload=workload, concurrency=concurrency)
        entry = s.store.get(key)
        # external reference figures (baselines provenance kind "external": typed in, not measured) leave
        # the gated list here and come back as REF decisions below, so they never trigger a confirming
        # re-measurement and never FAIL on magnitude (issue 16 item 2)
        refs = {m: entry.metrics[m] for m in gated if entry is not None and m in entry.metrics
                and entry.metrics[m].provenance is not None and entry.metrics[m].provenance.external}
        gated = [m for m in gated if m not in refs]

        def base_of(m: str) -> Sequence[float] | None:
            return entry.metrics[m].samples if entry is not None and m in entry.metrics else None

        def decide(smp: Mapping[str, Sequence[float]]) -> list[GateDecision]:
            return [gate(METRICS[m], base_of(m), smp[m], s.gate_config(m), independent=m not in dependent)
                    for m in gated]

        decisions = decide(samples)
        confirmed_from = None
        if confirm is not None and not s.update and any(d.verdict == "FAIL" for d in decisions):
            first = [d for d in decisions if d.verdict == "FAIL"]
            from .progress import log

            log(f"[{engine} c={concurrency}] {', '.join(d.metric for d in first)} FAIL on the first measurement "
                f"({'; '.join(d.message() for d in first)}); measuring again to confirm")
            confirmed_from = {"samples": {m: [float(v) for v in vals if _finite(v)] for m, vals in samples.items()},
                              "decisions": [asdict(d) for d in decisions]}
            again = confirm()
            missing = [m for m in gated if m not in again]
            if missing:
                raise ValueError(f"the confirming measurement did not measure gated metric(s) {missing}")
            # pooled, not replaced: the recorded samples are what the reported decision used
            decisions = [confirm_gate(METRICS[m], base_of(m), samples[m], again[m], s.gate_config(m),
                                      independent=m not in dependent) for m in gated]
            samples = {m: [*samples.get(m, []), *again.get(m, [])] for m in {**samples, **again}}
        if refs:
            from .stats import reference_comparison

            decisions += [reference_comparison(METRICS[m], r.samples, samples[m], source=r.provenance.source or "?",
                                               unknown=r.provenance.unknown or "?")
                          for m, r in refs.items()]
        if s.update:
            decisions = [replace(d, verdict="UPDATED", reason=f"recorded as baseline (was: {d.verdict}, {d.reason})")
                         for d in decisions]
            # a bound the test decided is no baseline: kept as decided, but nothing fails in update mode
            decisions += [replace(d, reason=f"{d.reason} (not raised: --perf-update-baselines)")
                          if d.verdict == "FAIL" else d for d in decided]
            decided = ()
        decisions = [*decisions, *decided]
        self.decisions += decisions
        if confirmed_from is not None:
            extra = {**(extra or {}), "first_measurement": confirmed_from}
        record = {
            "nodeid": self.node.nodeid, "key": key.as_dict(), "engine_version": engine_version,
            "baseline_engine_version": entry.engine_version if entry else None,
            "samples": {m: [float(v) for v in vals if _finite(v)] for m, vals in samples.items()},
            "decisions": [asdict(d) for d in decisions], "extra": dict(extra or {}), "time": time.time(),
        }
        if entry is not None:  # which run (or which external source) each baseline figure comes from
            record["baseline_provenance"] = {m: p.provenance.to_json() for m, p in entry.metrics.items()
                                             if p.provenance is not None}
        self.node.user_properties.append((PROP, json.dumps(record, default=str)))
        fails = [d for d in decisions if d.verdict == "FAIL"]
        for d in decisions:
            if d.verdict in ("WARN", "INCONCLUSIVE"):
                warnings.warn(PerfWarning(f"[{engine} c={concurrency}] {d.message()}"), stacklevel=2)
        if fails and fail and not s.update:
            ver = ""
            if entry is not None and entry.engine_version and engine_version and entry.engine_version != engine_version:
                ver = f" (engine version changed: baseline {entry.engine_version}, current {engine_version})"
            raise PerfRegression(
                f"performance regression in {scenario} [{engine}, c={concurrency}, {workload}]{ver}:\n  "
                + "\n  ".join(d.message() for d in fails))
        return decisions

    def check_ab(self, outcome: ABOutcome, *, scenario: str, engine: str, model: str,
                 extra: Mapping[str, Any] | None = None, fail: bool = True) -> list[ABDecision]:
        """Record a same-run A/B outcome (every pair, every decision) and gate it: a FAIL raises
        :class:`PerfRegression` naming metric, direction, base, candidate, interval and threshold; an
        INCONCLUSIVE verdict is a :class:`PerfWarning` with its interval, never a silent pass."""
        s = self.session
        probes = outcome.probes
        key = self.key(scenario=scenario, engine=engine, model=model,
                       workload="+".join(p.workload.key for p in probes) or scenario,
                       concurrency=max((p.workload.concurrency for p in probes), default=1))
        ab = {**outcome.to_json(), "base_spec": s.ab.describe() if s.ab else None}
        record = {
            "nodeid": self.node.nodeid, "key": key.as_dict(), "engine_version": outcome.versions.get("candidate"),
            "baseline_engine_version": outcome.versions.get("base"), "samples": {}, "decisions": [],
            "ab": ab, "extra": dict(extra or {}), "time": time.time(),
        }
        self.node.user_properties.append((PROP, json.dumps(record, default=str)))
        for d in outcome.decisions:
            if d.verdict == "INCONCLUSIVE":
                warnings.warn(PerfWarning(f"[A/B {engine} vs {outcome.base_label}] {d.message()}"), stacklevel=2)
        fails = [d for d in outcome.decisions if d.verdict == "FAIL"]
        if fails and fail:
            raise PerfRegression(
                f"performance regression in {scenario} [{engine}]: candidate ({outcome.candidate_label}) vs base "
                f"({outcome.base_label}), measured in this run, {outcome.blocks} blocks, {outcome.wall_s:.0f}s:\n  "
                + "\n  ".join(d.message() for d in fails))
        return list(outcome.decisions)


@pytest.fixture
def perf_gate(request: pytest.FixtureRequest) -> PerfGate:
    """Gate measured samples against ``baselines/<profile>.json`` (see :meth:`PerfGate.check`)."""
    return PerfGate(get_session(request.config), request.node)


@pytest.fixture(scope="session")
def perf_session(pytestconfig: pytest.Config) -> PerfSession:
    return get_session(pytestconfig)


class PerfCollector:
    """Registered on the controlling process only: turns reports into the summary, run file and
    baseline update. (On an xdist worker ``report.user_properties`` travel to the controller.)

    Registered before the session exists: the xdist controller collects nothing, so it builds the
    session from the first result a worker reports; a run without results never builds it."""

    def __init__(self, config: pytest.Config) -> None:
        self.config = config
        self.updated: tuple[Path, int] | None = None

    @property
    def s(self) -> PerfSession:
        return activate(self.config)

    def _active(self) -> bool:
        return self.config.stash.get(SESSION_KEY, None) is not None

    def pytest_runtest_logreport(self, report: pytest.TestReport) -> None:
        if report.when != "call":
            return
        cfg = self.config
        for name, value in report.user_properties:
            if name == PROP:
                rec = json.loads(value) if isinstance(value, str) else value
                rec["outcome"] = report.outcome
                self.s.results.append(rec)
                cfg.hook.pytest_perf_result(config=cfg, result=rec)

    def pytest_sessionfinish(self, session: pytest.Session, exitstatus: int) -> None:
        if not self._active():
            return
        s = self.s
        if not s.results:
            return
        from .report import write_reports

        minfo = machine_info(with_torch=False)
        session.config.hook.pytest_perf_update_machine_info(config=session.config, machine_info=minfo)
        commit = commit_info(s.rootdir)
        write_reports(s, minfo, commit)
        if s.history_path is not None:
            from .history import append_history, history_lines

            append_history(s.history_path, history_lines(s.results, profile=s.profile.name, hardware=s.hardware,
                                                         commit=commit, machine=minfo))
        if not s.update:
            return
        entries = entries_from_results(s.results, commit=commit, machine=minfo)
        if entries:
            self.updated = (s.store.write(entries), len(entries))

    def pytest_terminal_summary(self, terminalreporter: Any, exitstatus: int, config: pytest.Config) -> None:
        if not self._active():
            return
        s = self.s
        if not s.results:
            return
        from .report import AB_HEADERS, ab_detail_lines, ab_rows, summary_rows, text_table

        tr = terminalreporter
        tr.write_sep("=", f"kimi-perf summary: profile {s.profile.name}, hardware {s.hardware}, repeats {s.repeats}")
        rows, abr = summary_rows(s.results), ab_rows(s.results)
        if rows or not abr:
            for line in text_table(rows).splitlines():
                tr.write_line(line)
        if abr:
            tr.write_sep("-", "same-run A/B: candidate vs base, interleaved in this job")
            for line in [*text_table(abr, AB_HEADERS).splitlines(), *ab_detail_lines(s.results)]:
                tr.write_line(line)
        tr.write_line(f"report: {s.report_dir / 'summary.md'}  run file: {s.report_dir / 'run.json'}")
        if self.updated:
            tr.write_line(f"baselines updated: {self.updated[0]} ({self.updated[1]} entries)")
