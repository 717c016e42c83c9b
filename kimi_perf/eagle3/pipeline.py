"""Train-or-load an EAGLE-3 drafter end to end: regenerate -> vocab -> features -> train -> export.

Why a cached pipeline: the drafter fixture runs in every session, but training takes minutes (CPU CI)
to an hour (GPU). Every stage is keyed and stored under ``<cache>/eagle3/<target fingerprint>/``:
samples by the data config, features by the feature spec, the drafter by (features, train config).
Changing one stage's config redoes that stage and the ones after it, nothing before. Each stage is
itself resumable (see data.py, features.py, train.py), so a killed run continues where it stopped.
"""

from __future__ import annotations

import hashlib
import json
import math
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch

from ..atomic import atomic_write_json
from ..engines.reference.drafter_model import save_drafter
from ..models.embedded import cache_root, file_lock
from ..progress import log
from .data import EVAL_ONLY_SOURCES, DataConfig, Sample, build_items, generate_samples, samples_digest
from .features import FeatureSpec, FeatureStore, OnlineFeatures, extract_features
from .train import TrainConfig, TrainResult, train_drafter
from .vocab import DEFAULT_SIZES, build_vocab_maps, count_tokens, coverage_table

__all__ = ["DrafterArtifact", "DrafterRecipe", "build_drafter", "cache_dirs", "heldout_coverage", "load_target_tensors"]


@dataclass(frozen=True)
class DrafterRecipe:
    data: DataConfig = field(default_factory=DataConfig)
    features: FeatureSpec = field(default_factory=FeatureSpec)
    train: TrainConfig = field(default_factory=TrainConfig)

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> DrafterRecipe:
        def mk(klass: Any, raw: dict[str, Any] | None) -> Any:
            raw = dict(raw or {})
            for k, v in list(raw.items()):
                if isinstance(v, list):
                    raw[k] = tuple(v)
            unknown = set(raw) - set(klass.__dataclass_fields__)
            if unknown:
                raise ValueError(f"unknown {klass.__name__} field(s) {sorted(unknown)}; "
                                 f"known: {sorted(klass.__dataclass_fields__)}")
            return klass(**raw)

        unknown = set(d) - {"data", "features", "train"}
        if unknown:
            raise ValueError(f"unknown drafter recipe section(s) {sorted(unknown)}: use data, features, train")
        return cls(mk(DataConfig, d.get("data")), mk(FeatureSpec, d.get("features")), mk(TrainConfig, d.get("train")))


@dataclass(frozen=True)
class DrafterArtifact:
    path: Path
    feature_dir: Path
    samples_path: Path
    train_ids: tuple[str, ...]
    heldout_ids: tuple[str, ...]
    report: dict[str, Any]


def load_target_tensors(model_dir: Path) -> tuple[dict[str, Any], torch.Tensor, torch.Tensor]:
    """(config dict, embedding [V, H] fp32, lm_head [V, H] fp32) of a transformers checkpoint."""
    from safetensors import safe_open

    cfg = json.loads((Path(model_dir) / "config.json").read_text())
    embed = lm = None
    for f in sorted(Path(model_dir).glob("*.safetensors")):
        with safe_open(str(f), framework="pt") as h:
            keys = set(h.keys())
            if "model.embed_tokens.weight" in keys:
                embed = h.get_tensor("model.embed_tokens.weight").float()
            if "lm_head.weight" in keys:
                lm = h.get_tensor("lm_head.weight").float()
    if embed is None:
        raise FileNotFoundError(f"{model_dir}: no model.embed_tokens.weight in its safetensors")
    return cfg, embed, (lm if lm is not None and not cfg.get("tie_word_embeddings") else embed)


def load_target_norm(model_dir: Path) -> torch.Tensor | None:
    """The target's final RMSNorm weight (the warm start of the drafter's own final norm)."""
    from safetensors import safe_open

    for f in sorted(Path(model_dir).glob("*.safetensors")):
        with safe_open(str(f), framework="pt") as h:
            if "model.norm.weight" in set(h.keys()):
                return h.get_tensor("model.norm.weight").float()
    return None


def cache_dirs(recipe: DrafterRecipe, target_fingerprint: str, root: Path | None = None) -> tuple[Path, Path, Path]:
    """(samples dir, features dir, drafter work dir) of ``recipe`` under ``<root>/eagle3/<target>/``.

    Samples and features are shared by every selection with the same generation settings / spec; the
    drafter is specific to the selection and the training config. The one place the layout lives
    (build_drafter and ``python -m kimi_perf.eagle3.shipped export`` read it)."""
    base = (root or cache_root()) / "eagle3" / target_fingerprint
    data_dir = base / f"gen-{recipe.data.generation_digest()}"
    feat_dir = data_dir / f"features-{recipe.features.digest()}"
    return data_dir, feat_dir, feat_dir / f"drafter-{recipe.data.digest()}-{recipe.train.digest()}"


def feature_source(recipe: DrafterRecipe, samples: list[Sample], heldout: list[Sample], target_dir: Path,
                   feat_dir: Path, target_fingerprint: str) -> FeatureStore | OnlineFeatures:
    """Where the trainer reads features: the stored set of every sample, extracted now (resumable), or
    with ``features.online`` the target computing each batch's rows during training. An online recipe
    still stores the held-out samples' rows with their manifest (a few hundred samples): the alignment
    tests compare stored rows with the serving path (test_stored_features_match_inference)."""
    spec, max_len = recipe.features, recipe.train.max_seq_len
    if not spec.online:
        return extract_features(samples, target_dir, feat_dir, spec, model_fingerprint=target_fingerprint,
                                max_len=max_len)
    log(f"drafter features: online ({spec.backend} on {spec.device}), computed per training batch; "
        f"the {len(heldout)} held-out samples' rows are stored in {feat_dir}")
    extract_features(heldout, target_dir, feat_dir, spec, model_fingerprint=target_fingerprint, max_len=max_len)
    return OnlineFeatures(samples, target_dir, spec, max_len=max_len)


def build_drafter(
    recipe: DrafterRecipe,
    target_dir: Path,
    target_fingerprint: str,
    *,
    gen_url: str | Callable[[], str],
    tokenizer: Any,
    root: Path | None = None,
) -> DrafterArtifact:
    data_dir, feat_dir, work = cache_dirs(recipe, target_fingerprint, root)
    out = work / "drafter"
    with file_lock(data_dir.parent / ".pipeline.lock", what="building an EAGLE-3 drafter"):
        if (out / "COMPLETE").is_file():
            rep = json.loads((out / "report.json").read_text())
            log(f"drafter: reusing {out} (trained {rep['train']['steps']} steps on {rep['data']['train_tokens']} tokens)")
            return DrafterArtifact(out, feat_dir, data_dir / "samples.jsonl", tuple(rep["data"]["train_ids"]),
                                   tuple(rep["data"]["heldout_ids"]), rep)
        t0 = time.monotonic()
        items = build_items(recipe.data)
        samples = generate_samples(gen_url, tokenizer, items, data_dir / "samples.jsonl", recipe.data)
        t_data = time.monotonic() - t0
        train = [s for s in samples.values() if s.split == "train"]
        heldout = [s for s in samples.values() if s.split == "heldout"]
        held_main = [s for s in heldout if s.source not in EVAL_ONLY_SOURCES]
        if not train:
            raise RuntimeError("no training samples were generated (all prompts too long?)")
        cfg, embed, lm = load_target_tensors(target_dir)
        vocab = int(cfg["vocab_size"])
        counts = count_tokens(((s.ids, s.loss_mask) for s in train), vocab)
        d2t, t2d = build_vocab_maps(counts, recipe.train.draft_vocab_size)
        covered = float(counts[t2d].sum() / max(1, counts.sum()))
        by_size, by_source = heldout_coverage(counts, heldout, sorted({*DEFAULT_SIZES, recipe.train.draft_vocab_size}))
        log(f"drafter vocab: {int((counts > 0).sum())} distinct assistant tokens, draft vocab "
            f"{recipe.train.draft_vocab_size} covers {covered:.1%} of them by frequency; held-out coverage "
            + _coverage_text(by_size)
            + "".join(f"; {src}: {_coverage_text(rows)}" for src, rows in by_source.items()))
        available = len(train)
        train = capped_train(train, recipe.train.max_samples)
        keep = {s.id for s in train} | {s.id for s in heldout}
        t1 = time.monotonic()
        # in the file's order, as before the cap: extraction batches by it
        store = feature_source(recipe, [s for s in samples.values() if s.id in keep], heldout, target_dir, feat_dir,
                               target_fingerprint)
        t_feat = time.monotonic() - t1
        in_store = set(store.sample_ids)
        train_ids = [s.id for s in train if s.id in in_store]
        model, res = train_drafter(store, train_ids, cfg, embed, lm, torch.from_numpy(d2t), torch.from_numpy(t2d),
                                   work, recipe.train, target_norm=load_target_norm(target_dir),
                                   heldout_ids=[s.id for s in held_main if s.id in in_store])
        if res.steps < 1 or math.isnan(res.final_loss):
            raise RuntimeError(f"drafter training produced no usable model (steps {res.steps}, loss {res.final_loss})")
        aux_for = None if store.layers == (2, int(cfg["num_hidden_layers"]) // 2, int(cfg["num_hidden_layers"]) - 3) else "reference"
        save_drafter(model, out, aux_ids_for=aux_for, extra_meta={"recipe": _jsonable(recipe),
                                                                  "feature_backend": store.manifest["backend"]})
        report = {
            "recipe": _jsonable(recipe),
            "data": {"samples": len(samples), "train": len(train), "heldout": len(heldout),
                     **({"train_available": available} if available != len(train) else {}),
                     "train_tokens": int(sum(len(s.ids) for s in train)),
                     "train_response_tokens": int(sum(len(s.response_ids) for s in train)),
                     "samples_digest": samples_digest(list(samples.values())), "seconds": t_data,
                     "train_ids": sorted(train_ids), "heldout_ids": sorted(s.id for s in heldout)},
            "vocab": {"distinct_assistant_tokens": int((counts > 0).sum()), "coverage": covered,
                      "by_size": by_size, **({"by_source": by_source} if by_source else {})},
            "features": {"dir": str(feat_dir), "mode": "online" if recipe.features.online else "stored",
                         "layers": list(store.layers), "backend": store.manifest["backend"],
                         "backend_version": store.manifest["backend_version"], "tokens": store.num_tokens,
                         "seconds": t_feat, "planted_layer_offset": recipe.features.layer_offset},
            "train": asdict(res) if isinstance(res, TrainResult) else res,
            "created": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        }
        atomic_write_json(out / "report.json", report)
        (out / "COMPLETE").write_text("ok\n")
        log(f"drafter: built {out} in {time.monotonic() - t0:.0f}s (data {t_data:.0f}s, features {t_feat:.0f}s, "
            f"training {res.seconds:.0f}s at {res.tokens_per_s:.0f} tok/s)")
        return DrafterArtifact(out, feat_dir, data_dir / "samples.jsonl", tuple(sorted(train_ids)),
                               tuple(sorted(s.id for s in heldout)), report)


def capped_train(train: list[Sample], max_samples: int) -> list[Sample]:
    """The training samples a recipe trains on: all, or with ``train.max_samples`` the first that many
    by sha256 of their ids. A hash rather than the file's order, which is the generator's (sources one
    after another): the slice keeps the mix of sources and prompt lengths of the whole, and it is the
    same slice on every machine and every row of the extraction matrix, so rows differ only in path."""
    if not max_samples or max_samples >= len(train):
        return train
    keep = sorted(train, key=lambda s: hashlib.sha256(s.id.encode()).hexdigest())[:max_samples]
    log(f"drafter training: {max_samples} of {len(train)} training samples (train.max_samples, by id hash); "
        "the draft vocabulary counts all of them")
    return keep


def heldout_coverage(train_counts: np.ndarray, heldout: list[Sample], sizes: list[int],
                     ) -> tuple[list[dict[str, Any]], dict[str, list[dict[str, Any]]]]:
    """Draft-vocabulary coverage of the held-out answers for each size in ``sizes``: of the chat sources
    together (the training-time number every recipe reports), and of each evaluation-only source apart
    (code prompts: pooled with MT-bench they would change what the chat number means)."""
    vocab = int(train_counts.shape[0])

    def table(ss: list[Sample]) -> list[dict[str, Any]]:
        return coverage_table(train_counts, count_tokens(((s.ids, s.loss_mask) for s in ss), vocab), sizes)

    by_source = {src: table(ss) for src in EVAL_ONLY_SOURCES if (ss := [s for s in heldout if s.source == src])}
    return table([s for s in heldout if s.source not in EVAL_ONLY_SOURCES]), by_source


def _coverage_text(rows: list[dict[str, Any]]) -> str:
    return ", ".join(f"{r['size']}: {r['heldout_coverage']:.1%}" if r["heldout_coverage"] is not None
                     else f"{r['size']}: -" for r in rows)


def _jsonable(recipe: DrafterRecipe) -> dict[str, Any]:
    return json.loads(json.dumps(asdict(recipe), default=str))


def heldout_prompts(samples_path: Path, heldout_ids: tuple[str, ...], *, source: str = "mtbench",
                    first_turn_only: bool = True) -> list[list[int]]:
    """Prompt ids of held-out samples (the chat-templated user turn), for acceptance measurement."""
    from .data import read_samples

    s = read_samples(samples_path)
    out = []
    for sid in heldout_ids:
        smp: Sample | None = s.get(sid)
        if smp is None or smp.source != source or (first_turn_only and not sid.endswith("-t1")):
            continue
        out.append(smp.prompt_ids)
    return out


def score_heldout(art: DrafterArtifact, recipe: DrafterRecipe, target_dir: Path) -> dict[str, dict[str, Any]]:
    """A built drafter's teacher-forced scores on its held-out samples, by source (MT-bench, HumanEval):
    top-1 per draft step and the chain walk's predicted accept length (train.evaluate_heldout), from
    the stored held-out rows (``art.feature_dir``). Seconds on a CPU for a few hundred samples: what a
    drafter should accept can be read without launching an engine, also for a drafter built elsewhere."""
    from ..engines.reference.drafter_model import load_drafter
    from .data import read_samples
    from .train import evaluate_heldout

    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    _, embed, lm = load_target_tensors(target_dir)
    d2t, t2d = (torch.from_numpy(x) for x in vocab_maps_of(art.path))
    model = load_drafter(art.path, embed, device=device)
    lm_rows = lm[torch.nonzero(t2d.bool()).flatten()].float()
    store = FeatureStore(art.feature_dir)
    have, samples = set(store.sample_ids), read_samples(art.samples_path)
    by_source: dict[str, set[str]] = {}
    for sid in art.heldout_ids:
        if sid in have:
            by_source.setdefault(samples[sid].source, set()).add(sid)
    return {src: {"samples": len(ids), **evaluate_heldout(model, store.loader(ids), t2d.bool(), lm_rows,
                                                          recipe.train, device)}
            for src, ids in sorted(by_source.items())}


def vocab_maps_of(path: Path) -> tuple[np.ndarray, np.ndarray]:
    from safetensors.torch import load_file

    t = load_file(str(Path(path) / "model.safetensors"))
    return t["d2t"].numpy(), t["t2d"].numpy()
