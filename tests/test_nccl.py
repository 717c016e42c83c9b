"""The all-reduce harness (kimi_perf.nccl) on CPUs: torchrun, 2 gloo ranks, the same code path the GPU
runs take with NCCL; preset environments reaching the ranks; failures and timeouts leaving nothing
behind."""

from __future__ import annotations

import os
import time
from pathlib import Path

import pytest

from kimi_perf.engines.presets import SAFETY_ENV
from kimi_perf.nccl import AllReduceError, AllReduceSpec, _table, compare_presets, run_allreduce

pytest.importorskip("torch")
pytestmark = pytest.mark.slow

SPEC = AllReduceSpec(tokens=(1, 8, 64), hidden=256, dtype="float32", iters=30, warmup=3, world_size=2,
                     backend="gloo")


def _ranks_running() -> list[int]:
    pids = []
    for d in Path("/proc").iterdir():
        if d.name.isdigit():
            try:
                cmd = (d / "cmdline").read_bytes().replace(b"\0", b" ")
            except OSError:
                continue
            if b"kimi_perf.nccl worker" in cmd and int(d.name) != os.getpid():
                pids.append(int(d.name))
    return pids


def test_two_gloo_ranks_measure_every_size(tmp_path):
    r = run_allreduce(SPEC, "seed-pcie-tuned", log_dir=tmp_path, timeout_s=120)
    assert [s.tokens for s in r.sizes] == [1, 8, 64]
    for s in r.sizes:
        assert s.bytes == s.tokens * 256 * 4
        assert 0 < s.us_p50 <= s.us_p99 and s.busbw_gb_s > 0
    # the preset and the multicast switches reached the ranks' environment
    assert r.env["NCCL_PROTO"] == "LL" and r.env["NCCL_ALGO"] == "Ring"
    assert all(r.env[k] == v for k, v in SAFETY_ENV.items())
    assert r.nccl_version is None and r.extra["devices"] == ["cpu"]


def test_presets_interleaved_and_tabled(tmp_path):
    res = compare_presets(SPEC, ["default", "ll-only"], 1, log_dir=tmp_path, timeout_s=120)
    assert "NCCL_PROTO" not in res["default"][0].env and res["ll-only"][0].env["NCCL_PROTO"] == "LL"
    table = _table(res)
    assert "default / ll-only p50" in table and len(table.splitlines()) == 2 + len(SPEC.tokens)


def test_failed_ranks_name_exit_code_and_log(tmp_path):
    # NCCL on a machine without a usable GPU: every rank fails at set_device / init
    spec = AllReduceSpec(tokens=(1,), hidden=8, world_size=2, backend="nccl", iters=1, warmup=0)
    with pytest.raises(AllReduceError) as ei:
        run_allreduce(spec, log_dir=tmp_path, timeout_s=120,
                      extra_env={"CUDA_VISIBLE_DEVICES": ""})
    msg = str(ei.value)
    assert "exited with code" in msg and str(tmp_path) in msg and "last log lines" in msg
    assert not _ranks_running()


def test_timeout_kills_every_rank(tmp_path):
    spec = AllReduceSpec(tokens=(1,), hidden=8, world_size=2, backend="gloo", iters=10_000_000, warmup=0)
    t0 = time.monotonic()
    with pytest.raises(AllReduceError, match="timed out after 6s"):
        run_allreduce(spec, log_dir=tmp_path, timeout_s=6)
    assert time.monotonic() - t0 < 30
    assert not _ranks_running()


@pytest.mark.parametrize("kw, needle", [
    ({"world_size": 1}, "world_size 1"),
    ({"tokens": ()}, "tokens ()"),
    ({"backend": "mpi"}, "backend 'mpi'"),
    ({"dtype": "int4"}, "dtype 'int4'"),
])
def test_spec_validation(kw, needle):
    with pytest.raises(ValueError, match=needle.replace("(", r"\(").replace(")", r"\)")):
        AllReduceSpec(**kw)


def test_profile_section_is_validated(tmp_path):
    import json

    from kimi_perf.profiles import ProfileError, load_profile

    prof = json.loads((Path(__file__).parents[1] / "profiles" / "h200x2-nccl.json").read_text())
    prof["name"] = "p"
    prof["allreduce"]["presets"] = ["default", "nope"]
    (tmp_path / "p.json").write_text(json.dumps(prof))
    with pytest.raises(ProfileError, match=r"allreduce.presets.*seed-pcie-tuned"):
        load_profile(tmp_path / "p.json")
