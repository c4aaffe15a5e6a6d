"""Clipping: bound each example's contribution before it enters a sufficient statistic.

`Clip(x, G) = x * min(1, G / ||x||_2)` for user embeddings (rows of a matrix) and `[-G, G]` for
labels. Privacy: the sensitivity of the statistics (`privacy.accumulator`) holds only because every
u_i and y_i passes through these functions first.

Privacy: a clipped vector's norm is at most its bound: the sensitivity of every release rests on it.
"""

from __future__ import annotations

import numpy as np

from schemas.errors import UserError


def check_bound(name: str, bound: float, allow_inf: bool = False) -> float:
    """A clip norm must be a positive number, finite unless `allow_inf` (no clipping: non-private)."""
    bound = float(bound)
    if np.isnan(bound) or bound <= 0 or (bound == np.inf and not allow_inf):
        raise UserError(f"{name} must be a finite number > 0, got {bound}")
    return bound


def row_scales(x: np.ndarray, bound: float) -> np.ndarray:
    """Per row of `x`, the factor min(1, bound / ||x||_2) that clipping multiplies it by."""
    bound = check_bound("clip norm", bound, allow_inf=True)
    x = np.asarray(x, dtype=np.float64)
    with np.errstate(over="ignore"):
        squared = np.einsum("ij,ij->i", x, x)
    if not np.all(np.isfinite(squared)):  # squares overflowed: rescale by the largest entry first
        largest = np.max(np.abs(x), axis=-1) if x.shape[-1] else np.zeros(x.shape[0])
        with np.errstate(invalid="ignore", divide="ignore"):
            squared = np.where(largest > 0, np.einsum("ij,ij->i", x / largest[:, None], x / largest[:, None]), 0.0)
        norms = largest * np.sqrt(squared)
    else:
        norms = np.sqrt(squared)
    with np.errstate(divide="ignore"):
        return np.minimum(1.0, bound / norms)


def clip_rows(x: np.ndarray, bound: float) -> np.ndarray:
    """Scale each row of `x` down to L2 norm at most `bound` (rows already inside are unchanged)."""
    x = np.asarray(x, dtype=np.float64)
    return x * row_scales(x.reshape(-1, x.shape[-1]) if x.ndim != 2 else x, bound).reshape(x.shape[:-1] + (1,))


def clip_labels(y: np.ndarray, bound: float) -> np.ndarray:
    """Clip labels to [-bound, bound]."""
    bound = check_bound("label clip", bound, allow_inf=True)
    return np.clip(np.asarray(y, dtype=np.float64), -bound, bound)


def biased_row_clip(clip_u: float, bias_coordinate: float, has_embedding: bool = True) -> float:
    """The norm bound of a biased statistics row [Clip(u, clip_u), c] with c = bias_coordinate x clip_u:
    sqrt(clip_u^2 + c^2), or c alone without embedding coordinates (the per-item mean's rows [c]).
    The noise of A_j and b_j is scaled to it (pipelines.releases.stats_core, trainer.item_mean,
    privacy.report), so it is stated once here."""
    c = bias_coordinate * clip_u
    return float(np.hypot(clip_u, c)) if has_embedding else float(c)
