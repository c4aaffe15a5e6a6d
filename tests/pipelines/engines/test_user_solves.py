"""The user update on a real local Spark equals the closed-form ridge solve per user."""

import numpy as np
import pyarrow as pa
import pytest

from pipelines.engines import user_solves
from schemas import storage
from schemas.tables import INTERACTIONS, ITEM_EMBEDDINGS, validate_user_embeddings
from trainer.solve import ridge_solve


def test_spark_user_update_matches_closed_form(spark, tmp_path):
    rng = np.random.default_rng(3)
    users = rng.integers(1, 60, 800)
    items = rng.integers(1, 40, 800)
    pairs = np.unique(np.c_[users, items], axis=0)
    labels = rng.normal(size=len(pairs))
    storage.write_table(
        pa.table(
            {
                "user_id": pairs[:, 0],
                "item_id": pairs[:, 1],
                "label": labels,
                "timestamp": np.zeros(len(pairs), np.int64),
            },
            schema=INTERACTIONS,
        ),
        str(tmp_path / "i.parquet"),
    )
    v = rng.normal(size=(40, 3))
    storage.write_table(
        pa.table({"item_id": np.arange(1, 41), "embedding": list(v)}, schema=ITEM_EMBEDDINGS),
        str(tmp_path / "v.parquet"),
    )
    n, solve_seconds = user_solves.run(
        spark, str(tmp_path / "i.parquet"), str(tmp_path / "v.parquet"), str(tmp_path / "u.parquet"), 0.5, dim=3
    )
    assert solve_seconds > 0
    out = validate_user_embeddings(storage.read_table(str(tmp_path / "u.parquet")), dim=3).sort_by("user_id")
    keys, want = ridge_solve(pairs[:, 0], v[pairs[:, 1] - 1], labels, 0.5, scale_by_rows=True)
    assert n == keys.size == out.num_rows
    np.testing.assert_array_equal(out["user_id"].to_numpy(), keys)
    np.testing.assert_allclose(np.array(out["embedding"].to_pylist()), want, rtol=1e-10, atol=1e-12)
    # one user by hand: u = (V^T V + lambda n I)^-1 V^T y, n the user's rows
    rows = pairs[:, 0] == keys[0]
    vk = v[pairs[rows, 1] - 1]
    np.testing.assert_allclose(
        want[0], np.linalg.solve(vk.T @ vk + 0.5 * rows.sum() * np.eye(3), vk.T @ labels[rows]), rtol=1e-10
    )


def test_missing_item_embedding_and_bad_lambda(spark, tmp_path):
    storage.write_table(
        pa.table({"user_id": [1, 1], "item_id": [1, 2], "label": [1.0, 2.0], "timestamp": [0, 0]}, schema=INTERACTIONS),
        str(tmp_path / "i.parquet"),
    )
    storage.write_table(
        pa.table({"item_id": [1], "embedding": [[1.0, 0.0]]}, schema=ITEM_EMBEDDINGS), str(tmp_path / "v.parquet")
    )
    with pytest.raises(ValueError, match="no embedding for item 2"):
        user_solves.run(
            spark, str(tmp_path / "i.parquet"), str(tmp_path / "v.parquet"), str(tmp_path / "u.parquet"), 1.0
        )
    with pytest.raises(ValueError, match="--lambda-u must be > 0"):
        user_solves.run(
            spark, str(tmp_path / "i.parquet"), str(tmp_path / "v.parquet"), str(tmp_path / "u.parquet"), 0.0
        )
    assert not (tmp_path / "u.parquet").exists()


def _parts(path, tables, metadata=None):
    """A committed table of one part per table, each with `metadata` (chunks.USERS_TOGETHER or none)."""
    staged = storage.StagedWrite(path)
    staged.commit(
        [
            staged.write_part(k, table.cast(INTERACTIONS).replace_schema_metadata(metadata))
            for k, table in enumerate(tables)
        ],
        sum(table.num_rows for table in tables),
    )


def test_files_of_whole_users_are_solved_a_file_per_task_with_the_same_result(spark, tmp_path):
    """A table whose files declare whole users in order is read a file per task (no shuffle): the
    same embeddings as the shuffled path on the same rows; a declared file out of user order is
    refused, naming it, and nothing is written."""
    from pipelines.data.chunks import USERS_TOGETHER

    rng = np.random.default_rng(4)
    pairs = np.unique(np.c_[rng.integers(1, 60, 800), rng.integers(1, 40, 800)], axis=0)  # sorted by user
    rows = pa.table(
        {
            "user_id": pairs[:, 0],
            "item_id": pairs[:, 1],
            "label": rng.normal(size=len(pairs)),
            "timestamp": np.zeros(len(pairs), np.int64),
        }
    )
    low = rows.filter(pa.compute.less_equal(rows["user_id"], 30))
    high = rows.filter(pa.compute.greater(rows["user_id"], 30))
    storage.write_table(
        pa.table({"item_id": np.arange(1, 41), "embedding": list(rng.normal(size=(40, 3)))}, schema=ITEM_EMBEDDINGS),
        str(tmp_path / "v.parquet"),
    )
    _parts(str(tmp_path / "together.parquet"), [low, high], USERS_TOGETHER)
    _parts(str(tmp_path / "plain.parquet"), [high, low])
    solved = {}
    for name in ("together", "plain"):
        n, _ = user_solves.run(
            spark,
            str(tmp_path / f"{name}.parquet"),
            str(tmp_path / "v.parquet"),
            str(tmp_path / f"u-{name}.parquet"),
            0.5,
            dim=3,
        )
        solved[name] = storage.read_table(str(tmp_path / f"u-{name}.parquet")).sort_by("user_id")
        assert n == solved[name].num_rows == np.unique(pairs[:, 0]).size
    np.testing.assert_array_equal(solved["together"]["user_id"].to_numpy(), solved["plain"]["user_id"].to_numpy())
    np.testing.assert_allclose(
        np.array(solved["together"]["embedding"].to_pylist()),
        np.array(solved["plain"]["embedding"].to_pylist()),
        rtol=1e-10,
    )
    _parts(str(tmp_path / "unsorted.parquet"), [high, low.take(np.arange(low.num_rows)[::-1])], USERS_TOGETHER)
    with pytest.raises(ValueError, match=r"part-00001.parquet: its rows are not sorted by user_id"):
        user_solves.run(
            spark,
            str(tmp_path / "unsorted.parquet"),
            str(tmp_path / "v.parquet"),
            str(tmp_path / "u-bad.parquet"),
            0.5,
            dim=3,
        )
    assert not (tmp_path / "u-bad.parquet").exists()


def test_every_engine_solves_the_users_with_the_spark_tasks_bits(engine, spark, tmp_path):
    """The user update on each engine equals the Spark engine's bit for bit: on a table in no order
    (Spark shuffles by user, sorted by user and item) and on one whose files hold whole users in
    order (a file per task), with biases and gravity; bad input is refused with nothing written."""
    from pipelines.data.chunks import USERS_TOGETHER
    from pipelines.engines.prepare_spark import SparkEngine
    from pipelines.engines.user_solves import UserSolve

    rng = np.random.default_rng(8)
    pairs = np.unique(np.c_[rng.integers(1, 80, 1500), rng.integers(1, 40, 1500)], axis=0)
    rows = pa.table(
        {
            "user_id": pairs[:, 0],
            "item_id": pairs[:, 1],
            "label": rng.normal(size=len(pairs)),
            "timestamp": np.zeros(len(pairs), np.int64),
        }
    )
    shuffled = rows.take(rng.permutation(rows.num_rows))
    _parts(str(tmp_path / "shuffled.parquet"), [shuffled.slice(0, 700), shuffled.slice(700)])
    cut = int(np.searchsorted(pairs[:, 0], 40))
    _parts(str(tmp_path / "together.parquet"), [rows.slice(0, cut), rows.slice(cut)], USERS_TOGETHER)
    storage.write_table(
        pa.table({"item_id": np.arange(1, 41), "embedding": list(rng.normal(size=(40, 4)))}, schema=ITEM_EMBEDDINGS),
        str(tmp_path / "v.parquet"),
    )
    solve = UserSolve(0.3, 4, gravity=0.2, bias_ridge=2.0, prior=1.5)
    for table in ("shuffled", "together"):
        source, item_vectors = str(tmp_path / f"{table}.parquet"), str(tmp_path / "v.parquet")
        want = SparkEngine(spark).user_update(source, item_vectors, str(tmp_path / f"spark-{table}.parquet"), solve)
        got = engine.user_update(source, item_vectors, str(tmp_path / f"{engine.name}-{table}.parquet"), solve)
        assert got.users == want.users == 79
        expected = storage.read_table(str(tmp_path / f"spark-{table}.parquet")).sort_by("user_id")
        assert (
            storage.read_table(str(tmp_path / f"{engine.name}-{table}.parquet")).sort_by("user_id").equals(expected)
        ), table
    storage.write_table(
        pa.table({"item_id": [1], "embedding": [[1.0, 0.0, 0.0, 0.0]]}, schema=ITEM_EMBEDDINGS),
        str(tmp_path / "one.parquet"),
    )
    with pytest.raises(ValueError, match=r"one.parquet: no embedding for item \d+ of the interactions"):
        engine.user_update(
            str(tmp_path / "shuffled.parquet"),
            str(tmp_path / "one.parquet"),
            str(tmp_path / "bad.parquet"),
            UserSolve(1.0),
        )
    with pytest.raises(ValueError, match="--lambda-u must be > 0"):
        engine.user_update(
            str(tmp_path / "shuffled.parquet"),
            str(tmp_path / "v.parquet"),
            str(tmp_path / "bad.parquet"),
            UserSolve(0.0),
        )
    assert not (tmp_path / "bad.parquet").exists()
