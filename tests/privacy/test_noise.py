"""privacy.noise: N(0, 1) noise that is a pure function of (seed, release, item id), from HKDF-SHA256
and AES-CTR, and its release on a power-of-two grid (floating-point attacks)."""

from __future__ import annotations

import hashlib
import math
import os
import subprocess
import sys
from fractions import Fraction
from pathlib import Path

import numpy as np
import pytest
from cryptography.hazmat.primitives import hashes
from cryptography.hazmat.primitives.ciphers import Cipher, algorithms, modes
from cryptography.hazmat.primitives.kdf.hkdf import HKDF

from privacy import box_muller, noise
from privacy.noise import (
    GRID_BITS,
    MAX_VALUES,
    SEED_BYTES,
    add_noise,
    granularity,
    keystream_words,
    release_key,
    released_blocks,
    sensitivity_slack,
    standard_normal,
    standard_normal_blocks,
)

SEED = bytes(range(SEED_BYTES))
OTHER_SEED = bytes(range(1, SEED_BYTES + 1))
ROOT = Path(__file__).resolve().parents[2]


def test_seed_bytes_is_32():
    assert SEED_BYTES == 32


def test_shape_and_dtype():
    z = standard_normal(SEED, 0, np.array([1, 2, 3]), 5)
    assert z.shape == (3, 5)
    assert z.dtype == np.float64
    assert standard_normal(SEED, 0, np.array([], dtype=np.int64), 5).shape == (0, 5)
    assert standard_normal(SEED, 0, [1, 2], 0).shape == (2, 0)


def test_deterministic():
    a = standard_normal(SEED, 3, np.array([7, 11]), 6)
    b = standard_normal(bytearray(SEED), np.int64(3), [7, 11], 6)
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
    # every release has its own key
    assert len({release_key(SEED, r) for r in range(50)}) == 50


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


def test_batches_across_chunks_equal_single_items(monkeypatch):
    # many items per call are drawn a chunk of items at a time: no item's values may depend on
    # where those cuts fall
    ids = np.arange(-40, 160, 3)
    singles = np.concatenate([standard_normal(SEED, 4, [item], 37) for item in ids.tolist()])
    assert np.array_equal(standard_normal(SEED, 4, ids, 37), singles)
    monkeypatch.setattr(noise, "_CHUNK_BYTES", 700)  # two items a chunk
    assert np.array_equal(standard_normal(SEED, 4, ids, 37), singles)


def test_large_and_negative_item_ids():
    ids = np.array([2**62, -(2**62), -1, 0, 2**63 - 1, -(2**63)], dtype=np.int64)
    z = standard_normal(SEED, 0, ids, 4)
    assert len({tuple(row) for row in z.tolist()}) == ids.size
    assert np.array_equal(z[2], standard_normal(SEED, 0, [-1], 4)[0])


# ---------------------------------------------------------------------------------------------
# The documented construction, recomputed by hand


def by_hand_words(seed: bytes, release: int, item: int, words: int) -> list[int]:
    """HKDF-SHA256 key, AES-256 in CTR mode from the counter block item mod 2^64 || 0^8 (big-endian), as the module
    docstring says."""
    key = HKDF(
        algorithm=hashes.SHA256(),
        length=32,
        salt=None,
        info=b"ssp-recsys noise v4: AES-256 key of release " + release.to_bytes(8, "big"),
    ).derive(seed)
    counter = (item % 2**64).to_bytes(8, "big") + bytes(8)
    stream = Cipher(algorithms.AES(key), modes.CTR(counter)).encryptor().update(bytes(8 * words))
    return [int.from_bytes(stream[8 * k : 8 * k + 8], "little") for k in range(words)]


def by_hand_box_muller(w_radius: int, w_angle: int) -> tuple[float, float]:
    """R cos t, R sin t with u = (w + 1/2) / 2^64 (rounded once, below 1), t = 2 pi w' / 2^64, via math."""
    u = min(float(Fraction(2 * w_radius + 1, 2**65)), 1 - 2.0**-53)
    r = math.sqrt(-2.0 * math.log(u))
    turn = Fraction(w_angle, 2**64)
    turn -= round(turn)  # in [-1/2, 1/2]: the angle's reduction exact, one rounding below
    t = 2 * math.pi * float(turn)
    return r * math.cos(t), r * math.sin(t)


def test_release_key_is_hkdf_sha256_of_the_seed():
    for release in (0, 1, 5, 2**40):
        want = HKDF(
            algorithm=hashes.SHA256(), length=32, salt=None, info=noise.KEY_INFO + release.to_bytes(8, "big")
        ).derive(SEED)
        assert release_key(SEED, release) == want
    assert noise.KEY_INFO == b"ssp-recsys noise v4: AES-256 key of release "


def test_keystream_is_aes_ctr_with_the_item_id_in_the_counter():
    ids = [0, 3, -2, 2**40, -(2**63)]
    got = keystream_words(SEED, 5, np.array(ids), 11)
    assert got.dtype == np.uint64 and got.shape == (5, 11)
    for row, item in enumerate(ids):
        assert got[row].tolist() == by_hand_words(SEED, 5, item, 11)


def test_values_are_box_muller_of_the_keystream():
    ids = [0, 3, -2, 2**40]
    got = standard_normal(SEED, 5, np.array(ids), 9)  # odd: the fifth pair's sine is dropped
    for row, item in enumerate(ids):
        words = by_hand_words(SEED, 5, item, 10)
        want = [v for k in range(5) for v in by_hand_box_muller(words[2 * k], words[2 * k + 1])][:9]
        # math's log, cos and sin against the module's own: a few units in the last place of R
        np.testing.assert_allclose(got[row], want, rtol=0, atol=1e-14)


@pytest.mark.parametrize("w_radius", [0, 1, 2**11, 2**53 - 1, 2**53, 2**63, 2**64 - 2**11, 2**64 - 2**10, 2**64 - 1])
@pytest.mark.parametrize("w_angle", [0, 1, 2**53, 2**54 - 1, 2**62, 2**63, 3 * 2**62 + 12345, 2**64 - 1])
def test_box_muller_at_extreme_words(w_radius, w_angle):
    z = noise._box_muller(np.array([w_radius, w_angle], dtype=np.uint64))
    want = by_hand_box_muller(w_radius, w_angle)
    assert np.all(np.isfinite(z)) and np.all(np.abs(z) <= math.sqrt(130 * math.log(2)))  # u >= 2^-65: R <= 9.5
    assert math.hypot(*z) > 1e-8  # u <= 1 - 2^-53
    np.testing.assert_allclose(z, want, rtol=0, atol=1e-14)


def test_tables_agree_with_math():
    # the tables are built at import from Taylor series with exact operations (no libm, whose last
    # bits may vary): within a few units in the last place of math's values (whose angle t is
    # itself rounded, by up to 2^-51)
    size = box_muller._TURN_COS.size
    for j in range(0, size, 7):
        t = 2 * math.pi * (j + 0.5) / size
        assert (
            abs(box_muller._TURN_COS[j] - math.cos(t)) <= 2.0**-50
            and abs(box_muller._TURN_SIN[j] - math.sin(t)) <= 2.0**-50
        )
    half = box_muller._LOG_CENTRE.size // 2
    for i in range(half, 2 * half, 5):
        c = box_muller._LOG_CENTRE[i]
        assert abs(box_muller._MINUS_TWO_LOG_CENTRE[i] + 2 * math.log(c)) <= 4 * math.ulp(2 * math.log(c)) + 1e-300


def test_values_are_pinned_bit_for_bit():
    # the exact bits of a release: a change of the construction, or arithmetic that rounds
    # differently on some machine or numpy build, changes them (and would break retries)
    z = standard_normal(SEED, 5, [0, 1, -1, 2**40], 64).astype("<f8")
    assert hashlib.sha256(z.tobytes()).hexdigest() == PINNED_SHA256


PINNED_SHA256 = "ded6608dfcf11f93e48732fa4956a530edb3c4eb077d3dcbdfcecb2afd195ec9"


def test_same_bits_without_the_cpus_vector_instructions():
    # numpy picks SIMD code by CPU at import (its own log differs in the last bit with AVX-512);
    # the noise must not: recompute in a process whose numpy may use none of them
    code = (
        "import hashlib, numpy as np; from privacy.noise import standard_normal; "
        "print(hashlib.sha256(standard_normal(bytes(range(32)), 5, np.arange(-50, 50), "
        "301).astype('<f8').tobytes()).hexdigest())"
    )
    env = dict(
        os.environ,
        NPY_DISABLE_CPU_FEATURES=(
            "AVX512F AVX512CD AVX512_SKX AVX512_CLX AVX512_CNL AVX512_ICL AVX512_SPR AVX2 FMA3 F16C AVX"
        ),
        PYTHONPATH=os.pathsep.join(p for p in (str(ROOT), os.environ.get("PYTHONPATH")) if p),
    )
    done = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120)
    if done.returncode != 0 and "environment variable: 'NPY_DISABLE_CPU_FEATURES'" in done.stderr:  # numpy's refusal
        pytest.skip(f"numpy refused NPY_DISABLE_CPU_FEATURES here: {done.stderr.strip()[-200:]}")
    assert done.returncode == 0, done.stderr[-2000:]  # any other failure of the child is this test's
    here = hashlib.sha256(standard_normal(SEED, 5, np.arange(-50, 50), 301).astype("<f8").tobytes()).hexdigest()
    assert done.stdout.strip() == here


def test_prefix_property():
    long = standard_normal(SEED, 5, [1, 2, 3], 40)
    for k in (1, 2, 3, 10, 39):
        assert np.array_equal(standard_normal(SEED, 5, [1, 2, 3], k), long[:, :k])


@pytest.mark.parametrize("sizes", [(2080, 64), (5, 3), (1, 1, 1), (0, 7), (3, 0)])
def test_blocks_are_the_single_draw_cut_by_columns(sizes):
    whole = standard_normal(SEED, 2, [4, 9, -3], sum(sizes))
    blocks = standard_normal_blocks(SEED, 2, [4, 9, -3], sizes)
    column = 0
    for block, size in zip(blocks, sizes, strict=True):
        assert block.shape == (3, size) and block.flags.c_contiguous
        assert np.array_equal(block, whole[:, column : column + size])
        column += size


# ---------------------------------------------------------------------------------------------
# Distribution (fixed seeds: these numbers never change, so the bounds cannot flake; they are
# also at least 5 standard errors wide)


def test_empirical_moments():
    z = standard_normal(SEED, 0, np.arange(20_000), 5)
    n = z.size  # 100k draws: std error of the mean ~0.003, of the std ~0.0022
    assert abs(z.mean()) < 5 / np.sqrt(n)
    assert abs(z.std() - 1.0) < 5 / np.sqrt(2 * n)
    centred = z - z.mean()
    skew = np.mean(centred**3) / z.std() ** 3
    excess_kurtosis = np.mean(centred**4) / z.var() ** 2 - 3.0
    assert abs(skew) < 5 * np.sqrt(6 / n)
    assert abs(excess_kurtosis) < 5 * np.sqrt(24 / n)
    # per coordinate across items too (each column is one position of every item's stream)
    assert np.all(np.abs(z.mean(axis=0)) < 5 / np.sqrt(z.shape[0]))
    assert np.all(np.abs(z.std(axis=0) - 1) < 5 / np.sqrt(2 * z.shape[0]))
    # no visible correlation between positions of one stream (a Box-Muller pair's cos and sin
    # included), nor between neighbouring items
    corr = np.corrcoef(z, rowvar=False)
    assert np.max(np.abs(corr - np.eye(5))) < 5 / np.sqrt(z.shape[0])
    assert abs(np.corrcoef(z[:-1, 0], z[1:, 0])[0, 1]) < 5 / np.sqrt(z.shape[0])


def test_distribution_and_tails():
    z = standard_normal(OTHER_SEED, 7, np.arange(1000), 2000).ravel()  # 2M draws
    n = z.size
    # Kolmogorov-Smirnov distance to N(0, 1): sqrt(n) D < 1.95 at the 0.1% level
    sample = np.sort(z[::20])  # 100k
    cdf = 0.5 * (1 + np.vectorize(math.erf)(sample / math.sqrt(2)))
    steps = np.arange(1, sample.size + 1) / sample.size
    distance = max(np.max(steps - cdf), np.max(cdf - (steps - 1 / sample.size)))
    assert math.sqrt(sample.size) * distance < 1.95
    # tail masses P(|z| > k) against the Gaussian's, within 5 standard errors
    for k in (1, 2, 3, 4):
        p = math.erfc(k / math.sqrt(2))
        assert abs(np.mean(np.abs(z) > k) - p) < 5 * math.sqrt(p * (1 - p) / n), k
    assert np.abs(z).max() <= math.sqrt(130 * math.log(2))


# ---------------------------------------------------------------------------------------------
# The grid (add_noise)


def test_granularity_is_a_power_of_two_below_the_std():
    assert granularity(1.0) == 2.0**-GRID_BITS == granularity(1.9999)
    assert granularity(2.0) == 2.0 ** (1 - GRID_BITS)
    assert granularity(0.75) == 2.0 ** (-1 - GRID_BITS)
    for std in (1e-9, 0.3, 1.05, 7.0, 12345.678, 1e12):
        g = granularity(std)
        assert math.frexp(g)[0] == 0.5  # a power of two
        assert std * 2.0 ** -(GRID_BITS + 1) < g <= std * 2.0**-GRID_BITS
    for bad in (0.0, -1.0, math.inf, math.nan, 1e-300):
        with pytest.raises(ValueError):
            granularity(bad)


def test_add_noise_is_values_and_noise_rounded_to_the_grid():
    rng = np.random.default_rng(0)
    z = standard_normal(SEED, 1, np.arange(50), 40)
    x = rng.normal(scale=100.0, size=z.shape)
    std = 3.7
    g = granularity(std)
    out = add_noise(z.copy(), std, x)
    np.testing.assert_array_equal(out, g * (np.rint(x / g) + np.rint(std * z / g)))
    assert np.all(np.rint(out / g) == out / g)  # multiples of the grid
    assert np.all(np.abs(out - (x + std * z)) <= g)  # two roundings of at most half a step
    noise_only = add_noise(z.copy(), std)
    np.testing.assert_array_equal(noise_only, g * np.rint(std * z / g))


def test_add_noise_in_place_and_with_rows():
    z = standard_normal(SEED, 1, np.arange(6), 3)
    values = np.array([[1.0, 2.0, 3.0], [4.0, 5.0, 6.0]])
    target = z.copy()
    out = add_noise(target, 0.5, values, np.array([1, 4]))
    assert out is target
    full = np.zeros((6, 3))
    full[[1, 4]] = values
    np.testing.assert_array_equal(out, add_noise(z.copy(), 0.5, full))
    # scalars (the mean's two releases): one draw each
    g = granularity(2.0)
    assert add_noise(z[0, :1].copy(), 2.0, 123.456)[0] == g * (np.rint(123.456 / g) + np.rint(2.0 * z[0, 0] / g))


@pytest.mark.parametrize("rows", [None, "some"])
def test_released_blocks_are_the_draw_and_add_noise_bit_for_bit(monkeypatch, rows):
    """One pass per chunk (the compiled kernel) gives add_noise's bits for every block, across
    chunks (a small chunk size), with values for every item or for some rows only; std 0 too."""
    monkeypatch.setattr(noise, "_CHUNK_BYTES", 1 << 10)
    rng = np.random.default_rng(3)
    ids = np.array([5, -2, 7, 2**40, 0, 11, 12, 13, 90])
    positions = None if rows is None else np.array([0, 3, 4, 8])
    count = ids.size if rows is None else positions.size
    blocks = (rng.normal(scale=1e3, size=(count, 21)), rng.normal(size=(count, 6)))
    for stds in ((1.3, 0.07), (0.0, 0.0)):
        got = released_blocks(SEED, 4, ids, blocks, stds, positions)
        want = [
            add_noise(z, std, block, positions)
            for z, std, block in zip(standard_normal_blocks(SEED, 4, ids, (21, 6)), stds, blocks, strict=True)
        ]
        assert all(
            g.shape == w.shape and np.array_equal(g.view(np.uint64), w.view(np.uint64))
            for g, w in zip(got, want, strict=True)
        )
    with pytest.raises(ValueError, match="one row of values per item"):
        released_blocks(SEED, 4, ids, (blocks[0][:2], blocks[1][:2]), (1.0, 1.0), positions)


def test_add_noise_without_noise_releases_values_as_they_are():
    z = np.full((2, 3), np.nan)  # not read
    values = np.array([[0.1, -2.5, 1e-300], [3.0, 7.25, -0.0]])
    np.testing.assert_array_equal(add_noise(z, 0.0, values), values)
    np.testing.assert_array_equal(add_noise(np.ones(4), 0.0), np.zeros(4))
    for bad in (-1.0, math.nan, math.inf):
        with pytest.raises(ValueError):
            add_noise(np.ones(3), bad)


def test_the_release_does_not_depend_on_the_values_low_order_bits():
    # the floating-point attack (Mironov 2012) reads x from the low bits of x + noise: on the grid,
    # two values that round to the same grid point give bit-identical releases
    z = standard_normal(SEED, 9, np.arange(1000), 8)
    std = 1.0
    x = np.full(z.shape, 0.1)
    nudged = x + 2.0**-50  # a few units in the last place of 0.1, far below the grid step 2^-32
    np.testing.assert_array_equal(add_noise(z.copy(), std, x), add_noise(z.copy(), std, nudged))
    assert not np.array_equal(x + std * z, nudged + std * z)  # plain float addition shows the nudge


def test_sensitivity_slack():
    assert sensitivity_slack(1.0, 4) == 2.0 * 2.0**-GRID_BITS
    assert sensitivity_slack(0.0, 10**6) == 0.0
    # the stats release of 20,000 items at d = 64, noise multiplier 1: below 2e-6 of the sensitivity
    sensitivity = 1.0
    assert sensitivity_slack(1.0 * sensitivity, 20_000 * (64 * 65 // 2 + 64)) < 2e-6 * sensitivity


# ---------------------------------------------------------------------------------------------
# Refusals


@pytest.mark.parametrize("seed", [b"", b"x" * 16, b"x" * 31, b"x" * 33, b"x" * 64])
def test_bad_seed_length_raises(seed):
    with pytest.raises(ValueError, match="32 bytes"):
        standard_normal(seed, 0, [1], 3)


@pytest.mark.parametrize("release", [-1, 2**64])
def test_bad_release_raises(release):
    with pytest.raises(ValueError, match="release"):
        standard_normal(SEED, release, [1], 3)


def test_draws_beyond_a_stream_raise():
    with pytest.raises(ValueError, match="at most"):
        standard_normal_blocks(SEED, 0, [1], (MAX_VALUES, 1))
    with pytest.raises(ValueError, match=">= 0"):
        standard_normal_blocks(SEED, 0, [1], (3, -1))
