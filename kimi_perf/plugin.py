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

The pieces live beside this module, which keeps the hooks and the ``perf_gate``/``perf_session``
fixtures (and re-exports the names other modules import from here): :mod:`kimi_perf.options` (the
``--perf-*`` options, ini table, markers), :mod:`kimi_perf.session` (:class:`PerfSession`, building and
activating it), :mod:`kimi_perf.recorder` (:class:`PerfGate`: recording and verdicts in the test) and
:mod:`kimi_perf.collector` (:class:`PerfCollector`: run file, history, baseline update, summary).

Nothing here imports torch or an engine.
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

from .collector import PerfCollector
from .options import (
    _DEFAULT,
    _INI,
    DEFAULT_ENGINES_HELP,
    MARKERS,
    OPT_IN_MARKERS,
    _ini_help,
    _opt,
    add_options,
    check_rootdir,
)
from .recorder import PROP, PerfGate, PerfRegression, PerfWarning, _finite, unresolved_verdicts
from .sections import NcclSection
from .session import (
    _PARAM_FIXTURES,
    _SESSION_FIXTURES,
    SESSION_KEY,
    SIGNAL_KEY,
    PerfSession,
    _build_session,
    _switch,
    activate,
    end_session_on_signals,
    get_session,
    needs_session,
    server_affine_order,
    session_for_params,
)

# the names other modules (fixtures/, perf_tests/, tests/) import from the registered plugin module
__all__ = [
    "DEFAULT_ENGINES_HELP", "MARKERS", "MISSING_KEY", "PROP", "SESSION_KEY", "PerfCollector", "PerfGate",
    "PerfRegression", "PerfSession", "PerfWarning", "_DEFAULT", "_INI", "_SESSION_FIXTURES", "_build_session",
    "_finite", "_ini_help", "_opt", "activate", "get_session", "needs_session", "perf_gate", "perf_session",
    "session_for_params",
]


def pytest_addhooks(pluginmanager: pytest.PytestPluginManager) -> None:
    from . import hookspecs

    pluginmanager.add_hookspecs(hookspecs)


def pytest_addoption(parser: pytest.Parser) -> None:
    add_options(parser)


# -- configure ------------------------------------------------------------------------------------


def pytest_configure(config: pytest.Config) -> None:
    for name, desc in MARKERS.items():
        config.addinivalue_line("markers", f"{name}: {desc}")
    if config.option.help or config.option.version:
        return  # --help must work even where the default profile does not exist
    check_rootdir(config)
    # nothing is loaded here: the session is built by activate() when a selected test needs it
    if not hasattr(config, "workerinput"):
        config.pluginmanager.register(PerfCollector(config), "kimi-perf-collector")
    _install_progress_sink(config)
    from .workers import check_workers

    check_workers(config)  # -n under a cuda profile: a GPU slice per worker, or refused


def pytest_report_header(config: pytest.Config) -> list[str]:
    from .workers import header_lines

    return header_lines(config)


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
    def unsink() -> None:  # set_sink returns the previous sink; a cleanup returns nothing
        progress.set_sink(None)

    config.add_cleanup(unsink)


def pytest_report_collectionfinish(config: pytest.Config) -> list[str]:
    # after "collected N items", not in the header: the session exists only once a collected test needed it
    s = config.stash.get(SESSION_KEY, None)
    if s is None:
        return []
    base = f"{len(s.store.entries)} entries" if s.store.path.exists() else "none yet"
    return [f"kimi-perf: profile {s.profile.name} ({s.profile.hardware}), engines {','.join(s.engines)}, "
            f"repeats {s.repeats}, hardware {s.hardware}, baselines {s.store.path.name} ({base})"
            + (", UPDATING baselines" if s.update else "")] + (
        [f"kimi-perf A/B: candidate = this checkout, base = {s.ab.label}; threshold {s.profile.ab.describe_thresholds()}, "
         f"blocks {s.profile.ab.min_blocks}-{s.profile.ab.max_blocks} x {s.profile.ab.describe_repeats()}"
         + f", {s.profile.ab.launch_schedule}"] if s.ab else [])


def pytest_generate_tests(metafunc: pytest.Metafunc) -> None:
    if _PARAM_FIXTURES.isdisjoint(metafunc.fixturenames):
        return
    s = session_for_params(metafunc.config)
    if s is None:
        return
    if "perf_engine_name" in metafunc.fixturenames:
        kinds = getattr(metafunc.function, "perf_engine_kinds", None)
        names = [e for e in s.engines if kinds is None or s.profile.engines[e]["kind"] in kinds]
        metafunc.parametrize("perf_engine_name", names, ids=names, scope="session")
    nc = s.profile.nccl
    if "perf_nccl_preset" in metafunc.fixturenames:
        presets = list(nc.presets[1:]) if nc else []  # the first is the reference of the A/B
        ids = [f"{p}-vs-{nc.reference}" for p in presets] if nc else []
        metafunc.parametrize("perf_nccl_preset", presets or [None], ids=ids or ["no-presets"])
    if "perf_nccl_concurrency" in metafunc.fixturenames:
        nconc = list(nc.concurrency if nc else NcclSection.concurrency)
        metafunc.parametrize("perf_nccl_concurrency", nconc, ids=[f"c{c}" for c in nconc])
    if "perf_allreduce_tokens" in metafunc.fixturenames:
        toks = list(s.profile.allreduce.tokens) if s.profile.allreduce else [None]
        metafunc.parametrize("perf_allreduce_tokens", toks, ids=[f"t{t}" if t else "none" for t in toks])
    if "perf_concurrency" in metafunc.fixturenames:
        conc = s.profile.throughput.concurrency if s.profile.throughput else (1,)
        metafunc.parametrize("perf_concurrency", list(conc), ids=[f"c{c}" for c in conc])
    _parametrize_spec_engines(metafunc, s)


def _parametrize_engines(metafunc: pytest.Metafunc, argname: str, names: list[str], why: str) -> None:
    """Parametrize ``argname`` by engine name (test ids ``[engine]``); with none selected, one skipped
    case carrying the reason, so the report says why instead of pytest's bare "empty parameter set"."""
    if names:
        metafunc.parametrize(argname, names, ids=names)
    else:
        metafunc.parametrize(argname, [pytest.param(None, marks=pytest.mark.skip(reason=why))], ids=["none"])


def _parametrize_spec_engines(metafunc: pytest.Metafunc, s: PerfSession) -> None:
    """The EAGLE-3 and alignment tests' engines: ``eagle3_engine`` from ``eagle3.engines``,
    ``align_engine`` from ``alignment.engines`` (``planted_engine``: its SGLang engines), ``decode_engine``
    every vLLM engine of the profile; each narrowed to what --perf-engine selected."""
    from .alignment.plan import selected_engines

    p, names = s.profile, metafunc.fixturenames
    kind = {e: str(raw.get("kind")) for e, raw in p.engines.items()}
    if "eagle3_engine" in names:
        if p.eagle3 is None:
            _parametrize_engines(metafunc, "eagle3_engine", [], f"profile {p.name} has no eagle3 section")
        else:
            _parametrize_engines(metafunc, "eagle3_engine", *selected_engines(p.eagle3.engines, s.engines,
                                                                                "eagle3.engines"))
    listed = p.alignment.engines
    if "align_engine" in names:
        _parametrize_engines(metafunc, "align_engine", *selected_engines(listed, s.engines, "alignment.engines"))
    if "planted_engine" in names:
        # kind.get: alignment.engines defaults to ["reference"], which a GPU-only profile may not define
        sg = [e for e in listed if kind.get(e) == "sglang"]
        _parametrize_engines(metafunc, "planted_engine",
                             *selected_engines(sg, s.engines, "alignment.engines (SGLang engines)"))
    if "decode_engine" in names:
        # every vLLM engine of the profile: the capture is test_alignment.py's too (no extra launch)
        vl = [e for e in p.engines if kind[e] == "vllm"]
        _parametrize_engines(metafunc, "decode_engine", *selected_engines(vl, s.engines, "engines (vLLM engines)"))


def _markexpr_names(config: pytest.Config) -> set[str]:
    """The words of the ``-m`` expression (marker names, and/or/not), for "did the run name marker X"."""
    return set(str(config.getoption("markexpr", "") or "").replace("(", " ").split())


def _deselect_marked(config: pytest.Config, items: list[pytest.Item], marker: str) -> bool:
    """Remove the suite's items carrying ``marker`` (reported as deselected); whether there were any. A
    host repository's own test with a marker of that name is not the suite's and stays."""
    gone = [i for i in items if i.get_closest_marker(marker) is not None and needs_session(i)]
    if gone:
        items[:] = [i for i in items if i not in gone]
        config.hook.pytest_deselected(items=gone)
    return bool(gone)


@pytest.hookimpl(trylast=True)  # after -m/-k deselection: only the selected tests decide
def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    s = _switch(config, items)
    if s is None:
        return
    named = _markexpr_names(config)
    # experiments run on purpose, not part of a merge gate: the full extraction-path matrix trains ~6
    # drafters (~25 CPU minutes; its reduced version is not marked), its retraining-noise check 4 more
    # (~18 CPU minutes); each runs only when -m names its marker
    for marker in OPT_IN_MARKERS:
        if marker not in named:
            _deselect_marked(config, items, marker)
    # the A/B tests compare against a base only --perf-ab names; without it they are not part of the run
    if s.ab is None and _deselect_marked(config, items, "ab") and not items and "ab" in named:
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
        if not needs_session(item):
            continue  # not the suite's test (a host repository's own perf/gpu marker): left alone
        if item.get_closest_marker("perf") is not None and missing:
            reason = f"profile {s.profile.name} needs " + " and ".join(missing)
            if strict is not None:
                # a run that asked for this profile (CI, or --perf-profile by name) must not pass as skips
                item.stash[MISSING_KEY] = f"{reason} [a failure, not a skip: {strict}]"
            else:
                item.add_marker(pytest.mark.skip(reason=reason))
        elif item.get_closest_marker("gpu") is not None and not s.gpus:
            item.add_marker(pytest.mark.skip(reason="needs a CUDA GPU; nvidia-smi lists none on this machine"))
    items[:] = server_affine_order(items, s.engines)
    end_session_on_signals(config)


@pytest.hookimpl(trylast=True)
def pytest_sessionfinish(session: pytest.Session, exitstatus: int) -> None:
    signum = session.config.stash.get(SIGNAL_KEY, 0)
    if signum:
        # pytest returns session.exitstatus as set after this hook: 2 (interrupted) would hide the signal
        session.exitstatus = 128 + signum


MISSING_KEY = pytest.StashKey[str]()


def pytest_runtest_setup(item: pytest.Item) -> None:
    from .results import begin_capture

    begin_capture()  # the repeats this test measures, for perf_gate's per-request records
    why = item.stash.get(MISSING_KEY, None)
    if why is not None:
        pytest.fail(why, pytrace=False)


def pytest_runtest_teardown(item: pytest.Item) -> None:
    from .results import end_capture

    end_capture()


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item: pytest.Item, call: pytest.CallInfo[None]):  # type: ignore[no-untyped-def]
    """``--perf-strict``: a passed test whose recorded verdicts include WARN or INCONCLUSIVE fails,
    with them listed. Decided here, from the records the test attached, so every way a test gates
    (``check``, ``check_ab``, ``fail=False`` with its own assertion) is covered alike."""
    outcome = yield
    rep = outcome.get_result()
    cfg = item.config
    if rep.when != "call" or not rep.passed or not cfg.getoption("perf_strict", False):
        return
    if cfg.getoption("perf_update_baselines", False):
        return  # recording baselines: nothing fails on a verdict (they read UPDATED)
    soft = unresolved_verdicts(item.user_properties)
    if soft:
        rep.outcome = "failed"
        rep.longrepr = ("kimi-perf --perf-strict: verdicts that are not a PASS fail this run:\n  " + "\n  ".join(soft)
                        + "\n(without --perf-strict they are warnings; more repeats can resolve them)")


# -- fixtures -------------------------------------------------------------------------------------


@pytest.fixture
def perf_gate(request: pytest.FixtureRequest) -> PerfGate:
    """Gate measured samples against ``baselines/<profile>.json`` (see :meth:`PerfGate.check`)."""
    return PerfGate(get_session(request.config).gate_context(), request.node)


@pytest.fixture(scope="session")
def perf_session(pytestconfig: pytest.Config) -> PerfSession:
    return get_session(pytestconfig)
