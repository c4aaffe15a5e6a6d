"""pipelines.releases.pairs: the duplicate (user, item) check, by order, in memory or spilled by user range."""

from __future__ import annotations

import os

import numpy as np
import pyarrow as pa
from hypothesis import given, settings
from hypothesis import strategies as st

from pipelines.releases import pairs
from pipelines.releases.pairs import PairKeys
from schemas import storage


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


@settings(max_examples=80, deadline=None)
@given(
    st.integers(0, 200),
    st.integers(1, 30),
    st.integers(1, 20),
    st.integers(1, 4),
    st.integers(1, 40),
    st.sampled_from(("by group, then user and item", "any")),
    st.booleans(),
    st.integers(0, 2**32 - 1),
)
def test_the_order_check_passes_only_rows_without_a_repeat(rows, users, items, groups, batch, order, unique, seed):
    # rows each group's keys strictly increasing (as a run writes its stats rows) pass without a key
    # kept; whatever else comes is either passed with no repeat in it, or handed on (None)
    rng = np.random.default_rng(seed)
    user_at, item_at = rng.integers(0, users, rows, dtype=np.int32), rng.integers(0, items, rows, dtype=np.int32)
    if unique:
        _, first = np.unique(user_at.astype(np.int64) * items + item_at, return_index=True)
        user_at, item_at = user_at[np.sort(first)], item_at[np.sort(first)]
    item_groups = rng.integers(0, groups, items)
    if order != "any":
        by = np.lexsort((item_at, user_at, item_groups[item_at]))
        user_at, item_at = user_at[by], item_at[by]
    check = pairs.OrderedPairs(items, item_groups)
    for start in range(0, user_at.size, batch):
        check.add(user_at[start : start + batch], item_at[start : start + batch])
    got = check.duplicates()
    assert got in (None, (0, None))
    if got is not None:
        assert brute_force(user_at, item_at) == (0, None)
    if unique and order != "any":
        assert got == (0, None)


def test_files_in_user_order_reads_the_footers(tmp_path):
    def table(name, *files):
        staged = storage.StagedWrite(str(tmp_path / name))
        for part, user_ids in enumerate(files):
            ids = pa.array(user_ids, pa.int64())
            with staged.open_part(part, pa.schema([("user_id", pa.int64())])) as writer:
                writer.write_table(pa.table({"user_id": ids}))
        staged.commit([staged.part_name(part) for part in range(len(files))], sum(map(len, files)))
        return str(tmp_path / name)

    assert pairs.files_in_user_order(table("ranges", [3, 1, 2], [4, 9], [10]))
    assert not pairs.files_in_user_order(table("touching", [1, 2, 4], [4, 5]))  # user 4 in two files
    assert not pairs.files_in_user_order(table("interleaved", [1, 5], [2, 6]))
    assert not pairs.files_in_user_order(table("backwards", [7, 8], [1, 2]))
