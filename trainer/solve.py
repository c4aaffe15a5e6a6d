"""Closed-form ridge solves per key: the user update of alternating minimization (and fold-in).

For the rows of each key k (a user) with vectors v_i (the items' embeddings) and labels y_i:
`u_k = (sum v_i v_i^T + lambda_k I)^-1 sum y_i v_i`, with lambda_k = lambda or lambda * n_k. Each key's
normal equations come from one compiled pass over its rows (trainer.normal_equations); the solves are batched.

Privacy: the user update uses a user's own rows and released item embeddings only; its output
(user embeddings) is private and stays in the run directory.
"""

from __future__ import annotations

import numpy as np
from threadpoolctl import threadpool_limits

from privacy.accumulator import stable_argsort
from schemas.errors import UserError


def batched_solve(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    """x with a[k] @ x[k] = b[k] for a batch of small systems a (..., d, d), b (..., d), on one BLAS
    thread: OpenBLAS hands each small LAPACK solve to its threads, which costs more than the solve,
    and far more while another process keeps the cores busy (docs/results.md, "Small solves on one
    BLAS thread")."""
    with threadpool_limits(1, user_api="blas"):
        return np.linalg.solve(a, b[..., None])[..., 0]


def cholesky_solve(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    """x with a[k] @ x[k] = b[k] for symmetric positive definite a (keys, d, d), b (keys, d): each
    system by its Cholesky factor, compiled (trainer.normal_equations; faster than numpy's batched LU
    solves: docs/results.md); a system without one (not positive definite in floating point) by
    `batched_solve`, which refuses a singular one."""
    from trainer.normal_equations import cholesky_solve_kernel  # numba's import, once a process

    a, b = np.ascontiguousarray(a, dtype=np.float64), np.ascontiguousarray(b, dtype=np.float64)
    x, solved = np.zeros(b.shape), np.empty(b.shape[0], dtype=np.bool_)
    cholesky_solve_kernel(a, b, x, solved)
    if not solved.all():
        x[~solved] = batched_solve(a[~solved], b[~solved])
    return x


def confidence(counts: np.ndarray, alpha: float) -> np.ndarray:
    """How much a (user, item) seen `counts` times weighs (implicit feedback): Hu, Koren and
    Volinsky's c = 1 + alpha log(1 + count), relative to one interaction, so that a single play,
    and every row of explicit data, weighs 1."""
    counts = np.asarray(counts, dtype=np.float64)
    if not np.all(np.isfinite(counts)) or (counts.size and counts.min() < 1):
        raise UserError("interaction counts must be finite and at least 1")
    return (1.0 + alpha * np.log1p(counts)) / (1.0 + alpha * np.log(2.0))


def user_bias_ridge(protocol: str, biases: bool, lambda_bias: float | None) -> float | None:
    """`ridge_solve`'s bias_ridge for a model: None without biases; with them `lambda_bias` for
    ratings, infinite (every user's bias held at 0) for ranking, where a user's bias orders nothing
    and the item update's gravity has no term for it."""
    if not biases:
        return None
    return lambda_bias if protocol == "rmse" else float("inf")


def free_coordinates(width: int, bias_ridge: float | None) -> np.ndarray:
    """The coordinates of item vectors of `width` columns that each key solves against (ridge_solve):
    every one; with biases ([v, b_j, 1]) all but the item bias b_j, and also not the constant 1
    when every key's bias is held at 0 (an infinite `bias_ridge`)."""
    free = np.arange(width)
    if bias_ridge is None:
        return free
    return free[:-2] if np.isinf(bias_ridge) else np.delete(free, -2)


def ridge_solve(
    keys: np.ndarray,
    vectors: np.ndarray,
    labels: np.ndarray,
    lam: float,
    *,
    scale_by_rows: bool = False,
    gravity: np.ndarray | None = None,
    bias_ridge: float | None = None,
    prior: float = 0.0,
    confidence: bool = False,
) -> tuple[np.ndarray, np.ndarray]:
    """(sorted unique keys, solutions (keys x d)) of the per-key ridge problems.

    With `scale_by_rows` the regulariser of a key is lambda times its number of rows (the
    weighted-lambda ALS of Zhou et al. 2008), which suits keys with very different row counts.
    `gravity` (e.g. alpha V^T V over all items, in the layout of `vectors`) is the implicit-feedback
    penalty on the scores of unobserved items: alpha sum_j (x . v_j)^2 = x^T G x for every key's x.
    With `bias_ridge` the model has biases: the vectors are [v, item bias, 1] and each key solves
    [u, b_u] against [v, 1] on the labels less the item's bias, its bias b_u with the fixed ridge
    `bias_ridge` (a pseudo-count of zero residuals: a light key's bias shrinks, a heavy one's does
    not); the solutions are [u, 1, b_u], so that the prediction stays one dot product. An infinite
    `bias_ridge` holds every b_u at 0 (the ranking protocol: a user's bias orders nothing, and the
    gravity of the item update has no term for it). With gravity, the fixed coordinate 1 on the
    item bias gives the linear term of x^T G x: G's bias column moves to the right-hand side.
    `prior` is added to every key's ridge on its vector (not its bias): a fixed prior precision,
    which weighs most for the keys with fewest rows. With `confidence` the labels are the rows'
    confidences (the ranking protocol): each row is a positive, label 1, weighing its confidence in
    the squared error (Hu, Koren and Volinsky's weighted least squares). Every system is symmetric
    positive definite (its ridges are positive), solved by its Cholesky factor.
    """
    from trainer.normal_equations import normal_equations  # numba's import, once a process, on the first solve

    if not np.isfinite(lam) or lam <= 0:
        raise UserError(f"ridge regularisation lambda must be > 0, got {lam}")
    vectors = np.asarray(vectors, dtype=np.float64)
    labels = np.asarray(labels, dtype=np.float64)
    root = None
    if confidence:  # sqrt(c) on both sides: sum c x x^T and sum c y x
        root, labels = np.sqrt(labels), np.ones(labels.size)
    free = free_coordinates(vectors.shape[1], bias_ridge)
    if bias_ridge is not None and (np.isnan(bias_ridge) or bias_ridge <= 0):
        raise UserError(f"the bias ridge must be > 0, got {bias_ridge}")
    if not np.isfinite(prior) or prior < 0:
        raise UserError(f"the prior ridge must be >= 0, got {prior}")
    d = free.size
    keys = np.asarray(keys)
    if keys.size > 1 and not np.all(keys[1:] >= keys[:-1]):  # each key's rows together, in their given order
        order = stable_argsort(keys)
        keys, vectors, labels = keys[order], vectors[order], labels[order]
        root = None if root is None else root[order]
    starts = np.flatnonzero(np.r_[True, keys[1:] != keys[:-1]]) if keys.size else np.zeros(0, np.int64)
    unique = keys[starts]
    strength = prior + (lam * np.diff(np.r_[starts, keys.size]) if scale_by_rows else np.full(unique.size, lam))
    ridge = np.repeat(strength[:, None], d, axis=1)
    if bias_ridge is not None and np.isfinite(bias_ridge):
        ridge[:, -1] = bias_ridge
    gram, rhs = normal_equations(
        np.r_[starts, keys.size],
        vectors,
        labels,
        ridge,
        free=free,
        offset=None if bias_ridge is None else -2,
        root=root,
    )
    if gravity is not None:
        gravity = np.asarray(gravity, dtype=np.float64)
        gram = gram + gravity[np.ix_(free, free)]
        if bias_ridge is not None:
            rhs = rhs - gravity[free, -2]
    solved = cholesky_solve(gram, rhs)
    if bias_ridge is None:
        return unique, solved
    u, b_u = (solved, np.zeros(unique.size)) if np.isinf(bias_ridge) else (solved[:, :-1], solved[:, -1])
    return unique, np.hstack([u, np.ones((unique.size, 1)), b_u[:, None]])


def logistic_solve(
    keys: np.ndarray,
    vectors: np.ndarray,
    all_vectors: np.ndarray,
    lam: float,
    iterations: int = 25,
    tolerance: float = 1e-10,
) -> tuple[np.ndarray, np.ndarray]:
    """(sorted unique keys, solutions) of each key's implicit-feedback logistic problem: its rows'
    items (`vectors`) are positives of label 1 and every item of `all_vectors` a negative of label 0,
    weighted as SSP-convex weighs them (privacy.quadratic.logistic_weights, wbar 1), with ridge
    lambda/2 |u|^2. Newton's method from 0, batched over keys (the problem is strictly convex)."""
    from privacy.quadratic import logistic_derivatives, logistic_weights

    if not np.isfinite(lam) or lam <= 0:
        raise UserError(f"ridge regularisation lambda must be > 0, got {lam}")
    vectors, all_vectors = np.asarray(vectors, dtype=np.float64), np.asarray(all_vectors, dtype=np.float64)
    unique, group = np.unique(keys, return_inverse=True)
    d, m = vectors.shape[1], all_vectors.shape[0]
    w_p, w_n = logistic_weights(np.bincount(group, minlength=unique.size), m, 1.0)
    outer_all = (all_vectors[:, :, None] * all_vectors[:, None, :]).reshape(m, d * d)
    u = np.zeros((unique.size, d))
    for _ in range(iterations):
        slope_p, curve_p = logistic_derivatives(np.einsum("nd,nd->n", u[group], vectors), 1.0)
        slope_n, curve_n = logistic_derivatives(u @ all_vectors.T, 0.0)  # keys x items
        gradient = lam * u + (w_n[:, None] * slope_n) @ all_vectors
        np.add.at(gradient, group, (w_p[group] * slope_p)[:, None] * vectors)
        hessian = lam * np.eye(d) + ((w_n[:, None] * curve_n) @ outer_all).reshape(-1, d, d)
        np.add.at(hessian, group, (w_p[group] * curve_p)[:, None, None] * vectors[:, :, None] * vectors[:, None, :])
        step = batched_solve(hessian, gradient)
        u -= step
        if np.abs(step).max(initial=0.0) < tolerance:
            break
    return unique, u
