"""The statistics of a model with biases (StatsSettings.bias), through the real Spark job, the real
Beam pipeline and the installed `ssp stats --bias`: exact values by hand, and the change one user
makes within the bound the noise is scaled to.

With biases each user vector is [u, 1, b_u]; a row adds [Clip(u), c] (c = clip_u) with label
Clip(y - b_u), so |x| <= sqrt(clip_u^2 + c^2) = sqrt(2) clip_u is the clip of the noise scale.
"""

from __future__ import annotations

import os
import subprocess
import sys

import numpy as np
import pytest

from pipelines.releases import stats_job
from pipelines.releases.release import PrivacySettings
from pipelines.releases.stats_core import StatsSettings
from privacy.accumulator import unpack_upper
from schemas import storage
from schemas.tables import stats_metadata, validate_stats
from tests.pipelines.stats_inputs import (
    engine_named,
    expected_stats,
    noise_free_release,
    register_counts,
    registered,
    write_inputs,
)

SSP = os.path.join(os.path.dirname(sys.executable), "ssp")
CLIP_U, CLIP_Y, WBAR = 1.0, 2.0, 1.5
SETTINGS = StatsSettings(
    3, CLIP_U, CLIP_Y, "user", WBAR, bias=1.0
)  # d = 3 released: 2 embedding coordinates and the bias, c = clip_u
CATALOG = [10, 20, 30, 40]
COUNTS = {10: 16.0, 20: 1.0, 30: 81.0, 40: 2.0}
# user 4 saturates: |u| = 5 > clip_u, and y - b_u = +-10 beyond clip_y on every row
INTERACTIONS = [
    (1, 10, 1.5),
    (1, 20, -0.5),
    (2, 10, 0.25),
    (2, 30, 3.0),
    (3, 30, -1.0),
    (4, 10, 10.5),
    (4, 20, -9.5),
    (4, 30, 10.5),
]
EMBEDDINGS = {1: [0.3, 0.4, 1.0, 0.5], 2: [0.5, -0.5, 1.0, -0.25], 3: [0.0, 0.2, 1.0, 0.0], 4: [3.0, 4.0, 1.0, 0.5]}


def released(engine: str, folder, interactions, spark=None):
    """(A_j full matrices, b_j) of the noise-free release on `engine`, in catalog order."""
    return read(noise_free_release(engine, folder, interactions, EMBEDDINGS, COUNTS, CATALOG, SETTINGS, spark))


def read(path):
    table = validate_stats(storage.read_table(path)).sort_by("item_id")
    meta = stats_metadata(table.schema)
    assert table["item_id"].to_pylist() == CATALOG and meta["d"] == 3 and meta["bias"] == 1.0
    return unpack_upper(np.array(table["a_upper"].to_pylist()), 3), np.array(table["b"].to_pylist())


@pytest.mark.parametrize("engine", ["local", "spark", "beam"])
def test_biased_statistics_are_exact(engine, spark, tmp_path):
    a, b = released(engine, tmp_path, INTERACTIONS, spark)
    want_a, want_b = expected_stats(INTERACTIONS, EMBEDDINGS, COUNTS, CATALOG, CLIP_U, CLIP_Y, WBAR, bias=True)
    for row, j in enumerate(CATALOG):
        np.testing.assert_allclose(a[row], want_a[j], rtol=1e-12, atol=1e-15)
        np.testing.assert_allclose(b[row], want_b[j], rtol=1e-12, atol=1e-15)
    # by hand, item 20: user 1 (weight 1.5 / sqrt(1/2 + 1) on it, u = (0.3, 0.4) within the clip, y - b_u = -1)
    # and user 4 (u clipped to (0.6, 0.8), y - b_u = -10 clipped to -2)
    w1 = WBAR * 1.0 / np.sqrt(16**-0.5 + 1.0)
    w4 = WBAR * 1.0 / np.sqrt(16**-0.5 + 1.0 + 81**-0.5)
    x1, x4 = np.array([0.3, 0.4, CLIP_U]), np.array([0.6, 0.8, CLIP_U])
    np.testing.assert_allclose(b[1], w1 * -1.0 * x1 + w4 * -2.0 * x4, rtol=1e-12)
    np.testing.assert_allclose(
        a[1][2, 2], (w1 + w4) * CLIP_U**2, rtol=1e-12
    )  # the bias corner: the item's weighted count times c^2
    assert np.all(a[3] == 0) and np.all(b[3] == 0)  # item 40: no rows, still released


def installed_release(engine, folder, interactions):
    """(A_j full matrices, b_j) of `ssp stats --bias` as an operator runs it (a subprocess), noise-free."""
    paths = write_inputs(
        folder,
        interactions,
        {u: v for u, v in EMBEDDINGS.items() if any(row[0] == u for row in interactions)},
        COUNTS,
        CATALOG,
    )
    out = folder / "out"
    register_counts(paths["counts"], str(out / "ledger.parquet"), PrivacySettings(noise_multiplier=0.0))
    result = subprocess.run(
        [
            SSP,
            "stats",
            "--engine",
            engine,
            "--interactions",
            paths["interactions"],
            "--user-embeddings",
            paths["user_embeddings"],
            "--items",
            paths["items"],
            "--counts",
            paths["counts"],
            "--out",
            str(out),
            "--dim",
            "3",
            "--bias",
            "1",
            "--clip-u",
            str(CLIP_U),
            "--clip-y",
            str(CLIP_Y),
            "--wbar",
            str(WBAR),
            "--noise-multiplier",
            "0",
            "-q",
        ],
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    return read(str(out / "resample-0.parquet"))


@pytest.mark.parametrize(
    "way, engine",
    [
        *(("in-process", engine) for engine in ("local", "spark", "beam")),
        # the command's flags to the job: through Beam by default; the other engines' installed twins run
        # with -m slow (each engine's job: in-process above)
        pytest.param("installed", "local", marks=pytest.mark.slow),
        pytest.param("installed", "spark", marks=pytest.mark.slow),  # a JVM of its own
        ("installed", "beam"),
    ],
)
def test_removing_a_user_moves_the_biased_statistics_by_at_most_the_bound(way, engine, request, tmp_path):
    """In this process (the stats job on the engine), or through `ssp stats --bias` as an operator runs it
    (a subprocess; the saturating user only), on the data with and without a user."""

    def release(folder, interactions):
        if way == "installed":
            return installed_release(engine, folder, interactions)
        return released(engine, folder, interactions, request.getfixturevalue("spark") if engine == "spark" else None)

    a, b = release(tmp_path / "all", INTERACTIONS)
    want_a, _ = expected_stats(INTERACTIONS, EMBEDDINGS, COUNTS, CATALOG, CLIP_U, CLIP_Y, WBAR, bias=True)
    np.testing.assert_allclose(a[0], want_a[10], rtol=1e-12)
    clip_x = np.hypot(CLIP_U, CLIP_U)  # |[Clip(u), c]|
    assert SETTINGS.noise_clips() == (pytest.approx(clip_x), CLIP_Y)
    for user in (4,) if way == "installed" else (1, 4):
        a2, b2 = release(tmp_path / f"without-{user}", [row for row in INTERACTIONS if row[0] != user])
        moved_a, moved_b = np.sqrt(np.sum((a - a2) ** 2)), np.sqrt(np.sum((b - b2) ** 2))
        assert 0 < moved_a <= WBAR * clip_x**2 * (1 + 1e-9) and 0 < moved_b <= WBAR * CLIP_Y * clip_x * (1 + 1e-9)
        if user == 4:  # saturating: every row at the clip, so the bound is met (the weights' sum of squares is wbar^2)
            assert moved_b == pytest.approx(WBAR * CLIP_Y * clip_x, rel=1e-9)


def test_bias_needs_the_square_loss():
    with pytest.raises(ValueError, match="biases need the square loss"):
        StatsSettings(3, CLIP_U, CLIP_Y, weight_exponent=0.0, loss="logistic", bias=1.0)
    with pytest.raises(ValueError, match="bias coordinate must be a finite number >= 0"):
        StatsSettings(3, CLIP_U, CLIP_Y, bias=-1.0)
    assert StatsSettings(3, 0.3, CLIP_Y, bias=0.25).bias_scale == pytest.approx(0.075)


@pytest.mark.parametrize("engine", ["local", "spark", "beam"])
def test_the_per_item_means_statistics_move_by_at_most_their_own_bound(engine, spark, tmp_path):
    """The per-item mean's release (d = 1: users [1, 0], rows [c] with c = k clip_u): its noise is scaled
    to c alone, and removing a user moves it by at most wbar c^2 (A) and wbar clip_y c (b), met by a
    user whose every label is beyond the clip."""
    settings = StatsSettings(1, CLIP_U, CLIP_Y, "user", WBAR, bias=0.25)
    c = 0.25 * CLIP_U
    assert settings.noise_clips() == (pytest.approx(c), CLIP_Y)

    def release(name, interactions):
        users = {row[0] for row in interactions}
        paths = write_inputs(tmp_path / name, interactions, {u: [1.0, 0.0] for u in users}, COUNTS, CATALOG)
        job = registered(
            stats_job.StatsJob(
                paths["interactions"],
                paths["user_embeddings"],
                paths["items"],
                paths["counts"],
                str(tmp_path / name / "out"),
                settings,
                PrivacySettings(noise_multiplier=0.0),
            )
        )
        engine_named(engine, spark).release_stats(job)
        table = validate_stats(storage.read_table(str(tmp_path / name / "out" / "resample-0.parquet"))).sort_by(
            "item_id"
        )
        return np.array(table["a_upper"].to_pylist()), np.array(table["b"].to_pylist())

    a, b = release("all", INTERACTIONS)
    a2, b2 = release("without", [row for row in INTERACTIONS if row[0] != 4])
    assert np.sqrt(np.sum((a - a2) ** 2)) <= WBAR * c**2 * (1 + 1e-9)
    assert np.sqrt(np.sum((b - b2) ** 2)) == pytest.approx(
        WBAR * CLIP_Y * c, rel=1e-9
    )  # user 4: |y| > clip_y on every row


def test_the_item_bias_penalty_is_noise_over_the_prior_in_the_release_units():
    """By hand for one release: S = wbar rho^2 with rho = sqrt(1 + k^2) clip_u, N = 2 sqrt(d) z S;
    an item's penalty is 4 wbar c^2 (the ratings' own noise) + N / (2 sqrt(d)) (A's bias entry) +
    std_b^2 / (tau^2 W) (b's: std_b = z wbar clip_y rho, tau a quarter of the rating range), W the
    item's released weight less twice its noise s_W = z S / c^2 (over sqrt(R) for R resamples),
    floored at s_W / 1000; non-private, 4 c^2 wbar with c = wbar = 1, whatever the weights. The SSP
    update puts it on the bias coordinate alone."""
    import math

    import pyarrow as pa

    from pipelines.training import item_update
    from pipelines.training.settings import TrainConfig
    from schemas.tables import items_schema
    from trainer.features import FeatureSpace

    config = TrainConfig.create(epsilon=5.0, dim=8, clip_u=0.3, clip_y=1.0, wbar=1.0, bias_coordinate=0.25)
    rho, c, z = math.hypot(0.3, 0.075), 0.075, 2.0
    s_w = z * rho**2 / c**2
    weights = np.array([0.0, 2 * s_w + 1 / c**2, 10 * s_w])  # no statistics; a lower bound of 1 / c^2; of 8 s_W
    base = 4 * c**2 + 2 * 3 * z * rho**2 / (2 * 3)
    expected = base + np.array([(z * rho) ** 2 / (s_w / 1000), (z * rho * c) ** 2, (z * rho) ** 2 / (8 * s_w)])
    assert item_update.bias_penalty(config, z, (1.0, 5.0), weights) == pytest.approx(expected)
    assert item_update.bias_penalty(
        config, z, (1.0, 5.0), np.array([2 * s_w / 2 + 1 / c**2]), resamples=4
    ) == pytest.approx([expected[1]])  # s_W / 2
    assert item_update.bias_penalty(TrainConfig.create(non_private=True), 0.0, (1.0, 5.0), weights) == pytest.approx(
        np.full(3, 4.0)
    )
    space = FeatureSpace.from_items(pa.table({"item_id": [1, 2, 3], "title": ["a", "b", "c"]}, schema=items_schema({})))
    ridge, residual, anchor = item_update._ssp_penalties(
        config, space, z, rating_range=(1.0, 5.0), has_residual=True, bias_weights=weights
    )
    assert ridge.shape == residual.shape == (space.size, 9) and anchor.shape == (9,)
    assert residual[:, -1] == pytest.approx(expected) and anchor[-1] == 0.0
    assert (
        np.all(residual[:, :-1] == residual[0, 0]) and residual[0, 0] > expected[1]
    )  # the embedding's penalties are the spectral ones
    ridge_id, _, _ = item_update._ssp_penalties(
        config, space, z, rating_range=(1.0, 5.0), has_residual=False, bias_weights=weights
    )
    assert config.ridge * ridge_id[:, -1] == pytest.approx(
        expected
    )  # an id encoder has no residual: the penalty is its ridge


def test_the_released_bias_weights_are_the_last_diagonal_entry_over_c_squared(tmp_path):
    """W_j = A_j[d-1, d-1] / c^2, the mean over the resampled tables, 0 for an item without a row."""
    import pyarrow as pa

    from pipelines.releases.stats_core import stats_table
    from pipelines.training import item_update
    from privacy.accumulator import pack_upper
    from schemas import storage
    from schemas.tables import items_schema
    from trainer.features import FeatureSpace

    space = FeatureSpace.from_items(pa.table({"item_id": [1, 2, 3], "title": ["a", "b", "c"]}, schema=items_schema({})))
    d, c = 2, 0.5
    paths = []
    for k, diagonal in enumerate(([4.0, 8.0], [6.0, 2.0])):  # items 3 and 1, in that order
        a = np.array([[[1.0, 0.3], [0.3, diagonal[0]]], [[2.0, 0.1], [0.1, diagonal[1]]]])
        paths.append(str(tmp_path / f"r{k}.parquet"))
        meta = {"d": d, "noise_multiplier": 0.0, "clip_u": 1.0, "clip_y": 1.0, "wbar": 1.0, "release": k, "resample": k}
        storage.write_table(stats_table(np.array([3, 1]), pack_upper(a), np.zeros((2, d)), meta), paths[-1])
    weights = item_update.released_bias_weights(paths, space, d, c)
    assert weights.tolist() == pytest.approx([(8.0 + 2.0) / 2 / c**2, 0.0, (4.0 + 6.0) / 2 / c**2])
