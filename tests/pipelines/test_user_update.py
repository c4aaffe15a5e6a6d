"""The user update on a real local Spark equals the closed-form ridge solve per user."""

import numpy as np
import pyarrow as pa
import pytest

from pipelines.engines import user_update
from schemas import storage
from schemas.tables import INTERACTIONS, ITEM_EMBEDDINGS, validate_user_embeddings
from trainer.solve import ridge_solve


def test_spark_user_update_matches_closed_form(spark, tmp_path):
    rng = np.random.default_rng(3)
    users = rng.integers(1, 60, 800)
    items = rng.integers(1, 40, 800)
    pairs = np.unique(np.c_[users, items], axis=0)
    labels = rng.normal(size=len(pairs))
    storage.write_table(pa.table({"user_id": pairs[:, 0], "item_id": pairs[:, 1], "label": labels, "timestamp": np.zeros(len(pairs), np.int64)}, schema=INTERACTIONS), str(tmp_path / "i.parquet"))
    v = rng.normal(size=(40, 3))
    storage.write_table(pa.table({"item_id": np.arange(1, 41), "embedding": list(v)}, schema=ITEM_EMBEDDINGS), str(tmp_path / "v.parquet"))
    n, solve_seconds = user_update.run(spark, str(tmp_path / "i.parquet"), str(tmp_path / "v.parquet"), str(tmp_path / "u.parquet"), 0.5, 3)
    assert solve_seconds > 0
    out = validate_user_embeddings(storage.read_table(str(tmp_path / "u.parquet")), dim=3).sort_by("user_id")
    keys, want = ridge_solve(pairs[:, 0], v[pairs[:, 1] - 1], labels, 0.5, scale_by_rows=True)
    assert n == keys.size == out.num_rows
    np.testing.assert_array_equal(out["user_id"].to_numpy(), keys)
    np.testing.assert_allclose(np.array(out["embedding"].to_pylist()), want, rtol=1e-10, atol=1e-12)
    # one user by hand: u = (V^T V + lambda n I)^-1 V^T y, n the user's rows
    rows = pairs[:, 0] == keys[0]
    vk = v[pairs[rows, 1] - 1]
    np.testing.assert_allclose(want[0], np.linalg.solve(vk.T @ vk + 0.5 * rows.sum() * np.eye(3), vk.T @ labels[rows]), rtol=1e-10)


def test_missing_item_embedding_and_bad_lambda(spark, tmp_path):
    storage.write_table(pa.table({"user_id": [1, 1], "item_id": [1, 2], "label": [1.0, 2.0], "timestamp": [0, 0]}, schema=INTERACTIONS), str(tmp_path / "i.parquet"))
    storage.write_table(pa.table({"item_id": [1], "embedding": [[1.0, 0.0]]}, schema=ITEM_EMBEDDINGS), str(tmp_path / "v.parquet"))
    with pytest.raises(ValueError, match="no embedding for item 2"):
        user_update.run(spark, str(tmp_path / "i.parquet"), str(tmp_path / "v.parquet"), str(tmp_path / "u.parquet"), 1.0)
    with pytest.raises(ValueError, match="--lambda-u must be > 0"):
        user_update.run(spark, str(tmp_path / "i.parquet"), str(tmp_path / "v.parquet"), str(tmp_path / "u.parquet"), 0.0)
    assert not (tmp_path / "u.parquet").exists()
