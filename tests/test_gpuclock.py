"""kimi_perf.gpuclock against a stand-in ``nvidia-smi`` that prints what the real one prints in loop
mode: the sampler must keep the GPUs the servers see, stamp lines as they arrive, and cut a repeat's
window from them; without nvidia-smi it must not exist at all."""

from __future__ import annotations

import os
import sys
import time
from pathlib import Path

import pytest

from kimi_perf.gpuclock import GpuClocks, visible_gpus

# prints two GPUs per loop as `--query-gpu=index,clocks.sm,power.draw --format=csv,noheader,nounits`
# does; GPU 1's clock alternates and its power is not supported, as on some boards
FAKE = """#!{py}
import sys, time
ms = int([a for a in sys.argv if a.startswith("--loop-ms=")][0].split("=")[1])
i = 0
while True:
    print("0, 1980, 120.5", flush=True)
    print(f"1, {{1410 if i % 2 else 1200}}, [N/A]", flush=True)
    i += 1
    time.sleep(ms / 1000)
"""


def fake_smi(tmp_path: Path) -> Path:
    p = tmp_path / "nvidia-smi"
    p.write_text(FAKE.format(py=sys.executable))
    p.chmod(0o755)
    return p


def _wait_for(clocks: GpuClocks, t0: float, key: str, timeout: float = 10.0) -> dict[str, float]:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        w = clocks.window(t0, time.monotonic())
        if key in w:
            return w
        time.sleep(0.05)
    raise AssertionError(f"no {key} sample within {timeout}s")


def test_the_window_holds_the_medians_of_the_gpus_the_servers_see(tmp_path):
    t0 = time.monotonic()
    clocks = GpuClocks.start(exe=str(fake_smi(tmp_path)), interval_ms=20, gpus=[0])
    assert clocks is not None
    try:
        w = _wait_for(clocks, t0, "gpu_sm_clock_mhz")
        assert w == {"gpu_sm_clock_mhz": 1980.0, "gpu_power_w": 120.5}
        # a window before any sample arrived is empty, not zero
        assert clocks.window(t0 - 10, t0 - 5) == {}
    finally:
        clocks.close()
    t0 = time.monotonic()
    other = GpuClocks.start(exe=str(fake_smi(tmp_path)), interval_ms=20, gpus=[1])
    assert other is not None
    try:
        time.sleep(0.3)
        w = _wait_for(other, t0, "gpu_sm_clock_mhz")
        assert 1200.0 <= w["gpu_sm_clock_mhz"] <= 1410.0
        assert "gpu_power_w" not in w  # "[N/A]" is no number
    finally:
        other.close()


def test_no_nvidia_smi_means_no_sampler(monkeypatch, tmp_path):
    monkeypatch.setenv("PATH", str(tmp_path))
    assert GpuClocks.start() is None
    assert GpuClocks.start(exe=str(tmp_path / "missing")) is None


@pytest.mark.parametrize("env,want", [({}, None), ({"CUDA_VISIBLE_DEVICES": ""}, None),
                                      ({"CUDA_VISIBLE_DEVICES": "0,3"}, (0, 3)),
                                      ({"CUDA_VISIBLE_DEVICES": "GPU-8f1c2a"}, None)])
def test_visible_gpus_reads_numeric_cuda_visible_devices_only(env, want):
    assert visible_gpus(env) == want


def test_an_ab_records_each_repeats_clock_where_nvidia_smi_answers(tmp_path, monkeypatch):
    """Through the A/B runner: every measured repeat of both sides carries the clock and power."""
    from test_ab_gate import FakeSide, _probes, _prompts

    from kimi_perf.ab.config import ABSpec
    from kimi_perf.ab.runner import run_ab

    bindir = tmp_path / "bin"
    bindir.mkdir()
    fake_smi(bindir)
    monkeypatch.setenv("PATH", f"{bindir}{os.pathsep}{os.environ['PATH']}")
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "0")
    spec = ABSpec(threshold=0.5, min_blocks=2, max_blocks=2, repeats_per_block=1, blocks_per_launch=0)
    out = run_ab(FakeSide("base", tmp_path), FakeSide("candidate", tmp_path), _probes(), spec, _prompts)
    assert out.pairs
    for p in out.pairs:
        for side in (p.base, p.candidate):
            assert side.get("gpu_sm_clock_mhz") == 1980.0 and side.get("gpu_power_w") == 120.5
