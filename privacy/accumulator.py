"""The per-item sufficient statistics A_j, b_j: the one place their math lives.

For rows i of item j with user embedding u_i, label y_i and weight w_i (privacy.weights):
    A_j = sum_i w_i Clip(u_i, G_u) Clip(u_i, G_u)^T        b_j = sum_i w_i Clip(y_i, G_y) Clip(u_i, G_u)
accumulated in float64 and stored packed: the d(d+1)/2 entries of A_j's upper triangle (diagonal
included, row by row) and b_j. The accumulator follows the combiner protocol (as PipelineDP's):
`prepare_rows` (clip and weight), `grouped_sums` (a batch of rows -> partial sums per item, the
per-partition kernel), `create` / `merge` (combine partials), `finalize` (add the noise, once,
after the merge). Spark and Beam call only these.

A row enters the kernel augmented: z_i = [x_i, s_i] with x_i = sqrt(w_i) Clip(u_i) and
s_i = sqrt(w_i) Clip(y_i), so that A_j = sum x_i x_i^T and b_j = sum s_i x_i are both blocks of the
one Gram matrix sum z_i z_i^T: each row is read once, by one GEMM, for A and b together.

Privacy: with each user's weights satisfying sum w_i^2 <= wbar^2 and each (user, item) pair once,
removing a user changes (A_1..A_m) by at most wbar * G_u^2 in Frobenius norm (and the packed upper
triangle by no more) and (b_1..b_m) by at most wbar * G_y * G_u in L2 norm. `finalize` adds
N(0, (sigma G_u^2)^2) to every packed entry of A_j (Sym(N): the upper triangle i.i.d., mirrored)
and N(0, (sigma G_y G_u)^2) to every entry of b_j, with sigma = noise_multiplier * wbar: a Gaussian
mechanism with that noise multiplier for each of A and b (sums and noise on a power-of-two grid
against floating-point attacks; privacy.noise bounds what the rounding adds to the sensitivity).
It must run for every catalog item.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import lru_cache

import numpy as np
import scipy.sparse

from privacy import noise
from privacy.clipping import check_bound, clip_labels, row_scales
from schemas.errors import UserError


def packed_size(d: int) -> int:
    """Entries in the packed upper triangle of a d x d matrix."""
    return d * (d + 1) // 2


@lru_cache(maxsize=16)
def upper_indices(d: int) -> tuple[np.ndarray, np.ndarray]:
    """Row and column indices of the upper triangle, row by row (numpy's triu order)."""
    return np.triu_indices(d)


def pack_upper(a: np.ndarray) -> np.ndarray:
    """(..., d, d) symmetric matrices -> (..., d(d+1)/2) packed upper triangles."""
    rows, cols = upper_indices(a.shape[-1])
    return a[..., rows, cols]


def unpack_upper(packed: np.ndarray, d: int) -> np.ndarray:
    """(..., d(d+1)/2) packed upper triangles -> (..., d, d) symmetric matrices."""
    packed = np.asarray(packed, dtype=np.float64)
    if packed.shape[-1] != packed_size(d):
        raise UserError(f"packed A has {packed.shape[-1]} entries, expected {packed_size(d)} for d={d}")
    rows, cols = upper_indices(d)
    out = np.zeros(packed.shape[:-1] + (d, d))
    out[..., rows, cols] = packed
    out[..., cols, rows] = packed
    return out


def project_psd(a_upper: np.ndarray, d: int) -> np.ndarray:
    """Packed matrices projected onto the PSD cone (negative eigenvalues set to 0)."""
    eigenvalues, vectors = np.linalg.eigh(unpack_upper(a_upper, d))
    projected = (vectors * np.maximum(eigenvalues, 0.0)[:, None, :]) @ np.swapaxes(vectors, 1, 2)
    return pack_upper(projected)


def stable_argsort(keys: np.ndarray) -> np.ndarray:
    """np.argsort(keys, kind="stable"), faster for integer keys spanning less than 2^48: least
    significant 16 bits first, one radix pass per 16 bits (numpy radix-sorts 16-bit keys)."""
    keys = np.asarray(keys)
    if keys.dtype.kind not in "iu" or keys.size < 2:
        return np.argsort(keys, kind="stable")
    low = int(keys.min())
    span = int(keys.max()) - low
    if span >= 1 << 48:
        return np.argsort(keys, kind="stable")
    shifted = (keys - low).astype(np.uint64) if low else keys.astype(np.uint64, copy=False)
    order = np.argsort((shifted & 0xFFFF).astype(np.uint16), kind="stable")
    for shift in range(16, span.bit_length(), 16):
        order = order[np.argsort(((shifted[order] >> shift) & 0xFFFF).astype(np.uint16), kind="stable")]
    return order


def stable_order(keys: np.ndarray) -> np.ndarray:
    """`stable_argsort`'s order, by the compiled counting sort (privacy.grouped_gram.grouped_order)
    where the keys are integers over a dense range: for the callers that run the compiled kernels
    anyway (importing numba costs a process about 0.4 s, which stable_argsort's callers are spared).
    Keys already in order (a table's rows by user) are not sorted again."""
    from privacy import grouped_gram

    keys = np.asarray(keys)
    if not np.any(keys[1:] < keys[:-1]):
        return np.arange(keys.size)
    grouped = grouped_gram.grouped_order(keys)
    return grouped[0] if grouped is not None else stable_argsort(keys)


def augment(x: np.ndarray, s: np.ndarray) -> np.ndarray:
    """Kernel rows [x_i, s_i] (n x (d+1)) from vectors x (n x d) and scalars s (n): their grouped
    sums are A = sum x x^T and b = sum s x."""
    x = np.asarray(x, dtype=np.float64)
    rows = np.empty((x.shape[0], x.shape[1] + 1))
    rows[:, :-1] = x
    rows[:, -1] = s
    return rows


def _checked_weights(w: np.ndarray) -> np.ndarray:
    """Row weights as float64, refused unless finite and non-negative (they bound a user's contribution)."""
    w = np.asarray(w, dtype=np.float64)
    if w.size and (not np.all(np.isfinite(w)) or w.min() < 0):
        raise UserError("weights must be finite and non-negative")
    return w


def prepare_rows(u: np.ndarray, y: np.ndarray, w: np.ndarray, clip_u: float, clip_y: float) -> np.ndarray:
    """Clip and weight rows into kernel rows [x_i, s_i]: x_i = sqrt(w_i) Clip(u_i) and
    s_i = sqrt(w_i) Clip(y_i), so that A_j = sum x_i x_i^T and b_j = sum s_i x_i = sum w_i Clip(y_i) Clip(u_i)."""
    w = _checked_weights(w)
    u = np.asarray(u, dtype=np.float64)
    root_w = np.sqrt(w)
    rows = np.empty((u.shape[0], u.shape[1] + 1))
    np.multiply(u, (root_w * row_scales(u, clip_u))[:, None], out=rows[:, :-1])  # u_bar = scale * u, one multiplication
    np.multiply(root_w, clip_labels(y, clip_y), out=rows[:, -1])
    return rows


def grouped_sums(keys: np.ndarray, rows: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Per key, from kernel rows z_i = [x_i, s_i] (n x (d+1), see `prepare_rows` and `augment`):
    the packed sum of x x^T and the sum of s x. Returns (sorted unique keys, a_upper, b).

    Both are blocks of the key's Gram matrix sum z z^T. Rows are grouped through a stable sort of
    the keys (skipped when they are already sorted; a compiled counting sort when they are integers
    over a dense range, privacy.grouped_gram.grouped_order) and read where they lie, once, by the compiled
    kernel (privacy.grouped_gram): no per-row Python, no copy of the rows. Within a key the
    additions follow the rows' given order, so the same rows give the same bits.
    """
    keys = np.asarray(keys)
    z = np.asarray(rows, dtype=np.float64)
    if z.ndim != 2 or z.shape[1] < 2 or keys.shape != (z.shape[0],):
        raise ValueError(
            f"keys {keys.shape} and kernel rows {z.shape} do not line up (rows are [x, s]: n x (d+1), d >= 1)"
        )
    return weighted_grouped_sums(keys, z, d=z.shape[1] - 1)


def weighted_grouped_sums(
    keys: np.ndarray,
    vectors: np.ndarray,
    source: np.ndarray | None = None,
    weights: np.ndarray | None = None,
    labels: np.ndarray | None = None,
    d: int | None = None,
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Per key, sum w_i x_i x_i^T (packed) and sum w_i l_i x_i over the rows i with that key, where
    x_i = vectors[source[i], :d] (a row of a shared table: every row of a user may point to the
    user's one clipped vector; default: source[i] = i), w_i = weights[i] (default 1) and l_i = labels[i] (default: the
    column d of vectors). Returns (sorted unique keys, a_upper, b); see `grouped_sums`."""
    from privacy import grouped_gram  # numba: imported on the first sums

    keys = np.asarray(keys)
    d = np.shape(vectors)[1] - (labels is None) if d is None else d
    n = keys.size
    for name, values in (("row sources", source), ("weights", weights), ("labels", labels)):
        if values is not None and np.shape(values) != keys.shape:
            raise ValueError(f"{name} {np.shape(values)} do not match the keys {keys.shape}")
    if weights is not None:
        weights = _checked_weights(weights)
    if n == 0:
        return keys[:0], np.zeros((0, packed_size(d))), np.zeros((0, d))
    in_order = bool(np.all(keys[1:] >= keys[:-1]))
    grouped = None if in_order else grouped_gram.grouped_order(keys)
    if grouped is not None:  # integer keys over a dense range: a compiled counting sort gives the groups
        order, unique, bounds = grouped
        starts = bounds[:-1]
    else:
        order = None if in_order else stable_argsort(keys)
        sorted_keys = keys if in_order else keys[order]
        starts = np.flatnonzero(np.r_[True, sorted_keys[1:] != sorted_keys[:-1]])
        unique = sorted_keys[starts]
    if source is None:
        source = np.arange(n) if order is None else order
    elif order is not None:
        source = np.asarray(source, dtype=np.int64)[order]
    if order is not None:
        weights = None if weights is None else weights[order]
        labels = None if labels is None else np.asarray(labels, dtype=np.float64)[order]
    a, b = grouped_gram.grouped_gram(np.r_[starts, n], source, vectors, d, weights, labels)
    return unique, a, b


def reduce_by_key(keys: np.ndarray, a_upper: np.ndarray, b: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Merge partial sums that share a key: (sorted unique keys, summed a_upper, summed b).

    Rows are summed in their given order within each key (stable), so a caller that orders its
    partials deterministically gets bit-identical sums.
    """
    keys = np.asarray(keys)
    order = np.argsort(keys, kind="stable")
    keys = keys[order]
    starts = np.flatnonzero(np.r_[True, keys[1:] != keys[:-1]]) if keys.size else np.zeros(0, np.int64)
    membership = scipy.sparse.csr_matrix(
        (np.ones(keys.size), order, np.r_[starts, keys.size]), shape=(starts.size, keys.size)
    )
    return (
        keys[starts],
        membership @ np.asarray(a_upper, dtype=np.float64),
        membership @ np.asarray(b, dtype=np.float64),
    )


def create(d: int) -> tuple[np.ndarray, np.ndarray]:
    """An empty accumulator: zero packed A and zero b."""
    return np.zeros(packed_size(d)), np.zeros(d)


def merge(accumulators) -> tuple[np.ndarray, np.ndarray]:
    """Sum accumulators (pairs of packed A, b)."""
    accumulators = list(accumulators)
    return np.sum([acc[0] for acc in accumulators], axis=0), np.sum([acc[1] for acc in accumulators], axis=0)


@dataclass(frozen=True)
class NoiseSpec:
    """What `finalize` needs to noise a release: sigma = noise_multiplier * wbar, clip norms, and the
    key of the noise (the release's secret seed, privacy.seeds.SeedFile.release_seed, and its index).
    noise_multiplier 0 means no noise."""

    noise_multiplier: float
    wbar: float
    clip_u: float
    clip_y: float
    seed: bytes
    release: int

    def __post_init__(self):
        check_bound("clip_u", self.clip_u, allow_inf=self.noise_multiplier == 0)
        check_bound("clip_y", self.clip_y, allow_inf=self.noise_multiplier == 0)
        check_bound("wbar", self.wbar)
        if not np.isfinite(self.noise_multiplier) or self.noise_multiplier < 0:
            raise UserError(f"noise multiplier must be finite and >= 0, got {self.noise_multiplier}")

    @property
    def sigma(self) -> float:
        return self.noise_multiplier * self.wbar


def finalize(
    item_ids: np.ndarray, a_upper: np.ndarray, b: np.ndarray, spec: NoiseSpec, at: np.ndarray | None = None
) -> tuple[np.ndarray, np.ndarray]:
    """The released statistics of the given items (new arrays): their merged sums plus the
    release's keyed Gaussian noise, which every item gets, both on the noise's grid
    (`privacy.noise.add_noise`: the sums rounded to a power-of-two grid, the noise drawn on it).

    `a_upper` and `b` hold one row per item, or, with `at`, the sums of the items at positions
    `at` of `item_ids` only (items with rows; the others' sums are zero). The noise is drawn, scaled,
    rounded and summed a chunk of items at a time (`privacy.noise.released_blocks`).
    """
    a_upper = np.asarray(a_upper, dtype=np.float64)
    b = np.asarray(b, dtype=np.float64)
    item_ids = np.asarray(item_ids)
    rows = np.arange(item_ids.size) if at is None else np.asarray(at)
    if not (
        item_ids.ndim == 1
        and a_upper.ndim == b.ndim == 2
        and a_upper.shape[0] == b.shape[0] == rows.size
        and (rows.size == 0 or (rows.min() >= 0 and rows.max() < item_ids.size and np.all(rows[1:] > rows[:-1])))
    ):
        raise ValueError(
            f"finalize needs one row of sums per item, or per distinct position `at`: {item_ids.shape} ids, "
            f"{a_upper.shape[0]} A rows, {b.shape[0]} b rows, {rows.size} positions"
        )
    full = rows.size == item_ids.size  # increasing positions, as many as items: every item, in order
    positions = None if full else rows
    if spec.sigma == 0:  # no noise (clip norms may then be infinite): the sums as they are
        noised_a, noised_b = np.zeros((item_ids.size, a_upper.shape[1])), np.zeros((item_ids.size, b.shape[1]))
        noise.add_noise(noised_a, 0.0, a_upper, positions)
        noise.add_noise(noised_b, 0.0, b, positions)
        return noised_a, noised_b
    std_a, std_b = spec.sigma * spec.clip_u**2, spec.sigma * spec.clip_y * spec.clip_u
    noised_a, noised_b = noise.released_blocks(
        spec.seed, spec.release, item_ids, (a_upper, b), (std_a, std_b), positions
    )
    return noised_a, noised_b
