"""The DP per-item mean (trainer.item_mean): hand-computed posterior means from a released table."""

from __future__ import annotations

import numpy as np
import pytest

from pipelines.releases.stats_core import StatsSettings, release_metadata, stats_table
from privacy.accumulator import NoiseSpec
from schemas import storage
from trainer.features import FeatureSpace
from trainer.item_mean import item_means, noise_std_b

C = 0.5  # the bias coordinate: clip_u


BIASES_ONLY = StatsSettings(1, C, 1.0, "user", 1.5, bias=1.0)


def table(path, weights, sums, noise_multiplier=2.0, settings=BIASES_ONLY):
    """A released stats table of a biases-only model: A_j = c^2 W_j, b_j = c S_j."""
    items = np.arange(1, len(weights) + 1)
    a = (C**2 * np.asarray(weights, float))[:, None]
    b = (C * np.asarray(sums, float))[:, None]
    spec = NoiseSpec(noise_multiplier, settings.wbar, *settings.noise_clips(), b"k" * 32, 3)
    storage.write_table(stats_table(items, a, b, release_metadata(settings, spec, 0)), str(path))
    return str(path), FeatureSpace(np.arange(1, len(weights) + 2), [])  # one catalog item more: it has no row


def test_posterior_means_by_hand(tmp_path):
    path, space = table(tmp_path / "stats.parquet", [100.0, 2.0, 0.0, -3.0], [50.0, 2.0, 1.0, 4.0])
    std = noise_std_b(path)
    assert std == pytest.approx(2.0 * 1.5 * 1.0 * C)  # z wbar clip_y c: the rows are [c] alone
    means = item_means(path, space, C, std, (1.0, 5.0))[:, 0] * C  # the item biases, in rating units
    sigma, tau, v = 2.0, 1.0, (std / C) ** 2
    for j, (w, s) in enumerate([(100.0, 50.0), (2.0, 2.0)]):
        assert means[j] == pytest.approx(s / (w + sigma**2 / tau**2 + v / (tau**2 * w)), rel=1e-12)
    assert (
        means[2] == 0.0 and means[3] == 0.0 and means[4] == 0.0
    )  # no weight (or a negative noised one), and no row: the DP mean
    assert (
        0.45 < means[0] < 0.5 and means[1] < 0.3
    )  # heavy: near its mean 0.5; light: its mean 1 shrunk most of the way to the DP mean


def test_without_noise_it_is_the_mean_with_four_pseudo_ratings(tmp_path):
    path, space = table(tmp_path / "stats.parquet", [6.0], [3.0], noise_multiplier=0.0)
    assert noise_std_b(path) == 0.0
    assert item_means(path, space, C, 0.0, (1.0, 5.0))[0, 0] * C == pytest.approx(3.0 / (6.0 + 4.0))


def test_refuses_tables_of_other_models(tmp_path):
    path, space = table(tmp_path / "stats.parquet", [1.0], [1.0], settings=StatsSettings(1, C, 1.0, "user", 1.5))
    with pytest.raises(ValueError, match="without the bias coordinate"):
        item_means(path, space, C, 0.0, (1.0, 5.0))
    path, space = table(tmp_path / "stats2.parquet", [1.0], [1.0])
    with pytest.raises(ValueError, match="rating scale"):
        item_means(path, space, C, 0.0, (5.0, 1.0))
