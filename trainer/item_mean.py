"""The DP per-item mean (`--item-update item-mean`): the baseline a practitioner tries first.

Its statistics are those of a model of item biases alone: every user vector is [1, 0] (no embedding,
no bias), so each item's released A_j = c^2 W_j + noise and b_j = c S_j + noise, with W_j the item's
weighted count, S_j its weighted sum of clipped, centred labels and c the bias coordinate
(pipelines.releases.stats_core). The estimate is the posterior mean of the item's offset from the DP
mean under a normal prior: with S_j | mu_j ~ N(W_j mu_j, V + W_j sigma^2) and mu_j ~ N(0, tau^2),

    mu_j = S_j / (W_j + sigma^2 / tau^2 + V / (tau^2 W_j)),

where V is the variance of the noise on S_j (from the release's own noise multiplier and clips) and
sigma, tau come from the public rating scale (a rating's spread about its item's mean, half the
scale; an item's spread about the DP mean, a quarter of it). A heavily rated item gets its weighted
mean, an item whose statistics are mostly noise (W_j small against sqrt(V)) stays at the DP mean,
and without noise this is the classic shrunk mean with a pseudo-count of four ratings.

Privacy: reads only released statistics (post-processing) and the public rating scale.
"""

from __future__ import annotations

import math

import numpy as np

from privacy.clipping import biased_row_clip
from schemas import storage
from schemas.arrays import list_column_to_matrix
from schemas.errors import UserError
from schemas.tables import stats_metadata
from trainer.features import FeatureSpace
from trainer.ssp import check_stats


def rating_prior(rating_range: tuple[float, float]) -> tuple[float, float]:
    """(sigma, tau) of the public rating scale: a rating's spread about its item's mean (half the
    scale) and an item's spread about the DP mean (a quarter of it), in rating units."""
    low, high = rating_range
    return (high - low) / 2, (high - low) / 4


def item_means(
    stats_path: str,
    space: FeatureSpace,
    bias_scale: float,
    noise_std_b: float,
    rating_range: tuple[float, float],
    expected: dict | None = None,
) -> np.ndarray:
    """Each catalog item's offset from the DP mean divided by `bias_scale` (catalog order, one column:
    the id encoder's bias output); items without a row stay 0. `noise_std_b`: the standard deviation
    of the noise on b_j (noise multiplier x wbar x clip_y x clip of the rows, over sqrt(R) for a
    mean of R resamples); 0 without noise."""
    check_stats(stats_path, {"d": 1, **(expected or {})})
    if not stats_metadata(storage.read_schema(stats_path))["bias"]:
        raise UserError(
            f"{stats_path}: stats were released without the bias coordinate (bias=0): they hold no item's count and "
            "label sum"
        )
    low, high = rating_range
    if not (math.isfinite(low) and math.isfinite(high) and low < high) or not (bias_scale > 0 and noise_std_b >= 0):
        raise UserError(
            f"the per-item mean needs a finite rating scale, c > 0 and a noise std >= 0; got {rating_range}, "
            f"{bias_scale}, {noise_std_b}"
        )
    spread, prior = rating_prior(rating_range)
    variance = (noise_std_b / bias_scale) ** 2  # V: the noise on S_j = b_j / c
    means = np.zeros((space.size, 1))
    for batch in storage.iter_batches(stats_path, batch_size=8192):
        positions = space.index_of(batch.column("item_id").to_numpy())
        weight = np.maximum(
            list_column_to_matrix(batch.column("a_upper"), 1, "a_upper")[:, 0] / bias_scale**2, 0.0
        )  # W_j, noised
        total = list_column_to_matrix(batch.column("b"), 1, "b")[:, 0] / bias_scale  # S_j, noised
        shrink = (
            weight**2 + weight * (spread / prior) ** 2 + variance / prior**2
        )  # W (W + sigma^2/tau^2 + V/(tau^2 W)), kept finite at W = 0
        means[positions, 0] = np.where(shrink > 0, weight * total / np.where(shrink > 0, shrink, 1.0), 0.0) / bias_scale
    return means


def noise_std_b(stats_path: str) -> float:
    """The standard deviation of the noise on each b_j of a released table: noise multiplier x wbar
    x clip_y x the rows' clip (the bias coordinate c = k clip_u alone), over sqrt(R) for a mean of
    R resamples (trainer.ssp.mean_table)."""
    schema = storage.read_schema(stats_path)
    meta = stats_metadata(schema)
    if meta["noise_multiplier"] == 0:
        return 0.0
    averaged = int((schema.metadata or {}).get(b"averaged_resamples", b"1"))
    clip_x = biased_row_clip(meta["clip_u"], meta["bias"], has_embedding=False)  # the rows are [c] alone
    return meta["noise_multiplier"] * meta["wbar"] * meta["clip_y"] * clip_x / math.sqrt(averaged)
