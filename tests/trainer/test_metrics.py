"""Recall@k and RMSE on hand-computed examples."""

import math

import numpy as np
import pytest

from trainer.metrics import recall_at_k, recall_at_k_per_user, rmse, top_k_mask


def _mask(n_users, n_items, rows):
    mask = np.zeros((n_users, n_items), dtype=bool)
    for user, items in rows.items():
        mask[user, list(items)] = True
    return mask


def _example():
    """3 users x 25 items, worked out by hand below."""
    n_items = 25
    scores = np.zeros((3, n_items))
    # User 0: item j scores 25 - j. History {0, 1, 2} is skipped, so the top 20 are items 3..22:
    # targets {3, 22, 23} -> hits 3 and 22 -> 2 / min(20, 3) = 2/3. Without the exclusion the top 20
    # would be items 0..19 and only item 3 would hit (1/3).
    scores[0] = 25 - np.arange(n_items)
    # User 1: no history, 22 targets (items 3..24). Items 0 and 1 score 100 and 99, the others j, so
    # the top 20 are items 0, 1, 24, 23, ..., 7: 18 hits -> 18 / min(20, 22) = 0.9.
    scores[1] = np.arange(n_items)
    scores[1, 0], scores[1, 1] = 100.0, 99.0
    # User 2: no targets, so not evaluated.
    scores[2] = np.linspace(1.0, 0.0, n_items)
    history = _mask(3, n_items, {0: {0, 1, 2}, 2: {5}})
    targets = _mask(3, n_items, {0: {3, 22, 23}, 1: set(range(3, 25))})
    return scores, history, targets


def test_recall_at_20_hand_example():
    scores, history, targets = _example()
    per_user = recall_at_k_per_user(scores, history, targets, k=20)
    assert per_user[0] == pytest.approx(2 / 3)
    assert per_user[1] == pytest.approx(0.9)
    assert math.isnan(per_user[2])
    assert recall_at_k(scores, history, targets) == pytest.approx((2 / 3 + 0.9) / 2)  # 0.78333...


def test_history_exclusion_changes_the_result():
    scores, history, targets = _example()
    history[0] = False  # user 0 now ranks items 0..19: only item 3 hits
    assert recall_at_k_per_user(scores, history, targets, k=20)[0] == pytest.approx(1 / 3)


def test_small_k():
    scores, history, targets = _example()
    # k=1: user 0's best non-history item is 3 (a target) -> 1/1; user 1's is item 0 -> 0/1.
    assert recall_at_k_per_user(scores, history, targets, k=1)[:2] == pytest.approx([1.0, 0.0])
    assert recall_at_k(scores, history, targets, k=1) == pytest.approx(0.5)
    # k=3: user 0 gets items 3, 4, 5 -> 1 hit / min(3, 3); user 1 gets 0, 1, 24 -> 1 hit / 3.
    assert recall_at_k_per_user(scores, history, targets, k=3)[:2] == pytest.approx([1 / 3, 1 / 3])


def test_ties_go_to_the_lower_item_index():
    scores = np.zeros((1, 5))
    targets = _mask(1, 5, {0: {1, 2}})
    # All scores equal: the top 2 are items 0 and 1 -> 1 hit / 2.
    assert recall_at_k(scores, np.zeros((1, 5), bool), targets, k=2) == pytest.approx(0.5)
    # With item 0 in the history, the top 2 are items 1 and 2 -> 2 hits / 2.
    assert recall_at_k(scores, _mask(1, 5, {0: {0}}), targets, k=2) == pytest.approx(1.0)
    # Ties at the k-th place only: item 4 is clearly first, then items 0..3 tie for the last place.
    scores = np.array([[1.0, 1.0, 1.0, 1.0, 2.0]])
    assert top_k_mask(scores, np.zeros((1, 5), bool), 2).tolist() == [[True, False, False, False, True]]


def test_fewer_candidates_than_k_and_k_above_item_count():
    scores = np.array([[4.0, 3.0, 2.0, 1.0]])
    history = _mask(1, 4, {0: {0, 1, 2}})
    targets = _mask(1, 4, {0: {3}})
    # Only item 3 is a candidate; it is in the top 3 -> 1 / min(3, 1).
    assert recall_at_k(scores, history, targets, k=3) == pytest.approx(1.0)
    # k larger than the catalog: every non-history item is recommended.
    targets = _mask(1, 4, {0: {3}})
    assert recall_at_k(scores, np.zeros((1, 4), bool), targets, k=50) == pytest.approx(1.0)


def test_zero_one_masks_are_accepted():
    scores, history, targets = _example()
    assert recall_at_k(scores, history.astype(int), targets.astype(np.int8)) == pytest.approx((2 / 3 + 0.9) / 2)


def test_recall_shape_and_value_errors():
    scores, history, targets = _example()
    with pytest.raises(ValueError, match="2-D"):
        recall_at_k(scores[0], history[0], targets[0])
    with pytest.raises(ValueError, match="history must have the shape"):
        recall_at_k(scores, history[:2], targets)
    with pytest.raises(ValueError, match="targets must have the shape"):
        recall_at_k(scores, history, targets[:, :24])
    with pytest.raises(ValueError, match="boolean"):
        recall_at_k(scores, history * 2, targets)
    with pytest.raises(ValueError, match="overlap"):
        recall_at_k(scores, history | targets, targets)
    with pytest.raises(ValueError, match="k must be"):
        recall_at_k(scores, history, targets, k=0)
    with pytest.raises(ValueError, match="NaN"):
        bad = scores.copy()
        bad[1, 3] = np.nan
        recall_at_k(bad, history, targets)
    with pytest.raises(ValueError, match="no user has a target"):
        recall_at_k(scores, history, np.zeros_like(targets))


def test_rmse_hand_example():
    # Errors -1, 0, -2, 4: squares 1, 0, 4, 16, mean 21/4 = 5.25.
    assert rmse([1.0, 2.0, 3.0, 4.0], [2.0, 2.0, 5.0, 0.0]) == pytest.approx(math.sqrt(5.25))
    assert rmse(np.array([3.5]), np.array([3.5])) == 0.0


def test_rmse_errors():
    with pytest.raises(ValueError, match="one length"):
        rmse([1.0, 2.0], [1.0])
    with pytest.raises(ValueError, match="one length"):
        rmse(np.ones((2, 2)), np.ones((2, 2)))
    with pytest.raises(ValueError, match="no predictions"):
        rmse([], [])
    with pytest.raises(ValueError, match="finite"):
        rmse([np.nan], [1.0])
