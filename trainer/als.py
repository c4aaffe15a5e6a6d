"""The closed-form item update of DP-ALS (Chien et al. 2021; weights of Krichene et al. 2023).

With the id-only encoder every item has a free embedding, and the item update has a closed form
from the same released statistics as SSP: `v_j = (PSD(A_j) + lambda_j I)^-1 b_j`, where PSD is the
projection onto the PSD cone (post-processing) and lambda_j the same per-item ridge the SSP trainer
uses. With noise off this is plain (weighted-lambda) ALS. Items are solved in streamed batches, so
memory does not grow with the number of items.

Resamples: a step released with R > 1 (`--resamples`) holds R independently noised copies of the
same statistics, and the budget paid for all R. The closed-form solves use their mean
(`trainer.ssp.mean_table`), whose noise has 1/R of one copy's variance, not just one copy.

Privacy: reads only released statistics (post-processing).
"""

from __future__ import annotations

import numpy as np

from privacy.accumulator import packed_size, project_psd, unpack_upper
from schemas import storage
from schemas.arrays import list_column_to_matrix
from schemas.errors import UserError
from trainer.features import FeatureSpace
from trainer.solve import batched_solve
from trainer.ssp import check_stats, diagonals


def item_systems(
    stats_path: str,
    space: FeatureSpace,
    dim: int,
    ridge: float,
    *,
    ridge_scale: np.ndarray | None = None,
    psd_projection: bool = True,
    batch_size: int = 2048,
    gravity: np.ndarray | None = None,
):
    """The per-item ridge systems of a stats table, streamed: (catalog positions, PSD(A_j) +
    lambda_j I (+ gravity), b_j) per batch of items. DP-ALS solves them as they are; DP-CMF
    (trainer.cmf) adds its public feature terms first."""
    for batch in storage.iter_batches(stats_path, batch_size=batch_size):
        positions = space.index_of(batch.column("item_id").to_numpy())
        a_upper = list_column_to_matrix(batch.column("a_upper"), packed_size(dim), "a_upper")
        if psd_projection:
            a_upper = project_psd(a_upper, dim)
        scale = ridge_scale[positions] if ridge_scale is not None else np.ones(positions.size)
        gram = unpack_upper(a_upper, dim) + diagonals(ridge * scale, dim) + (gravity if gravity is not None else 0.0)
        yield positions, gram, list_column_to_matrix(batch.column("b"), dim, "b")


def solve_items(
    stats_path: str,
    space: FeatureSpace,
    dim: int,
    ridge: float,
    *,
    ridge_scale: np.ndarray | None = None,
    psd_projection: bool = True,
    expected: dict | None = None,
    batch_size: int = 2048,
    gravity: np.ndarray | None = None,
) -> np.ndarray:
    """Item embeddings (catalog order) solved from one stats table; items without a row stay 0."""
    if not np.isfinite(ridge) or ridge <= 0:
        raise UserError(f"the item ridge must be > 0 for a closed-form solve, got {ridge}")
    check_stats(stats_path, {"d": dim, **(expected or {})})
    vectors = np.zeros((space.size, dim))
    for positions, gram, b in item_systems(
        stats_path,
        space,
        dim,
        ridge,
        ridge_scale=ridge_scale,
        psd_projection=psd_projection,
        batch_size=batch_size,
        gravity=gravity,
    ):
        vectors[positions] = batched_solve(gram, b)
    return vectors
