"""Clipping: bound each example's contribution before it enters a sufficient statistic.

`Clip(x, G) = x * min(1, G / ||x||_2)` for user embeddings (rows of a matrix) and `[-G, G]` for
labels. Privacy: the sensitivity of the statistics (`privacy.accumulator`) holds only because every
u_i and y_i passes through these functions first.
"""

from __future__ import annotations

import numpy as np


def check_bound(name: str, bound: float, allow_inf: bool = False) -> float:
    """A clip norm must be a positive number, finite unless `allow_inf` (no clipping: non-private)."""
    bound = float(bound)
    if np.isnan(bound) or bound <= 0 or (bound == np.inf and not allow_inf):
        raise ValueError(f"{name} must be a finite number > 0, got {bound}")
    return bound


def clip_rows(x: np.ndarray, bound: float) -> np.ndarray:
    """Scale each row of `x` down to L2 norm at most `bound` (rows already inside are unchanged)."""
    bound = check_bound("clip norm", bound, allow_inf=True)
    x = np.asarray(x, dtype=np.float64)
    largest = np.max(np.abs(x), axis=-1, keepdims=True) if x.shape[-1] else np.zeros(x.shape[:-1] + (1,))
    with np.errstate(invalid="ignore", divide="ignore"):
        norms = largest * np.linalg.norm(np.where(largest > 0, x / largest, 0.0), axis=-1, keepdims=True)  # no overflow
    with np.errstate(divide="ignore"):
        scale = np.minimum(1.0, bound / norms)
    return x * scale


def clip_labels(y: np.ndarray, bound: float) -> np.ndarray:
    """Clip labels to [-bound, bound]."""
    bound = check_bound("label clip", bound, allow_inf=True)
    return np.clip(np.asarray(y, dtype=np.float64), -bound, bound)
