"""Positions of ids (users, items) in an id column: the row lookups of the joins.

The jobs join millions of rows with a table by id (each interaction with its user's embedding and
its item's DP count). A binary search per row (np.searchsorted) costs a cache miss per probe;
when the ids are dense enough (their span at most a few times their number, as MovieLens and
most warehouse ids are), a position table indexed by `id - smallest id` finds each in one read,
in one compiled pass over the values.
Sparse ids (hashes) fall back to the binary search. Both give the same positions.

Privacy: lookups only.
"""

from __future__ import annotations

import numpy as np

from schemas.compiled import kernel
from schemas.errors import UserError

DENSE_SPAN_FACTOR = 8  # a position table at most this many times the number of ids (plus DENSE_SLACK)
DENSE_SLACK = 1 << 20


class IdIndex:
    """Lookups in `ids` (unique int64, in any order: a position is an index into `ids`). Pickles as
    its ids only: a worker that receives it builds its own position table."""

    def __init__(self, ids: np.ndarray):
        self.ids = np.asarray(ids, dtype=np.int64)
        self._table = self._order = None
        if self.ids.size:
            self.low, self.high = int(self.ids.min()), int(self.ids.max())
            if self.high - self.low <= DENSE_SPAN_FACTOR * self.ids.size + DENSE_SLACK:
                self._table = np.full(  # int32 where it holds every position: half the memory to touch
                    self.high - self.low + 1, -1, dtype=np.int32 if self.ids.size < 2**31 else np.int64
                )
                _fill_table(self._table, self.ids, self.low)
            elif np.any(self.ids[1:] < self.ids[:-1]):
                self._order = np.argsort(self.ids, kind="stable")
                self._sorted = self.ids[self._order]  # once, not per lookup

    def __getstate__(self):
        return {"ids": self.ids}

    def __setstate__(self, state):
        self.__init__(state["ids"])

    def lookup(self, values: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """(position of each value, whether it is there); positions of absent values are arbitrary."""
        values = np.asarray(values, dtype=np.int64)
        if self.ids.size == 0:
            return np.zeros(values.size, np.int64), np.zeros(values.size, bool)
        if self._table is None:
            ordered = self.ids if self._order is None else self._sorted
            at = np.minimum(np.searchsorted(ordered, values), self.ids.size - 1)
            found = ordered[at] == values
            return (at if self._order is None else self._order[at]), found
        at, found = np.empty(values.shape, np.int64), np.empty(values.shape, bool)
        _table_lookup(
            self._table,
            self.low,
            self.high,
            np.ascontiguousarray(values).reshape(-1),
            at.reshape(-1),
            found.reshape(-1),
        )
        return at, found

    def positions(self, values: np.ndarray, what: str = "id") -> np.ndarray:
        """Positions of values that must all be there; a ValueError names the first missing one."""
        at, found = self.lookup(values)
        if not found.all():
            raise UserError(f"{np.count_nonzero(~found)} {what}(s) not found, e.g. {np.asarray(values)[~found][0]}")
        return at


@kernel
def _fill_table(table, ids, low):
    """table[id - low] <- the position of each id, in one pass (no temporary arrays)."""
    for i in range(ids.size):
        table[ids[i] - low] = i


@kernel
def _table_lookup(table, low, high, values, at, found):
    """at[i], found[i] <- the position of values[i] in the position table (0 and False when absent),
    in one pass; a value is compared with the table's span before it is subtracted, so far-off
    values cannot overflow."""
    for i in range(values.size):
        value = values[i]
        position = table[value - low] if low <= value <= high else -1
        found[i] = position >= 0
        at[i] = max(position, 0)
