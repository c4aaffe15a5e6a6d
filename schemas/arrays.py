"""Arrow columns <-> numpy matrices: how vectors (embeddings, packed statistics) travel in tables.

A d-vector per row is a `list<double>` column in stored tables.

Privacy: conversions only.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Iterable, Iterator
from concurrent.futures import ThreadPoolExecutor

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


def fill_by_file(
    path: str,
    fill: Callable[[slice, pa.RecordBatch], None],
    what: str,
    columns: list[str] | None = None,
    batch_size: int = 65_536,
) -> int:
    """`fill(rows, batch)` for every record batch of the table at `path`, `rows` its slice of the
    table's rows (in `storage.row_groups` order, counted from the files' footers: a file with more
    or fewer rows is refused), into arrays the caller sized from `storage.row_count`. A thread per
    core reads and fills a file at a time (Arrow's reads, numpy's copies and compiled kernels
    release the GIL): filling gigabytes of new memory is mostly the first touch of its pages, which
    threads share out. The first error in the table's order is raised. Returns the rows."""
    from schemas import storage

    groups: dict[str, list[tuple[int, int]]] = {}  # each file's (row group, rows), in order
    for file, group, rows in storage.row_groups(path):
        groups.setdefault(file, []).append((group, rows))
    files = list(groups)
    ends = np.cumsum([sum(rows for _, rows in groups[file]) for file in files], dtype=np.int64)

    def fill_file(k: int) -> None:
        start = int(ends[k - 1]) if k else 0
        batches = (
            batch
            for group, _ in groups[files[k]]
            for batch in storage.iter_row_group(files[k], group, columns, batch_size)
        )
        for part, batch in batches_in_place(batches, int(ends[k]) - start, what):
            fill(slice(start + part.start, start + part.stop), batch)

    with ThreadPoolExecutor(max_workers=max(1, min(len(files), os.cpu_count() or 1))) as pool:
        list(pool.map(fill_file, range(len(files))))  # the results in file order: the first file's error first
    return int(ends[-1]) if files else 0


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
