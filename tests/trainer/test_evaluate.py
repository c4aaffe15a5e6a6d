"""trainer.evaluate's popularity column: its scale by hand, and a fold-in that falls back on the DP
counts exactly when the trained vectors carry nothing; the ranking report is trainer.metrics' on the
folded-in scores."""

import math

import numpy as np
import pytest

from schemas.errors import UserError
from schemas.ids import IdIndex
from trainer import evaluate, metrics


def test_predicted_ratings_are_the_dot_products_plus_the_mean_within_the_range():
    """Users 7 and 9 with vectors [1, 2] and [0, -1], items [1, 1] and [2, 0], mean 3, range 1..5:
    7 on item 0 gives 3 + 3 = 6, limited to 5; 9 on item 1 gives 3 + 0 = 3; 9 on item 0 gives 2; an
    unknown user (4) the mean alone. The same whether every user is known or not."""
    users = (IdIndex(np.array([9, 7])), np.array([[0.0, -1.0], [1.0, 2.0]]))
    items = np.array([[1.0, 1.0], [2.0, 0.0]])
    known = evaluate.predict_ratings(np.array([7, 9, 9]), np.array([0, 1, 0]), users, items, 3.0, (1.0, 5.0))
    np.testing.assert_array_equal(known, [5.0, 3.0, 2.0])
    mixed = evaluate.predict_ratings(np.array([7, 4, 9]), np.array([0, 0, 0]), users, items, 3.0, (1.0, 5.0))
    np.testing.assert_array_equal(mixed, [5.0, 3.0, 2.0])
    broken = (users[0], np.array([[np.nan, 0.0], [1.0, 2.0]]))  # a NaN is kept, for squared_errors to refuse
    assert np.isnan(
        evaluate.predict_ratings(np.array([9, 7]), np.array([0, 0]), broken, items, 3.0, (1.0, 5.0))
    ).tolist() == [
        True,
        False,
    ]
    for positions, vectors in (
        (np.array([0, 2, 0]), items),
        (np.array([0, -1, 0]), items),
        (np.array([0]), items[:, :1]),
    ):
        with pytest.raises(UserError, match="one width"):  # read outside the arrays: refused, never guessed
            evaluate.predict_ratings(np.array([7, 9, 9])[: positions.size], positions, users, vectors, 3.0, (1.0, 5.0))


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
    with_column = evaluate.ranking_report(
        history,
        targets,
        evaluate.with_popularity(np.zeros((m, 4)), counts),
        1.0,
        item_buckets=buckets,
        gravity=0.1,
    )
    popularity = evaluate.ranking_report(history, targets, counts[:, None], 1.0, item_buckets=buckets)
    assert with_column == popularity and 0 < popularity["recall_at_20"] < popularity["recall_at_50"] == 1.0
    # every user's ranking is the counts' order: the union of the top 20s is the 20 most counted items
    # and those the users' histories push out of them
    assert 20 / m < popularity["coverage_at_20"] < 1 and popularity["users"] == users
    assert evaluate.popularity_ranking_report(history[:2], targets, counts, buckets) == popularity


def test_the_ranking_report_is_trainer_metrics_on_the_folded_in_scores():
    """The report's four metrics and slices are trainer.metrics.ranking_metrics of the scores u . v of
    the users the ridge folds in, over more than one block of users (1024 a block)."""
    rng = np.random.default_rng(5)
    m, users, d = 60, 1100, 3
    vectors = rng.normal(size=(m, d))
    h_users, t_users = np.repeat(np.arange(users), 4), np.repeat(np.arange(users), 3)
    picks = np.array([rng.choice(m, 7, replace=False) for _ in range(users)])
    history = (h_users, picks[:, :4].ravel(), np.ones(h_users.size))
    targets = (np.append(t_users, 5000), np.append(picks[:, 4:].ravel(), 0))  # user 5000: no history, not evaluated
    buckets = np.arange(m) % evaluate.BUCKETS
    report = evaluate.ranking_report(history, targets, vectors, 0.5, item_buckets=buckets)
    # the ridge fold-in by hand: u = (V_h^T V_h + 0.5 * 4 I)^-1 V_h^T 1 (lambda scaled by the history's 4 rows)
    solved = np.array(
        [
            np.linalg.solve(vectors[p[:4]].T @ vectors[p[:4]] + 2.0 * np.eye(d), vectors[p[:4]].sum(axis=0))
            for p in picks
        ]
    )
    hist, targ = np.zeros((users, m), bool), np.zeros((users, m), bool)
    np.put_along_axis(hist, picks[:, :4], True, axis=1)
    np.put_along_axis(targ, picks[:, 4:], True, axis=1)
    expected = metrics.ranking_metrics([(solved @ vectors.T, hist, targ)], buckets, evaluate.BUCKETS)
    assert report.keys() == expected.keys() and report["users"] == users
    for key in (*metrics.RANKING, "sliced"):
        assert report[key] == pytest.approx(expected[key])
    with pytest.raises(ValueError, match="no held-out user has both a history and targets"):
        evaluate.ranking_report(history, (np.array([5000]), np.array([0])), vectors, 0.5, item_buckets=buckets)


def _rmse(predictions, labels) -> float:
    predictions = np.asarray(predictions, dtype=np.float64)
    return evaluate.rmse_report(evaluate.squared_errors(predictions, labels, np.zeros(predictions.shape, np.int64)))[
        "rmse"
    ]


def test_rmse_hand_example():
    # Errors -1, 0, -2, 4: squares 1, 0, 4, 16, mean 21/4 = 5.25.
    assert _rmse([1.0, 2.0, 3.0, 4.0], [2.0, 2.0, 5.0, 0.0]) == pytest.approx(math.sqrt(5.25))
    assert _rmse(np.array([3.5]), np.array([3.5])) == 0.0
    # per bucket: 1 and 0 in bucket 0, 4 and 16 in bucket 2, nothing in the others
    sums = evaluate.squared_errors(
        np.array([1.0, 2.0, 3.0, 4.0]), np.array([2.0, 2.0, 5.0, 0.0]), np.array([0, 0, 2, 2])
    )
    assert evaluate.rmse_report(sums)["sliced"] == pytest.approx([math.sqrt(0.5), None, math.sqrt(10.0), None, None])


def test_rmse_errors():
    with pytest.raises(ValueError, match="one length"):
        evaluate.squared_errors(np.array([1.0, 2.0]), np.array([1.0]), np.zeros(2, np.int64))
    with pytest.raises(ValueError, match="one length"):
        evaluate.squared_errors(np.ones((2, 2)), np.ones((2, 2)), np.zeros(2, np.int64))
    with pytest.raises(ValueError, match="no predictions"):
        _rmse([], [])
    with pytest.raises(ValueError, match="finite"):
        _rmse([np.nan], [1.0])
