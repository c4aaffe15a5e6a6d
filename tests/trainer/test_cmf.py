"""DP-CMF item update: mu = 0 is DP-ALS, hand-computed solves, monotone objective, feature-only items."""

import numpy as np
import pyarrow as pa
import pytest

from privacy.accumulator import pack_upper
from schemas import storage
from schemas.arrays import matrix_to_list_column
from schemas.tables import STATS, items_schema
from trainer import als, cmf, ssp
from trainer.features import Family, FeatureSpace, feature_labels, feature_matrix

ITEMS = pa.table(
    {
        "item_id": [10, 20, 30, 40, 50, 60],
        "title": ["a", "b", "c", "d", "e", "f"],
        "genres": [["x", "y"], ["y"], ["x", "x", "z"], [], ["z"], ["y", "z"]],
        "year": [1990, 1990, None, 2000, 2010, 2000],
    },
    schema=items_schema({"genres": "multivalent", "year": "univalent"}),
)


def write_stats(path, item_ids, a, b, d, **meta):
    """A stats table (STATS schema) from full (k, d, d) matrices A and (k, d) vectors b."""
    metadata = {
        "d": d,
        "noise_multiplier": 0.0,
        "clip_u": 1.0,
        "clip_y": 1.0,
        "wbar": 1.0,
        "release": 0,
        "resample": 0,
        **meta,
    }
    table = pa.Table.from_arrays(
        [
            pa.array(np.asarray(item_ids), pa.int64()),
            matrix_to_list_column(pack_upper(np.asarray(a, float))),
            matrix_to_list_column(np.asarray(b, float)),
        ],
        schema=STATS.with_metadata({key.encode(): str(value).encode() for key, value in metadata.items()}),
    )
    storage.write_table(table, path)
    return path


def noisy_stats(tmp_path, space, d, rows, seed):
    """Stats for the first `rows` catalog items: sums of u u^T / y u plus symmetric noise (A_j may be indefinite)."""
    rng = np.random.default_rng(seed)
    u = rng.normal(size=(rows, 8, d))
    y = rng.normal(size=(rows, 8))
    noise = rng.normal(scale=0.7, size=(rows, d, d))
    a = np.einsum("kri,krj->kij", u, u) + (noise + np.swapaxes(noise, 1, 2)) / 2
    b = np.einsum("kr,kri->ki", y, u) + rng.normal(scale=0.3, size=(rows, d))
    return write_stats(str(tmp_path / f"stats{seed}.parquet"), space.item_ids[:rows], a, b, d)


def test_feature_matrix_is_the_encoders_bag_average():
    space = FeatureSpace.from_items(ITEMS)
    assert feature_labels(space) == [
        ("genres", "x"),
        ("genres", "y"),
        ("genres", "z"),
        ("year", "1990"),
        ("year", "2000"),
        ("year", "2010"),
    ]
    expected = np.array(
        [
            [1 / 2, 1 / 2, 0, 1, 0, 0],
            [0, 1, 0, 1, 0, 0],
            [2 / 3, 0, 1 / 3, 0, 0, 0],  # repeated value weighs more; null year: empty block
            [0, 0, 0, 0, 1, 0],  # no genres: empty block
            [0, 0, 1, 0, 0, 1],
            [0, 1 / 2, 1 / 2, 0, 1, 0],
        ]
    )
    np.testing.assert_allclose(feature_matrix(space).toarray(), expected, rtol=0, atol=1e-15)
    # the "unknown" id 0 is no feature value: dropped, also from the bag length
    odd = FeatureSpace(np.array([1]), [Family("g", ["x"], np.array([0, 1]), np.array([0, 2]))])
    np.testing.assert_array_equal(feature_matrix(odd).toarray(), [[1.0]])


def test_zero_feature_weight_is_dp_als_exactly(tmp_path):
    space = FeatureSpace.from_items(ITEMS)
    d = 3
    path = noisy_stats(tmp_path, space, d, rows=5, seed=0)  # item 60 has no stats row
    rng = np.random.default_rng(1)
    scale = rng.uniform(0.5, 2.0, space.size)
    g = rng.normal(size=(d, d))
    gravity = 0.1 * g @ g.T
    for psd in (True, False):
        expected = als.solve_items(
            path, space, d, ridge=0.3, ridge_scale=scale, psd_projection=psd, gravity=gravity, batch_size=2
        )
        start = rng.normal(size=(6, d))  # whatever P is, mu = 0 ignores it
        vectors, features = cmf.solve_items(
            path,
            space,
            d,
            ridge=0.3,
            ridge_scale=scale,
            psd_projection=psd,
            feature_weight=0.0,
            feature_vectors=start,
            gravity=gravity,
            inner_iterations=3,
            batch_size=2,
        )
        assert np.max(np.abs(vectors - expected)) <= 1e-12
        np.testing.assert_array_equal(vectors[5], 0.0)  # as in DP-ALS: no row, no vector
        np.testing.assert_array_equal(features, 0.0)


def test_hand_computed_item_solve_and_feature_solve(tmp_path):
    items = pa.table(
        {"item_id": [1, 2], "title": ["a", "b"], "genres": [["x"], ["x", "y"]]},
        schema=items_schema({"genres": "multivalent"}),
    )
    space = FeatureSpace.from_items(items)
    x = feature_matrix(space)
    np.testing.assert_array_equal(x.toarray(), [[1.0, 0.0], [0.5, 0.5]])
    # A_1 = I, b_1 = (1, 2); A_2 = [[2, 1], [1, 2]], b_2 = (0, 3); mu = 2, ridge 1, P = I (p_x = e1, p_y = e2).
    path = write_stats(
        str(tmp_path / "s.parquet"), [1, 2], [np.eye(2), [[2.0, 1.0], [1.0, 2.0]]], [[1.0, 2.0], [0.0, 3.0]], 2
    )
    vectors, features = cmf.solve_items(
        path, space, 2, ridge=1.0, feature_weight=2.0, feature_ridge=1.0, feature_vectors=np.eye(2), inner_iterations=1
    )
    # item 1: (I + I + 2 I) v = 4 v = (1, 2) + 2 (1, 0) = (3, 2)      ->  v_1 = (3/4, 1/2)
    # item 2: ([[2,1],[1,2]] + I + 2 I) v = (0, 3) + 2 (.5, .5) = (1, 4)
    #         [[5,1],[1,5]]^-1 = [[5,-1],[-1,5]] / 24                  ->  v_2 = (1/24, 19/24)
    np.testing.assert_allclose(vectors, [[3 / 4, 1 / 2], [1 / 24, 19 / 24]], rtol=0, atol=1e-14)
    np.testing.assert_allclose(features, cmf.solve_features(x, vectors, 2.0, 1.0), rtol=0, atol=1e-14)
    # feature solve for V = [[1, 0], [1, 1]], mu = 2, lambda_f = 1:
    #   mu V^T V + I = [[5, 2], [2, 3]], inverse [[3, -2], [-2, 5]] / 11
    #   mu X^T V: row x = 2 (1 (1,0) + .5 (1,1)) = (3, 1); row y = 2 (.5 (1,1)) = (1, 1)
    #   p_x = (9 - 2, -6 + 5) / 11 = (7, -1) / 11;  p_y = (3 - 2, -2 + 5) / 11 = (1, 3) / 11
    p = cmf.solve_features(x, np.array([[1.0, 0.0], [1.0, 1.0]]), 2.0, 1.0)
    np.testing.assert_allclose(p, np.array([[7.0, -1.0], [1.0, 3.0]]) / 11, rtol=0, atol=1e-14)


def test_objective_decreases_and_each_solve_is_a_block_minimum(tmp_path):
    space = FeatureSpace.from_items(ITEMS)
    d = 3
    path = noisy_stats(tmp_path, space, d, rows=5, seed=3)
    rng = np.random.default_rng(4)
    g = rng.normal(size=(d, d))
    args = {
        "ridge": 0.2,
        "ridge_scale": rng.uniform(0.5, 2.0, space.size),
        "psd_projection": True,
        "feature_weight": 1.5,
        "feature_ridge": 0.4,
        "gravity": 0.05 * g @ g.T,
    }

    def loss(v, p):
        return cmf.objective(path, space, v, p, **args)

    features = np.zeros((6, d))
    values = [loss(np.zeros((space.size, d)), features)]
    for _ in range(6):
        vectors, new_features = cmf.solve_items(
            path, space, d, inner_iterations=1, feature_vectors=features, batch_size=2, **args
        )
        values += [
            loss(vectors, features),
            loss(vectors, new_features),
        ]  # after the item solve, after the feature solve
        features = new_features
    assert np.all(np.diff(values) <= 1e-12), values
    assert values[-1] < values[2] - 1e-3  # the feature term does move things
    # the same iterates in one call
    once_v, once_p = cmf.solve_items(path, space, d, inner_iterations=6, batch_size=4, **args)
    np.testing.assert_allclose(once_v, vectors, rtol=0, atol=1e-12)
    np.testing.assert_allclose(once_p, features, rtol=0, atol=1e-12)
    # each solve is the exact minimiser of its block: the objective grows in every direction
    base = loss(vectors, features)  # P = feature solve for V
    v_next, _ = cmf.solve_items(
        path, space, d, inner_iterations=1, feature_vectors=features, **args
    )  # item solve for P
    for _ in range(5):
        assert loss(vectors, features + 1e-3 * rng.normal(size=features.shape)) > base
        assert loss(v_next + 1e-3 * rng.normal(size=v_next.shape), features) > loss(v_next, features)


def test_item_without_stats_gets_its_vector_from_features(tmp_path):
    space = FeatureSpace.from_items(ITEMS)
    d, mu, ridge = 2, 2.0, 0.5
    path = noisy_stats(tmp_path, space, d, rows=5, seed=5)  # item 60 (genres y, z; year 2000) has no row
    p = np.random.default_rng(6).normal(size=(6, d))
    vectors, _ = cmf.solve_items(path, space, d, ridge=ridge, feature_weight=mu, feature_vectors=p, inner_iterations=1)
    x_60 = np.array([0, 0.5, 0.5, 0, 1, 0])
    expected = np.linalg.solve(ridge * np.eye(d) + mu * p.T @ p, mu * p.T @ x_60)
    np.testing.assert_allclose(vectors[5], expected, rtol=1e-12, atol=1e-14)
    assert np.linalg.norm(vectors[5]) > 0.1
    # from P = 0 it takes one feature solve: the second inner iteration fills it in
    cold, _ = cmf.solve_items(path, space, d, ridge=ridge, feature_weight=mu, inner_iterations=1)
    warm, _ = cmf.solve_items(path, space, d, ridge=ridge, feature_weight=mu, inner_iterations=2)
    np.testing.assert_array_equal(cold[5], 0.0)
    assert np.linalg.norm(warm[5]) > 0
    zero, _ = cmf.solve_items(path, space, d, ridge=ridge, feature_weight=0.0, feature_vectors=p)
    np.testing.assert_array_equal(zero[5], 0.0)


@pytest.mark.parametrize(
    "bad",
    [
        {"feature_weight": -0.1},
        {"feature_weight": np.nan},
        {"ridge": 0.0},
        {"ridge": -1.0},
        {"feature_ridge": 0.0},
        {"inner_iterations": 0},
        {"inner_iterations": 1.5},
        {"feature_vectors": np.zeros((5, 2))},
        {"ridge_scale": np.ones(3)},
        {"gravity": np.eye(3)},
        {"dim": 3},
    ],
)
def test_invalid_arguments_raise(tmp_path, bad):
    space = FeatureSpace.from_items(ITEMS)
    path = noisy_stats(tmp_path, space, 2, rows=5, seed=7)
    args = {"dim": 2, "ridge": 1.0, **bad}
    with pytest.raises(ValueError):
        cmf.solve_items(path, space, **args)


def test_mean_table_averages_the_resamples_item_by_item(tmp_path):
    """DP-ALS / DP-CMF solve from the mean of a step's R resamples (all R were paid for): A_j and
    b_j averaged item by item, streamed in lockstep whatever the batch boundaries."""
    space = FeatureSpace.from_items(ITEMS)
    d, rng = 3, np.random.default_rng(5)
    a = rng.normal(size=(3, 6, d, d))
    a = a + np.swapaxes(a, 2, 3)
    b = rng.normal(size=(3, 6, d))
    paths = [
        write_stats(
            str(tmp_path / f"r{k}.parquet"),
            space.item_ids,
            a[k],
            b[k],
            d,
            noise_multiplier=2.0,
            release=4 + k,
            resample=k,
        )
        for k in range(3)
    ]
    mean = ssp.mean_table(paths, str(tmp_path / "mean.parquet"), batch_size=4)
    table = storage.read_table(mean)
    assert table["item_id"].to_pylist() == space.item_ids.tolist()
    np.testing.assert_allclose(
        np.array(table["a_upper"].to_pylist()), pack_upper(a.mean(axis=0)), rtol=1e-15, atol=1e-15
    )
    np.testing.assert_allclose(np.array(table["b"].to_pylist()), b.mean(axis=0), rtol=1e-15, atol=1e-15)
    assert (
        table.schema.metadata[b"averaged_resamples"] == b"3" and table.schema.metadata[b"averaged_releases"] == b"4,5,6"
    )
    # the solve of the mean is the solve of the averaged statistics, not of any one resample
    by_hand = write_stats(
        str(tmp_path / "by-hand.parquet"), space.item_ids, a.mean(axis=0), b.mean(axis=0), d, noise_multiplier=2.0
    )
    solved = als.solve_items(mean, space, d, 0.5, expected={"noise_multiplier": 2.0})
    np.testing.assert_allclose(solved, als.solve_items(by_hand, space, d, 0.5), rtol=1e-12, atol=1e-12)
    assert not np.allclose(solved, als.solve_items(paths[-1], space, d, 0.5))
    # resamples of different releases, or listing other items, are refused
    other = write_stats(str(tmp_path / "other.parquet"), space.item_ids, a[0], b[0], d, noise_multiplier=3.0)
    with pytest.raises(ValueError, match="different noise_multiplier"):
        ssp.mean_table([paths[0], other], str(tmp_path / "bad.parquet"))
    shuffled = write_stats(
        str(tmp_path / "shuffled.parquet"), space.item_ids[::-1], a[1], b[1], d, noise_multiplier=2.0
    )
    with pytest.raises(ValueError, match="different orders"):
        ssp.mean_table([paths[0], shuffled], str(tmp_path / "bad.parquet"))
    short = write_stats(
        str(tmp_path / "short.parquet"), space.item_ids[:4], a[1][:4], b[1][:4], d, noise_multiplier=2.0
    )
    with pytest.raises(ValueError, match="different numbers of rows"):
        ssp.mean_table([paths[0], short], str(tmp_path / "bad.parquet"))
