"""Alignment check with a named cause.

When an extracted layer disagrees with the inference path, "cosine 0.62" is not actionable. The
diagnosis compares the extracted tensor with the inference path's neighbouring layers (k-1, k+1), with
the final RMSNorm applied or removed, and shifted by one token, and names the best match, e.g.
``extracted layer 15 matches inference layer 16 (cos 0.9999 vs 0.87): off-by-one layer id``. When no
transform explains it but the values sit on a coarse grid, it names precision loss (int8/fp8).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

import numpy as np

from .compare import LayerComparison, compare_layer
from .extract import HiddenStates, Layer

__all__ = ["AlignmentError", "AlignmentReport", "Candidate", "check_alignment", "check_layers", "diagnose_layer",
           "quantization_signature"]


class AlignmentError(AssertionError):
    pass


@dataclass(frozen=True)
class Candidate:
    description: str
    cause: str
    cos_min: float
    cos_mean: float


@dataclass
class LayerVerdict:
    layer: Layer
    comparison: LayerComparison
    ok: bool
    threshold: float
    norm_ok: bool
    cause: str | None = None
    message: str | None = None
    candidates: list[Candidate] = field(default_factory=list)


@dataclass
class AlignmentReport:
    pair: str
    verdicts: list[LayerVerdict]

    @property
    def ok(self) -> bool:
        return all(v.ok for v in self.verdicts)

    def failures(self) -> list[LayerVerdict]:
        return [v for v in self.verdicts if not v.ok]

    def raise_if_failed(self) -> None:
        if not self.ok:
            raise AlignmentError(f"hidden-state alignment failed for {self.pair}:\n  "
                                 + "\n  ".join(v.message or "" for v in self.failures()))

    def markdown(self) -> str:
        lines = [f"**{self.pair}**", "", "| layer | cos min | cos p1 | cos mean | rel L2 max | norm ratio | threshold | ok |",
                 "|---|---|---|---|---|---|---|---|"]
        for v in self.verdicts:
            c = v.comparison
            lines.append(f"| {v.layer} | {c.cos_min:.6f} | {c.cos_p1:.6f} | {c.cos_mean:.6f} | {c.rel_l2_max:.4f} | "
                         f"{c.norm_ratio_median:.4f} | {v.threshold:.6f} | {'yes' if v.ok else '**no**: ' + (v.cause or '')} |")
        return "\n".join(lines)


def _rms(x: np.ndarray, w: np.ndarray, eps: float = 1e-5) -> np.ndarray:
    return w * (x / np.sqrt((x * x).mean(-1, keepdims=True) + eps))


def quantization_signature(x: np.ndarray) -> str | None:
    """Name a lossy format the values look rounded to (per-row int8 grid, fp8 e4m3), or None."""
    rows = x[: min(len(x), 32)]
    if rows.size == 0:
        return None
    scale = np.abs(rows).max(1, keepdims=True) / 127.0
    scale[scale == 0] = 1.0
    q = rows / scale
    if np.abs(q - np.round(q)).max() < 1e-3 and len(np.unique(np.round(q))) <= 255:
        return "int8 (per-token absmax grid)"
    try:
        import torch

        t = torch.from_numpy(rows.astype(np.float32))
        if torch.equal(t.to(torch.float8_e4m3fn).float(), t):
            return "fp8 e4m3"
        if torch.equal(t.to(torch.float8_e5m2).float(), t):
            return "fp8 e5m2"
    except (ImportError, AttributeError, TypeError):
        pass
    return None


def diagnose_layer(extracted: np.ndarray, layer: Layer, inference: HiddenStates, *,
                   final_norm_weight: np.ndarray | None, num_layers: int | None) -> list[Candidate]:
    """Score transforms that could explain ``extracted`` (claimed to be ``layer``); best first."""
    cands: list[Candidate] = []

    def add(desc: str, cause: str, a: np.ndarray, b: np.ndarray) -> None:
        if a.shape != b.shape or a.shape[0] == 0:
            return
        c = compare_layer(a, b, layer=str(layer))
        cands.append(Candidate(desc, cause, c.cos_min, c.cos_mean))

    inf = inference.layers
    if layer in inf:
        add(f"inference layer {layer}", "none", extracted, inf[layer])
    if isinstance(layer, int):
        for d in (-1, 1, -2, 2):
            k = layer + d
            if k in inf:
                add(f"inference layer {k}", f"{'off-by-one' if abs(d) == 1 else 'off-by-two'} layer id "
                    f"(extracted {layer} is the residual entering layer {k})", extracted, inf[k])
        if num_layers is not None and layer == num_layers and "final" in inf:
            add("inference final-norm output", "post-norm vs pre-norm: extracted last layer is after the final "
                "RMSNorm, inference's is before it", extracted, inf["final"])
    if layer == "final" and num_layers is not None and num_layers in inf:
        add(f"inference layer {num_layers} (pre-norm)", "pre-norm vs post-norm: extracted 'final' lacks the "
            "final RMSNorm", extracted, inf[num_layers])
    if final_norm_weight is not None:
        ref = inf.get(layer)
        if ref is not None:
            add(f"inference layer {layer} with the final norm applied", "post-norm vs pre-norm: extracted "
                "features went through the final RMSNorm", extracted, _rms(ref, final_norm_weight))
            add(f"extracted with the final norm applied vs inference {layer}", "pre-norm vs post-norm: extracted "
                "features are missing the final RMSNorm", _rms(extracted, final_norm_weight), ref)
    ref = inf.get(layer)
    if ref is not None and len(ref) > 2:
        add(f"inference layer {layer} one token later", "one-token shift: extracted row t is inference row t+1 "
            "(features indexed from the next token)", extracted[:-1], ref[1:])
        add(f"inference layer {layer} one token earlier", "one-token shift: extracted row t is inference row t-1 "
            "(features lag by one token)", extracted[1:], ref[:-1])
    cands.sort(key=lambda c: (c.cos_mean, c.cos_min), reverse=True)
    return cands


def rows_below(cos: np.ndarray, threshold: float, *, max_runs: int = 4, prompt_len: int | None = None) -> str:
    """Where a layer fails, in token positions: ``"12/160 rows below threshold: 148-159 (the last 12)"``.

    Why: an unexplained mismatch is usually *positional* -- a capture that misses the last decode
    step's rows, a block-boundary bug every 16 tokens, a stale first row -- and the position pattern
    names it when no layer, norm or shift transform does."""
    bad = np.flatnonzero(cos < threshold)
    if bad.size == 0:
        return "no row below threshold"
    runs: list[tuple[int, int]] = []
    for i in bad.tolist():
        if runs and i == runs[-1][1] + 1:
            runs[-1] = (runs[-1][0], i)
        else:
            runs.append((i, i))
    n = int(cos.shape[0])
    shown = ", ".join(f"{a}" if a == b else f"{a}-{b}" for a, b in runs[:max_runs])
    more = f", ... ({len(runs)} runs)" if len(runs) > max_runs else ""
    tail = f" (the last {n - runs[-1][0]})" if len(runs) == 1 and runs[-1][1] == n - 1 and runs[-1][0] > 0 else ""
    head = " (from the first row)" if len(runs) == 1 and runs[0][0] == 0 and runs[0][1] < n - 1 else ""
    split = ""
    if prompt_len is not None and 0 < prompt_len < n:
        # prompt rows come from one prefill, generated rows from decode (or verify) steps: which side the
        # failures sit on separates a prefill/capture bug from a decode-path one (CUDA graphs, spec verify)
        in_prompt = int((bad < prompt_len).sum())
        split = (f"; {in_prompt} in the prompt (rows 0-{prompt_len - 1}), {bad.size - in_prompt} in the "
                 f"generated rows ({prompt_len}-{n - 1})")
    return f"{bad.size}/{n} rows below threshold: {shown}{more}{tail}{head}{split}"


def positional_cause(cos: np.ndarray, threshold: float, prompt_len: int | None) -> str | None:
    """Name a mismatch by where its rows sit, when no transform of the values explains it.

    Prompt rows come from one prefill, generated rows from decode steps. Failures confined to the
    generated rows, with every prompt row agreeing, cannot be a layer, norm or indexing fault (those
    move every row): the capture's decode side returned rows the model did not compute there -- on
    vLLM 0.26.0's extract_hidden_states on an H200 the last 17 of 31 generated rows, the signature of a
    copy read before it completed. Confined to the prompt rows, it is the prefill side (chunked
    prefill, a prefix-cache hit that skipped rows)."""
    bad = np.flatnonzero(cos < threshold)
    n = int(cos.shape[0])
    if bad.size == 0 or prompt_len is None or not 0 < prompt_len < n:
        return None
    tail = bad.size == n - int(bad[0]) and int(bad[-1]) == n - 1
    if int(bad[0]) >= prompt_len:
        return ("decode-path capture fault: every prompt row agrees, "
                + (f"the last {bad.size} generated rows do not (the final decode steps' rows are not what the "
                   "model computed, e.g. read before their copy completed)" if tail else
                   f"{bad.size} of {n - prompt_len} generated rows do not (CUDA graphs, async scheduling or "
                   "speculative verify in the capture's decode path)"))
    if int(bad[-1]) < prompt_len:
        return (f"prefill-path capture fault: {bad.size} of {prompt_len} prompt rows disagree while every "
                "generated row agrees (chunked prefill or a prefix-cache hit in the capture)")
    return None


def check_alignment(
    extracted: HiddenStates,
    inference: HiddenStates,
    layers: Sequence[Layer],
    *,
    threshold: float,
    norm_ratio_tol: float,
    final_norm_weight: np.ndarray | None = None,
    num_layers: int | None = None,
) -> AlignmentReport:
    """Compare ``layers`` of the two sides; diagnose every failing layer."""
    n = min(len(extracted.token_ids), len(inference.token_ids))
    if extracted.token_ids[:n] != inference.token_ids[:n]:
        first = next(i for i in range(n) if extracted.token_ids[i] != inference.token_ids[i])
        raise AlignmentError(f"the two sides cover different tokens from position {first} on "
                             f"({extracted.provenance.backend} vs {inference.provenance.backend}): compare the "
                             "same sequence (regenerate, or compare only the common prefix)")
    pair = (f"{extracted.provenance.backend} [{extracted.provenance.dtype}] vs "
            f"{inference.provenance.backend} [{inference.provenance.dtype}]")
    ext = HiddenStates({k: v[:n] for k, v in extracted.layers.items()}, extracted.token_ids[:n], extracted.provenance)
    inf = HiddenStates({k: v[:n] for k, v in inference.layers.items()}, inference.token_ids[:n], inference.provenance)
    verdicts = []
    for k in layers:
        c = compare_layer(ext.get(k), inf.get(k), layer=str(k))
        norm_ok = abs(c.norm_ratio_median - 1.0) <= norm_ratio_tol
        ok = c.cos_min >= threshold and norm_ok
        v = LayerVerdict(layer=k, comparison=c, ok=ok, threshold=threshold, norm_ok=norm_ok)
        if not ok:
            cands = diagnose_layer(ext.get(k), k, inf, final_norm_weight=final_norm_weight, num_layers=num_layers)
            v.candidates = cands
            base = next((x for x in cands if x.cause == "none"), None)
            best = cands[0] if cands else None
            why = (f"cos min {c.cos_min:.4f} (p1 {c.cos_p1:.4f}, mean {c.cos_mean:.4f}) < threshold {threshold:.6f}"
                   if c.cos_min < threshold else
                   f"cos min {c.cos_min:.4f} passes but norm ratio {c.norm_ratio_median:.3f} is off by more than "
                   f"{norm_ratio_tol:.3f}")
            if best is not None and best.cause != "none" and best.cos_mean > (base.cos_mean if base else -1) + 1e-4:
                v.cause = best.cause
                v.message = (f"layer {k}: {why}; extracted layer {k} matches {best.description} "
                             f"(cos {best.cos_mean:.4f} vs {base.cos_mean if base else float('nan'):.4f}): {best.cause}")
            else:
                q = quantization_signature(ext.get(k))
                if q is not None:
                    v.cause = f"precision loss: extracted values are rounded to {q}"
                else:
                    prompt_len = inference.prompt_len if inference.prompt_len is not None else extracted.prompt_len
                    where = rows_below(c.cos, threshold, prompt_len=prompt_len)
                    v.cause = (f"{positional_cause(c.cos, threshold, prompt_len) or 'unexplained mismatch'} (no "
                               f"neighbouring layer, norm or token shift matches better); {where}")
                v.message = f"layer {k}: {why}; {v.cause}"
            if not norm_ok and v.cause and "norm" not in v.cause and c.cos_min >= threshold:
                v.cause = f"scale mismatch (norm ratio {c.norm_ratio_median:.3f}): {v.cause}"
        verdicts.append(v)
    return AlignmentReport(pair=pair, verdicts=verdicts)


def check_layers(
    pairs: Sequence[tuple[HiddenStates, HiddenStates]],
    thresholds: Mapping[Layer, tuple[float, float]],
    *,
    final_norm_weight: np.ndarray | None = None,
    num_layers: int | None = None,
    pair: str | None = None,
) -> AlignmentReport:
    """:func:`check_alignment` with each layer gated on its *own* (cosine threshold, norm-ratio
    tolerance), over several (side under test, reference side) pairs -- one per prompt. Per layer the
    report keeps the worst prompt's verdict (a failing one before any passing one), so a layer fails
    when any prompt fails it. Why per layer: the noise floor differs by two orders of magnitude between
    an early and a late layer in bf16, and one shared threshold is either blind early or flaky late."""
    worst: dict[Layer, LayerVerdict] = {}
    name = pair
    for a, b in pairs:
        for k, (thr, tol) in thresholds.items():
            rep = check_alignment(a, b, [k], threshold=thr, norm_ratio_tol=tol, final_norm_weight=final_norm_weight,
                                  num_layers=num_layers)
            v = rep.verdicts[0]
            name = name or rep.pair
            cur = worst.get(k)
            if (cur is None or (cur.ok and not v.ok)
                    or (cur.ok == v.ok and v.comparison.cos_min < cur.comparison.cos_min)):
                worst[k] = v
    return AlignmentReport(pair=name or "?", verdicts=[worst[k] for k in thresholds if k in worst])


def heatmap_png(report: AlignmentReport, path: str, *, max_tokens: int = 256) -> str:
    """Layer x token cosine heatmap of one comparison."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = [v.comparison.cos[:max_tokens] for v in report.verdicts]
    width = max(len(r) for r in rows)
    grid = np.full((len(rows), width), np.nan)
    for i, r in enumerate(rows):
        grid[i, : len(r)] = r
    fig, ax = plt.subplots(figsize=(min(14, 2 + width / 20), 1 + 0.45 * len(rows)))
    lo = float(np.nanmin(grid))
    im = ax.imshow(grid, aspect="auto", cmap="viridis", vmin=min(lo, 0.99), vmax=1.0, interpolation="nearest")
    ax.set_yticks(range(len(rows)), [str(v.layer) for v in report.verdicts])
    ax.set_xlabel("token position")
    ax.set_ylabel("layer")
    ax.set_title(report.pair, fontsize=9)
    fig.colorbar(im, ax=ax, label="cosine")
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return path


def check_served_layers(
    stored: HiddenStates,
    inference: HiddenStates,
    trained: Sequence[int],
    served: Sequence[int],
    *,
    threshold: float,
    norm_ratio_tol: float,
) -> AlignmentReport:
    """The features a drafter was trained on (``stored``, layers ``trained``) against what a serving
    engine actually feeds it (``inference`` layer ``served[i]`` for ``trained[i]``). ``inference`` must
    hold neighbouring layers too, so a mismatch can be located."""
    n = min(len(stored.token_ids), len(inference.token_ids))
    if stored.token_ids[:n] != inference.token_ids[:n]:
        raise AlignmentError("stored features and the inference pass cover different tokens")
    verdicts = []
    for k, sv in zip(trained, served):
        c = compare_layer(stored.get(k)[:n], inference.get(sv)[:n], layer=f"{k}->{sv}")
        norm_ok = abs(c.norm_ratio_median - 1.0) <= norm_ratio_tol
        v = LayerVerdict(layer=k, comparison=c, ok=c.cos_min >= threshold and norm_ok, threshold=threshold, norm_ok=norm_ok)
        if not v.ok:
            best_j, best = None, -2.0
            for j, arr in inference.layers.items():
                if isinstance(j, int):
                    m = compare_layer(stored.get(k)[:n], arr[:n]).cos_mean
                    if m > best:
                        best_j, best = j, m
            if best_j is not None and best_j != sv and best > c.cos_mean:
                d = best_j - sv
                kind = "off-by-one" if abs(d) == 1 else f"off-by-{abs(d)}"
                v.cause = (f"{kind} layer id: the checkpoint's aux-layer ids are read in another engine's "
                           f"convention (serving feeds layer {sv}, training used layer {best_j})")
                v.message = (f"drafter trained on layer {k} features, the serving path feeds layer {sv} "
                             f"(cos mean {c.cos_mean:.4f}, min {c.cos_min:.4f}); stored layer {k} matches inference "
                             f"layer {best_j} (cos {best:.4f} vs {c.cos_mean:.4f}): {v.cause}")
            else:
                v.cause = "unexplained mismatch"
                v.message = f"layer {k} -> served {sv}: cos min {c.cos_min:.4f} < {threshold:.4f}; {v.cause}"
        verdicts.append(v)
    return AlignmentReport(pair=f"{stored.provenance.backend} vs {inference.provenance.backend} (as served)",
                           verdicts=verdicts)
