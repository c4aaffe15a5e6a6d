"""trainer.evaluate's popularity column: its scale by hand, and a fold-in that falls back on the DP
counts exactly when the trained vectors carry nothing."""

import numpy as np
import pytest

from trainer import evaluate


def test_the_popularity_column_is_the_dp_counts_at_the_trained_columns_rms_norm():
    v = np.array([[1.0, 0.0], [0.0, 1.0], [1.0, 1.0]])  # Frobenius norm 2, d 2: RMS column norm sqrt(2)
    out = evaluate.with_popularity(v, np.array([1.0, 2.0, 2.0]))  # norm 3
    np.testing.assert_allclose(out, np.c_[v, np.sqrt(2) / 3 * np.array([1.0, 2.0, 2.0])])
    floored = evaluate.with_popularity(v, np.array([-5.0, 2.0, 2.0]))  # a count below 1 counts as 1
    np.testing.assert_allclose(floored[:, 2], out[:, 2])
    with pytest.raises(ValueError, match="2 DP counts for 3 item vectors"):
        evaluate.with_popularity(v, np.array([1.0, 2.0]))


def test_with_nothing_trained_the_fold_in_ranks_by_the_dp_counts():
    rng = np.random.default_rng(3)
    m, users = 40, 30
    counts = rng.permutation(np.arange(1.0, m + 1)) * 7
    h_users = np.repeat(np.arange(users), 3)
    picks = [rng.choice(m, 7, replace=False) for _ in range(users)]  # 3 history items and 4 targets, disjoint
    h_positions = np.concatenate([p[:3] for p in picks])
    t_users = np.repeat(np.arange(users), 4)
    t_positions = np.concatenate([p[3:] for p in picks])
    buckets = np.arange(m) % evaluate.BUCKETS
    history, targets = (h_users, h_positions, np.ones(h_users.size)), (t_users, t_positions)
    with_column = evaluate.recall_report(
        history,
        targets,
        evaluate.with_popularity(np.zeros((m, 4)), counts),
        1.0,
        item_buckets=buckets,
        k=5,
        gravity=0.1,
    )
    popularity = evaluate.recall_report(history, targets, counts[:, None], 1.0, item_buckets=buckets, k=5)
    assert with_column == popularity and 0 < popularity["recall_at_5"] < 1
