"""The features encoder's principal initialisation: items embedded by the DP-count-weighted principal
directions of their public feature vectors (hand-computed feature matrix, numpy eigenvectors)."""

import numpy as np
import pyarrow as pa
import pytest

from schemas.tables import items_schema
from trainer.encoder import ItemEncoder
from trainer.features import FeatureSpace

ITEMS = pa.table(
    {
        "item_id": [10, 20, 30, 40, 50],
        "title": ["a", "b", "c", "d", "e"],
        "genres": [["x", "y"], ["y"], ["x", "x", "z"], [], ["z"]],
        "year": [1990, 1990, None, 2000, 2010],
    },
    schema=items_schema({"genres": "multivalent", "year": "univalent"}),
)
# columns: genres x, y, z | year 1990, 2000, 2010 | constant (bias)
FEATURES = np.array(
    [
        [1 / 2, 1 / 2, 0, 1, 0, 0, 1],
        [0, 1, 0, 1, 0, 0, 1],
        [2 / 3, 0, 1 / 3, 0, 0, 0, 1],
        [0, 0, 0, 0, 1, 0, 1],
        [0, 0, 1, 0, 0, 1, 1],
    ]
)
WEIGHTS = np.array([10.0, 1.0, 3.0, 7.0, 2.0])


def principal_embeddings(k: int) -> np.ndarray:
    values, vectors = np.linalg.eigh(FEATURES.T @ np.diag(WEIGHTS) @ FEATURES)
    return FEATURES @ vectors[:, np.argsort(values)[::-1][:k]]


@pytest.mark.parametrize("use_item_id", [False, True])
def test_items_are_embedded_by_the_weighted_principal_directions(use_item_id):
    encoder = ItemEncoder(FeatureSpace.from_items(ITEMS, use_item_id=use_item_id), dim=2)
    assert encoder.init_principal(WEIGHTS) == 2
    embedded, expected = encoder.embed_all(), principal_embeddings(2)
    # each column is the projection on one eigenvector (its sign is arbitrary): compare column by column up to sign
    for column in range(2):
        sign = np.sign(embedded[:, column] @ expected[:, column])
        np.testing.assert_allclose(sign * embedded[:, column], expected[:, column], rtol=0, atol=1e-6)
    np.testing.assert_allclose(embedded, encoder.embed_all(shared=True), rtol=0, atol=0)  # residuals stay at zero


def test_a_heavier_item_pulls_the_first_direction_towards_its_features():
    encoder = ItemEncoder(FeatureSpace.from_items(ITEMS, use_item_id=False), dim=1)
    heavy = np.ones(5)
    heavy[3] = 1e6  # item 40: year 2000 only
    encoder.init_principal(heavy)
    embedded = np.abs(encoder.embed_all()[:, 0])
    assert embedded.argmax() == 3
    np.testing.assert_allclose(
        embedded[3], np.sqrt(2), rtol=1e-4
    )  # its own unit feature vector (2000, constant), normalised


def test_dimensions_beyond_the_features_rank_keep_random_directions_at_the_same_scale():
    encoder = ItemEncoder(FeatureSpace.from_items(ITEMS, use_item_id=False), dim=8)
    rank = encoder.init_principal(WEIGHTS)
    assert rank == np.linalg.matrix_rank(FEATURES) == 5  # five items
    embedded, expected = encoder.embed_all(), principal_embeddings(rank)
    np.testing.assert_allclose(embedded[:, :rank] @ embedded[:, :rank].T, expected @ expected.T, rtol=0, atol=1e-5)
    rms = np.sqrt(np.mean(np.square(embedded), axis=0))
    assert np.all(rms[rank:] > 0)
    np.testing.assert_allclose(rms[rank:], np.mean(rms[:rank]), rtol=1e-5)


def test_bad_uses_are_refused():
    space = FeatureSpace.from_items(ITEMS)
    with pytest.raises(ValueError, match="one finite weight >= 0 per catalog item"):
        ItemEncoder(space, dim=2).init_principal(np.ones(4))
    with pytest.raises(ValueError, match="one finite weight >= 0 per catalog item"):
        ItemEncoder(space, dim=2).init_principal(np.array([1.0, np.nan, 1.0, 1.0, 1.0]))
    with pytest.raises(ValueError, match="at least d = 3 dimensions"):
        ItemEncoder(space, dim=3, family_dim=2).init_principal(WEIGHTS)
    with pytest.raises(ValueError, match="only the features encoder"):
        ItemEncoder(space, dim=2, kind="id").init_principal(WEIGHTS)


@pytest.mark.parametrize("ids", [[30, 10, 50, 20, 40], [3 << 60, -5, 7, 2**62, 0]])
def test_index_of_gives_catalog_positions_and_refuses_an_unknown_item(ids):
    """Dense ids (a position table) and sparse ones (a binary search), in catalog order, not sorted."""
    space = FeatureSpace.from_items(ITEMS.set_column(0, "item_id", pa.array(ids, pa.int64())))
    assert space.index_of(np.array([ids[3], ids[0], ids[3], ids[4]])).tolist() == [3, 0, 3, 4]
    with pytest.raises(ValueError, match="item 99 is not in the catalog the encoder was built for"):
        space.index_of(np.array([ids[1], 99]))
