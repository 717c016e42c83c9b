"""scripts/check_commit_msg.py, the commit-msg hook of .pre-commit-config.yaml: subjects over 72
characters are refused with the fix, comments and blank lines before the subject are not the subject,
and --range checks commits already made."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

SCRIPT = Path(__file__).resolve().parent.parent / "scripts" / "check_commit_msg.py"


def _check(*args: str, cwd: Path | None = None) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, str(SCRIPT), *args], capture_output=True, text=True, cwd=cwd)


@pytest.mark.parametrize("message,ok", [
    ("x" * 72 + "\n\nbody " + "y" * 300 + "\n", True),  # 72 is allowed; a long body is the point
    ("x" * 73 + "\n", False),
    ("# Please enter the commit message\n\n" + "x" * 60 + "\n# " + "z" * 100 + "\n", True),  # comments skipped
    ("\n\n" + "x" * 90 + "\n", False),  # leading blank lines are not the subject
])
def test_message_file(tmp_path, message, ok):
    f = tmp_path / "COMMIT_EDITMSG"
    f.write_text(message)
    r = _check(str(f))
    assert (r.returncode == 0) == ok, r.stderr
    if not ok:
        assert "at most 72" in r.stderr and 'git commit -m "subject" -m "body"' in r.stderr


def test_range_names_each_long_subject(tmp_path):
    def git(*a: str) -> None:
        subprocess.run(["git", "-c", "user.name=t", "-c", "user.email=t@t", *a], cwd=tmp_path, check=True,
                       capture_output=True)

    git("init", "-q")
    for i, subject in enumerate(["short one", "L" * 80, "another short"]):
        (tmp_path / f"f{i}").write_text(str(i))
        git("add", ".")
        git("commit", "-q", "-m", subject)
    r = _check("--range", "HEAD~2..HEAD", cwd=tmp_path)
    assert r.returncode == 1 and r.stderr.count("at most 72") == 1 and "80 characters" in r.stderr
    assert _check("--range", "HEAD~1..HEAD", cwd=tmp_path).returncode == 0
    assert _check("--range", "nosuchref..HEAD", cwd=tmp_path).returncode == 2
