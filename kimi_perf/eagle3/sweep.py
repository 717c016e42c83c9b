"""Recipe sweep: train variants of a profile's drafter recipe on its stored samples and features, and
score each on the held-out samples after every epoch.

Why: a drafter's cost is mostly its data (generation 45-47% and features 34-41% of a build on the
H200; training 12-20%), while the questions a recipe table asks -- how many epochs, which learning
rate, how large a draft vocabulary, how long a TTT unroll -- are training settings. Variants of the
training config reuse the stored samples and features, so each row costs one training. Rows are
scored on the held-out samples after every epoch (:func:`kimi_perf.eagle3.train.evaluate_heldout`):
teacher-forced top-1 per draft step and the accept length a served 3-draft chain would reach on them
(the chain walk; on the shipped CPU drafters it predicted 1.296 and 1.301 where the reference engine
served 1.283 and 1.276-1.292), which ranks the epochs; and by the held-out coverage of their draft
vocabulary (:func:`kimi_perf.eagle3.vocab.coverage_table`). The chosen recipe is then served
(``pytest -m eagle``) for its accept length and speedup, which only serving measures.

    python -m kimi_perf.eagle3.sweep --profile embedded-cpu --variant lr=0.001 --variant epochs=12,lr=0.001

The recipe as the profile has it is always the first row. Each variant's result is cached next to the
features (``sweep-<train digest>.json``), so a sweep cut short by a lease's end resumes where it stopped.
The samples and features must exist: one ``pytest -m eagle --perf-profile P --perf-train-drafter``
(or the pipeline run of any test that trains the recipe) makes them.
"""

from __future__ import annotations

import argparse
import json
import math
import time
from dataclasses import asdict, fields, replace
from pathlib import Path
from typing import Any

from ..progress import log

__all__ = ["parse_variant", "run_sweep"]


def parse_variant(text: str, base: Any) -> Any:
    """``"lr=0.001,epochs=12"`` applied to the TrainConfig ``base`` (values read as JSON, else strings).
    Only training settings can vary: a data or feature setting needs its own samples or features."""
    known = {f.name: f for f in fields(base)}
    changes: dict[str, Any] = {}
    for part in filter(None, (p.strip() for p in text.split(","))):
        key, sep, raw = part.partition("=")
        key = key.strip().removeprefix("train.")
        if not sep or key not in known:
            raise SystemExit(f"--variant {text!r}: {part!r} is not KEY=VALUE of a training setting "
                             f"({', '.join(sorted(known))}); data and feature settings need their own run")
        try:
            value = json.loads(raw)
        except json.JSONDecodeError:
            value = raw
        changes[key] = value
    return replace(base, **changes)


def _describe(cfg: Any, base: Any) -> str:
    diff = [f"{f.name}={getattr(cfg, f.name)}" for f in fields(cfg) if getattr(cfg, f.name) != getattr(base, f.name)]
    return ", ".join(diff) or "recipe as profiled"


def run_sweep(profile: str, variants: list[str], *, model_dir: Path | None = None) -> dict[str, Any]:
    import torch

    from ..machine import machine_info
    from ..models.embedded import ensure_embedded_model, model_fingerprint
    from .data import build_items, read_samples
    from .features import FeatureStore, OnlineFeatures
    from .pipeline import cache_dirs, load_target_norm, load_target_tensors
    from .shipped import _profile_recipe
    from .train import train_drafter
    from .vocab import build_vocab_maps, count_tokens, coverage_table

    prof, recipe = _profile_recipe(profile)
    target = model_dir or ensure_embedded_model().path
    fp = model_fingerprint(target)
    data_dir, feat_dir, _ = cache_dirs(recipe, fp)
    wanted = {i.id for i in build_items(recipe.data)}
    stored = [s for s in read_samples(data_dir / "samples.jsonl").values() if s.id in wanted]
    store: FeatureStore | OnlineFeatures
    if recipe.features.online:  # features from the target per batch: only the samples must be there
        if not stored:
            raise SystemExit(f"{data_dir}: no samples of the recipe: build them first "
                             f"(python -m kimi_perf.eagle3.generate --profile {profile})")
        feat_dir.mkdir(parents=True, exist_ok=True)  # the sweep's rows and checkpoints live there
        store = OnlineFeatures(stored, target, recipe.features, max_len=recipe.train.max_seq_len)
    else:
        try:
            store = FeatureStore(feat_dir)
        except FileNotFoundError as e:
            raise SystemExit(f"{e}: build the recipe's samples and features first "
                             f"(pytest -m eagle --perf-profile {profile} --perf-train-drafter)") from None
    in_store = set(store.sample_ids)
    samples = [s for s in stored if s.id in in_store]
    train = [s for s in samples if s.split == "train"]
    held = [s for s in samples if s.split != "train"]
    if not train or not held:
        raise SystemExit(f"{feat_dir}: {len(train)} training and {len(held)} held-out samples with features; need both")
    cfg, embed, lm = load_target_tensors(target)
    vocab = int(cfg["vocab_size"])
    counts = count_tokens(((s.ids, s.loss_mask) for s in train), vocab)
    held_counts = count_tokens(((s.ids, s.loss_mask) for s in held), vocab)
    rows = []
    configs = [recipe.train] + [parse_variant(v, recipe.train) for v in variants]
    for i, tc in enumerate(configs):
        cached = feat_dir / f"sweep-{tc.digest()}.json"
        name = _describe(tc, recipe.train)
        if cached.is_file():
            row = json.loads(cached.read_text())
            log(f"sweep {i + 1}/{len(configs)} ({name}): done before, {cached}")
        else:
            log(f"sweep {i + 1}/{len(configs)} ({name}): training on {len(train)} samples, "
                f"scoring {len(held)} held-out ones after each epoch")
            d2t, t2d = build_vocab_maps(counts, tc.draft_vocab_size)
            t0 = time.monotonic()
            work = feat_dir / f"sweep-{tc.digest()}"
            for _attempt in range(2):
                _, res = train_drafter(store, [s.id for s in train], cfg, embed, lm, torch.from_numpy(d2t),
                                       torch.from_numpy(t2d), work, tc, target_norm=load_target_norm(target),
                                       heldout_ids=[s.id for s in held])
                if res.heldout_by_epoch:
                    break
                # no curve although training ended: a checkpoint written before the held-out points
                # travelled in it (kimi_perf.eagle3.train keeps them since 2026-12-06); train it again
                (work / "train_state.pt").unlink(missing_ok=True)
            cov = coverage_table(counts, held_counts, [tc.draft_vocab_size])[0]
            curve = res.heldout_by_epoch
            best = max(curve, key=_rank)
            row = {"variant": name, "train_config": asdict(tc), "seconds": time.monotonic() - t0,
                   "steps": res.steps, "tokens_per_s": res.tokens_per_s, "train_final_step_acc": res.final_step_acc,
                   "heldout_by_epoch": curve, "best_epoch": best["epoch"],
                   "heldout_coverage": cov["heldout_coverage"], "train_samples": len(train), "heldout_samples": len(held)}
            cached.write_text(json.dumps(row, indent=1))
        rows.append(row)
    return {"kimi_perf_recipe_sweep": 1, "profile": prof.get("name", profile), "target_fingerprint": fp,
            "features": str(feat_dir), "machine": machine_info(with_torch=True), "rows": rows,
            "created": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())}


def _rank(point: dict[str, Any]) -> float:
    """An epoch's held-out standing: the chain walk's predicted accept length; a point scored before the
    walk existed (a cached row) by top-1 at draft position 0, as then."""
    v = point["chain"]["accept_length"] if "chain" in point else point["all_acc"][0]
    return v if math.isfinite(v) else -1.0


def _chain(point: dict[str, Any]) -> str:
    ch = point.get("chain")
    if not ch or not math.isfinite(ch["accept_length"]):
        return "-"
    return f"{ch['accept_length']:.3f} ({' / '.join(f'{x:.3f}' for x in ch['per_position'])})"


def markdown(doc: dict[str, Any]) -> str:
    def accs(xs: list[float]) -> str:
        return " / ".join(f"{x:.3f}" if math.isfinite(x) else "-" for x in xs[:3])

    out = [f"# Drafter recipe sweep: {doc['profile']}", "",
           f"{doc['machine'].get('cpu', '?')}, {', '.join(g.get('name', '') for g in doc['machine'].get('gpus', [])) or 'no GPU'}; "
           f"{doc['rows'][0]['train_samples']} training and {doc['rows'][0]['heldout_samples']} held-out samples; "
           "held-out columns are teacher-forced top-1 over every assistant position (a token outside the draft "
           "vocabulary is a miss), draft positions 0 / 1 / 2, after the last epoch, and the accept length a served "
           "3-draft chain reaches on them (per position); `python -m kimi_perf.eagle3.sweep`.",
           "", "| variant | steps | train s | train top-1 (last batches) | held-out top-1, last epoch | predicted "
           "accept length, last epoch | best epoch (its prediction) | held-out coverage of the draft vocab |",
           "|---|---|---|---|---|---|---|---|"]
    for r in doc["rows"]:
        last = r["heldout_by_epoch"][-1]
        best = next(p for p in r["heldout_by_epoch"] if p["epoch"] == r["best_epoch"])
        out.append(f"| {r['variant']} | {r['steps']} | {r['seconds']:.0f} | {accs(r['train_final_step_acc'])} | "
                   f"{accs(last['all_acc'])} | {_chain(last)} | {r['best_epoch']} ({_chain(best)}) | "
                   f"{r['heldout_coverage']:.1%} |")
    return "\n".join(out) + "\n"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m kimi_perf.eagle3.sweep", description=__doc__.split("\n\n")[0])
    ap.add_argument("--profile", default="embedded-cpu", help="profile whose eagle3.recipe is swept")
    ap.add_argument("--variant", action="append", default=[], metavar="K=V[,K=V]",
                    help="a training-config variant, e.g. lr=0.001,epochs=12 (repeatable)")
    ap.add_argument("--model-dir", type=Path, default=None, help="the target checkpoint (default: the embedded model)")
    ap.add_argument("--out", type=Path, default=None, help="write the JSON here and the table next to it (.md)")
    ns = ap.parse_args(argv)
    doc = run_sweep(ns.profile, ns.variant, model_dir=ns.model_dir)
    text = markdown(doc)
    print(text)
    if ns.out:
        ns.out.parent.mkdir(parents=True, exist_ok=True)
        ns.out.write_text(json.dumps(doc, indent=1))
        ns.out.with_suffix(".md").write_text(text)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
