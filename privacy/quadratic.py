"""SSP-convex's statistics (the paper's appendix, Algorithm "SSP-convex"): for a convex loss other
than the square, the per-item quadratic approximation of the loss in the item embedding around an
expansion point v0_j (public: the current item embeddings), re-released as v0 moves.

The released H_j = sum_i w_i l''(s_i, y_i) u_i u_i^T and g_j = sum_i w_i l'(s_i, y_i) u_i
(s_i = u_i . v0_j) give SSP2's statistics A_j = H_j, b_j = H_j v0_j - g_j (`expansion`,
post-processing), so the SSP2 trainer, unchanged, descends the approximation. Implicit feedback
(`ssp train --protocol recall --loss logistic`): positives through the stats engines' rows
(`kernel_rows`), every catalog item as a negative through a dense pass over all users per item
(`all_items_sums`), summed before the noise. docs/models.md ("SSP-convex's statistics") has the
derivation.

Privacy: for the logistic loss l'' <= 1/4 and |l'| <= 1, so with per-item weights whose squares sum
to at most wbar^2 over the catalog (`logistic_weights`) removing a user moves (H_1..H_m) by at most
wbar Gamma_u^2 / 4 and (g_1..g_m) by at most wbar Gamma_u. `kernel_rows` writes the rows so that the
accumulator's own sums and noise apply unchanged with the effective clips of `effective_clips`
(clip_u' = Gamma_u / 2, clip_y' = 2), which have exactly those sensitivities.
"""

from __future__ import annotations

import numpy as np

from privacy.accumulator import augment, pack_upper, unpack_upper
from privacy.clipping import row_scales
from schemas.errors import UserError

LOSSES = ("logistic",)


def logistic_derivatives(scores: np.ndarray, labels: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(l', l'') of the logistic loss log(1 + e^s) - y s at each score."""
    sigma = 1.0 / (1.0 + np.exp(-np.asarray(scores, dtype=np.float64)))
    return sigma - np.asarray(labels, dtype=np.float64), sigma * (1.0 - sigma)


def logistic_loss(scores: np.ndarray, labels: np.ndarray) -> np.ndarray:
    """log(1 + e^s) - y s, computed without overflow."""
    scores = np.asarray(scores, dtype=np.float64)
    return np.logaddexp(0.0, scores) - np.asarray(labels, dtype=np.float64) * scores


def effective_clips(clip_u: float) -> tuple[float, float]:
    """(clip_u', clip_y') under which the accumulator's noise fits the logistic H_j and g_j."""
    return clip_u / 2.0, 2.0


def kernel_rows(
    u: np.ndarray, labels: np.ndarray, weights: np.ndarray, expansion_rows: np.ndarray, clip_u: float
) -> tuple[np.ndarray, np.ndarray]:
    """(rows whose grouped sums' A is H_j, rows whose grouped sums' b is g_j) for rows with user
    embeddings u (clipped here to clip_u), labels y in {0, 1}, weights w and the expansion point
    v0 of each row's item (`expansion_rows`, n x d)."""
    w = np.asarray(weights, dtype=np.float64)
    if w.size and (not np.all(np.isfinite(w)) or w.min() < 0):
        raise UserError("weights must be finite and non-negative")
    labels = np.asarray(labels, dtype=np.float64)
    if labels.size and not np.all((labels == 0) | (labels == 1)):
        raise UserError("logistic labels must be 0 or 1")
    u = np.asarray(u, dtype=np.float64)
    clipped = u * row_scales(u, clip_u)[:, None]
    slope, curvature = logistic_derivatives(np.einsum("nd,nd->n", clipped, expansion_rows), labels)
    curvature_rows = augment(clipped * np.sqrt(w * curvature)[:, None], np.zeros(len(w)))
    slope_rows = augment(clipped * (np.sqrt(w) / 2)[:, None], 2 * np.sqrt(w) * slope)
    return curvature_rows, slope_rows


def expansion(h_upper: np.ndarray, g: np.ndarray, v0: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """SSP2's (packed A_j, b_j) = (H_j, H_j v0_j - g_j) of released H_j, g_j and public v0 (items x d)."""
    d = v0.shape[1]
    h = unpack_upper(h_upper, d)
    return pack_upper(h), np.einsum("jab,jb->ja", h, v0) - g


def logistic_weights(positives: np.ndarray, items: int, wbar: float) -> tuple[np.ndarray, np.ndarray]:
    """Each user's (w_p, w_n): the weight of each of its n_pos positives and of each of the `items`
    catalog items as a negative (every item, rated or not: the all-item negatives of implicit
    feedback). Half the squared budget each, scaled so that the user's per-item weights satisfy
    n_pos (w_p + w_n)^2 + (items - n_pos) w_n^2 = wbar^2 exactly: an item the user rated gets both
    terms, so that is the bound `kernel_rows` and `all_items_sums` together need. A function of the
    user's own count and the public catalog size."""
    n = np.asarray(positives, dtype=np.float64)
    if n.size and (n.min() < 1 or n.max() > items):
        raise UserError(f"a user's positives must number 1..{items} (the catalog), got {n.min():g}..{n.max():g}")
    w_p, w_n = np.sqrt(0.5 / np.maximum(n, 1)), np.full(n.shape, np.sqrt(0.5 / items))
    scale = wbar / np.sqrt(n * (w_p + w_n) ** 2 + (items - n) * w_n**2)
    return w_p * scale, w_n * scale


def all_items_sums(
    u: np.ndarray, negative_weights: np.ndarray, v0: np.ndarray, clip_u: float
) -> tuple[np.ndarray, np.ndarray]:
    """(packed H_j, g_j) of every user (rows of u, clipped here) as a negative (label 0) of every item
    of v0 (its expansion points, items x d), weighted by `negative_weights`: a dense n x items block
    of scores, O(n items d^2)."""
    u = np.asarray(u, dtype=np.float64)
    clipped = u * row_scales(u, clip_u)[:, None]
    slope, curvature = logistic_derivatives(clipped @ v0.T, 0.0)  # n x items
    w = np.asarray(negative_weights, dtype=np.float64)[:, None]
    d = u.shape[1]
    outer = (clipped[:, :, None] * clipped[:, None, :]).reshape(len(u), d * d)
    h = ((w * curvature).T @ outer).reshape(-1, d, d)
    return pack_upper(h), (w * slope).T @ clipped
