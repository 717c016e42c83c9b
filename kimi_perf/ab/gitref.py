"""``--perf-ab git:REF``: this repository at another commit, checked out beside the candidate.

Why a worktree in the cache and not a second clone: the merge gate's question is "did this change make
the reference engine slower?", so the base must be the same repository at the merge base, run on the
same machine in the same job. ``git worktree add --detach`` gives that commit's files without touching
the candidate's checkout, shares the object store (no network, seconds), and is reused across runs
keyed by the commit id. Only the *server* runs from the worktree (its ``kimi_perf`` first on
``PYTHONPATH``); the load client, the statistics and the report are always the candidate's, so both
sides are measured by the same code.

A ref that does not resolve, and a shallow clone that lacks it (CI checkouts often have depth 1), are
configuration errors that say how to fix them, raised before any server starts.
"""

from __future__ import annotations

import shutil
import subprocess
from dataclasses import dataclass
from pathlib import Path

from .config import ABConfigError

__all__ = ["GitBase", "ensure_worktree", "resolve_ref"]


@dataclass(frozen=True)
class GitBase:
    ref: str  # as the user wrote it (HEAD~1, origin/main, a sha)
    sha: str
    subject: str
    repo: Path


def _git(repo: Path, *args: str, check: bool = True) -> subprocess.CompletedProcess[str]:
    try:
        return subprocess.run(["git", "-C", str(repo), *args], capture_output=True, text=True, timeout=120,
                              check=check)
    except FileNotFoundError:
        raise ABConfigError("--perf-ab git:REF needs the git command; install git or compare against a "
                            "profile variant instead") from None
    except subprocess.CalledProcessError as e:
        raise ABConfigError(f"git {' '.join(args)} failed in {repo}: {(e.stderr or e.stdout).strip()[-400:]}") from None


def resolve_ref(repo: Path, ref: str) -> GitBase:
    """Resolve ``ref`` to a commit of ``repo``; errors name the fix (shallow clone, typo, not a repo)."""
    if not ref:
        raise ABConfigError("--perf-ab git: needs a ref after 'git:', e.g. git:HEAD~1 or git:origin/main")
    inside = _git(repo, "rev-parse", "--is-inside-work-tree", check=False)
    if inside.returncode != 0 or inside.stdout.strip() != "true":
        raise ABConfigError(f"--perf-ab git:{ref}: {repo} is not a git checkout, so there is no commit to "
                            "compare against; run from a clone, or use --perf-ab with a profile variant")
    r = _git(repo, "rev-parse", "--verify", "--quiet", f"{ref}^{{commit}}", check=False)
    if r.returncode != 0 or not r.stdout.strip():
        shallow = _git(repo, "rev-parse", "--is-shallow-repository", check=False).stdout.strip() == "true"
        if shallow:
            raise ABConfigError(
                f"--perf-ab git:{ref}: this clone is shallow and does not contain {ref}. Fix: fetch the history "
                f"the base needs (git fetch --deepen=1 for HEAD~1, or git fetch --unshallow), or check out "
                f"with fetch-depth 0 in CI")
        raise ABConfigError(f"--perf-ab git:{ref}: {ref!r} does not name a commit of {repo} "
                            "(git rev-parse --verify failed). Fix: check the spelling, or git fetch the branch")
    sha = r.stdout.strip()
    subject = _git(repo, "show", "-s", "--format=%s", sha, check=False).stdout.strip()
    return GitBase(ref=ref, sha=sha, subject=subject, repo=repo)


def ensure_worktree(base: GitBase, cache_dir: Path) -> Path:
    """A detached worktree of ``base.sha`` under ``cache_dir/ab-worktrees/``, created once and reused.

    A leftover directory that is not a worktree at that commit (an interrupted earlier run) is removed
    and created again."""
    from ..models.embedded import file_lock

    root = cache_dir / "ab-worktrees"
    path = root / base.sha[:16]
    with file_lock(root / f".{base.sha[:16]}.lock", what=f"git worktree of {base.sha[:12]}"):
        if path.exists():
            head = _git(path, "rev-parse", "HEAD", check=False)
            if head.returncode == 0 and head.stdout.strip() == base.sha and (path / "kimi_perf").is_dir():
                return path
            shutil.rmtree(path, ignore_errors=True)
            _git(base.repo, "worktree", "prune", check=False)
        root.mkdir(parents=True, exist_ok=True)
        _git(base.repo, "worktree", "add", "--detach", "--force", str(path), base.sha)
        if not (path / "kimi_perf" / "engines" / "reference" / "server.py").is_file():
            raise ABConfigError(f"--perf-ab git:{base.ref} ({base.sha[:12]}) has no reference engine "
                                "(kimi_perf/engines/reference/server.py): compare against a newer commit")
    return path
