"""EAGLE-3 drafter training: TTT loss, AdamW with warmup, clipping, bf16 on CUDA, checkpoints, resume.

Why resumable to the batch: training on the 2-core CI box or a shared GPU gets killed. The trainer
writes ``train_state.pt`` (model, optimiser, scheduler position, epoch order, RNG) atomically every
``checkpoint_every`` steps and at the end; a restart with the same config continues from the last
checkpoint without redoing finished steps. Progress lines report loss, per-step top-1 accuracy and
tokens/s, so a run is never silent.

Held-out accuracy at every epoch's end: the training log's top-1 is measured on the batches being
fitted, and on the recipes measured so far it rose to 0.65-0.69 at draft position 0 while the served
acceptance of held-out prompts stayed at 0.22-0.34. Which epoch count, learning rate or data size
generalises can only be read on samples the drafter never trained on, so given ``heldout_ids`` the
trainer scores them after each epoch (teacher-forced, no gradient: seconds) and logs and returns the
curve. ``all_acc`` counts every assistant position, a target token outside the draft vocabulary as a
miss; ``acc`` only the positions it can draft, like the training log.

Why also a chain walk (``chain``): per-position top-1 is not what serving measures. A served verify
step drafts a chain from where the last one stopped, so a run of easy tokens is consumed in one step
and the steps gather at the hard positions; and a draft at position k counts only when drafts 0..k-1
were accepted too. :func:`chain_walk` replays that on the held-out hits: from the first response token,
accept the leading hits of the ``CHAIN_STEPS`` drafts, move on by accepted + 1 (the target's own token),
repeat. Its accept length is the served one's prediction from features alone, which the recipe sweep
can compare without a server.

Targets: the target's distribution at each position restricted to the draft vocabulary, computed
from the stored post-norm final hidden and the target's lm_head rows (``t2d``); positions whose
predicted token is not an assistant token, or whose target argmax is outside the draft vocabulary,
are masked (SpecForge specforge/core/eagle3.py).
"""

from __future__ import annotations

import hashlib
import json
import math
import os
import random
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import torch
from torch.profiler import record_function

from ..engines.reference.drafter_model import Eagle3Config, Eagle3Drafter
from ..progress import log
from .features import FeatureLoader, FeatureSample, FeatureStore, OnlineFeatures

__all__ = ["TrainConfig", "TrainResult", "evaluate_heldout", "train_drafter", "warm_start"]


@dataclass(frozen=True)
class TrainConfig:
    draft_vocab_size: int = 4096
    ttt_steps: int = 7
    epochs: int = 4
    lr: float = 5e-4
    warmup_steps: int = 20
    min_lr_ratio: float = 0.1
    weight_decay: float = 0.0
    grad_clip: float = 0.5
    batch_tokens: int = 4096
    max_seq_len: int = 1024
    seed: int = 0
    checkpoint_every: int = 50
    log_every: int = 10
    device: str = "auto"
    threads: int = 0
    # "target": lm_head from the target's rows of the draft vocab (and norm from the target's final
    # norm when given); "random": PyTorch's default init
    init_lm_head: str = "random"
    # warm start: the weights of a drafter bundle shipped in kimi_perf/eagle3/shipped_drafters/ (its folder
    # name), trained further by this config's epochs and schedule; "" starts from scratch
    init_from: str = ""
    # train on at most this many of the training samples (0: all of them), chosen by a hash of their ids
    # (pipeline.capped_train), while the draft vocabulary is still counted over all: a warm start's
    # d2t must equal its parent's, and the extraction matrix fine-tunes one parent per row on a slice
    # of the parent's data that a GPU lease affords (47K samples online take ~650 s a row)
    max_samples: int = 0
    # after a warm start, these of the drafter's modules start again from PyTorch's default init
    # (names in REINIT_MODULES). "fc": the projection the aux rows enter through, so a drafter fine-tuned
    # on another extraction path must learn to read that path instead of keeping the parent's reading
    # of the correct one (benchmarks/matrix_warm_start.py measured the parent's reading survive 100
    # steps on every planted fault)
    reinit: tuple[str, ...] = ()

    def digest(self) -> str:
        d = asdict(self)
        for k in ("checkpoint_every", "log_every", "device", "threads"):
            d.pop(k)
        # fields added later leave the digest as it was when unset, so every recipe written before them
        # keeps its digest (and its shipped bundle)
        for k in ("init_from", "max_samples", "reinit"):
            if not d[k]:
                d.pop(k)
        return hashlib.sha256(json.dumps(d, sort_keys=True).encode()).hexdigest()[:12]


@dataclass(frozen=True)
class TrainResult:
    steps: int
    tokens: int
    seconds: float
    tokens_per_s: float
    final_step_acc: list[float]
    final_loss: float
    resumed_from_step: int
    # per epoch ended in this run: {"epoch", "step", "acc": [per draft step], "all_acc": [...], "positions"}
    heldout_by_epoch: list[dict[str, Any]] = field(default_factory=list)


def _batches(lengths: dict[str, int], batch_tokens: int, rng: random.Random) -> list[list[str]]:
    """Length-sorted buckets up to ``batch_tokens`` padded tokens, in a seeded random order."""
    ids = sorted(lengths, key=lambda i: (lengths[i], i))
    out: list[list[str]] = []
    cur: list[str] = []
    width = 0
    for i in ids:
        w = max(width, lengths[i])
        if cur and w * (len(cur) + 1) > batch_tokens:
            out.append(cur)
            cur, width = [], 0
            w = lengths[i]
        cur.append(i)
        width = w
    if cur:
        out.append(cur)
    rng.shuffle(out)
    return out


def _collate(samples: list[FeatureSample], t2d: torch.Tensor, lm_rows: torch.Tensor, device: torch.device,
             dtype: torch.dtype) -> tuple[torch.Tensor, ...]:
    t = max(s.input_ids.shape[0] for s in samples)
    b = len(samples)
    feat = samples[0].aux.shape[-1]
    # built where the features are (host memory for stored ones, the GPU for online ones), then moved
    src = samples[0].aux.device
    t2d_src = t2d.to(src)
    aux = torch.zeros(b, t, feat, dtype=dtype, device=src)
    ids = torch.zeros(b, t, dtype=torch.long, device=src)
    final = torch.zeros(b, t, lm_rows.shape[1], dtype=torch.float32, device=src)
    valid = torch.zeros(b, t, dtype=torch.bool, device=src)
    for i, s in enumerate(samples):
        n = s.input_ids.shape[0]
        aux[i, :n] = s.aux.to(dtype)
        ids[i, :n] = s.input_ids
        final[i, :n] = s.final.float()
        # position p predicts token p+1: trainable if that token is an assistant token and the target's
        # choice there is representable in the draft vocabulary
        v = torch.zeros(n, dtype=torch.bool, device=src)
        v[: n - 1] = s.loss_mask[1:n] & t2d_src[s.target_argmax[: n - 1]]
        valid[i, :n] = v
    logits = final.to(device) @ lm_rows.to(device).T  # [B, T, Vd]
    return aux.to(device), ids.to(device), logits, valid.to(device)


CHAIN_STEPS = 3  # draft tokens per verify step in every profile's eagle3.steps, and EAGLE-3's usual chain


def chain_walk(hits: list[list[bool]], loss_mask: list[bool], steps: int = CHAIN_STEPS) -> list[int]:
    """Drafts accepted at each verify step of a served greedy chain, replayed on one sample's
    teacher-forced hits (``hits[k][t]``: TTT step k at anchor t matched the target's choice for token
    t + 2 + k; ``loss_mask[p]``: token p is a response token). Each response span starts where the
    prefill leaves it: at anchor first - 1, whose hidden state and the first response token draft token
    first + 1."""
    n = len(loss_mask)
    out: list[int] = []
    p = 0
    while p < n:
        if not loss_mask[p]:
            p += 1
            continue
        first = p
        while p < n and loss_mask[p]:
            p += 1
        last = p - 1  # the span's last response token
        t = first - 1
        while t + 2 <= last:
            a = 0
            while a < steps and a < len(hits) and t + 2 + a <= last and hits[a][t]:
                a += 1
            out.append(a)
            t += 1 + a
    return out


@torch.no_grad()
def evaluate_heldout(model: Eagle3Drafter, samples: FeatureLoader, t2d: torch.Tensor,
                     lm_rows: torch.Tensor, cfg: TrainConfig, device: torch.device) -> dict[str, Any]:
    """Teacher-forced top-1 per drafting step on ``samples`` (see the module doc): ``acc`` over the
    positions whose target token is in the draft vocabulary, ``all_acc`` over every assistant position,
    ``chain`` the :func:`chain_walk` of :data:`CHAIN_STEPS` drafts (accept length, per-position rates)."""
    was_training = model.training
    model.eval()
    hits = [0.0] * cfg.ttt_steps
    drafted = [0] * cfg.ttt_steps
    assistant = [0] * cfg.ttt_steps
    walked: list[int] = []
    drafts = min(CHAIN_STEPS, cfg.ttt_steps)  # the drafts a served chain has of this unroll
    lengths = {i: min(n, cfg.max_seq_len) for i, n in samples.lengths.items()}
    for batch_ids in _batches(lengths, cfg.batch_tokens, random.Random(0)):
        batch = samples.batch(batch_ids, cfg.max_seq_len)
        aux, ids, tlogits, valid = _collate(batch, t2d, lm_rows, device, torch.float32)
        with torch.autocast(device_type=device.type, dtype=torch.bfloat16, enabled=device.type == "cuda"):
            out = model.ttt(aux, ids, tlogits, valid, cfg.ttt_steps, keep_hits=True)
        rows = [h.cpu() for h in out.step_hits]
        for i, s in enumerate(batch):
            walked += chain_walk([r[i].tolist() for r in rows[:drafts]], s.loss_mask.tolist(), drafts)
        for k, (a, n) in enumerate(zip(out.step_acc, out.step_count)):
            if n:
                hits[k] += a * n
                drafted[k] += n
            # assistant positions step k is scored on: token p+1+k is an assistant token (as ``valid``,
            # without the vocabulary condition)
            assistant[k] += sum(int(s.loss_mask[1 + k:].sum()) for s in batch)
    if was_training:
        model.train()
    chain = {"steps": drafts, "verify_steps": len(walked),
             "accept_length": 1 + sum(walked) / len(walked) if walked else float("nan"),
             "per_position": [sum(a > j for a in walked) / len(walked) if walked else float("nan") for j in range(drafts)]}
    return {"acc": [h / n if n else float("nan") for h, n in zip(hits, drafted)],
            "all_acc": [h / n if n else float("nan") for h, n in zip(hits, assistant)],
            "positions": assistant[0], "chain": chain}


def _atomic_save(obj: Any, path: Path) -> None:
    tmp = path.with_suffix(path.suffix + ".tmp")
    torch.save(obj, tmp)
    with open(tmp, "rb") as f:
        os.fsync(f.fileno())
    tmp.replace(path)


def train_drafter(
    store: FeatureStore | OnlineFeatures,
    train_ids: list[str],
    target_config: dict[str, Any],
    target_embed: torch.Tensor,
    target_lm_head: torch.Tensor,
    d2t: torch.Tensor,
    t2d: torch.Tensor,
    workdir: Path,
    cfg: TrainConfig,
    *,
    target_norm: torch.Tensor | None = None,
    stop_after_steps: int | None = None,
    heldout_ids: list[str] | None = None,
) -> tuple[Eagle3Drafter, TrainResult]:
    """Train on ``train_ids`` of ``store`` (stored features held in host memory, or
    :class:`~kimi_perf.eagle3.features.OnlineFeatures` computing each batch's rows from the target);
    checkpoints live in ``workdir``. ``stop_after_steps`` ends
    the run early (as a kill would) -- the resume tests use it. ``heldout_ids`` are scored after every
    epoch (:func:`evaluate_heldout`)."""
    if cfg.threads:
        torch.set_num_threads(cfg.threads)
    device = torch.device("cuda" if cfg.device == "auto" and torch.cuda.is_available() else
                          ("cpu" if cfg.device == "auto" else cfg.device))
    autocast = device.type == "cuda"
    workdir = Path(workdir)
    workdir.mkdir(parents=True, exist_ok=True)
    torch.manual_seed(cfg.seed)
    dcfg = Eagle3Config.for_target(target_config, cfg.draft_vocab_size, aux_layer_ids=store.layers
                                   if store.layers != _default_layers(target_config) else None)
    model = Eagle3Drafter(dcfg, target_embed.float())
    model.set_vocab(d2t, t2d)
    used = torch.nonzero(t2d, as_tuple=False).flatten()
    if cfg.init_lm_head == "target":
        # warm start: the drafter's output hidden lives in the target's final-hidden space, so its
        # vocabulary projection (and final norm) start as the target's
        with torch.no_grad():
            model.lm_head.weight.copy_(target_lm_head[used].float())
            if target_norm is not None:
                model.norm.weight.copy_(target_norm.float())
    elif cfg.init_lm_head != "random":
        raise ValueError(f"init_lm_head {cfg.init_lm_head!r}: use 'target' or 'random'")
    if cfg.init_from:
        warm_start(model, cfg.init_from)
    reinit_modules(model, cfg.reinit)
    model.to(device)
    lm_rows = target_lm_head[used].float()
    params = list(model.parameters())
    opt = torch.optim.AdamW(params, lr=cfg.lr, weight_decay=cfg.weight_decay, betas=(0.9, 0.95))
    samples = store.loader(set(train_ids))
    lengths = {i: min(n, cfg.max_seq_len) for i, n in samples.lengths.items()}
    if not lengths:
        raise ValueError("no training samples found in the feature store for the given ids")
    heldout = store.loader(set(heldout_ids)) if heldout_ids else None  # evaluate_heldout truncates
    curve: list[dict[str, Any]] = []
    rng = random.Random(cfg.seed)
    epoch_batches = [_batches(lengths, cfg.batch_tokens, rng) for _ in range(cfg.epochs)]
    total_steps = sum(len(e) for e in epoch_batches)

    def lr_at(step: int) -> float:
        if step < cfg.warmup_steps:
            return cfg.lr * (step + 1) / cfg.warmup_steps
        prog = (step - cfg.warmup_steps) / max(1, total_steps - cfg.warmup_steps)
        return cfg.lr * (cfg.min_lr_ratio + (1 - cfg.min_lr_ratio) * 0.5 * (1 + math.cos(math.pi * min(1.0, prog))))

    state_path = workdir / "train_state.pt"
    step = 0
    tokens = 0
    resumed = 0
    if state_path.is_file():
        st = torch.load(state_path, map_location="cpu", weights_only=False)
        if st.get("config_digest") == cfg.digest() and st.get("train_ids") == sorted(train_ids):
            model.load_state_dict(st["model"])
            opt.load_state_dict(st["optim"])
            step, tokens = int(st["step"]), int(st["tokens"])
            curve = list(st.get("curve", []))  # the held-out points of the epochs before the kill
            random.setstate(st["py_rng"])
            torch.set_rng_state(st["torch_rng"])
            resumed = step
            log(f"drafter training: resuming at step {step}/{total_steps} from {state_path}")
        else:
            log(f"drafter training: {state_path} belongs to another config or data; starting over")
    flat = [(e, b) for e, bs in enumerate(epoch_batches) for b in bs]
    t0 = time.monotonic()
    tok0 = tokens
    last_acc: list[float] = []
    # the loss stays on the device between log lines: reading it back every step (float(loss) after
    # opt.step) would wait for the backward and the optimiser before the next batch is even read.
    # fp64, so the window's sum is the one the former per-step Python floats added up to
    last_loss: torch.Tensor | None = None
    win_loss_t = torch.zeros((), dtype=torch.float64, device=device)
    win_acc, win_n = [0.0] * cfg.ttt_steps, 0

    def save() -> None:
        _atomic_save({"config_digest": cfg.digest(), "train_ids": sorted(train_ids), "model": model.state_dict(),
                      "optim": opt.state_dict(), "step": step, "tokens": tokens, "py_rng": random.getstate(),
                      "torch_rng": torch.get_rng_state(), "curve": curve}, state_path)

    log(f"drafter training: {len(lengths)} samples, {sum(lengths.values())} tokens x {cfg.epochs} epochs, "
        f"{total_steps} steps, TTT {cfg.ttt_steps}, draft vocab {cfg.draft_vocab_size}, device {device}")
    model.train()
    # record_function labels name the step's phases in a torch.profiler trace
    # (benchmarks/drafter_train_speed.py); without an active profiler they cost next to nothing
    while step < total_steps:
        epoch, batch_ids = flat[step]
        with record_function("kimi:batch"):
            batch = samples.batch(batch_ids, cfg.max_seq_len)
        with record_function("kimi:collate"):
            aux, ids, tlogits, valid = _collate(batch, t2d, lm_rows, device, torch.float32)
        for g in opt.param_groups:
            g["lr"] = lr_at(step)
        with record_function("kimi:ttt_forward"), \
                torch.autocast(device_type=device.type, dtype=torch.bfloat16, enabled=autocast):
            out = model.ttt(aux, ids, tlogits, valid, cfg.ttt_steps)
        with record_function("kimi:backward"):
            opt.zero_grad(set_to_none=True)
            out.loss.backward()
        with record_function("kimi:optimizer"):
            torch.nn.utils.clip_grad_norm_(params, cfg.grad_clip)
            opt.step()
        step += 1
        tokens += int(sum(s.input_ids.shape[0] for s in batch))
        last_loss = out.loss.detach()
        last_acc = out.step_acc  # host floats already: ttt reads its per-step numbers back once
        win_loss_t += last_loss
        win_acc = [a + (0.0 if math.isnan(b) else b) for a, b in zip(win_acc, out.step_acc)]
        win_n += 1
        if step % cfg.log_every == 0 or step == total_steps:
            win_loss = float(win_loss_t)  # the one read-back per log line: the window's steps have finished
            el = time.monotonic() - t0
            accs = " ".join(f"{a / win_n:.2f}" for a in win_acc)
            log(f"drafter training: step {step}/{total_steps} epoch {epoch + 1}/{cfg.epochs} loss {win_loss / win_n:.3f} "
                f"top1/step [{accs}] lr {lr_at(step - 1):.2e} {(tokens - tok0) / max(el, 1e-9):.0f} tok/s")
            win_loss_t.zero_()
            win_acc, win_n = [0.0] * cfg.ttt_steps, 0
        # the epoch's held-out point before the checkpoint, so a resumed run reports every epoch's
        if heldout is not None and (step == total_steps or flat[step][0] != epoch):
            ev = evaluate_heldout(model, heldout, t2d, lm_rows, cfg, device)
            curve.append({"epoch": epoch + 1, "step": step, **ev})
            log(f"drafter training: epoch {epoch + 1} held-out ({len(heldout.lengths)} samples) top-1/step "
                f"[{' '.join(f'{a:.2f}' for a in ev['acc'])}], over all assistant tokens "
                f"[{' '.join(f'{a:.2f}' for a in ev['all_acc'])}]; as a {ev['chain']['steps']}-draft chain: accept "
                f"length {ev['chain']['accept_length']:.3f} (per position "
                f"{' / '.join(f'{a:.3f}' for a in ev['chain']['per_position'])}, {ev['chain']['verify_steps']} steps)")
        if step % cfg.checkpoint_every == 0 or step == total_steps:
            save()
        if stop_after_steps is not None and step - resumed >= stop_after_steps:
            break
    final_loss = float(last_loss) if last_loss is not None else float("nan")  # waits for the last step
    el = time.monotonic() - t0
    model.eval()
    return model.cpu(), TrainResult(steps=step, tokens=tokens, seconds=el, tokens_per_s=(tokens - tok0) / max(el, 1e-9),
                                    final_step_acc=last_acc, final_loss=final_loss, resumed_from_step=resumed,
                                    heldout_by_epoch=curve)


REINIT_MODULES = ("fc",)


def reinit_modules(model: Eagle3Drafter, names: tuple[str, ...]) -> None:
    """``train.reinit``: reset the named modules' parameters (after a warm start, with the run's seed)."""
    unknown = [n for n in names if n not in REINIT_MODULES]
    if unknown:
        raise ValueError(f"train.reinit {unknown}: the drafter modules that can start again are {list(REINIT_MODULES)}")
    for n in names:
        getattr(model, n).reset_parameters()
        log(f"drafter training: {n} re-initialised (train.reinit)")


def warm_start(model: Eagle3Drafter, bundle_name: str) -> None:
    """Load the weights of the shipped bundle ``bundle_name`` into ``model`` (``train.init_from``).

    Why: a drafter's held-out acceptance was still rising when its schedule ended (the 47K-sample
    h200-embedded build: 1.958, 2.241, 2.332 over three epochs), and training it again from scratch for
    more epochs costs a whole GPU lease. Training on from the shipped weights with a new, lower schedule
    costs only the added epochs. The bundle's optimiser state is not kept (it ships bf16 weights only), so
    the schedule's warmup starts the moments again. The bundle is verified (sha256) as when it is served,
    and it must be the same shape of drafter on the same draft vocabulary and layers: otherwise the
    weights mean something else, and this is a ValueError naming what differs.
    """
    from safetensors.torch import load_file

    from ..engines.reference.drafter_model import CHECKPOINT_KEYS
    from .bundle import SHIPPED_ROOT, bundle_at, retired, served_path, shipped_names

    bundle = bundle_at(SHIPPED_ROOT / bundle_name) if bundle_name and "/" not in bundle_name else None
    if bundle is None and bundle_name in retired():
        raise ValueError(f"train.init_from {bundle_name} was retired from the tree (kimi_perf/eagle3/shipped_drafters/"
                         f"RETIRED.json): put it back with python -m kimi_perf.eagle3.shipped restore {bundle_name}")
    if bundle is None:
        raise ValueError(f"train.init_from {bundle_name!r} is not a drafter bundle shipped in {SHIPPED_ROOT} "
                         f"(shipped: {', '.join(shipped_names()) or 'none'})")
    path = served_path(bundle)
    sd = load_file(str(path / "model.safetensors"))
    own = model.state_dict()
    layers = json.loads((path / "config.json").read_text()).get("kimi_perf", {}).get("trained_aux_layers")
    problems = [f"{k}: {tuple(sd[k].shape)} vs {tuple(own[k].shape)}" for k in CHECKPOINT_KEYS
                if k in sd and sd[k].shape != own[k].shape]
    problems += [f"{k} is missing" for k in CHECKPOINT_KEYS if k not in sd]
    if not problems:
        problems += [f"{k} differs (another draft vocabulary)" for k in ("d2t", "t2d") if not torch.equal(sd[k], own[k])]
    if layers is not None and tuple(layers) != tuple(model.cfg.aux_layers):
        problems.append(f"aux layers {tuple(layers)} vs {tuple(model.cfg.aux_layers)}")
    if problems:
        raise ValueError(f"train.init_from {bundle_name}: the bundle's drafter does not fit this recipe's: "
                         f"{'; '.join(problems)}. Warm-start from a bundle of the same data, draft vocabulary "
                         "and features, or leave init_from out")
    model.load_state_dict({k: sd[k].to(own[k].dtype) for k in CHECKPOINT_KEYS}, strict=True)
    log(f"drafter training: warm start from shipped drafter {bundle_name}")


def _default_layers(c: dict[str, Any]) -> tuple[int, ...]:
    n = int(c["num_hidden_layers"])
    return (2, n // 2, n - 3)
