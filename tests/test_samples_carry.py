"""Samples packed on one GPU lease and unpacked on the next (kimi_perf.eagle3.carry): nothing lost,
nothing doubled, broken parts refused, and the parts respect what a device call can bring back."""

from __future__ import annotations

import json
import random
from dataclasses import asdict
from pathlib import Path

import pytest

from kimi_perf.eagle3.carry import CarryError, _cli, pack, unpack
from kimi_perf.eagle3.data import Sample, read_samples


def _write(path: Path, samples: list[Sample], torn: bytes = b"") -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(b"".join((json.dumps(asdict(s)) + "\n").encode() for s in samples) + torn)


def _samples(n: int, seed: int = 0, start: int = 0) -> list[Sample]:
    rng = random.Random(seed)
    return [Sample(id=f"src-{i}-t1", source="src", split="train" if i % 4 else "heldout",
                   prompt_ids=[1, 9690, 198] + [rng.randrange(49152) for _ in range(rng.randrange(5, 60))],
                   response_ids=[rng.randrange(49152) for _ in range(rng.randrange(1, 80))], finish_reason="length")
            for i in range(start, start + n)]


def _cache_file(root: Path) -> Path:
    return root / "eagle3" / "a114c67ab3aea404" / "gen-f1b48ad24963" / "samples.jsonl"


def test_pack_then_unpack_restores_every_sample_at_the_cache_place(tmp_path):
    src = _cache_file(tmp_path / "device-cache")
    _write(src, _samples(300), torn=b'{"id": "half')  # a call killed mid-write leaves a torn line
    m = pack(src, tmp_path / "out", part_mib=0.02)
    assert m["samples"] == 300 and m["cache_tail"] == "eagle3/a114c67ab3aea404/gen-f1b48ad24963/samples.jsonl"
    assert len(m["parts"]) > 1 and all(p["bytes"] <= 0.02 * 2**20 for p in m["parts"])
    assert sum(p["samples"] for p in m["parts"]) == 300
    here = tmp_path / "next-lease-cache"
    assert unpack([tmp_path / "out"], cache=here) == {str(_cache_file(here)): 300}
    assert read_samples(_cache_file(here)) == read_samples(src)
    # unpacking again adds nothing: a sample is never doubled
    assert unpack([tmp_path / "out"], cache=here) == {str(_cache_file(here)): 0}


def test_only_new_brings_back_what_a_call_added_and_unpack_merges(tmp_path):
    src = _cache_file(tmp_path / "c")
    _write(src, _samples(50))
    pack(src, tmp_path / "call1")
    _write(src, _samples(80))  # the next call generated 30 more (the first 50 are the same)
    m = pack(src, tmp_path / "call2", only_new=[tmp_path / "call1"])
    assert m["samples"] == 30 and m["skipped_as_packed"] == 50
    dest = tmp_path / "merged.jsonl"
    _write(dest, _samples(10))  # the destination already holds some
    assert unpack([tmp_path / "call1", tmp_path / "call2"], into=dest) == {str(dest): 70}
    assert sorted(read_samples(dest)) == sorted(s.id for s in _samples(80))


def test_broken_parts_and_oversized_packs_are_refused_with_the_fix(tmp_path):
    src = _cache_file(tmp_path / "c")
    _write(src, _samples(200))
    pack(src, tmp_path / "out", part_mib=0.01)
    part = tmp_path / "out" / "samples-000.jsonl.xz"
    part.write_bytes(part.read_bytes()[:-1] + b"\0")
    dest = tmp_path / "d.jsonl"
    with pytest.raises(CarryError, match="sha256 differs.*fetch it again"):
        unpack([tmp_path / "out"], into=dest)
    assert not dest.exists()  # nothing written before every part checked out
    with pytest.raises(CarryError, match="over --max-parts 2.*--only-new"):
        pack(src, tmp_path / "out2", part_mib=0.01, max_parts=2)
    outside = tmp_path / "loose.jsonl"
    _write(outside, _samples(3))
    pack(outside, tmp_path / "loose")
    with pytest.raises(CarryError, match="outside a kimi-perf cache; pass --into"):
        unpack([tmp_path / "loose"], cache=tmp_path)


def test_cli(tmp_path, capsys):
    src = _cache_file(tmp_path / "c")
    _write(src, _samples(20))
    assert _cli(["pack", str(src), "--out", str(tmp_path / "o")]) == 0
    assert _cli(["unpack", str(tmp_path / "o"), "--cache", str(tmp_path / "n")]) == 0
    assert len(read_samples(_cache_file(tmp_path / "n"))) == 20
    assert _cli(["unpack", str(tmp_path / "missing")]) == 2
    assert "no MANIFEST.json" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        _cli(["pack", str(src), "--out", str(tmp_path / "o"), "--part-mib", "0"])
