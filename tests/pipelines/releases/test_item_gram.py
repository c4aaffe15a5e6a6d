"""The DP item Gram: exact sums by hand, one user's bounded contribution, the release's noise and
ledger entry, neighbouring data through the release, and the directions kept above the noise."""

import numpy as np
import pyarrow as pa
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from pipelines.engines.local import LocalEngine
from pipelines.releases.item_gram import (
    KEEP_ABOVE,
    dp_item_gram,
    item_gram_sums,
    kept_directions,
    noise_bound,
    pooled,
    principal_directions,
    read_item_gram,
)
from privacy.accumulator import pack_upper
from privacy.ledger import Ledger
from privacy.seeds import SeedFile
from schemas import storage
from schemas.errors import UserError


def test_the_sums_by_hand():
    """User 1 has items 10 (twice), 20 and 99 (outside the list): x = (1/sqrt 2, 1/sqrt 2, 0); user 2
    has 20: x = (0, 1, 0); user 3 only 99: nothing."""
    users = np.array([1, 1, 1, 1, 2, 3])
    items = np.array([10, 10, 20, 99, 20, 99])
    packed = item_gram_sums(users, items, np.array([10, 20, 30]))
    np.testing.assert_allclose(packed, [0.5, 0.5, 0.0, 1.5, 0.0, 0.0])  # rows of the upper triangle in turn
    assert item_gram_sums(np.array([3]), np.array([99]), np.array([10, 20])).tolist() == [0.0, 0.0, 0.0]


@settings(max_examples=60, deadline=None)
@given(st.lists(st.integers(0, 12), min_size=1, max_size=30), st.lists(st.integers(0, 5), min_size=1, max_size=20))
def test_removing_a_user_moves_the_packed_gram_by_at_most_one(mine, others):
    """The release's sensitivity: whatever one user has (repeats, items outside the list), the packed
    upper triangle moves by at most 1 in L2 norm when it is removed, exactly 1 with a single item."""
    items = np.arange(0, 10)
    users = np.r_[np.zeros(len(mine), np.int64), 1 + np.arange(len(others)) % 4]
    rated = np.r_[mine, others]
    move = item_gram_sums(users, rated, items) - item_gram_sums(users[len(mine) :], rated[len(mine) :], items)
    inside = np.unique([i for i in mine if i < 10])
    assert np.linalg.norm(move) <= 1.0 + 1e-12
    if inside.size == 1:
        assert np.linalg.norm(move) == pytest.approx(1.0)
    if inside.size == 0:
        assert not move.any()


def _log(path, users, items):
    storage.write_table(
        pa.table({"user_id": np.asarray(users, np.int64), "item_id": np.asarray(items, np.int64)}), str(path)
    )
    return str(path)


def _release(folder, log, items, multiplier, seed):
    ledger = Ledger.create(str(folder / "ledger.parquet"), float("inf"), 1e-5, multipliers={"item_gram": multiplier})
    seeds = SeedFile.create(str(folder / "seed"), seed)
    gram = dp_item_gram(log, items, str(folder / "out"), ledger, seeds, engine=LocalEngine())
    return gram, ledger


def test_without_noise_the_release_is_the_exact_gram_in_the_ledger(tmp_path):
    log = _log(tmp_path / "log.parquet", [1, 1, 2], [10, 20, 20])
    gram, ledger = _release(tmp_path, log, np.array([10, 20]), 0.0, bytes(32))
    np.testing.assert_allclose(gram, [[0.5, 0.5], [0.5, 1.5]])
    assert [row["name"] for row in Ledger.open(ledger.path).rows] == ["item_gram"]
    items, written, multiplier = read_item_gram(str(tmp_path / "out" / "item_gram.parquet"))
    assert items.tolist() == [10, 20] and multiplier == 0.0 and np.array_equal(written, gram)


def test_the_noise_is_the_multiplier_on_every_pair_even_where_no_one_interacted(tmp_path):
    """60 items no one has: the released matrix is the noise alone, std z on each packed entry."""
    log = _log(tmp_path / "log.parquet", [1], [1000])
    gram, _ = _release(tmp_path, log, np.arange(60), 2.5, bytes(range(32)))
    packed = pack_upper(gram)
    assert np.allclose(gram, gram.T) and packed.std() == pytest.approx(2.5, rel=0.05) and abs(packed.mean()) < 0.1


def test_removing_a_user_moves_the_release_by_its_own_term_only(tmp_path):
    """Neighbouring data through the release, one user's rows removed: without noise (the noise's key
    carries the inputs' fingerprint, so two inputs never share it) the released Gram moves by that
    user's x x^T alone: nothing else in the release looks at another user's rows."""
    rng = np.random.default_rng(3)
    users, rated = rng.integers(0, 40, 400), rng.integers(0, 30, 400)
    items = np.arange(0, 30, 2)
    released = []
    for name, keep in (("all", np.ones(users.size, bool)), ("without", users != 7)):
        folder = tmp_path / name
        folder.mkdir()
        log = _log(folder / "log.parquet", users[keep], rated[keep])
        released.append(_release(folder, log, items, 0.0, bytes(range(32)))[0])
    own = item_gram_sums(users[users == 7], rated[users == 7], items)
    assert np.abs(own).sum() > 0
    np.testing.assert_allclose(pack_upper(released[0] - released[1]), own, atol=1e-12)


def test_an_unsorted_item_list_is_refused_before_anything_is_released(tmp_path):
    log = _log(tmp_path / "log.parquet", [1], [10])
    with pytest.raises(UserError, match="sorted list of distinct items"):
        _release(tmp_path, log, np.array([20, 10]), 1.0, bytes(32))
    assert Ledger.open(str(tmp_path / "ledger.parquet")).rows == []


def test_the_directions_kept_are_those_above_the_noise_scaled_by_what_stands_above_it():
    """A Gram with eigenvalues 100, 30, 8.4 and 0 over 4 items at z = 2: the noise bound is 2 z sqrt(4) = 8,
    a direction is kept above 3 / (2 sqrt(2)) x 8 = 8.49 (8.4 is not), scaled by sqrt(100 - 8) and
    sqrt(30 - 8); the third column is zero. Without noise every direction up to dim is kept."""
    basis = np.linalg.qr(np.random.default_rng(0).normal(size=(4, 4)))[0]
    gram = basis @ np.diag([100.0, 30.0, 8.4, 0.0]) @ basis.T
    assert noise_bound(2.0, 4) == 8.0
    assert kept_directions(gram, 2.0) == 3 and kept_directions(gram, 0.0) == 4  # detected: above the bound
    assert kept_directions(gram, 2.0, KEEP_ABOVE) == 2  # kept: what principal_directions embeds
    embeddings = principal_directions(gram, 2.0, 3)
    assert not embeddings[:, 2].any()
    np.testing.assert_allclose(np.abs(embeddings[:, :2]), np.abs(basis[:, :2] * np.sqrt([92.0, 22.0])), atol=1e-9)
    exact = principal_directions(gram, 0.0, 3)
    np.testing.assert_allclose(np.abs(exact), np.abs(basis[:, :3] * np.sqrt([100.0, 30.0, 8.4])), atol=1e-9)


def test_two_releases_pool_by_inverse_variance():
    """z 1 and z 2: weights 1 and 1/4, so 2 and 5 pool to (2 + 5/4) / (5/4) = 2.6 at z = 1 / sqrt(5/4);
    an exact release (z 0) is itself."""
    gram, multiplier = pooled([(np.full((2, 2), 2.0), 1.0), (np.full((2, 2), 5.0), 2.0)])
    np.testing.assert_allclose(gram, np.full((2, 2), 2.6))
    assert multiplier == pytest.approx(1 / np.sqrt(1.25))
    exact, zero = pooled([(np.ones((2, 2)), 0.0), (np.zeros((2, 2)), 1.0)])
    assert zero == 0.0 and np.array_equal(exact, np.ones((2, 2)))
