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


COMMON = SCRIPT.parent / "lease_common.sh"


def _sh(script: str, cwd: Path, **env: str) -> subprocess.CompletedProcess:
    """Run bash with scripts/lease_common.sh sourced, as the device scripts source it."""
    return subprocess.run(["bash", "-c", f'. "{COMMON}"; {script}'], cwd=cwd, capture_output=True, text=True,
                          timeout=60, env={**os.environ, **env})


def test_wait_is_cut_to_end_before_the_calls_limit(tmp_path):
    # the default, WAIT over it, and the cut: 600 s a call, 30 s to collect, what the script spent
    assert _sh("wait_s 500", tmp_path).stdout.split() == ["500"]
    assert _sh("wait_s 500", tmp_path, WAIT="20").stdout.split() == ["20"]
    assert _sh("SECONDS=400; wait_s 500", tmp_path).stdout.split() == ["170"]
    assert _sh("wait_s 500", tmp_path, CALL_S="100").stdout.split() == ["70"]
    assert _sh("SECONDS=590; wait_s 500", tmp_path).stdout.split() == ["5"]  # a late call still collects


def test_carry_advice_drops_carry_once_the_tree_and_a_part_fill_the_call(tmp_path):
    subprocess.run(["git", "init", "-q", str(tmp_path)], check=True)
    (tmp_path / ".gitignore").write_text(".whl/\n.carry/\n")
    (tmp_path / "tree.bin").write_bytes(b"\0" * (30 << 20))
    (tmp_path / ".whl").mkdir()
    (tmp_path / ".whl" / "part").write_bytes(b"\0" * (28 << 20))
    (tmp_path / ".carry").mkdir()
    (tmp_path / ".carry" / "COMMIT").write_text("abc\n")
    r = _sh("carry_advice", tmp_path)
    assert r.returncode == 0 and r.stdout.startswith('carry [".carry", ".whl"]'), r.stdout
    (tmp_path / ".carry" / "kcache").write_bytes(b"\0" * (8 << 20))  # 30 + 28 + 8 MiB: over 64
    r = _sh("carry_advice", tmp_path)
    assert r.returncode == 0 and r.stdout.startswith('carry [".whl"] only') and "would be 67 MiB" in r.stdout, r.stdout  # rounded up
    (tmp_path / "more.bin").write_bytes(b"\0" * (10 << 20))  # untracked, not ignored: it travels too
    r = _sh("carry_advice", tmp_path)
    assert r.returncode == 1 and "over 64 MiB even without .carry" in r.stderr, (r.stdout, r.stderr)


def test_part_size_leaves_room_for_the_tree_a_call_carries(tmp_path):
    """Wheelhouse parts are cut once and staged one a call beside the whole tree (64 MiB in all): the
    size prepare cuts follows the tree, at most the 28 MiB that ran so far, and refuses below 4 MiB."""
    subprocess.run(["git", "init", "-q", str(tmp_path)], check=True)
    (tmp_path / ".gitignore").write_text(".whl/\n")
    (tmp_path / ".whl").mkdir()
    (tmp_path / ".whl" / "old-part").write_bytes(b"\0" * (28 << 20))  # ignored: not the tree
    (tmp_path / "tree.bin").write_bytes(b"\0" * (28 << 20))
    assert _sh("part_size", tmp_path).stdout.strip() == "28M"
    (tmp_path / "bundle.xz").write_bytes(b"\0" * (14 << 20))  # a GPU drafter ships: 42 MiB and .gitignore
    assert _sh("part_size", tmp_path).stdout.strip() == "19M"
    (tmp_path / "more.bin").write_bytes(b"\0" * (18 << 20))  # 60 MiB
    r = _sh("part_size", tmp_path)
    assert r.returncode == 1 and "the tree is 60 MiB" in r.stderr, (r.stdout, r.stderr)
