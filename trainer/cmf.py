"""The item update of DP-CMF (Curmei et al. 2023, "Private Matrix Factorization with Public Item Features").

Owns: the public item-feature matrix X of the catalog, the closed-form item solve (every catalog
item) and the closed-form feature solve of collective matrix factorization, alternated for a few
inner iterations, and the objective they minimise.

Every public feature value f is one more "user" row with a learned embedding p_f whose "ratings"
are the column X_{:,f}; the objective adds mu/2 ||X - V P^T||_F^2 and a feature ridge to the
released statistics' quadratic and the item ridge. The item solve (per item, P fixed) and the
feature solve (all features, V fixed) are exact block minimisations, so the objective never
increases; with mu = 0 the item solve is exactly DP-ALS (trainer.als). X_jf is item j's bag average
of value f, as in the features encoder (`trainer.features.feature_matrix`). The stats table is
streamed in item batches once per inner iteration: V, P and the sparse X are held, never all the A_j.
docs/models.md ("DP-CMF") has the objective, both solves and the choice of X.

Privacy: reads only released (noised) statistics and the public item features; P is fitted from
X and the released item vectors only. All of it is post-processing of the DP release.
"""

from __future__ import annotations

import numpy as np
import scipy.sparse as sp

from privacy.accumulator import packed_size, project_psd, unpack_upper
from schemas import storage
from schemas.arrays import list_column_to_matrix
from schemas.errors import UserError
from trainer.als import item_systems
from trainer.features import FeatureSpace, feature_matrix
from trainer.solve import batched_solve
from trainer.ssp import check_stats, diagonals


def solve_features(x: sp.spmatrix, vectors: np.ndarray, feature_weight: float, feature_ridge: float) -> np.ndarray:
    """The feature solve: P (F x d) = argmin mu/2 ||X - V P^T||^2 + lambda_f/2 ||P||^2, V fixed."""
    _check_weights(feature_weight, feature_ridge)
    dim = vectors.shape[1]
    gram = feature_weight * (vectors.T @ vectors) + feature_ridge * np.eye(dim)
    rhs = feature_weight * np.asarray(x.T @ vectors)  # (F, d): row f is mu sum_j X_jf v_j
    if rhs.shape[0] == 0:
        return np.zeros((0, dim))
    return np.linalg.solve(gram, rhs.T).T


def solve_items(
    stats_path: str,
    space: FeatureSpace,
    dim: int,
    ridge: float,
    *,
    ridge_scale: np.ndarray | None = None,
    psd_projection: bool = True,
    expected: dict | None = None,
    feature_weight: float = 1.0,
    feature_ridge: float = 1.0,
    inner_iterations: int = 3,
    feature_vectors: np.ndarray | None = None,
    gravity: np.ndarray | None = None,
    batch_size: int = 2048,
) -> tuple[np.ndarray, np.ndarray]:
    """(item vectors (n x d, catalog order), feature vectors (F x d, `features.feature_labels` order)) after
    `inner_iterations` rounds of item solve then feature solve.

    `feature_vectors` are the feature vectors to start from (the caller carries the returned ones
    across outer steps); None starts from P = 0, so the first item solve is plain DP-ALS. The
    returned P is the feature solve for the returned V.
    """
    if not np.isfinite(ridge) or ridge <= 0:
        raise UserError(f"the item ridge must be > 0 for a closed-form solve, got {ridge}")
    _check_weights(feature_weight, feature_ridge)
    if (
        isinstance(inner_iterations, bool)
        or not isinstance(inner_iterations, (int, np.integer))
        or inner_iterations < 1
    ):
        raise UserError(f"inner_iterations must be a positive integer, got {inner_iterations!r}")
    if batch_size < 1:
        raise UserError(f"batch_size must be >= 1, got {batch_size}")
    if ridge_scale is not None and np.shape(ridge_scale) != (space.size,):
        raise UserError(
            f"ridge_scale must have one entry per catalog item ({space.size}), got shape {np.shape(ridge_scale)}"
        )
    if gravity is not None and np.shape(gravity) != (dim, dim):
        raise UserError(f"gravity must be a {dim} x {dim} matrix, got shape {np.shape(gravity)}")
    check_stats(stats_path, {"d": dim, **(expected or {})})
    x = feature_matrix(space)
    if feature_vectors is None:
        features = np.zeros((x.shape[1], dim))
    else:
        features = np.asarray(feature_vectors, dtype=np.float64)
        if features.shape != (x.shape[1], dim):
            raise UserError(f"feature_vectors must be {x.shape[1]} x {dim} (features x d), got shape {features.shape}")
    if feature_weight == 0 or x.shape[1] == 0:
        inner_iterations = 1  # no feature term: the item solve does not depend on P, one pass is exact
    vectors = np.zeros((space.size, dim))
    for _ in range(inner_iterations):
        vectors = _item_pass(
            stats_path,
            space,
            dim,
            ridge,
            ridge_scale=ridge_scale,
            psd_projection=psd_projection,
            batch_size=batch_size,
            gravity=gravity,
            mu=feature_weight,
            x=x,
            features=features,
        )
        features = solve_features(x, vectors, feature_weight, feature_ridge)
    return vectors, features


def objective(
    stats_path: str,
    space: FeatureSpace,
    vectors: np.ndarray,
    feature_vectors: np.ndarray,
    ridge: float,
    *,
    ridge_scale: np.ndarray | None = None,
    psd_projection: bool = True,
    feature_weight: float = 1.0,
    feature_ridge: float = 1.0,
    gravity: np.ndarray | None = None,
    batch_size: int = 2048,
) -> float:
    """L(V, P) of the module docstring (up to the constant of the users' rows), streamed over the stats."""
    dim = vectors.shape[1]
    total = 0.0
    for batch in storage.iter_batches(stats_path, batch_size=batch_size):
        positions = space.index_of(batch.column("item_id").to_numpy())
        a_upper = list_column_to_matrix(batch.column("a_upper"), packed_size(dim), "a_upper")
        if psd_projection:
            a_upper = project_psd(a_upper, dim)
        v = vectors[positions]
        b = list_column_to_matrix(batch.column("b"), dim, "b")
        total += 0.5 * np.einsum("bi,bij,bj->", v, unpack_upper(a_upper, dim), v) - np.sum(b * v)
    scale = ridge_scale if ridge_scale is not None else np.ones(space.size)
    total += 0.5 * ridge * np.sum(scale * np.sum(vectors**2, axis=1))
    if gravity is not None:
        total += 0.5 * np.einsum("bi,ij,bj->", vectors, gravity, vectors)
    x = feature_matrix(space)
    # ||X - V P^T||^2 = ||X||^2 - 2 <X^T V, P> + <V^T V, P^T P>, without forming the dense n x F matrix.
    residual = (
        x.multiply(x).sum()
        - 2.0 * np.sum(np.asarray(x.T @ vectors) * feature_vectors)
        + np.sum((vectors.T @ vectors) * (feature_vectors.T @ feature_vectors))
    )
    return float(total + 0.5 * feature_weight * residual + 0.5 * feature_ridge * np.sum(feature_vectors**2))


def _check_weights(feature_weight: float, feature_ridge: float) -> None:
    if not np.isfinite(feature_weight) or feature_weight < 0:
        raise UserError(f"the feature weight mu must be >= 0, got {feature_weight}")
    if not np.isfinite(feature_ridge) or feature_ridge <= 0:
        raise UserError(f"the feature ridge must be > 0 for a closed-form solve, got {feature_ridge}")


def _item_pass(
    stats_path, space, dim, ridge, *, ridge_scale, psd_projection, batch_size, gravity, mu, x, features
) -> np.ndarray:
    """One item solve over the whole catalog, P fixed: the stats table streamed in batches, then the
    items without a stats row from the feature term alone."""
    vectors = np.zeros((space.size, dim))
    seen = np.zeros(space.size, dtype=bool)
    use_features = mu > 0 and features.shape[0] > 0
    if use_features:
        shared = mu * (features.T @ features)  # mu P^T P, the same for every item
        pulled = mu * np.asarray(x @ features)  # (n, d): row j is mu P^T x_j
    # DP-ALS's own systems (trainer.als), so that mu = 0 reproduces DP-ALS bit for bit
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
        if use_features:
            gram = gram + shared
            b = b + pulled[positions]
        vectors[positions] = batched_solve(gram, b)
        seen[positions] = True
    if use_features:
        missing = np.flatnonzero(~seen)
        for start in range(0, missing.size, batch_size):
            positions = missing[start : start + batch_size]
            scale = ridge_scale[positions] if ridge_scale is not None else np.ones(positions.size)
            gram = diagonals(ridge * scale, dim) + (gravity if gravity is not None else 0.0) + shared
            vectors[positions] = batched_solve(gram, pulled[positions])
    return vectors
