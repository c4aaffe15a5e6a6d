"""DP-SGD trainer: per-unit clipping (fast and classic paths) against per-unit GradientTape, noise
scale, non-private fit, accounting against dp-accounting and TF-Privacy, row cap, config errors."""

import itertools
import math
import re

import dp_accounting
import numpy as np
import pyarrow as pa
import pytest
import tensorflow as tf
from tensorflow_privacy.privacy.analysis.compute_dp_sgd_privacy_lib import compute_dp_sgd_privacy_statement

from privacy.accounting import epsilon_of
from schemas.tables import items_schema
from trainer import dpsgd
from trainer.encoder import ItemEncoder
from trainer.features import FeatureSpace

ITEMS = pa.table(
    {
        "item_id": [10, 20, 30, 40, 50, 60],
        "title": list("abcdef"),
        "genres": [["x", "y"], ["y"], ["x", "x", "z"], [], ["z"], ["y", "z"]],
        "year": [1990, 1990, None, 2000, 2010, 2000],
    },
    schema=items_schema({"genres": "multivalent", "year": "univalent"}),
)


def catalog(m):
    return pa.table({"item_id": list(range(m)), "title": [str(i) for i in range(m)]}, schema=items_schema({}))


def encoder(kind="features", items=ITEMS, dim=3, seed=0):
    model = ItemEncoder(FeatureSpace.from_items(items), dim, kind=kind, family_dim=4, seed=seed)
    model(tf.zeros([1], tf.int64))
    return model


def weights_of(model):
    return [w.numpy().astype(np.float64) for w in model.trainable_variables]


def unit_gradient(model, positions, u, y, w):
    """Gradient of sum_rows w (u . v - y)^2 / 2 over one unit's rows, by a plain GradientTape."""
    with tf.GradientTape() as tape:
        v = tf.cast(model(tf.constant(positions)), tf.float64)
        loss = 0.5 * tf.reduce_sum(w * (tf.reduce_sum(v * u, axis=1) - y) ** 2)
    return [tf.convert_to_tensor(g).numpy() for g in tape.gradient(loss, model.trainable_variables)]


def clipped_sum(model, units, rows, vectors, clip):
    """Sum over units of their gradients clipped to `clip`, and each unit's gradient norm."""
    users, positions, labels, weights = rows
    total, norms = [np.zeros(w.shape) for w in model.trainable_variables], []
    for unit in units:
        grads = unit_gradient(model, positions[unit], vectors[users[unit]], labels[unit], weights[unit])
        norms.append(math.sqrt(sum(float(np.sum(g**2)) for g in grads)))
        total = [t + g * min(1.0, clip / norms[-1]) for t, g in zip(total, grads, strict=True)]
    return total, np.array(norms)


def random_rows(rng, users, per_user, items, d, big_user=None):
    """Rows of `users` users with 1..per_user distinct items each; one user with huge labels."""
    ids, positions = [], []
    for user in range(users):
        chosen = rng.choice(items, size=rng.integers(1, per_user + 1), replace=False)
        ids += [user] * chosen.size
        positions += chosen.tolist()
    ids, positions = np.array(ids), np.array(positions)
    labels = rng.normal(size=ids.size)
    if big_user is not None:
        labels[ids == big_user] = 500.0
    return (ids, positions, labels, rng.uniform(0.2, 1.0, ids.size)), rng.normal(size=(users, d))


@pytest.mark.parametrize(
    "kind,fast,unit",
    [("features", True, "user"), ("features", False, "user"), ("id", True, "user"), ("features", True, "example")],
)
def test_update_is_sum_of_clipped_unit_gradients_over_expected_batch(kind, fast, unit):
    """Noise 0, q = 1, one SGD step: the update is -lr * (sum of clipped per-unit gradients) / batch."""
    model = encoder(kind)
    rng = np.random.default_rng(1)
    rows, vectors = random_rows(rng, users=9, per_user=5, items=6, d=3, big_user=4)
    units = (
        [np.flatnonzero(rows[0] == user) for user in range(9)]
        if unit == "user"
        else [np.array([i]) for i in range(rows[0].size)]
    )
    clip, lr = 3.0, 0.3
    expected_sum, norms = clipped_sum(model, units, rows, vectors, clip)
    assert norms.max() > 100 * clip and norms.min() < clip  # some units are clipped, some are not
    before = weights_of(model)
    config = dpsgd.DPSGDConfig(
        epochs=1,
        batch_size=len(units),
        learning_rate=lr,
        l2_norm_clip=clip,
        unit=unit,
        optimizer="sgd",
        seed=0,
        fast_clipping=fast,
    )
    out = dpsgd.train(
        model,
        rows,
        (np.arange(9), vectors),
        config,
        noise_multiplier=0.0,
        clip_u=math.inf,
        clip_y=math.inf,
        progress=False,
    )
    assert (out["steps"], out["sampling_probability"], out["units"]) == (1, 1.0, len(units))
    for w0, w1, g, var in zip(before, weights_of(model), expected_sum, model.trainable_variables, strict=True):
        np.testing.assert_allclose((w0 - w1) / lr, g / len(units), rtol=2e-4, atol=1e-6, err_msg=var.name)


@pytest.mark.parametrize("fast", [True, False])
def test_noise_on_the_summed_gradient_has_std_z_times_clip(fast):
    """Zero-gradient data (weights 0), 40 SGD steps at q = 1/40 (about a third of them with an empty
    sample): every parameter moves by the sum of 40 N(0, (zC)^2) draws over the expected batch."""
    model = encoder("id", items=catalog(400), dim=8)
    n = 40
    rows = (np.arange(n), np.arange(n), np.ones(n), np.zeros(n))
    z, clip = 2.0, 0.5
    before = weights_of(model)
    config = dpsgd.DPSGDConfig(
        epochs=1, batch_size=1, learning_rate=1.0, l2_norm_clip=clip, optimizer="sgd", seed=3, fast_clipping=fast
    )
    out = dpsgd.train(
        model, rows, (np.arange(n), np.ones((n, 8))), config, noise_multiplier=z, clip_u=1.0, clip_y=1.0, progress=False
    )
    assert out["steps"] == 40
    moved = np.concatenate([(b - a).ravel() for a, b in zip(before, weights_of(model), strict=True)])
    standardized = moved / (z * clip * math.sqrt(40))
    assert moved.size == 401 * 8 and np.all(moved != 0)  # dense noise, on rows no data touched too
    assert abs(standardized.mean()) < 0.06 and standardized.std() == pytest.approx(1.0, abs=0.04)


def test_ridge_gradient_is_ridge_over_units_times_the_weights():
    """Zero-gradient data, one SGD step at q = 1: the update is -lr * ridge / units * theta."""
    model = encoder("features")
    before = weights_of(model)
    rows = (np.arange(4), np.arange(4), np.ones(4), np.zeros(4))
    config = dpsgd.DPSGDConfig(
        epochs=1, batch_size=4, learning_rate=0.5, l2_norm_clip=1.0, ridge=2.0, optimizer="sgd", seed=0
    )
    dpsgd.train(
        model,
        rows,
        (np.arange(4), np.ones((4, 3))),
        config,
        noise_multiplier=0.0,
        clip_u=1.0,
        clip_y=1.0,
        progress=False,
    )
    for a, b in zip(before, weights_of(model), strict=True):
        np.testing.assert_allclose(b, a * (1 - 0.5 * 2.0 / 4), rtol=1e-6)


def test_non_private_training_fits_a_planted_model():
    """Id encoder, labels exactly u . v*_j: z = 0 and no clipping recover v*."""
    rng = np.random.default_rng(0)
    m, users, d = 20, 60, 2
    planted, vectors = rng.normal(size=(m, d)), rng.normal(size=(users, d))
    ids = np.repeat(np.arange(users), 8)
    positions = np.concatenate([rng.choice(m, 8, replace=False) for _ in range(users)])
    labels = np.einsum("nd,nd->n", vectors[ids], planted[positions])
    model = encoder("id", items=catalog(m), dim=d)
    config = dpsgd.DPSGDConfig(epochs=40, batch_size=10, learning_rate=0.05, l2_norm_clip=math.inf, seed=0)
    dpsgd.train(
        model,
        (ids, positions, labels, np.ones(ids.size)),
        (np.arange(users), vectors),
        config,
        noise_multiplier=0.0,
        clip_u=math.inf,
        clip_y=math.inf,
        progress=False,
    )
    fitted = model.embed_all()
    rmse = np.sqrt(np.mean((np.einsum("nd,nd->n", vectors[ids], fitted[positions]) - labels) ** 2))
    assert rmse < 0.02 < np.std(labels)
    np.testing.assert_allclose(fitted, planted, atol=0.05)


def test_row_cap_keeps_max_rows_per_user_of_the_users_rows():
    """One user with 5 rows, cap 2, no clipping: the update is the gradient of exactly 2 of its rows."""
    model = encoder("id")
    rows = (np.zeros(5, int), np.arange(5), np.array([1.0, 2.0, 3.0, 4.0, 5.0]), np.ones(5))
    vectors = np.array([[1.0, 0.5, -0.5]])
    before = weights_of(model)
    config = dpsgd.DPSGDConfig(
        epochs=1, batch_size=1, learning_rate=1.0, l2_norm_clip=math.inf, max_rows_per_user=2, optimizer="sgd", seed=5
    )
    dpsgd.train(
        model,
        rows,
        (np.array([0]), vectors),
        config,
        noise_multiplier=0.0,
        clip_u=math.inf,
        clip_y=math.inf,
        progress=False,
    )
    moved = before[0] - weights_of(model)[0]
    matches = []
    for pair in itertools.combinations(range(5), 2):
        pair = np.array(pair)
        grads = unit_gradient(encoder("id"), rows[1][pair], vectors[0], rows[2][pair], rows[3][pair])
        matches.append(np.allclose(moved, grads[0], rtol=1e-5, atol=1e-7))
    assert sum(matches) == 1


def test_event_epsilon_matches_dp_accounting_and_tf_privacy():
    n, batch, epochs, z, delta = 100, 10, 2, 1.1, 1e-5
    config = dpsgd.DPSGDConfig(epochs=epochs, batch_size=batch, unit="example", l2_norm_clip=1.0, seed=0)
    assert dpsgd.schedule(n, config) == (0.1, 20)
    assert dpsgd.count_units(np.repeat(np.arange(25), 4), config) == n
    rows = (np.repeat(np.arange(25), 4), np.arange(n) % 6, np.ones(n), np.ones(n))
    out = dpsgd.train(
        encoder("id"),
        rows,
        (np.arange(25), np.ones((25, 3))),
        config,
        noise_multiplier=z,
        clip_u=1.0,
        clip_y=1.0,
        progress=False,
    )
    assert (out["sampling_probability"], out["steps"], out["units"], out["noise_multiplier"]) == (0.1, 20, n, z)
    epsilon = epsilon_of(
        [out["event"]], delta, accountant="rdp"
    )  # as TF-Privacy states it (PLD, the ledger's default, is tighter)
    assert epsilon_of([out["event"]], delta) < epsilon
    accountant = dp_accounting.rdp.RdpAccountant()
    accountant.compose(
        dp_accounting.SelfComposedDpEvent(
            dp_accounting.PoissonSampledDpEvent(0.1, dp_accounting.GaussianDpEvent(z)), 20
        )
    )
    assert epsilon == pytest.approx(accountant.get_epsilon(delta), rel=1e-12)
    statement = compute_dp_sgd_privacy_statement(
        number_of_examples=n,
        batch_size=batch,
        num_epochs=epochs,
        noise_multiplier=z,
        delta=delta,
        used_microbatching=False,
    )
    tf_privacy = float(re.search(r"Epsilon assuming Poisson sampling \(\*\):\s+([0-9.]+)", statement).group(1))
    assert epsilon == pytest.approx(tf_privacy, rel=0.05)
    assert (
        epsilon_of(
            [
                dpsgd.train(
                    encoder("id"),
                    rows,
                    (np.arange(25), np.ones((25, 3))),
                    config,
                    noise_multiplier=0.0,
                    clip_u=1.0,
                    clip_y=1.0,
                    progress=False,
                )["event"]
            ],
            delta,
        )
        == math.inf
    )


@pytest.mark.parametrize(
    "field,value,message",
    [
        ("unit", "item", "unit must be one of"),
        ("batch_size", 0, "batch_size must be a positive integer"),
        ("max_rows_per_user", 2.5, "max_rows_per_user must be a positive integer"),
        ("epochs", 0, "epochs must be a finite number > 0"),
        ("learning_rate", math.nan, "learning_rate must be a finite number > 0"),
        ("ridge", -1.0, "ridge must be a finite number >= 0"),
        ("l2_norm_clip", 0.0, "l2_norm_clip must be a finite number > 0"),
        ("optimizer", "rmsprop", "optimizer must be one of"),
    ],
)
def test_bad_config_raises(field, value, message):
    with pytest.raises(ValueError, match=message):
        dpsgd.DPSGDConfig(**{field: value})


def test_bad_inputs_raise():
    model = encoder("features")
    rows = (np.array([0, 1]), np.array([0, 1]), np.ones(2), np.ones(2))
    vectors = (np.array([0, 1]), np.ones((2, 3)))
    config = dpsgd.DPSGDConfig(batch_size=1, l2_norm_clip=math.inf)
    with pytest.raises(ValueError, match="needs a finite l2_norm_clip"):
        dpsgd.train(model, rows, vectors, config, noise_multiplier=1.0, clip_u=1.0, clip_y=1.0, progress=False)
    with pytest.raises(ValueError, match="noise multiplier must be"):
        dpsgd.train(model, rows, vectors, config, noise_multiplier=-1.0, clip_u=1.0, clip_y=1.0, progress=False)
    with pytest.raises(ValueError, match="user 1 has rows but no embedding"):
        dpsgd.train(
            model,
            rows,
            (np.array([0]), np.ones((1, 3))),
            config,
            noise_multiplier=0.0,
            clip_u=1.0,
            clip_y=1.0,
            progress=False,
        )
    with pytest.raises(ValueError, match=r"item positions must be in \[0, 6\)"):
        dpsgd.train(
            model,
            (rows[0], np.array([0, 6]), rows[2], rows[3]),
            vectors,
            config,
            noise_multiplier=0.0,
            clip_u=1.0,
            clip_y=1.0,
            progress=False,
        )
    with pytest.raises(ValueError, match="need 1 <= batch size <= units"):
        dpsgd.train(
            model,
            rows,
            vectors,
            dpsgd.DPSGDConfig(batch_size=3),
            noise_multiplier=0.0,
            clip_u=1.0,
            clip_y=1.0,
            progress=False,
        )


def test_planned_units_below_the_rows_still_sample_every_unit():
    """`ssp train` plans the sampling over a DP number of users, which may fall below the true
    number: every unit of the rows is still sampled with q (here q = 1: all 9 of them, over the
    planned expected batch of 7), none is left out."""
    model = encoder("features")
    rng = np.random.default_rng(1)
    rows, vectors = random_rows(rng, users=9, per_user=5, items=6, d=3, big_user=4)
    units = [np.flatnonzero(rows[0] == user) for user in range(9)]
    clip, lr = 3.0, 0.3
    expected_sum, _ = clipped_sum(model, units, rows, vectors, clip)
    before = weights_of(model)
    config = dpsgd.DPSGDConfig(epochs=1, batch_size=7, learning_rate=lr, l2_norm_clip=clip, optimizer="sgd", seed=0)
    out = dpsgd.train(
        model,
        rows,
        (np.arange(9), vectors),
        config,
        noise_multiplier=0.0,
        clip_u=math.inf,
        clip_y=math.inf,
        progress=False,
        units=7,
    )
    assert (out["steps"], out["sampling_probability"], out["units"]) == (1, 1.0, 7)
    for w0, w1, g, var in zip(before, weights_of(model), expected_sum, model.trainable_variables, strict=True):
        np.testing.assert_allclose((w0 - w1) / lr, g / 7, rtol=2e-4, atol=1e-6, err_msg=var.name)


def test_logistic_rows_draw_unrated_negatives_that_estimate_the_every_item_term():
    from privacy.quadratic import logistic_weights

    users, positions = np.array([5, 5, 5, 9, 9]), np.array([0, 3, 7, 1, 2])
    out_users, out_positions, labels, weights = dpsgd.logistic_rows(users, positions, 10, np.random.default_rng(0))
    w_p, w_n = logistic_weights(np.array([3, 2]), 10, 1.0)
    for user, rated, pos_w, neg_w in ((5, {0, 3, 7}, w_p[0], w_n[0]), (9, {1, 2}, w_p[1], w_n[1])):
        mine = out_users == user
        negatives = out_positions[mine & (labels == 0)]
        assert set(out_positions[mine & (labels == 1)]) == rated and np.allclose(weights[mine & (labels == 1)], pos_w)
        assert len(negatives) == len(rated) and len(set(negatives)) == len(negatives) and not set(negatives) & rated
        assert weights[mine & (labels == 0)].sum() == pytest.approx(
            neg_w * 10
        )  # unbiased for the every-item term's weight
    # a user who rated every item has no negative to draw
    _, _, labels, _ = dpsgd.logistic_rows(np.array([1, 1]), np.array([0, 1]), 2, np.random.default_rng(0))
    assert labels.tolist() == [1.0, 1.0]
