"""Run results as data (kimi_perf.results): per-request JSONL written beside run.json by a real run,
loaded into DataFrames, exported to Bencher BMF and github-action-benchmark JSON that validate against
schemas written from the formats' public docs."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from kimi_perf.metrics import METRICS
from kimi_perf.results import GAB_FILES, RunResults, _cli, ab_table, export, to_bencher, to_gab

ROOT = Path(__file__).resolve().parents[1]
FAKE = str(Path(__file__).with_name("fake_server.py"))

# https://bencher.dev/bmf.json (Bencher Metric Format reference page, schema as published)
BMF_SCHEMA = {
    "$schema": "http://json-schema.org/draft-07/schema", "type": "object",
    "patternProperties": {".+": {"type": "object", "patternProperties": {".+": {
        "type": "object", "required": ["value"],
        "properties": {"value": {"type": "number"}, "lower_value": {"type": "number"},
                       "upper_value": {"type": "number"}}}}}},
}
# github-action-benchmark, README "Examples" (custom tools) and src/extract.ts's BenchmarkResult:
# {name: string; value: number; unit: string; range?: string; extra?: string}; the file is a list
GAB_SCHEMA = {
    "$schema": "http://json-schema.org/draft-07/schema", "type": "array",
    "items": {"type": "object", "required": ["name", "unit", "value"], "additionalProperties": False,
              "properties": {"name": {"type": "string", "minLength": 1}, "unit": {"type": "string"},
                             "value": {"type": "number"}, "range": {"type": "string"}, "extra": {"type": "string"}}},
}


def _validate(doc, schema) -> None:
    """jsonschema where it is installed; else the same rules checked by hand."""
    try:
        import jsonschema
    except ImportError:
        if schema is BMF_SCHEMA:
            assert isinstance(doc, dict)
            for bench, measures in doc.items():
                assert bench and isinstance(measures, dict)
                for name, m in measures.items():
                    assert name and isinstance(m, dict) and "value" in m
                    assert all(isinstance(m[k], (int, float)) for k in m if k in ("value", "lower_value", "upper_value"))
        else:
            assert isinstance(doc, list)
            for e in doc:
                assert set(e) <= {"name", "unit", "value", "range", "extra"} and {"name", "unit", "value"} <= set(e)
                assert isinstance(e["value"], (int, float)) and all(isinstance(e.get(k, ""), str)
                                                                     for k in ("name", "unit", "range", "extra"))
        return
    jsonschema.validate(doc, schema)


def test_the_schemas_reject_what_the_formats_reject():
    """The validation can fail: a value given as a string, a missing value, an unknown key."""
    pytest.importorskip("jsonschema")
    import jsonschema

    for bad, schema in (({"b": {"m": {"value": "1"}}}, BMF_SCHEMA), ({"b": {"m": {"lower_value": 1.0}}}, BMF_SCHEMA),
                        ([{"name": "x", "unit": "ms"}], GAB_SCHEMA),
                        ([{"name": "x", "unit": "ms", "value": 1, "range": 3}], GAB_SCHEMA),
                        ([{"name": "x", "unit": "ms", "value": 1, "direction": "lower"}], GAB_SCHEMA)):
        with pytest.raises(jsonschema.ValidationError):
            jsonschema.validate(bad, schema)


CONFTEST = f'''
import sys
import pytest
pytest_plugins = ["kimi_perf.plugin"]

@pytest.fixture(scope="session")
def fake(tmp_path_factory):
    from kimi_perf.bench import RunningServer
    from kimi_perf.launcher import LaunchSpec, ServerProcess
    spec = LaunchSpec(name="fake", argv_for_port=lambda p: [sys.executable, {FAKE!r}, str(p), "sse"],
                      ready_timeout_s=30, log_dir=tmp_path_factory.mktemp("logs"))
    with ServerProcess(spec) as srv:
        yield RunningServer(name="reference", kind="fake", base_url=srv.base_url, model="m", process=srv, config=None)
'''

TEST = '''
import pytest
from kimi_perf.bench import measure, samples_of
from kimi_perf.load.workload import Workload

W = Workload(name="tiny", input_len=4, output_len=16, num_prompts=3, concurrency=2, warmup=0)
M = ["output_throughput", "tpot_ms_p50", "ttft_ms_p50"]

@pytest.mark.perf
def test_tiny(perf_gate, fake):
    def run():
        s = samples_of(measure(fake, W, lambda w, i: [[1 + i, 2, 3, 4]] * w.num_prompts, 3), M)
        # pinned: the fake server's speed swings by 2x between repeats, and it is not what is tested here
        s["output_throughput"] = [100.0, 100.1, 99.9]
        return s

    first = run()
    if {dip}:  # the first measurement's numbers collapse: the gate re-measures to confirm
        first["output_throughput"] = [1.0, 1.0, 1.0]
    perf_gate.check(scenario="tiny", engine="reference", model="m", workload="tiny-1", concurrency=2,
                    samples=first, gated=["output_throughput"], engine_version="0.0-fake", confirm=run)
'''


@pytest.fixture(scope="module")
def run_dir(tmp_path_factory):
    """A real report directory: a baseline run, then a run whose first measurement FAILs and is
    re-measured (the confirm path), against the fake SSE server; returns the report dir of the second."""
    pt = tmp_path_factory.mktemp("proj")
    (pt / "profiles").mkdir()
    (pt / "profiles" / "toy.json").write_text(json.dumps({
        "name": "toy", "description": "toy", "hardware": "cpu", "model": {"source": "embedded", "name": "m"},
        "engines": {"reference": {"kind": "reference"}}, "repeats": 3, "gate": {"floor": 0.5}}))
    (pt / "conftest.py").write_text(CONFTEST)
    (pt / "pytest.ini").write_text("[pytest]\naddopts = --strict-markers -p no:cacheprovider\n")
    import os
    import subprocess
    import sys

    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])}

    def pytest_run(*args):
        r = subprocess.run([sys.executable, "-m", "pytest", "-q", "--perf-profile", "toy", *args], cwd=pt,
                           env=env, capture_output=True, text=True, timeout=300)
        assert r.returncode == 0, r.stdout + r.stderr
        return r

    (pt / "test_tiny.py").write_text(TEST.format(dip=False))
    pytest_run("--perf-update-baselines", "--perf-report-dir=out1")
    # a stale request file from an earlier run in the same report dir is removed by the next run
    (pt / "out2" / "requests").mkdir(parents=True)
    (pt / "out2" / "requests" / "stale.jsonl").write_text("{}\n")
    (pt / "test_tiny.py").write_text(TEST.format(dip=True))
    r = pytest_run("--perf-report-dir=out2")
    assert "FAIL on the first measurement" in r.stdout
    return pt / "out2"


def test_every_request_is_written_beside_the_run_file(run_dir):
    (rec,) = json.loads((run_dir / "run.json").read_text())["results"]
    ref = rec["requests"]
    # 3 repeats first + 3 confirming, 3 prompts each
    assert ref["count"] == 18 and ref["repeats"] == 6 and ref["file"].startswith("requests/")
    lines = [json.loads(ln) for ln in (run_dir / ref["file"]).read_text().splitlines()]
    assert [ln["measurement"] for ln in lines] == ["first"] * 9 + ["confirm"] * 9
    assert sorted({ln["repeat"] for ln in lines}) == [0, 1, 2, 3, 4, 5]
    assert all(ln["ok"] and ln["completion_tokens"] == 16 and ln["n_chunks"] == 16 for ln in lines)
    assert all(ln["ttft_ms"] > 0 and ln["e2el_ms"] >= ln["ttft_ms"] for ln in lines)
    assert [p.name for p in (run_dir / "requests").iterdir()] == [Path(ref["file"]).name]  # stale one pruned
    assert json.loads((run_dir / "run.json").read_text())["report_dir"] == str(run_dir)


def test_history_is_appended_under_the_report_dir_not_the_tracked_tree(run_dir):
    assert len((run_dir / "history" / "toy.jsonl").read_text().splitlines()) == 1
    assert len((run_dir.parent / "out1" / "history" / "toy.jsonl").read_text().splitlines()) == 1
    assert not (run_dir.parent / "baselines" / "history").exists()


def test_loaders_give_requests_repeats_and_verdicts(run_dir):
    run = RunResults.load(run_dir)
    req = run.requests()
    assert len(req) == 18 and {"engine", "scenario", "ttft_ms", "tpot_ms", "repeat"} <= set(req.columns)
    assert "chunk_times" not in req.columns and len(run.requests(chunks=True)["chunk_times"][0]) == 16
    assert set(req["engine"]) == {"reference"} and set(req["concurrency"]) == {2}
    rep = run.repeats()
    tp = rep[rep.metric == "output_throughput"]
    # the first measurement's (divided) samples pooled with the confirming ones, each labelled
    assert list(tp.measurement) == ["first"] * 3 + ["confirm"] * 3
    assert tp.value.iloc[0] * 20 < tp.value.iloc[3]
    assert set(tp.unit) == {"tok/s"} and set(tp.direction) == {"higher"}
    # a repeat's TPOT p50 is the median of its requests' TPOTs: requests join their repeat's metrics
    tpot = rep[(rep.metric == "tpot_ms_p50")].set_index("repeat").value
    by_req = req.groupby("repeat").tpot_ms.median()
    assert by_req.round(9).to_dict() == tpot.round(9).to_dict()
    v = run.verdicts()
    (row,) = v.itertuples()
    assert row.kind == "gate" and row.metric == "output_throughput" and row.verdict in ("PASS", "WARN")
    assert "first measurement FAIL" in row.reason


def test_a_run_file_from_before_request_records_loads_with_no_requests():
    run = RunResults.load(ROOT / "benchmarks" / "h200-engines-lease" / "run-vllm.json")
    assert run.requests().empty and len(run.repeats()) > 50 and len(run.verdicts()) >= len(run.results)
    # the copy names a report dir that is not there: its requests are said to be missing, with the fix
    data = {**run.data, "results": [{**run.results[0], "requests": {"file": "requests/x.jsonl"}}]}
    with pytest.raises(FileNotFoundError, match="requests/ included"):
        RunResults(run.path, data).requests()


def test_bencher_export_validates_and_carries_median_and_spread(run_dir):
    run = RunResults.load(run_dir)
    bmf = to_bencher(run)
    _validate(bmf, BMF_SCHEMA)
    (bench,) = bmf
    assert bench == "tiny/reference/tiny-1/c2"
    vals = sorted(run.repeats().query("metric == 'tpot_ms_p50'").value)
    m = bmf[bench]["tpot_ms_p50"]
    assert m["lower_value"] == vals[0] and m["upper_value"] == vals[-1] and vals[0] <= m["value"] <= vals[-1]
    # Bencher measure names are at most 64 characters
    assert all(len(k) <= 64 for ms in bmf.values() for k in ms)


def test_gab_export_splits_by_direction_from_the_metrics_registry(run_dir):
    gab = to_gab(RunResults.load(run_dir))
    for entries in gab.values():
        _validate(entries, GAB_SCHEMA)
    big = {e["name"].split()[-1]: e for e in gab["customBiggerIsBetter"]}
    small = {e["name"].split()[-1]: e for e in gab["customSmallerIsBetter"]}
    assert "output_throughput" in big and "tpot_ms_p50" in small and "ttft_ms_p50" in small
    assert all(METRICS[m].direction == "higher" for m in big) and all(METRICS[m].direction == "lower" for m in small)
    assert big["output_throughput"]["unit"] == "tok/s" and small["tpot_ms_p50"]["unit"] == "ms"
    assert big["output_throughput"]["range"].startswith("± ") and "6 repeats" in big["output_throughput"]["extra"]


def test_export_on_a_real_gpu_run_file_validates(tmp_path):
    run = RunResults.load(ROOT / "benchmarks" / "h200-engines-lease" / "run-sglang.json")
    (bmf,) = export(run, "bencher", tmp_path)
    _validate(json.loads(bmf.read_text()), BMF_SCHEMA)
    files = export(run, "gab", tmp_path)
    assert sorted(p.name for p in files) == sorted(GAB_FILES.values())
    docs = [json.loads(p.read_text()) for p in files]
    for d in docs:
        _validate(d, GAB_SCHEMA)
    assert sum(len(d) for d in docs) == sum(len(v) for v in json.loads(bmf.read_text()).values())


def test_cli_export_and_its_errors(run_dir, tmp_path, capsys):
    assert _cli(["export", "--format", "gab", str(run_dir), "-o", str(tmp_path / "gab")]) == 0
    assert sorted(p.name for p in (tmp_path / "gab").iterdir()) == sorted(GAB_FILES.values())
    assert _cli(["export", "--format", "bencher", str(run_dir / "run.json"), "-o", str(tmp_path / "b.json"),
                 "--metric", "tpot_ms_p50"]) == 0
    assert list(json.loads((tmp_path / "b.json").read_text()).values())[0].keys() == {"tpot_ms_p50"}
    assert _cli(["show", str(run_dir)]) == 0
    assert "18 request records" in capsys.readouterr().out
    for bad in (["export", "--format", "bencher", str(tmp_path / "nowhere")],
                ["export", "--format", "csv", str(run_dir)],
                ["export", "--format", "bencher", str(run_dir), "--metric", "tok_s"]):
        with pytest.raises(SystemExit) as e:
            _cli(bad)
        assert e.value.code == 2
    err = capsys.readouterr().err
    assert "no run file at" in err and "invalid choice: 'csv'" in err and "unknown metric(s) ['tok_s']" in err


def test_the_docs_unit_and_direction_table_matches_the_metrics_registry():
    text = (ROOT / "docs" / "results-export.md").read_text()
    rows = {}
    for ln in text.splitlines():
        cells = [c.strip() for c in ln.strip("|").split("|")]
        if len(cells) == 4 and cells[0].startswith("`"):
            rows[cells[0].strip("`")] = tuple(cells[1:])
    assert rows == {m.name: (m.unit, m.direction, "customBiggerIsBetter" if m.direction == "higher"
                             else "customSmallerIsBetter") for m in METRICS.values()}


def test_eagle3_generation_runs_are_captured_for_the_running_test(monkeypatch):
    """The EAGLE-3 speedup/acceptance measurement calls the client directly, not bench.measure: its
    repeat is noted too, so the test's check writes its requests."""
    from types import SimpleNamespace

    from kimi_perf import results
    from kimi_perf.eagle3 import evaluate
    from kimi_perf.load.results import BenchResult, RequestRecord, compute_metrics
    from kimi_perf.load.workload import Workload

    recs = [RequestRecord(index=i, prompt_len=3, max_tokens=4, ok=True, error=None, t_send=0.0, t_first=0.1,
                          t_end=0.4, chunk_times=(0.1, 0.2, 0.3, 0.4), completion_tokens=4, text="abcd")
            for i in range(2)]
    fake = BenchResult(workload=Workload(name="eagle3-eval"), records=tuple(recs),
                       metrics=compute_metrics(recs, 1), duration_s=0.4, client_cpu_s=0.0)
    monkeypatch.setattr(evaluate, "flush_cache", lambda *a, **k: SimpleNamespace(describe=lambda: "flushed"))
    monkeypatch.setattr(evaluate, "_get_json", lambda url, headers=None: None)
    monkeypatch.setattr(evaluate, "read_spec_counters", lambda url, headers=None: None)
    monkeypatch.setattr(evaluate, "run_workload", lambda *a, **k: fake)
    results.begin_capture()
    try:
        out = evaluate.measure_generation("http://127.0.0.1:1", "m", [[1, 2, 3]] * 2, 4, engine="reference")
        assert out.texts == ("abcd", "abcd") and results.drain() == [fake] and results.drain() == []
    finally:
        results.end_capture()
    evaluate.measure_generation("http://127.0.0.1:1", "m", [[1, 2, 3]] * 2, 4, engine="reference")
    assert results.drain() == []  # outside a test nothing is collected


def test_ab_ratios_are_exported_with_their_interval_and_the_metrics_direction(tmp_path):
    ab = {"base": "git:HEAD~1", "decisions": [
        {"probe": "single_stream", "metric": "decode_tok_s", "ratio": 0.97, "ratio_lo": 0.95, "ratio_hi": 0.99,
         "n_pairs": 6, "verdict": "FAIL"},
        {"probe": "sweep", "metric": "tpot_ms_p50", "ratio": 1.01, "ratio_lo": 0.98, "ratio_hi": 1.04,
         "n_pairs": 6, "verdict": "PASS"},
        {"probe": "sweep", "metric": "ttft_ms_p50", "ratio": float("nan"), "ratio_lo": float("nan"),
         "ratio_hi": float("nan"), "n_pairs": 0, "verdict": "INCONCLUSIVE"}]}
    rec = {"nodeid": "t::ab", "key": {"scenario": "ab_throughput", "engine": "reference", "model": "m",
                                      "hardware": "h", "workload": "w", "concurrency": 8}, "samples": {},
           "decisions": [], "ab": ab}
    run = RunResults(tmp_path / "run.json", {"profile": "p", "hardware": "h", "results": [rec]})
    bmf = to_bencher(run)
    _validate(bmf, BMF_SCHEMA)
    assert bmf == {"ab_throughput/reference/ab-vs-git:HEAD~1": {
        "single_stream:decode_tok_s:ab_ratio": {"value": 0.97, "lower_value": 0.95, "upper_value": 0.99},
        "sweep:tpot_ms_p50:ab_ratio": {"value": 1.01, "lower_value": 0.98, "upper_value": 1.04}}}
    gab = to_gab(run)
    assert [e["name"].split()[-1] for e in gab["customBiggerIsBetter"]] == ["single_stream:decode_tok_s:ab_ratio"]
    assert [e["name"].split()[-1] for e in gab["customSmallerIsBetter"]] == ["sweep:tpot_ms_p50:ab_ratio"]
    assert "6 pairs, interval 0.95..0.99; verdict FAIL" in gab["customBiggerIsBetter"][0]["extra"]
    assert run.verdicts().kind.tolist() == ["ab"] * 3


def test_ab_table_shows_each_decision_with_its_comparison(tmp_path, capsys):
    """The flag-A/B table (README, docs/results.md) is read from run files: one row per metric with the
    base, the interval, the threshold, the verdict and what the comparison cost."""
    ab = {"base": "variant sglang-cds4", "blocks": 4, "wall_s": 512.4, "stopped": "every gated metric decided",
          "launches": [{"role": "base"}, {"role": "candidate"}] * 2, "versions": {"base": "0.5.17"},
          "decisions": [
              {"probe": "single_stream", "metric": "decode_tok_s", "unit": "tok/s", "direction": "higher",
               "base": 800.0, "candidate": 760.0, "ratio": 0.95, "ratio_lo": 0.94, "ratio_hi": 0.96, "level": 0.9,
               "threshold": 0.025, "n_pairs": 12, "verdict": "FAIL"},
              {"probe": "top", "metric": "steady_output_throughput", "unit": "tok/s", "direction": "higher",
               "base": 9000.0, "candidate": float("nan"), "ratio": float("nan"), "ratio_lo": float("nan"),
               "ratio_hi": float("nan"), "level": 0.9, "threshold": 0.075, "n_pairs": 0,
               "verdict": "INCONCLUSIVE"}]}
    rec = {"nodeid": "t::ab", "key": {"scenario": "ab_throughput", "engine": "sglang", "model": "m",
                                      "hardware": "gpu-h200-x1", "workload": "w", "concurrency": 128},
           "samples": {}, "decisions": [], "ab": ab}
    path = tmp_path / "run.json"
    path.write_text(json.dumps({"profile": "p", "hardware": "h", "results": [rec, {"nodeid": "t::plain"}]}))
    table = ab_table([RunResults.load(tmp_path)]).splitlines()
    assert len(table) == 4  # header, rule, two decisions; a result without an A/B gives no row
    assert table[2] == ("| sglang | variant sglang-cds4 | ab_throughput | decode_tok_s ↑ [tok/s] | 800 | 760 "
                        "| 0.9500 [0.9400, 0.9600] (90%) | 2.5% | FAIL | 12 / 4 / 4 | 512 |")
    assert "| n/a [n/a, n/a] (90%) | 7.5% | INCONCLUSIVE | 0 / 4 / 4 |" in table[3]
    assert _cli(["ab-table", str(tmp_path), str(path)]) == 0
    assert capsys.readouterr().out.count("| sglang |") == 4
    with pytest.raises(SystemExit):
        _cli(["ab-table", str(tmp_path / "missing")])

