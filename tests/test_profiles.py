"""Profile files: every shipped profile loads; mistakes are errors naming file, key and fix."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from kimi_perf.profiles import ProfileError, find_profile, load_profile

ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.parametrize("path", sorted((ROOT / "profiles").glob("*.json")), ids=lambda p: p.stem)
def test_shipped_profiles_load(path):
    prof = load_profile(path)
    assert prof.name == path.stem and prof.engines


def base():
    return json.loads((ROOT / "profiles" / "embedded-cpu.json").read_text())


@pytest.mark.parametrize("mutate, needle", [
    (lambda d: d.update(name="x"), "name"),
    (lambda d: d.update(colour="red"), "unknown key"),
    (lambda d: d["engines"]["reference"].update(kind="tgi"), "engines.reference.kind"),
    (lambda d: d.update(default_engines=["nope"]), "default_engines"),
    (lambda d: d["throughput"].update(concurrency=[0]), "throughput.concurrency"),
    (lambda d: d["throughput"]["workload"].update(input_lenght=3), "unknown workload field"),
    (lambda d: d["throughput"].update(gated_sweep=["speed"]), "unknown metric 'speed'"),
    (lambda d: d["gate"].update(floor=-1), "gate"),
    (lambda d: d.update(repeats=0), "repeats"),
    (lambda d: d["model"].update(source="hub"), "model.source"),
    (lambda d: d.update(nccl={"presets": ["default", "seed-pcie-tuned"], "min_ration": 1.0}), "unknown key(s) ['min_ration']"),
    (lambda d: d.update(nccl={"presets": ["default", "no-such-preset"]}), "nccl.presets"),
    (lambda d: d.update(nccl={"presets": ["default", "seed-pcie-tuned"], "engine": "sglang-typo"}), "nccl.engine"),
    (lambda d: d.update(nccl={"presets": ["default", "seed-pcie-tuned"], "concurrency": [0]}), "nccl.concurrency"),
])
def test_profile_errors(tmp_path, mutate, needle):
    d = base()
    mutate(d)
    p = tmp_path / "embedded-cpu.json"
    p.write_text(json.dumps(d))
    with pytest.raises(ProfileError) as ei:
        load_profile(p)
    assert str(p) in str(ei.value) and needle in str(ei.value)


def test_unknown_profile_lists_known():
    with pytest.raises(ProfileError, match="known profiles: .*embedded-cpu"):
        find_profile("nope", [ROOT / "profiles"])
