"""Positions of ids (users, items) in a sorted id column: the row lookups of the joins.

The jobs join millions of rows with a table by id (each interaction with its user's embedding and
its item's DP count). A binary search per row (np.searchsorted) costs a cache miss per probe;
when the ids are dense enough (their span at most a few times their number, as MovieLens and
most warehouse ids are), a position table indexed by `id - smallest id` finds each in one read.
Sparse ids (hashes) fall back to the binary search. Both give the same positions.
"""

from __future__ import annotations

import numpy as np

from schemas.errors import UserError

DENSE_SPAN_FACTOR = 8  # a position table at most this many times the number of ids (plus DENSE_SLACK)
DENSE_SLACK = 1 << 20


class IdIndex:
    """Lookups in `sorted_ids` (ascending, unique int64). Pickles as its ids only: a worker that
    receives it builds its own position table."""

    def __init__(self, sorted_ids: np.ndarray):
        self.ids = np.asarray(sorted_ids, dtype=np.int64)
        self._table = None
        if self.ids.size:
            span = int(self.ids[-1]) - int(self.ids[0])
            if span <= DENSE_SPAN_FACTOR * self.ids.size + DENSE_SLACK:
                self._table = np.full(span + 1, -1, dtype=np.int64)
                self._table[self.ids - self.ids[0]] = np.arange(self.ids.size)

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
            at = np.minimum(np.searchsorted(self.ids, values), self.ids.size - 1)
            return at, self.ids[at] == values
        low, high = self.ids[0], self.ids[-1]
        if values.size == 0 or (values.min() >= low and values.max() <= high):
            at = self._table[values - low]
        else:  # compare before subtracting: far-off values would overflow int64
            inside = (values >= low) & (values <= high)
            at = np.full(values.size, -1, dtype=np.int64)
            at[inside] = self._table[values[inside] - low]
        found = at >= 0
        return np.maximum(at, 0), found

    def positions(self, values: np.ndarray, what: str = "id") -> np.ndarray:
        """Positions of values that must all be there; a ValueError names the first missing one."""
        at, found = self.lookup(values)
        if not found.all():
            raise UserError(f"{np.count_nonzero(~found)} {what}(s) not found, e.g. {np.asarray(values)[~found][0]}")
        return at
