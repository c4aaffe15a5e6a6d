"""privacy.weights: w_i = wbar * n_j^e / sqrt(sum_{user} n_j'^(2e)), so sum_user w_i^2 = wbar^2."""

from __future__ import annotations

import math

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from privacy import weights
from privacy.weights import (
    DEFAULT_EXPONENT,
    example_level_weights,
    normalisers_at,
    user_level_weights,
    user_normalisers,
)


def test_default_exponent_is_minus_a_quarter():
    assert DEFAULT_EXPONENT == -0.25


def test_hand_example_one_user():
    # counts 1, 16, 81 -> raw n^-1/4 = 1, 1/2, 1/3; normaliser sqrt(1 + 1/4 + 1/9) = sqrt(49/36) = 7/6
    for wbar in (1.0, 2.0, 0.3):
        w = user_level_weights(np.array([5, 5, 5]), np.array([1.0, 16.0, 81.0]), wbar)
        np.testing.assert_allclose(w, wbar * np.array([6 / 7, 3 / 7, 2 / 7]), rtol=1e-14)
        assert np.sum(w**2) == pytest.approx(wbar**2, rel=1e-14)


def test_hand_example_two_users_are_normalised_separately():
    users = np.array([1, 2, 1, 2, 1])
    counts = np.array([1.0, 16.0, 16.0, 16.0, 81.0])
    w = user_level_weights(users, counts, 2.0)
    # user 1: counts 1, 16, 81 -> 2 * (6/7, 3/7, 2/7); user 2: counts 16, 16 -> equal weights 2/sqrt(2)
    np.testing.assert_allclose(w, [12 / 7, math.sqrt(2), 6 / 7, math.sqrt(2), 4 / 7], rtol=1e-14)


def test_tail_items_get_more_weight_than_head_items():
    w = user_level_weights(np.zeros(3, dtype=int), np.array([1.0, 10.0, 1000.0]), 1.0)
    assert w[0] > w[1] > w[2] > 0


def test_single_row_user_gets_wbar():
    w = user_level_weights(np.array([3, 4]), np.array([7.0, 1.0]), 1.7)
    np.testing.assert_allclose(w, [1.7, 1.7], rtol=1e-15)


@st.composite
def users_and_counts(draw):
    n = draw(st.integers(1, 40))
    users = draw(st.lists(st.integers(-5, 8), min_size=n, max_size=n))
    counts = draw(st.lists(st.floats(1.0, 1e6), min_size=n, max_size=n))
    return np.array(users), np.array(counts)


@settings(max_examples=60, deadline=None)
@given(data=users_and_counts(), wbar=st.floats(0.01, 100.0), exponent=st.sampled_from([-0.25, -0.5, 0.0, -1.0, 0.25]))
def test_sum_of_squared_weights_per_user_is_wbar_squared(data, wbar, exponent):
    users, counts = data
    w = user_level_weights(users, counts, wbar, exponent)
    assert w.shape == users.shape
    assert np.all(w > 0)
    for user in np.unique(users):
        assert np.sum(w[users == user] ** 2) == pytest.approx(wbar**2, rel=1e-12)


@settings(max_examples=40, deadline=None)
@given(data=users_and_counts(), wbar=st.floats(0.1, 10.0), seed=st.integers(0, 2**32 - 1))
def test_row_order_is_irrelevant(data, wbar, seed):
    users, counts = data
    w = user_level_weights(users, counts, wbar)
    perm = np.random.default_rng(seed).permutation(users.size)
    w_perm = user_level_weights(users[perm], counts[perm], wbar)
    np.testing.assert_allclose(w_perm, w[perm], rtol=1e-14)


def test_uniform_weights_with_exponent_zero():
    users = np.array([1, 1, 1, 1, 2, 3, 3])
    counts = np.array([1.0, 50.0, 3.0, 1e5, 2.0, 9.0, 1.0])
    w = user_level_weights(users, counts, 3.0, exponent=0.0)
    np.testing.assert_allclose(w, [1.5, 1.5, 1.5, 1.5, 3.0, 3.0 / math.sqrt(2), 3.0 / math.sqrt(2)], rtol=1e-15)


def test_string_user_ids_work():
    w = user_level_weights(np.array(["a", "b", "a"]), np.array([1.0, 4.0, 16.0]), 1.0)
    # user a: raw 1, 1/2 -> normaliser sqrt(1.25)
    np.testing.assert_allclose(w, [1 / math.sqrt(1.25), 1.0, 0.5 / math.sqrt(1.25)], rtol=1e-15)


def test_empty_input_gives_empty_weights():
    w = user_level_weights(np.array([], dtype=np.int64), np.array([]), 1.0)
    assert w.shape == (0,)


@pytest.mark.parametrize("counts", [[0.5, 2.0], [0.0, 1.0], [-1.0, 3.0], [math.nan, 2.0], [math.inf, 2.0]])
def test_counts_below_one_or_not_finite_raise(counts):
    with pytest.raises(ValueError, match="counts"):
        user_level_weights(np.array([1, 2]), np.array(counts), 1.0)


@pytest.mark.parametrize("wbar", [0.0, -1.0, math.nan, math.inf])
def test_bad_wbar_raises(wbar):
    with pytest.raises(ValueError, match="wbar"):
        user_level_weights(np.array([1]), np.array([2.0]), wbar)


def test_non_finite_exponent_raises():
    with pytest.raises(ValueError, match="exponent"):
        user_level_weights(np.array([1]), np.array([2.0]), 1.0, exponent=math.nan)


@pytest.mark.parametrize("users, counts", [([1, 2, 3], [1.0, 2.0]), ([1, 2], [[1.0, 2.0]]), ([[1, 2]], [1.0, 2.0])])
def test_shape_mismatch_raises(users, counts):
    with pytest.raises(ValueError, match="shape"):
        user_level_weights(np.array(users), np.array(counts), 1.0)


def test_example_level_weights_are_ones():
    w = example_level_weights(4)
    assert w.dtype == np.float64
    assert w.tolist() == [1.0, 1.0, 1.0, 1.0]
    assert example_level_weights(0).shape == (0,)


def test_a_huge_history_is_still_bounded():
    """One user with 10^5 ratings among light users: their squared weights still sum to wbar^2."""
    rng = np.random.default_rng(7)
    users = np.r_[np.zeros(100_000, np.int64), rng.integers(1, 50, 500)]
    counts = rng.integers(1, 10_000, users.size).astype(float)
    w = user_level_weights(users, counts, 1.5)
    assert np.isclose(np.sum(w[users == 0] ** 2), 1.5**2, rtol=1e-12)
    assert w[users == 0].max() < 0.05  # each of the heavy user's rows weighs little (wbar 1.5 over 10^5 rows)


def test_normalisers_with_known_users_equal_the_sorting_path():
    users = np.array([30, 10, 30, 20, 10, 30])
    counts = np.array([4.0, 16.0, 1.0, 9.0, 4.0, 16.0])
    expected_users, expected = user_normalisers(users, counts)
    known_users, known = user_normalisers(users, counts, known_users=np.array([5, 10, 20, 25, 30]))
    assert known_users.tolist() == expected_users.tolist() == [10, 20, 30]
    # by hand, n^(2e) = n^(-1/2): user 10: 1/4 + 1/2; user 20: 1/3; user 30: 1/2 + 1 + 1/4
    assert np.allclose(expected, [0.75, 1 / 3, 1.75]) and np.array_equal(known, expected)
    # the same rows by position: users' in the known ones, items' in a table of counts by item (4, 16, 1, 9)
    at_users, at = normalisers_at(
        np.array([4, 1, 4, 2, 1, 4]),
        np.array([0, 1, 2, 3, 0, 1]),
        np.array([4.0, 16.0, 1.0, 9.0]),
        np.array([5, 10, 20, 25, 30]),
    )
    assert at_users.tolist() == [10, 20, 30] and np.array_equal(at, expected)


@settings(max_examples=50, deadline=None)
@given(
    st.integers(1, 400),
    st.integers(1, 30),
    st.integers(1, 50),
    st.booleans(),
    st.floats(-2.0, 1.0),
    st.integers(0, 2**32 - 1),
    st.integers(1, 64),
)
def test_normalisers_at_give_the_bits_of_the_per_row_formula(rows, users, items, confident, exponent, seed, chunk):
    """Per item powers gathered per row give exactly what (c_i n_j^e)^2 per row, summed in row order, does,
    whatever the chunks the rows are summed in and with int32 positions (the stats job's)."""
    rng = np.random.default_rng(seed)
    known = np.sort(rng.choice(10 * users, users, replace=False))
    positions, item_at = rng.integers(0, users, rows, dtype=np.int32), rng.integers(0, items, rows, dtype=np.int32)
    item_counts = 1.0 + rng.exponential(100.0, items)
    confidence = rng.uniform(0.1, 5.0, rows) if confident else None
    whole, weights.NORMALISER_CHUNK = weights.NORMALISER_CHUNK, chunk
    try:
        got_users, got = normalisers_at(positions, item_at, item_counts, known, exponent, confidence)
    finally:
        weights.NORMALISER_CHUNK = whole
    terms = ((confidence if confident else np.ones(rows)) * item_counts[item_at] ** exponent) ** 2
    expected = np.zeros(users)
    for position, term in zip(positions, terms, strict=True):  # in the rows' order
        expected[position] += term
    present = np.isin(np.arange(users), positions)
    assert np.array_equal(got_users, known[present]) and np.array_equal(got, expected[present])
