"""scripts/setup.sh's command line: only what runs without installing anything (syntax, --help, a bad
argument). Building the venvs is measured by hand (docs/results.md, "Setup"), not here: it takes minutes and PyPI."""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

import pytest

SCRIPT = Path(__file__).resolve().parent.parent / "scripts" / "setup.sh"
BASH = shutil.which("bash")
pytestmark = pytest.mark.skipif(BASH is None, reason="no bash on PATH")


def _run(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([BASH, str(SCRIPT), *args], capture_output=True, text=True, timeout=30,
                          stdin=subprocess.DEVNULL)


def test_syntax() -> None:
    r = subprocess.run([BASH, "-n", str(SCRIPT)], capture_output=True, text=True, timeout=30)
    assert r.returncode == 0, r.stderr


@pytest.mark.parametrize("flag", ["--help", "-h"])
def test_help_prints_usage(flag: str) -> None:
    r = _run(flag)
    assert r.returncode == 0, r.stderr
    assert r.stdout.startswith("usage: scripts/setup.sh [--full | --help]")
    for word in ("--full", "KIMI_PERF_SKIP_VLLM=1", "KIMI_PERF_SKIP_SGLANG_PARSER=1", "KIMI_PERF_TORCH",
                 "KIMI_PERF_VENV", "PYTHON="):
        assert word in r.stdout
    assert "[setup" not in r.stdout  # nothing was set up


@pytest.mark.parametrize("args", [["--bogus"], ["full"], ["--full", "--full"], ["--full", "extra"], [""]])
def test_bad_arguments_exit_2_with_usage(args: list[str]) -> None:
    r = _run(*args)
    assert r.returncode == 2
    assert "unknown argument" in r.stderr
    assert "usage: scripts/setup.sh" in r.stderr
    assert "[setup" not in r.stdout + r.stderr


def test_ci_runs_the_readme_test_command() -> None:
    """The README's second command is what .ci/run runs (its setup and its pytest arguments), so the
    newcomer's test command and CI cannot drift apart; the first is the main job on the default scope."""
    root = SCRIPT.parent.parent
    cmds = [ln.strip() for ln in (root / "README.md").read_text().splitlines()[:20] if ln.startswith("    ")]
    main_job, tests = cmds[0], cmds[1]
    assert main_job == "./scripts/setup.sh && .venv/bin/python -m pytest -m perf"
    setup, _, pytest_cmd = tests.partition(" && ")
    ci = (root / ".ci" / "run").read_text()
    assert f"\n{setup}\n" in ci, f".ci/run does not run the README's setup {setup!r}"
    assert f"\n{pytest_cmd} " in ci, f".ci/run does not run the README's test command {pytest_cmd!r}"
