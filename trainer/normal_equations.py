"""The user update's kernels, compiled: each key's ridge normal equations from its rows in one
pass, and their solves by Cholesky factors.

For the rows i of a key g (consecutive rows), with z_i = r_i [v_i[free], y_i - v_i[offset]] (the
solved coordinates of the item vector, the label less an offset coordinate such as the item bias,
both scaled by a row weight r_i), `gram[g] = sum x_i x_i^T + diag(ridge[g])` and `rhs[g] = sum s_i x_i`
for z_i = [x_i, s_i] (trainer.solve.ridge_solve then solves them, batched). numba compiles the loop
over keys: a key's rows are gathered into a small buffer and multiplied by one small GEMM (about a
microsecond, numba's BLAS binding), written straight into the key's system. numpy's path (column
copies of every row, the statistics' grouped sums padded to bucket widths, unpacking the triangle,
adding the ridge: each a pass over all the rows or all the keys' matrices) took 2.5x as long.
trainer.solve imports this module on the first solve (numba's import and, on a cold cache, the
compile take about a second once per process; the compiled code is cached beside this file, except
where the module is read from a zip, as from spark-submit's --py-files).

Privacy: the users' own solves on the trusted side; nothing is released.
"""

from __future__ import annotations

import numpy as np

from schemas.compiled import kernel


def _normal_equations(
    starts: np.ndarray,
    vectors: np.ndarray,
    labels: np.ndarray,
    root: np.ndarray,
    free: np.ndarray,
    offset: int,
    ridge: np.ndarray,
    gram: np.ndarray,
    rhs: np.ndarray,
) -> None:
    """gram (keys, d, d) and rhs (keys, d) <- each key's sums over its rows starts[g]:starts[g + 1]
    (module docstring; `offset` -1: none), ridge[g] (keys, d) added to the diagonal."""
    d = free.size
    widest = 0
    for g in range(starts.size - 1):
        widest = max(widest, starts[g + 1] - starts[g])
    buffer = np.empty((widest, d + 1))
    for g in range(starts.size - 1):
        n = starts[g + 1] - starts[g]
        block = buffer[:n]
        for k in range(n):
            i = starts[g] + k
            for p in range(d):
                block[k, p] = root[i] * vectors[i, free[p]]
            block[k, d] = root[i] * (labels[i] - vectors[i, offset]) if offset >= 0 else root[i] * labels[i]
        full = block.T @ block
        for p in range(d):
            for q in range(d):
                gram[g, p, q] = full[p, q]
            gram[g, p, p] += ridge[g, p]
            rhs[g, p] = full[p, d]


def _cholesky_solve(a: np.ndarray, b: np.ndarray, x: np.ndarray, solved: np.ndarray) -> None:
    """x[k] <- a[k]^-1 b[k] by the Cholesky factor of a[k] (its lower triangle read), and solved[k]
    whether a[k] has one (every pivot positive; x[k] is left as it was where not)."""
    keys, d = b.shape
    factor = np.empty((d, d))
    y = np.empty(d)
    for k in range(keys):
        solved[k] = True
        for j in range(d):
            pivot = a[k, j, j]
            for m in range(j):
                pivot -= factor[j, m] * factor[j, m]
            if not pivot > 0.0:
                solved[k] = False
                break
            factor[j, j] = np.sqrt(pivot)
            for i in range(j + 1, d):
                t = a[k, i, j]
                for m in range(j):
                    t -= factor[i, m] * factor[j, m]
                factor[i, j] = t / factor[j, j]
        if not solved[k]:
            continue
        for i in range(d):
            t = b[k, i]
            for m in range(i):
                t -= factor[i, m] * y[m]
            y[i] = t / factor[i, i]
        for i in range(d - 1, -1, -1):
            t = y[i]
            for m in range(i + 1, d):
                t -= factor[m, i] * x[k, m]
            x[k, i] = t / factor[i, i]


normal_equations_kernel = kernel(_normal_equations)
cholesky_solve_kernel = kernel(_cholesky_solve)


def normal_equations(
    starts: np.ndarray,
    vectors: np.ndarray,
    labels: np.ndarray,
    ridge: np.ndarray,
    *,
    free: np.ndarray | None = None,
    offset: int | None = None,
    root: np.ndarray | None = None,
) -> tuple[np.ndarray, np.ndarray]:
    """(gram (keys, d, d), rhs (keys, d)) of the keys whose rows start at `starts` (increasing, the
    last entry the number of rows), solving for the coordinates `free` of `vectors` (default: all)
    against `labels` less the coordinate `offset` (default: none), each row weighted by `root`
    (default: 1), with `ridge` (keys, d) on each gram's diagonal."""
    vectors = np.ascontiguousarray(vectors, dtype=np.float64)
    n = vectors.shape[0]
    free = np.arange(vectors.shape[1]) if free is None else np.asarray(free, dtype=np.int64)
    root = np.ones(n) if root is None else np.ascontiguousarray(root, dtype=np.float64)
    keys, d = starts.size - 1, free.size
    gram, rhs = np.empty((keys, d, d)), np.empty((keys, d))
    normal_equations_kernel(
        np.asarray(starts, dtype=np.int64),
        vectors,
        np.ascontiguousarray(labels, dtype=np.float64),
        root,
        free,
        -1 if offset is None else offset % vectors.shape[1],
        np.ascontiguousarray(ridge, dtype=np.float64),
        gram,
        rhs,
    )
    return gram, rhs
