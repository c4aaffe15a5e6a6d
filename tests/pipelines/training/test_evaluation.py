"""The evaluate stage's ranking metrics on a hand-made split (no training: nothing trained, so the
fold-in ranks by the popularity column) and the summary it prints."""

import os
import subprocess
import sys

import numpy as np
import pyarrow as pa
import pytest

from pipelines.training import evaluation
from pipelines.training.settings import TrainConfig
from schemas import storage
from schemas.errors import SchemaError
from trainer.features import FeatureSpace
from trainer.metrics import RANKING

CATALOG = np.arange(101, 126)  # 25 items; DP count 130 - id: ranking by count is ranking by id
D = 1 / np.log2(np.arange(2, 102))  # the discount of rank r


def _write(folder, part, history, targets):
    for kind, pairs in (("history", history), ("targets", targets)):
        users, items = (np.array(column, np.int64) for column in zip(*pairs, strict=True))
        storage.write_table(
            pa.table({"user_id": users, "item_id": items, "label": np.ones(users.size)}),
            f"{folder}/{part}_{kind}.parquet",
        )


def _hand_split(tmp_path) -> str:
    split = str(tmp_path)
    storage.write_table(pa.table({"item_id": np.repeat(CATALOG, 3)}), f"{split}/train.parquet")
    # valid: user 1 ranks 104..125 (targets 104, 124, 125 at ranks 0, 20, 21), user 2 ranks 101..109,
    # 111..125 (121 at 19, 124 at 22); test: user 3 ranks 106..125 (125 at 19), user 4 ranks 101..124
    # (120..123 at 19..22); user 5 has no history: not evaluated
    _write(split, "valid", [(1, 101), (1, 102), (1, 103), (2, 110)], [(1, 104), (1, 124), (1, 125), (2, 121), (2, 124)])
    _write(
        split,
        "test",
        [(3, i) for i in range(101, 106)] + [(4, 125)],
        [(3, 125), (4, 120), (4, 121), (4, 122), (4, 123), (5, 101)],
    )
    return split


def test_the_ranking_protocol_records_every_ranking_metric_for_the_model_and_dp_popularity(tmp_path):
    split = _hand_split(tmp_path)
    config = TrainConfig.create(protocol="recall", data=split, out=split, dim=2)
    counts = 130.0 - CATALOG
    metrics = evaluation._evaluate(
        config,
        FeatureSpace(CATALOG, []),
        split_dir=split,
        train_rows=f"{split}/train.parquet",
        item_vectors=np.zeros((CATALOG.size, 2)),  # nothing trained: each user's coefficient on the counts column
        final_users=f"{split}/none.parquet",
        mean=0.0,
        unit="user",
        ratings=(0.0, 1.0),
        counts=counts,
        popularity=counts,
    )
    expected = {
        "valid": {
            "recall_at_20": (1 / 3 + 1 / 2) / 2,
            "recall_at_50": 1.0,
            "ndcg_at_100": ((D[0] + D[20] + D[21]) / D[:3].sum() + (D[19] + D[22]) / D[:2].sum()) / 2,
            "coverage_at_20": 23 / 25,  # 104..123, 101..109 and 111..121
        },
        "test": {
            "recall_at_20": (1 + 1 / 4) / 2,
            "recall_at_50": 1.0,
            "ndcg_at_100": (D[19] + D[19:23].sum() / D[:4].sum()) / 2,
            "coverage_at_20": 1.0,  # 106..125 and 101..120
        },
    }
    for part, values in expected.items():
        for key, value in values.items():
            assert metrics[f"{part}_{key}"] == pytest.approx(value), (part, key)
            assert metrics[f"{part}_popularity_{key}"] == pytest.approx(value), (part, key)
        assert len(metrics[f"{part}_recall_at_20_sliced"]) == 5


def test_example_recommendations_are_each_test_users_top_k_without_its_history_marking_its_targets(tmp_path):
    split = _hand_split(tmp_path)
    config = TrainConfig.create(protocol="recall", data=split, out=split, dim=2)
    examples = evaluation.example_recommendations(
        config,
        FeatureSpace(CATALOG, []),
        split_dir=split,
        item_vectors=np.zeros((CATALOG.size, 2)),  # ranked by the counts column alone: by id
        counts=130.0 - CATALOG,
        final_users=f"{split}/none.parquet",
        mean=0.0,
        ratings=(0.0, 1.0),
        confidence_alpha=None,
        k=20,
    )
    assert [example["user"] for example in examples] == [3, 4]  # user 5 has no history
    assert [item for item, _ in examples[0]["history"]] == list(range(101, 106))
    tops = [[item for item, _, _ in example["recommended"]] for example in examples]
    assert tops == [list(range(106, 126)), list(range(101, 121))]
    marked = [[item for item, _, held in example["recommended"] if held is not None] for example in examples]
    assert marked == [[125], [120]]
    scores = [score for _, score, _ in examples[0]["recommended"]]
    assert scores == sorted(scores, reverse=True) and scores[0] > 0


def _ranking_metrics(**test) -> dict:
    values = {"recall_at_20": 0.1234, "recall_at_50": 0.25, "ndcg_at_100": 0.3, "coverage_at_20": 0.05}
    metrics = {"protocol": "recall", "non_private": False, "unit": "user", "delta": 1e-5, "epsilon_spent": 1.0}
    for key in RANKING:
        metrics[f"valid_{key}"] = values[key] + 0.01
        metrics[f"test_{key}"] = test.get(key, values[key])
        metrics[f"test_popularity_{key}"] = values[key] / 2
    metrics["test_recall_at_20_sliced"] = [None, 0.0, 0.1, 0.2, 0.3]
    metrics["test_popularity_recall_at_20_sliced"] = [None, 0.0, 0.0, 0.0, 0.2]
    metrics.update(
        epsilon_budget=1.0,
        releases=3,
        seconds=5.0,
        outputs={"run": "R", "ledger": "L", "encoder": "E", "item_embeddings": "I"},
    )
    return metrics


def test_the_summary_prints_every_ranking_metric_of_the_model_and_of_dp_popularity():
    lines = evaluation.describe(_ranking_metrics()).splitlines()
    assert lines[:4] == [
        "test Recall@20 0.1234 (valid 0.1334)",
        "  test Recall@50 0.2500, NDCG@100 0.3000, coverage@20 0.0500 (valid Recall@50 0.2600, NDCG@100 0.3100, "
        "coverage@20 0.0600)",
        "test Recall@20 by item popularity (least to most popular fifth): -, 0.0000, 0.1000, 0.2000, 0.3000",
        "  DP popularity (the run's counts release): test Recall@20 0.0617; same fifths: -, 0.0000, 0.0000, 0.0000, "
        "0.2000; Recall@50 0.1250, NDCG@100 0.1500, coverage@20 0.0250",
    ]
    below = evaluation.describe(_ranking_metrics(recall_at_20=0.05)).splitlines()[3]
    assert "test Recall@20 0.0617; the model is BELOW it" in below
    at_10 = {
        f"test_{name}_at_10": value
        for name, value in zip(
            ("recall", "precision", "ndcg", "map", "coverage"), (0.1, 0.2, 0.3, 0.4, 0.5), strict=True
        )
    }
    popular = {key.replace("test_", "test_popularity_"): value / 10 for key, value in at_10.items()}
    line = evaluation.describe({**_ranking_metrics(), **at_10, **popular}).splitlines()[4]
    assert line == (
        "test at 10: Recall 0.1000, Precision 0.2000, NDCG 0.3000, MAP 0.4000, coverage 0.5000 (DP popularity: "
        "Recall 0.0100, Precision 0.0200, NDCG 0.0300, MAP 0.0400, coverage 0.0500)"
    )
    exact = evaluation.describe({**_ranking_metrics(), "non_private": True}).splitlines()[3]
    assert exact.startswith(
        "  popularity (exact counts: a non-private run) (the run's counts release): test Recall@20 0.0617;"
    )


@pytest.mark.parametrize("command, bad", [("evaluate", "0"), ("evaluate", "10,x"), ("evaluate", ","), ("train", "-5")])
def test_bad_cut_offs_are_one_line_through_the_installed_command(tmp_path, command, bad):
    result = subprocess.run(
        [
            os.path.join(os.path.dirname(sys.executable), "ssp"),
            command,
            "--run" if command == "evaluate" else "--out",
            str(tmp_path),
            f"--metrics-at={bad}",
        ],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert result.returncode == 2 and "Traceback" not in result.stderr
    assert "argument --metrics-at: must be positive integers separated by commas" in result.stderr.splitlines()[-1]


def _rmse_split(tmp_path, users: dict) -> str:
    """A hand-made ratings split written a few rows a file, so that every table is read in several batches."""
    split = str(tmp_path)
    train = np.repeat(np.arange(1, 6), np.arange(1, 6))  # item j has j training rows: item j in popularity fifth j-1
    storage.write_table(pa.table({"item_id": train}), f"{split}/train.parquet", rows_per_file=4)
    for part, rows in (
        ("valid", [(10, 2, 3.0)]),
        ("test", [(10, 1, 3.0), (20, 5, 4.0), (30, 2, 5.0), (40, 5, 1.0), (10, 3, 2.0)]),
    ):
        user, item, label = (np.array(column) for column in zip(*rows, strict=True))
        storage.write_table(
            pa.table({"user_id": user, "item_id": item, "label": label}), f"{split}/{part}.parquet", rows_per_file=2
        )
    ids = np.array(list(users), np.int64)
    storage.write_table(
        pa.table({"user_id": ids, "embedding": [list(v) for v in users.values()]}),
        f"{split}/users.parquet",
        rows_per_file=2,
    )
    return split


def _evaluate_rmse(split):
    return evaluation._evaluate(
        TrainConfig.create(data=split, out=split, dim=2, biases=False),
        FeatureSpace(np.arange(1, 6), []),
        split_dir=split,
        train_rows=f"{split}/train.parquet",
        item_vectors=np.array([[0.1 * j, 0.05] for j in range(1, 6)]),
        final_users=f"{split}/users.parquet",
        mean=3.0,
        unit="user",
        ratings=(1.0, 5.0),
    )


def test_the_ratings_protocol_streams_every_table_to_the_rmse_of_each_popularity_fifth(tmp_path):
    """u . v + mean clipped to the range, the mean for a user without an embedding (30); the tables are read a
    batch at a time, and the sums over the batches give the hand-computed errors."""
    metrics = _evaluate_rmse(_rmse_split(tmp_path, {10: [1.0, 0.0], 20: [0.0, 30.0], 40: [100.0, 0.0]}))
    # test predictions 3.1, 4.5, 3 (user 30), 5 (53 clipped), 3.3: squared errors 0.01, 0.25, 4, 16, 1.69
    assert metrics["test_rmse"] == pytest.approx(np.sqrt(21.95 / 5))
    assert metrics["test_rmse_sliced"] == pytest.approx([0.1, 2.0, 1.3, None, np.sqrt(16.25 / 2)])
    assert metrics["test_mean_predictor_rmse"] == pytest.approx(np.sqrt(10 / 5))
    assert metrics["test_mean_predictor_rmse_sliced"] == pytest.approx([0.0, 2.0, 1.0, None, np.sqrt(5 / 2)])
    assert metrics["valid_rmse"] == pytest.approx(0.2)


def test_a_user_with_two_embeddings_in_different_files_is_refused(tmp_path):
    split = _rmse_split(tmp_path, {10: [1.0, 0.0], 20: [0.0, 1.0], 10_000: [0.0, 0.0]})
    storage.write_table(
        pa.table({"user_id": np.array([10, 20, 10], np.int64), "embedding": [[1.0, 0.0], [0.0, 1.0], [2.0, 0.0]]}),
        f"{split}/users.parquet",
        rows_per_file=2,
    )
    with pytest.raises(SchemaError, match="user embeddings: column 'user_id', row 2: value 10 appears more than once"):
        _evaluate_rmse(split)


def test_a_bad_embedding_in_a_later_file_is_refused_with_its_row_in_the_whole_table(tmp_path):
    # the files are read in threads, each batch validated alone: the row named is the table's
    split = _rmse_split(tmp_path, {10: [1.0, 0.0], 20: [0.0, 1.0], 10_000: [0.0, 0.0]})
    storage.write_table(
        pa.table(
            {
                "user_id": np.array([10, 20, 30, 40], np.int64),
                "embedding": [[1.0, 0.0], [0.0, 1.0], [2.0, 0.0], [np.nan, 0.0]],
            }
        ),
        f"{split}/users.parquet",
        rows_per_file=2,
    )
    with pytest.raises(SchemaError, match="user embeddings: column 'embedding', row 3: holds a non-finite value"):
        _evaluate_rmse(split)


def test_of_two_bad_files_read_side_by_side_the_first_in_the_table_is_named(tmp_path):
    split = _rmse_split(tmp_path, {10: [1.0, 0.0], 20: [0.0, 1.0], 10_000: [0.0, 0.0]})
    storage.write_table(
        pa.table(
            {
                "user_id": np.array([10, 20, 30, 40], np.int64),
                "embedding": [[1.0, 0.0], [np.inf, 1.0], [2.0, 0.0], [np.nan, 0.0]],
            }
        ),
        f"{split}/users.parquet",
        rows_per_file=2,
    )
    with pytest.raises(SchemaError, match="user embeddings: column 'embedding', row 1: holds a non-finite value"):
        _evaluate_rmse(split)
