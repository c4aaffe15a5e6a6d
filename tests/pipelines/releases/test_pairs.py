"""pipelines.releases.pairs: the duplicate (user, item) check, in memory or spilled by user range."""

from __future__ import annotations

import os

import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st

from pipelines.releases import pairs
from pipelines.releases.pairs import PairKeys


def brute_force(user_at: np.ndarray, item_at: np.ndarray) -> tuple[int, tuple[int, int] | None]:
    seen, repeated = set(), []
    for pair in zip(user_at.tolist(), item_at.tolist(), strict=True):
        if pair in seen:
            repeated.append(pair)
        seen.add(pair)
    return len(repeated), min(repeated) if repeated else None


@settings(max_examples=60, deadline=None)
@given(
    st.integers(0, 300),
    st.integers(1, 40),
    st.integers(1, 30),
    st.integers(1, 64),
    st.integers(1, 50),
    st.sampled_from(("any", "by user and item", "runs by user")),
    st.integers(0, 2**32 - 1),
)
def test_the_count_and_the_smallest_repeat_whatever_the_buckets(rows, users, items, bucket_keys, batch, order, seed):
    rng = np.random.default_rng(seed)
    user_at, item_at = rng.integers(0, users, rows, dtype=np.int32), rng.integers(0, items, rows, dtype=np.int32)
    if order == "by user and item":  # a run's centred rows
        by = np.lexsort((item_at, user_at))
        user_at, item_at = user_at[by], item_at[by]
    if order == "runs by user":  # the stats rows: each item shard's rows by user (mean.write_by_item_shard)
        by = np.lexsort((user_at, item_at % 3))
        user_at, item_at = user_at[by], item_at[by]
    whole, pairs.BUCKET_KEYS = pairs.BUCKET_KEYS, bucket_keys
    try:
        with PairKeys(rows, users, items) as keys:
            assert keys.buckets == max(1, -(-rows // bucket_keys))
            for start in range(0, rows, batch):
                keys.add(user_at[start : start + batch], item_at[start : start + batch])
            got = keys.duplicates()
    finally:
        pairs.BUCKET_KEYS = whole
    assert got == brute_force(user_at, item_at)


def test_the_spilled_keys_are_private_and_removed(monkeypatch):
    monkeypatch.setattr(pairs, "BUCKET_KEYS", 2)
    with PairKeys(6, 3, 4) as keys:
        folder = keys._folder.name
        assert keys.buckets == 3 and os.stat(folder).st_mode & 0o077 == 0  # the owner's only
        keys.add(np.array([2, 0, 1, 0, 2, 2]), np.array([1, 3, 0, 3, 1, 1]))
        assert keys.duplicates() == (3, (0, 3))  # user 0's item 3 once more, user 2's item 1 twice more
    assert not os.path.exists(folder)
