"""privacy.noise: N(0, 1) noise that is a pure function of (seed, release, item id)."""

from __future__ import annotations

import numpy as np
import pytest

from privacy.noise import SEED_BYTES, release_key, standard_normal, standard_normal_blocks

SEED = bytes(range(SEED_BYTES))
OTHER_SEED = bytes(range(1, SEED_BYTES + 1))


def test_seed_bytes_is_32():
    assert SEED_BYTES == 32


def test_shape_and_dtype():
    z = standard_normal(SEED, 0, np.array([1, 2, 3]), 5)
    assert z.shape == (3, 5)
    assert z.dtype == np.float64
    assert standard_normal(SEED, 0, np.array([], dtype=np.int64), 5).shape == (0, 5)


def test_deterministic():
    a = standard_normal(SEED, 3, np.array([7, 11]), 6)
    b = standard_normal(bytes(SEED), 3, [7, 11], 6)
    assert np.array_equal(a, b)


def test_different_release_item_or_seed_gives_different_noise():
    base = standard_normal(SEED, 0, [7], 16)[0]
    others = [
        standard_normal(SEED, 1, [7], 16)[0],
        standard_normal(SEED, 0, [8], 16)[0],
        standard_normal(SEED, 0, [-7], 16)[0],
        standard_normal(OTHER_SEED, 0, [7], 16)[0],
        standard_normal(SEED[:-1] + bytes([SEED[-1] ^ 1]), 0, [7], 16)[0],
    ]
    for other in others:
        assert not np.any(other == base)  # continuous draws: no entry coincides
    # release and item are not interchangeable
    assert not np.array_equal(standard_normal(SEED, 1, [2], 4), standard_normal(SEED, 2, [1], 4))


def test_every_item_in_a_batch_gets_its_own_noise():
    z = standard_normal(SEED, 0, np.arange(50), 3)
    assert len({tuple(row) for row in z.tolist()}) == 50


def test_independent_of_batch_composition_and_order():
    alone = standard_normal(SEED, 2, [7], 10)[0]
    for batch in ([3, 7, 9], [9, 7], [7, 7, 1], list(range(20))[::-1]):
        z = standard_normal(SEED, 2, np.array(batch), 10)
        for row, item in enumerate(batch):
            if item == 7:
                assert np.array_equal(z[row], alone)


def test_large_and_negative_item_ids():
    ids = np.array([2**62, -(2**62), -1, 0], dtype=np.int64)
    z = standard_normal(SEED, 0, ids, 4)
    assert len({tuple(row) for row in z.tolist()}) == 4
    assert np.array_equal(z[2], standard_normal(SEED, 0, [-1], 4)[0])


def test_each_item_is_its_own_philox_stream():
    # the documented construction: Philox keyed by the release key, counter starting at (0, 0, id, 0)
    key = release_key(SEED, 5)
    ids = np.array([0, 3, -2, 2**40])
    got = standard_normal(SEED, 5, ids, 9)
    for row, item in enumerate(ids.tolist()):
        counter = np.array([0, 0, item % 2**64, 0], dtype=np.uint64)
        want = np.random.Generator(np.random.Philox(counter=counter, key=key)).standard_normal(9)
        np.testing.assert_array_equal(got[row], want)


def test_prefix_property():
    long = standard_normal(SEED, 5, [1, 2, 3], 40)
    for k in (1, 3, 10, 39):
        assert np.array_equal(standard_normal(SEED, 5, [1, 2, 3], k), long[:, :k])


def test_blocks_are_the_single_draw_cut_by_columns():
    whole = standard_normal(SEED, 2, [4, 9, -3], 2080 + 64)
    a, b = standard_normal_blocks(SEED, 2, [4, 9, -3], (2080, 64))
    assert np.array_equal(a, whole[:, :2080]) and np.array_equal(b, whole[:, 2080:])
    assert a.flags.c_contiguous and b.flags.c_contiguous


def test_empirical_mean_and_std():
    z = standard_normal(SEED, 0, np.arange(20_000), 5)
    n = z.size  # 100k draws: std error of the mean ~0.003, of the std ~0.0022
    assert abs(z.mean()) < 5 / np.sqrt(n)
    assert abs(z.std() - 1.0) < 5 / np.sqrt(2 * n)
    # per coordinate across items too (each column is one position of every item's stream)
    assert np.all(np.abs(z.mean(axis=0)) < 5 / np.sqrt(z.shape[0]))
    assert np.all(np.abs(z.std(axis=0) - 1) < 5 / np.sqrt(2 * z.shape[0]))
    # no visible correlation between positions of one stream, nor between neighbouring items
    corr = np.corrcoef(z, rowvar=False)
    assert np.max(np.abs(corr - np.eye(5))) < 5 / np.sqrt(z.shape[0])
    assert abs(np.corrcoef(z[:-1, 0], z[1:, 0])[0, 1]) < 5 / np.sqrt(z.shape[0])
    # tails look Gaussian: P(|z| > 2) = 0.0455
    assert abs(np.mean(np.abs(z) > 2) - 0.0455) < 0.004


@pytest.mark.parametrize("seed", [b"", b"x" * 16, b"x" * 31, b"x" * 33, b"x" * 64])
def test_bad_seed_length_raises(seed):
    with pytest.raises(ValueError, match="32 bytes"):
        standard_normal(seed, 0, [1], 3)


def test_negative_release_raises():
    with pytest.raises(ValueError, match="release"):
        standard_normal(SEED, -1, [1], 3)
