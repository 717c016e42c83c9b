"""Served acceptance of a shipped drafter on the reference engine against the chain walk's prediction on
the very tokens it served, in process, per engine mode (eager, target CUDA graphs, target + drafter
graphs) and dtype: does the serving path lose acceptance, and where.

Why: the 47K drafter was served at 1.956 by the reference engine and 2.050 by SGLang on the same 20
held-out prompts (H100), and its chain walk on the recipe's own (SGLang-generated) responses predicted
2.061 there. A walk on other tokens cannot tell a serving loss (a drafter cache, CUDA-graph or numerics
fault) from the engines writing other continuations. Here the walk reads the tokens the engine emitted,
with the recipe's features of prompt + output (transformers, as in training), so a difference is the
serving path's. Measured on an H100 (benchmarks/served-vs-walk/h100-47k-20261207.json): served 1.946,
walk on the same tokens 1.946, in all three modes; transformers' argmax equals every emitted token.

Usage: python benchmarks/served_vs_walk.py --bundle NAME [--prompts 20 --max-new 96 --modes eager,graphs,graphs+drafter
--dtype bfloat16 --json OUT]  (on a lease: PYTHONPATH=/tmp/site-model:$PWD KIMI_PERF_CACHE=/tmp/kcache)
"""
from __future__ import annotations

import argparse
import json
import threading
import time

import torch


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--bundle", required=True)
    ap.add_argument("--prompts", type=int, default=20)
    ap.add_argument("--max-new", type=int, default=96)
    ap.add_argument("--modes", default="eager,graphs,graphs+drafter")
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--json", default=None)
    a = ap.parse_args()
    from kimi_perf.eagle3.data import read_samples
    from kimi_perf.eagle3.features import FeaturePath, FeatureSample
    from kimi_perf.eagle3.pipeline import load_target_tensors, vocab_maps_of
    from kimi_perf.eagle3.shipped import SHIPPED_ROOT, bundle_at, bundle_recipe, install
    from kimi_perf.eagle3.train import _collate, chain_walk
    from kimi_perf.engines.reference.drafter_model import load_drafter
    from kimi_perf.engines.reference.drafting import DrafterRuntime
    from kimi_perf.engines.reference.engine import Engine, SamplingParams, Sequence
    from kimi_perf.engines.reference.model import LlamaRunner
    from kimi_perf.models.embedded import ensure_embedded_model, model_fingerprint

    dev = "cuda" if torch.cuda.is_available() else "cpu"
    dtype = getattr(torch, a.dtype)
    m = ensure_embedded_model()
    fp = model_fingerprint(m.path)
    b = bundle_at(SHIPPED_ROOT / a.bundle)
    recipe = bundle_recipe(b)
    art = install(b, recipe, m.path, fp, heldout_features=False)
    samples = read_samples(art.samples_path)
    ids = [i for i in art.heldout_ids if samples[i].source == "mtbench" and i.endswith("-t1")][:a.prompts]
    _, embed, lm = load_target_tensors(m.path)
    d2t, t2d = (torch.from_numpy(x) for x in vocab_maps_of(art.path))
    model = load_drafter(art.path, embed, device=dev)
    lm_rows = lm[torch.nonzero(t2d.bool()).flatten()].float().to(dev)
    path = FeaturePath(recipe.features, m.path, max_len=2048)
    report = {"bundle": a.bundle, "device": torch.cuda.get_device_name() if dev == "cuda" else "cpu",
              "dtype": a.dtype, "prompts": ids, "max_new": a.max_new, "modes": {}}
    for mode in a.modes.split(","):
        t0 = time.monotonic()
        runner = LlamaRunner.from_pretrained(m.path, device=dev, dtype=dtype, max_slots=a.batch, max_len=1024)
        dr = DrafterRuntime.from_pretrained(art.path, runner)
        if mode.startswith("graphs"):
            from kimi_perf.engines.reference.cuda_graphs import enable_cuda_graphs

            enable_cuda_graphs(runner, max_bs=a.batch, q_lens=[1, 4], aux_layers=dr.aux_layers)
            if mode == "graphs+drafter":
                dr.enable_cuda_graphs(max_bs=a.batch, k=3)
        eng = Engine(runner, eos_token_ids={2}, max_running=a.batch, drafter=dr, spec_steps=3)
        left, done = set(ids), threading.Event()

        def on_step(evs, left=left, done=done):
            for e in evs:
                if e.finished:
                    left.discard(e.seq.rid)
            if not left:
                done.set()
        eng.on_step = on_step
        seqs = [Sequence(rid=s, prompt=list(samples[s].prompt_ids), params=SamplingParams(max_new_tokens=a.max_new))
                for s in ids]
        eng.start()
        for q in seqs:
            eng.submit(q)
        done.wait(600)
        eng.stop()
        ver = sum(q.spec_verify_ct for q in seqs)
        acc = sum(q.spec_accepted for q in seqs)
        per = [sum(q.spec_accepted_per_pos[j] for q in seqs) / ver for j in range(3)]
        walked: list[int] = []
        agree = total = 0
        for q in seqs:
            p, o = list(samples[q.rid].prompt_ids), list(q.output)
            (aux, final, am), = path.batch([p + o])
            mask = torch.tensor([False] * len(p) + [True] * len(o))
            fs = FeatureSample(q.rid, torch.tensor(p + o, device=aux.device), mask.to(aux.device), aux, final, am)
            x, tok, tl, valid = _collate([fs], t2d.bool(), lm_rows, torch.device(dev), torch.float32)
            with torch.no_grad(), torch.autocast(device_type=dev, dtype=torch.bfloat16, enabled=dev == "cuda"):
                out = model.ttt(x, tok, tl, valid, 3, keep_hits=True)
            walked += chain_walk([h[0].tolist() for h in out.step_hits], mask.tolist(), 3)
            amx = am.tolist()
            agree += sum(int(amx[len(p) - 1 + i] == o[i]) for i in range(len(o)))
            total += len(o)
        wp = [sum(x > j for x in walked) / len(walked) for j in range(3)]
        row = {"served": 1 + acc / ver, "served_per_pos": per, "verify_steps": ver,
               "walk": 1 + sum(walked) / len(walked), "walk_per_pos": wp, "hf_argmax_agrees": agree / total,
               "drafter_graph_replays": getattr(dr.graphs, "replays", None), "seconds": time.monotonic() - t0}
        report["modes"][mode] = row
        print(f"{mode}: served {row['served']:.3f} ({' / '.join(f'{v:.3f}' for v in per)}), walk on the same tokens "
              f"{row['walk']:.3f} ({' / '.join(f'{v:.3f}' for v in wp)}), hf argmax = served token "
              f"{row['hf_argmax_agrees']:.3f}, drafter graph replays {row['drafter_graph_replays']}, "
              f"{row['seconds']:.0f} s", flush=True)
        del eng, dr, runner
        if dev == "cuda":
            torch.cuda.empty_cache()
    if a.json:
        with open(a.json, "w") as f:
            json.dump(report, f, indent=1)


if __name__ == "__main__":
    main()
