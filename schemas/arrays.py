"""Arrow columns <-> numpy matrices: how vectors (embeddings, packed statistics) travel in tables.

A d-vector per row is a `list<double>` column in stored tables.

Privacy: conversions only.
"""

from __future__ import annotations

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from schemas.errors import UserError


def list_column_to_matrix(column: pa.Array | pa.ChunkedArray, width: int, what: str) -> np.ndarray:
    """A list<double> column whose lists all have `width` entries, as an (n, width) float64 array."""
    if isinstance(column, pa.ChunkedArray):
        column = column.combine_chunks()
    lengths = pc.list_value_length(column).to_numpy(zero_copy_only=False)
    if column.null_count or (lengths.size and np.any(lengths != width)):
        bad = int(np.flatnonzero(column.is_null().to_numpy(zero_copy_only=False) | (lengths != width))[0])
        raise UserError(
            f"{what} of row {bad} has {0 if column[bad].as_py() is None else lengths[bad]} entries, expected {width}"
        )
    return column.flatten().to_numpy(zero_copy_only=False).astype(np.float64).reshape(-1, width)


def matrix_to_list_column(matrix: np.ndarray) -> pa.ListArray:
    """An (n, width) array as a list<double> Arrow column."""
    n, width = matrix.shape
    offsets = pa.array(np.arange(n + 1, dtype=np.int32) * width)
    return pa.ListArray.from_arrays(offsets, pa.array(np.ascontiguousarray(matrix).ravel(), pa.float64()))
