"""Comparison math for hidden states: per-token cosine similarity and relative L2 error per layer.

Why both and a norm ratio: cosine alone hides a missing or doubled RMSNorm on models whose norm
weights are all 1 (random test models), and hides scale bugs entirely; relative L2 and the ratio of
norms catch those. Summary statistics are min / p1 / mean (the worst token matters: one bad position
is one rejected draft).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

__all__ = ["AlignmentInputError", "LayerComparison", "compare_layer"]


class AlignmentInputError(ValueError):
    """The two sides cannot be compared (shape, token count, NaN, empty); the message says which."""


@dataclass(frozen=True)
class LayerComparison:
    layer: str
    n_tokens: int
    cos: np.ndarray  # [T] per token
    rel_l2: np.ndarray  # [T] ||a - b|| / ||b||
    norm_ratio: np.ndarray  # [T] ||a|| / ||b||

    @property
    def cos_min(self) -> float:
        return float(self.cos.min())

    @property
    def cos_p1(self) -> float:
        return float(np.percentile(self.cos, 1))

    @property
    def cos_mean(self) -> float:
        return float(self.cos.mean())

    @property
    def rel_l2_max(self) -> float:
        return float(self.rel_l2.max())

    @property
    def norm_ratio_median(self) -> float:
        return float(np.median(self.norm_ratio))

    @property
    def worst_token(self) -> int:
        return int(self.cos.argmin())

    def summary(self) -> dict[str, float]:
        return {"cosine_min": self.cos_min, "cosine_p1": self.cos_p1, "cosine_mean": self.cos_mean,
                "rel_l2_max": self.rel_l2_max, "norm_ratio_median": self.norm_ratio_median,
                "n_tokens": float(self.n_tokens)}


def _as_2d(x: object, name: str) -> np.ndarray:
    try:
        import torch

        if isinstance(x, torch.Tensor):
            x = x.detach().float().cpu().numpy()
    except ImportError:  # pragma: no cover - torch is always present where tensors are
        pass
    a = np.asarray(x, dtype=np.float64)
    if a.ndim == 1:
        a = a[None, :]
    if a.ndim != 2:
        raise AlignmentInputError(f"{name}: expected [tokens, hidden], got shape {a.shape}")
    return a


def compare_layer(a: object, b: object, *, layer: str = "?", eps: float = 1e-12) -> LayerComparison:
    """Compare ``a`` (e.g. extracted) against ``b`` (e.g. inference), token by token."""
    x = _as_2d(a, f"layer {layer} side A")
    y = _as_2d(b, f"layer {layer} side B")
    if x.shape[0] == 0 or y.shape[0] == 0:
        raise AlignmentInputError(f"layer {layer}: no tokens to compare (A has {x.shape[0]}, B has {y.shape[0]})")
    if x.shape[0] != y.shape[0]:
        raise AlignmentInputError(
            f"layer {layer}: token counts differ (A {x.shape[0]}, B {y.shape[0]}); both sides must cover the "
            "same positions -- SGLang returns prompt + output[:-1] rows; an HF forward over prompt + output "
            "has one more (drop its last)")
    if x.shape[1] != y.shape[1]:
        raise AlignmentInputError(f"layer {layer}: hidden sizes differ (A {x.shape[1]}, B {y.shape[1]}): "
                                  "wrong layer split of concatenated aux rows?")
    for nm, arr in (("A", x), ("B", y)):
        bad = ~np.isfinite(arr)
        if bad.any():
            tok = int(np.argwhere(bad)[0][0])
            raise AlignmentInputError(f"layer {layer}: side {nm} has {int(bad.sum())} non-finite values "
                                      f"(first at token {tok}): overflow in the capture dtype?")
    na = np.linalg.norm(x, axis=1)
    nb = np.linalg.norm(y, axis=1)
    cos = (x * y).sum(1) / np.maximum(na * nb, eps)
    rel = np.linalg.norm(x - y, axis=1) / np.maximum(nb, eps)
    ratio = na / np.maximum(nb, eps)
    # an all-zero row on both sides agrees perfectly; on one side it is a total mismatch
    both0 = (na < eps) & (nb < eps)
    cos = np.where(both0, 1.0, cos)
    rel = np.where(both0, 0.0, rel)
    ratio = np.where(both0, 1.0, ratio)
    return LayerComparison(layer=str(layer), n_tokens=int(x.shape[0]), cos=np.clip(cos, -1.0, 1.0), rel_l2=rel,
                           norm_ratio=ratio)


def threshold_from_floor(floor_cos_min: float, margin: float, min_gap: float = 1e-7) -> float:
    """A cosine threshold ``margin`` times looser than the measured noise floor: the *distance* from 1
    scales, so a floor of 0.9996 with margin 5 gives 0.998. ``min_gap`` keeps an exact (fp32) floor
    from demanding bit-identical results."""
    if not math.isfinite(floor_cos_min):
        raise AlignmentInputError("noise floor is not finite")
    return 1.0 - margin * max(1.0 - floor_cos_min, min_gap)
