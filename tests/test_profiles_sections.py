"""The typed profile sections (kimi_perf.sections): parsed once at load, errors naming file, key and fix,
bools refused where numbers are expected, one default per key, a doc per field, and no raw-dict reads
of these sections left in the suite (issue 27: ``mismatch_min_accept_length`` 1.5 stood in three files).
"""

from __future__ import annotations

import dataclasses
import json
import re
from pathlib import Path

import pytest

from kimi_perf.profiles import ProfileError, load_profile
from kimi_perf.sections import (
    AlignmentSection,
    AllReduceSection,
    Eagle3Eval,
    Eagle3Section,
    NcclSection,
    SectionError,
    field_docs,
    parse_alignment,
    parse_allreduce,
    parse_eagle3,
    parse_nccl,
)

ROOT = Path(__file__).resolve().parents[1]
ENGINES = {"reference": {"kind": "reference"}, "vllm": {"kind": "vllm"}, "sglang": {"kind": "sglang"}}


def _write(tmp_path: Path, base: str, **sections: object) -> Path:
    raw = json.loads((ROOT / "profiles" / f"{base}.json").read_text())
    raw.update(sections)
    p = tmp_path / f"{base}.json"
    p.write_text(json.dumps(raw))
    return p


@pytest.mark.parametrize("section, value, key", [
    ("eagle3", {"steps": True}, "eagle3.steps"),
    ("eagle3", {"eval": {"prompts": True}}, "eagle3.eval.prompts"),
    ("eagle3", {"eval": {"min_speedup": False}}, "eagle3.eval.min_speedup"),
    ("eagle3", {"eval": {"code_prompts": True}}, "eagle3.eval.code_prompts"),
    ("alignment", {"prompts": True}, "alignment.prompts"),
    ("alignment", {"margin": True}, "alignment.margin"),
    ("nccl", {"presets": ["default", "seed-pcie-tuned"], "concurrency": [True]}, "nccl.concurrency"),
    ("nccl", {"presets": ["default", "seed-pcie-tuned"], "min_ratio": True}, "nccl.min_ratio"),
    ("allreduce", {"hidden": True}, "allreduce.hidden"),
    ("allreduce", {"world_size": True}, "allreduce.world_size"),
    ("allreduce", {"tokens": [1, True]}, "allreduce.tokens"),
])
def test_bools_are_refused_where_numbers_are_expected_naming_file_and_key(tmp_path, section, value, key):
    p = _write(tmp_path, "embedded-cpu", **{section: value})
    with pytest.raises(ProfileError, match=rf"profile {re.escape(str(p))}: {re.escape(key)}: .*Fix: "):
        load_profile(p)


@pytest.mark.parametrize("section, value, match", [
    ("nccl", {"presets": ["default", "seed-pcie-tuned"], "min_ration": 1.0}, r"nccl: unknown key\(s\) \['min_ration'\]"),
    ("allreduce", {"backend": "gloo"}, r"allreduce: unknown key\(s\) \['backend'\]"),
    ("allreduce", {"preferred": "ll-only"}, r"allreduce.preferred: 'll-only' is not one of the compared presets"),
    ("eagle3", {"matrix": {"rows": ["hf"], "engines": ["sglang-x"]}}, r"eagle3.matrix: engines must be"),
    ("eagle3", {"recipe": ["data"]}, r"eagle3.recipe: must be an object"),
    ("eagle3", {"eval": {"code_prompts": -1}}, r"eagle3.eval.code_prompts"),
    ("eagle3", {"eval": {"code_prompts": 2.5}}, r"eagle3.eval.code_prompts"),
    ("eagle3", {"eval": {"mismatch_max_accept_ratio": "none"}}, r"eagle3.eval.mismatch_max_accept_ratio"),
    # a bundle name with a typo: the load fails before any server starts, listing what ships
    ("eagle3", {"serve": "c6777fd6e43c3e90-002c71e6c1a8"}, r"eagle3.serve: 'c6777fd6e43c3e90-002c71e6c1a8' is not a "
                                                           r"drafter bundle shipped in .*shipped_drafters"),
    ("eagle3", {"serve": 3}, r"eagle3.serve: 3 is not a drafter bundle"),
    # a warm start from a bundle that does not ship: refused at load, before any data is made
    ("eagle3", {"recipe": {"train": {"init_from": "nope"}}},
     r"eagle3.recipe.train.init_from: 'nope' is not a drafter bundle shipped in .*shipped_drafters"),
])
def test_section_errors_name_the_key_and_the_fix(tmp_path, section, value, match):
    with pytest.raises(ProfileError, match=match + ".*Fix: "):
        load_profile(_write(tmp_path, "embedded-cpu", **{section: value}))


def test_a_retired_bundle_may_be_a_warm_starts_parent_but_is_not_served():
    from kimi_perf.eagle3.shipped import retired

    parent = next(iter(retired()))
    e = parse_eagle3({"recipe": {"train": {"init_from": parent}}}, ENGINES)
    assert e.recipe["train"]["init_from"] == parent
    with pytest.raises(SectionError, match=rf"eagle3.serve: '{parent}' is not a drafter bundle shipped"):
        parse_eagle3({"serve": parent}, ENGINES)


def test_a_mistyped_served_bundle_lists_the_shipped_ones():
    with pytest.raises(SectionError, match=r"Fix: name one of \[.*'c6777fd6e43c3e90-002c71e6c1a8-03d0b33f6cff-2272382829dc'"):
        parse_eagle3({"serve": "c6777fd6e43c3e90-002c71e6c1a8"}, ENGINES)
    e = parse_eagle3({"serve": "c6777fd6e43c3e90-002c71e6c1a8-03d0b33f6cff-2272382829dc"}, ENGINES)
    assert e.serve_tag == "002c71e6c1a8" and Eagle3Section().serve is None


def test_sections_are_typed_with_their_defaults_from_one_place():
    e = parse_eagle3({"engine": "vllm"}, ENGINES)
    assert isinstance(e, Eagle3Section) and e.engines == ("vllm",) and e.eval == Eagle3Eval()
    assert e.steps == 3 and e.eval.mismatch_min_accept_length == 1.5 and e.gated == ("accept_length", "accept_rate_pos0")
    assert e.matrix is None and e.recipe is None
    # null is the one non-number a collapse ratio takes: measured and reported, not asserted
    assert e.eval.mismatch_max_accept_ratio == 0.6
    assert parse_eagle3({"eval": {"mismatch_max_accept_ratio": None}}, ENGINES).eval.mismatch_max_accept_ratio is None
    with pytest.raises(ValueError, match="no eagle3.recipe"):
        e.drafter_recipe()
    assert parse_alignment(None, ENGINES) == AlignmentSection() == parse_alignment({}, ENGINES)
    assert parse_nccl(None, ENGINES) is None and parse_allreduce({}) is None
    n = parse_nccl({"presets": ["default", "seed-pcie-tuned"]}, ENGINES)
    assert n == NcclSection(presets=("default", "seed-pcie-tuned")) and n.reference == "default"
    a = parse_allreduce({"presets": ["default", "seed-pcie-tuned", "ll-only"], "world_size": 4})
    assert a.preferred_preset == "seed-pcie-tuned" and a.spec(4).tokens == AllReduceSection().tokens
    # frozen: a test cannot change the profile another test reads
    with pytest.raises(dataclasses.FrozenInstanceError):
        e.steps = 4  # type: ignore[misc]
    with pytest.raises(TypeError):
        parse_eagle3({"recipe": {"data": {"max_train_items": 1}}}, ENGINES).recipe["data"]["x"] = 1  # type: ignore[index]


def test_shipped_profiles_parse_into_the_sections_they_declare():
    kimi = load_profile(ROOT / "profiles" / "kimi-k2.5-int4-8x-rtx-pro-6000.json")
    assert kimi.nccl == NcclSection(presets=("default", "seed-pcie-tuned"), engine="vllm", concurrency=(1, 128),
                                    min_ratio=1.0)
    assert kimi.allreduce.world_size == 8 and kimi.allreduce.presets[-1] == "ll-only"
    assert kimi.eagle3.engine == "sglang" and kimi.eagle3.eval.prompts == 25
    cpu = load_profile(ROOT / "profiles" / "embedded-cpu.json")
    assert cpu.eagle3.matrix is not None and cpu.eagle3.matrix.engines == ("reference", "vllm")
    assert cpu.alignment.prompts == 3 and cpu.nccl is None and cpu.allreduce is None


def test_a_gpu_profile_without_a_reference_engine_is_parametrized(tmp_path):
    """alignment.engines defaults to ["reference"], which the kimi and llama profiles do not define: the
    planted test's SGLang filter raised KeyError 'reference' while collecting test_engine_alignment.py."""
    from types import SimpleNamespace

    from kimi_perf import plugin

    prof = load_profile(ROOT / "profiles" / "llama-3.1-8b-1xh100.json")
    cfg = SimpleNamespace(stash={}, getoption=lambda name: None)
    cfg.stash[plugin.SESSION_KEY] = SimpleNamespace(profile=prof, engines=("sglang",), config=cfg)
    calls = []
    mf = SimpleNamespace(fixturenames=["align_engine", "planted_engine", "decode_engine"], config=cfg,
                         parametrize=lambda name, values, ids=None: calls.append((name, ids)))
    plugin.pytest_generate_tests(mf)
    assert calls == [("align_engine", ["none"]), ("planted_engine", ["none"]), ("decode_engine", ["none"])]


@pytest.mark.parametrize("cls", [Eagle3Section, Eagle3Eval, AlignmentSection, NcclSection, AllReduceSection])
def test_every_field_has_a_type_a_default_and_a_doc(cls):
    """What the JSON Schema and the profile reference are generated from (issue 25 item 2)."""
    docs = field_docs(cls)
    assert [d["name"] for d in docs] == [f.name for f in dataclasses.fields(cls)]
    for d in docs:
        assert d["doc"] and d["type"] and d["default"] != "(required)", d
    json.dumps(docs)  # machine-readable as it is


def test_the_matrix_fields_are_documented_under_their_json_keys():
    from kimi_perf.eagle3.matrix import MatrixPlan

    docs = {d["name"]: d for d in field_docs(MatrixPlan)}
    assert list(docs) == ["rows", "engines", "ci.rows", "ci.engines", "accept_tolerance", "retrain_seeds", "cosine_only"]
    assert all(d["doc"] for d in docs.values())
    assert docs["accept_tolerance"]["default"] == 0.08 and docs["ci.rows"]["default"] == "rows"
    assert docs["rows"]["default"] == "(required)"


def test_no_raw_dict_reads_of_the_typed_sections():
    pat = re.compile(r"""profile\.(eagle3|alignment|nccl|allreduce)\.get\(|\.(eagle3|alignment)\.get\("|"""
                     r"""\b(prof|raw|profile)\[["'](eagle3|alignment|nccl|allreduce)["']\]""")
    hits = []
    for folder in ("kimi_perf", "fixtures", "perf_tests", "tests"):
        for p in sorted((ROOT / folder).rglob("*.py")):
            rel = p.relative_to(ROOT).as_posix()
            if rel == "tests/test_profiles_sections.py":
                continue
            # writes (a test making a broken profile file) are not reads
            hits += [f"{rel}:{i}: {line.strip()}" for i, line in enumerate(p.read_text().splitlines(), 1)
                     if pat.search(line) and not re.search(r"\]\s*=[^=]", line)]
    assert not hits, "raw-dict reads of typed profile sections (read the attributes):\n" + "\n".join(hits)
