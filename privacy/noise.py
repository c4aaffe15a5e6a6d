"""Keyed Gaussian noise: a pure function of (secret release seed, release index, item id), on a grid.

The construction (noise version 4), in brief; docs/noise.md has it in full with the reasons for each
choice, and every constant below is part of what a release means:

1. Key: HKDF-SHA256 of the release's seed (privacy.seeds.SeedFile.release_seed), info = KEY_INFO +
   the release index as 8 bytes big-endian.
2. Stream: item j's words are the AES-256-CTR keystream under that key, the counter block starting
   at (j mod 2^64) || 0, read as little-endian 64-bit words; at most MAX_VALUES values per draw.
3. Gaussians: Box-Muller on consecutive words from IEEE-exact operations only (privacy.box_muller),
   so a value is the same bits on every machine and numpy build.
4. Grid: `add_noise` releases g (rint(x / g) + rint(s z / g)), g = 2^(floor(log2 s) - GRID_BITS),
   so no bit below the grid depends on the data (the floating-point attacks of Mironov 2012);
   `sensitivity_slack` gives the rounding's growth of the sensitivity, which the accounting leaves
   out.

Each item's noise depends on nothing but (release seed, release, item id): not on the engine,
partition, task attempt, batch or order, so retries reproduce a release exactly and Spark and Beam
give identical noise.

Privacy: the seed is secret (drawn from the OS CSPRNG and kept in the run's private directory).
Reusing a seed and release index on different data would reveal the difference of the two
un-noised statistics exactly; `privacy.seeds` and the ledger refuse that.
"""

from __future__ import annotations

import math
from functools import lru_cache

import numpy as np
from cryptography.hazmat.primitives import hashes
from cryptography.hazmat.primitives.ciphers import Cipher, algorithms, modes
from cryptography.hazmat.primitives.kdf.hkdf import HKDF

from schemas.errors import UserError

SEED_BYTES = 32
NOISE_VERSION = 4  # part of every release's fingerprint: a release made with other noise is never resumed with this one
KEY_INFO = (
    b"ssp-recsys noise v4: AES-256 key of release "  # HKDF info, followed by the release index (8 bytes, big-endian)
)
GRID_BITS = 32  # the grid of a noise standard deviation s: 2^(floor(log2 s) - GRID_BITS)
MAX_VALUES = 1 << 36  # values per item and draw at most: 2^35 AES blocks of 16 bytes
_CHUNK_BYTES = 1 << 19  # keystream drawn and turned into values at a time (whole items; in the CPU's cache)


def release_key(seed: bytes, release: int) -> bytes:
    """The AES-256 key (32 bytes) of one release: HKDF-SHA256 of the secret seed, info KEY_INFO + release."""
    seed = bytes(seed)
    if len(seed) != SEED_BYTES:
        raise UserError(f"a noise seed has {SEED_BYTES} bytes, got {len(seed)}")
    release = int(release)
    if not 0 <= release < 1 << 64:
        raise UserError(f"release index must be >= 0 (and < 2^64), got {release}")
    return _release_key(seed, release)


@lru_cache(maxsize=64)
def _release_key(seed: bytes, release: int) -> bytes:
    return HKDF(algorithm=hashes.SHA256(), length=32, salt=None, info=KEY_INFO + release.to_bytes(8, "big")).derive(
        seed
    )


def _item_ids(item_ids) -> np.ndarray:
    return np.asarray(item_ids, dtype=np.int64).reshape(-1)


def keystream_words(seed: bytes, release: int, item_ids: np.ndarray, words: int) -> np.ndarray:
    """The first `words` 64-bit words (little-endian) of each item's AES-CTR stream: (len(item_ids), words) uint64."""
    ids = _item_ids(item_ids)
    out = np.empty((ids.size, words), dtype=np.uint64)
    for first, chunk in _keystream_chunks(release_key(seed, release), ids, words, _chunk_items(words)):
        out[first : first + chunk.shape[0]] = chunk
    return out


def _chunk_items(words: int) -> int:
    """Items per chunk of about _CHUNK_BYTES of keystream (whole items)."""
    return max(1, _CHUNK_BYTES // (8 * max(words, 1)))


def _keystream_chunks(key: bytes, ids: np.ndarray, words: int, step: int):
    """Yields (first, (n, words) uint64 view): items ids[first : first + n]'s first `words` words
    of keystream, `step` items at a time: AES of the counter blocks ids[k] || 0, ids[k] || 1, ...
    (module docstring, step 2), one ECB call per chunk, which is CTR's keystream by definition. The
    buffers and the cipher are made once (a new 512 KB buffer per chunk cost its page faults: 7x the
    cipher's own time); each view is overwritten by the next chunk. ECB keeps no state between
    calls of whole blocks, so one encryptor serves every chunk."""
    blocks = (words + 1) // 2
    if not (ids.size and blocks):
        return
    counters = np.empty((min(step, ids.size), blocks, 2), dtype=">u8")
    counters[:, :, 1] = np.arange(blocks, dtype=np.uint64)
    stream = np.empty(counters.nbytes + 16, dtype=np.uint8)  # update_into asks room for a block more than it writes
    encryptor = Cipher(algorithms.AES(key), modes.ECB()).encryptor()
    for first in range(0, ids.size, step):
        chunk = ids[first : first + step]
        counters[: chunk.size, :, 0] = chunk.view(np.uint64)[:, None]  # two's complement: the id modulo 2^64
        size = chunk.size * blocks * 16
        encryptor.update_into(counters[: chunk.size].reshape(-1).view(np.uint8), stream[: size + 15])
        yield first, stream[:size].view("<u8").reshape(chunk.size, 2 * blocks)[:, :words]


def _box_muller(words: np.ndarray, out: np.ndarray | None = None) -> np.ndarray:
    """Standard normal values from 64-bit words (1-d, even length): value 2k = R cos t, 2k+1 = R sin t
    of words 2k, 2k+1 (module docstring, step 3), from IEEE-exact operations and privacy.box_muller's
    tables, compiled there."""
    from privacy.box_muller import (
        box_muller,
    )  # numba: imported, and compiled or loaded from its cache, on the first draw

    words = np.ascontiguousarray(words, dtype=np.uint64)
    out = np.empty(words.shape, dtype=np.float64) if out is None else out
    box_muller(words, out)
    return out


def standard_normal(seed: bytes, release: int, item_ids: np.ndarray, size: int) -> np.ndarray:
    """Unscaled N(0, 1) noise of shape (len(item_ids), size), row k a pure function of
    (seed, release, item_ids[k]); the first entries of a longer draw equal a shorter draw."""
    return standard_normal_blocks(seed, release, item_ids, (size,))[0]


def standard_normal_blocks(seed: bytes, release: int, item_ids: np.ndarray, sizes: tuple[int, ...]) -> list[np.ndarray]:
    """Item k's stream cut into consecutive blocks, one (len(item_ids), size) array per size: the
    same numbers as `standard_normal` with the sizes' sum, split by columns, but each block
    contiguous (the packed A noise and the b noise of a release, without a copy of the whole).

    Items are drawn a chunk at a time (about _CHUNK_BYTES of keystream): the chunk's AES-CTR
    keystreams in one call, then the compiled Box-Muller over its words."""
    ids = _item_ids(item_ids)
    sizes = tuple(int(size) for size in sizes)
    words = _draw_words(sizes)
    blocks = [np.empty((ids.size, size), dtype=np.float64) for size in sizes]
    for first, values in _normal_chunks(seed, release, ids, words):
        column = 0
        for block, size in zip(blocks, sizes, strict=True):
            block[first : first + values.shape[0]] = values[:, column : column + size]
            column += size
    return blocks


def _draw_words(sizes: tuple[int, ...]) -> int:
    """The 64-bit words per item of a draw of blocks of these sizes, after checking them."""
    if min(sizes, default=0) < 0:
        raise ValueError(f"noise block sizes must be >= 0, got {sizes}")
    total = sum(sizes)
    if total > MAX_VALUES:
        raise ValueError(f"at most {MAX_VALUES} noise values per item and draw, asked for {total}")
    return 2 * ((total + 1) // 2)  # Box-Muller pairs: an odd draw drops its last pair's sine


def _normal_chunks(seed: bytes, release: int, ids: np.ndarray, words: int):
    """Yields (first, (n, words) values): the standard normal values of items ids[first : first + n],
    a chunk at a time (the chunk's keystreams in one AES call, then the compiled Box-Muller over its
    words); each view is overwritten by the next chunk."""
    step = _chunk_items(words)
    values = np.empty((min(step, ids.size), words), dtype=np.float64)
    for first, chunk in _keystream_chunks(release_key(seed, release), ids, words, step):
        count = chunk.shape[0]
        _box_muller(
            chunk.reshape(-1), values[:count].reshape(-1)
        )  # items' pairs one after another (words is even: a contiguous view)
        yield first, values[:count]


def released_blocks(
    seed: bytes,
    release: int,
    item_ids: np.ndarray,
    blocks: tuple[np.ndarray, ...],
    stds: tuple[float, ...],
    rows: np.ndarray | None = None,
) -> list[np.ndarray]:
    """The release of several blocks noised from one draw: block k is
    add_noise(standard_normal_blocks(...)[k], stds[k], blocks[k], rows), the same bits, with the
    blocks' widths as the draw's sizes; but each chunk of items is scaled, rounded to the grid and
    summed while its noise is in the cache (privacy.box_muller.on_grid), one pass instead of five
    numpy passes over the whole release. `rows`: as add_noise's (increasing positions of the items
    that have values), None for every item."""
    ids = _item_ids(item_ids)
    blocks = tuple(np.asarray(block, dtype=np.float64) for block in blocks)
    sizes = tuple(block.shape[1] for block in blocks)
    if any(float(std) == 0 for std in stds):  # no noise: add_noise's own path
        return [
            add_noise(z, std, block, rows)
            for z, std, block in zip(standard_normal_blocks(seed, release, ids, sizes), stds, blocks, strict=True)
        ]
    from privacy.box_muller import on_grid

    grids = [granularity(std) for std in stds]
    positions = np.arange(ids.size) if rows is None else np.asarray(rows, dtype=np.int64)
    if any(block.shape[0] != positions.size for block in blocks):
        raise ValueError(
            f"each block needs one row of values per item with values: {positions.size}, got "
            f"{[block.shape[0] for block in blocks]}"
        )
    words = _draw_words(sizes)
    out = [np.empty((ids.size, size), dtype=np.float64) for size in sizes]
    for first, values in _normal_chunks(seed, release, ids, words):
        count = values.shape[0]
        low, high = np.searchsorted(positions, (first, first + count))
        column = 0
        for block, std, grid, target in zip(blocks, stds, grids, out, strict=True):
            on_grid(
                values[:, column : column + block.shape[1]],
                float(std) / grid,
                grid,
                block[low:high],
                positions[low:high] - first,
                target[first : first + count],
            )
            column += block.shape[1]
    return out


def granularity(std: float) -> float:
    """The grid of noise with standard deviation std > 0: the power of two 2^(floor(log2 std) - GRID_BITS),
    in (std 2^-(GRID_BITS+1), std 2^-GRID_BITS]."""
    std = float(std)
    if not (math.isfinite(std) and std > 0):
        raise UserError(f"a noise standard deviation must be finite and > 0, got {std}")
    mantissa, exponent = math.frexp(
        std
    )  # std = mantissa 2^exponent, mantissa in [1/2, 1): floor(log2 std) = exponent - 1
    grid = math.ldexp(1.0, exponent - 1 - GRID_BITS)
    if grid < np.finfo(np.float64).tiny:
        raise UserError(f"noise standard deviation {std} is too small for its grid")
    return grid


def sensitivity_slack(std: float, coordinates: int) -> float:
    """What rounding to the grid can add to a release's L2 sensitivity: granularity(std) sqrt(coordinates)."""
    return 0.0 if std == 0 else granularity(std) * math.sqrt(coordinates)


def add_noise(z: np.ndarray, std: float, values=None, rows=None) -> np.ndarray:
    """The released values: `values` and Gaussian noise of standard deviation `std`, on the grid
    g = granularity(std) (module docstring, step 4): g (rint(values / g) + rint(std z / g)).

    `z` holds the unscaled draws (`standard_normal`, float64); it is overwritten with the released
    values and returned (the one temporary: the values on the grid). `values`: the un-noised values, z's shape;
    with `rows`, the values of z's rows `rows` only (distinct positions; other rows have value 0);
    None: all 0. std 0 means no noise: z is ignored and the values are released as they are."""
    std = float(std)
    if not (math.isfinite(std) and std >= 0):
        raise UserError(f"a noise standard deviation must be finite and >= 0, got {std}")
    if std == 0:
        z[...] = 0.0
        grid = None
    else:
        grid = granularity(std)
        z *= std / grid  # exact power-of-two scaling of std z: (std z) / g
        np.rint(z, out=z)
    if values is not None:
        values = np.asarray(values, dtype=np.float64)
        if grid is None:
            on_grid = values
        else:
            on_grid = np.divide(values, grid, out=np.empty(values.shape))  # exact: a power of two
            np.rint(on_grid, out=on_grid)
        if rows is None:
            z += on_grid
        else:
            z[rows] += on_grid
    if grid is not None:
        z *= grid
    return z
