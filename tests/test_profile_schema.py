"""The profile format as data (kimi_perf.profile_schema): the shipped JSON Schema and docs/profiles.md
are what the parser's classes generate, every profile in the repository validates against the schema,
and the ``python -m kimi_perf.profiles`` commands work."""

from __future__ import annotations

import dataclasses
import json
import subprocess
import sys
from pathlib import Path

import pytest

from kimi_perf import profile_schema as ps

ROOT = Path(__file__).resolve().parents[1]
REGEN = "python -m kimi_perf.profiles schema > kimi_perf/profile.schema.json; python -m kimi_perf.profiles docs > docs/profiles.md"


def test_the_shipped_schema_and_reference_page_are_generated_from_the_parser():
    assert json.loads((ROOT / "kimi_perf" / ps.SCHEMA_NAME).read_text()) == ps.schema(), f"regenerate: {REGEN}"
    assert (ROOT / ps.DOCS_PATH).read_text() == ps.markdown(), f"regenerate: {REGEN}"


def test_every_field_has_a_one_line_doc():
    from kimi_perf.ab.config import ABSpec
    from kimi_perf.load.slo import SLOSpec
    from kimi_perf.load.workload import Workload

    for cls, docs in ((ABSpec, ps.AB), (SLOSpec, ps.SLO), (Workload, ps.WORKLOAD)):
        missing = {f.name for f in dataclasses.fields(cls)} - set(docs) - {"name"}
        assert not missing, f"{cls.__name__} fields without a doc in kimi_perf/profile_schema.py: {sorted(missing)}"

    def walk(p, where):
        assert p.get("description"), f"{where} has no description"
        for k, sub in (p.get("properties") or {}).items():
            walk(sub, f"{where}.{k}")

    for k, p in ps.schema()["properties"].items():
        walk(p, k)


def _validator():
    jsonschema = pytest.importorskip("jsonschema", reason="jsonschema is in the dev extras (scripts/setup.sh)")
    s = ps.schema()
    jsonschema.Draft202012Validator.check_schema(s)
    return jsonschema.Draft202012Validator(s)


@pytest.mark.parametrize("path", sorted((ROOT / "profiles").glob("*.json")), ids=lambda p: p.stem)
def test_every_profile_validates_against_the_schema(path):
    errs = [f"{list(e.absolute_path)}: {e.message}" for e in _validator().iter_errors(json.loads(path.read_text()))]
    assert not errs, errs


def test_the_schema_refuses_what_the_parser_refuses():
    v = _validator()
    good = json.loads((ROOT / "profiles" / "embedded-cpu.json").read_text())
    for change in ({"unknown_key": 1}, {"repeats": True}, {"hardware": "tpu"},
                   {"engines": {"x": {"kind": "tgi"}}}, {"engines": {"x": {"kind": "vllm", "no_such_knob": 1}}},
                   {"ab": {**good["ab"], "blocks_per_launch": "2"}}):
        assert list(v.iter_errors({**good, **change})), f"schema accepted {change}"


def _cli(*args, cwd=ROOT):
    return subprocess.run([sys.executable, "-m", "kimi_perf.profiles", *args], cwd=cwd, capture_output=True, text=True,
                          timeout=120)


def test_check_new_and_a_bad_profile_pointing_at_the_reference(tmp_path):
    from kimi_perf.models.dummy import ensure_dummy_model
    from kimi_perf.profiles import DUMMY_SHAPES

    r = _cli("check", str(ROOT / "profiles" / "embedded-cpu.json"))
    assert r.returncode == 0 and "ok" in r.stdout
    bad = tmp_path / "bad.json"
    bad.write_text(json.dumps({"name": "bad", "hardware": "cpu", "model": {"source": "embedded"},
                               "engines": {"reference": {"kind": "reference"}}, "repeats": True}))
    r = _cli("check", str(bad))
    assert r.returncode == 1 and "repeats" in r.stderr and "docs/profiles.md" in r.stderr, r.stderr
    model = ensure_dummy_model("tiny-llama", DUMMY_SHAPES["tiny-llama"])
    out = tmp_path / "profiles" / "mine.json"
    r = _cli("new", "--model", str(model), "--name", "mine", "--out", str(out))
    assert r.returncode == 0, r.stderr
    assert _cli("check", str(out)).returncode == 0
    assert not list(_validator().iter_errors(json.loads(out.read_text())))
    assert _cli("new", "--model", str(model), "--name", "mine", "--out", str(out)).returncode != 0  # no overwrite
