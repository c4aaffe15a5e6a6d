"""The content digest's compiled kernels (privacy.seeds.content_digest_batches): splitmix64 mixing
of a batch's columns into one number per row, and the batch's two sums of those numbers, in one
pass each instead of numpy's pass per operation. The same wrapping uint64 arithmetic as
privacy.seeds.mix64, so the digests keep their bits. The split's keyed row hash
(pipelines.data.splits.row_uniform) absorbs its columns with `absorb_values` too, and the item
shards (pipelines.releases.stats_core.shard_of) are `mixed_modulo`. The keyed digest
(privacy.seeds.keyed_digest_batches) sums each list's PRF values with `row_pair_sums`.

Privacy: the kernels hash values they are handed; they hold no key, and the digest they serve
identifies content without resisting an adversary.
"""

from __future__ import annotations

import numba
import numpy as np

from schemas.compiled import kernel

_C1 = np.uint64(0xBF58476D1CE4E5B9)
_C2 = np.uint64(0x94D049BB133111EB)
_S30, _S27, _S31 = np.uint64(30), np.uint64(27), np.uint64(31)


def _mix(x):
    x = (x ^ (x >> _S30)) * _C1
    x = (x ^ (x >> _S27)) * _C2
    return x ^ (x >> _S31)


_mix_kernel = numba.njit(inline="always")(_mix)


def _absorb_values(row, bits, salt):
    """row <- mix(row ^ mix(bits + salt)), elementwise: a column of 64-bit values absorbed."""
    for i in range(row.size):
        row[i] = _mix_kernel(row[i] ^ _mix_kernel(bits[i] + salt))


def _absorb_hashes(row, hashes):
    """row <- mix(row ^ hashes), elementwise: a column already hashed absorbed."""
    for i in range(row.size):
        row[i] = _mix_kernel(row[i] ^ hashes[i])


def _sums(row, fold):
    """(sum of row, sum of mix(row ^ fold)), modulo 2^64."""
    total = np.uint64(0)
    folded = np.uint64(0)
    for i in range(row.size):
        total += row[i]
        folded += _mix_kernel(row[i] ^ fold)
    return total, folded


def _mixed_modulo(values, count, out):
    """out <- mix(values) mod count, elementwise."""
    for i in range(values.size):
        out[i] = _mix_kernel(values[i]) % count


def _row_pair_sums(pairs, width, out):
    """out[r] <- the sums of pairs[r * width : (r + 1) * width] (uint64 pairs), each half modulo 2^64."""
    for r in range(out.shape[0]):
        first = np.uint64(0)
        second = np.uint64(0)
        for k in range(r * width, (r + 1) * width):
            first += pairs[k, 0]
            second += pairs[k, 1]
        out[r, 0] = first
        out[r, 1] = second


absorb_values = kernel(_absorb_values)
absorb_hashes = kernel(_absorb_hashes)
sums = kernel(_sums)
mixed_modulo = kernel(_mixed_modulo)
row_pair_sums = kernel(_row_pair_sums)
