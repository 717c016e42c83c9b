"""Does a warm start hide a planted extraction fault? The extraction matrix's rows fine-tuned from one
shipped parent on a slice of its data, each scored on the features the serving engine gives (the
correct path), without launching an engine.

Why: the H200 matrix (profiles/h200-matrix.json) needs row drafters that accept >= 1.8, so that a fault
has acceptance to lose. Trained from scratch that takes the 47K-sample recipe (~650 s of training a row,
seven rows), more than a lease. Fine-tuning one strong parent (the recipe-4 bundle, ~2.0 served) per row
on a slice of the same samples (``train.max_samples``) costs seconds a row, but the parent learnt the
correct features: a short fine-tune on a faulty path might keep reading the correct one well, and the
matrix would then call a fault harmless that a drafter trained on that path from scratch is not. This
measures it: every row's drafter walks the held-out MT-bench chain (teacher-forced, 3 drafts, top-1: the
predicted accept length, which tracks served acceptance within ~0.07, benchmarks/served_vs_walk.py) on
its own path's features (what it learnt) and on the hf path's (what a correct engine serves), beside the
parent's. A fine-tune that adapted to the fault reads its own path well and the served path badly (the
fault shows, as it would from scratch); one that kept the parent's reading does the
opposite (masked). The walk on the served path is the cell's acceptance to within serving noise.

Usage, on a GPU lease (on the 2-core CPU box transformers' forward ran at 330-560 tok/s in bf16 and fp32,
~17 minutes a row, 2026-12-07); the recipe's samples must be in the cache: python -m kimi_perf.eagle3.carry
unpack on the packs of benchmarks/h200-drafter-lease/3-data/packs.txt (they land under the GPU target's
fingerprint, c6777fd6e43c3e90; a CPU's conversion of the model has another) and the recipe's prompt data
(python -m kimi_perf.data fetch --sharegpt-v3 --instructlab --humaneval, or .carry/data on a lease):
    python benchmarks/matrix_warm_start.py --max-samples 2000 --epochs 2 --warmup 10 --json OUT
"""
from __future__ import annotations

import argparse
import json
import platform
import time
from dataclasses import replace
from pathlib import Path
from typing import Any

import torch

# h200-embedded's warm-started 47K drafter (recipe 4), which h200-engines serves (scripts/h200_engine_ab.sh DRAFTER)
RECIPE4 = "c6777fd6e43c3e90-002c71e6c1a8-03d0b33f6cff-2272382829dc"


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--profile", default="h200-embedded", help="whose eagle3.recipe (data, features, train)")
    ap.add_argument("--parent", default=None, help=f"shipped bundle to fine-tune (default {RECIPE4}, recipe 4)")
    ap.add_argument("--rows", default="hf,hf+offset1,hf+postnorm,hf+int8")
    ap.add_argument("--max-samples", type=int, default=600)
    ap.add_argument("--epochs", type=int, default=1)
    ap.add_argument("--lr", type=float, default=None, help="default: the recipe's")
    ap.add_argument("--warmup", type=int, default=None, help="warmup steps (default: the recipe's)")
    ap.add_argument("--batch-tokens", type=int, default=None, help="default: the recipe's")
    ap.add_argument("--dtype", default=None, help="feature dtype (default: the recipe's; float32 runs ~5x faster "
                    "than bfloat16 on a CPU without bf16 units)")
    ap.add_argument("--reinit", default="", help="train.reinit, comma-separated (fc: each row learns its own input "
                    "projection; the 2026-12-07 run without it kept the parent's reading on every fault)")
    ap.add_argument("--json", default=None)
    a = ap.parse_args()

    from transformers import AutoTokenizer

    from kimi_perf.eagle3.matrix import parse_row
    from kimi_perf.eagle3.pipeline import build_drafter, score_heldout
    from kimi_perf.eagle3.shipped import SHIPPED_ROOT, bundle_at, served_path
    from kimi_perf.machine import commit_info
    from kimi_perf.models.embedded import ensure_embedded_model, model_fingerprint
    from kimi_perf.profiles import load_profile
    from kimi_perf.progress import log

    root = Path(__file__).resolve().parents[1]
    dev = "cuda" if torch.cuda.is_available() else "cpu"
    e3 = load_profile(root / "profiles" / f"{a.profile}.json").eagle3
    assert e3 is not None
    base = e3.drafter_recipe()
    parent = a.parent or RECIPE4
    train = replace(base.train, init_from=parent, max_samples=a.max_samples, epochs=a.epochs, device="auto",
                    lr=a.lr if a.lr is not None else base.train.lr,
                    warmup_steps=a.warmup if a.warmup is not None else base.train.warmup_steps,
                    batch_tokens=a.batch_tokens or base.train.batch_tokens, log_every=5,
                    reinit=tuple(x for x in a.reinit.split(",") if x))
    features = replace(base.features, device=dev, dtype=a.dtype or base.features.dtype)
    m = ensure_embedded_model()
    fp = model_fingerprint(m.path)
    tok = AutoTokenizer.from_pretrained(str(m.path))

    def no_server() -> str:
        raise RuntimeError("the recipe's samples are not all in the cache: unpack its packs first (see --help)")

    arts: dict[str, Any] = {}
    for name in a.rows.split(","):
        row = parse_row(name)
        recipe = replace(base, features=row.features_of(features), train=train)
        t0 = time.monotonic()
        log(f"matrix warm start: row {name} ({row.describe()}): fine-tuning {parent} on {a.max_samples} samples")
        arts[name] = (build_drafter(recipe, m.path, fp, gen_url=no_server, tokenizer=tok), time.monotonic() - t0)
    if "hf" not in arts:
        raise SystemExit("--rows must include hf: its stored held-out rows are the served path's features")
    hf_art = arts["hf"][0]

    def served_walk(path: Path) -> tuple[dict[str, Any], int]:
        # the drafter at ``path`` scored on the hf row's stored held-out rows: MT-bench, the trainer's
        # held-out set (code prompts are evaluation-only and scored apart); and how many rows that was
        r = score_heldout(replace(hf_art, path=path), replace(base, train=train), m.path)["mtbench"]
        return {"acc": r["acc"], "chain": r["chain"]}, r["samples"]

    parent_bundle = bundle_at(SHIPPED_ROOT / parent)
    if parent_bundle is None:  # the rows' warm start refuses it first; this keeps the type honest
        raise SystemExit(f"{parent} is not a shipped bundle under {SHIPPED_ROOT}")
    parent_walk, held = served_walk(served_path(parent_bundle))

    out: dict[str, Any] = {
        "what": "held-out MT-bench chain walk (3 drafts, top-1) of drafters fine-tuned from one parent per row",
        "machine": f"{platform.node()} {torch.cuda.get_device_name() if dev == 'cuda' else 'cpu'}",
        # a lease's copy of the tree has no .git: commit_info reads KIMI_PERF_COMMIT (.carry/COMMIT) there
        "commit": commit_info(root).get("id"), "torch": torch.__version__, "parent": parent,
        "max_samples": a.max_samples, "epochs": a.epochs, "lr": train.lr, "reinit": list(train.reinit), "heldout_samples": held,
        "parent_served_path": parent_walk, "rows": {}}
    log(f"matrix warm start: parent on the served path: chain {out['parent_served_path']['chain']}")
    for name, (art, secs) in arts.items():
        rep = art.report
        own = rep["train"]["heldout_by_epoch"][-1]
        out["rows"][name] = {"seconds": round(secs, 1), "train_steps": rep["train"]["steps"],
                             "train_tokens_per_s": rep["train"]["tokens_per_s"],
                             "train_samples": rep["data"]["train"], "own_path": {"acc": own["acc"], "chain": own.get("chain")},
                             "served_path": served_walk(art.path)[0], "drafter": str(art.path)}
        log(f"matrix warm start: {name}: own path {own.get('chain')}, served path {out['rows'][name]['served_path']['chain']}")
    text = json.dumps(out, indent=1)
    print(text)
    if a.json:
        Path(a.json).parent.mkdir(parents=True, exist_ok=True)
        Path(a.json).write_text(text + "\n")


if __name__ == "__main__":
    main()
