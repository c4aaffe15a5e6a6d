"""Keyed Gaussian noise: a pure function of (secret run seed, release index, item id).

Each item's noise comes from its own stream of a counter-based generator: numpy Philox, keyed by a
SeedSequence of the 256-bit secret seed with spawn key (release,), its 256-bit counter starting at
(0, 0, item id, 0), so that items never share counter values (an item draws far fewer than 2^128
blocks). It does not depend on which engine, partition, task attempt or order produced the item:
re-running or retrying reproduces a release exactly, Spark and Beam give identical noise, and an
item with no rows gets the same kind of noise as any other.

Privacy: the seed is secret (drawn from the OS CSPRNG and kept in the run's private directory).
Reusing a seed and release index on different data would reveal the difference of the two
un-noised statistics exactly; `privacy.seeds` and the ledger refuse that.
"""

from __future__ import annotations

import numpy as np

SEED_BYTES = 32
_UINT64 = 1 << 64


def release_key(seed: bytes, release: int) -> np.ndarray:
    """The Philox key (2 x 64 bits) of one release: a hash of the secret seed and the release index."""
    if len(seed) != SEED_BYTES:
        raise ValueError(f"a noise seed has {SEED_BYTES} bytes, got {len(seed)}")
    if release < 0:
        raise ValueError(f"release index must be >= 0, got {release}")
    return np.random.SeedSequence(int.from_bytes(seed, "big"), spawn_key=(int(release),)).generate_state(2, np.uint64)


def standard_normal(seed: bytes, release: int, item_ids: np.ndarray, size: int) -> np.ndarray:
    """Unscaled N(0, 1) noise of shape (len(item_ids), size), row k a pure function of
    (seed, release, item_ids[k]); the first entries of a longer draw equal a shorter draw."""
    return standard_normal_blocks(seed, release, item_ids, (size,))[0]


def standard_normal_blocks(seed: bytes, release: int, item_ids: np.ndarray, sizes: tuple[int, ...]) -> list[np.ndarray]:
    """Item k's stream cut into consecutive blocks, one (len(item_ids), size) array per size: the
    same numbers as `standard_normal` with the sizes' sum, split by columns, but each block
    contiguous (the packed A noise and the b noise of a release, without a copy)."""
    item_ids = np.asarray(item_ids, dtype=np.int64)
    blocks = [np.empty((item_ids.size, size), dtype=np.float64) for size in sizes]
    bits = np.random.Philox(key=release_key(seed, release))
    generator = np.random.Generator(bits)
    state = bits.state  # counter 0, empty buffer: each item starts from here with its own counter
    counter = state["state"]["counter"]
    for row, item_id in enumerate(item_ids.tolist()):
        counter[2] = item_id % _UINT64
        bits.state = state  # cheaper than a new Philox per item; the same stream
        for block in blocks:
            generator.standard_normal(block.shape[1], out=block[row])
    return blocks
