"""The taste signal against a release's noise (bench.taste_signal): the Gram by hand, the noise's
shape, and a planted two-taste run where the Gram ranks above popularity and the noise is measured."""

import os
import subprocess
import sys

import numpy as np
import pyarrow as pa
import pytest

from bench import taste_signal
from schemas import storage


def test_the_gram_sums_each_users_unit_row_over_the_top_items():
    # m = 3 items, the top two are positions 0 and 2; user 1 rated 0, 1, 2 -> [1, 1] / sqrt(2); user 2 rated 2 -> [0, 1]
    users, positions = np.array([1, 1, 1, 2, 3]), np.array([0, 1, 2, 2, 1])  # user 3 has no top item: no row
    gram = taste_signal.taste_gram(users, positions, np.array([0, 2]), 3)
    np.testing.assert_allclose(gram, [[0.5, 0.5], [0.5, 1.5]])


def test_the_noise_is_symmetric_with_the_multiplier_as_its_std():
    noise = taste_signal.symmetric_noise(400, 2.5, np.random.default_rng(0))
    np.testing.assert_array_equal(noise, noise.T)
    assert np.std(noise[np.triu_indices(400)]) == pytest.approx(2.5, rel=0.01)


def _planted_run(folder: str) -> None:
    """Items 1..10 taste A, 11..20 taste B, and 21..60 more popular by their DP counts but rated by no
    one here; 400 training users of one taste each rate their taste's items 1..7 or 11..17, and 100
    test users rate 1..5 (11..15), their targets 6..10 (16..20)."""
    counts = pa.table(
        {
            "item_id": np.arange(1, 61, dtype=np.int64),
            "count": np.r_[np.linspace(300, 100, 20), np.linspace(400, 301, 40)],
        }
    )
    storage.write_table(counts, os.path.join(folder, "counts", "counts.parquet"))

    def rows(users, items_of):
        pairs = [(u, i) for u in users for i in items_of(u)]
        return pa.table(
            {"user_id": np.array([p[0] for p in pairs], np.int64), "item_id": np.array([p[1] for p in pairs], np.int64)}
        )

    taste = lambda u: 0 if u % 2 else 10  # noqa: E731
    split = os.path.join(folder, "private", "split")
    storage.write_table(
        rows(range(400), lambda u: [taste(u) + i for i in range(1, 8)]), os.path.join(split, "train.parquet")
    )
    storage.write_table(
        rows(range(1000, 1100), lambda u: [taste(u) + i for i in range(1, 6)]),
        os.path.join(split, "test_history.parquet"),
    )
    storage.write_table(
        rows(range(1000, 1100), lambda u: [taste(u) + i for i in range(6, 11)]),
        os.path.join(split, "test_targets.parquet"),
    )


def test_a_planted_taste_stands_above_the_noise_and_ranks_above_popularity(tmp_path):
    _planted_run(str(tmp_path))
    result = taste_signal.measure(str(tmp_path), epsilon=5.0, delta=1e-5, items=60, rank=2, seed=0)
    # 200 users per taste over 7 items: G's two blocks have eigenvalue 200 each, nothing else
    np.testing.assert_allclose(result["top_eigenvalues"], [200, 200, 0], atol=1e-6)
    assert result["items"] == 60 and 0 < result["noise_spectral_norm"] < 200
    assert result["taste_eigenvalues_above_noise"] == 1  # the second block's; the first stands for popularity
    recall = result["test_recall_at_20"]
    # of each test user's 5 targets only the 2 trained ones (6, 7) rank above the 40 more popular items
    assert recall["gram, no noise"] == pytest.approx(0.4)
    assert recall["DP popularity"] == 0.0  # its top 20 are the unrated items
    assert recall["gram, DP"] >= 0.4  # the trained two kept their places (the noise may lift an untrained target)
    # both blocks stand far above 2 z sqrt(K) (about 14 here): the rule keeps the same two directions
    assert recall["gram, DP, directions above 2 z sqrt(K)"] == recall["gram, DP"]
    # DP popularity's list is the 40 unrated items 21..60, then 1..20 by count less the history: taste A's
    # targets 6..10 at ranks 40..44 (in the top 50), taste B's 16..20 after 1..10, at ranks 50..54
    d = 1 / np.log2(np.arange(2, 102))
    assert result["test_recall_at_50"]["DP popularity"] == 0.5
    assert result["test_ndcg_at_100"]["DP popularity"] == pytest.approx(
        (d[40:45].sum() + d[50:55].sum()) / (2 * d[:5].sum())
    )
    assert result["test_coverage_at_20"]["DP popularity"] == pytest.approx(20 / 60)  # everyone's top 20: 21..40
    assert result["test_ndcg_at_100"]["gram, no noise"] > result["test_ndcg_at_100"]["DP popularity"]


def test_the_command_refuses_a_folder_without_a_split(tmp_path):
    done = subprocess.run(
        [sys.executable, "-m", "bench.taste_signal", "--run", str(tmp_path)], capture_output=True, text=True
    )
    assert done.returncode == 2 and "no private/split/train.parquet" in done.stderr
