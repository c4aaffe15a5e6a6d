"""The two benchmark protocols: row-local (keyed-hash) assignment, neighbouring data sets, fixed
fractions, determinism, and the Liang et al. rules."""

import argparse
import hashlib
import json
import math
import os

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.csv as pacsv
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from pipelines.data import splits
from pipelines.data.datasets import open_dataset, write_dataset
from pipelines.engines.local import LocalEngine
from schemas import storage
from schemas.errors import UserError
from schemas.tables import INTERACTIONS, items_schema

RATINGS_CSV = os.path.join(
    os.path.dirname(__file__), "..", "..", "..", "pipelines", "data", "ml-latest-small", "ratings.csv"
)


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


def _random_ratings(n, seed=0, n_users=100):
    rng = np.random.default_rng(seed)
    # Distinct (user, item) pairs, so every row is identified by its key.
    keys = rng.choice(n_users * 1000, size=n, replace=False)
    return _table(keys // 1000, keys % 1000, rng.integers(1, 11, n) / 2.0, rng.integers(0, 10**9, n))


def _keys(table):
    return set(zip(table["user_id"].to_pylist(), table["item_id"].to_pylist(), strict=True))


def _rows(table):
    return sorted(zip(*(table[c].to_pylist() for c in table.column_names), strict=True))


def _users(table):
    return set(table["user_id"].to_pylist())


def _without(table, user):
    return table.filter(pc.not_equal(table["user_id"], user))


def _within_5_sigma(count, n, p):
    """|count - n p| <= 5 sqrt(n p (1 - p)): a binomial count misses it with probability < 6e-7, and
    the tables and seeds below are fixed, so a pass is a pass for good."""
    return abs(count - n * p) <= 5 * math.sqrt(n * p * (1 - p))


# ---------------------------------------------------------------------------------------------
# Neighbouring data sets: removing a user's rows removes exactly those rows from every part


# Small tables with repeated (user, item) ratings (the dedup keeps the latest), few users and items
# so that users share items, and labels on both sides of the positive threshold.
_interactions = st.lists(
    st.tuples(
        st.integers(0, 7), st.integers(0, 11), st.sampled_from([1.0, 2.0, 3.0, 3.5, 4.0, 4.5, 5.0]), st.integers(0, 3)
    ),
    min_size=1,
    max_size=80,
)
_holdouts = st.one_of(st.sampled_from([0.0, 0.02, 0.2, 0.5, 0.9]), st.floats(0.0, 0.99))


@st.composite
def _positive_interactions(draw):
    """For the ranking protocol: up to 8 users with 0..16 rows each (repeats included), mostly
    positives, so that users are eligible and held-out users have the 5 rows that targets need."""
    rows = []
    for user in range(draw(st.integers(1, 8))):
        k = draw(st.integers(0, 16))
        items = draw(st.lists(st.integers(0, 14), min_size=k, max_size=k))
        labels = draw(st.lists(st.sampled_from([2.0, 4.0, 4.5, 5.0]), min_size=k, max_size=k))
        rows += [(user, item, label, t) for t, (item, label) in enumerate(zip(items, labels, strict=True))]
    return rows or [(0, 0, 5.0, 0)]


def _from_rows(rows):
    users, items, labels, timestamps = zip(*rows, strict=True)
    return _table(users, items, labels, timestamps)


def _assert_neighbouring(split_d, split_without_u, user):
    assert split_d.keys() == split_without_u.keys()
    for name, part in split_d.items():
        assert split_without_u[name].equals(_without(part, user)), name


@settings(max_examples=200, deadline=None)
@given(rows=_interactions, pick=st.integers(0, 10**6), seed=st.integers(-(2**40), 2**40), holdout=_holdouts)
def test_rating_split_of_a_neighbour_is_the_split_minus_the_user(rows, pick, seed, holdout):
    table = _from_rows(rows)
    users = sorted(_users(table))
    user = users[pick % len(users)]
    neighbour = _without(table, user)
    split = splits.split_ratings(table, seed, holdout)
    if neighbour.num_rows == 0:  # the user was the only one (an empty table is refused)
        assert all(_users(part) <= {user} for part in split.values())
        return
    _assert_neighbouring(split, splits.split_ratings(neighbour, seed, holdout), user)


@settings(max_examples=200, deadline=None)
@given(
    rows=_positive_interactions(),
    pick=st.integers(0, 10**6),
    seed=st.integers(-(2**40), 2**40),
    holdout=_holdouts,
    min_positives=st.integers(1, 5),
)
def test_ranking_split_of_a_neighbour_is_the_split_minus_the_user(rows, pick, seed, holdout, min_positives):
    # Without the (evaluation-only) restriction of held-out rows to training items, every part is
    # row-local given the user-local eligibility and < 5 rows rules.
    table = _from_rows(rows)
    users = sorted(_users(table))
    user = users[pick % len(users)]
    neighbour = _without(table, user)

    def split(t):
        try:
            return splits.split_heldout_users(
                t, seed, min_positives=min_positives, holdout=holdout, restrict_to_train_items=False
            )
        except ValueError as error:  # no eligible user (or no row) left
            return str(error)

    whole, without = split(table), split(neighbour)
    if isinstance(without, str):  # nobody but `user` was eligible: the other users are in no part
        assert isinstance(whole, str) or all(_users(part) <= {user} for part in whole.values())
        return
    _assert_neighbouring(whole, without, user)


@settings(max_examples=200, deadline=None)
@given(rows=_positive_interactions(), pick=st.integers(0, 10**6), seed=st.integers(0, 2**32), holdout=_holdouts)
def test_ranking_split_train_part_is_row_local_with_the_item_restriction(rows, pick, seed, holdout):
    # The protocol's default restricts held-out rows to the items of the training positives. The
    # training table (the only one that feeds releases) stays exactly row-local; the held-out tables
    # are row-local whenever the training items stay the same (the restriction couples only them).
    table = _from_rows(rows)
    user = sorted(_users(table))[pick % len(_users(table))]
    try:
        whole = splits.split_heldout_users(table, seed, min_positives=2, holdout=holdout)
        without = splits.split_heldout_users(_without(table, user), seed, min_positives=2, holdout=holdout)
    except ValueError:
        return
    assert without["train"].equals(_without(whole["train"], user))
    train_items = set(whole["train"]["item_id"].to_pylist())
    if set(without["train"]["item_id"].to_pylist()) == train_items:
        _assert_neighbouring(whole, without, user)
    unrestricted = splits.split_heldout_users(
        table, seed, min_positives=2, holdout=holdout, restrict_to_train_items=False
    )
    assert unrestricted["train"].equals(whole["train"])
    for group in ("valid", "test"):  # the restriction only drops held-out rows on items no training user has
        held = _keys(whole[f"{group}_history"]) | _keys(whole[f"{group}_targets"])
        assert held == {
            (u, i)
            for u, i in _keys(unrestricted[f"{group}_history"]) | _keys(unrestricted[f"{group}_targets"])
            if i in train_items
        }


@settings(max_examples=100, deadline=None)
@given(rows=_interactions, seed=st.integers(0, 2**32), holdout=_holdouts, order=st.randoms(use_true_random=False))
def test_splits_ignore_row_order(rows, seed, holdout, order):
    table = _from_rows(rows)
    permutation = list(range(table.num_rows))
    order.shuffle(permutation)
    shuffled = table.take(pa.array(permutation, pa.int64()))
    first, again = splits.split_ratings(table, seed, holdout), splits.split_ratings(shuffled, seed, holdout)
    for name in splits.RATING_PARTS:
        assert first[name].equals(again[name])
    try:
        first = splits.split_heldout_users(table, seed, min_positives=1, holdout=holdout)
    except ValueError:
        return
    again = splits.split_heldout_users(shuffled, seed, min_positives=1, holdout=holdout)
    for name in splits.HELDOUT_PARTS:
        assert first[name].equals(again[name])


@settings(max_examples=100, deadline=None)
@given(rows=_interactions, seed=st.integers(-(2**40), 2**40))
def test_holdout_zero_trains_on_every_row(rows, seed):
    table = _from_rows(rows)
    canonical = splits.split_ratings(table, seed, 0.2)
    everything = pa.concat_tables([canonical[name] for name in splits.RATING_PARTS]).sort_by(
        [(c, "ascending") for c in INTERACTIONS.names]
    )
    split = splits.split_ratings(table, seed, 0.0)
    assert split["train"].equals(everything)  # deduplicated, in canonical order
    assert split["valid"].num_rows == split["test"].num_rows == 0
    try:
        ranked = splits.split_heldout_users(table, seed, min_positives=1, holdout=0.0)
    except ValueError:
        return
    labels = everything["label"].to_numpy()
    assert ranked["train"].equals(
        everything.filter(pa.array(labels > 3.5))
    )  # every positive of every eligible (here: every) user
    assert all(ranked[name].num_rows == 0 for name in splits.HELDOUT_PARTS[1:])


def test_row_uniform_is_a_keyed_hash_of_the_row_alone():
    users, items = np.array([5, 5, 7, -3]), np.array([1, 2, 1, 2**40])
    x = splits.row_uniform(9, "rmse-row", users, items)
    assert x.dtype == np.float64 and np.all((0 <= x) & (x < 1)) and np.unique(x).size == 4
    # One row at a time gives the same numbers: nothing depends on the other rows.
    assert [splits.row_uniform(9, "rmse-row", users[k : k + 1], items[k : k + 1])[0] for k in range(4)] == x.tolist()
    assert not np.array_equal(x, splits.row_uniform(10, "rmse-row", users, items))  # keyed by the seed
    assert not np.array_equal(x, splits.row_uniform(9, "recall-target", users, items))  # and by the purpose
    assert not np.array_equal(x, splits.row_uniform(9, "rmse-row", items, users))  # (u, i) is not (i, u)


def _splitmix(x: int) -> int:
    mask = 2**64 - 1
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & mask
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & mask
    return x ^ (x >> 31)


def test_row_uniform_is_the_documented_splitmix64_chain():
    """The split's row hash from its definition, in Python integers: the key is the first 8 bytes
    (little-endian) of BLAKE2b("ssp-split-v1/purpose/seed"); column k (from 1) is absorbed as
    h <- mix(h ^ mix(value + k * golden)) with negative ids as their 64-bit two's complement; the
    number is the top 53 bits over 2^53. The rows' parts follow from it (train below 1 - holdout)."""
    users, items = np.array([5, 7, -3, 2**62]), np.array([1, 1, 2**40, -(2**63)])
    key = int.from_bytes(hashlib.blake2b(b"ssp-split-v1/rmse-row/9", digest_size=8).digest(), "little")
    golden, mask = 0x9E3779B97F4A7C15, 2**64 - 1
    expected = []
    for user, item in zip(users.tolist(), items.tolist(), strict=True):
        h = key
        for position, value in enumerate((user, item), start=1):
            h = _splitmix(h ^ _splitmix(((value & mask) + position * golden) & mask))
        expected.append((h >> 11) / 2.0**53)
    assert splits.row_uniform(9, "rmse-row", users, items).tolist() == expected
    with pytest.raises(UserError, match="equally long"):
        splits.row_uniform(9, "rmse-row", users, items[:2])


@pytest.mark.parametrize("holdout", [-0.1, 1.0, 1.5, float("nan"), float("inf"), "x"])
def test_holdout_out_of_range_is_refused(holdout):
    with pytest.raises(ValueError, match="holdout"):
        splits.split_ratings(_random_ratings(10), holdout=holdout)
    with pytest.raises(ValueError, match="holdout"):
        splits.split_heldout_users(_random_ratings(10), holdout=holdout)


# ---------------------------------------------------------------------------------------------
# Fixed fractions (binomial part sizes)


@pytest.mark.parametrize("holdout", [0.2, 0.02, 0.5])
def test_rating_split_fractions_are_the_fixed_ones(holdout):
    n = 20_000
    split = splits.split_ratings(_random_ratings(n, seed=11), seed=5, holdout=holdout)
    for name, p in (("train", 1 - holdout), ("valid", holdout / 2), ("test", holdout / 2)):
        assert _within_5_sigma(split[name].num_rows, n, p), (name, split[name].num_rows, n * p)
    assert sum(split[name].num_rows for name in splits.RATING_PARTS) == n


def test_ranking_split_fractions_are_the_fixed_ones():
    # 20,000 users with 6..10 positives each (all eligible) and a negative each.
    rng = np.random.default_rng(4)
    sizes = rng.integers(6, 11, 20_000)
    users = np.repeat(np.arange(20_000), sizes + 1)
    items = np.concatenate([rng.choice(400, size=k + 1, replace=False) for k in sizes])
    labels = np.concatenate([np.r_[np.full(k, 4.5), 2.0] for k in sizes])
    split = splits.split_heldout_users(_table(users, items, labels), seed=3, restrict_to_train_items=False)
    n_users = 20_000
    groups = {g: _users(split[f"{g}_history"]) | _users(split[f"{g}_targets"]) for g in ("valid", "test")}
    assert _within_5_sigma(len(_users(split["train"])), n_users, 0.8)
    assert _within_5_sigma(len(groups["valid"]), n_users, 0.1) and _within_5_sigma(len(groups["test"]), n_users, 0.1)
    held_rows = sum(split[name].num_rows for name in splits.HELDOUT_PARTS[1:])
    targets = split["valid_targets"].num_rows + split["test_targets"].num_rows
    assert _within_5_sigma(
        targets, held_rows, 0.2
    )  # every held-out user has >= 6 rows: each row is a target with probability 0.2
    assert split["train"].num_rows + held_rows == int(sizes.sum())


# ---------------------------------------------------------------------------------------------
# Regression protocol


def test_rating_split_follows_the_hash_rule():
    table = _random_ratings(1000)
    split = splits.split_ratings(table, seed=77, holdout=0.3)
    x = splits.row_uniform(77, "rmse-row", table["user_id"].to_numpy(), table["item_id"].to_numpy())
    keys = list(zip(table["user_id"].to_pylist(), table["item_id"].to_pylist(), strict=True))
    expected = {
        "train": {k for k, v in zip(keys, x, strict=True) if v < 0.7},
        "valid": {k for k, v in zip(keys, x, strict=True) if 0.7 <= v < 0.85},
        "test": {k for k, v in zip(keys, x, strict=True) if v >= 0.85},
    }
    assert {name: _keys(split[name]) for name in splits.RATING_PARTS} == expected
    assert all(expected.values())


def test_rating_split_is_a_partition_of_the_rows():
    table = _random_ratings(1000)
    split = splits.split_ratings(table)
    parts = [_keys(split[name]) for name in ("train", "valid", "test")]
    assert not (parts[0] & parts[1]) and not (parts[0] & parts[2]) and not (parts[1] & parts[2])
    assert parts[0] | parts[1] | parts[2] == _keys(table)
    # Whole rows travel, labels and timestamps included, and the schema is the canonical one.
    assert sorted(sum((_rows(split[name]) for name in split), [])) == _rows(table)
    assert all(split[name].schema.equals(INTERACTIONS) for name in split)
    for name in split:  # canonical (user, item) order
        keys = list(zip(split[name]["user_id"].to_pylist(), split[name]["item_id"].to_pylist(), strict=True))
        assert keys == sorted(keys)


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


def test_rating_split_holdout_only_moves_rows_out_of_train():
    # One hash number per row, compared with the fractions: a larger holdout takes more rows out of
    # train and never puts one back.
    table = _random_ratings(2000)
    small, large = splits.split_ratings(table, holdout=0.02), splits.split_ratings(table, holdout=0.2)
    assert _keys(large["train"]) < _keys(small["train"])


def test_rating_split_rejects_empty_input():
    with pytest.raises(ValueError, match="empty"):
        splits.split_ratings(_table([], [], []))


# ---------------------------------------------------------------------------------------------
# Ranking protocol


def _groups(ids, seed=splits.DEFAULT_SEED, holdout=0.2):
    """The documented group rule: train below 1 - h, valid below 1 - h/2, test above."""
    x = splits.row_uniform(seed, "recall-user", np.asarray(list(ids), np.int64))
    bounds = {"train": (0.0, 1 - holdout), "valid": (1 - holdout, 1 - holdout / 2), "test": (1 - holdout / 2, 1.0)}
    return {g: {int(u) for u, v in zip(ids, x, strict=True) if lo <= v < hi} for g, (lo, hi) in bounds.items()}


def _is_target(user, item, seed=splits.DEFAULT_SEED, fraction=0.2):
    return splits.row_uniform(seed, "recall-target", np.array([user]), np.array([item]))[0] < fraction


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
    expected = _groups(range(30))  # seed 1234: 25 training, 4 validation and 1 test user
    assert [len(expected[g]) for g in ("train", "valid", "test")] == [25, 4, 1]
    valid, test, train = _users(split["valid_history"]), _users(split["test_history"]), _users(split["train"])
    assert (train, valid, test) == (
        expected["train"],
        expected["valid"],
        expected["test"],
    )  # user 999 (4 positives) is gone
    assert set(split["train"]["label"].to_pylist()) <= {4.0, 5.0}
    # Training users keep all 11 positives, their own item included.
    assert split["train"].num_rows == 25 * 11
    for u in train:
        assert (u, 1000 + u) in _keys(split["train"])
    # Held-out users lose their own item (no training user has it): 10 rows, each a target by its hash.
    for group in ("valid", "test"):
        history, targets = _keys(split[f"{group}_history"]), _keys(split[f"{group}_targets"])
        for u in expected[group]:
            h = {i for uu, i in history if uu == u}
            t = {i for uu, i in targets if uu == u}
            assert not (h & t) and h | t == set(range(10))
            assert t == {i for i in range(10) if _is_target(u, i)}
    assert split["valid_targets"].num_rows + split["test_targets"].num_rows > 0


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
    eligible = sorted(ids[counts >= 5].tolist())
    expected = _groups(eligible)
    split = splits.split_heldout_users(table)

    train = _users(split["train"])
    assert train == expected["train"]
    assert split["train"].num_rows == int(np.isin(users[positive], list(train)).sum())
    train_items = set(split["train"]["item_id"].to_pylist())
    held_users = {g: _users(split[f"{g}_history"]) | _users(split[f"{g}_targets"]) for g in ("valid", "test")}
    assert held_users["valid"] <= expected["valid"] and held_users["test"] <= expected["test"]

    positives_on_train_items = {}
    for u, i in zip(users[positive], items[positive], strict=True):
        if i in train_items:
            positives_on_train_items.setdefault(int(u), set()).add(int(i))
    assert held_users["valid"] | held_users["test"] == (expected["valid"] | expected["test"]) & set(
        positives_on_train_items
    )
    seen = {"large": 0, "small": 0}
    for group in ("valid", "test"):
        history, targets = _keys(split[f"{group}_history"]), _keys(split[f"{group}_targets"])
        for u in held_users[group]:
            hist = {i for uu, i in history if uu == u}
            targ = {i for uu, i in targets if uu == u}
            assert not (hist & targ)
            assert hist | targ == positives_on_train_items[u]  # restricted to training items, nothing else lost
            n_u = len(hist) + len(targ)
            assert targ == ({i for i in hist | targ if _is_target(u, i)} if n_u >= 5 else set())
            seen["large" if n_u >= 5 else "small"] += 1
    assert seen["large"] > 0 and split["valid_targets"].num_rows > 0 and split["test_targets"].num_rows > 0


def test_ranking_split_users_with_few_rows_keep_everything_as_history():
    # Shared items 0..4 for all users; each user also has 4 private items. Held-out users keep only
    # the shared ones (restricted to training items): 5 rows (odd users) or 2 rows (even users), and
    # under 5 rows means no targets, whatever the hash says.
    users, items, labels = [], [], []
    for u in range(200):
        shared = range(5) if u % 2 else range(2)
        for i in shared:
            users.append(u), items.append(i), labels.append(4.0)
        for j in range(4):
            users.append(u), items.append(1000 + 10 * u + j), labels.append(4.0)
    table = _table(users, items, labels)
    for fraction in (0.2, 0.5):
        split = splits.split_heldout_users(table, target_fraction=fraction)
        held = (
            _users(split["valid_history"])
            | _users(split["test_history"])
            | _users(split["valid_targets"])
            | _users(split["test_targets"])
        )
        assert held == _groups(range(200))["valid"] | _groups(range(200))["test"]
        targets = _keys(split["valid_targets"]) | _keys(split["test_targets"])
        for u in held:
            shared = range(5) if u % 2 else range(2)
            assert {i for uu, i in targets if uu == u} == (
                {i for i in shared if _is_target(u, i, fraction=fraction)} if u % 2 else set()
            )
        # The rule was exercised: some 2-row user has an item the hash would have made a target.
        assert any(_is_target(u, i, fraction=fraction) for u in held if u % 2 == 0 for i in range(2))


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


def test_ranking_split_needs_an_eligible_user():
    rows = [(u, i) for u in range(3) for i in range(5)]
    table = _table([u for u, _ in rows], [i for _, i in rows], [5.0] * len(rows))
    split = splits.split_heldout_users(table.slice(0, 5))  # one eligible user: in one group, whichever its hash says
    (group,) = [g for g, members in _groups([0]).items() if members]
    assert _users(split["train" if group == "train" else f"{group}_history"]) == {0}
    with pytest.raises(ValueError, match="at least 5 positives"):
        splits.split_heldout_users(table.slice(0, 4))
    with pytest.raises(ValueError, match="empty"):
        splits.split_heldout_users(table.slice(0, 0))


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
    document = splits.make_split(data, "rmse", out, seed=7, engine=LocalEngine())
    on_disk = json.loads((tmp_path / "split" / "split.json").read_text())
    assert on_disk == document
    assert document["protocol"] == "rmse" and document["seed"] == 7 and document["holdout"] == 0.2
    assert document["fractions"] == {"train": 0.8, "valid": 0.1, "test": 0.1}
    expected = splits.split_ratings(table, seed=7)
    assert sum(size["rows"] for size in document["sizes"].values()) == 1000
    for name in ("train", "valid", "test"):
        read = storage.read_table(storage.join(out, f"{name}.parquet"))
        assert read.equals(expected[name])
        assert document["sizes"][name] == {"rows": read.num_rows, "users": len(_users(read))}


def test_make_split_holdout_zero(tmp_path):
    data = _dataset(tmp_path / "data", _random_ratings(1000))
    document = splits.make_split(data, "rmse", str(tmp_path / "rmse"), holdout=0, engine=LocalEngine())
    assert document["holdout"] == 0.0 and document["fractions"] == {"train": 1.0, "valid": 0.0, "test": 0.0}
    assert {name: size["rows"] for name, size in document["sizes"].items()} == {"train": 1000, "valid": 0, "test": 0}
    data = _dataset(tmp_path / "ranking", _hand_ranking_table())
    document = splits.make_split(data, "recall", str(tmp_path / "recall"), holdout=0.0, engine=LocalEngine())
    assert document["sizes"]["train"] == {"rows": 30 * 11, "users": 30}
    assert all(document["sizes"][name]["rows"] == 0 for name in splits.HELDOUT_PARTS[1:])
    with pytest.raises(ValueError, match="holdout"):
        splits.make_split(data, "recall", str(tmp_path / "bad"), holdout=1.0, engine=LocalEngine())
    assert not (tmp_path / "bad").exists()


def test_make_split_recall_round_trip(tmp_path):
    data = _dataset(tmp_path / "data", _hand_ranking_table())
    out = str(tmp_path / "split")
    document = splits.make_split(data, "recall", out, engine=LocalEngine())
    assert json.loads((tmp_path / "split" / "split.json").read_text()) == document
    assert document["protocol"] == "recall" and document["seed"] == 1234 and document["holdout"] == 0.2
    assert (
        document["train_item_fraction"] == 0.1
        and document["n_eligible_users"] == 30
        and document["target_fraction"] == 0.2
    )
    assert document["user_fractions"] == {"train": 0.8, "valid": 0.1, "test": 0.1}
    expected = splits.split_heldout_users(_hand_ranking_table())
    for name in splits.HELDOUT_PARTS:
        read = storage.read_table(storage.join(out, f"{name}.parquet"))
        assert read.equals(expected[name])
        assert document["sizes"][name] == {"rows": read.num_rows, "users": len(_users(read))}
    assert document["sizes"]["train"] == {"rows": 25 * 11, "users": 25}


def test_the_positives_follow_the_declared_rating_scale_or_the_flag(spark, tmp_path):
    """On a 1..10 scale the positives are the top 30% (above 7.3: 8, 9, 10), not "above 3.5"; on
    MovieLens' 0.5..5 (and data that declares no scale) 4 and up, as the papers'. --positive-threshold
    overrides it; implicit feedback keeps every row and refuses the flag. Checked through `ssp split`,
    on the default engine: the test session's Spark (`spark`), which the command uses as it finds it."""
    from ssp import cli

    assert splits.scale_threshold((1.0, 10.0)) == pytest.approx(7.3) and splits.POSITIVE_THRESHOLD == pytest.approx(
        3.65
    )
    mine = [
        8.0,
        9.0,
        10.0,
        8.0,
        9.0,
        4.0,
        3.0,
        7.0,
        2.0,
        10.0,
    ]  # every user's labels: 6 above 7.3, 8 above 3.5 (or 3.65)
    labels = mine * 10
    table = _table(np.repeat(np.arange(10), 10), np.tile(np.arange(10), 10), labels)
    catalog = pa.table({"item_id": np.arange(10), "title": [f"item {i}" for i in range(10)]}, schema=items_schema({}))
    write_dataset(str(tmp_path / "ten"), catalog, table.to_batches(), {"source": "test", "rating_scale": [1.0, 10.0]})
    write_dataset(str(tmp_path / "undeclared"), catalog, table.to_batches(), {"source": "test"})
    write_dataset(str(tmp_path / "implicit"), catalog, table.to_batches(), {"source": "test", "feedback": "implicit"})
    for data, flags, want in (
        ("ten", [], 7.3),
        ("ten", ["--positive-threshold", "3.5"], 3.5),
        ("undeclared", [], 3.65),
        ("implicit", [], None),
    ):
        out = tmp_path / f"split-{data}-{len(flags)}"
        assert (
            cli.main(
                [
                    "split",
                    "--data",
                    str(tmp_path / data),
                    "--protocol",
                    "recall",
                    "--holdout",
                    "0",
                    "--out",
                    str(out),
                    *flags,
                ]
            )
            == 0
        )
        document = json.loads((out / "split.json").read_text())
        assert document["positive_threshold"] == (None if want is None else pytest.approx(want))
        assert document["sizes"]["train"]["rows"] == 10 * {None: 10, 7.3: 6, 3.5: 8, 3.65: 8}[want], (data, flags)
    assert (
        cli.main(
            [
                "split",
                "--data",
                str(tmp_path / "implicit"),
                "--protocol",
                "recall",
                "--out",
                str(tmp_path / "bad"),
                "--positive-threshold",
                "5",
            ]
        )
        == 2
    )
    assert not (tmp_path / "bad").exists()


def test_make_split_errors(tmp_path):
    data = _dataset(tmp_path / "data", _random_ratings(20))
    with pytest.raises(ValueError, match="unknown protocol 'ndcg'"):
        splits.make_split(data, "ndcg", str(tmp_path / "out"), engine=LocalEngine())
    with pytest.raises(ValueError, match="at least 5 positives"):
        splits.make_split(
            _dataset(tmp_path / "few", _table([1] * 4, range(4), [5.0] * 4)),
            "recall",
            str(tmp_path / "out"),
            engine=LocalEngine(),
        )
    empty = _dataset(tmp_path / "empty", _table([], [], []))
    with pytest.raises(ValueError, match="no interactions"):
        splits.make_split(empty, "rmse", str(tmp_path / "out"), engine=LocalEngine())
    assert not (tmp_path / "out" / "split.json").exists()


def test_cli_hooks(tmp_path, capsys):
    data = _dataset(tmp_path / "data", _random_ratings(1000))
    parser = argparse.ArgumentParser()
    splits.add_arguments(parser)
    args = parser.parse_args(["--data", str(tmp_path / "data"), "--protocol", "rmse", "--out", str(tmp_path / "split")])
    assert args.seed == 1234 and args.holdout == 0.2
    assert splits.run(args, data, LocalEngine()) == 0
    lines = capsys.readouterr().out.splitlines()
    assert [line.split()[0] for line in lines] == ["train", "valid", "test"]
    rows = [int(line.split()[1].removeprefix("rows=")) for line in lines]
    assert sum(rows) == 1000 and rows == [
        splits.split_ratings(_random_ratings(1000))[name].num_rows for name in splits.RATING_PARTS
    ]
    args = parser.parse_args(
        ["--data", str(tmp_path / "data"), "--protocol", "rmse", "--out", str(tmp_path / "all"), "--holdout", "0"]
    )
    assert splits.run(args, data, LocalEngine()) == 0
    assert capsys.readouterr().out.splitlines()[0].split()[:2] == ["train", "rows=1000"]
    with pytest.raises(SystemExit):
        parser.parse_args(["--protocol", "ndcg", "--out", "x"])
    with pytest.raises(SystemExit):
        parser.parse_args(["--protocol", "rmse"])  # --out is required


# ---------------------------------------------------------------------------------------------
# The bundled MovieLens sample (read directly, independent of pipelines.data.movielens)


@pytest.fixture(scope="module")
def bundled():
    table = pacsv.read_csv(RATINGS_CSV)
    assert table.column_names == ["userId", "movieId", "rating", "timestamp"]
    return table.rename_columns(["user_id", "item_id", "label", "timestamp"]).cast(INTERACTIONS)


def test_bundled_rating_split_sizes(bundled):
    # 100836 rows, each train / valid / test with probability 0.8 / 0.1 / 0.1 by its hash (seed 1234).
    assert bundled.num_rows == 100_836
    split = splits.split_ratings(bundled)
    sizes = [split[n].num_rows for n in ("train", "valid", "test")]
    assert sizes == [80_688, 10_091, 10_057]  # pinned: the hash is part of the protocol
    assert all(_within_5_sigma(size, 100_836, p) for size, p in zip(sizes, (0.8, 0.1, 0.1), strict=True))
    assert sum(len(_keys(split[n])) for n in split) == 100_836
    assert _keys(split["train"]) | _keys(split["valid"]) | _keys(split["test"]) == _keys(bundled)


def test_bundled_ranking_split(bundled):
    users, labels = bundled["user_id"].to_numpy(), bundled["label"].to_numpy()
    ids, counts = np.unique(users[labels > 3.5], return_counts=True)
    eligible = ids[counts >= 5]
    assert eligible.size == 603  # of 610 users, 609 have a positive and 603 have at least 5
    expected = _groups(eligible.tolist())
    split = splits.split_heldout_users(bundled)
    train, valid, test = _users(split["train"]), _users(split["valid_history"]), _users(split["test_history"])
    assert (len(train), len(valid), len(test)) == (
        479,
        55,
        69,
    )  # pinned (seed 1234); no held-out user loses all rows to the training-item filter
    assert (train, valid, test) == (expected["train"], expected["valid"], expected["test"])
    assert _users(split["valid_targets"]) <= valid and _users(split["test_targets"]) <= test
    train_items = set(split["train"]["item_id"].to_pylist())
    for group in ("valid", "test"):
        history, targets = _keys(split[f"{group}_history"]), _keys(split[f"{group}_targets"])
        assert not (history & targets)
        assert {i for _, i in history | targets} <= train_items
    for name in splits.HELDOUT_PARTS:
        assert split[name]["label"].to_numpy().min() > 3.5


def test_repeated_ratings_keep_the_latest():
    table = pa.table(
        {"user_id": [1, 1, 1, 2], "item_id": [5, 5, 6, 5], "label": [1.0, 4.5, 3.0, 2.0], "timestamp": [10, 20, 15, 1]}
    )
    for holdout in (0.2, 0.0):
        split = splits.split_ratings(table, seed=0, holdout=holdout)
        rows = sorted(
            r
            for part in split.values()
            for r in zip(
                part["user_id"].to_pylist(), part["item_id"].to_pylist(), part["label"].to_pylist(), strict=True
            )
        )
        assert rows == [(1, 5, 4.5), (1, 6, 3.0), (2, 5, 2.0)]
