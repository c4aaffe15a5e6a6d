"""The closed-form item update of DP-ALS (Chien et al. 2021; weights of Krichene et al. 2023).

With the id-only encoder every item has a free embedding, and the item update has a closed form
from the same released statistics as SSP: `v_j = (PSD(A_j) + lambda_j I)^-1 b_j`, where PSD is the
projection onto the PSD cone (post-processing) and lambda_j the same per-item ridge the SSP trainer
uses. With noise off this is plain (weighted-lambda) ALS. Items are solved in streamed batches, so
memory does not grow with the number of items.

Resamples: a step released with R > 1 (`--resamples`) holds R independently noised copies of the
same statistics, and the budget paid for all R. The closed-form solves use their mean
(`mean_table`), whose noise has 1/R of one copy's variance, not just one copy.

Privacy: reads only released statistics (post-processing).
"""

from __future__ import annotations

import numpy as np
import pyarrow as pa

from privacy.accumulator import packed_size, project_psd, unpack_upper
from schemas import storage
from schemas.arrays import list_column_to_matrix, matrix_to_list_column
from schemas.tables import STATS, stats_metadata
from trainer.features import FeatureSpace
from trainer.ssp import check_stats


def item_systems(stats_path: str, space: FeatureSpace, dim: int, ridge: float, ridge_scale: np.ndarray | None = None,
                 psd_projection: bool = True, batch_size: int = 2048, gravity: np.ndarray | None = None):
    """The per-item ridge systems of a stats table, streamed: (catalog positions, PSD(A_j) +
    lambda_j I (+ gravity), b_j) per batch of items. DP-ALS solves them as they are; DP-CMF
    (trainer.cmf) adds its public feature terms first."""
    for batch in storage.iter_batches(stats_path, batch_size=batch_size):
        positions = space.index_of(batch.column("item_id").to_numpy())
        a_upper = list_column_to_matrix(batch.column("a_upper"), packed_size(dim), "a_upper")
        if psd_projection:
            a_upper = project_psd(a_upper, dim)
        scale = ridge_scale[positions] if ridge_scale is not None else np.ones(positions.size)
        gram = unpack_upper(a_upper, dim) + (ridge * scale)[:, None, None] * np.eye(dim) + (gravity if gravity is not None else 0.0)
        yield positions, gram, list_column_to_matrix(batch.column("b"), dim, "b")


def _aligned_batches(paths: list[str], batch_size: int):
    """The tables' rows in lockstep: lists of equally long record batches, one per table."""
    iterators = [storage.iter_batches(path, batch_size=batch_size) for path in paths]
    pending = [None] * len(paths)
    while True:
        for k, iterator in enumerate(iterators):
            while pending[k] is None or pending[k].num_rows == 0:
                pending[k] = next(iterator, None)
                if pending[k] is None:
                    break
        ends = [batch is None for batch in pending]
        if all(ends):
            return
        if any(ends):
            raise ValueError(f"the stats tables {paths} have different numbers of rows")
        rows = min(batch.num_rows for batch in pending)
        yield [batch.slice(0, rows) for batch in pending]
        pending = [batch.slice(rows) for batch in pending]


def mean_table(paths: list[str], out: str, batch_size: int = 2048) -> str:
    """The item-by-item mean of a step's R stats tables (its resamples), streamed into `out`;
    returns `out`. The resamples list the same items in the same order (each engine writes every
    resample of a shard from one array of items); anything else is refused. Metadata: the first
    table's, plus `averaged_resamples` (R) and `averaged_releases` (the R release indices): the
    mean's noise standard deviation is noise_multiplier / sqrt(R) times the sensitivity."""
    metas = [stats_metadata(storage.read_schema(path)) for path in paths]
    for key in ("d", "noise_multiplier", "clip_u", "clip_y", "wbar"):
        if len({meta[key] for meta in metas}) != 1:
            raise ValueError(f"the stats tables {paths} were released with different {key}; only resamples of one release can be averaged")
    d = int(metas[0]["d"])
    schema = STATS.with_metadata({**storage.read_schema(paths[0]).metadata, b"averaged_resamples": str(len(paths)).encode(),
                                  b"averaged_releases": ",".join(str(int(meta["release"])) for meta in metas).encode()})
    with storage.TableWriter(out, schema) as writer:
        for batches in _aligned_batches(paths, batch_size):
            items = batches[0].column("item_id")
            if any(not batch.column("item_id").equals(items) for batch in batches[1:]):
                raise ValueError(f"the stats tables {paths} list their items in different orders")
            a = sum(list_column_to_matrix(batch.column("a_upper"), packed_size(d), "a_upper") for batch in batches) / len(batches)
            b = sum(list_column_to_matrix(batch.column("b"), d, "b") for batch in batches) / len(batches)
            writer.write(pa.RecordBatch.from_arrays([items, matrix_to_list_column(a), matrix_to_list_column(b)], schema=schema))
    return out


def solve_items(stats_path: str, space: FeatureSpace, dim: int, ridge: float, ridge_scale: np.ndarray | None = None,
                psd_projection: bool = True, expected: dict | None = None, batch_size: int = 2048, gravity: np.ndarray | None = None) -> np.ndarray:
    """Item embeddings (catalog order) solved from one stats table; items without a row stay 0."""
    if not np.isfinite(ridge) or ridge <= 0:
        raise ValueError(f"the item ridge must be > 0 for a closed-form solve, got {ridge}")
    check_stats(stats_path, {"d": dim, **(expected or {})})
    vectors = np.zeros((space.size, dim))
    for positions, gram, b in item_systems(stats_path, space, dim, ridge, ridge_scale, psd_projection, batch_size, gravity):
        vectors[positions] = np.linalg.solve(gram, b[..., None])[..., 0]
    return vectors
