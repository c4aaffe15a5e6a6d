"""Vectors in Arrow columns: list<double> columns round-trip exactly and refuse bad rows."""

import numpy as np
import pyarrow as pa
import pytest

from schemas.arrays import list_column_to_matrix, matrix_to_list_column, vectors_of_batches


def test_round_trips_are_exact():
    m = np.array([[1.5, -2.0, 3.25], [0.0, 1e-300, -7.0]])
    np.testing.assert_array_equal(list_column_to_matrix(matrix_to_list_column(m), 3, "v"), m)
    assert matrix_to_list_column(m).to_pylist() == m.tolist()
    sliced = matrix_to_list_column(np.arange(12.0).reshape(4, 3)).slice(1, 2)  # offsets not at 0
    np.testing.assert_array_equal(list_column_to_matrix(sliced, 3, "v"), np.arange(3.0, 9.0).reshape(2, 3))


def test_bad_rows_are_named():
    with pytest.raises(ValueError, match="embedding of row 1 has 1 entries, expected 2"):
        list_column_to_matrix(pa.array([[1.0, 2.0], [3.0]]), 2, "embedding")
    with pytest.raises(ValueError, match="embedding of row 0 has 0 entries, expected 2"):
        list_column_to_matrix(pa.array([None, [3.0, 4.0]], pa.list_(pa.float64())), 2, "embedding")


def test_a_chunked_column_fills_one_matrix_and_names_rows_across_chunks():
    first, second = np.arange(6.0).reshape(2, 3), np.arange(6.0, 15.0).reshape(3, 3)
    chunked = pa.chunked_array([matrix_to_list_column(first), matrix_to_list_column(second).slice(1, 2)])
    matrix = list_column_to_matrix(chunked, 3, "v")
    np.testing.assert_array_equal(matrix, np.vstack([first, second[1:]]))
    assert matrix.flags.writeable and matrix.flags.c_contiguous
    floats = pa.chunked_array(
        [pa.array([[1.5, 2.5]], pa.list_(pa.float32())), pa.array([[3.0]], pa.list_(pa.float32()))]
    )
    with pytest.raises(ValueError, match="embedding of row 1 has 1 entries, expected 2"):
        list_column_to_matrix(floats, 2, "embedding")
    np.testing.assert_array_equal(list_column_to_matrix(floats.chunk(0), 2, "v"), [[1.5, 2.5]])


def test_vectors_of_batches_fill_arrays_sized_from_the_footers_and_refuse_other_counts():
    batches = [
        pa.record_batch({"user_id": [5, 3], "embedding": matrix_to_list_column(np.array([[1.0, 2.0], [3.0, 4.0]]))}),
        pa.record_batch({"user_id": [9], "embedding": matrix_to_list_column(np.array([[5.0, 6.0]]))}),
    ]
    ids, vectors = vectors_of_batches(batches, 3, "user_id", 2, "user embedding")
    np.testing.assert_array_equal(ids, [5, 3, 9])
    np.testing.assert_array_equal(vectors, [[1.0, 2.0], [3.0, 4.0], [5.0, 6.0]])
    with pytest.raises(ValueError, match="more rows than the files' footers declare"):
        vectors_of_batches(batches, 2, "user_id", 2, "user embedding")
    with pytest.raises(ValueError, match="3 rows read where the files' footers declare 4"):
        vectors_of_batches(batches, 4, "user_id", 2, "user embedding")


def test_a_table_is_filled_file_by_file_in_threads_each_row_in_its_place_and_the_first_error_in_table_order(
    tmp_path,
):
    from schemas import storage
    from schemas.arrays import fill_by_file

    path = str(tmp_path / "rows.parquet")
    ids = np.random.default_rng(3).permutation(1000)[:700]
    with storage.TableWriter(path, pa.schema([("id", pa.int64())]), rows_per_file=150) as writer:
        for start in range(0, 700, 40):  # row groups of at most 40 rows, in 5 files
            writer.write(pa.table({"id": ids[start : start + 40]}))
    assert len(storage.table_files(path)) == 5 and len(storage.row_groups(path)) > 5
    filled = np.full(700, -1)

    def fill(part, batch):
        filled[part] = batch.column("id").to_numpy()

    assert fill_by_file(path, fill, "row", batch_size=16) == 700
    np.testing.assert_array_equal(filled, ids)  # every row where the table's order puts it

    def refuse(part, batch):  # rows 160 and 600 (files 1 and 4) are bad: the first one is named
        bad = [row for row in (160, 600) if part.start <= row < part.stop]
        if bad:
            raise ValueError(f"row {bad[0]} is bad")

    for _ in range(5):
        with pytest.raises(ValueError, match="row 160 is bad"):
            fill_by_file(path, refuse, "row", batch_size=16)
