"""scripts/h200_engine_ab.sh's matrix column, checked here before a lease spends device time on it.

Why a test of a shell script: the matrix job writes h200-matrix with its rows and engines cut to
MX_ROWS and MX_ENGINES, and a wrong choice (a row SGLang cannot capture, a column the profile has no
engine for) would otherwise surface minutes into a lease, after the staging calls. ``matrix-check``
writes the same profile and loads it as a run would; it also says which engine wheelhouses the column
needs, which decides the lease's staging calls.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def _check(**env: str) -> subprocess.CompletedProcess[str]:
    e = {k: v for k, v in os.environ.items() if not k.startswith("MX_")}
    return subprocess.run(["bash", "scripts/h200_engine_ab.sh", "matrix-check"], cwd=ROOT, text=True,
                          capture_output=True, env={**e, "PY": sys.executable, **env}, timeout=120)


def test_default_column_needs_only_the_model():
    r = _check()
    assert r.returncode == 0, r.stdout + r.stderr
    assert "engines: reference;" in r.stdout
    assert r.stdout.rstrip().endswith("wheelhouses to stage: model")


def test_engine_rows_and_columns_add_their_wheelhouses():
    r = _check(MX_ROWS="hf vllm vllm+offset1", MX_ENGINES="reference sglang")
    assert r.returncode == 0, r.stdout + r.stderr
    assert r.stdout.rstrip().endswith("wheelhouses to stage: model vllm sglang")


def test_a_row_sglang_cannot_capture_is_refused_with_its_fix():
    r = _check(MX_ROWS="hf sglang+offset1")
    assert r.returncode != 0
    assert "sglang+offset1" in r.stdout + r.stderr and "plant the offset on hf or reference" in r.stdout + r.stderr


def test_a_column_the_profile_has_no_engine_for_is_refused():
    r = _check(MX_ENGINES="trtllm")
    assert r.returncode != 0
    assert "trtllm" in r.stdout + r.stderr
