"""The ranking metrics (Recall@k, NDCG@k, catalog coverage) and RMSE on hand-computed examples,
their properties on random score matrices (hypothesis) and against a direct transcription of
Liang et al. 2018's code."""

import math

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from trainer import metrics
from trainer.metrics import (
    catalog_coverage,
    ndcg_at_k,
    ndcg_at_k_per_user,
    ranked_top_k,
    ranking_metrics,
    recall_at_k,
    recall_at_k_per_user,
    top_k_mask,
)


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


@pytest.mark.parametrize("metric", [recall_at_k, ndcg_at_k, catalog_coverage])
def test_ranking_shape_and_value_errors(metric):
    scores, history, targets = _example()
    with pytest.raises(ValueError, match="2-D"):
        metric(scores[0], history[0], targets[0])
    with pytest.raises(ValueError, match="history must have the shape"):
        metric(scores, history[:2], targets)
    with pytest.raises(ValueError, match="targets must have the shape"):
        metric(scores, history, targets[:, :24])
    with pytest.raises(ValueError, match="boolean"):
        metric(scores, history * 2, targets)
    with pytest.raises(ValueError, match="overlap"):
        metric(scores, history | targets, targets)
    for k in (0, -3, 2.5, True):
        with pytest.raises(ValueError, match="k must be"):
            metric(scores, history, targets, k=k)
    with pytest.raises(ValueError, match="NaN"):
        bad = scores.copy()
        bad[1, 3] = np.nan
        metric(bad, history, targets)
    with pytest.raises(ValueError, match="no user has a target"):
        metric(scores, history, np.zeros_like(targets))


def test_ranking_metrics_refuse_what_the_metrics_refuse():
    scores, history, targets = _example()
    with pytest.raises(ValueError, match="overlap"):
        ranking_metrics([(scores, history | targets, targets)])
    with pytest.raises(ValueError, match="no user has a target"):
        ranking_metrics([(scores, history, np.zeros_like(targets))])
    with pytest.raises(ValueError, match="no user has a target"):
        ranking_metrics([])


def test_ndcg_by_hand():
    d = [1 / math.log2(r + 2) for r in range(4)]  # the discounts of ranks 0..3: 1, 0.6309, 0.5, 0.4307
    scores = np.array([[0.9, 0.8, 0.7, 0.1]])
    targets = _mask(1, 4, {0: {1, 3}})
    none = np.zeros((1, 4), bool)
    # ranking 0, 1, 2, 3: targets at ranks 1 and 3; IDCG of 2 targets = d0 + d1
    assert ndcg_at_k(scores, none, targets, k=4) == pytest.approx((d[1] + d[3]) / (d[0] + d[1]))  # 0.6509
    assert ndcg_at_k(scores, none, targets, k=2) == pytest.approx(d[1] / (d[0] + d[1]))  # 0.3869
    assert ndcg_at_k(scores, none, targets, k=1) == 0.0  # rank 0 is item 0; IDCG d0
    # history {0}: ranking 1, 2, 3 (item 0 fills rank 3 and is never a target): ranks 0 and 2 hit
    assert ndcg_at_k(scores, _mask(1, 4, {0: {0}}), targets, k=3) == pytest.approx((d[0] + d[2]) / (d[0] + d[1]))
    # k above the catalog: the IDCG counts min(k, |targets|) = 2 ranks, the DCG the 4 there are
    assert ndcg_at_k(scores, none, targets, k=100) == pytest.approx((d[1] + d[3]) / (d[0] + d[1]))
    # ties: all scores equal, the lower index first: ranking 0, 1, 2, 3; target 2 at rank 2 -> d2 / d0 = 0.5
    assert ndcg_at_k(np.zeros((1, 4)), none, _mask(1, 4, {0: {2}}), k=4) == pytest.approx(0.5)
    # a user without targets is NaN and left out of the mean; 2 users -> their mean
    two = np.array([[0.9, 0.8, 0.7, 0.1], [0.1, 0.2, 0.3, 0.4], [1.0, 1.0, 1.0, 1.0]])
    aimed = _mask(3, 4, {0: {1, 3}, 1: {3}})
    per_user = ndcg_at_k_per_user(two, np.zeros((3, 4), bool), aimed, k=4)
    assert per_user[:2] == pytest.approx([(d[1] + d[3]) / (d[0] + d[1]), 1.0]) and math.isnan(per_user[2])
    assert ndcg_at_k(two, np.zeros((3, 4), bool), aimed, k=4) == pytest.approx(np.mean(per_user[:2]))


def test_ndcg_of_the_example_at_20_and_100():
    scores, history, targets = _example()
    d = 1 / np.log2(np.arange(2, 102))
    # user 0 ranks 3, 4, ..., 24: targets 3, 22, 23 at ranks 0, 19, 20; IDCG of 3 targets = d0 + d1 + d2
    # user 1 ranks 0, 1, 24, 23, ..., 2: item j at rank 26 - j, so its 22 targets 3..24 sit at ranks 2..23
    assert ndcg_at_k_per_user(scores, history, targets, k=20)[:2] == pytest.approx(
        [(d[0] + d[19]) / d[:3].sum(), d[2:20].sum() / d[:20].sum()]
    )
    assert ndcg_at_k_per_user(scores, history, targets, k=100)[:2] == pytest.approx(
        [(d[0] + d[19] + d[20]) / d[:3].sum(), d[2:24].sum() / d[:22].sum()]
    )


def test_catalog_coverage_by_hand():
    scores = np.array([[6.0, 5, 4, 3, 2, 1], [1.0, 6, 5, 4, 3, 2], [1.0, 2, 3, 4, 5, 6], [3.0, 0, 0, 0, 0, 0]])
    history = _mask(4, 6, {3: {1, 2, 3, 4, 5}})
    targets = _mask(4, 6, {0: {5}, 1: {0}, 3: {0}})
    # top 2: user 0 {0, 1}, user 1 {1, 2}, user 2 has no target (its {5, 4} do not count), user 3 has one
    # candidate, item 0, and item 1 of its history fills the list (not recommended): {0, 1, 2} of 6
    assert catalog_coverage(scores, history, targets, k=2) == pytest.approx(3 / 6)
    # top 1: {0}, {1}, {0} -> 2 of 6; top 6: users 0 and 1 get every item
    assert catalog_coverage(scores, history, targets, k=1) == pytest.approx(2 / 6)
    assert catalog_coverage(scores, history, targets, k=6) == 1.0
    # the one pass: coverage of the top 20 over blocks is over the union of their users' lists
    report = ranking_metrics([(scores[:1], history[:1], targets[:1]), (scores[1:], history[1:], targets[1:])])
    assert report["coverage_at_20"] == 1.0 and report["users"] == 3


def test_ranking_metrics_of_the_example_in_one_pass():
    scores, history, targets = _example()
    buckets = np.arange(25) // 5  # items 0..4 bucket 0, ..., 20..24 bucket 4
    report = ranking_metrics([(scores, history, targets)], buckets, 5)
    assert list(report) == [*metrics.RANKING, "sliced", "users"]
    assert report["recall_at_20"] == pytest.approx((2 / 3 + 0.9) / 2)
    # top 50 is every candidate: user 0 gets its 3 targets (3 / 3), user 1 its 22 (22 / 22)
    assert report["recall_at_50"] == 1.0
    assert report["ndcg_at_100"] == pytest.approx(np.nanmean(ndcg_at_k_per_user(scores, history, targets, 100)))
    # top 20: user 0 items 3..22, user 1 items 0, 1, 7..24: every item but 2 (history of user 0)
    assert report["coverage_at_20"] == pytest.approx(24 / 25)
    # Recall@20 per bucket: bucket 0 (items 0..4) user 0 target 3 hit (1/1), user 1 targets 3, 4 missed
    # (0/2): 0.5; bucket 1 (5..9) only user 1, targets 5..9, hits 7, 8, 9: 3/5; buckets 2 and 3 user 1
    # all 5 hit; bucket 4 (20..24) user 0: 22 hit, 23 missed (1/2), user 1: all 5 (5/5): 0.75
    assert report["sliced"] == pytest.approx([0.5, 0.6, 1.0, 1.0, 0.75])
    assert report["users"] == 2
    # a bucket without targets is None
    assert ranking_metrics([(scores, history, targets)], np.full(25, 1), 2)["sliced"] == [None, report["recall_at_20"]]


# ---------------------------------------------------------------------------------------------
# Properties on random score matrices


@st.composite
def rankings(draw):
    """(scores, history, targets): small integer scores (ties are common), each cell of the masks one
    of none / history / target."""
    users = draw(st.integers(1, 6))
    items = draw(st.integers(1, 30))
    cells = st.lists(st.integers(0, 3), min_size=users * items, max_size=users * items)
    scores = np.array(draw(cells), dtype=np.float64).reshape(users, items)
    kind = np.array(draw(st.lists(st.sampled_from([0, 0, 1, 2]), min_size=users * items, max_size=users * items)))
    return scores, (kind == 1).reshape(users, items), (kind == 2).reshape(users, items)


def _liang(scores, history, targets, k):
    """Liang et al. 2018's Recall@k and NDCG@k per user, transcribed loop by loop (a full sort by
    score, ties by the lower index, in place of their argpartition)."""
    recall, ndcg = [], []
    for s, h, t in zip(scores, history, targets, strict=True):
        if not t.any():
            recall.append(np.nan)
            ndcg.append(np.nan)
            continue
        order = sorted(range(s.size), key=lambda j: (-(-np.inf if h[j] else s[j]), j))[:k]
        recall.append(sum(t[j] for j in order) / min(k, t.sum()))
        dcg = sum(1 / math.log2(r + 2) for r, j in enumerate(order) if t[j])
        ndcg.append(dcg / sum(1 / math.log2(r + 2) for r in range(min(k, t.sum()))))
    return np.array(recall), np.array(ndcg)


@settings(max_examples=150, deadline=None)
@given(rankings(), st.integers(1, 40))
def test_recall_and_ndcg_are_liangs(ranking, k):
    recall, ndcg = _liang(*ranking, k)
    np.testing.assert_allclose(recall_at_k_per_user(*ranking, k), recall)
    np.testing.assert_allclose(ndcg_at_k_per_user(*ranking, k), ndcg)


@settings(max_examples=150, deadline=None)
@given(rankings(), st.integers(1, 40))
def test_metrics_lie_in_0_1_and_nest_in_k(ranking, k):
    scores, history, targets = ranking
    n_targets = targets.sum(axis=1)
    ranked = ranked_top_k(scores, history, k)
    deeper = ranked_top_k(scores, history, k + 5)
    assert np.array_equal(deeper[:, : ranked.shape[1]], ranked)  # the top k are the first k of the top k + 5
    top = np.zeros(scores.shape, bool)
    np.put_along_axis(top, ranked, True, axis=1)
    assert np.array_equal(top, top_k_mask(scores, history, k))  # the same items as the mask
    for metric in (recall_at_k_per_user, ndcg_at_k_per_user):
        value = metric(scores, history, targets, k)
        assert np.array_equal(np.isnan(value), n_targets == 0)
        assert np.all((value[n_targets > 0] >= 0) & (value[n_targets > 0] <= 1 + 1e-12))
    has = n_targets > 0
    # hits never fall as k grows, so neither does Recall@k once k >= |targets| (its divisor then fixed)
    hits = recall_at_k_per_user(scores, history, targets, k)[has] * np.minimum(k, n_targets[has])
    more = recall_at_k_per_user(scores, history, targets, k + 5)[has] * np.minimum(k + 5, n_targets[has])
    assert np.all(more >= hits - 1e-9)
    settled = n_targets[has] <= k
    assert np.all(
        recall_at_k_per_user(scores, history, targets, k + 5)[has][settled]
        >= recall_at_k_per_user(scores, history, targets, k)[has][settled] - 1e-12
    )
    if has.any():
        coverage = catalog_coverage(scores, history, targets, k)
        assert 0 <= coverage <= 1 and catalog_coverage(scores, history, targets, k + 5) >= coverage


@settings(max_examples=100, deadline=None)
@given(rankings(), st.integers(1, 40))
def test_targets_that_are_the_top_score_one(ranking, k):
    scores, history, _ = ranking
    ranked = ranked_top_k(scores, history, k)
    # each user's targets: their first min(k, candidates) items, or fewer (a prefix of the ranking)
    candidates = (~history).sum(axis=1)
    targets = np.zeros(scores.shape, bool)
    for user, row in enumerate(ranked):
        count = min(k, candidates[user])
        targets[user, row[: max(count - user % 2, 0)]] = True
    has = targets.any(axis=1)
    np.testing.assert_allclose(ndcg_at_k_per_user(scores, history, targets, k)[has], 1.0)
    np.testing.assert_allclose(recall_at_k_per_user(scores, history, targets, k)[has], 1.0)


@settings(max_examples=60, deadline=None)
@given(rankings(), st.integers(1, 5))
def test_ranking_metrics_do_not_depend_on_the_blocks(ranking, cut):
    scores, history, targets = ranking
    if not targets.any():
        return
    buckets = np.arange(scores.shape[1]) % 3
    whole = ranking_metrics([(scores, history, targets)], buckets, 3)
    cut = min(cut, scores.shape[0])
    parts = ranking_metrics(
        [(scores[:cut], history[:cut], targets[:cut]), (scores[cut:], history[cut:], targets[cut:])], buckets, 3
    )
    assert parts["users"] == whole["users"] == int(targets.any(axis=1).sum())
    for key in metrics.RANKING:
        assert parts[key] == pytest.approx(whole[key])
    assert whole["recall_at_20"] == pytest.approx(recall_at_k(scores, history, targets, 20))
    assert whole["recall_at_50"] == pytest.approx(recall_at_k(scores, history, targets, 50))
    assert whole["ndcg_at_100"] == pytest.approx(ndcg_at_k(scores, history, targets, 100))
    assert whole["coverage_at_20"] == pytest.approx(catalog_coverage(scores, history, targets, 20))


def test_precision_and_map_at_k_by_hand_and_every_cut_off_in_the_same_pass():
    """One user, items ranked 0, 1, 2, 3, 4 (scores falling), targets {0, 2, 5}: at k = 3 hits at ranks
    1 and 3: Precision 2/3, AP (1/1 + 2/3) / min(3, 3) = 5/9, Recall 2/3; at k = 1: Precision 1,
    AP 1, Recall 1 (min(1, 3) = 1). Item 5 is ranked last (score 0), below item 4."""
    scores = np.array([[5.0, 4.0, 3.0, 2.0, 1.0, 0.0]])
    history = np.zeros((1, 6), dtype=bool)
    targets = _mask(1, 6, {0: {0, 2, 5}})
    report = ranking_metrics([(scores, history, targets)], at=[3, 1, 3])
    assert report["precision_at_3"] == pytest.approx(2 / 3) and report["map_at_3"] == pytest.approx(5 / 9)
    assert report["recall_at_3"] == pytest.approx(2 / 3) and report["coverage_at_3"] == pytest.approx(3 / 6)
    assert (report["precision_at_1"], report["map_at_1"], report["recall_at_1"]) == (1.0, 1.0, 1.0)
    assert report["ndcg_at_3"] == pytest.approx((1 + 1 / math.log2(4)) / (1 + 1 / math.log2(3) + 1 / math.log2(4)))
    assert set(metrics.at_k_keys([1, 3])) <= set(report) and "precision_at_20" not in report
    # the protocol's own metrics are the same with or without extra cut-offs
    plain = ranking_metrics([(scores, history, targets)])
    assert {key: report[key] for key in plain} == plain
    with pytest.raises(Exception, match="k must be a positive integer"):
        ranking_metrics([(scores, history, targets)], at=[0])


@settings(max_examples=40, deadline=None)
@given(st.integers(0, 2**32 - 1), st.integers(1, 30))
def test_metrics_at_k_agree_with_the_per_user_functions_and_their_bounds(seed, k):
    rng = np.random.default_rng(seed)
    scores = rng.normal(size=(6, 30))
    history = rng.random((6, 30)) < 0.2
    targets = (rng.random((6, 30)) < 0.2) & ~history
    if not targets.any():
        targets[0, np.flatnonzero(~history[0])[0]] = True
    report = ranking_metrics([(scores, history, targets)], at=[k])
    assert report[f"recall_at_{k}"] == pytest.approx(recall_at_k(scores, history, targets, k))
    assert report[f"ndcg_at_{k}"] == pytest.approx(ndcg_at_k(scores, history, targets, k))
    assert report[f"coverage_at_{k}"] == pytest.approx(catalog_coverage(scores, history, targets, k))
    assert 0 <= report[f"map_at_{k}"] <= report[f"recall_at_{k}"] + 1e-12  # each hit's precision is at most 1
    assert 0 <= report[f"precision_at_{k}"] <= 1
