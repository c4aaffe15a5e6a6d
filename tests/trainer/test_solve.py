"""Closed-form ridge solves per key: plain, weighted-lambda and with an implicit-feedback gravity term."""

import numpy as np
import pytest
from threadpoolctl import threadpool_info, threadpool_limits

from trainer.normal_equations import normal_equations
from trainer.solve import batched_solve, cholesky_solve, logistic_solve, ridge_solve


def _blas_threads() -> list[int]:
    return [pool["num_threads"] for pool in threadpool_info() if pool["user_api"] == "blas"]


def test_batched_solves_run_on_one_blas_thread_and_give_the_systems_solutions(monkeypatch):
    """Each system's solution, from numpy's solve called with every BLAS pool at one thread, and the
    pools' threads as they were afterwards (two here: the suite's processes run with one)."""
    rng = np.random.default_rng(0)
    m = rng.normal(size=(40, 5, 5))
    a, b = m @ m.transpose(0, 2, 1) + np.eye(5), rng.normal(size=(40, 5))
    during, solve = [], np.linalg.solve

    def spy(*args):
        during.append(_blas_threads())
        return solve(*args)

    monkeypatch.setattr(np.linalg, "solve", spy)
    with threadpool_limits(2, user_api="blas"):
        before = _blas_threads()
        x = batched_solve(a, b)
        after = _blas_threads()
    assert before == after == [2] * len(before) and during == [[1] * len(before)]
    np.testing.assert_allclose(np.einsum("kij,kj->ki", a, x), b, atol=1e-12)
    np.testing.assert_allclose(x[7], solve(a[7], b[7]), rtol=1e-12)


def test_cholesky_solves_by_hand_and_falls_back_where_a_system_has_no_factor():
    """[[4, 2], [2, 3]] x = [2, 1]: factor [[2, 0], [1, sqrt 2]], so y = [1, 0] and x = [0.5, 0].
    An indefinite system ([[0, 1], [1, 0]]: no factor) is still solved, by numpy's LU; a singular
    one is refused as numpy refuses it; random positive definite ones agree with numpy's solve."""
    a = np.array([[[4.0, 2.0], [2.0, 3.0]], [[0.0, 1.0], [1.0, 0.0]]])
    x = cholesky_solve(a, np.array([[2.0, 1.0], [3.0, 5.0]]))
    np.testing.assert_allclose(x, [[0.5, 0.0], [5.0, 3.0]], rtol=1e-15)
    with pytest.raises(np.linalg.LinAlgError):
        cholesky_solve(np.array([[[1.0, 1.0], [1.0, 1.0]]]), np.array([[1.0, 2.0]]))
    rng = np.random.default_rng(3)
    m = rng.normal(size=(200, 17, 17))
    spd, b = m @ m.transpose(0, 2, 1) + 0.1 * np.eye(17), rng.normal(size=(200, 17))
    np.testing.assert_allclose(cholesky_solve(spd, b), np.linalg.solve(spd, b[..., None])[..., 0], rtol=1e-9)


def test_solves_match_the_normal_equations():
    rng = np.random.default_rng(0)
    keys = np.array([3, 1, 3, 3, 1])
    v, y = rng.normal(size=(5, 2)), rng.normal(size=5)
    gravity = np.array([[2.0, 0.5], [0.5, 1.0]])
    for scale, extra in ((False, None), (True, None), (True, gravity)):
        unique, u = ridge_solve(keys, v, y, 0.3, scale_by_rows=scale, gravity=extra)
        assert unique.tolist() == [1, 3]
        for row, key in enumerate(unique):
            rows = keys == key
            lam = 0.3 * rows.sum() if scale else 0.3
            system = v[rows].T @ v[rows] + lam * np.eye(2) + (extra if extra is not None else 0)
            np.testing.assert_allclose(u[row], np.linalg.solve(system, v[rows].T @ y[rows]), rtol=1e-12)
    with pytest.raises(ValueError, match="lambda must be > 0"):
        ridge_solve(keys, v, y, 0.0)


def test_the_compiled_normal_equations_are_each_keys_sums_plus_its_ridge():
    """Key 0 has one row, vector [1, 7, 2], label 3: solving for coordinates 0 and 2 with coordinate 1
    as the offset gives x = [1, 2], s = 3 - 7 = -4, so gram [[1, 2], [2, 4]] + diag(ridge) and rhs
    [-4, -8] by hand; with root 2 on that row, 4x the gram's sums and the rhs. Key 1 has 300 rows
    (more than one GEMM tile) and key 2 none, against numpy's sums."""
    rng = np.random.default_rng(1)
    vectors = np.vstack([[1.0, 7.0, 2.0], rng.normal(size=(300, 3))])
    labels = np.r_[3.0, rng.normal(size=300)]
    ridge = np.array([[0.5, 0.25], [1.0, 2.0], [3.0, 3.0]])
    starts, free = np.array([0, 1, 301, 301]), np.array([0, 2])
    gram, rhs = normal_equations(starts, vectors, labels, ridge, free=free, offset=1)
    np.testing.assert_array_equal(gram[0], [[1.5, 2.0], [2.0, 4.25]])
    np.testing.assert_array_equal(rhs[0], [-4.0, -8.0])
    x, s = vectors[1:][:, free], labels[1:] - vectors[1:, 1]
    np.testing.assert_allclose(gram[1], x.T @ x + np.diag([1.0, 2.0]), rtol=1e-12)
    np.testing.assert_allclose(rhs[1], x.T @ s, rtol=1e-12)
    np.testing.assert_array_equal(gram[2], np.diag([3.0, 3.0]))
    np.testing.assert_array_equal(rhs[2], [0.0, 0.0])
    weighted, weighted_rhs = normal_equations(
        starts, vectors, labels, ridge, free=free, offset=1, root=np.r_[2.0, np.ones(300)]
    )
    np.testing.assert_array_equal(weighted[0], [[4.5, 8.0], [8.0, 16.25]])
    np.testing.assert_array_equal(weighted_rhs[0], [-16.0, -32.0])
    plain, plain_rhs = normal_equations(starts, vectors, labels, np.ones((3, 3)))
    np.testing.assert_allclose(plain[1], vectors[1:].T @ vectors[1:] + np.eye(3), rtol=1e-12)
    np.testing.assert_allclose(plain_rhs[1], vectors[1:].T @ labels[1:], rtol=1e-12)
    unique, u = ridge_solve(np.zeros(0, np.int64), np.zeros((0, 2)), np.zeros(0), 0.1)
    assert unique.size == 0 and u.shape == (0, 2)


def test_the_logistic_solve_is_the_minimiser_of_each_users_weighted_logistic_loss():
    from scipy import optimize

    from privacy.quadratic import logistic_loss, logistic_weights

    rng = np.random.default_rng(0)
    items = rng.normal(size=(30, 4))
    keys, rated = np.array([3, 3, 3, 7, 7, 9]), np.array([0, 5, 9, 2, 9, 29])
    solved_keys, u = logistic_solve(keys, items[rated], items, 0.1)
    assert solved_keys.tolist() == [3, 7, 9]
    for row, key in enumerate(solved_keys):
        mine = items[rated[keys == key]]
        w_p, w_n = logistic_weights(np.array([len(mine)]), len(items), 1.0)

        def objective(x, mine=mine, w_p=w_p, w_n=w_n):
            return (
                w_p[0] * logistic_loss(mine @ x, 1.0).sum()
                + w_n[0] * logistic_loss(items @ x, 0.0).sum()
                + 0.05 * x @ x
            )

        np.testing.assert_allclose(
            u[row], optimize.minimize(objective, np.zeros(4), method="BFGS", options={"gtol": 1e-12}).x, atol=1e-6
        )
    with pytest.raises(ValueError, match="lambda must be > 0"):
        logistic_solve(keys, items[rated], items, 0.0)


def test_the_prior_adds_a_fixed_ridge_to_each_keys_vector_not_its_bias():
    """Key 1 has 2 rows, key 2 has 5: with biases ([v, b_j, 1] items), each solves [u, b_u] against
    [v, 1] on y - b_j with ridge lam n + prior on u and the bias ridge on b_u, by hand."""
    rng = np.random.default_rng(3)
    keys = np.array([1, 1, 2, 2, 2, 2, 2])
    vectors = np.hstack([rng.normal(size=(7, 2)), rng.normal(size=(7, 1)), np.ones((7, 1))])
    labels = rng.normal(size=7)
    lam, prior, bias_ridge = 0.5, 3.0, 2.0
    unique, solved = ridge_solve(keys, vectors, labels, lam, scale_by_rows=True, bias_ridge=bias_ridge, prior=prior)
    assert unique.tolist() == [1, 2]
    for k, key in enumerate(unique):
        rows = keys == key
        x, y = vectors[rows][:, [0, 1, 3]], labels[rows] - vectors[rows, 2]
        ridge = np.diag([lam * rows.sum() + prior] * 2 + [bias_ridge])
        u = np.linalg.solve(x.T @ x + ridge, x.T @ y)
        np.testing.assert_allclose(solved[k], [u[0], u[1], 1.0, u[2]], rtol=1e-10)
    with pytest.raises(ValueError, match="prior ridge must be >= 0"):
        ridge_solve(keys, vectors, labels, lam, prior=-1.0)


@pytest.mark.parametrize("bias_ridge", [2.0, np.inf])
def test_biases_with_gravity_minimise_the_implicit_objective(bias_ridge):
    """Items [v, b_j, 1] over a catalog V; each key x = [u, 1, b_u] minimises
    sum_rows (y - x . v_j)^2 + lam n |u|^2 + bias_ridge b_u^2 + alpha sum_catalog (x . v_j)^2, the
    gravity's fixed coordinate 1 on b_j included; an infinite bias ridge holds b_u at 0."""
    from scipy import optimize

    rng = np.random.default_rng(5)
    catalog = np.hstack([rng.normal(size=(9, 2)), rng.normal(size=(9, 1)), np.ones((9, 1))])
    keys, rated = np.array([4, 4, 4, 6, 6]), np.array([0, 3, 8, 1, 3])
    labels, lam, alpha = rng.normal(size=5), 0.4, 0.3
    unique, solved = ridge_solve(
        keys,
        catalog[rated],
        labels,
        lam,
        scale_by_rows=True,
        gravity=alpha * catalog.T @ catalog,
        bias_ridge=bias_ridge,
    )
    for k, key in enumerate(unique):
        rows = keys == key

        def objective(free, rows=rows):
            x = np.array([free[0], free[1], 1.0, free[2] if np.isfinite(bias_ridge) else 0.0])
            penalty = lam * rows.sum() * (free[0] ** 2 + free[1] ** 2) + (
                bias_ridge * free[2] ** 2 if np.isfinite(bias_ridge) else 0.0
            )
            return ((labels[rows] - catalog[rated[rows]] @ x) ** 2).sum() + penalty + alpha * ((catalog @ x) ** 2).sum()

        best = optimize.minimize(objective, np.zeros(3), method="BFGS", options={"gtol": 1e-12}).x
        want = [best[0], best[1], 1.0, best[2] if np.isfinite(bias_ridge) else 0.0]
        np.testing.assert_allclose(solved[k], want, atol=1e-6)
    with pytest.raises(ValueError, match="bias ridge must be > 0"):
        ridge_solve(keys, catalog[rated], labels, lam, bias_ridge=0.0)
