"""Evaluation metrics of the two benchmark protocols: RMSE (regression) and Recall@k (ranking).

NumPy only (no TensorFlow): the metrics run wherever the predictions are.

Recall@k follows Liang et al. 2018: for each user with at least one target, the number of targets
among the k highest-scored items, divided by min(k, number of targets); the metric is the mean over
those users. The user's fold-in history is excluded from the ranking (its scores become -inf), and
ties are broken deterministically in favour of the lower item index (Liang's code leaves them to
argpartition).

Privacy: computed on held-out rows on the trusted side; not a release.
"""

from __future__ import annotations

import numpy as np

from schemas.errors import UserError

_ROW_BLOCK = 1024  # users ranked at a time, to bound the temporaries of large score matrices


def rmse(predictions, labels) -> float:
    """Root mean squared error between predictions and labels (1-D, same length, finite)."""
    predictions = np.asarray(predictions, dtype=np.float64)
    labels = np.asarray(labels, dtype=np.float64)
    if predictions.ndim != 1 or predictions.shape != labels.shape:
        raise UserError(
            f"predictions and labels must be 1-D arrays of one length, got shapes {predictions.shape} and "
            f"{labels.shape}"
        )
    if predictions.size == 0:
        raise UserError("rmse of no predictions is undefined")
    if not (np.all(np.isfinite(predictions)) and np.all(np.isfinite(labels))):
        raise UserError("predictions and labels must be finite")
    return float(np.sqrt(np.mean((predictions - labels) ** 2)))


def _mask(name: str, mask, shape: tuple[int, ...]) -> np.ndarray:
    mask = np.asarray(mask)
    if mask.shape != shape:
        raise UserError(f"{name} must have the shape of scores {shape}, got {mask.shape}")
    if mask.dtype != bool:
        if not np.all((mask == 0) | (mask == 1)):
            raise UserError(f"{name} must be a boolean (or 0/1) mask")
        mask = mask.astype(bool)
    return mask


def top_k_mask(scores: np.ndarray, history: np.ndarray, k: int) -> np.ndarray:
    """Boolean mask of each user's top-k items among the items outside their history.

    History items get score -inf; among equal scores the lower item index wins. If a user has fewer
    than k items outside the history, history items fill the remaining places (they can never be
    targets, so they do not count as hits).
    """
    n_users, n_items = scores.shape
    k = min(k, n_items)
    masked = np.where(history, -np.inf, scores)
    if k == 0:
        return np.zeros(scores.shape, dtype=bool)
    # The k-th largest score per user; everything strictly above it is in, equal ones fill up by index.
    kth = -np.partition(-masked, k - 1, axis=1)[:, k - 1 : k]
    above = masked > kth
    equal = masked == kth
    room = k - above.sum(axis=1, keepdims=True)
    return above | (equal & (np.cumsum(equal, axis=1) <= room))


def recall_at_k_per_user(scores: np.ndarray, history: np.ndarray, targets: np.ndarray, k: int = 20) -> np.ndarray:
    """Per-user Recall@k: hits / min(k, |targets|); NaN for users without targets.

    scores: (users x items) float array; history and targets: boolean masks of the same shape,
    disjoint (a target in the history could never be recommended).
    """
    scores = np.asarray(scores, dtype=np.float64)
    if scores.ndim != 2:
        raise UserError(f"scores must be a 2-D (users x items) array, got shape {scores.shape}")
    history = _mask("history", history, scores.shape)
    targets = _mask("targets", targets, scores.shape)
    if isinstance(k, bool) or not isinstance(k, (int, np.integer)) or k < 1:
        raise UserError(f"k must be a positive integer, got {k!r}")
    if np.isnan(scores).any():
        raise UserError("scores hold NaN")
    if (history & targets).any():
        user = int(np.flatnonzero((history & targets).any(axis=1))[0])
        raise UserError(f"history and targets overlap (user row {user}); they must be disjoint")
    n_targets = targets.sum(axis=1)
    hits = np.empty(scores.shape[0], dtype=np.int64)
    for start in range(0, scores.shape[0], _ROW_BLOCK):
        rows = slice(start, start + _ROW_BLOCK)
        hits[rows] = (top_k_mask(scores[rows], history[rows], k) & targets[rows]).sum(axis=1)
    recall = np.full(scores.shape[0], np.nan)
    has = n_targets > 0
    recall[has] = hits[has] / np.minimum(k, n_targets[has])
    return recall


def recall_at_k(scores: np.ndarray, history: np.ndarray, targets: np.ndarray, k: int = 20) -> float:
    """Mean Recall@k over the users that have at least one target (see `recall_at_k_per_user`)."""
    per_user = recall_at_k_per_user(scores, history, targets, k)
    evaluated = per_user[~np.isnan(per_user)]
    if evaluated.size == 0:
        raise UserError("no user has a target: Recall@k is undefined")
    return float(evaluated.mean())
