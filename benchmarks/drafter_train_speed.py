"""The EAGLE-3 drafter trainer's speed on a recipe's own data, and where a training step's time goes.

Why this exists: the h200-embedded build trained its drafter (one decoder layer, hidden 576, TTT 7,
draft vocabulary 8,192, batches of 16,384 padded tokens) at 82.7K tok/s on an H100, about 200 ms a
step for a model that small, which points at kernel launches and host syncs rather than FLOPs (a
suspicion until a trace shows it). A GPU comes in short leases, so one command has to say whether a
change to the trainer helped and where the rest of the step goes. This script trains the recipe's
drafter exactly as the pipeline does (``kimi_perf.eagle3.pipeline.build_drafter``: the same draft
vocabulary, feature source and ``train_drafter``) on the recipe's already generated samples -- it
never generates any -- and reports

* tokens/s (real tokens, the trainer's own measure; padded tokens/s beside it) and ms/step over
  ``--steps`` steady-state steps, after ``--warmup`` steps, with the device synchronised at both ends;
* peak CUDA memory of those steps;
* a torch.profiler trace of ``--profile-steps`` steps: the time of each phase the trainer labels
  (``kimi:batch``, ``kimi:collate``, ``kimi:ttt_forward``, ``kimi:backward``, ``kimi:optimizer``),
  the 25 ops with the most self device time (self CPU time on a CPU), and per step the CUDA calls
  that synchronise the host with the device and the ops that read a number back.

It writes one JSON (``--out``) and prints progress lines as it goes. On a GPU lease whose cache holds
the recipe's samples (``python -m kimi_perf.eagle3.carry unpack .carry/samples/*``, the packs
``scripts/h200_engine_ab.sh prepare-data`` restores from the commits in
``benchmarks/h200-drafter-lease/3-data/packs.txt``; docs/eagle3.md)::

    python benchmarks/drafter_train_speed.py --profile h200-embedded --out $OUT/drafter-train-speed.json

A smoke run on a CPU, on the CPU recipe's cached samples::

    python benchmarks/drafter_train_speed.py --profile embedded-cpu --max-samples 24 --steps 3 --warmup 1 \\
        --profile-steps 2
"""

from __future__ import annotations

import argparse
import os
import random
import shutil
import sys
import tempfile
import time
from collections.abc import Callable, Sequence
from dataclasses import replace
from pathlib import Path
from typing import Any

import torch

PHASES = ("kimi:batch", "kimi:collate", "kimi:ttt_forward", "kimi:backward", "kimi:optimizer")
# CUDA runtime calls that make the host wait for the device: their count per step is what a sync-free
# step drives down (a tensor read back or indexed by a mask shows here as a cudaStreamSynchronize)
DEVICE_SYNCS = ("cudaStreamSynchronize", "cudaDeviceSynchronize", "cudaEventSynchronize", "cudaMemcpy")
# the ops that read a number back or index by a mask, on any device: on a GPU each is a sync when its
# tensor is on the GPU, but the count includes reads of CPU tensors (AdamW's per-parameter step counter),
# which are not
SCALAR_READS = ("aten::_local_scalar_dense", "aten::item", "aten::nonzero")
NEVER = 10**9  # checkpoint_every / log_every that never fire (neither is part of the config digest)


def _log(msg: str) -> None:
    from kimi_perf.progress import log

    log(f"drafter speed: {msg}")


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


class _StampedLoader:
    """The trainer's feature loader, noting the first batch the trainer asks for (after a device
    sync, and starting the profiler there if one is given) and the real and padded tokens of each:
    the trainer's setup before its loop (model, optimiser, reading stored features, resuming from a
    checkpoint) stays out of the timing and the trace."""

    def __init__(self, inner: Any, device: torch.device, on_first: Callable[[], None] | None) -> None:
        self.inner = inner
        # read once: a loader may build ``lengths`` on each read, and its cost would be timed as the
        # trainer's (reading it per sample of each batch once put 1.1 s of host time into every step)
        self.lengths: dict[str, int] = inner.lengths
        self.device = device
        self.on_first = on_first
        self.t_first: float | None = None
        self.batches = 0
        self.tokens = 0
        self.padded = 0

    def batch(self, ids: Sequence[str], max_len: int) -> list[Any]:
        if self.t_first is None:
            _sync(self.device)
            if self.on_first is not None:
                self.on_first()
            self.t_first = time.perf_counter()
        lens = [min(self.lengths[i], max_len) for i in ids]
        self.batches += 1
        self.tokens += sum(lens)
        self.padded += max(lens) * len(lens)
        return self.inner.batch(ids, max_len)  # type: ignore[no-any-return]


class _StampedSource:
    """The recipe's feature source as train_drafter sees it, handing out stamped loaders. A stored
    set's loader (every training sample's rows read into host memory) is read once and shared by the
    warm-up, timed and profiled runs."""

    def __init__(self, src: Any, device: torch.device) -> None:
        self.src = src
        self.layers = src.layers
        self.device = device
        self._held: dict[frozenset[str], Any] = {}
        self.on_first: Callable[[], None] | None = None
        self.last: _StampedLoader | None = None

    def loader(self, ids: set[str]) -> _StampedLoader:
        key = frozenset(ids)
        if key not in self._held:
            self._held[key] = self.src.loader(ids)
        self.last = _StampedLoader(self._held[key], self.device, self.on_first)
        return self.last


def _device_time(e: Any, self_only: bool) -> float:
    """An event's device time in µs across torch versions (device_* names since 2.4, cuda_* before)."""
    names = ("self_device_time_total", "self_cuda_time_total") if self_only else ("device_time_total", "cuda_time_total")
    for n in names:
        v = getattr(e, n, None)
        if v is not None:
            return float(v)
    return 0.0


def _profile_summary(prof: Any, steps: int, on_cuda: bool) -> dict[str, Any]:
    from torch.autograd import DeviceType

    phases: dict[str, dict[str, float]] = {}
    for ev in prof.events():
        if ev.name not in PHASES:
            continue
        d = phases.setdefault(ev.name, {"count": 0, "cpu_wall_ms": 0.0, "device_kernel_ms": 0.0, "device_span_ms": 0.0})
        if ev.device_type == DeviceType.CPU:
            # the host's time inside the label, and the device time of the kernels launched from it
            d["count"] += 1
            d["cpu_wall_ms"] += ev.cpu_time_total / 1e3
            d["device_kernel_ms"] += _device_time(ev, self_only=False) / 1e3
        else:  # the label's span on the device's timeline (a GPU user annotation)
            d["device_span_ms"] += ev.time_range.elapsed_us() / 1e3
    for d in phases.values():  # each phase runs once a step; the trace starts inside the first kimi:batch
        for k in ("cpu_wall_ms", "device_kernel_ms", "device_span_ms"):
            d[k + "_per_call"] = d[k] / max(d["count"], 1)
    avgs = [e for e in prof.key_averages() if not e.key.startswith(("kimi:", "ProfilerStep"))]

    def order(e: Any) -> float:
        return _device_time(e, self_only=True) if on_cuda else float(e.self_cpu_time_total)

    top = [{"name": e.key, "count": e.count, "self_device_ms": _device_time(e, self_only=True) / 1e3,
            "device_total_ms": _device_time(e, self_only=False) / 1e3, "self_cpu_ms": e.self_cpu_time_total / 1e3,
            "cpu_total_ms": e.cpu_time_total / 1e3}
           for e in sorted(avgs, key=order, reverse=True)[:25]]
    counts = {e.key: e.count for e in prof.key_averages()}
    per_step = max(steps, 1)
    return {"steps": steps, "phases": phases, "top_ops_by": "self_device_time" if on_cuda else "self_cpu_time",
            "top_ops": top,
            "device_syncs_per_step": {k: counts[k] / per_step for k in DEVICE_SYNCS if k in counts},
            "scalar_reads_per_step": {k: counts[k] / per_step for k in SCALAR_READS if k in counts}}


def _phase_table(phases: dict[str, dict[str, float]]) -> str:
    rows = [f"  {'phase':<18} {'calls':>5} {'host ms/call':>13} {'kernels ms/call':>16} {'device span ms/call':>20}"]
    for name in PHASES:
        d = phases.get(name)
        if d:
            rows.append(f"  {name:<18} {int(d['count']):>5} {d['cpu_wall_ms_per_call']:>13.2f} "
                        f"{d['device_kernel_ms_per_call']:>16.2f} {d['device_span_ms_per_call']:>20.2f}")
    return "\n".join(rows)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--profile", default="h200-embedded", help="profile name or JSON path whose eagle3.recipe to train")
    ap.add_argument("--steps", type=int, default=60, help="timed training steps (default 60)")
    ap.add_argument("--warmup", type=int, default=10, help="steps before the timed ones (default 10)")
    ap.add_argument("--profile-steps", type=int, default=8,
                    help="steps traced with torch.profiler after the timed run (default 8; 0: no trace)")
    ap.add_argument("--device", default=None,
                    help="train on this device, the target's forward of an online recipe too (default: cuda if "
                         "available, else cpu)")
    ap.add_argument("--max-samples", type=int, default=None,
                    help="train on this many of the recipe's training samples (a seeded choice; for a quick "
                         "CPU smoke run). The draft vocabulary is still built from all of them")
    ap.add_argument("--threads", type=int, default=0, help="torch CPU threads (default: torch's)")
    ap.add_argument("--cache-root", type=Path, default=None,
                    help="root of the drafter pipeline's cache (default: kimi_perf's cache root)")
    ap.add_argument("--out", type=Path, default=Path("perf-report/drafter-train-speed.json"))
    a = ap.parse_args(argv)
    if a.steps < 1 or a.warmup < 0 or a.profile_steps < 0:
        ap.error("--steps must be >= 1, --warmup and --profile-steps >= 0")

    from kimi_perf.atomic import atomic_write_json
    from kimi_perf.eagle3.data import read_samples
    from kimi_perf.eagle3.pipeline import cache_dirs, feature_source, load_target_norm, load_target_tensors
    from kimi_perf.eagle3.shipped import _profile_recipe, recipe_key
    from kimi_perf.eagle3.train import train_drafter
    from kimi_perf.eagle3.vocab import build_vocab_maps, count_tokens
    from kimi_perf.machine import commit_info, machine_info
    from kimi_perf.models.embedded import ensure_embedded_model, model_fingerprint

    t_start = time.monotonic()
    prof_json, recipe = _profile_recipe(a.profile)
    if (prof_json.get("model") or {}).get("source") != "embedded":
        raise SystemExit(f"profile {a.profile}: the drafter pipeline's recipes train on the embedded model; "
                         f"this profile's model is {prof_json.get('model')}")
    if a.threads:
        torch.set_num_threads(a.threads)
    device = torch.device(a.device or ("cuda" if torch.cuda.is_available() else "cpu"))
    if a.device and recipe.features.device != device.type:
        # an online recipe's training rows come from the target's forward in the trainer's loop: run it
        # where the drafter trains (h200-embedded's CUDA target on a CPU box, for a smoke run)
        recipe = replace(recipe, features=replace(recipe.features, device=device.type))
    target = ensure_embedded_model()
    fp = model_fingerprint(target.path)
    data_dir, feat_dir, _ = cache_dirs(recipe, fp, a.cache_root)
    samples_path = data_dir / "samples.jsonl"
    samples = read_samples(samples_path)
    if not samples:
        raise SystemExit(f"profile {a.profile}: no generated samples at {samples_path}. This benchmark trains on "
                         "the recipe's samples and never generates them: build the recipe's data first (the "
                         "pipeline, `python -m kimi_perf.eagle3.generate --profile ...`, or on a lease "
                         "`python -m kimi_perf.eagle3.carry unpack .carry/samples/*` after `bash scripts/h200_engine_ab.sh "
                         "prepare-data` here)")
    train = [s for s in samples.values() if s.split == "train"]
    heldout = [s for s in samples.values() if s.split == "heldout"]
    if not train:
        raise SystemExit(f"{samples_path}: {len(samples)} samples, none of them a training sample")
    _log(f"profile {a.profile}, {len(train)} training samples in {samples_path}")

    # the draft vocabulary as build_drafter makes it: from every training sample's assistant tokens
    tcfg, embed, lm = load_target_tensors(target.path)
    counts = count_tokens(((s.ids, s.loss_mask) for s in train), int(tcfg["vocab_size"]))
    d2t_np, t2d_np = build_vocab_maps(counts, recipe.train.draft_vocab_size)
    d2t, t2d = torch.from_numpy(d2t_np), torch.from_numpy(t2d_np)
    norm = load_target_norm(target.path)
    if a.max_samples is not None and a.max_samples < len(train):
        train = sorted(random.Random(0).sample(sorted(train, key=lambda s: s.id), a.max_samples), key=lambda s: s.id)
        _log(f"--max-samples: training on {len(train)} of them")
    # stored features are extracted only where the cache lacks them (the pipeline's resumable stage);
    # an online recipe stores its held-out rows, as the pipeline does, and computes training rows per batch
    _log(f"feature source ({'online' if recipe.features.online else 'stored'}) in {feat_dir}")
    store = feature_source(recipe, [*train, *heldout], heldout, target.path, feat_dir, fp)
    in_store = set(store.sample_ids)
    train_ids = [s.id for s in train if s.id in in_store]
    if not train_ids:
        raise SystemExit(f"{feat_dir}: none of the {len(train)} training samples has features (longer than "
                         f"max_seq_len {recipe.train.max_seq_len}?)")
    src = _StampedSource(store, device)
    base_cfg = replace(recipe.train, device=str(device))
    _log(f"device {device}, {len(train_ids)} training samples, batches of {base_cfg.batch_tokens} tokens, "
         f"TTT {base_cfg.ttt_steps}, draft vocab {base_cfg.draft_vocab_size}; setup took "
         f"{time.monotonic() - t_start:.0f}s")

    report: dict[str, Any] = {
        "profile": a.profile, "recipe_digest": recipe_key(recipe), "target_fingerprint": fp,
        "device": str(device),
        "device_name": torch.cuda.get_device_name(device) if device.type == "cuda" else
        f"{machine_info()['cpu']} ({torch.get_num_threads()} torch threads)",
        "torch": torch.__version__, "cuda": torch.version.cuda, "commit": commit_info().get("id"),
        "train_samples": len(train_ids), "batch_tokens": base_cfg.batch_tokens, "ttt_steps": base_cfg.ttt_steps,
        "draft_vocab_size": base_cfg.draft_vocab_size, "features": "online" if recipe.features.online else "stored",
        "warmup_steps": a.warmup, "steps_requested": a.steps,
    }

    def run(label: str, workdir: Path, cfg: Any, stop: int) -> tuple[Any, _StampedLoader, float]:
        _sync(device)
        t0 = time.perf_counter()
        _, res = train_drafter(src, train_ids, tcfg, embed, lm, d2t, t2d, workdir, cfg, target_norm=norm,
                               stop_after_steps=stop, heldout_ids=None)
        _sync(device)
        t1 = time.perf_counter()
        view = src.last
        assert view is not None
        _log(f"{label}: steps {res.resumed_from_step + 1}-{res.steps} in {t1 - t0:.1f}s "
             f"(trainer setup {((view.t_first or t1) - t0):.1f}s)")
        return res, view, t1

    # Warm-up, then timed steps that resume from the warm-up's checkpoint. Why resume rather than a
    # second fresh run in another workdir: the timed steps are then the steps warmup+1..warmup+steps of
    # a real run (the optimiser's state exists, the learning rate is past step 0, the data order is the
    # schedule's), and process-wide first-use costs (CUDA context, cuBLAS handles, the allocator's pool,
    # the RoPE table) fall in the warm-up. The warm-up checkpoints exactly at its last step; the timed
    # and profiled runs get a copy of that checkpoint each (so neither sees the other's steps) and never
    # checkpoint or log before the end (checkpoint_every and log_every are not part of the config digest,
    # so the resume is accepted). Their clocks start at the first batch they ask for, after a device
    # sync, and stop after train_drafter returns and the device is synchronised again.
    with tempfile.TemporaryDirectory(prefix="kimi-drafter-speed-") as tmp:
        root = Path(tmp)
        warm_tokens = 0
        if a.warmup:
            _log(f"warm-up: {a.warmup} steps")
            warm, _, _ = run("warm-up", root / "warm",
                             replace(base_cfg, checkpoint_every=a.warmup, log_every=a.warmup), a.warmup)
            warm_tokens = warm.tokens
            if warm.steps < a.warmup:
                raise SystemExit(f"the recipe's schedule has only {warm.steps} steps on these samples; "
                                 "lower --warmup or raise --max-samples")
        for name in ("timed", "profiled"):
            (root / name).mkdir()
            if a.warmup:
                shutil.copy2(root / "warm" / "train_state.pt", root / name / "train_state.pt")
        quiet = replace(base_cfg, checkpoint_every=NEVER, log_every=NEVER)

        _log(f"timed: {a.steps} steps")
        if device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(device)
        res, view, t_end = run("timed", root / "timed", quiet, a.steps)
        steps = res.steps - res.resumed_from_step
        if res.resumed_from_step != a.warmup:
            raise SystemExit(f"the timed run resumed at step {res.resumed_from_step}, not {a.warmup}")
        if steps < 1 or view.t_first is None:
            raise SystemExit("the timed run trained no step: the recipe's schedule ended in the warm-up")
        el = t_end - view.t_first
        report.update({
            "steps": steps, "schedule_end_reached": steps < a.steps,
            "seconds": el, "ms_per_step": 1e3 * el / steps,
            "tokens": view.tokens, "padded_tokens": view.padded,
            "tokens_per_s": view.tokens / el, "padded_tokens_per_s": view.padded / el,
            "trainer_tokens_per_s": res.tokens_per_s, "trainer_tokens": res.tokens - warm_tokens,
            "final_loss": res.final_loss,
        })
        if device.type == "cuda":
            report["peak_memory_mib"] = {"allocated": torch.cuda.max_memory_allocated(device) / 2**20,
                                         "reserved": torch.cuda.max_memory_reserved(device) / 2**20}
        if steps < a.steps:
            _log(f"the schedule ended after {steps} timed steps (its end also wrote a checkpoint, inside the timing)")
        _log(f"timed: {steps} steps, {report['tokens_per_s']:,.0f} tok/s ({report['padded_tokens_per_s']:,.0f} padded "
             f"tok/s), {report['ms_per_step']:.1f} ms/step"
             + (f", peak {report['peak_memory_mib']['allocated']:,.0f} MiB allocated" if device.type == "cuda" else ""))
        a.out.parent.mkdir(parents=True, exist_ok=True)
        atomic_write_json(a.out, report)  # the timing survives a profiler that fails below

        if a.profile_steps:
            from torch.profiler import ProfilerActivity, profile

            acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.type == "cuda" else [])
            prof = profile(activities=acts)
            started: list[bool] = []

            def start() -> None:
                prof.start()
                started.append(True)

            src.on_first = start  # the trace starts at the first batch: the trainer's setup stays out of it
            _log(f"profiled: {a.profile_steps} steps under torch.profiler")
            try:
                pres, _, _ = run("profiled", root / "profiled", quiet, a.profile_steps)
            finally:
                src.on_first = None
                if started:
                    prof.stop()
            try:
                summary = _profile_summary(prof, pres.steps - pres.resumed_from_step, device.type == "cuda")
                report["profile_steps"] = summary.pop("steps")
                report.update(summary)
                print(_phase_table(summary["phases"]), file=sys.stderr)
                print(prof.key_averages().table(
                    sort_by="self_device_time_total" if device.type == "cuda" else "self_cpu_time_total",
                    row_limit=25), file=sys.stderr)
                for what in ("device_syncs_per_step", "scalar_reads_per_step"):
                    if summary[what]:
                        _log(what.replace("_", " ") + ": "
                             + ", ".join(f"{k} {v:.1f}" for k, v in sorted(summary[what].items())))
            except Exception as ex:  # the timing above is the result: keep it whatever the trace says
                report["profile_error"] = f"{type(ex).__name__}: {ex}"
                _log(f"reading the profile failed: {report['profile_error']}")
    report["wall_s"] = time.monotonic() - t_start
    atomic_write_json(a.out, report)
    _log(f"wrote {a.out} ({report['wall_s']:.0f}s in all)")
    return 0


if __name__ == "__main__":
    sys.path.insert(0, os.fspath(Path(__file__).resolve().parents[1]))  # kimi_perf of this checkout
    sys.exit(main())
