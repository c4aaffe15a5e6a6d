"""The end-to-end training run on the bundled data: quality, metrics, resume, seed reuse, recall."""

import json
import os

import numpy as np
import pytest

from pipelines import train
from privacy.ledger import Ledger
from schemas import storage
from trainer import ssp


def test_non_private_run_reaches_the_als_regime(spark, tmp_path):
    metrics = train.run(train.TrainConfig(out=str(tmp_path / "run"), non_private=True), spark=spark, progress=False)
    assert metrics["test_rmse"] < 0.90  # plain ALS ~0.89 on this split
    assert metrics["test_rmse"] < metrics["test_mean_predictor_rmse"] - 0.1
    assert len(metrics["test_rmse_sliced"]) == 5 and all(v > 0 for v in metrics["test_rmse_sliced"])
    assert metrics["epsilon_spent"] == float("inf") and metrics["non_private"]
    on_disk = json.load(open(tmp_path / "run" / "metrics.json"))
    for key in ("protocol", "test_rmse", "valid_rmse", "epsilon_spent", "delta", "sliced", "seconds"):
        assert key in on_disk
    assert on_disk["epsilon_spent"] == "inf"
    assert storage.read_table(str(tmp_path / "run" / "item_embeddings.parquet")).num_rows == 9742  # every catalog item
    assert sorted(os.listdir(tmp_path / "run" / "private")) == ["data", "seed", "split", "step-1", "step-2", "step-3", "train_centred.parquet", "user_embeddings.parquet"]


def small(out, **kwargs):
    return train.TrainConfig(out=str(out), epsilon=5.0, outer_steps=2, epochs=3, dim=8, **kwargs)


def test_interrupted_run_resumes_without_spending_twice(spark, tmp_path, monkeypatch):
    calls = {"n": 0}
    real_train = ssp.train

    def dies_in_step_two(*args, **kwargs):
        calls["n"] += 1
        if calls["n"] == 2:
            raise KeyboardInterrupt("killed")
        return real_train(*args, **kwargs)

    monkeypatch.setattr(ssp, "train", dies_in_step_two)
    with pytest.raises(KeyboardInterrupt):
        train.run(small(tmp_path / "run"), spark=spark, progress=False)
    manifest = json.load(open(tmp_path / "run" / "manifest.json"))
    assert manifest["steps_done"] == [1] and manifest["status"] == "running"
    step1 = open(tmp_path / "run" / "step-1" / "item_embeddings.parquet" / "part-00000.parquet", "rb").read()
    monkeypatch.setattr(ssp, "train", real_train)
    metrics = train.run(small(tmp_path / "run"), spark=spark, progress=False)
    ledger = Ledger.open(str(tmp_path / "run" / "ledger.parquet"))
    assert [row["name"] for row in ledger.rows] == ["counts", "mean", "step-1/stats/r0", "step-2/stats/r0"]
    assert metrics["epsilon_spent"] == pytest.approx(5.0, rel=1e-6)
    assert open(tmp_path / "run" / "step-1" / "item_embeddings.parquet" / "part-00000.parquet", "rb").read() == step1
    # a run with other settings in the same directory is refused
    with pytest.raises(ValueError, match=r"holds a run with other settings \(epsilon\)"):
        train.run(small(tmp_path / "run").__class__(**{**small(tmp_path / "run").__dict__, "epsilon": 1.0}), spark=spark, progress=False)

    # the run's seed file reproduces its releases byte for byte in a new directory
    again = train.run(small(tmp_path / "again", seed_file=str(tmp_path / "run" / "private" / "seed")), spark=spark, progress=False)
    for step in (1, 2):
        folder = tmp_path / "run" / f"step-{step}" / "stats" / "resample-0.parquet"
        for name in os.listdir(folder):
            assert open(folder / name, "rb").read() == open(tmp_path / "again" / f"step-{step}" / "stats" / "resample-0.parquet" / name, "rb").read()
    assert again["test_rmse"] == pytest.approx(metrics["test_rmse"], abs=1e-9)


def test_recall_protocol_trains_on_top_items_by_dp_count(spark, tmp_path):
    metrics = train.run(small(tmp_path / "run", protocol="recall"), spark=spark, progress=False)
    assert 0.0 <= metrics["test_recall_at_20"] <= 1.0 and 0.0 <= metrics["valid_recall_at_20"] <= 1.0
    stats = storage.read_table(str(tmp_path / "run" / "step-1" / "stats" / "resample-0.parquet"))
    assert stats.num_rows == int(np.ceil(0.1 * 9742))  # the top 10% items by DP count
    names = [row["name"] for row in Ledger.open(str(tmp_path / "run" / "ledger.parquet")).rows]
    # no mean release in the ranking protocol; one users' Gram matrix (implicit-feedback gravity) per step
    assert names == ["counts", "step-1/stats/r0", "step-1/gram", "step-2/stats/r0", "step-2/gram"]
    assert metrics["epsilon_spent"] == pytest.approx(5.0, rel=1e-6)
