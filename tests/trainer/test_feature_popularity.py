"""Popularity by features: hand-computed means, the published table and a new item's score from it."""

import numpy as np
import pyarrow as pa
import pytest

from schemas.errors import UserError
from schemas.tables import items_schema
from trainer import feature_popularity
from trainer.features import FeatureSpace

FAMILIES = {"genres": "multivalent", "length": "numeric"}


def catalog(rows) -> pa.Table:
    """Items (id, genres, length)."""
    ids, genres, lengths = zip(*rows, strict=True)
    return pa.table(
        {"item_id": list(ids), "title": [f"item {i}" for i in ids], "genres": list(genres), "length": list(lengths)},
        schema=items_schema(FAMILIES),
    )


def test_popularity_by_features_by_hand():
    items = catalog([(1, ["A"], 1.0), (2, ["A", "B"], 1.0), (3, ["B"], 1.0), (4, ["A", "B"], 1.0)])
    space = FeatureSpace.from_items(items, use_item_id=False)
    counts = np.array([10.0, 20.0, 40.0, 3.0])
    new = np.array([False, False, False, True])
    # item 4: genre A (items 1, 2: 15), genre B (2, 3: 30), the one length bucket (1-3: 70 / 3), averaged
    assert feature_popularity.popularity_by_features(space, counts, new) == pytest.approx([(15 + 30 + 70 / 3) / 3])
    # a new item sharing no value with another: the other items' mean count
    lonely = catalog([(1, ["A"], None), (2, ["A", "B"], None), (3, ["B"], None), (4, ["C"], None)])
    scores = feature_popularity.popularity_by_features(FeatureSpace.from_items(lonely, use_item_id=False), counts, new)
    assert scores == pytest.approx([70 / 3])


def test_the_published_table_scores_new_items_as_the_catalog_would():
    lengths = [float(k) for k in range(1, 21)]  # 20 lengths: ten decile buckets of two items each
    items = catalog([(i, ["A"] if i % 2 else ["B"], length) for i, length in enumerate(lengths, start=1)])
    counts = np.arange(1.0, 21.0)
    table = feature_popularity.table(FeatureSpace.from_items(items, use_item_id=False), counts)
    genre = {row["value"]: row["mean_count"] for row in table.to_pylist() if row["family"] == "genres"}
    assert genre == pytest.approx({"A": 10.0, "B": 11.0})  # odd counts 1..19, even 2..20
    buckets = [row for row in table.to_pylist() if row["family"] == "length"]
    assert len(buckets) == 10 and buckets[0]["low"] == -np.inf and buckets[-1]["high"] == np.inf
    for row in buckets:  # each bucket's mean over the items whose length lies in [low, high)
        inside = [row["low"] <= length < row["high"] for length in lengths]
        assert row["mean_count"] == pytest.approx(counts[inside].mean())
    new = pa.table(
        {
            "item_id": [30, 31, 32, 33],
            "genres": [["A", "A"], ["B", "Z"], ["Z"], []],  # a bag's repeated value counts once; Z is unknown
            "length": pa.array(["1.5", None, "100", " "]),  # as a CSV gives them: text
        }
    )
    fallback = float(counts.mean())
    scores = feature_popularity.score_new_items(table, new, FAMILIES, fallback)
    first = next(row["mean_count"] for row in buckets if row["low"] <= 1.5 < row["high"])
    last = buckets[-1]["mean_count"]
    assert scores == pytest.approx([(10.0 + first) / 2, 11.0, last, fallback])


def test_a_number_feature_that_is_not_a_number_is_named():
    items = catalog([(1, ["A"], 1.0), (2, ["B"], 2.0)])
    table = feature_popularity.table(FeatureSpace.from_items(items, use_item_id=False), np.array([1.0, 2.0]))
    new = pa.table({"item_id": [3, 4], "genres": [["A"], ["B"]], "length": ["2.5", "long"]})
    with pytest.raises(UserError, match="'length' column is a number feature, but row 2 holds 'long'"):
        feature_popularity.score_new_items(table, new, FAMILIES, 1.5)
