"""The drafter recipe's data stage alone: launch the generator engine, regenerate the missing samples
until a deadline, stop, and pack what this call made.

Why: a GPU recipe of >= 50K samples is generated over several device calls of at most ten minutes on
machines that start bare. Inside pytest the drafter pipeline runs data, features and training in one
go, which one call cannot finish and whose partial samples would be lost with the machine. This entry
point does only the data stage, under a time limit, with the fastest generator (SGLang at high
concurrency on a GPU; ``eagle3.recipe.data.generator``), and packs the new samples
(:mod:`kimi_perf.eagle3.carry`) for the next lease, where ``carry unpack`` puts them back and the next
call (or ``pytest -m eagle --perf-train-drafter``) goes on from there.

    python -m kimi_perf.eagle3.generate --profile h200-embedded --engine-python /tmp/sglang-python \\
        --max-s 420 --pack $OUT/samples --only-new .carry/samples

It prints progress (samples, tokens/s) while it runs and a JSON summary at the end: samples wanted,
present, made this call, response tokens and seconds, so each call's rate is recorded.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from dataclasses import replace
from pathlib import Path
from typing import Any

from ..progress import log

__all__ = ["run"]


def run(profile: str, *, engine_python: str | None = None, max_s: float | None = None,
        concurrency: int | None = None, model_dir: Path | None = None, log_dir: Path = Path("perf-report/generate"),
        pack_dir: Path | None = None, only_new: tuple[Path, ...] = ()) -> dict[str, Any]:
    from transformers import AutoTokenizer

    from ..engines.registry import EngineConfigError, build_engine_config
    from ..launcher import ServerProcess
    from ..models.embedded import ensure_embedded_model, model_fingerprint
    from .carry import pack
    from .data import build_items, generate_samples, read_samples
    from .pipeline import cache_dirs
    from .shipped import _profile_recipe

    t0 = time.monotonic()
    deadline = None if max_s is None else t0 + max_s
    prof, recipe = _profile_recipe(profile)
    if concurrency is not None:
        recipe = replace(recipe, data=replace(recipe.data, concurrency=concurrency))
    gen = recipe.data.generator
    raw = (prof.get("engines") or {}).get(gen)
    if raw is None:
        raise SystemExit(f"profile {profile}: eagle3.recipe.data.generator {gen!r} is not an engine of the profile "
                         f"(engines: {', '.join(prof.get('engines') or {})})")
    try:
        over = recipe.data.generator_overrides(str(raw.get("kind")))
    except ValueError as e:
        raise SystemExit(f"profile {profile}: eagle3.recipe.data.{e}") from None
    if model_dir is None:
        em = ensure_embedded_model()
        target, name = em.path, em.name
    else:
        target, name = model_dir, model_dir.name
    data_dir, _, _ = cache_dirs(recipe, model_fingerprint(target))
    samples_path = data_dir / "samples.jsonl"
    items = build_items(recipe.data)
    before = read_samples(samples_path)
    now = {i.id: before[i.id] for i in items if i.id in before}
    todo = [i for i in items if i.id not in now]
    log(f"generate: {len(items)} samples in the recipe, {len(now)} present in {samples_path}, "
        f"{len(todo)} to make" + (f" within {max_s:.0f}s" if max_s else ""))
    stats: dict[str, int] = {}
    if todo:
        if raw["kind"] == "reference":
            over["load_format"] = "auto"
        try:
            cfg = build_engine_config(gen, raw, model_path=str(target), served_model_name=name,
                                      python=engine_python, overrides=over, source=f"profile {profile}")
        except EngineConfigError as e:
            raise SystemExit(str(e)) from None
        procs: list[ServerProcess] = []

        def launch() -> str:
            # called by generate_samples only when some item can still be made: a call whose missing
            # items are all too long starts no server
            log(f"generate: launching {gen} ({raw['kind']}); its log goes to {log_dir}")
            procs.append(ServerProcess(cfg.launch_spec(log_dir)).start())
            return procs[0].base_url

        try:
            tok = AutoTokenizer.from_pretrained(str(target))
            # the launch counts against the deadline: what is left of it goes to generation
            now = generate_samples(launch, tok, items, samples_path, recipe.data, deadline=deadline, stats=stats)
        finally:
            for proc in procs:
                proc.stop()
    mine = [now[i.id] for i in todo if i.id in now]
    summary = {"profile": profile, "generator": gen, "samples_path": str(samples_path), "wanted": len(items),
               "present": len(now), "made": len(mine), "skipped_too_long": stats.get("skipped", 0),
               "left_for_next_call": stats.get("left", 0),
               "made_response_tokens": sum(len(s.response_ids) for s in mine),
               "seconds": round(time.monotonic() - t0, 1)}
    if pack_dir is not None and samples_path.is_file():
        summary["pack"] = {k: v for k, v in pack(samples_path, pack_dir, only_new=only_new).items() if k != "ids"}
    return summary


def _cli(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m kimi_perf.eagle3.generate",
                                 description="the drafter recipe's data stage: regenerate the missing samples "
                                             "with the recipe's generator engine, until a deadline")
    ap.add_argument("--profile", required=True, help="profile name or JSON path holding eagle3.recipe")
    ap.add_argument("--engine-python", default=None,
                    help="interpreter of the generator engine (an SGLang wrapper, like --perf-sglang-python)")
    ap.add_argument("--max-s", type=float, default=None, help="start no request after this many seconds (launch "
                                                              "included); the rest is left for the next call")
    ap.add_argument("--concurrency", type=int, default=None, help="requests in flight (default: the recipe's)")
    ap.add_argument("--log-dir", type=Path, default=Path("perf-report/generate"), help="server logs")
    ap.add_argument("--pack", type=Path, default=None, help="pack the samples into this folder afterwards")
    ap.add_argument("--only-new", type=Path, action="append", default=[],
                    help="with --pack: leave out the samples an earlier pack holds (repeatable)")
    ns = ap.parse_args(argv)
    if ns.max_s is not None and ns.max_s <= 0:
        ap.error("--max-s must be > 0")
    if ns.concurrency is not None and ns.concurrency < 1:
        ap.error("--concurrency must be >= 1")
    summary = run(ns.profile, engine_python=ns.engine_python, max_s=ns.max_s, concurrency=ns.concurrency,
                  log_dir=ns.log_dir, pack_dir=ns.pack, only_new=tuple(ns.only_new))
    print(json.dumps(summary, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(_cli())
