"""The two benchmark protocols: how interactions are split into training and evaluation tables.

This module owns the split protocols of the paper's benchmarks and the layout of a split folder:

* ``rmse`` (regression, the ML10M benchmark): a random 80/10/10 train/valid/test split of the
  ratings (`split_ratings`).
* ``recall`` (ranking, the ML20M benchmark): the preprocessing of Liang et al. 2018 (VAE-CF) as used
  by the DP-ALS papers: positives only, held-out validation and test users whose positives are split
  into fold-in history and targets (`split_heldout_users`). The restriction of training to the 10%
  most frequent items is not applied here: it must use DP counts, not exact ones, so the protocol
  only records ``train_item_fraction`` and `top_items` applies it later to released counts.

A split folder holds one table per part (``<out>/<name>.parquet``) and ``<out>/split.json``, written
last, which marks the folder complete and records the protocol, the seed and the table sizes.

Both splits are deterministic functions of the *set* of input rows and the seed: rows are sorted by
(user_id, item_id, timestamp, label) before any randomness is drawn, so the input row order does not
matter, and all randomness comes from ``numpy.random.Generator(Philox(seed))``.

Privacy: splits are private tables (they are interactions); they stay in the run directory, next
to the data set they come from, and are never released. split.json holds exact sizes of private
tables, so it is private too.
"""

from __future__ import annotations

import argparse
import math

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from pipelines.datasets import Dataset
from schemas import storage
from schemas.tables import validate_interactions

DEFAULT_SEED = 1234
PROTOCOLS = ("rmse", "recall")
SPLIT_MANIFEST = "split.json"

# Regression protocol: train = floor(0.8 n), valid = floor(0.1 n), test = the rest.
RATING_PARTS = ("train", "valid", "test")

# Ranking protocol (Liang et al. 2018).
HELDOUT_PARTS = ("train", "valid_history", "valid_targets", "test_history", "test_targets")
POSITIVE_THRESHOLD = 3.5  # labels above it are positives
MIN_POSITIVES = 5  # users with fewer positives are dropped
TARGET_FRACTION = 0.2  # share of a held-out user's items that are targets
MAX_HELDOUT_USERS = 10_000  # per held-out group (validation, test), at full scale
HELDOUT_PERCENT = 10  # per held-out group, for smaller sets
TRAIN_ITEM_FRACTION = 0.1  # training keeps the top 10% items by DP count (applied later)
MIN_ELIGIBLE_USERS = 3  # one training, one validation and one test user at the very least


def _generator(seed: int) -> np.random.Generator:
    return np.random.Generator(np.random.Philox(seed))


def _canonical(interactions: pa.Table) -> pa.Table:
    """Validated interactions in canonical row order (sorted by user, item, timestamp, label), one
    row per (user, item): a repeated rating keeps only its latest (the last in that order). The
    privacy bounds count each (user, item) pair once."""
    table = validate_interactions(interactions)
    if table.num_rows == 0:
        raise ValueError("cannot split an empty interactions table")
    order = pc.sort_indices(
        table,
        sort_keys=[("user_id", "ascending"), ("item_id", "ascending"), ("timestamp", "ascending"), ("label", "ascending")],
    )  # null timestamps sort last (the default)
    table = table.take(order).combine_chunks()
    users, items = table["user_id"].to_numpy(), table["item_id"].to_numpy()
    last = np.r_[(users[1:] != users[:-1]) | (items[1:] != items[:-1]), True]
    return table if last.all() else table.filter(pa.array(last))


# ---------------------------------------------------------------------------------------------
# Regression protocol


def split_ratings(interactions: pa.Table, seed: int = DEFAULT_SEED) -> dict[str, pa.Table]:
    """Random 80/10/10 train/valid/test split of the ratings (the regression benchmark).

    Rows are sorted by (user_id, item_id, timestamp, label), then permuted with
    Generator(Philox(seed)); the first floor(0.8 n) permuted rows are train, the next
    floor(0.1 n) valid and the rest (n - floor(0.8 n) - floor(0.1 n)) test. Every table keeps the
    canonical (sorted) row order.
    """
    table = _canonical(interactions)
    n = table.num_rows
    n_train, n_valid = n * 8 // 10, n // 10  # exact integer floors, no float rounding
    perm = _generator(seed).permutation(n)
    bounds = {"train": perm[:n_train], "valid": perm[n_train : n_train + n_valid], "test": perm[n_train + n_valid :]}
    return {name: table.take(pa.array(np.sort(rows))) for name, rows in bounds.items()}


# ---------------------------------------------------------------------------------------------
# Ranking protocol


def heldout_user_count(n_eligible: int) -> int:
    """Users per held-out group: min(10000, round(0.1 n_eligible)), at least 1.

    The rounding is half-up in exact integer arithmetic ((10 n + 50) // 100). The floor of 1 only matters
    below 15 eligible users, where 10% rounds to 0; it keeps tiny data sets usable.
    """
    if n_eligible < MIN_ELIGIBLE_USERS:
        raise ValueError(f"the ranking protocol needs at least {MIN_ELIGIBLE_USERS} eligible users, got {n_eligible}")
    return max(1, min(MAX_HELDOUT_USERS, (n_eligible * HELDOUT_PERCENT + 50) // 100))


def _fold_in_split(users: np.ndarray, rng: np.random.Generator, target_fraction: float) -> np.ndarray:
    """Target mask for held-out rows (grouped by user, sorted): int(fraction * n_u) random rows per
    user with n_u >= 5 rows; users with fewer than 5 rows get no targets (all history)."""
    n = users.size
    if n == 0:
        return np.zeros(0, dtype=bool)
    starts = np.flatnonzero(np.r_[True, users[1:] != users[:-1]])
    sizes = np.diff(np.r_[starts, n])
    n_targets = np.where(sizes >= 5, np.floor(target_fraction * sizes).astype(np.int64), 0)
    # A uniformly random subset per user: rank each user's rows by a random key, keep the lowest ranks.
    keys = rng.random(n)
    order = np.lexsort((keys, users))  # by user, then by random key
    group = np.repeat(np.arange(starts.size), sizes)
    rank = np.empty(n, dtype=np.int64)
    rank[order] = np.arange(n) - starts[group]  # users are contiguous, so order keeps the groups in place
    return rank < n_targets[group]


def split_heldout_users(
    interactions: pa.Table,
    seed: int = DEFAULT_SEED,
    positive_threshold: float = POSITIVE_THRESHOLD,
    min_positives: int = MIN_POSITIVES,
    target_fraction: float = TARGET_FRACTION,
) -> dict[str, pa.Table]:
    """The ranking protocol of Liang et al. 2018 (VAE-CF), as used for ML20M by the DP-ALS papers.

    1. Rows with label > positive_threshold are the positives (labels are kept as they are); all
       other rows are dropped.
    2. Users with at least `min_positives` positives are eligible; the others are dropped.
    3. The eligible users (ascending ids) are shuffled with Generator(Philox(seed)); with
       h = `heldout_user_count(n_eligible)`, the first n - 2h are training users, the next h
       validation users and the last h test users.
    4. Held-out users' rows are restricted to the items that appear in the training users'
       positives (a held-out user left with no rows then appears in no table).
    5. Each held-out user's remaining n_u rows are split into fold-in history and targets:
       int(target_fraction * n_u) random rows are targets when n_u >= 5. Users with fewer than 5
       rows keep everything as history and have no targets (evaluation skips them).

    Returns the tables train, valid_history, valid_targets, test_history, test_targets, each in
    (user_id, item_id, timestamp, label) order.
    """
    if not 0.0 <= target_fraction < 1.0:
        raise ValueError(f"target_fraction must be in [0, 1), got {target_fraction}")
    table = _canonical(interactions)
    table = table.filter(pc.greater(table["label"], positive_threshold))
    users = table["user_id"].to_numpy()
    ids, counts = np.unique(users, return_counts=True)
    eligible = ids[counts >= min_positives]
    h = heldout_user_count(eligible.size)
    rng = _generator(seed)
    shuffled = eligible[rng.permutation(eligible.size)]
    n_train_users = eligible.size - 2 * h
    groups = {
        "train": shuffled[:n_train_users],
        "valid": shuffled[n_train_users : n_train_users + h],
        "test": shuffled[n_train_users + h :],
    }

    items = table["item_id"].to_numpy()
    train_mask = np.isin(users, groups["train"])
    train_items = np.unique(items[train_mask])
    known_item = np.isin(items, train_items)
    split = {"train": table.filter(pa.array(train_mask))}
    for name in ("valid", "test"):
        mask = np.isin(users, groups[name]) & known_item
        rows = np.flatnonzero(mask)
        target = _fold_in_split(users[rows], rng, target_fraction)
        split[f"{name}_history"] = table.take(pa.array(rows[~target]))
        split[f"{name}_targets"] = table.take(pa.array(rows[target]))
    return split


def top_items(item_ids: np.ndarray, counts: np.ndarray, fraction: float = TRAIN_ITEM_FRACTION) -> np.ndarray:
    """The ids of the ceil(fraction * m) items with the largest counts, sorted ascending.

    Meant for DP (noised) counts: the ranking protocol restricts training to the top 10% items, and
    choosing them from exact counts would leak. Ties are broken by the smaller item id.
    """
    item_ids, counts = np.asarray(item_ids), np.asarray(counts, dtype=np.float64)
    if item_ids.ndim != 1 or counts.shape != item_ids.shape:
        raise ValueError(f"item_ids and counts must be 1-D arrays of one length, got shapes {item_ids.shape} and {counts.shape}")
    if not 0.0 < fraction <= 1.0:
        raise ValueError(f"fraction must be in (0, 1], got {fraction}")
    if not np.all(np.isfinite(counts)):
        raise ValueError("counts must be finite")
    if np.unique(item_ids).size != item_ids.size:
        raise ValueError("item_ids must be unique")
    m = item_ids.size
    keep = math.ceil(round(fraction * m, 9))  # round first: 0.1 * 30 is 3.0000000000000004 in floats
    order = np.lexsort((item_ids, -counts))  # largest count first, then smaller id
    return np.sort(item_ids[order[:keep]])


# ---------------------------------------------------------------------------------------------
# Split folders


def _sizes(split: dict[str, pa.Table]) -> dict[str, dict[str, int]]:
    return {
        name: {"rows": table.num_rows, "users": int(pc.count_distinct(table["user_id"]).as_py())}
        for name, table in split.items()
    }


def write_split(split: dict[str, pa.Table], out: str, manifest: dict) -> dict:
    """Write each table to ``<out>/<name>.parquet``, then ``<out>/split.json`` last.

    split.json is `manifest` plus ``sizes`` ({name: {"rows", "users"}}); it is returned. An earlier
    split.json is removed first, so the folder reads as incomplete until the new one lands.
    """
    storage.remove(storage.join(out, SPLIT_MANIFEST))
    for name, table in split.items():
        storage.write_table(table, storage.join(out, f"{name}.parquet"))
    document = {**manifest, "sizes": _sizes(split)}
    storage.write_json(document, storage.join(out, SPLIT_MANIFEST))
    return document


def make_split(data: Dataset, protocol: str, out: str, seed: int = DEFAULT_SEED) -> dict:
    """Split a data set's interactions with a protocol ("rmse" or "recall") into `out`; returns split.json."""
    if protocol not in PROTOCOLS:
        raise ValueError(f"unknown protocol {protocol!r}; choose one of {', '.join(PROTOCOLS)}")
    interactions = storage.read_table(data.interactions)
    if interactions.num_rows == 0:
        raise ValueError(f"{data.path} has no interactions to split")
    manifest = {"protocol": protocol, "seed": int(seed), "source": data.path}
    if protocol == "rmse":
        split = split_ratings(interactions, seed)
        manifest["fractions"] = {"train": 0.8, "valid": 0.1, "test": 0.1}
    else:
        split = split_heldout_users(interactions, seed, POSITIVE_THRESHOLD, MIN_POSITIVES, TARGET_FRACTION)
        n_eligible = _eligible_users(interactions)
        manifest.update(
            positive_threshold=POSITIVE_THRESHOLD,
            min_positives=MIN_POSITIVES,
            target_fraction=TARGET_FRACTION,
            train_item_fraction=TRAIN_ITEM_FRACTION,
            n_eligible_users=n_eligible,
            # Users drawn per held-out group; a drawn user whose rows all fall outside the training
            # items appears in no table, so the tables' user counts can be smaller.
            n_heldout=heldout_user_count(n_eligible),
        )
    return write_split(split, out, manifest)


def _eligible_users(interactions: pa.Table) -> int:
    """Users with at least MIN_POSITIVES labels above POSITIVE_THRESHOLD."""
    users = interactions.filter(pc.greater(interactions["label"], POSITIVE_THRESHOLD))["user_id"].to_numpy()
    _, counts = np.unique(users, return_counts=True)
    return int((counts >= MIN_POSITIVES).sum())


# ---------------------------------------------------------------------------------------------
# CLI hooks (`ssp split`)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Add the `ssp split` options to a parser."""
    parser.add_argument("--data", metavar="DIR", help="MovieLens folder or data set folder written by ssp ingest / ssp synth (default: the bundled ml-latest-small)")
    parser.add_argument(
        "--protocol",
        required=True,
        choices=PROTOCOLS,
        help="rmse: random 80/10/10 split of the ratings; recall: Liang et al. 2018 held-out users "
        "(positives > 3.5, users with >= 5 positives, 80/20 fold-in history/targets)",
    )
    parser.add_argument("--out", metavar="DIR", required=True, help="folder for the split tables and split.json (private: keep it in the run directory)")
    parser.add_argument("--seed", type=int, default=DEFAULT_SEED, help=f"seed of the Philox generator (default {DEFAULT_SEED})")


def run(args: argparse.Namespace, data: Dataset) -> int:
    """Make the split and print one line per table (rows and users)."""
    document = make_split(data, args.protocol, args.out, args.seed)
    width = max(len(name) for name in document["sizes"])
    for name, size in document["sizes"].items():
        print(f"{name:<{width}}  rows={size['rows']}  users={size['users']}")
    return 0
