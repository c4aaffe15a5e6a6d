"""The new-items experiment: the derived data set, the targets, popularity by features by hand, the fold-in
held equal to the run's evaluation, and the experiment end to end on a small MovieLens-like set."""

import json

import numpy as np
import pyarrow as pa
import pytest

from bench import __main__ as bench_main
from bench import new_items, training
from pipelines.data import splits, synth
from pipelines.data.datasets import write_dataset
from pipelines.training import settings
from schemas import storage
from schemas.errors import UserError
from trainer import evaluate, metrics
from trainer.features import FeatureSpace


def items_table(rows: list[tuple]) -> pa.Table:
    """An items table of (item_id, genres, year), both families public."""
    table = pa.table(
        {
            "item_id": pa.array([r[0] for r in rows], pa.int64()),
            "title": pa.array([f"item {r[0]}" for r in rows]),
            "genres": pa.array([r[1] for r in rows], pa.list_(pa.string())),
            "year": pa.array([r[2] for r in rows], pa.int64()),
        }
    )
    return table.replace_schema_metadata({"features": json.dumps({"genres": "multivalent", "year": "univalent"})})


@pytest.fixture(scope="module")
def movielens(tmp_path_factory):
    return synth.generate(str(tmp_path_factory.mktemp("ml") / "ml"), users=300, like="movielens")


def test_the_new_items_lose_every_interaction_and_nothing_else(movielens, tmp_path):
    original = storage.read_table(movielens.interactions)
    held = new_items.new_items(movielens)
    rated = np.unique(original["item_id"].to_numpy())
    assert held.size == round(0.1 * rated.size) and np.isin(held, rated).all()
    assert np.array_equal(held, new_items.new_items(movielens))  # seeded: the same items again
    assert not np.array_equal(held, new_items.new_items(movielens, seed=53))
    derived = new_items.hold_out(movielens, str(tmp_path / "derived"))
    rows = storage.read_table(derived.interactions)
    assert not np.isin(rows["item_id"].to_numpy(), held).any()
    kept = original.filter(pa.array(~np.isin(original["item_id"].to_numpy(), held)))
    assert rows.sort_by([("user_id", "ascending"), ("item_id", "ascending"), ("timestamp", "ascending")]).equals(
        kept.sort_by([("user_id", "ascending"), ("item_id", "ascending"), ("timestamp", "ascending")])
    )
    assert storage.read_table(derived.items).equals(storage.read_table(movielens.items))  # every item, every feature
    assert derived.manifest["rating_scale"] == movielens.manifest["rating_scale"]  # the same positive threshold
    assert derived.manifest["new_items"]["held_out"] == held.size


def test_the_targets_are_the_original_positives_on_new_items(tmp_path):
    catalog = items_table([(i, ["A"], 2000) for i in range(1, 6)])
    rows = pa.table(
        {
            "user_id": pa.array([1, 1, 1, 1, 2, 2, 3], pa.int64()),
            "item_id": pa.array([4, 4, 5, 1, 5, 4, 4], pa.int64()),
            "label": pa.array([4.0, 5.0, 3.65, 5.0, 4.5, 1.0, 5.0]),
            "timestamp": pa.array([1, 2, 3, 4, 5, 6, 7], pa.int64()),
        }
    )
    data = write_dataset(str(tmp_path / "d"), catalog, rows.to_batches(), {"source": "hand"})
    # users 1 and 2, new items 4 and 5, positives above 3.65: (1, 4) once though rated twice; not (1, 5) at the
    # threshold, (1, 1) on an old item, (2, 4) below it or user 3's
    users, items = new_items.positives(data, 3.65, np.array([1, 2]), np.array([4, 5]))
    assert list(zip(users.tolist(), items.tolist(), strict=True)) == [(1, 4), (2, 5)]
    users, items = new_items.positives(data, None, np.array([1, 2]), np.array([4, 5]))  # implicit: every row
    assert list(zip(users.tolist(), items.tolist(), strict=True)) == [(1, 4), (1, 5), (2, 4), (2, 5)]
    users, items = new_items.positives(data, 3.65)  # everyone's, on every item
    assert list(zip(users.tolist(), items.tolist(), strict=True)) == [(1, 1), (1, 4), (2, 5), (3, 4)]


def test_popularity_by_features_by_hand():
    catalog = items_table([(1, ["A"], 1980), (2, ["A", "B"], 1985), (3, ["B"], 1990), (4, ["A", "B"], 1990)])
    space = FeatureSpace.from_items(catalog, use_item_id=False)
    counts = np.array([10.0, 20.0, 40.0, 3.0])
    new = np.array([False, False, False, True])
    # item 4: genre A (items 1, 2: mean 15), genre B (2, 3: 30), year 1990 (3: 40), averaged: 85 / 3
    assert new_items.popularity_by_features(space, counts, new) == pytest.approx([85 / 3])
    # a new item that shares no value with a trained item: the trained items' mean count
    lonely = items_table([(1, ["A"], 1980), (2, ["A", "B"], 1985), (3, ["B"], 1990), (4, ["C"], 2001)])
    scores = new_items.popularity_by_features(FeatureSpace.from_items(lonely, use_item_id=False), counts, new)
    assert scores == pytest.approx([70 / 3])


def test_expected_random_recall_by_hand():
    # 100 items: 1 target -> 20/100; 30 targets -> 20 * 30 / 100 hits of 20 -> 0.3
    assert new_items.expected_random_recall(np.array([1, 30]), 100) == pytest.approx(0.25)
    assert new_items.expected_random_recall(np.array([3]), 10) == pytest.approx(1.0)  # fewer items than k: all hit


def test_the_fold_in_is_the_runs_evaluation():
    """Ranking the whole catalog with `fold_in`'s users gives ranking_report's metrics to the last bit."""
    rng = np.random.default_rng(0)
    m, users = 60, 40
    vectors = rng.normal(size=(m, 5))
    config = settings.TrainConfig.create(protocol="recall")
    h_users = np.repeat(np.arange(users), 6)
    h_positions = np.concatenate([rng.choice(m, 9, replace=False) for _ in range(users)])
    h_positions, t_positions = h_positions.reshape(users, 9)[:, :6].ravel(), h_positions.reshape(users, 9)[:, 6:]
    t_users = np.repeat(np.arange(users), 3)
    labels = rng.uniform(1.0, 2.0, h_users.size)
    expected = evaluate.ranking_report(
        (h_users, h_positions, labels),
        (t_users, t_positions.ravel()),
        vectors,
        config.lambda_u,
        item_buckets=np.zeros(m, np.int64),
        gravity=config.fold_in_gravity,
        confidence=True,
    )
    solved_users, solved = new_items.fold_in(config, (h_users, h_positions, labels), vectors)
    assert np.array_equal(solved_users, np.arange(users))
    blocks = [
        (
            solved @ vectors.T,
            evaluate.user_item_mask(solved_users, h_users, h_positions, m),
            evaluate.user_item_mask(solved_users, t_users, t_positions.ravel(), m),
        )
    ]
    got = metrics.ranking_metrics(blocks)
    assert {k: got[k] for k in metrics.RANKING} == {k: expected[k] for k in metrics.RANKING}


TINY = {"epsilons": [5.0], "methods": ["ssp"], "base": {"epochs": 2, "outer_steps": 1, "dim": 4}}


def test_the_experiment_end_to_end(movielens, tmp_path, monkeypatch, spark):
    monkeypatch.setattr(new_items, "sizes", lambda quick: TINY)
    out = tmp_path / "out"
    argv = ["new-items", "--data", movielens.path, "--out", str(out), "--quick", "--seeds", "1", "--no-progress"]
    assert bench_main.main(argv) == 0
    cells = json.loads((out / "results.json").read_text())["cells"]
    assert [c["params"]["method"] for c in cells.values()] == ["ssp"]
    # the targets: the test users of the run's split (the derived data, its seed and threshold) and their
    # original positives on the new items
    held = new_items.new_items(movielens)
    derived = new_items.hold_out(movielens, new_items.derived_path(str(out), movielens.path))
    threshold = splits.positive_threshold_for(derived)
    split = splits.split_heldout_users(storage.read_table(derived.interactions), positive_threshold=threshold)
    test_users = np.unique(split["test_history"]["user_id"].to_numpy())
    rows = storage.read_table(movielens.interactions)
    positive = (
        np.isin(rows["user_id"].to_numpy(), test_users)
        & np.isin(rows["item_id"].to_numpy(), held)
        & (rows["label"].to_numpy() > threshold)
    )
    pairs = np.unique(np.stack([rows["user_id"].to_numpy()[positive], rows["item_id"].to_numpy()[positive]]), axis=1)
    for cell in cells.values():
        value = cell["value"]
        assert (value["new_items"], value["targets"], value["users"]) == (
            held.size,
            pairs.shape[1],
            np.unique(pairs[0]).size,
        )
        rankers = (
            "model",
            "model_in_catalog",
            "popularity_by_features",
            "popularity_by_features_exact",
            "random",
        )
        for ranker in rankers:
            assert value[ranker]["users"] == value["users"]
            assert all(0 <= value[ranker][k] <= 1 for k in metrics.RANKING)
        assert 0 < value["epsilon_spent"] <= 5.0 + 1e-9
    report = (out / "report.md").read_text()
    assert "## New items: what the public features buy" in report
    assert "| AM-SSP | 5 |" in report
    # a rerun reads the cells, trains nothing
    monkeypatch.setattr(new_items, "run_cell", lambda out, params: pytest.fail("recomputed a finished cell"))
    assert bench_main.main(argv) == 0
    assert training.METHODS["ssp"].label in (out / "report.md").read_text()


def test_only_methods_with_a_features_encoder_score_new_items(tmp_path):
    assert [n for n in training.METHODS if new_items.feature_based(n)] == ["nonprivate-ssp", "none", "dpsgd", "ssp"]
    with pytest.raises(UserError, match="features encoder"):
        bench_main.main(["new-items", "--data", "/nowhere", "--out", str(tmp_path), "--methods", "als", "gram"])
