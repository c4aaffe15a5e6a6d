"""SSP-convex's statistics: with no noise, SSP2's gradient and curvature at the expansion point are
the exact logistic loss's (the paper's decomposition); re-expanding converges to the non-private
logistic fit; one user's contribution stays within the effective clips' sensitivity."""

import numpy as np
import pytest
import tensorflow as tf
from hypothesis import given, settings
from hypothesis import strategies as st
from scipy import optimize

from privacy import quadratic
from privacy.accumulator import grouped_sums, unpack_upper


def problem(seed=0, rows=300, items=7, d=3):
    rng = np.random.default_rng(seed)
    return (
        rng.integers(0, items, rows),
        rng.normal(size=(rows, d)),
        rng.integers(0, 2, rows).astype(float),
        rng.uniform(0.1, 1.0, rows),
        rng.normal(size=(items, d)) * 0.5,
    )


def released(items, u, y, w, v0, clip_u):
    """Exact (un-noised) H_j, g_j through the accumulator's kernel, then SSP2's A_j, b_j."""
    curvature_rows, slope_rows = quadratic.kernel_rows(u, y, w, v0[items], clip_u)
    keys, h_upper, _ = grouped_sums(items, curvature_rows)
    _, _, g = grouped_sums(items, slope_rows)
    assert np.array_equal(keys, np.arange(v0.shape[0]))
    return quadratic.expansion(h_upper, g, v0)


@pytest.mark.parametrize("clip_u", [np.inf, 1.0])
def test_ssp2s_gradient_and_curvature_at_the_expansion_point_are_the_exact_losss(clip_u):
    items, u, y, w, v0 = problem()
    a_upper, b = released(items, u, y, w, v0, clip_u)
    a = unpack_upper(a_upper, v0.shape[1])
    clipped = u * np.minimum(1.0, clip_u / np.linalg.norm(u, axis=1))[:, None]
    v = tf.Variable(v0)
    with tf.GradientTape(persistent=True) as outer:
        with tf.GradientTape() as inner:
            scores = tf.reduce_sum(
                tf.constant(clipped) * (tf.one_hot(items, v0.shape[0], dtype=tf.float64) @ v), axis=1
            )
            loss = tf.reduce_sum(w * (tf.math.softplus(scores) - y * scores))
        gradient = inner.gradient(loss, v)
    hessian = outer.jacobian(gradient, v).numpy()  # (items, d, items, d): block diagonal
    np.testing.assert_allclose(np.einsum("jab,jb->ja", a, v0) - b, gradient.numpy(), rtol=1e-10, atol=1e-12)
    for j in range(v0.shape[0]):
        np.testing.assert_allclose(a[j], hessian[j, :, j, :], rtol=1e-10, atol=1e-12)


def test_re_expanding_converges_to_the_non_private_logistic_fit():
    items, u, y, w, v0 = problem(seed=1)
    ridge, d = 0.5, v0.shape[1]
    v = np.zeros_like(v0)
    for _ in range(30):  # SSP-convex with no noise: each release's quadratic minimised exactly (a Newton step)
        a_upper, b = released(items, u, y, w, v, np.inf)
        v = np.linalg.solve(unpack_upper(a_upper, d) + ridge * np.eye(d), b[..., None])[..., 0]
    for j in range(v0.shape[0]):
        mine = items == j

        def objective(x, mine=mine):
            s = u[mine] @ x
            return np.sum(w[mine] * quadratic.logistic_loss(s, y[mine])) + ridge / 2 * x @ x

        fit = optimize.minimize(objective, np.zeros(d), method="BFGS", options={"gtol": 1e-12})
        np.testing.assert_allclose(v[j], fit.x, atol=1e-6)


@settings(max_examples=50, deadline=None)
@given(st.integers(1, 12), st.floats(0.1, 5.0), st.integers(0, 2**31))
def test_one_users_contribution_is_within_the_effective_clips_sensitivity(rated, clip_u, seed):
    rng = np.random.default_rng(seed)
    d, wbar = 4, 0.7
    u = np.repeat(
        rng.normal(size=(1, d)) * rng.uniform(0.1, 20), rated, axis=0
    )  # one user: the same embedding on every row
    raw = rng.uniform(0.1, 1.0, rated)
    w = wbar * raw / np.sqrt(np.sum(raw**2))  # sum of squared weights = wbar^2
    y = rng.integers(0, 2, rated).astype(float)
    v0 = rng.normal(size=(rated, d)) * rng.uniform(0.1, 10)
    curvature_rows, slope_rows = quadratic.kernel_rows(u, y, w, v0, clip_u)
    _, h_upper, _ = grouped_sums(np.arange(rated), curvature_rows)
    _, _, g = grouped_sums(np.arange(rated), slope_rows)
    clip_eff, label_eff = quadratic.effective_clips(clip_u)
    assert np.linalg.norm(unpack_upper(h_upper, d)) <= wbar * clip_eff**2 * (1 + 1e-9)
    assert np.linalg.norm(g) <= wbar * label_eff * clip_eff * (1 + 1e-9)
    assert np.all(np.linalg.norm(curvature_rows[:, :-1], axis=1) <= np.sqrt(w) * clip_eff * (1 + 1e-12))
    assert np.all(np.abs(slope_rows[:, -1]) <= np.sqrt(w) * label_eff)


def test_labels_other_than_zero_and_one_are_refused():
    with pytest.raises(ValueError, match="0 or 1"):
        quadratic.kernel_rows(np.ones((2, 2)), np.array([1.0, 3.5]), np.ones(2), np.ones((2, 2)), 1.0)


def test_alternating_minimisation_with_ssp_convex_reaches_the_logistic_matrix_factorisation_fit():
    """Noise off, every user solved exactly (trainer.solve.logistic_solve) and every item moved to the
    minimum of its released quadratic (a Newton step): the fixed point is a stationary point of the
    joint implicit-feedback logistic MF objective, as good as a direct L-BFGS fit of it."""
    from trainer.solve import logistic_solve

    rng = np.random.default_rng(4)
    users, items, d, lam_u, lam_v = 12, 9, 2, 0.1, 0.1
    positive = rng.random((users, items)) < 0.35
    positive[np.arange(users), rng.integers(0, items, users)] = True
    rows_u, rows_j = np.nonzero(positive)
    w_p, w_n = quadratic.logistic_weights(positive.sum(1), items, 1.0)

    def objective(u, v):
        s = u @ v.T
        return (
            np.sum(w_p[:, None] * positive * quadratic.logistic_loss(s, 1.0))
            + np.sum(w_n[:, None] * quadratic.logistic_loss(s, 0.0))
            + lam_u / 2 * np.sum(u**2)
            + lam_v / 2 * np.sum(v**2)
        )

    v = rng.normal(size=(items, d)) * 0.5
    for _ in range(300):
        _, u = logistic_solve(rows_u, v[rows_j], v, lam_u)
        curvature_rows, slope_rows = quadratic.kernel_rows(
            u[rows_u], np.ones(rows_u.size), w_p[rows_u], v[rows_j], np.inf
        )
        _, h, _ = grouped_sums(rows_j, curvature_rows)
        _, _, g = grouped_sums(rows_j, slope_rows)
        h_all, g_all = quadratic.all_items_sums(u, w_n, v, np.inf)
        a_upper, b = quadratic.expansion(h + h_all, g + g_all, v)
        v = np.linalg.solve(unpack_upper(a_upper, d) + lam_v * np.eye(d), b[..., None])[..., 0]
    flat = np.concatenate([u.ravel(), v.ravel()])

    def joint(x):
        return objective(x[: users * d].reshape(users, d), x[users * d :].reshape(items, d))

    gradient = optimize.approx_fprime(flat, joint, 1e-7)
    assert np.abs(gradient).max() < 1e-5  # a stationary point of the joint objective
    direct = optimize.minimize(
        joint, rng.normal(size=flat.size) * 0.5, method="L-BFGS-B", options={"gtol": 1e-10, "maxiter": 5000}
    )
    assert joint(flat) <= direct.fun + 1e-6
