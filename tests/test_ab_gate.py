"""The same-run A/B gate's parts: the interval and sequential decision, the profile's ab/variants
sections, ``--perf-ab`` resolution (variants, git refs, shallow clones), the base side's config, and
the ABBA schedule run against real (tiny, paced) servers."""

from __future__ import annotations

import dataclasses
import json
import math
import os
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from scipy import stats as sps

from kimi_perf.ab.base import base_engine_config, resolve_base
from kimi_perf.ab.config import ABConfigError, ABSpec, parse_ab, parse_variants
from kimi_perf.ab.decide import block_t_interval, decide
from kimi_perf.ab.gitref import ensure_worktree, resolve_ref
from kimi_perf.engines.base import ReferenceEngineConfig, SpecConfig
from kimi_perf.engines.reference import PLANT_ENV
from kimi_perf.metrics import get_metric

TP = get_metric("output_throughput")  # higher is better
LAT = get_metric("tpot_ms_p50")  # lower is better
HERE = Path(__file__).parent


def blocks_of(shift: float, sd: float, n_blocks: int, per_block: int = 2, seed: int = 0) -> list[list[float]]:
    rng = np.random.default_rng(seed)
    return [list(shift + sd * rng.standard_normal(per_block)) for _ in range(n_blocks)]


# -- the interval ---------------------------------------------------------------------------------


def test_block_t_interval_is_the_t_interval_of_block_medians():
    blocks = [[0.01, 0.03, 0.5], [-0.02, 0.0, -0.01], [0.05, 0.01, 0.02], [0.02, 0.02, -0.9]]
    iv = block_t_interval(blocks, 0.95)
    means = [np.median(b) for b in blocks]  # one stalled pair per block does not move them
    lo, hi = sps.t.interval(0.95, len(means) - 1, loc=np.mean(means), scale=sps.sem(means))
    assert (iv.lo, iv.hi) == pytest.approx((lo, hi))
    assert iv.n_blocks == 4 and iv.n_pairs == 12 and iv.ratio == pytest.approx(math.exp(np.mean(means)))


def test_one_block_gives_no_interval_and_nan_pairs_are_dropped():
    assert block_t_interval([[0.1, 0.2]], 0.95) is None
    iv = block_t_interval([[0.1, float("nan")], [0.2], [float("nan")]], 0.95)
    assert iv is not None and iv.n_blocks == 2 and iv.n_pairs == 2


# -- the decision ---------------------------------------------------------------------------------


def _decide(metric, blocks, *, final=False, threshold=0.05, family=1, min_blocks=3):
    return decide(metric, "p", blocks, [100.0], [100.0], threshold=threshold, alpha=0.05, family=family,
                  min_blocks=min_blocks, final=final)


def test_no_change_passes_a_20pct_slowdown_fails_and_the_message_has_everything():
    assert _decide(TP, blocks_of(0.0, 0.01, 4)).verdict == "PASS"
    d = _decide(TP, blocks_of(math.log(0.8), 0.01, 4))
    assert d.verdict == "FAIL" and d.ratio == pytest.approx(0.8, rel=0.02) and d.ratio_hi < 0.95
    msg = d.message()
    for part in ("output_throughput", "higher is better", "tok/s", "base", "candidate", "ratio 0.8",
                 "interval [", "threshold 0.950", "4 blocks", "FAIL"):
        assert part in msg, (part, msg)


def test_lower_is_better_metrics_fail_when_the_candidate_takes_longer():
    assert _decide(LAT, blocks_of(math.log(1.25), 0.01, 4)).verdict == "FAIL"
    assert _decide(LAT, blocks_of(math.log(0.8), 0.01, 4)).verdict == "PASS"  # faster: an improvement


def test_a_straddling_interval_keeps_measuring_then_is_inconclusive_never_pass():
    blocks = blocks_of(math.log(0.95), 0.05, 4)  # right at the threshold, noisy
    d = _decide(TP, blocks)
    assert d.verdict == "INCONCLUSIVE" and "measuring more" in d.reason
    d = _decide(TP, blocks, final=True)
    assert d.verdict == "INCONCLUSIVE" and "budget" in d.reason and d.ratio_lo < 0.95 < d.ratio_hi


def test_nothing_is_decided_before_min_blocks():
    d = _decide(TP, blocks_of(math.log(0.5), 0.001, 2), min_blocks=3)
    assert d.verdict == "INCONCLUSIVE" and "min_blocks" in d.reason


def test_family_of_metrics_widens_each_interval():
    b = blocks_of(0.0, 0.03, 5)
    one, three = _decide(TP, b, family=1), _decide(TP, b, family=3)
    assert three.level == pytest.approx(1 - 0.05 / 3)
    assert three.ratio_lo < one.ratio_lo and three.ratio_hi > one.ratio_hi


def test_deterministic_identical_sides_pass_with_a_zero_width_interval():
    d = _decide(get_metric("accept_length"), [[0.0]] * 5)
    assert d.verdict == "PASS" and d.ratio_lo == d.ratio_hi == 1.0


# -- profile sections -----------------------------------------------------------------------------


def test_ab_section_defaults_depend_on_hardware_and_bad_values_name_the_key():
    assert parse_ab(None, hardware="cpu").threshold == 0.05
    assert parse_ab(None, hardware="cuda").threshold == 0.025
    with pytest.raises(ABConfigError, match="unknown key"):
        parse_ab({"treshold": 0.1}, hardware="cpu")
    with pytest.raises(ABConfigError, match="min_blocks"):
        parse_ab({"min_blocks": 9, "max_blocks": 4}, hardware="cpu")
    with pytest.raises(ABConfigError, match="gated"):
        parse_ab({"gated": {"single_stream": ["decode_tok_z"]}}, hardware="cpu")
    with pytest.raises(ABConfigError, match="relaunch"):
        parse_ab({"relaunch": "yes"}, hardware="cpu")


def test_a_metric_can_have_its_own_threshold_and_a_bad_one_names_the_fix():
    spec = parse_ab({"thresholds": {"steady_output_throughput": 0.075}}, hardware="cuda")
    assert spec.threshold_for("steady_output_throughput") == 0.075 and spec.threshold_for("decode_tok_s") == 0.025
    assert spec.describe_thresholds() == "2.5% (steady_output_throughput 7.5%)"
    assert parse_ab(None, hardware="cpu").describe_thresholds() == "5.0%"
    with pytest.raises(ABConfigError, match="unknown metric.*steady_tput.*docs/metrics.md"):
        parse_ab({"thresholds": {"steady_tput": 0.075}}, hardware="cuda")
    with pytest.raises(ABConfigError, match="fractions in"):
        parse_ab({"thresholds": {"steady_output_throughput": 7.5}}, hardware="cuda")
    with pytest.raises(ABConfigError, match="must map metric names"):
        parse_ab({"thresholds": [0.075]}, hardware="cuda")


def test_variants_are_validated_and_cannot_choose_what_runs():
    engines = {"reference": {"kind": "reference"}, "sglang": {"kind": "sglang"}}
    v = parse_variants({"nccl": {"engine": "sglang", "settings": {"nccl_preset": "seed-pcie-tuned"}}}, engines)
    assert v["nccl"].engine == "sglang" and v["nccl"].settings == {"nccl_preset": "seed-pcie-tuned"}
    for bad, match in (({"same": {}}, "reserved"), ({"x": {"engine": "trt"}}, "not an engine"),
                       ({"x": {"settings": {"python": "/bin/sh"}}}, "cannot choose what runs"),
                       ({"x": {"interpreter": "mine"}}, "interpreter"), ({"x": {"colour": 1}}, "unknown key")):
        with pytest.raises(ABConfigError, match=match):
            parse_variants(bad, engines)


# -- --perf-ab resolution and git -----------------------------------------------------------------


def _git(repo, *args):
    return subprocess.run(["git", "-c", "user.name=t", "-c", "user.email=t@t", *args], cwd=repo, check=True,
                          capture_output=True, text=True).stdout.strip()


@pytest.fixture
def repo(tmp_path):
    if shutil.which("git") is None:
        pytest.skip("git is not installed")
    r = tmp_path / "repo"
    (r / "kimi_perf" / "engines" / "reference").mkdir(parents=True)
    _git(tmp_path, "init", "-q", str(r))
    for i in (1, 2):
        (r / "kimi_perf" / "engines" / "reference" / "server.py").write_text(f"VERSION = {i}\n")
        _git(r, "add", "-A")
        _git(r, "commit", "-qm", f"commit {i}")
    return r


def test_git_base_resolves_and_its_worktree_is_that_commit_reused(repo, tmp_path):
    b = resolve_base("git:HEAD~1", {}, repo)
    assert b.kind == "git" and b.git.sha == _git(repo, "rev-parse", "HEAD~1") and "commit 1" in b.label
    wt = ensure_worktree(b.git, tmp_path / "cache")
    assert (wt / "kimi_perf" / "engines" / "reference" / "server.py").read_text() == "VERSION = 1\n"
    assert ensure_worktree(b.git, tmp_path / "cache") == wt  # reused, not re-created
    shutil.rmtree(wt / "kimi_perf")  # an interrupted earlier run: recreated
    assert (ensure_worktree(b.git, tmp_path / "cache") / "kimi_perf").is_dir()


def test_bad_bases_are_errors_that_name_the_fix(repo, tmp_path):
    with pytest.raises(ABConfigError, match="does not name a commit"):
        resolve_base("git:no-such-branch", {}, repo)
    with pytest.raises(ABConfigError, match="not a git checkout"):
        resolve_ref(tmp_path, "HEAD~1")
    with pytest.raises(ABConfigError, match="not a variant of this profile; choose one of: same, git:REF, fast"):
        resolve_base("slow", {"fast": parse_variants({"fast": {}}, {})["fast"]}, repo)
    cli = parse_variants({"old": {"interpreter": "cli"}}, {})
    with pytest.raises(ABConfigError, match="--perf-ab-python"):
        resolve_base("old", cli, repo)
    shallow = tmp_path / "shallow"
    subprocess.run(["git", "clone", "-q", "--depth", "1", f"file://{repo}", str(shallow)], check=True)
    with pytest.raises(ABConfigError, match="shallow.*git fetch --deepen=1"):
        resolve_base("git:HEAD~1", {}, shallow)


def test_base_config_changes_one_thing_and_never_inherits_the_planted_slowdown(repo, tmp_path):
    cand = ReferenceEngineConfig(name="reference-candidate", model_path="/m", env=((PLANT_ENV, "0.2"),))
    same = base_engine_config(cand, resolve_base("same", {}, repo), build=None, cache_dir=tmp_path)
    assert dict(same.env)[PLANT_ENV] == "0" and same.source_root is None
    assert same.argv(1) == cand.argv(1)  # A/A: the same command line
    git = base_engine_config(cand, resolve_base("git:HEAD~1", {}, repo), build=None, cache_dir=tmp_path)
    assert git.source_root and Path(git.source_root).is_dir() and git.environ()["PYTHONPATH"].startswith(git.source_root)
    v = parse_variants({"eager": {"settings": {"disable_cuda_graph": True}, "env": {"OMP_NUM_THREADS": "1"}}}, {})
    built = []

    def build(name, **settings):
        built.append((name, settings))
        return ReferenceEngineConfig(name=name, model_path="/m", **settings)

    eager = base_engine_config(cand, resolve_base("eager", v, repo), build=build, cache_dir=tmp_path)
    assert built == [("reference-candidate", {"disable_cuda_graph": True})] and eager.disable_cuda_graph
    assert dict(eager.env) == {PLANT_ENV: "0", "OMP_NUM_THREADS": "1"}
    spec_cand = ReferenceEngineConfig(name="r", model_path="/m", spec=SpecConfig("/drafters/new"))
    d = parse_variants({"old-drafter": {"drafter": "/drafters/old"}}, {})
    assert base_engine_config(spec_cand, resolve_base("old-drafter", d, repo), build=None,
                              cache_dir=tmp_path).spec.draft_model_path == "/drafters/old"
    with pytest.raises(ABConfigError, match="not serving speculative"):
        base_engine_config(cand, resolve_base("old-drafter", d, repo), build=None, cache_dir=tmp_path)


# -- the schedule, against real paced servers -----------------------------------------------------


class FakeSide:
    """A side whose server is tests/fake_server.py in 'paced' mode (tokens at a set speed, slowed by
    the planted-slowdown variable exactly as the reference engine reads it)."""

    def __init__(self, role, tmp_path, plant="0", fail=False, events=None):
        from kimi_perf.launcher import LaunchSpec

        self.role, self.label, self.launches = role, f"fake {role}", 0
        self.events = events if events is not None else []  # (role, cpus) per launch, shared by both sides
        mode = "exit7" if fail else "paced"
        self.spec = LaunchSpec(name=f"fake-{role}", argv_for_port=lambda p: [sys.executable, str(HERE / "fake_server.py"),
                                                                            str(p), mode],
                               env={PLANT_ENV: plant, "FAKE_TOKEN_MS": "4"}, ready_timeout_s=30, log_dir=tmp_path)
        self.proc = None

    def start(self, cpus=()):
        from kimi_perf.bench import RunningServer
        from kimi_perf.launcher import ServerProcess

        self.launches += 1
        self.events.append((self.role, tuple(cpus)))
        self.proc = ServerProcess(dataclasses.replace(self.spec, cpus=tuple(cpus)), progress_every_s=60).start()
        return RunningServer(self.spec.name, "fake", self.proc.base_url, "m", self.proc, None, version="fake-1")

    def stop(self):
        if self.proc is not None:
            self.proc.stop(grace_s=2)
            self.proc = None


class StubSide:
    """A side whose server is never reached: for tests that replace measure_repeat."""

    def __init__(self, role):
        self.role, self.label = role, f"stub {role}"

    def start(self, cpus=()):
        from kimi_perf.bench import RunningServer

        return RunningServer(f"stub-{self.role}", "stub", "http://127.0.0.1:9", "m", None, None, version="s")

    def stop(self):
        pass


def _probes():
    from kimi_perf.ab.runner import Probe
    from kimi_perf.load.workload import Workload

    w = Workload(name="w", input_len=4, output_len=24, num_prompts=2, concurrency=1, warmup=1)
    return [Probe("single_stream", w, ("decode_tok_s",), ("engine_cpu_ms_per_tok",))]


def _prompts(w, i):
    return [[1, 2, 3, 4]] * w.num_prompts


@pytest.mark.slow
def test_abba_schedule_relaunches_every_block_and_catches_a_planted_slowdown(tmp_path):
    from kimi_perf.ab.runner import run_ab

    spec = ABSpec(threshold=0.05, min_blocks=3, max_blocks=6, repeats_per_block=2, blocks_per_launch=1)
    base, cand = FakeSide("base", tmp_path), FakeSide("candidate", tmp_path, plant="0.3")
    out = run_ab(base, cand, _probes(), spec, _prompts)
    d = out.decisions[0]
    assert d.verdict == "FAIL" and d.ratio == pytest.approx(1 / 1.3, rel=0.1), d.message()
    assert out.blocks == 3 and base.launches == cand.launches == 3 and out.stopped == "a gated metric FAILED"
    firsts = [p.first for p in out.pairs]
    assert firsts == ["base", "candidate", "candidate", "base", "base", "candidate"]  # ABBA
    assert all(math.isfinite(p.candidate["engine_cpu_ms_per_tok"]) for p in out.pairs)
    assert json.loads(json.dumps(out.to_json()))["decisions"][0]["verdict"] == "FAIL"
    aa = run_ab(FakeSide("base", tmp_path), FakeSide("candidate", tmp_path), _probes(), spec, _prompts)
    assert aa.decisions[0].verdict == "PASS", aa.decisions[0].message()


def test_a_base_that_does_not_start_is_named_and_keeps_what_was_measured(tmp_path):
    from kimi_perf.ab.runner import ABSideError, run_ab

    spec = ABSpec(min_blocks=2, max_blocks=2, repeats_per_block=1)
    with pytest.raises(ABSideError) as ei:
        run_ab(FakeSide("base", tmp_path, fail=True), FakeSide("candidate", tmp_path), _probes(), spec, _prompts)
    msg = str(ei.value)
    assert ei.value.role == "base" and "A/B base side [fake base]: server did not start" in msg
    assert "exited with code 7" in msg and "Fix:" in msg
    assert ei.value.outcome.error and ei.value.outcome.pairs == []


def test_pairs_measured_under_host_steal_are_redone(tmp_path, monkeypatch):
    from kimi_perf.ab import runner
    from kimi_perf.procstat import HostCPU

    ticks = iter(range(0, 10**6, 100))
    # every reading adds 100 jiffies; the first 4 repeats see 50% steal, later ones none
    calls = {"n": 0}

    def fake_host():
        calls["n"] += 1
        t = next(ticks)
        return HostCPU(total=t, steal=t // 2 if calls["n"] <= 8 else 400, idle=0)

    monkeypatch.setattr(runner, "host_cpu", fake_host)
    spec = ABSpec(min_blocks=2, max_blocks=2, repeats_per_block=1, blocks_per_launch=0, max_steal=0.05, max_redo=3)
    out = runner.run_ab(FakeSide("base", tmp_path), FakeSide("candidate", tmp_path), _probes(), spec, _prompts)
    assert sum(p.redone for p in out.pairs) >= 1
    assert len(out.pairs) == 2 and os.environ.get(PLANT_ENV) is None


@pytest.mark.slow
def test_a_git_base_server_runs_the_worktree_code_not_the_candidates(tmp_path):
    """`python -m` puts the working directory first on sys.path: a base started from the candidate's
    directory would silently run the candidate's code while the report says git:REF."""
    from kimi_perf.ab.runner import _check_source
    from kimi_perf.bench import RunningServer
    from kimi_perf.launcher import ServerProcess
    from kimi_perf.models.dummy import ensure_dummy_model
    from kimi_perf.profiles import DUMMY_SHAPES

    root = Path(__file__).resolve().parents[1]
    try:
        base = resolve_base("git:HEAD", {}, root)
    except ABConfigError as e:
        pytest.skip(f"no git history here: {e}")
    model = ensure_dummy_model("tiny-llama", DUMMY_SHAPES["tiny-llama"])
    cand = ReferenceEngineConfig(name="tiny-candidate", model_path=str(model), load_format="dummy", device="cpu",
                                 dtype="float32", context_length=256, max_running_requests=2, disable_cuda_graph=True)
    cfg = base_engine_config(cand, base, build=None, cache_dir=tmp_path)
    assert cfg.launch_spec(tmp_path).cwd == cfg.source_root
    with ServerProcess(cfg.launch_spec(tmp_path)) as proc:
        srv = RunningServer(cfg.name, "reference", proc.base_url, cfg.served_model_name, proc, cfg)
        info = srv.get_json("/server_info")
        assert Path(info["source_root"]).resolve() == Path(cfg.source_root).resolve() != root
        _check_source(srv, "base", type("S", (), {"label": "git:HEAD"})(), None)  # does not raise
        wrong = RunningServer(cfg.name, "reference", proc.base_url, "m", proc,
                              dataclasses.replace(cfg, source_root=str(root)))
        from kimi_perf.ab.runner import ABOutcome, ABSideError

        out = ABOutcome("b", "c", ABSpec(), ())
        with pytest.raises(ABSideError, match="runs the code in"):
            _check_source(wrong, "base", type("S", (), {"label": "git:HEAD"})(), out)


@pytest.mark.slow
def test_launch_rounds_alternate_which_side_launches_first_and_decide_only_after_whole_abba_cycles(tmp_path):
    """On the H200 the side launched second read ~1% faster on identical code; with the base always
    launched first that became the verdict's bias. Launch rounds of k blocks alternate the order and
    the comparison stops only at the end of a cycle of 2k blocks, even on a clear FAIL."""
    from kimi_perf.ab.runner import run_ab

    events: list = []
    spec = ABSpec(threshold=0.05, min_blocks=2, max_blocks=4, repeats_per_block=1, blocks_per_launch=2)
    base = FakeSide("base", tmp_path, events=events)
    cand = FakeSide("candidate", tmp_path, plant="0.3", events=events)
    out = run_ab(base, cand, _probes(), spec, _prompts)
    assert [e[0] for e in events] == ["base", "candidate", "candidate", "base"]
    assert out.blocks == 4 and out.decisions[0].verdict == "FAIL", out.decisions[0].message()
    assert [p.launch for p in out.pairs] == [0, 0, 1, 1]
    assert [x["round"] for x in out.launches] == [0, 0, 1, 1]
    assert out.cpus == {"pinned": False, "why": "ab.pin_cpus is false"}


def test_stop_reason_waits_for_the_end_of_a_launch_cycle():
    from kimi_perf.ab.runner import stop_reason

    fail = [_decision("FAIL")]
    spec = ABSpec(min_blocks=2, max_blocks=6, blocks_per_launch=3)
    assert stop_reason(fail, 3, spec, final=False) == ""  # one launch round: the order effect is in it
    assert stop_reason(fail, 6, spec, final=False) == "a gated metric FAILED"
    every = ABSpec(min_blocks=2, max_blocks=6, blocks_per_launch=1)
    assert stop_reason(fail, 3, every, final=False) == "a gated metric FAILED"
    assert (spec.launch_round(2), spec.launch_round(3), ABSpec(blocks_per_launch=0).launch_round(5)) == (0, 1, 0)


def _decision(verdict):
    from kimi_perf.ab.decide import ABDecision

    return ABDecision("decode_tok_s", "tok/s", "higher", "single_stream", verdict, 1.0, 1.0, 1.0, 1.0, 1.0, 0.9,
                      0.05, 3, 3, "")


def test_launch_schedule_is_validated_and_relaunch_is_its_older_spelling():
    assert parse_ab({"relaunch": False}, hardware="cuda").blocks_per_launch == 0
    assert parse_ab({"relaunch": True}, hardware="cpu").relaunch is True
    assert parse_ab({"blocks_per_launch": 3, "max_blocks": 6}, hardware="cuda").blocks_per_launch == 3
    with pytest.raises(ABConfigError, match="multiple of 2 x 3 = 6"):
        parse_ab({"blocks_per_launch": 3, "max_blocks": 8}, hardware="cuda")
    with pytest.raises(ABConfigError, match="not both"):
        parse_ab({"blocks_per_launch": 1, "relaunch": True}, hardware="cpu")
    with pytest.raises(ABConfigError, match="blocks_per_launch: True must be an integer"):
        parse_ab({"blocks_per_launch": True}, hardware="cpu")
    with pytest.raises(ABConfigError, match="pin_cpus"):
        parse_ab({"pin_cpus": "yes"}, hardware="cpu")


def test_parallel_launch_is_refused_for_engines_that_size_memory_from_what_is_free():
    from kimi_perf.ab.config import parallel_launch_problem
    from kimi_perf.engines.base import ReferenceEngineConfig
    from kimi_perf.engines.sglang import SGLangConfig
    from kimi_perf.engines.vllm import VLLMConfig

    assert parallel_launch_problem(ReferenceEngineConfig(name="r", model_path="/m")) is None
    assert parallel_launch_problem(VLLMConfig(name="v", model_path="/m", kv_cache_memory_bytes="8G")) is None
    why = parallel_launch_problem(VLLMConfig(name="v", model_path="/m", gpu_memory_utilization=0.4))
    assert why is not None and "#55827" in why and "kv_cache_memory_bytes" in why
    why = parallel_launch_problem(SGLangConfig(name="s", model_path="/m"))
    assert why is not None and "ab.parallel_launch false" in why


def test_cpu_plan_gives_whole_cores_to_client_and_equal_shares_to_the_sides():
    from kimi_perf.ab.pinning import plan_cpus

    smt = {c: {c, c + 8} if c < 8 else {c - 8, c} for c in range(16)}  # 8 cores x 2 threads
    p = plan_cpus(range(16), client=2, siblings=lambda c: smt[c])
    assert p.pinned and p.client == (0, 8)
    assert p.sides["base"] == (1, 9, 2, 10, 3, 11) and p.sides["candidate"] == (4, 12, 5, 13, 6, 14)
    assert not set(p.client) & set(p.sides["base"]) and not set(p.sides["base"]) & set(p.sides["candidate"])
    assert "client on CPUs 0,8" in p.describe() and p.to_json()["candidate"] == [4, 12, 5, 13, 6, 14]
    two = plan_cpus([0, 1], client=1, siblings=lambda c: {c})
    assert not two.pinned and "2 physical core(s) available (0-1)" in two.why
    assert two.to_json() == {"pinned": False, "why": two.why}


def test_run_files_record_the_hosts_cores_and_smt_threads():
    """Whether a host-bound engine's busy processes can share a core's hyperthreads, and whether
    pinning can give each side whole cores, depend on this topology: every run.json carries it."""
    from kimi_perf.machine import cpu_topology, machine_info

    smt = {c: {c, c + 8} if c < 8 else {c - 8, c} for c in range(16)}
    assert cpu_topology(range(16), lambda c: smt[c]) == {"logical": 16, "cores": 8, "threads_per_core": 2}
    # an affinity mask holding one thread of each of 3 cores: no SMT sharing is possible inside it
    assert cpu_topology([0, 1, 2], lambda c: smt[c]) == {"logical": 3, "cores": 3, "threads_per_core": 1}
    assert set(machine_info()["cpu_topology"]) == {"logical", "cores", "threads_per_core"}


def test_a_pinned_launch_runs_the_server_on_its_cpus_only(tmp_path):
    """The affinity is set in the child before exec: the server and every thread it starts run on
    the plan's CPUs (read back from the kernel)."""
    from kimi_perf.launcher import LaunchSpec, ServerProcess

    cpu = max(os.sched_getaffinity(0))
    spec = LaunchSpec(name="pinned", argv_for_port=lambda p: [sys.executable, str(HERE / "fake_server.py"), str(p),
                                                              "paced"], ready_timeout_s=30, log_dir=tmp_path,
                      cpus=(cpu,))
    with ServerProcess(spec, progress_every_s=60) as proc:
        assert os.sched_getaffinity(proc.pid) == {cpu}


def test_launch_together_overlaps_the_starts_and_returns_each_sides_failure():
    """ab.parallel_launch: both blocking starts run at once (an 8B launch is 15-30 s on the H200, and
    one after the other they were ~40% of a comparison's wall time); a failure is returned, not raised,
    so the side that did start can be registered and stopped."""
    import threading
    import time as _time

    from kimi_perf.ab.runner import launch_together
    from kimi_perf.launcher import ServerDied

    spans: dict[str, tuple[float, float]] = {}
    gate = threading.Barrier(2, timeout=5)  # each start waits for the other: only overlapping starts pass

    def start(role):
        t = _time.monotonic()
        gate.wait()
        spans[role] = (t, _time.monotonic())
        if role == "candidate":
            raise ServerDied("candidate exited with code 7", 7)
        return f"server-{role}"

    from concurrent.futures import ThreadPoolExecutor

    with ThreadPoolExecutor(max_workers=2) as ex:
        res = launch_together(("base", "candidate"), start, ex)
    assert res["base"][0] == "server-base" and isinstance(res["candidate"][0], ServerDied)
    assert spans["base"][0] < spans["candidate"][1] and spans["candidate"][0] < spans["base"][1]


@pytest.mark.slow
def test_parallel_launch_rounds_measure_like_sequential_ones_and_a_failed_side_stops_the_other(tmp_path):
    from kimi_perf.ab.runner import ABSideError, run_ab

    spec = ABSpec(threshold=0.05, min_blocks=2, max_blocks=4, repeats_per_block=1, blocks_per_launch=2,
                  parallel_launch=True)
    assert "both sides launched together" in spec.launch_schedule
    events: list = []
    base = FakeSide("base", tmp_path, events=events)
    cand = FakeSide("candidate", tmp_path, plant="0.3", events=events)
    out = run_ab(base, cand, _probes(), spec, _prompts)
    assert out.blocks == 4 and out.decisions[0].verdict == "FAIL", out.decisions[0].message()
    assert [e[0] for e in events] == ["base", "candidate", "candidate", "base"]  # staggered: ABBA kept
    assert [(x["role"], x["round"], x["together"]) for x in out.launches] == [
        ("base", 0, True), ("candidate", 0, True), ("candidate", 1, True), ("base", 1, True)]
    cand2 = FakeSide("candidate", tmp_path)
    with pytest.raises(ABSideError) as ei:
        run_ab(FakeSide("base", tmp_path, fail=True), cand2, _probes(), spec, _prompts)
    assert ei.value.role == "base" and "server did not start" in str(ei.value)
    assert cand2.launches == 1 and cand2.proc is None  # it had started: stopped, not left running


def test_pairs_per_probe_and_a_probe_retired_once_its_metrics_passed(tmp_path, monkeypatch):
    """ab.repeats gives each probe its own pairs per block; ab.retire_decided stops measuring a probe
    (its warm-up included) once every metric it gates PASSED at a decision point, and its verdict
    stands. Decisions are scripted so the schedule, not the noise, is what is tested."""
    from kimi_perf.ab import runner
    from kimi_perf.ab.decide import ABDecision

    def scripted(out, family, *, final):
        blocks = {p.probe: p.block + 1 for p in out.pairs}
        top_ok = out.blocks >= 4
        return [ABDecision("decode_tok_s", "tok/s", "higher", "single_stream", "PASS", 1, 1, 1, 1, 1, 0.95, 0.05,
                           3, blocks.get("single_stream", 0), "scripted"),
                ABDecision("output_throughput", "tok/s", "higher", "c2", "PASS" if top_ok else "INCONCLUSIVE", 1, 1,
                           1, 1, 1, 0.95, 0.05, 3, blocks.get("c2", 0), "scripted")]

    monkeypatch.setattr(runner, "_decide_all", scripted)
    w = _probes()[0].workload
    probes = [runner.Probe("single_stream", w, ("decode_tok_s",)),
              runner.Probe("c2", dataclasses.replace(w, concurrency=2), ("output_throughput",))]
    warmed: list = []
    real_measure = runner.measure_repeat

    peers: list = []

    def measure(server, workload, prompts, *, label="", max_error_rate=0.02, peer=None):
        if "warm-up" in label:
            warmed.append(label)
        else:
            peers.append((server, peer))
        return real_measure(server, workload, prompts, label=label, max_error_rate=max_error_rate, peer=peer)

    monkeypatch.setattr(runner, "measure_repeat", measure)
    spec = ABSpec(min_blocks=2, max_blocks=6, repeats_per_block=1, repeats={"top": 2}, blocks_per_launch=1,
                  retire_decided=True)
    assert "a probe stops once its metrics PASS" in spec.launch_schedule
    out = runner.run_ab(FakeSide("base", tmp_path), FakeSide("candidate", tmp_path), probes, spec, _prompts)
    per_block = [(p.block, p.probe) for p in out.pairs]
    assert per_block == [(0, "single_stream"), (0, "c2"), (0, "c2"), (1, "single_stream"), (1, "c2"), (1, "c2"),
                         (2, "c2"), (2, "c2"), (3, "c2"), (3, "c2")]
    assert out.retired == {"single_stream": 2} and out.blocks == 4 and out.stopped == "every gated metric decided"
    # blocks 1-2 warmed up both probes on both sides, blocks 3-4 only c2
    assert len(warmed) == 8 + 4 and not any("single_stream" in x for x in warmed[8:])
    assert out.to_json()["retired"] == {"single_stream": 2}
    # every measured repeat also reads the waiting side's CPU use (peer_cpu_util)
    assert peers and all(p is not None and p is not s for s, p in peers)
    assert all("peer_cpu_util" in pr.base and "peer_cpu_util" in pr.candidate for pr in out.pairs)


def test_pairs_per_probe_are_validated():
    assert parse_ab({"repeats": {"top": 1}}, hardware="cuda").repeats_for("c128") == 1
    assert parse_ab({"repeats": {"top": 1}}, hardware="cuda").repeats_for("single_stream") == 3
    assert parse_ab({"repeats": {"top": 1}}, hardware="cuda").describe_repeats() == "3 pairs (top 1)"
    with pytest.raises(ABConfigError, match='probe "single_stream" or "top"'):
        parse_ab({"repeats": {"c128": 1}}, hardware="cuda")
    with pytest.raises(ABConfigError, match="must map a probe"):
        parse_ab({"repeats": 2}, hardware="cuda")
    with pytest.raises(ABConfigError, match="retire_decided"):
        parse_ab({"retire_decided": "yes"}, hardware="cuda")


def test_a_final_inconclusive_verdict_says_where_its_noise_sat():
    """At the end of the budget an undecided verdict carries the noise note (kimi_perf.ab.variance):
    here the launch rounds disagree and the waiting side spun, and the reason says both; a decided
    verdict keeps its plain reason, and so does an undecided one before the budget is spent."""
    from kimi_perf.ab import runner

    pairs = []
    for block in range(4):
        launch = block // 2
        for i in range(3):
            c = 100.0 * (1.06 if launch else 0.96) * (1 + 0.002 * i)
            pairs.append(runner.PairRecord(block, i, "single_stream", "base", {"decode_tok_s": 100.0, "peer_cpu_util": 1.0},
                                           {"decode_tok_s": c, "peer_cpu_util": 0.9}, launch=launch))
    out = runner.ABOutcome("b", "c", ABSpec(threshold=0.025, min_blocks=2, max_blocks=4), tuple(_probes()), pairs=pairs)
    [d] = runner._decide_all(out, 1, final=True)
    assert d.verdict == "INCONCLUSIVE" and "after the whole budget" in d.reason
    assert "most between launches: more launch rounds" in d.reason and "waiting side used 0.95 cores" in d.reason
    assert d.message().endswith(d.reason)  # the message every report prints carries it
    [d] = runner._decide_all(out, 1, final=False)
    assert "noise" not in d.reason
    same = [dataclasses.replace(p, candidate={"decode_tok_s": 100.0}) for p in pairs]
    [d] = runner._decide_all(dataclasses.replace(out, pairs=same), 1, final=True)
    assert d.verdict == "PASS" and "noise" not in d.reason


# -- the top probe sized on the machine (ab.top_min_steady_s) ------------------------------------


def test_the_top_probe_grows_until_its_steady_window_would_last_long_enough():
    """The window lasts about as long as the N - C requests after the first batch, so N - C scales by
    target / window, in whole batches of C, from the shorter side's window; a long enough window,
    a missing one, or a size past the cap are each said."""
    from kimi_perf.ab.runner import size_for_window
    from kimi_perf.load.workload import Workload

    w = Workload(name="top", input_len=64, output_len=64, num_prompts=384, concurrency=128)
    rec = size_for_window(w, {"base": 1.0, "candidate": 0.9}, 3.0)
    assert rec["used"] == 1024 and not rec["capped"]  # 128 + ceil(256 x 3 / 0.9) = 982 -> 8 batches
    assert "0.90 s < 3 s" in rec["why"] and "384 -> 1024" in rec["why"]
    assert size_for_window(w, {"base": 4.0, "candidate": 3.5}, 3.0)["used"] == 384  # never shrinks
    capped = size_for_window(w, {"base": 0.01, "candidate": 0.02}, 3.0)
    assert capped["used"] == 384 * 8 and capped["capped"] and "capped at 8x" in capped["why"]
    one_batch = dataclasses.replace(w, num_prompts=8, concurrency=8)  # its window is about one request
    assert size_for_window(one_batch, {"base": 0.5, "candidate": 0.6}, 3.0)["used"] == 56  # 8 + 8 x 6
    none = size_for_window(w, {"base": float("nan"), "candidate": 1.0}, 3.0)
    assert none["used"] == 384 and "no steady window on base" in none["why"]
    from kimi_perf.ab.config import TOP_MAX_GROWTH
    from kimi_perf.profile_schema import AB

    assert TOP_MAX_GROWTH == 8 and "at most 8x" in AB["top_min_steady_s"]  # the profile docs say the cap


def test_an_ab_sizes_its_top_probe_once_and_every_pair_runs_that_size(monkeypatch):
    """One discarded repeat per side after the first launch round; the pairs of every later block
    run the size it gave, the result keeps the configured workload (its key), and run.json and the
    report say what was run."""
    from kimi_perf.ab import runner
    from kimi_perf.load.workload import Workload
    from kimi_perf.report import ab_detail_lines

    seen: list = []

    def measure(server, workload, prompts, *, label="", max_error_rate=0.02, peer=None):
        assert len(prompts) == workload.num_prompts
        seen.append((label, workload.num_prompts))
        c = workload.concurrency
        # 100 requests a second once the batch is full: a window of (N - C) / 100 s
        return {"decode_tok_s": 50.0, "output_throughput": 900.0, "host_steal_fraction": 0.0,
                "steady_window_s": (workload.num_prompts - c) / 100 if workload.num_prompts > c else float("nan")}

    monkeypatch.setattr(runner, "measure_repeat", measure)
    top = Workload(name="top", input_len=4, output_len=8, num_prompts=96, concurrency=32)
    single = Workload(name="one", input_len=4, output_len=8, num_prompts=1, concurrency=1)
    probes = [runner.Probe("single_stream", single, ("decode_tok_s",)), runner.Probe("c32", top, ("output_throughput",))]
    spec = ABSpec(min_blocks=2, max_blocks=4, repeats_per_block=1, blocks_per_launch=2, top_min_steady_s=2.0)
    assert "top probe sized to a 2 s steady window" in spec.launch_schedule
    out = runner.run_ab(StubSide("base"), StubSide("candidate"), probes, spec, lambda w, i: [[1, 2]] * w.num_prompts)
    sizing = [x for x in seen if "sizing" in x[0]]
    assert sizing == [("base c32 sizing", 96), ("candidate c32 sizing", 96)]  # once, at the configured size
    assert {n for lbl, n in seen if lbl.startswith("A/B") and "c32" in lbl} == {256}  # 32 + 200 -> 8 batches
    assert {n for lbl, n in seen if lbl.startswith("A/B") and "single_stream" in lbl} == {1}
    assert out.probes[1].workload.num_prompts == 96  # the configured size names the result
    rec = out.to_json()["sized"]["c32"]
    assert rec["configured"] == 96 and rec["used"] == 256 and rec["steady_window_s"] == {"base": 0.64,
                                                                                         "candidate": 0.64}
    lines = ab_detail_lines([{"nodeid": "perf_tests/t.py::test_x", "ab": out.to_json()}])
    assert any("c32 sized: steady window 0.64 s < 2 s (ab.top_min_steady_s): 96 -> 256 prompts" in x for x in lines)
    with pytest.raises(ABConfigError, match="top_min_steady_s"):
        parse_ab({"top_min_steady_s": 0}, hardware="cuda")
    assert parse_ab({"top_min_steady_s": 3}, hardware="cuda").top_min_steady_s == 3


def test_pair_segments_cancel_a_drift_across_the_pair_that_one_stream_a_side_turns_into_noise(monkeypatch):
    """The host's speed falls steadily while a pair is measured (the 2-core VM's CPU speed wanders on a
    scale of seconds). One stream a side: the side measured second reads slower, by an amount that
    follows the drift. Two segments a side in A B B A order with each side the mean of its segments:
    the sides agree exactly, whatever the drift, and the records say what was run."""
    from kimi_perf.ab import runner
    from kimi_perf.load.workload import Workload

    clock = [0.0]
    seen: list = []

    def measure(server, workload, prompts, *, label="", max_error_rate=0.02, peer=None):
        if label.startswith("A/B"):
            seen.append((label.split()[1], workload.output_len, prompts[0][0]))
        start = clock[0]
        clock[0] += workload.output_len / 10.0  # 10 tokens a second
        mid = (start + clock[0]) / 2
        return {"decode_tok_s": 100.0 * (1 - 0.001 * mid), "num_requests": 1.0, "total_output_tokens":
                float(workload.output_len), "host_steal_fraction": 0.01 if "candidate" in label else 0.0,
                "ttft_ms_p50": float("nan") if len(seen) % 2 else 5.0}

    monkeypatch.setattr(runner, "measure_repeat", measure)
    single = Workload(name="one", input_len=4, output_len=48, num_prompts=1, concurrency=1)
    probes = [runner.Probe("single_stream", single, ("decode_tok_s",))]

    def ratios(k):
        clock[0] = 0.0
        seen.clear()
        spec = ABSpec(min_blocks=2, max_blocks=2, repeats_per_block=2, max_steal=0.5, pair_segments=k)
        out = runner.run_ab(StubSide("base"), StubSide("candidate"), probes, spec, lambda w, i: [[i, 1]])
        return out, [p.candidate["decode_tok_s"] / p.base["decode_tok_s"] for p in out.pairs]

    _, plain = ratios(1)
    assert all(abs(r - 1) > 1e-3 for r in plain)  # the drift shows up as a difference of the sides
    out, seg = ratios(2)
    assert all(abs(r - 1) < 1e-12 for r in seg)
    # A B B A: half-length segments, the i-th of each side on the same prompts
    assert [s[:2] for s in seen[:4]] == [("base", 24), ("candidate", 24), ("candidate", 24), ("base", 24)]
    assert seen[0][2] == seen[1][2] and seen[2][2] == seen[3][2] and seen[0][2] != seen[2][2]
    rec = out.pairs[0].candidate
    assert rec["segments"] == 2 and rec["num_requests"] == 2 and rec["total_output_tokens"] == 48
    assert rec["host_steal_fraction"] == 0.01 and rec["ttft_ms_p50"] == 5.0  # worst steal; NaN left out
    assert "pairs in 4 interleaved segments" in out.spec.launch_schedule
    assert runner.segment_order(4) == [0, 1, 1, 0, 1, 0, 0, 1]
    with pytest.raises(ABConfigError, match="pair_segments 0"):
        parse_ab({"pair_segments": 0}, hardware="cpu")
