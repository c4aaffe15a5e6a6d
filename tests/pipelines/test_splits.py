"""The two benchmark protocols: exact sizes, disjointness, determinism, and the Liang et al. rules."""

import argparse
import json
import os

import numpy as np
import pyarrow as pa
import pyarrow.csv as pacsv
import pytest

from pipelines import splits
from pipelines.datasets import open_dataset, write_dataset
from schemas import storage
from schemas.tables import INTERACTIONS, items_schema

RATINGS_CSV = os.path.join(os.path.dirname(__file__), "..", "..", "pipelines", "data", "ml-latest-small", "ratings.csv")


def _table(users, items, labels, timestamps=None):
    n = len(users)
    timestamps = np.arange(n) if timestamps is None else timestamps
    return pa.table(
        {
            "user_id": np.asarray(users, np.int64),
            "item_id": np.asarray(items, np.int64),
            "label": np.asarray(labels, np.float64),
            "timestamp": np.asarray(timestamps, np.int64),
        },
        schema=INTERACTIONS,
    )


def _random_ratings(n, seed=0):
    rng = np.random.default_rng(seed)
    # Distinct (user, item) pairs, so every row is identified by its key.
    keys = rng.choice(100 * 1000, size=n, replace=False)
    return _table(keys // 1000, keys % 1000, rng.integers(1, 11, n) / 2.0, rng.integers(0, 10**9, n))


def _keys(table):
    return set(zip(table["user_id"].to_pylist(), table["item_id"].to_pylist()))


def _rows(table):
    return sorted(zip(*(table[c].to_pylist() for c in table.column_names)))


def _users(table):
    return set(table["user_id"].to_pylist())


# ---------------------------------------------------------------------------------------------
# Regression protocol


@pytest.mark.parametrize("n, sizes", [(1000, (800, 100, 100)), (7, (5, 0, 2)), (19, (15, 1, 3)), (1, (0, 0, 1))])
def test_rating_split_sizes_follow_the_floor_rule(n, sizes):
    # train = floor(0.8 n), valid = floor(0.1 n), test = the rest: 19 -> 15 (15.2), 1 (1.9), 3.
    split = splits.split_ratings(_random_ratings(n))
    assert tuple(split[name].num_rows for name in ("train", "valid", "test")) == sizes


def test_rating_split_is_a_partition_of_the_rows():
    table = _random_ratings(1000)
    split = splits.split_ratings(table)
    parts = [_keys(split[name]) for name in ("train", "valid", "test")]
    assert not (parts[0] & parts[1]) and not (parts[0] & parts[2]) and not (parts[1] & parts[2])
    assert parts[0] | parts[1] | parts[2] == _keys(table)
    # Whole rows travel, labels and timestamps included, and the schema is the canonical one.
    assert sorted(sum((_rows(split[name]) for name in split), [])) == _rows(table)
    assert all(split[name].schema.equals(INTERACTIONS) for name in split)


def test_rating_split_is_seeded_and_ignores_row_order():
    table = _random_ratings(1000)
    first = splits.split_ratings(table, seed=1234)
    again = splits.split_ratings(table, seed=1234)
    shuffled = splits.split_ratings(table.take(np.random.default_rng(5).permutation(1000)), seed=1234)
    other = splits.split_ratings(table, seed=99)
    for name in ("train", "valid", "test"):
        assert first[name].equals(again[name])
        assert first[name].equals(shuffled[name])
    assert _keys(first["test"]) != _keys(other["test"])
    assert other["test"].num_rows == 100


def test_rating_split_rejects_empty_input():
    with pytest.raises(ValueError, match="empty"):
        splits.split_ratings(_table([], [], []))


# ---------------------------------------------------------------------------------------------
# Ranking protocol


def _hand_ranking_table():
    """30 eligible users (ids 0..29) and one ineligible user (999).

    Each eligible user rates items 0..9 with 4.0 (positives, shared by everyone), their own item
    1000 + u with 5.0 (a positive no other user has), and items 100, 101 with 3.5 and 1.0
    (negatives: the threshold is strict). User 999 has 4 positives and 6 negatives.
    """
    users, items, labels = [], [], []
    for u in range(30):
        for item, label in [*((i, 4.0) for i in range(10)), (1000 + u, 5.0), (100, 3.5), (101, 1.0)]:
            users.append(u), items.append(item), labels.append(label)
    for i in range(10):
        users.append(999), items.append(i), labels.append(4.0 if i < 4 else 2.0)
    return _table(users, items, labels)


def test_ranking_split_hand_example():
    split = splits.split_heldout_users(_hand_ranking_table())
    # 30 eligible users -> round(0.1 * 30) = 3 validation and 3 test users, 24 training users.
    valid, test, train = _users(split["valid_history"]), _users(split["test_history"]), _users(split["train"])
    assert len(valid) == 3 and len(test) == 3 and len(train) == 24
    assert _users(split["valid_targets"]) == valid and _users(split["test_targets"]) == test
    assert not (valid & test) and not (valid & train) and not (test & train)
    assert valid | test | train == set(range(30))  # user 999 (4 positives) is gone
    for table in split.values():
        assert all(label > 3.5 for label in table["label"].to_pylist())  # positives only, labels kept
        assert set(table["label"].to_pylist()) <= {4.0, 5.0}
    # Training users keep all 11 positives, their own item included.
    assert split["train"].num_rows == 24 * 11
    for u in train:
        assert (u, 1000 + u) in _keys(split["train"])
    # Held-out users lose their own item (no training user has it): 10 rows -> 2 targets, 8 history.
    for group in ("valid", "test"):
        history, targets = split[f"{group}_history"], split[f"{group}_targets"]
        assert history.num_rows == 3 * 8 and targets.num_rows == 3 * 2
        for u in _users(history):
            h = {i for uu, i in _keys(history) if uu == u}
            t = {i for uu, i in _keys(targets) if uu == u}
            assert len(h) == 8 and len(t) == 2 and not (h & t) and h | t == set(range(10))


def _varied_ranking_table(seed=3, n_users=200):
    """Users with 2..40 positives and some negatives over 300 items; popular items are shared."""
    rng = np.random.default_rng(seed)
    users, items, labels = [], [], []
    for u in range(n_users):
        n = int(rng.integers(2, 41))
        chosen = rng.choice(300, size=n, replace=False, p=np.linspace(2.0, 0.1, 300) / np.linspace(2.0, 0.1, 300).sum())
        users += [u] * n
        items += chosen.tolist()
        labels += rng.choice([1.0, 2.0, 3.0, 3.5, 4.0, 4.5, 5.0], size=n).tolist()
    return _table(users, items, labels, rng.integers(0, 10**9, len(users)))


def test_ranking_split_follows_the_rules_on_varied_users():
    table = _varied_ranking_table()
    users, items, labels = (table[c].to_numpy() for c in ("user_id", "item_id", "label"))
    positive = labels > 3.5
    ids, counts = np.unique(users[positive], return_counts=True)
    eligible = set(ids[counts >= 5].tolist())
    h = round(0.1 * len(eligible))
    split = splits.split_heldout_users(table)

    train = _users(split["train"])
    assert len(train) == len(eligible) - 2 * h
    assert split["train"].num_rows == int(np.isin(users[positive], list(train)).sum())
    train_items = set(split["train"]["item_id"].to_pylist())
    held_users = {g: _users(split[f"{g}_history"]) | _users(split[f"{g}_targets"]) for g in ("valid", "test")}
    assert len(held_users["valid"]) <= h and len(held_users["test"]) <= h
    assert not (held_users["valid"] & held_users["test"]) and not ((held_users["valid"] | held_users["test"]) & train)
    assert (held_users["valid"] | held_users["test"] | train) <= eligible

    positives_on_train_items = {}
    for u, i in zip(users[positive], items[positive]):
        if i in train_items:
            positives_on_train_items.setdefault(int(u), set()).add(int(i))
    seen_large = 0
    for group in ("valid", "test"):
        history, targets = _keys(split[f"{group}_history"]), _keys(split[f"{group}_targets"])
        for u in held_users[group]:
            hist = {i for uu, i in history if uu == u}
            targ = {i for uu, i in targets if uu == u}
            assert not (hist & targ)
            assert hist | targ == positives_on_train_items[u]  # restricted to training items, nothing else lost
            n_u = len(hist) + len(targ)
            assert len(targ) == (int(0.2 * n_u) if n_u >= 5 else 0)
            seen_large += n_u >= 10
    assert seen_large > 0  # the 80/20 rule was exercised with at least 2 targets


def test_ranking_split_users_with_few_rows_keep_everything_as_history():
    # Shared items 0..4 for all users; each user also has 4 private items. Held-out users keep only
    # the 5 shared ones (1 target) ... unless the user has just 2 shared items: then all history.
    users, items, labels = [], [], []
    for u in range(40):
        shared = range(5) if u % 2 else range(2)
        for i in shared:
            users.append(u), items.append(i), labels.append(4.0)
        for j in range(4):
            users.append(u), items.append(1000 + 10 * u + j), labels.append(4.0)
    split = splits.split_heldout_users(_table(users, items, labels))
    held = _users(split["valid_history"]) | _users(split["test_history"])
    assert len(held) == 8  # round(0.1 * 40) = 4 per group
    targets = _keys(split["valid_targets"]) | _keys(split["test_targets"])
    for u in held:
        expected = 1 if u % 2 else 0  # 5 rows -> int(0.2 * 5) = 1 target; 2 rows -> none
        assert sum(1 for uu, _ in targets if uu == u) == expected
    assert {u for u, _ in targets} == {u for u in held if u % 2}
    # With target_fraction 0.5 a 2-row user would get int(1.0) = 1 target, but under 5 rows means none.
    split = splits.split_heldout_users(_table(users, items, labels), target_fraction=0.5)
    for group in ("valid", "test"):
        targets = _keys(split[f"{group}_targets"])
        for u in _users(split[f"{group}_history"]):
            assert sum(1 for uu, _ in targets if uu == u) == (2 if u % 2 else 0)  # 5 rows -> int(2.5) = 2


def test_ranking_split_is_seeded_and_ignores_row_order():
    table = _varied_ranking_table()
    first = splits.split_heldout_users(table, seed=1234)
    again = splits.split_heldout_users(table, seed=1234)
    shuffled = splits.split_heldout_users(table.take(np.random.default_rng(8).permutation(table.num_rows)), seed=1234)
    other = splits.split_heldout_users(table, seed=4321)
    for name in splits.HELDOUT_PARTS:
        assert first[name].equals(again[name])
        assert first[name].equals(shuffled[name])
    assert _users(first["test_history"]) != _users(other["test_history"])


def test_ranking_split_needs_three_eligible_users():
    rows = [(u, i) for u in range(3) for i in range(5)]
    table = _table([u for u, _ in rows], [i for _, i in rows], [5.0] * len(rows))
    split = splits.split_heldout_users(table)  # 3 users: 1 train, 1 valid, 1 test
    assert [len(_users(split[n])) for n in ("train", "valid_history", "test_history")] == [1, 1, 1]
    with pytest.raises(ValueError, match="at least 3 eligible users, got 2"):
        splits.split_heldout_users(table.slice(0, 10))
    with pytest.raises(ValueError, match="empty"):
        splits.split_heldout_users(table.slice(0, 0))


@pytest.mark.parametrize("n, h", [(3, 1), (14, 1), (15, 2), (25, 3), (603, 60), (138_493, 10_000), (50_000, 5_000)])
def test_heldout_user_count(n, h):
    assert splits.heldout_user_count(n) == h


# ---------------------------------------------------------------------------------------------
# Top items from (DP) counts


def test_top_items_hand_example_with_ties():
    ids = np.array([50, 10, 40, 20, 30, 60, 70, 80, 90, 15, 25])
    counts = np.array([3.0, 9.0, 7.5, 7.5, 7.5, 1.0, 1.0, 2.0, 1.0, 1.0, 1.0])
    # m = 11, fraction 0.3 -> ceil(3.3) = 4 items: 10 (9.0), then the 7.5 tie 20, 30, 40 all fit.
    assert splits.top_items(ids, counts, 0.3).tolist() == [10, 20, 30, 40]
    # fraction 0.2 -> ceil(2.2) = 3: 10, then the two smallest ids of the 7.5 tie (20, 30).
    assert splits.top_items(ids, counts, 0.2).tolist() == [10, 20, 30]
    # default 0.1 -> ceil(1.1) = 2: 10 and 20.
    assert splits.top_items(ids, counts).tolist() == [10, 20]
    # fraction 0.9 -> ceil(9.9) = 10 items: all but one of the six count-1 items (the largest id, 90).
    assert splits.top_items(ids, counts, 0.9).tolist() == [10, 15, 20, 25, 30, 40, 50, 60, 70, 80]


def test_top_items_exact_tenth_is_not_rounded_up():
    # 0.1 * 30 is 3.0000000000000004 in floating point; the rule means exactly 3 items.
    ids = np.arange(30)
    assert splits.top_items(ids, np.arange(30.0)).tolist() == [27, 28, 29]


def test_top_items_errors():
    with pytest.raises(ValueError, match="one length"):
        splits.top_items(np.arange(3), np.ones(2))
    with pytest.raises(ValueError, match="unique"):
        splits.top_items(np.array([1, 1]), np.ones(2))
    with pytest.raises(ValueError, match="fraction"):
        splits.top_items(np.arange(3), np.ones(3), 0.0)
    with pytest.raises(ValueError, match="finite"):
        splits.top_items(np.arange(3), np.array([1.0, np.nan, 2.0]))


# ---------------------------------------------------------------------------------------------
# Split folders and the CLI hooks


def _dataset(path, table):
    catalog = np.unique(table["item_id"].to_numpy())
    items = pa.table({"item_id": catalog, "title": [f"item {i}" for i in catalog]}, schema=items_schema({}))
    write_dataset(str(path), items, table.to_batches(), {"source": "test"})
    return open_dataset(str(path))


def test_make_split_rmse_round_trip(tmp_path):
    table = _random_ratings(1000)
    data = _dataset(tmp_path / "data", table)
    out = str(tmp_path / "split")
    document = splits.make_split(data, "rmse", out, seed=7)
    on_disk = json.loads((tmp_path / "split" / "split.json").read_text())
    assert on_disk == document
    assert document["protocol"] == "rmse" and document["seed"] == 7
    assert {name: size["rows"] for name, size in document["sizes"].items()} == {"train": 800, "valid": 100, "test": 100}
    expected = splits.split_ratings(table, seed=7)
    for name in ("train", "valid", "test"):
        read = storage.read_table(storage.join(out, f"{name}.parquet"))
        assert read.equals(expected[name])
        assert document["sizes"][name]["users"] == len(_users(read))


def test_make_split_recall_round_trip(tmp_path):
    data = _dataset(tmp_path / "data", _hand_ranking_table())
    out = str(tmp_path / "split")
    document = splits.make_split(data, "recall", out)
    assert json.loads((tmp_path / "split" / "split.json").read_text()) == document
    assert document["protocol"] == "recall" and document["seed"] == 1234
    assert document["train_item_fraction"] == 0.1 and document["n_heldout"] == 3 and document["n_eligible_users"] == 30
    assert document["sizes"] == {
        "train": {"rows": 264, "users": 24},
        "valid_history": {"rows": 24, "users": 3},
        "valid_targets": {"rows": 6, "users": 3},
        "test_history": {"rows": 24, "users": 3},
        "test_targets": {"rows": 6, "users": 3},
    }
    for name in splits.HELDOUT_PARTS:
        assert storage.read_table(storage.join(out, f"{name}.parquet")).num_rows == document["sizes"][name]["rows"]


def test_make_split_errors(tmp_path):
    data = _dataset(tmp_path / "data", _random_ratings(20))
    with pytest.raises(ValueError, match="unknown protocol 'ndcg'"):
        splits.make_split(data, "ndcg", str(tmp_path / "out"))
    with pytest.raises(ValueError, match="at least 3 eligible users"):
        splits.make_split(_dataset(tmp_path / "few", _table([1] * 6, range(6), [5.0] * 6)), "recall", str(tmp_path / "out"))
    empty = _dataset(tmp_path / "empty", _table([], [], []))
    with pytest.raises(ValueError, match="no interactions"):
        splits.make_split(empty, "rmse", str(tmp_path / "out"))
    assert not (tmp_path / "out" / "split.json").exists()


def test_cli_hooks(tmp_path, capsys):
    data = _dataset(tmp_path / "data", _random_ratings(1000))
    parser = argparse.ArgumentParser()
    splits.add_arguments(parser)
    args = parser.parse_args(["--data", str(tmp_path / "data"), "--protocol", "rmse", "--out", str(tmp_path / "split")])
    assert args.seed == 1234
    assert splits.run(args, data) == 0
    lines = capsys.readouterr().out.splitlines()
    assert len(lines) == 3
    assert lines[0].split()[:2] == ["train", "rows=800"]
    assert lines[2].split()[:2] == ["test", "rows=100"]
    with pytest.raises(SystemExit):
        parser.parse_args(["--protocol", "ndcg", "--out", "x"])
    with pytest.raises(SystemExit):
        parser.parse_args(["--protocol", "rmse"])  # --out is required


# ---------------------------------------------------------------------------------------------
# The bundled MovieLens sample (read directly, independent of pipelines.movielens)


@pytest.fixture(scope="module")
def bundled():
    table = pacsv.read_csv(RATINGS_CSV)
    assert table.column_names == ["userId", "movieId", "rating", "timestamp"]
    return table.rename_columns(["user_id", "item_id", "label", "timestamp"]).cast(INTERACTIONS)


def test_bundled_rating_split_sizes(bundled):
    # 100836 rows: floor(80668.8) = 80668, floor(10083.6) = 10083, 100836 - 80668 - 10083 = 10085.
    assert bundled.num_rows == 100_836
    split = splits.split_ratings(bundled)
    assert [split[n].num_rows for n in ("train", "valid", "test")] == [80_668, 10_083, 10_085]
    assert sum(len(_keys(split[n])) for n in split) == 100_836
    assert _keys(split["train"]) | _keys(split["valid"]) | _keys(split["test"]) == _keys(bundled)


def test_bundled_ranking_split(bundled):
    users, labels = bundled["user_id"].to_numpy(), bundled["label"].to_numpy()
    ids, counts = np.unique(users[labels > 3.5], return_counts=True)
    n_eligible = int((counts >= 5).sum())
    assert n_eligible == 603  # of 610 users, 609 have a positive and 603 have at least 5
    h = round(0.1 * n_eligible)
    assert h == 60
    split = splits.split_heldout_users(bundled)
    train, valid, test = _users(split["train"]), _users(split["valid_history"]), _users(split["test_history"])
    assert len(train) == n_eligible - 2 * h == 483
    assert len(valid) == len(test) == 60  # no held-out user loses all rows to the training-item filter
    assert not (train & valid) and not (train & test) and not (valid & test)
    assert _users(split["valid_targets"]) <= valid and _users(split["test_targets"]) <= test
    train_items = set(split["train"]["item_id"].to_pylist())
    for group in ("valid", "test"):
        history, targets = _keys(split[f"{group}_history"]), _keys(split[f"{group}_targets"])
        assert not (history & targets)
        assert {i for _, i in history | targets} <= train_items
    for name in splits.HELDOUT_PARTS:
        assert split[name]["label"].to_numpy().min() > 3.5


def test_repeated_ratings_keep_the_latest():
    table = pa.table({"user_id": [1, 1, 1, 2], "item_id": [5, 5, 6, 5], "label": [1.0, 4.5, 3.0, 2.0], "timestamp": [10, 20, 15, 1]})
    split = splits.split_ratings(table, seed=0)
    rows = sorted(r for part in split.values() for r in zip(part["user_id"].to_pylist(), part["item_id"].to_pylist(), part["label"].to_pylist()))
    assert rows == [(1, 5, 4.5), (1, 6, 3.0), (2, 5, 2.0)]
