"""Arrow columns <-> numpy matrices: how vectors (embeddings, packed statistics) travel in tables.

A d-vector per row is a `list<double>` column in stored tables.

Privacy: conversions only.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from schemas.errors import UserError


def list_column_to_matrix(
    column: pa.Array | pa.ChunkedArray, width: int, what: str, out: np.ndarray | None = None
) -> np.ndarray:
    """A list<double> column whose lists all have `width` entries, as an (n, width) float64 array
    (`out` when given): one copy, filled chunk by chunk (a users' table at 10^7 rows is gigabytes)."""
    chunks = column.chunks if isinstance(column, pa.ChunkedArray) else [column]
    matrix = np.empty((len(column), width), dtype=np.float64) if out is None else out
    start = 0
    for chunk in chunks:
        lengths = pc.list_value_length(chunk).to_numpy(zero_copy_only=False)
        if chunk.null_count or (lengths.size and np.any(lengths != width)):
            bad = int(np.flatnonzero(chunk.is_null().to_numpy(zero_copy_only=False) | (lengths != width))[0])
            raise UserError(
                f"{what} of row {start + bad} has {0 if chunk[bad].as_py() is None else lengths[bad]} entries, "
                f"expected {width}"
            )
        matrix[start : start + len(chunk)] = chunk.flatten().to_numpy(zero_copy_only=False).reshape(-1, width)
        start += len(chunk)
    return matrix


def vectors_of_batches(
    batches: Iterable[pa.RecordBatch | pa.Table], rows: int, id_column: str, width: int, what: str
) -> tuple[np.ndarray, np.ndarray]:
    """(ids, vectors) of an id column and a list<double> "embedding" column read batch by batch into
    arrays of `rows` rows (the files' footers), so that no whole table is held beside them."""
    ids, vectors = np.empty(rows, np.int64), np.empty((rows, width))
    for part, batch in batches_in_place(batches, rows, what):
        ids[part] = batch.column(id_column).to_numpy()
        list_column_to_matrix(batch.column("embedding"), width, what, out=vectors[part])
    return ids, vectors


def batches_in_place(
    batches: Iterable[pa.RecordBatch | pa.Table], rows: int, what: str
) -> Iterator[tuple[slice, pa.RecordBatch | pa.Table]]:
    """Each batch with the rows it fills of arrays sized `rows` (the files' footers); refuses a
    table with more or fewer rows than that."""
    at = 0
    for batch in batches:
        if at + batch.num_rows > rows:
            raise UserError(f"{what}s: more rows than the files' footers declare ({rows})")
        yield slice(at, at + batch.num_rows), batch
        at += batch.num_rows
    if at != rows:
        raise UserError(f"{what}s: {at} rows read where the files' footers declare {rows}")


def matrix_to_list_column(matrix: np.ndarray) -> pa.ListArray:
    """An (n, width) array as a list<double> Arrow column."""
    n, width = matrix.shape
    offsets = pa.array(np.arange(n + 1, dtype=np.int32) * width)
    return pa.ListArray.from_arrays(offsets, pa.array(np.ascontiguousarray(matrix).ravel(), pa.float64()))
