#!/usr/bin/env python3
"""Refuse commit subjects over 72 characters (the commit-msg hook in .pre-commit-config.yaml).

Why: issue 27 found a median subject of 189 characters; `git log --oneline`, GitHub's commit list and
`git shortlog` cut or wrap anything past ~72, so a long subject hides its point. The detail belongs in
the body (`git commit -m "subject" -m "body"`). Written by hand because it is ten lines of logic and a
hook package for it would be a dependency of its own.

    scripts/check_commit_msg.py MSG_FILE          # what git's commit-msg hook passes (.git/COMMIT_EDITMSG)
    scripts/check_commit_msg.py --range main..HEAD  # check commits already made (e.g. a branch before merging)

Exit 0 when every subject fits, 1 otherwise (each offender printed with its length and the fix).
"""

from __future__ import annotations

import argparse
import subprocess
import sys
from pathlib import Path

MAX_SUBJECT = 72


def subject_of(message: str) -> str:
    """The subject git shows: the first line that is neither empty nor a comment ('#', git's default
    core.commentChar; the hook sees the message before git strips comments)."""
    for line in message.splitlines():
        if line.startswith("#"):
            continue
        if line.strip():
            return line.rstrip()
    return ""


def problem(subject: str) -> str | None:
    if len(subject) <= MAX_SUBJECT:
        return None
    return (f"commit subject is {len(subject)} characters (at most {MAX_SUBJECT}): {subject[:MAX_SUBJECT]}... "
            "Fix: a short imperative subject, the detail in the body "
            '(git commit -m "subject" -m "body")')


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("msg_file", nargs="?", help="the commit message file git hands a commit-msg hook")
    ap.add_argument("--range", metavar="REVS", help="check the subjects of these commits, e.g. main..HEAD")
    args = ap.parse_args(argv)
    if bool(args.msg_file) == bool(args.range):
        ap.error("give a message file or --range REVS")
    if args.range:
        log = subprocess.run(["git", "log", "--format=%h %s", args.range], capture_output=True, text=True)
        if log.returncode != 0:
            print(log.stderr.strip(), file=sys.stderr)
            return 2
        subjects = [tuple(line.split(" ", 1)) for line in log.stdout.splitlines() if line]
    else:
        subjects = [("message", subject_of(Path(args.msg_file).read_text(encoding="utf-8", errors="replace")))]
    bad = [(ref, p) for ref, s in subjects if (p := problem(s))]
    for ref, p in bad:
        print(f"{ref}: {p}", file=sys.stderr)
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
