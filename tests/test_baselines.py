"""Baseline files: strict schema with errors naming file, entry and fix; atomic updates."""

from __future__ import annotations

import json

import pytest

from kimi_perf import baselines as bl
from kimi_perf.baselines import BaselineEntry, BaselineError, BaselineKey, BaselineStore, MetricSamples

KEY = {"scenario": "throughput_sweep", "engine": "reference", "model": "m", "hardware": "cpu-x86_64-2c",
       "workload": "random-abc", "concurrency": 8}


def good(samples=(10.0, 11.0, 12.0)):
    return {"schema_version": 1, "profile": "p", "entries": [{
        "key": dict(KEY), "engine_version": "0.1.0",
        "metrics": {"output_throughput": {"unit": "tok/s", "direction": "higher", "samples": list(samples)}}}]}


def write(tmp_path, data):
    p = tmp_path / "p.json"
    p.write_text(json.dumps(data) if not isinstance(data, str) else data)
    return p


def test_roundtrip(tmp_path):
    st = BaselineStore(write(tmp_path, good()), "p")
    assert st.lookup_samples(BaselineKey(**KEY), "output_throughput") == (10.0, 11.0, 12.0)
    assert st.lookup_samples(BaselineKey(**{**KEY, "concurrency": 4}), "output_throughput") is None


@pytest.mark.parametrize("mutate, needle", [
    (lambda d: d.update(schema_version=3), "schema_version"),
    (lambda d: d["entries"][0]["metrics"].update(output_thruput=d["entries"][0]["metrics"]["output_throughput"]),
     "unknown metric 'output_thruput'"),
    (lambda d: d["entries"][0]["metrics"]["output_throughput"].update(direction="lower"), "direction"),
    (lambda d: d["entries"][0]["metrics"]["output_throughput"].update(unit="ms"), "unit"),
    (lambda d: d["entries"][0]["metrics"]["output_throughput"].update(samples=[]), "samples"),
    (lambda d: d["entries"][0]["metrics"]["output_throughput"].update(samples=["fast"]), "samples"),
    (lambda d: d["entries"][0]["key"].pop("hardware"), "missing ['hardware']"),
    (lambda d: d["entries"][0]["key"].update(concurrency="8"), "concurrency"),
    (lambda d: d["entries"].append(d["entries"][0]), "duplicate key"),
    (lambda d: d.update(extra=1), "unknown field"),
])
def test_schema_errors_name_file_key_and_fix(tmp_path, mutate, needle):
    d = good()
    mutate(d)
    p = write(tmp_path, d)
    with pytest.raises(BaselineError) as ei:
        BaselineStore(p, "p")
    msg = str(ei.value)
    assert str(p) in msg and needle in msg and "Fix:" in msg


def test_invalid_json_names_line(tmp_path):
    with pytest.raises(BaselineError, match=r"not valid JSON \(line 1"):
        BaselineStore(write(tmp_path, "{not json"), "p")


def test_profile_mismatch(tmp_path):
    with pytest.raises(BaselineError, match="profile is 'p'"):
        BaselineStore(write(tmp_path, good()), "other")


def test_update_merges_and_keeps_unmeasured_metrics(tmp_path):
    p = write(tmp_path, good())
    st = BaselineStore(p, "p")
    new = BaselineEntry(key=BaselineKey(**KEY), metrics={"tpot_ms_p50": MetricSamples("ms", "lower", (5.0, 6.0))})
    st.write([new])
    again = BaselineStore(p, "p")
    e = again.get(BaselineKey(**KEY))
    assert set(e.metrics) == {"output_throughput", "tpot_ms_p50"}


def test_crash_mid_write_leaves_old_file(tmp_path, monkeypatch):
    p = write(tmp_path, good())
    before = p.read_text()
    st = BaselineStore(p, "p")

    def boom(*a, **k):
        raise OSError("disk full")

    monkeypatch.setattr(bl.json, "dump", boom)
    with pytest.raises(OSError):
        st.write([BaselineEntry(key=BaselineKey(**KEY), metrics={"tpot_ms_p50": MetricSamples("ms", "lower", (1.0,))})])
    assert p.read_text() == before
    assert [f.name for f in tmp_path.iterdir()] == ["p.json"]  # no temp file left behind


def _run_file(tmp_path, *, dirty):
    key = {"scenario": "single_stream", "engine": "vllm", "model": "m", "hardware": "gpu-h200-x1",
           "workload": "w", "concurrency": 1}
    results = [
        {"nodeid": "t::a[vllm]", "key": key, "samples": {"decode_tok_s": [500.0, 510.0]}, "outcome": "passed",
         "engine_version": "0.26.0", "time": 1796340121.0, "extra": {"note": "x"}},
        {"nodeid": "t::b[vllm]", "key": {**key, "scenario": "alignment_engine_vs_hf"},
         "samples": {"cosine_min": [0.4]}, "outcome": "failed", "engine_version": "0.26.0", "time": 1796340121.0},
        {"nodeid": "t::ab", "key": {**key, "scenario": "ab"}, "samples": {"decode_tok_s": [1.0]},
         "outcome": "passed", "ab": {"verdict": "PASS"}, "time": 1796340121.0},
    ]
    p = tmp_path / "run.json"
    p.write_text(json.dumps({"profile": "h200-engines", "commit": {"id": "abc123", "dirty": dirty},
                             "machine": {"cpu": "Xeon", "cpu_count": 16, "gpus": [{"name": "NVIDIA H200"}]},
                             "results": results}))
    return p


def test_record_from_run_file_keeps_passed_results_only(tmp_path, capsys):
    run = _run_file(tmp_path, dirty=True)
    assert bl._cli(["record", str(run), "--dir", str(tmp_path)]) == 0
    assert "1 entries recorded" in capsys.readouterr().out
    store = BaselineStore(tmp_path / "h200-engines.json", "h200-engines")
    (entry,) = store.entries.values()
    assert entry.key.scenario == "single_stream" and entry.metrics["decode_tok_s"].samples == (500.0, 510.0)
    # the run file says its tree was dirty: the entry must not claim the clean commit
    assert entry.commit == "abc123+dirty" and entry.engine_version == "0.26.0"
    assert entry.machine["gpus"] == ["NVIDIA H200"] and entry.source == "measured by t::a[vllm]"


def test_record_commit_override(tmp_path):
    run = _run_file(tmp_path, dirty=True)
    assert bl._cli(["record", str(run), "--dir", str(tmp_path), "--commit", "def456"]) == 0
    (entry,) = BaselineStore(tmp_path / "h200-engines.json", "h200-engines").entries.values()
    assert entry.commit == "def456"


# -- per-metric provenance and external reference figures (schema 2) -----------------------------


def _measured(commit, source, tpot=None):
    prov = bl.Provenance(commit=commit, source=source, recorded_at="2026-01-01T00:00:00Z", machine={"cpu": source})
    metrics = {"output_throughput": MetricSamples("tok/s", "higher", (10.0, 11.0), prov)}
    if tpot is not None:
        metrics["tpot_ms_p50"] = MetricSamples("ms", "lower", tpot, prov)
    return BaselineEntry(key=BaselineKey(**KEY), metrics=metrics, commit=commit, source=source,
                         machine={"cpu": source})


def test_partial_update_keeps_each_metrics_provenance(tmp_path):
    p = tmp_path / "p.json"
    BaselineStore(p, "p").write([_measured("aaa", "run A", tpot=(5.0, 6.0))])
    # run B measures only output_throughput (e.g. -k deselected the TPOT test)
    BaselineStore(p, "p").write([BaselineEntry(
        key=BaselineKey(**KEY), metrics={"output_throughput": MetricSamples("tok/s", "higher", (12.0, 13.0))},
        commit="bbb", source="run B", machine={"cpu": "B"})])
    e = BaselineStore(p, "p").get(BaselineKey(**KEY))
    assert e.commit == "bbb"  # the entry's fields describe the last write...
    tp, tpot = e.metrics["output_throughput"].provenance, e.metrics["tpot_ms_p50"].provenance
    assert (tp.commit, tp.source, dict(tp.machine)) == ("bbb", "run B", {"cpu": "B"})
    # ...but the kept metric still says who measured it
    assert (tpot.commit, tpot.source, dict(tpot.machine)) == ("aaa", "run A", {"cpu": "run A"})
    assert e.metrics["tpot_ms_p50"].samples == (5.0, 6.0)


def test_schema1_file_loads_with_inherited_provenance_and_upgrades_on_write(tmp_path):
    d = good()
    d["entries"][0].update(commit="abc", source="measured by t::x")
    p = write(tmp_path, d)
    st = BaselineStore(p, "p")
    prov = st.get(BaselineKey(**KEY)).metrics["output_throughput"].provenance
    assert (prov.kind, prov.commit, prov.source) == ("measured", "abc", "measured by t::x")
    st.write([])
    raw = json.loads(p.read_text())
    assert raw["schema_version"] == 2
    assert raw["entries"][0]["metrics"]["output_throughput"]["provenance"]["commit"] == "abc"


def test_schema1_entry_without_commit_says_its_reason_is_unknown(tmp_path):
    st = BaselineStore(write(tmp_path, good()), "p")  # good() has no commit
    prov = st.get(BaselineKey(**KEY)).metrics["output_throughput"].provenance
    assert prov.commit is None and prov.no_commit_reason == bl.LEGACY_NO_COMMIT


@pytest.mark.parametrize("prov, needle", [
    ({"kind": "measured", "commit": None}, "no_commit_reason"),
    ({"kind": "external", "commit": "x", "source": "a blog"}, "unknown"),
    ({"kind": "guessed", "commit": "x"}, "kind"),
    ({"commit": "x", "who": "me"}, "unknown field"),
])
def test_schema2_provenance_errors_name_the_fix(tmp_path, prov, needle):
    d = good()
    d["schema_version"] = 2
    d["entries"][0]["metrics"]["output_throughput"]["provenance"] = prov
    p = write(tmp_path, d)
    with pytest.raises(BaselineError) as ei:
        BaselineStore(p, "p")
    assert needle in str(ei.value) and "Fix:" in str(ei.value)


def test_provenance_in_a_schema1_file_asks_for_schema2(tmp_path):
    d = good()
    d["entries"][0]["metrics"]["output_throughput"]["provenance"] = {"commit": "x"}
    with pytest.raises(BaselineError, match="schema_version"):
        BaselineStore(write(tmp_path, d), "p")


def test_run_without_commit_says_why(tmp_path):
    results = [{"nodeid": "t::a", "key": dict(KEY), "samples": {"output_throughput": [1.0, 2.0]},
                "outcome": "passed", "time": 0.0}]
    (e,) = bl.entries_from_results(results, commit={}, machine={})
    prov = e.metrics["output_throughput"].provenance
    assert prov.commit is None and "no git commit" in prov.no_commit_reason
    p = tmp_path / "p.json"
    BaselineStore(p, "p").write([e])
    assert BaselineStore(p, "p").get(BaselineKey(**KEY)).metrics["output_throughput"].provenance == prov


def _add(tmp_path, *extra):
    return bl._cli(["add", "--profile", "embedded-cpu", "--scenario", "single_stream", "--engine", "vllm",
                    "--model", "m", "--hardware", "h", "--workload", "w", "--concurrency", "1",
                    "--source", "a vendor blog", "--unknown", "workload; output or decode tok/s",
                    "--metric", "decode_tok_s=63.6", "--dir", str(tmp_path), *extra])


def test_add_records_an_external_figure_that_a_measurement_replaces(tmp_path):
    assert _add(tmp_path) == 0
    path = tmp_path / "embedded-cpu.json"
    key = BaselineKey("single_stream", "vllm", "m", "h", "w", 1)
    prov = BaselineStore(path, "embedded-cpu").get(key).metrics["decode_tok_s"].provenance
    assert prov.external and prov.unknown == "workload; output or decode tok/s" and prov.commit is None
    assert "external" in prov.no_commit_reason
    measured = bl.entries_from_results(
        [{"nodeid": "t::a", "key": key.as_dict(), "samples": {"decode_tok_s": [70.0, 71.0]}, "outcome": "passed",
          "time": 0.0}], commit={"id": "abc"}, machine={})
    BaselineStore(path, "embedded-cpu").write(measured)
    prov = BaselineStore(path, "embedded-cpu").get(key).metrics["decode_tok_s"].provenance
    assert not prov.external and prov.commit == "abc"
    # and an external figure does not overwrite the measurement
    with pytest.raises(SystemExit):
        _add(tmp_path)


def test_add_requires_what_is_unknown(tmp_path):
    with pytest.raises(SystemExit):
        bl._cli(["add", "--profile", "embedded-cpu", "--scenario", "s", "--engine", "e", "--model", "m",
                 "--hardware", "h", "--workload", "w", "--concurrency", "1", "--source", "x",
                 "--metric", "decode_tok_s=1", "--dir", str(tmp_path)])
