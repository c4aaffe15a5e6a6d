"""The features encoder as a linear map of the public features: its principal initialisation (items
embedded by the DP-count-weighted principal directions of their feature vectors; hand-computed feature
matrix, numpy eigenvectors) and its refit to the trained catalog (a leave-one-out ridge, checked
against refitting without each row)."""

import numpy as np
import pyarrow as pa
import pytest

from schemas.tables import items_schema
from trainer.encoder import RIDGE_GRID, ItemEncoder, loo_ridge, public_inputs
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
    with pytest.raises(ValueError, match="one finite weight >= 0 per catalog item"):
        ItemEncoder(space, dim=2).refit_shared(-WEIGHTS)
    with pytest.raises(ValueError, match="only the features encoder"):
        ItemEncoder(space, dim=2, kind="id").refit_shared(WEIGHTS)


@pytest.mark.parametrize("rows, columns", [(14, 5), (6, 11)])
def test_loo_ridge_picks_the_ridge_whose_refits_without_each_row_predict_it_best(rows, columns):
    """Both sides of the thin SVD (more rows than columns, and fewer): the ridge each row's refit
    without it predicts best, and the weighted ridge solution at that ridge."""
    rng = np.random.default_rng(rows)
    x = rng.normal(size=(rows, columns)) * (rng.random((rows, columns)) < 0.6)
    x[:, 0] = 1.0
    targets = x @ rng.normal(size=(columns, 3)) + rng.normal(size=(rows, 3))
    weights = rng.uniform(0.5, 4.0, rows)

    def fit(keep, lam):
        xw = x[keep] * weights[keep, None]
        return np.linalg.solve(xw.T @ x[keep] + lam * np.eye(columns), xw.T @ targets[keep])

    eigen = np.linalg.eigvalsh(x.T @ (weights[:, None] * x))
    mean = eigen.sum() / min(rows, columns)  # the mean of the non-zero eigenvalues
    errors = []
    for lam in RIDGE_GRID * mean:
        left_out = [np.arange(rows) != i for i in range(rows)]
        predicted = np.array([x[i] @ fit(keep, lam) for i, keep in enumerate(left_out)])
        errors.append(np.sum(weights[:, None] * (targets - predicted) ** 2))
    best = RIDGE_GRID[int(np.argmin(errors))] * mean
    linear, error = loo_ridge(x, targets, weights)
    np.testing.assert_allclose(linear, fit(np.ones(rows, bool), best), rtol=1e-8, atol=1e-10)
    assert error == pytest.approx(min(errors), rel=1e-8)


def artists_catalog(artists: np.ndarray) -> pa.Table:
    """One item per entry of `artists` (its artist's number): artists 0 and 1 play rock, the others jazz."""
    return pa.table(
        {
            "item_id": np.arange(1, artists.size + 1),
            "title": [f"t{i}" for i in range(artists.size)],
            "artist": artists,
            "genres": [["rock"] if a < 2 else ["jazz"] for a in artists],
        },
        schema=items_schema({"artist": "univalent", "genres": "multivalent"}),
    )


def test_the_refit_guesses_a_new_item_from_the_trained_items_that_share_its_features():
    """Thirty items of three artists, their trained embeddings the artist's vector plus noise (held in
    the residuals); three items no update moved, one per artist. The refit keeps every catalog
    embedding and makes the shared encoder say, of each unmoved item, close to its artist's vector."""
    rng = np.random.default_rng(3)
    artists = np.repeat([0, 1, 2], 11)
    encoder = ItemEncoder(FeatureSpace.from_items(artists_catalog(artists)), dim=4)
    unmoved = np.arange(33) % 11 == 10
    taste = rng.normal(size=(3, 4)) * 3
    trained = taste[artists] + 0.3 * rng.normal(size=(33, 4))
    before = encoder.embed_all(shared=True)
    residuals = np.where(unmoved[:, None], 0.0, trained - before)
    encoder.set_residuals(np.arange(33), residuals)
    catalog = encoder.embed_all()
    weights = rng.uniform(1.0, 50.0, 33)
    assert encoder.refit_shared(weights) == 30
    np.testing.assert_allclose(encoder.embed_all(), catalog, rtol=0, atol=1e-5)
    moved = ~unmoved
    expected = (
        public_inputs(encoder.space)[unmoved]
        @ loo_ridge(public_inputs(encoder.space)[moved], catalog[moved], weights[moved])[0]
    )
    guess = encoder.embed_all(shared=True)[unmoved]
    np.testing.assert_allclose(guess, expected, rtol=0, atol=1e-5)
    for artist in range(3):
        error, before_error = (np.linalg.norm(v[artist] - taste[artist]) for v in (guess, before[unmoved]))
        assert error < 0.25 * np.linalg.norm(taste[artist]) < before_error


def test_the_refit_fits_the_heaviest_moved_items_when_more_moved_than_it_fits():
    encoder = ItemEncoder(FeatureSpace.from_items(ITEMS), dim=2)
    encoder.set_residuals(np.arange(4), np.ones((4, 2)))  # items 10..40 moved, 50 not
    outputs = encoder.embed_all()
    assert encoder.refit_shared(WEIGHTS, most=2) == 2
    heaviest = [0, 3]  # weights 10 and 7
    x = public_inputs(encoder.space)
    expected = x @ loo_ridge(x[heaviest], outputs[heaviest], WEIGHTS[heaviest])[0]
    np.testing.assert_allclose(encoder.embed_all(shared=True), expected, rtol=0, atol=1e-5)
    np.testing.assert_allclose(encoder.embed_all(), outputs, rtol=0, atol=1e-5)


def test_the_refit_is_declined_when_the_features_guess_the_moved_items_worse_than_the_trained_encoder():
    """Thirty items whose trained residuals are noise the features cannot predict: the trained shared
    encoder's weighted error on them (the residuals' weighted norm) is below the refit's leave-one-out
    error, so the encoder is left as it is."""
    rng = np.random.default_rng(5)
    encoder = ItemEncoder(FeatureSpace.from_items(artists_catalog(np.repeat([0, 1, 2], 10))), dim=4)
    encoder.set_residuals(np.arange(30), 0.3 * rng.normal(size=(30, 4)))
    shared, catalog = encoder.embed_all(shared=True), encoder.embed_all()
    weights = rng.uniform(1.0, 50.0, 30)
    _, loo_error = loo_ridge(public_inputs(encoder.space), catalog, weights)
    assert loo_error > weights @ np.sum(np.square(catalog - shared), axis=1)
    assert encoder.refit_shared(weights) == 0
    np.testing.assert_array_equal(encoder.embed_all(shared=True), shared)
    np.testing.assert_array_equal(encoder.embed_all(), catalog)


def test_the_refit_leaves_an_encoder_no_update_moved_or_without_residuals():
    for use_item_id in (True, False):
        encoder = ItemEncoder(FeatureSpace.from_items(ITEMS, use_item_id=use_item_id), dim=2)
        before = encoder.embed_all(shared=True)
        assert encoder.refit_shared(WEIGHTS) == 0
        np.testing.assert_array_equal(encoder.embed_all(shared=True), before)


@pytest.mark.parametrize("ids", [[30, 10, 50, 20, 40], [3 << 60, -5, 7, 2**62, 0]])
def test_index_of_gives_catalog_positions_and_refuses_an_unknown_item(ids):
    """Dense ids (a position table) and sparse ones (a binary search), in catalog order, not sorted."""
    space = FeatureSpace.from_items(ITEMS.set_column(0, "item_id", pa.array(ids, pa.int64())))
    assert space.index_of(np.array([ids[3], ids[0], ids[3], ids[4]])).tolist() == [3, 0, 3, 4]
    with pytest.raises(ValueError, match="item 99 is not in the catalog the encoder was built for"):
        space.index_of(np.array([ids[1], 99]))
