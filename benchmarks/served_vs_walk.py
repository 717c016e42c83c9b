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

``--url`` does the same for any running speculative server that serves the bundle (vLLM, SGLang, the
reference engine): the same prompts, greedy, token ids in and out (vLLM's ``/v1/completions`` with
``return_token_ids``, else the SGLang-native ``/generate``), served acceptance from the engine's own
counters (``vllm:spec_decode_*`` on ``/metrics``, else SGLang's per-request ``meta_info``), then the
walk on what it emitted. Why: vLLM's CPU build accepted 2.299 where the reference engine accepted 2.124
on the same 8 prompts; only a walk on each engine's own tokens says whether a serving path loses
acceptance or the engines wrote other continuations.

Usage: python benchmarks/served_vs_walk.py --bundle NAME [--prompts 20 --max-new 96 --modes eager,graphs,graphs+drafter
--dtype bfloat16 --json OUT]  (on a lease: PYTHONPATH=/tmp/site-model:$PWD KIMI_PERF_CACHE=/tmp/kcache)
       python benchmarks/served_vs_walk.py --bundle NAME --url http://127.0.0.1:8000 [--prompts 8 --max-new 64]
"""
from __future__ import annotations

import argparse
import json
import threading
import time
from typing import Any

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
    ap.add_argument("--url", default=None, help="a running speculative server serving the bundle: walk on its tokens")
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
    def walk(outputs: dict[str, list[int]]) -> dict[str, Any]:
        """The chain walk (teacher-forced, 3 steps, top-1) on each prompt + the tokens served for it,
        with the recipe's features of that sequence, and how often transformers' argmax is the served token."""
        walked: list[int] = []
        agree = total = 0
        for rid, o in outputs.items():
            p = list(samples[rid].prompt_ids)
            (aux, final, am), = path.batch([p + o])
            mask = torch.tensor([False] * len(p) + [True] * len(o))
            fs = FeatureSample(rid, torch.tensor(p + o, device=aux.device), mask.to(aux.device), aux, final, am)
            x, tok, tl, valid = _collate([fs], t2d.bool(), lm_rows, torch.device(dev), torch.float32)
            with torch.no_grad(), torch.autocast(device_type=dev, dtype=torch.bfloat16, enabled=dev == "cuda"):
                out = model.ttt(x, tok, tl, valid, 3, keep_hits=True)
            walked += chain_walk([h[0].tolist() for h in out.step_hits], mask.tolist(), 3)
            amx = am.tolist()
            agree += sum(int(amx[len(p) - 1 + i] == o[i]) for i in range(len(o)))
            total += len(o)
        return {"walk": 1 + sum(walked) / len(walked),
                "walk_per_pos": [sum(x > j for x in walked) / len(walked) for j in range(3)],
                "hf_argmax_agrees": agree / total, "tokens": total}

    if a.url:
        t0 = time.monotonic()
        outputs, served = serve_url(a.url, {i: list(samples[i].prompt_ids) for i in ids}, a.max_new)
        row = {**served, **walk(outputs), "seconds": time.monotonic() - t0}
        report["modes"][f"url:{served['engine']}"] = row
        show(f"{served['engine']} at {a.url}", row)
    for mode in ([] if a.url else a.modes.split(",")):
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
        row = {"served": 1 + acc / ver, "served_per_pos": per, "verify_steps": ver,
               **walk({q.rid: list(q.output) for q in seqs}),
               "drafter_graph_replays": getattr(dr.graphs, "replays", None), "seconds": time.monotonic() - t0}
        report["modes"][mode] = row
        show(mode, row)
        del eng, dr, runner
        if dev == "cuda":
            torch.cuda.empty_cache()
    if a.json:
        with open(a.json, "w") as f:
            json.dump(report, f, indent=1)


def show(name: str, row: dict[str, Any]) -> None:
    per, wp = row["served_per_pos"], row["walk_per_pos"]
    print(f"{name}: served {row['served']:.3f} ({' / '.join(f'{v:.3f}' for v in per) or 'no per-position counts'}), "
          f"walk on the same tokens {row['walk']:.3f} ({' / '.join(f'{v:.3f}' for v in wp)}), hf argmax = served "
          f"token {row['hf_argmax_agrees']:.3f} over {row['tokens']} tokens, drafter graph replays "
          f"{row.get('drafter_graph_replays')}, {row['seconds']:.0f} s", flush=True)


def serve_url(url: str, prompts: dict[str, list[int]], max_new: int) -> tuple[dict[str, list[int]], dict[str, Any]]:
    """Greedy generation of each prompt by a running server, one at a time (as the suite's acceptance
    test runs it), stopping at EOS: the token ids it emitted and its own acceptance over them.

    Token ids, not text: a walk on re-tokenized text would read other tokens than the engine verified.
    vLLM returns them from ``/v1/completions`` with ``return_token_ids``; SGLang and the reference engine
    from ``/generate`` (``output_ids``). Acceptance: the ``vllm:spec_decode_*`` counters around the pass
    (vLLM and the reference engine), else SGLang's per-request ``meta_info`` summed, as the suite's
    acceptance test sums it (:func:`kimi_perf.eagle3.evaluate.sglang_acceptance`)."""
    from kimi_perf.eagle3.evaluate import (
        _generate_all,
        _get_json,
        _server_kind,
        read_spec_counters,
        sglang_acceptance,
    )
    from kimi_perf.engines.sglang import parse_generate_response
    from kimi_perf.httpjson import fetch

    base = url.rstrip("/")
    kind = _server_kind(_get_json(base + "/server_info", None))
    kind = "vllm" if kind == "other" else kind
    before = read_spec_counters(base)
    outputs: dict[str, list[int]] = {}
    records: list[dict[str, Any]] = []
    if kind == "vllm":
        model = _get_json(base + "/v1/models", None)["data"][0]["id"]
        for rid, p in prompts.items():
            body = {"model": model, "prompt": p, "max_tokens": max_new, "temperature": 0.0, "return_token_ids": True}
            r = json.loads(fetch(base + "/v1/completions", {"Content-Type": "application/json"}, 1800,
                                 json.dumps(body).encode()))
            outputs[rid] = list(r["choices"][0]["token_ids"])
    else:
        # the suite's own greedy /generate pass (the SGLang acceptance pass's), one request at a time
        answers = _generate_all(base, list(prompts.values()), max_new, 1, 1800.0)
        records = [parse_generate_response(r)[0] for r in answers]
        outputs = {rid: list(rec["output_ids"]) for rid, rec in zip(prompts, records)}
    after = read_spec_counters(base)
    if before is not None and after is not None:
        d, source = after - before, "vllm:spec_decode_* counters"
    elif any("spec_verify_ct" in r for r in records):
        # SGLang's per-request meta_info, summed and read as the suite's acceptance test reads it (1 +
        # correct drafts per verify step; per position from the histogram of correct drafts)
        d, source = sglang_acceptance(records).counters(), "SGLang meta_info"
    else:
        raise SystemExit(f"{url}: no speculative counters (vllm:spec_decode_* or spec_verify_ct): is it serving a drafter?")
    served = {"served": 1 + d.accepted / d.drafts, "served_per_pos": [x / d.drafts for x in d.per_pos[:3]],
              "verify_steps": d.drafts, "source": source}
    return outputs, {"engine": kind, **served}


if __name__ == "__main__":
    main()
