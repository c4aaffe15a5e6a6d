"""The statistics job's duplicate (user, item) pair check, in memory bounded by two buckets of keys.

Rows that come, per item group, in strictly increasing (user, item) order (a run's own stats
rows: files of increasing user ranges, each item shard's rows by user and item) cannot repeat a
pair: `OrderedPairs` checks that order without keeping a key. Other rows go to `PairKeys`: each
row's pair key (user position x catalog size + item position) goes to the bucket of its user's
range of positions, BUCKET_KEYS keys a bucket on average (from the row count the files' footers
declare). One bucket is kept in memory; more are spilled to a private temporary folder (mode 0700,
removed when the check ends) and each is sorted alone, two at a time: a pair's duplicates share
its user and so its bucket. Buckets are checked in user order, so the example a refusal names is
the smallest duplicated key, as one sort of every key would find.

Privacy: the keys say who rated what; they never leave the driver's process and its temporary
folder, and the check runs before any release.
"""

from __future__ import annotations

import os
import tempfile
from collections import deque
from concurrent.futures import ThreadPoolExecutor

import numpy as np

from schemas import storage

BUCKET_KEYS = 1 << 24  # keys per bucket on average (128 MiB of int64; the check holds two at a time)


class OrderedPairs:
    """The order check: each batch's rows, per item group (`item_groups`: the group of each catalog
    position; a pair's duplicates share its item and so its group), must continue that group's
    strictly increasing keys. `duplicates()` is (0, None) when every row did, else None: then
    the rows need `PairKeys`."""

    def __init__(self, items: int, item_groups: np.ndarray):
        self.items, self.item_groups = items, item_groups
        self.last = np.full(int(item_groups.max(initial=0)) + 1, -1, np.int64)  # each group's largest key so far
        self.holds = True

    def __enter__(self) -> OrderedPairs:
        return self

    def __exit__(self, *exc) -> None:
        pass

    def add(self, user_at: np.ndarray, item_at: np.ndarray) -> None:
        if not self.holds or not item_at.size:
            return
        keys = user_at.astype(np.int64) * self.items + item_at
        group = self.item_groups[item_at]
        turns = group[1:] != group[:-1]
        if not np.all((keys[1:] > keys[:-1]) | turns):
            self.holds = False
            return
        starts = np.r_[0, np.flatnonzero(turns) + 1]
        ends = np.r_[starts[1:], keys.size] - 1
        for start, end in zip(starts.tolist(), ends.tolist(), strict=True):  # a few runs: a batch is one row group
            if keys[start] <= self.last[group[start]]:
                self.holds = False
                return
            self.last[group[start]] = keys[end]

    def duplicates(self) -> tuple[int, None] | None:
        return (0, None) if self.holds else None


def files_in_user_order(path: str) -> bool:
    """Whether the files' footers show their users in increasing, disjoint ranges, in the order a
    table is read: what `OrderedPairs` needs of rows in several files."""
    ranges = [storage.value_range(file, "user_id") for file in storage.table_files(path)]
    return None not in ranges and all(high < low for (_, high), (low, _) in zip(ranges, ranges[1:], strict=False))


class PairKeys:
    """Collect the rows' (user, item) positions batch by batch; `duplicates()` after the last."""

    def __init__(self, rows: int, users: int, items: int):
        self.users, self.items = users, items
        self.buckets = max(1, -(-rows // BUCKET_KEYS))
        self._kept: list[np.ndarray] = []  # one bucket: the keys in memory
        self._folder = tempfile.TemporaryDirectory(prefix="ssp-pairs-") if self.buckets > 1 else None
        self._files = (
            [open(os.path.join(self._folder.name, f"{k}.keys"), "wb") for k in range(self.buckets)]
            if self._folder
            else []
        )

    def __enter__(self) -> PairKeys:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def close(self) -> None:
        for file in self._files:
            file.close()
        if self._folder is not None:
            self._folder.cleanup()

    def add(self, user_at: np.ndarray, item_at: np.ndarray) -> None:
        """The keys of a batch of rows, given their user and item positions."""
        users = user_at.astype(np.int64)
        keys = users * self.items + item_at
        if not self._files:
            self._kept.append(keys)
            return
        bucket = users * self.buckets // max(self.users, 1)
        if bucket.size and bucket.min() == bucket.max():  # rows by user: a batch is mostly in one bucket
            keys.tofile(self._files[bucket[0]])
            return
        if not np.all(bucket[1:] >= bucket[:-1]):  # rows by user within an item shard's row group need no order
            order = np.argsort(bucket, kind="stable")
            keys, bucket = keys[order], bucket[order]
        ends = np.searchsorted(bucket, np.arange(1, self.buckets + 1))
        for k, (start, end) in enumerate(zip(np.r_[0, ends[:-1]], ends, strict=True)):
            if end > start:
                keys[start:end].tofile(self._files[k])

    def duplicates(self) -> tuple[int, tuple[int, int] | None]:
        """(how many rows repeat an earlier row's pair, the smallest repeated pair as (user position,
        item position), or None). Two buckets are checked at a time (numpy's reads, sorts and
        comparisons release the GIL), their results taken in user order."""
        for file in self._files:
            file.close()
        count, first = 0, None
        with ThreadPoolExecutor(max_workers=2) as pool:
            pending = deque(pool.submit(self._bucket_duplicates, k) for k in range(min(2, self.buckets)))
            for k in range(self.buckets):
                repeated, smallest = pending.popleft().result()
                if k + 2 < self.buckets:
                    pending.append(pool.submit(self._bucket_duplicates, k + 2))
                count += repeated
                first = smallest if first is None else first
        return count, first

    def _bucket_duplicates(self, k: int) -> tuple[int, tuple[int, int] | None]:
        """(repeated keys in bucket k, its smallest repeated pair or None)."""
        if self._files:
            keys = np.fromfile(self._files[k].name, dtype=np.int64)
        else:
            keys = np.concatenate(self._kept) if self._kept else np.zeros(0, np.int64)
            self._kept = []
        if np.any(keys[1:] < keys[:-1]):  # a run's rows by user and item come sorted: no sort at all
            keys.sort()  # else numpy's quicksort (vectorised), several times timsort's speed on many runs
        same = keys[1:] == keys[:-1]
        if not same.any():
            return 0, None
        return int(same.sum()), divmod(int(keys[1:][same][0]), self.items)
