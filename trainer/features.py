"""The public feature space of the catalog: every item's feature values as integer ids per family.

Built from the items table only (public by declaration). Each declared family gets a vocabulary of
its values (id 0 is reserved for "unknown": an item with no value in a family, or a value unseen
when the space was built); multivalent families keep repeated values (they weigh more in the
encoder's bag average). The item id itself can be one more family: the catalog is public, so an
id embedding costs no privacy under SSP (the noise scales with the number of items, not of
features). A numeric family (a price) is bucketed by the catalog's quantiles (NUMERIC_BUCKETS of
them, fewer where values repeat): one value per bucket, so items of a similar price share an
embedding row, and a new item's number falls in a bucket whatever its exact value.

Privacy: public item features only.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import cached_property

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import scipy.sparse as sp

from schemas.errors import UserError
from schemas.ids import IdIndex
from schemas.tables import NUMERIC, item_features, validate_items

ITEM_ID_FAMILY = "item_id"
NUMERIC_BUCKETS = 10  # deciles, the usual quantile bucketing of a numeric feature


@dataclass
class Family:
    """One feature family: its vocabulary and every catalog item's value ids (CSR layout)."""

    name: str
    vocabulary: list[str]  # value of id k is vocabulary[k - 1]; id 0 = unknown
    values: np.ndarray  # int64 value ids, all items concatenated
    row_splits: np.ndarray  # item i's ids are values[row_splits[i]:row_splits[i + 1]]
    boundaries: np.ndarray | None = None  # a numeric family's bucket edges: x's id is 1 + #(edges <= x)

    @property
    def size(self) -> int:
        return len(self.vocabulary) + 1


@dataclass
class FeatureSpace:
    """The catalog (item ids in order) and its feature families."""

    item_ids: np.ndarray
    families: list[Family]

    @classmethod
    def from_items(cls, items: pa.Table, use_item_id: bool = True, families: list[str] | None = None) -> FeatureSpace:
        """Build the space from an items table; `families` restricts to some declared families."""
        items = validate_items(items)
        declared = item_features(items.schema)
        chosen = list(declared) if families is None else families
        unknown = [name for name in chosen if name not in declared]
        if unknown:
            raise UserError(
                f"feature families {unknown} are not declared public in the items table (declared: {list(declared)})"
            )
        out = []
        for name in chosen:
            if declared[name] == NUMERIC:
                out.append(_numeric_family(name, items[name]))
                continue
            lengths, flat = _column_values(items[name])
            vocabulary, ids = (
                np.unique(flat, return_inverse=True) if flat.size else (np.array([], str), np.zeros(0, np.int64))
            )
            out.append(
                Family(
                    name, vocabulary.tolist(), ids.astype(np.int64) + 1, np.r_[0, np.cumsum(lengths)].astype(np.int64)
                )
            )
        item_ids = items["item_id"].to_numpy()
        if use_item_id:
            out.append(
                Family(
                    ITEM_ID_FAMILY,
                    [str(i) for i in item_ids],
                    np.arange(1, item_ids.size + 1, dtype=np.int64),
                    np.arange(item_ids.size + 1, dtype=np.int64),
                )
            )
        if not out:
            raise UserError("the encoder needs at least one feature family (or the item id)")
        return cls(item_ids, out)

    @property
    def size(self) -> int:
        return int(self.item_ids.size)

    @cached_property
    def _index(self) -> tuple[IdIndex, np.ndarray]:
        """(the ids in order, as an IdIndex; the catalog position of each), built once: index_of runs
        per minibatch and per evaluated row."""
        order = np.argsort(self.item_ids, kind="stable")
        return IdIndex(self.item_ids[order]), order

    def index_of(self, item_ids: np.ndarray) -> np.ndarray:
        """Positions of catalog items in this space; raises for an item not in the catalog."""
        index, order = self._index
        item_ids = np.asarray(item_ids)
        at, found = index.lookup(item_ids)
        if not np.all(found):
            raise UserError(f"item {item_ids[~found][0]} is not in the catalog the encoder was built for")
        return order[at]


def _numeric_family(name: str, column: pa.ChunkedArray) -> Family:
    """A numeric family: buckets between the catalog's quantiles (the catalog is public), each
    item's number as its bucket (no value when null)."""
    numbers = column.to_numpy(zero_copy_only=False).astype(np.float64)
    known = np.isfinite(numbers)
    if known.any():
        edges = np.unique(np.quantile(numbers[known], np.linspace(0.0, 1.0, NUMERIC_BUCKETS + 1)[1:-1]))
        edges = edges[edges > numbers[known].min()]  # no bucket below every value
    else:
        edges = np.zeros(0)
    bounds = np.r_[-np.inf, edges, np.inf]
    vocabulary = [f"[{low:g}, {high:g})" for low, high in zip(bounds[:-1], bounds[1:], strict=True)]
    ids = np.searchsorted(edges, numbers[known], side="right").astype(np.int64) + 1
    return Family(name, vocabulary, ids, np.r_[0, np.cumsum(known)].astype(np.int64), boundaries=edges)


def _column_values(column: pa.Array | pa.ChunkedArray) -> tuple[np.ndarray, np.ndarray]:
    """(number of values of each row, every value as a string, rows concatenated) of a feature
    column: a bag (list<string>, repeats kept) or a single value (null: none)."""
    column = column.combine_chunks() if isinstance(column, pa.ChunkedArray) else column
    if pa.types.is_list(column.type) or pa.types.is_large_list(column.type):
        lengths, flat = pc.list_value_length(column).fill_null(0), column.flatten()
    else:
        lengths, flat = column.is_valid(), column.drop_null()
    return lengths.to_numpy(zero_copy_only=False).astype(np.int64), pc.cast(flat, pa.string()).to_numpy(
        zero_copy_only=False
    ).astype(str)


def value_strings(items: pa.Table, name: str) -> list[list[str]]:
    """Every row's values of feature family `name` as the strings the vocabularies hold (a bag's
    values in order; a univalent value as a one-element list, none when null; a number as its
    text, which the signature buckets): what the exported encoder's `embed_features` signature takes."""
    column = items[name]
    if pa.types.is_floating(column.type):
        return [[] if value is None or value != value else [repr(float(value))] for value in column.to_pylist()]
    lengths, flat = _column_values(column)
    splits, values = np.r_[0, np.cumsum(lengths)], flat.tolist()
    return [values[splits[i] : splits[i + 1]] for i in range(lengths.size)]


def feature_families(space: FeatureSpace) -> list:
    """The families that are public features (the features encoder's, DP-CMF's): every family but the item id."""
    return [family for family in space.families if family.name != ITEM_ID_FAMILY]


def feature_labels(space: FeatureSpace) -> list[tuple[str, str]]:
    """(family, value) of every column of `feature_matrix(space)`, in column order."""
    return [(family.name, value) for family in feature_families(space) for value in family.vocabulary]


def feature_matrix(space: FeatureSpace) -> sp.csr_matrix:
    """X (n items x F feature values, CSR): each family's bag of known values averaged, as the encoder does."""
    n = space.size
    rows, cols, weights, offset = [], [], [], 0
    for family in feature_families(space):
        item = np.repeat(np.arange(n, dtype=np.int64), np.diff(family.row_splits))
        values = np.asarray(family.values, dtype=np.int64)
        known = values > 0
        item, values = item[known], values[known]
        lengths = np.bincount(item, minlength=n)
        rows.append(item)
        cols.append(offset + values - 1)
        weights.append(1.0 / lengths[item])
        offset += family.size - 1
    if not rows:
        return sp.csr_matrix((n, 0))
    x = sp.coo_matrix((np.concatenate(weights), (np.concatenate(rows), np.concatenate(cols))), shape=(n, offset))
    return x.tocsr()  # duplicate (item, value) entries are summed: count / bag length
