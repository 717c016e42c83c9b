"""Same-run A/B gate: base and candidate measured in one job, interleaved, decided on an interval.

Why a package of its own: a stored baseline recorded on another host cannot tell a 10% regression from
the machine (CPU VMs differ by 35%+ on one commit, H200 hosts by 12-27%), so the merge verdict comes
from a comparison made side by side. ``config`` reads the profile's policy and variants, ``base``
resolves what ``--perf-ab`` names, ``gitref`` checks a git base out as a worktree, ``runner`` runs the
ABBA schedule and ``decide`` turns pair ratios into PASS / FAIL / INCONCLUSIVE. Nothing here imports
torch or an engine, so ``--collect-only`` stays fast.
"""
