"""scripts/gpu_lease.py: a background job that outlives the call that started it, waited on in
bounded calls, and collected into the folder a lease call returns."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path

SCRIPT = Path(__file__).resolve().parents[1] / "scripts" / "gpu_lease.py"


def _lease(root: Path, cwd: Path, *args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, str(SCRIPT), "--root", str(root), *args], cwd=cwd, capture_output=True,
                          text=True, timeout=60)


def test_a_job_runs_from_a_copy_of_the_tree_is_waited_on_and_collected(tmp_path):
    tree, root, out = tmp_path / "tree", tmp_path / "root", tmp_path / "out"
    (tree / ".git").mkdir(parents=True)
    (tree / "data.txt").write_text("input")
    r = _lease(root, tree, "start", "j", "--", "bash", "-c", "cat data.txt > result.txt; echo step one; sleep 1")
    assert r.returncode == 0, r.stderr
    assert not (root / "j" / "repo" / ".git").exists()  # version control is not copied
    again = _lease(root, tree, "start", "j", "--", "true")
    assert again.returncode == 2 and "already runs" in again.stdout
    w = _lease(root, tree, "wait", "j", "--max-s", "30", "--every", "0.5")
    assert w.returncode == 0 and "ended with exit 0" in w.stdout and "step one" in w.stdout
    c = _lease(root, tree, "collect", "j", str(out), "result.txt", "missing.json")
    assert c.returncode == 0 and "missing.json does not exist" in c.stdout
    assert (out / "j" / "result.txt").read_text() == "input" and "step one" in (out / "j" / "job.log").read_text()


def test_wait_is_bounded_and_reports_a_failed_job(tmp_path):
    tree, root = tmp_path / "tree", tmp_path / "root"
    tree.mkdir()
    assert _lease(root, tree, "start", "slow", "--", "sleep", "30").returncode == 0
    w = _lease(root, tree, "wait", "slow", "--max-s", "1", "--every", "0.5")
    assert w.returncode == 3 and "still running" in w.stdout
    pid = int(__import__("json").loads((root / "slow" / "state.json").read_text())["pid"])
    os.killpg(pid, signal.SIGTERM)
    assert _lease(root, tree, "start", "bad", "--", "bash", "-c", "echo boom; exit 4").returncode == 0
    w = _lease(root, tree, "wait", "bad", "--max-s", "30", "--every", "0.5")
    assert w.returncode == 1 and "exit 4" in w.stdout and "boom" in w.stdout
    assert _lease(root, tree, "status", "bad").returncode == 1
