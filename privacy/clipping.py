"""Clipping: bound each example's contribution before it enters a sufficient statistic.

`Clip(x, G) = x * min(1, G / ||x||_2)` for user embeddings (rows of a matrix) and `[-G, G]` for
labels. Privacy: the sensitivity of the statistics (`privacy.accumulator`) holds only because every
u_i and y_i passes through these functions first.

Privacy: a clipped vector's norm is at most its bound: the sensitivity of every release rests on it.
"""

from __future__ import annotations

import math

import numpy as np

from schemas.compiled import kernel
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


def clip_rows_into(
    x: np.ndarray, bound: float, out: np.ndarray, head_bound: float | None = None, constant: float = 0.0
) -> np.ndarray:
    """`out` <- each row of `x` clipped to `bound`, in one compiled pass with no temporaries. With
    `head_bound` a row is first [Clip(x_head, head_bound), constant] (the head: the first out width
    - 1 entries of x), then clipped to `bound`. Norms are summed in the row's order, so a row's bits
    do not depend on the machine or on the rows around it."""
    x = np.asarray(x, dtype=np.float64)
    if x.ndim != 2 or out.ndim != 2 or out.shape[0] != x.shape[0] or out.dtype != np.float64:
        raise ValueError(f"clip of {x.shape} rows into a {out.dtype} array of {out.shape}")
    head = out.shape[1] - (0 if head_bound is None else 1)
    if head > x.shape[1]:
        raise ValueError(f"rows of {x.shape[1]} entries have no head of {head}")
    bound = check_bound("clip norm", bound, allow_inf=True)
    head_bound = math.nan if head_bound is None else check_bound("clip norm", head_bound, allow_inf=True)
    _clip_rows(x, head, head_bound, float(constant), bound, out)
    return out


@kernel
def _norm(row):
    """||row||_2, summed in order; squares that overflow are rescaled by the largest entry first."""
    squared = 0.0
    for value in row:
        squared += value * value
    if not math.isinf(squared):
        return math.sqrt(squared)
    largest = 0.0
    for value in row:
        largest = max(largest, abs(value))
    squared = 0.0
    for value in row:
        squared += (value / largest) * (value / largest)
    return largest * math.sqrt(squared)


@kernel
def _factor(norm, bound):
    """min(1, bound / norm), as `row_scales` (a zero norm: 1)."""
    return 1.0 if norm <= bound else bound / norm


@kernel
def _clip_rows(x, head, head_bound, constant, bound, out):
    for i in range(x.shape[0]):
        row = out[i]
        scale = 1.0 if math.isnan(head_bound) else _factor(_norm(x[i, :head]), head_bound)
        for j in range(head):
            row[j] = x[i, j] * scale
        if not math.isnan(head_bound):
            row[head] = constant
        scale = _factor(_norm(row), bound)
        for j in range(row.size):
            row[j] *= scale


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
