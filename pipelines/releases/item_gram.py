"""The DP item Gram: G = sum_u x_u x_u^T over the K most popular items (by DP count), x_u user u's
indicator row over the items it interacted with among them, scaled to unit norm.

G is the most a second-moment release can carry at the user level with one unit of sensitivity:
removing a user changes G by x_u x_u^T, whose packed upper triangle has L2 norm at most
||x_u||^2 = 1, so one Gaussian release of the "item_gram" noise multiplier z (std z on every packed
entry, every pair of the K items, whether anyone interacted with it or not) is (z, 1)-Gaussian. Its
principal directions above the noise carry the users' taste: `principal_directions` keeps those whose
released eigenvalue stands clearly above the noise's spectral norm, about 2 z sqrt(K) (public), and
gives them as item embeddings, a model on its own (`--item-update gram`) or a start for the item update.
A run that also trains from statistics releases it in two halves: the second (`item_gram_more`, fresh
noise, `pooled` with the first) only when the first detects directions beyond the leading one, else
that share goes to the statistics (pipelines.training.prepare.released_item_gram).

The exact sums are `item_gram_sums` of chunks of complete users, run by the run's engine (local,
Spark, Beam: pipelines.engines.engine); this module adds the noise and writes the release.

Privacy: reads private interactions (through the engine) and releases one noised K x K matrix, K and
its items chosen from the DP counts, through the ledger; the directions are post-processing.
"""

from __future__ import annotations

import numpy as np
import pyarrow as pa
from scipy import sparse

from pipelines.base import logs
from pipelines.releases import release
from privacy import accounting
from privacy.accumulator import pack_upper, packed_size, unpack_upper
from privacy.noise import add_noise, standard_normal
from schemas import storage
from schemas.errors import UserError

RELEASE = "item_gram"
# a direction is kept when its released eigenvalue is this far above the noise's edge: in the spiked
# model, more than half of its energy on the true direction (principal_directions)
KEEP_ABOVE = 3 / (2 * np.sqrt(2))
SCHEMA = pa.schema([("item_id", pa.int64()), ("row", pa.list_(pa.float64()))])


def item_gram_sums(users: np.ndarray, item_ids: np.ndarray, items: np.ndarray) -> np.ndarray:
    """The packed upper triangle of sum_u x_u x_u^T over the sorted `items`, for rows (users,
    item_ids) that hold every row of each of their users: x_u is 1 / sqrt(n_u) on the n_u distinct
    items of `items` user u has (repeats count once), zero elsewhere."""
    column = np.searchsorted(items, item_ids)
    inside = (column < items.size) & (items[np.minimum(column, items.size - 1)] == item_ids)
    pairs = np.unique(np.stack([np.asarray(users, np.int64)[inside], column[inside]]), axis=1)
    if pairs.shape[1] == 0:
        return np.zeros(packed_size(items.size))
    owners, row = np.unique(pairs[0], return_inverse=True)
    per_user = np.bincount(row)
    x = sparse.csr_matrix(
        (1.0 / np.sqrt(per_user[row]), (row, pairs[1])), shape=(owners.size, items.size), dtype=np.float64
    )
    return pack_upper((x.T @ x).toarray())


def dp_item_gram(
    interactions: str, items: np.ndarray, out: str, ledger, seeds, *, engine, name: str = RELEASE
) -> np.ndarray:
    """Release the item Gram of `interactions` over the sorted catalog `items` (chosen from the DP
    counts) as the ledger's release `name` (its group's multiplier) into `<out>/<name>.parquet`;
    returns it (K x K, symmetric)."""
    items = np.asarray(items, dtype=np.int64)
    if items.size == 0 or np.any(items[1:] <= items[:-1]):
        raise UserError("the item Gram needs a non-empty, sorted list of distinct items")
    exact = engine.item_gram_sums(interactions, items)
    multiplier = ledger.multipliers[name]
    description = {"items": int(items.size), "inputs": {"interactions": seeds.digest_table(interactions)}}
    index = release.make_release(ledger, seeds, name, accounting.gaussian_event(multiplier), description)
    packed = exact
    if multiplier > 0:
        packed = add_noise(
            standard_normal(seeds.release_seed(index), index, np.array([0]), exact.size)[0], multiplier, exact
        )  # on the noise's grid; sensitivity 1
    gram = unpack_upper(packed, items.size)
    metadata = {b"noise_multiplier": repr(multiplier).encode(), b"release": str(index).encode()}
    table = pa.Table.from_arrays(
        [pa.array(items), pa.array(list(gram), type=pa.list_(pa.float64()))], schema=SCHEMA.with_metadata(metadata)
    )
    storage.write_table(table, storage.join(out, f"{name}.parquet"))
    logs.log(f"{name.replace('_', ' ')}: release {index}, {items.size} items, noise multiplier {multiplier:.4g}")
    return gram


def read_item_gram(path: str) -> tuple[np.ndarray, np.ndarray, float]:
    """(items, G, noise multiplier) of a released item Gram table."""
    table = storage.read_table(path)
    metadata = table.schema.metadata or {}
    rows = table["row"].to_pylist()
    return table["item_id"].to_numpy(), np.asarray(rows, dtype=np.float64), float(metadata[b"noise_multiplier"])


def pooled(releases: list[tuple[np.ndarray, float]]) -> tuple[np.ndarray, float]:
    """(G, z) of independent releases (G_i, z_i) of the same Gram pooled by inverse-variance weights:
    the noise of one release whose 1 / z^2 is the sum of theirs (an exact one, z 0, is itself)."""
    exact = [gram for gram, multiplier in releases if multiplier == 0]
    if exact:
        return exact[0], 0.0
    precision = sum(1.0 / multiplier**2 for _, multiplier in releases)
    return sum(gram / multiplier**2 for gram, multiplier in releases) / precision, 1.0 / np.sqrt(precision)


def noise_bound(multiplier: float, k: int) -> float:
    """About the spectral norm of the release's noise (a symmetric K x K matrix of N(0, z^2)
    entries): 2 z sqrt(K), from public quantities."""
    return 2.0 * multiplier * np.sqrt(k)


def kept_directions(gram: np.ndarray, multiplier: float, above: float = 1.0) -> int:
    """How many of the released `gram`'s eigenvalues stand above `above` times `noise_bound`: at 1
    the directions it detects (in the spiked model, each with some energy on a true one), at
    KEEP_ABOVE those `principal_directions` keeps."""
    bound = above * noise_bound(multiplier, gram.shape[0])
    return int(np.sum(np.linalg.eigvalsh(gram) > bound)) if bound > 0 else gram.shape[0]


def principal_directions(gram: np.ndarray, multiplier: float, dim: int) -> np.ndarray:
    """(K x dim) item embeddings: the at most `dim` principal directions of the released `gram`
    whose eigenvalue is above KEEP_ABOVE times `noise_bound`, each scaled by the root of its
    eigenvalue less the bound (the noise's share removed); zero columns where fewer stand above it.
    In the spiked model (a direction of strength theta plus symmetric noise of edge 2 z sqrt(K)) the
    released eigenvalue is theta + z^2 K / theta and the released direction keeps 1 - z^2 K / theta^2
    of its energy on the true one: more than half from theta = sqrt(2) z sqrt(K), where the released
    eigenvalue is 3 / (2 sqrt(2)) (about 1.06) times the edge."""
    values, vectors = np.linalg.eigh(gram)
    order = np.argsort(-values)[:dim]
    bound = noise_bound(multiplier, gram.shape[0])
    kept = order[values[order] > KEEP_ABOVE * bound] if bound > 0 else order
    embeddings = np.zeros((gram.shape[0], dim))
    embeddings[:, : kept.size] = vectors[:, kept] * np.sqrt(np.maximum(values[kept] - bound, 0.0))
    return embeddings
