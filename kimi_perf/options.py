"""What kimi-perf declares to pytest: the ``--perf-*`` options, their ini fallbacks and the markers.

Split out of :mod:`kimi_perf.plugin` so the option table (the one place the defaults live) reads on its
own and the session builder can resolve an option without importing the hook module.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

MARKERS = {
    "perf": "performance measurement gated against stored baselines (starts engines)",
    "alignment": "hidden-state agreement between an extraction path and an inference path",
    "eagle": "EAGLE-3 drafter acceptance and speedup",
    "gpu": "needs a CUDA GPU (skipped with a reason when none is visible)",
    "ab": "same-run A/B against the base named by --perf-ab (deselected without it)",
    "matrix": "the full EAGLE-3 extraction-path x serving-engine matrix, ~25 CPU minutes (deselected unless -m names it)",
    "matrix_noise": "the matrix tolerance vs retraining noise: own-features drafters x training seeds, ~18 CPU minutes "
                    "(deselected unless -m names it)",
    "traffic": "realistic traffic: goodput under the profile's latency SLOs over a request-rate sweep and its "
               "knee, prefix caching on shared-prefix prompts (deselected unless -m names it)",
}
# markers whose tests run only when the -m expression names them (long experiments, not merge gates)
OPT_IN_MARKERS = ("matrix", "matrix_noise", "traffic")


_INI: list[tuple[str, str, str]] = [
    ("perf_profile", "profile name (profiles/<name>.json) or path", "embedded-cpu"),
    ("perf_engine", "engine name(s) of the profile, comma-separated, 'default' or 'all'", "default"),
    ("perf_repeats", "measured repeats per point; 0 = the profile's value", "0"),
    ("perf_report_dir", "directory for the summary, run file, plots and server logs", "perf-report"),
    ("perf_baseline_dir", "directory of baselines/<profile>.json", "baselines"),
    ("perf_server_timeout", "seconds a server may take to become ready", "600"),
    # history stays out of the tracked tree by default: appended there it dirtied every checkout that ran
    # the gate and was lost with an ephemeral runner's workspace anyway (issue 25 item 4)
    ("perf_history_dir", "directory of <profile>.jsonl run histories ('' = <perf_report_dir>/history, 'off' = none)",
     ""),
]
# bounds of the numeric options, inclusive: --perf-server-timeout=-5 or a repeats count with extra digits
# was accepted and the run then failed late or never ended (checked where the session is built)
OPTION_BOUNDS = {"perf_repeats": (0, 100), "perf_server_timeout": (1.0, 86_400.0)}
# the one place the defaults live: addini gets them and every --perf-* help text quotes them from here
_DEFAULT = {name: default for name, _, default in _INI}
DEFAULT_ENGINES_HELP = "'default' = the profile's default_engines"


def _ini_help(name: str, default: str | None = None) -> str:
    return f"ini: {name}; default {default if default is not None else _DEFAULT[name]}"



def add_options(parser: pytest.Parser) -> None:
    """The body of the plugin's ``pytest_addoption``: the ``--perf-*`` group and its ini values."""
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
                help="use this EAGLE-3 drafter instead of the profile's recipe: a checkpoint folder or a shipped "
                     "bundle's (kimi_perf/eagle3/shipped_drafters/NAME, written out once into the cache)")
    g.addoption("--perf-train-drafter", action="store_true", default=False,
                help="train the profile's EAGLE-3 drafter recipe through the cached pipeline even when a drafter "
                     "shipped with kimi-perf matches it (recipe digests, target fingerprint, file hashes) or the "
                     "profile's eagle3.serve names another bundle; CI passes it so training stays tested. Without it "
                     "eagle3.serve's bundle, else a matching shipped drafter is served. The reduced matrix's row "
                     "drafters are served when shipped either way")
    g.addoption("--perf-vllm-python", default=None, metavar="PATH",
                help="python interpreter of the environment that has vLLM (env KIMI_PERF_VLLM_PYTHON; default "
                     ".venv-vllm/bin/python when scripts/setup.sh --full made it)")
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
                     "'python -m kimi_perf.history'; 'off' disables it (ini: perf_history_dir; default "
                     "<perf-report-dir>/history, outside the tracked tree: name a kept directory to keep history "
                     "across runs)")
    g.addoption("--perf-url", default=None, metavar="URL",
                help="measure the OpenAI-compatible server already running at URL (scheme://host[:port]) instead of "
                     "launching the profile's engine; name its engine with --perf-engine NAME (baselines key on it); "
                     "tests that need a launch of their own skip with the reason")
    g.addoption("--perf-tokenizer", default=None, metavar="DIR",
                help="with --perf-url: the served model's tokenizer directory, for the token-id prompts (default: "
                     "the profile's model)")
    g.addoption("--perf-api-key-env", default=None, metavar="NAME",
                help="with --perf-url: environment variable holding a bearer token for the endpoint (default "
                     "KIMI_PERF_API_KEY; unset = no Authorization header)")
    g.addoption("--perf-served-model", default=None, metavar="NAME",
                help="with --perf-url: the model name to request (default: the first one /v1/models lists)")
    g.addoption("--perf-strict", action="store_true", default=False,
                help="fail a test whose gate verdict is WARN or INCONCLUSIVE (default: they warn and pass): for CI "
                     "that must not merge on an unresolved measurement")
    for name, help_, default in _INI:
        parser.addini(name, help_, default=default)


def _opt(config: pytest.Config, name: str) -> Any:
    v = config.getoption("--" + name.replace("_", "-"))
    return v if v is not None else config.getini(name)


def check_rootdir(config: pytest.Config) -> None:
    """Refuse a run whose rootdir pytest took from a ``--perf-*`` option's value.

    Why: pytest finds its rootdir and ini file before it loads plugins from entry points, so in
    ``--perf-report-dir /tmp/out`` the value looks like a test path; when it exists outside the
    repository, pytest roots the run at it (or at a common ancestor) and reads no
    ``[tool.pytest.ini_options]``: no markers, no ``--strict-markers``, and ``baselines/`` resolved under
    the wrong directory (a gate with no baselines, every verdict NEW). ``--perf-report-dir=/tmp/out`` (one
    token) is parsed after the plugin loads. Only refused where the invocation directory has a pytest
    configuration that was missed, so a repository without one is not bothered."""
    missed = None if config.inipath is not None else _pytest_config_above(config.invocation_params.dir)
    if missed is None:
        return
    args = [str(a) for a in config.invocation_params.args]
    for opt, val in zip(args, args[1:]):
        if not opt.startswith("--perf-") or "=" in opt or val.startswith("-"):
            continue
        p = (config.invocation_params.dir / val).resolve()
        if p.exists() and p.is_relative_to(config.rootpath):
            raise pytest.UsageError(
                f"pytest took the value of {opt} ({val}) for a test path and made {config.rootpath} its rootdir, "
                f"so it read no pytest configuration (markers, addopts, the perf_* ini defaults; this directory "
                f"has {missed}). Fix: write {opt}={val} as one "
                "argument, or pass --rootdir=. (or -c pyproject.toml)")


def _pytest_config_above(start: Path) -> Path | None:
    """The pytest configuration file pytest would have found from ``start`` upwards, if any."""
    for d in (start, *start.parents):
        if (d / "pytest.ini").is_file():
            return d / "pytest.ini"
        pp = d / "pyproject.toml"
        if pp.is_file() and "[tool.pytest.ini_options]" in pp.read_text(errors="replace"):
            return pp
    return None
