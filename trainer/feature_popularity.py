"""Popularity by features: an item without a DP count of its own (a new item) scored by the mean DP
count of the catalog items that share its public feature values. A ranking fold-in's popularity
column (trainer.evaluate.with_popularity) takes this value for a new item, where its own count
would be noise around zero; docs/results.md "New items" measures what it buys.

Privacy: post-processing of the counts release and the public catalog only.
"""

from __future__ import annotations

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from schemas.errors import UserError
from trainer.features import FeatureSpace, feature_families, feature_labels, feature_matrix, value_strings

SCHEMA = pa.schema(
    [
        ("family", pa.string()),
        ("value", pa.string()),  # a category, or a numeric family's bucket [low, high)
        ("low", pa.float64()),  # a numeric bucket's bounds (null for a category)
        ("high", pa.float64()),
        ("mean_count", pa.float64()),
    ]
)
FILE = "feature_popularity.parquet"


def value_means(has, counts: np.ndarray, known: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(mean of `counts` over the `known` items holding each feature value, how many known items
    hold it); `has`: which item holds which value (`holds`)."""
    held = has[known]
    sharing = np.asarray(held.sum(axis=0)).ravel()
    total = held.T @ np.asarray(counts, dtype=np.float64)[known]
    return np.divide(total, sharing, out=np.zeros(sharing.size), where=sharing > 0), sharing


def holds(space: FeatureSpace):
    """Items x feature values (the columns of feature_matrix(space)), 1 where the item holds the value."""
    return (feature_matrix(space) > 0).astype(np.float64).tocsr()


def popularity_by_features(space: FeatureSpace, counts: np.ndarray, new: np.ndarray) -> np.ndarray:
    """Each `new` item's score (catalog order over the mask): the mean, over its feature values held
    by at least one other item, of those items' mean count; the other items' mean count for a new
    item that shares none."""
    has = holds(space)
    means, sharing = value_means(has, counts, ~new)
    fresh = has[new].multiply((sharing > 0)[None, :]).tocsr()
    shared = np.asarray(fresh.sum(axis=1)).ravel()
    fallback = float(np.asarray(counts, dtype=np.float64)[~new].mean())
    return np.where(shared > 0, (fresh @ means) / np.maximum(shared, 1), fallback)


def table(space: FeatureSpace, counts: np.ndarray) -> pa.Table:
    """The catalog's mean count per feature value (every value some item holds), as published."""
    means, sharing = value_means(holds(space), counts, np.ones(space.size, bool))
    bounds = {}
    for family in feature_families(space):
        if family.boundaries is not None:
            edges = np.r_[-np.inf, family.boundaries, np.inf]
            bounds.update({(family.name, value): (edges[k], edges[k + 1]) for k, value in enumerate(family.vocabulary)})
    rows = [(label, mean) for label, mean, n in zip(feature_labels(space), means, sharing, strict=True) if n > 0]
    return pa.table(
        {
            "family": [family for (family, _), _ in rows],
            "value": [value for (_, value), _ in rows],
            "low": [bounds.get(label, (None, None))[0] for label, _ in rows],
            "high": [bounds.get(label, (None, None))[1] for label, _ in rows],
            "mean_count": [mean for _, mean in rows],
        },
        schema=SCHEMA,
    )


def score_new_items(means: pa.Table, items: pa.Table, families: dict, fallback: float) -> np.ndarray:
    """Popularity by features of every row of `items` (public feature columns of `families`) from
    a published `table`: the mean over its values found there (a number by its bucket); `fallback`
    (the catalog's mean count) for an item with none."""
    total, found = np.zeros(items.num_rows), np.zeros(items.num_rows)
    for name, kind in families.items():
        of = means.filter(pc.equal(means["family"], name))
        if kind == "numeric":
            numbers = numbers_of(items, name)
            low, high = (of[column].to_numpy(zero_copy_only=False) for column in ("low", "high"))
            inside = (numbers[:, None] >= low[None, :]) & (numbers[:, None] < high[None, :])
            hit = inside.any(axis=1)
            total[hit] += of["mean_count"].to_numpy()[inside[hit].argmax(axis=1)]
            found += hit
            continue
        lookup = dict(zip(of["value"].to_pylist(), of["mean_count"].to_pylist(), strict=True))
        for row, values in enumerate(value_strings(items, name)):
            known = [lookup[value] for value in dict.fromkeys(values) if value in lookup]  # a bag's value once
            total[row] += sum(known)
            found[row] += len(known)
    return np.where(found > 0, total / np.maximum(found, 1), fallback)


def numbers_of(items: pa.Table, name: str) -> np.ndarray:
    """A number feature column of new items as floats (NaN where empty), refusing, with its row, a
    value that is not a number."""
    values = [None if value is None or str(value).strip() == "" else value for value in items[name].to_pylist()]
    for row, value in enumerate(values):
        if not _is_number(value):
            raise UserError(f"the new items' {name!r} column is a number feature, but row {row + 1} holds {value!r}")
    return pc.cast(pa.array(values), pa.float64()).to_numpy(zero_copy_only=False).astype(np.float64)


def _is_number(value) -> bool:
    try:
        return value is None or np.isfinite(pa.scalar(value).cast(pa.float64()).as_py())
    except (pa.ArrowInvalid, pa.ArrowNotImplementedError, pa.ArrowTypeError):
        return False
