"""GPU discovery must tell "no GPU" from "a broken driver" (issue: silent paths)."""

from __future__ import annotations

import os
import stat

from kimi_perf.machine import gpu_info, gpu_probe_error


def _fake_smi(tmp_path, body: str):
    exe = tmp_path / "nvidia-smi"
    exe.write_text("#!/bin/sh\n" + body + "\n")
    exe.chmod(exe.stat().st_mode | stat.S_IEXEC)
    return str(tmp_path)


def test_failing_nvidia_smi_is_reported(tmp_path, monkeypatch):
    monkeypatch.setenv("PATH", _fake_smi(tmp_path, 'echo "NVIDIA-SMI has failed because it couldn\'t '
                                                   'communicate with the NVIDIA driver" >&2; exit 9')
                       + os.pathsep + os.environ["PATH"])
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    assert gpu_info() == []
    err = gpu_probe_error()
    assert err is not None and "exit code 9" in err and "communicate with the NVIDIA driver" in err


def test_working_nvidia_smi_lists_gpus_and_no_error(tmp_path, monkeypatch):
    monkeypatch.setenv("PATH", _fake_smi(tmp_path, 'echo "NVIDIA H200, 580.1, 143771 MiB"')
                       + os.pathsep + os.environ["PATH"])
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    assert gpu_info() == [{"name": "NVIDIA H200", "driver": "580.1", "memory": "143771 MiB"}]
    assert gpu_probe_error() is None
