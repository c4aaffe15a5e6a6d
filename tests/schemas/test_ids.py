"""schemas.ids.IdIndex: the same positions as a binary search, dense ids or sparse."""

from __future__ import annotations

import pickle

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from schemas.ids import IdIndex

INT64 = st.integers(-(2**63), 2**63 - 1)


def reference(ids: np.ndarray, values: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    at = np.minimum(np.searchsorted(ids, values), max(ids.size - 1, 0))
    return at, (ids[at] == values) if ids.size else np.zeros(values.size, bool)


def check(ids: np.ndarray, values: np.ndarray) -> None:
    at, found = IdIndex(ids).lookup(values)
    want_at, want_found = reference(ids, values)
    np.testing.assert_array_equal(found, want_found)
    np.testing.assert_array_equal(at[found], want_at[want_found])


def test_dense_ids_use_a_position_table_and_sparse_ones_do_not():
    dense = IdIndex(np.arange(10, 1000, 3))
    assert dense._table.dtype == np.int32 and dense._table[[0, 1, 3, 987]].tolist() == [0, -1, 1, 329]
    assert dense.lookup(np.array([13]))[0].dtype == np.int64  # positions are int64 whatever the table holds
    assert IdIndex(np.array([1, 2**40]))._table is None


def test_hand_example():
    index = IdIndex(np.array([3, 5, 9]))
    at, found = index.lookup(np.array([9, 3, 4, 5, 10, 2]))
    assert found.tolist() == [True, True, False, True, False, False]
    assert at[found].tolist() == [2, 0, 1]
    assert index.positions(np.array([5, 5, 9])).tolist() == [1, 1, 2]
    with pytest.raises(ValueError, match=r"1 user\(s\) not found, e.g. 4"):
        index.positions(np.array([3, 4]), "user")


def test_a_dense_table_refuses_values_at_the_int64_limits_without_wrapping():
    index = IdIndex(np.arange(-3, 5))
    assert index._table is not None
    at, found = index.lookup(np.array([2**63 - 1, -(2**63), 4, -3, 5, -4]))
    assert found.tolist() == [False, False, True, True, False, False]
    assert at.tolist() == [0, 0, 7, 0, 0, 0]


@settings(max_examples=150, deadline=None)
@given(ids=st.sets(st.integers(-50, 400), max_size=60), values=st.lists(st.integers(-60, 420), max_size=80))
def test_dense_matches_binary_search(ids, values):
    check(np.array(sorted(ids), dtype=np.int64), np.array(values, dtype=np.int64))


@settings(max_examples=150, deadline=None)
@given(
    ids=st.sets(INT64, max_size=20),
    values=st.lists(INT64, max_size=30),
    reuse=st.lists(st.integers(0, 19), max_size=10),
)
def test_any_int64_ids_and_far_off_values(ids, values, reuse):
    # values near the int64 limits must not wrap around into the dense table's range
    ids = np.array(sorted(ids), dtype=np.int64)
    picked = [int(ids[k % ids.size]) for k in reuse] if ids.size else []
    check(ids, np.array(values + picked, dtype=np.int64))
    dense = np.arange(100, dtype=np.int64)
    check(dense, np.array(values + [0, 99, 100, -1], dtype=np.int64))


def test_empty_index_and_empty_values():
    at, found = IdIndex(np.zeros(0, np.int64)).lookup(np.array([1, 2]))
    assert not found.any()
    at, found = IdIndex(np.arange(5)).lookup(np.zeros(0, np.int64))
    assert at.size == 0 and found.size == 0


def test_pickles_as_its_ids_and_rebuilds_the_table():
    index = IdIndex(np.arange(1000, 5000))
    restored = pickle.loads(pickle.dumps(index))
    assert len(pickle.dumps(index)) < 4000 * 8 + 2000  # the ids, not a second table
    np.testing.assert_array_equal(restored.lookup(np.array([999, 1000, 4999]))[1], [False, True, True])
    assert restored.positions(np.array([4999]))[0] == 3999


@settings(max_examples=200, deadline=None)
@given(st.sets(INT64, max_size=40), st.lists(INT64, max_size=40), st.randoms(use_true_random=False))
def test_ids_in_any_order_give_positions_into_the_order_given(ids, probes, shuffle):
    """A catalog in any order (a customer's table as written): each position is where the id sits
    in the array given, dense ids or sparse, and absent values are reported absent."""
    given_order = sorted(ids)
    shuffle.shuffle(given_order)
    ids = np.array(given_order, dtype=np.int64)
    values = np.array(probes + list(ids[:5]), dtype=np.int64)
    at, found = IdIndex(ids).lookup(values)
    np.testing.assert_array_equal(found, np.isin(values, ids))
    np.testing.assert_array_equal(ids[at[found]], values[found])


def test_values_of_any_shape_keep_it():
    at, found = IdIndex(np.array([3, 5, 9])).lookup(np.array([[9, 3], [4, 5]]))
    assert found.tolist() == [[True, True], [False, True]]
    assert at[found].tolist() == [2, 0, 1]
