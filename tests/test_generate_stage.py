"""The drafter recipe's data stage on its own (``python -m kimi_perf.eagle3.generate``), end to end
with the real reference engine on the embedded model: it launches the recipe's generator, makes the
missing samples, stops the server and packs what it made; a second call finds nothing to do.

Why end to end: the stage exists for device calls that start bare, so what matters is that the
launch, the cache place and the pack agree with what ``carry unpack`` and the pipeline read."""

from __future__ import annotations

import json

import pytest
from engine_helpers import embedded_path

from kimi_perf.eagle3.carry import unpack
from kimi_perf.eagle3.data import read_samples
from kimi_perf.eagle3.generate import _cli, run

pytestmark = pytest.mark.slow


def _profile(tmp_path, **data):
    recipe = {"data": {"sources": ["mtbench"], "max_train_items": 3, "max_heldout_items": 1, "max_new_tokens": 4,
                       "multi_turn": False, "concurrency": 2, **data}}
    p = tmp_path / "tiny.json"
    p.write_text(json.dumps({"engines": {"reference": {"kind": "reference", "dtype": "float32", "device": "cpu"},
                                         "vllm": {"kind": "vllm"}},
                             "eagle3": {"recipe": recipe}}))
    return p


def test_the_data_stage_generates_packs_and_resumes(tmp_path, monkeypatch):
    from kimi_perf.models.embedded import cache_root

    model = embedded_path()
    data = cache_root() / "data"  # the prompt data setup fetched (python -m kimi_perf.data fetch)
    for c in ("cache", "cache2"):
        (tmp_path / c).mkdir()
        (tmp_path / c / "data").symlink_to(data)
    monkeypatch.setenv("KIMI_PERF_CACHE", str(tmp_path / "cache"))
    prof = _profile(tmp_path)
    s = run(str(prof), model_dir=model, log_dir=tmp_path / "logs", pack_dir=tmp_path / "pack")
    assert s["made"] == s["wanted"] == s["present"] >= 3 and s["made_response_tokens"] > 0
    assert s["pack"]["samples"] == s["made"]
    assert str(tmp_path / "cache") in s["samples_path"]
    # the next lease: unpacked into a fresh cache, the stage finds everything there and launches nothing
    monkeypatch.setenv("KIMI_PERF_CACHE", str(tmp_path / "cache2"))
    unpack([tmp_path / "pack"])
    again = run(str(prof), model_dir=model, log_dir=tmp_path / "logs2")
    assert again["made"] == 0 and again["present"] == s["wanted"] and not (tmp_path / "logs2").exists()
    assert read_samples(tmp_path / "cache2" / s["samples_path"].split("/cache/", 1)[1]).keys() == \
        read_samples(tmp_path / "cache" / s["samples_path"].split("/cache/", 1)[1]).keys()


def test_a_generator_without_token_id_generate_is_refused(tmp_path, capsys):
    with pytest.raises(SystemExit, match=r"eagle3.recipe.data.generator 'vllm' is a vllm engine, which has no "
                                         r"/generate taking token ids; use the reference engine or SGLang"):
        run(str(_profile(tmp_path, generator="vllm")), model_dir=tmp_path)
    with pytest.raises(SystemExit):
        _cli(["--profile", "x", "--max-s", "0"])
    assert "--max-s must be > 0" in capsys.readouterr().err
