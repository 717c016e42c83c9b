"""The baseline store under concurrent writers and bad input: merges under a lock (nothing lost, a
same-key conflict named), validates before it replaces, writes with the umask, and a broken sample's
fix can be followed."""

from __future__ import annotations

import json
import os
import stat
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from kimi_perf import baselines as bl
from kimi_perf.atomic import atomic_write_json, process_umask
from kimi_perf.baselines import BaselineEntry, BaselineError, BaselineKey, BaselineStore, load_file

ROOT = Path(__file__).resolve().parents[1]
KEY = {"scenario": "throughput_sweep", "engine": "reference", "model": "m", "hardware": "cpu",
       "workload": "w", "concurrency": 8}

# each writer loads the store, waits until all have loaded (so every one read the same old file), then
# writes its own key: without a lock and a re-read at write time the last writer reverts the others
WRITER = textwrap.dedent("""
    import sys, time
    from pathlib import Path
    sys.path.insert(0, {root!r})
    from kimi_perf.baselines import BaselineEntry, BaselineKey, BaselineStore, MetricSamples
    from kimi_perf.metrics import METRICS
    d, i, n, metric_of = Path({d!r}), int(sys.argv[1]), {n}, {metric_of!r}
    store = BaselineStore(d / "p.json", "p")
    (d / f"ready-{{i}}").touch()
    while sum(1 for _ in d.glob("ready-*")) < n:
        time.sleep(0.01)
    m = metric_of[i] if metric_of else "output_throughput"
    e = BaselineEntry(key=BaselineKey("s", "reference", "m", "cpu", f"w{{i}}" if not metric_of else "w",
                                      {conc}),
                      metrics={{m: MetricSamples(METRICS[m].unit, METRICS[m].direction, (float(i + 1),) * 3)}},
                      commit="abc", source=f"writer {{i}}")
    store.write([e])
    print("\\n".join(store.conflicts), flush=True)
""")


def run_writers(d: Path, n: int, metric_of: list[str] | None = None, conc: int = 8) -> list[str]:
    code = WRITER.format(root=str(ROOT), d=str(d), n=n, metric_of=metric_of, conc=conc)
    procs = [subprocess.Popen([sys.executable, "-c", code, str(i)], stdout=subprocess.PIPE, text=True)
             for i in range(n)]
    outs = [p.communicate(timeout=120)[0] for p in procs]
    assert all(p.returncode == 0 for p in procs)
    return outs


def seed_file(d: Path) -> None:
    e = BaselineEntry(key=BaselineKey("s", "reference", "m", "cpu", "old", 8),
                      metrics={"output_throughput": bl.MetricSamples("tok/s", "higher", (5.0, 5.0, 5.0))}, commit="0")
    BaselineStore(d / "p.json", "p").write([e])


def test_four_concurrent_writers_of_different_keys_lose_nothing(tmp_path):
    seed_file(tmp_path)
    run_writers(tmp_path, 4)
    _, entries = load_file(tmp_path / "p.json")
    assert sorted(e.key.workload for e in entries.values()) == ["old", "w0", "w1", "w2", "w3"]
    assert not list(tmp_path.glob(".p.json.*")), "a temp file was left behind"


def test_same_key_same_metric_conflict_is_named(tmp_path):
    seed_file(tmp_path)
    outs = run_writers(tmp_path, 2, metric_of=["output_throughput", "output_throughput"])
    said = [o for o in outs if "also updated by another run" in o]
    # the second writer to take the lock replaced the first one's samples and says whose
    assert len(said) == 1 and "output_throughput" in said[0] and "writer" in said[0]


def test_same_key_different_metrics_merge_without_conflict(tmp_path):
    seed_file(tmp_path)
    outs = run_writers(tmp_path, 2, metric_of=["output_throughput", "request_throughput"])
    assert not any(o.strip() for o in outs)
    _, entries = load_file(tmp_path / "p.json")
    (e,) = [e for e in entries.values() if e.key.workload == "w"]
    assert set(e.metrics) == {"output_throughput", "request_throughput"}


def test_a_write_the_loader_would_reject_leaves_the_file_alone(tmp_path):
    seed_file(tmp_path)
    before = (tmp_path / "p.json").read_text()
    store = BaselineStore(tmp_path / "p.json", "p")
    # a bool where the key wants an integer: json writes `true`, which the loader rejects
    bad = BaselineEntry(key=BaselineKey("s", "reference", "m", "cpu", "w", True),  # type: ignore[arg-type]
                        metrics={"output_throughput": bl.MetricSamples("tok/s", "higher", (1.0,))}, commit="x")
    with pytest.raises(BaselineError, match="concurrency"):
        store.write([bad])
    assert (tmp_path / "p.json").read_text() == before
    BaselineStore(tmp_path / "p.json", "p")  # still loads
    assert not list(tmp_path.glob(".p.json.*"))


def test_files_get_the_process_umask(tmp_path):
    old = os.umask(0o022)
    try:
        assert process_umask() == 0o022
        atomic_write_json(tmp_path / "a.json", {"x": 1})
        assert stat.S_IMODE((tmp_path / "a.json").stat().st_mode) == 0o644
        os.umask(0o077)
        atomic_write_json(tmp_path / "b.json", {"x": 1})
        assert stat.S_IMODE((tmp_path / "b.json").stat().st_mode) == 0o600
    finally:
        os.umask(old)


def test_nan_sample_fix_names_file_and_entry_and_not_only_the_refused_flag(tmp_path):
    p = tmp_path / "p.json"
    p.write_text(json.dumps({"schema_version": 1, "profile": "p", "entries": [{
        "key": KEY, "metrics": {"output_throughput": {"unit": "tok/s", "direction": "higher",
                                                      "samples": [1.0, float("nan")]}}}]}))
    with pytest.raises(BaselineError) as ei:
        BaselineStore(p, "p")
    fix = str(ei.value).split("Fix:", 1)[1]
    assert str(p) in fix and "entries[0].metrics.output_throughput" in fix and "delete" in fix


def test_a_baseline_path_that_is_a_directory_is_a_baseline_error(tmp_path):
    (tmp_path / "p.json").mkdir()
    with pytest.raises(BaselineError, match="cannot be read.*IsADirectoryError"):
        BaselineStore(tmp_path / "p.json", "p")
