"""The two benchmark protocols: how interactions are split into training and evaluation tables.

This module owns the split protocols of the paper's benchmarks and the layout of a split folder:

* ``rmse`` (regression, the ML10M benchmark): each rating goes to train, valid or test with fixed
  probabilities 1 - h, h/2, h/2 (h = ``holdout``, 0.2 by default: 80/10/10) (`split_ratings`).
* ``recall`` (ranking, the ML20M benchmark): the preprocessing of Liang et al. 2018 (VAE-CF):
  positives only (labels in the top 30% of the rating scale; every row of implicit feedback),
  held-out validation and test users whose positives are split into fold-in history and targets
  (`split_heldout_users`). The restriction of training to the 10% most frequent items must use DP
  counts, so the protocol only records ``train_item_fraction`` and `top_items` applies it later.

``holdout`` 0 is the production mode: every row (rmse) or every eligible user (recall) trains.
A split folder holds one table per part and ``split.json``, written last. Both splits are
deterministic functions of the *set* of input rows and the seed, every table in
(user_id, item_id, timestamp, label) order. docs/own-data.md ("Why every split is row-local, and
the split folder") has the details.

Privacy: every split is row-local: a row's part depends on that row alone, through a keyed hash of
the split seed, the user id and (for row decisions) the item id, never on other rows, the row order
or exact totals, so removing a user's rows removes exactly those rows from the training part. The
one exception (recall's held-out rows restricted to the training positives' items) touches only the
held-out tables, which feed nothing but the private evaluation. Splits and split.json are private
tables: they stay in the run directory and are never released.
"""

from __future__ import annotations

import argparse
import hashlib
import math
from collections.abc import Iterable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from pipelines.data.chunks import USERS_TOGETHER, complete_users
from pipelines.data.datasets import Dataset
from privacy.mixing import absorb_values
from schemas import storage
from schemas.errors import UserError
from schemas.tables import INTERACTIONS, validate_interactions

DEFAULT_SEED = 1234
DEFAULT_HOLDOUT = 0.2  # share of rows (rmse) or eligible users (recall) held out: half valid, half test
PROTOCOLS = ("rmse", "recall")
SPLIT_MANIFEST = "split.json"

# Regression protocol: each row is train, valid or test with probabilities 1 - h, h/2, h/2.
RATING_PARTS = ("train", "valid", "test")

# Ranking protocol (Liang et al. 2018).
HELDOUT_PARTS = ("train", "valid_history", "valid_targets", "test_history", "test_targets")
POSITIVE_SHARE = 0.3  # explicit ratings: the positives are the labels in the top 30% of the rating scale
DEFAULT_SCALE = (0.5, 5.0)  # the rating scale of data that declares none (as the run's rating range)


def scale_threshold(scale: tuple[float, float]) -> float:
    """The positive threshold of a rating scale: labels above low + (1 - POSITIVE_SHARE)(high - low)
    are positives (3.65 on 0.5..5 stars: 4 and up, the MovieLens papers' positives; 7.3 on 1..10)."""
    low, high = scale
    return low + (1 - POSITIVE_SHARE) * (high - low)


POSITIVE_THRESHOLD = scale_threshold(DEFAULT_SCALE)
MIN_POSITIVES = 5  # users with fewer positives are dropped
TARGET_FRACTION = 0.2  # probability that a held-out user's row is a target
MIN_TARGET_ROWS = 5  # a held-out user with fewer rows keeps them all as history
TRAIN_ITEM_FRACTION = 0.1  # training keeps the top 10% items by DP count (applied later)

HOLDOUT_HELP = (
    "share of rows (rmse) or users (recall) held out for evaluation, half validation and half test, chosen by a "
    "keyed hash "
    "of the row or user so that the split never couples users; 0 is the production mode: train on every row, no "
    "held-out evaluation"
)

_GOLDEN = 0x9E3779B97F4A7C15


def check_holdout(holdout: float) -> float:
    """`holdout` as a float, or ValueError unless it is in [0, 1)."""
    try:
        value = float(holdout)
    except (TypeError, ValueError):
        raise UserError(f"holdout must be a number in [0, 1), got {holdout!r}") from None
    if not 0.0 <= value < 1.0:  # also refuses NaN
        raise UserError(
            "holdout must be in [0, 1) (the share of rows or users held out for evaluation; 0 trains on "
            f"every row), got {holdout!r}"
        )
    return value


def _key(seed: int, purpose: str) -> np.uint64:
    """A 64-bit hash key per (seed, purpose): the decisions of different purposes are independent."""
    digest = hashlib.blake2b(f"ssp-split-v1/{purpose}/{int(seed)}".encode(), digest_size=8).digest()
    return np.uint64(int.from_bytes(digest, "little"))


def row_uniform(seed: int, purpose: str, *columns: np.ndarray) -> np.ndarray:
    """A uniform number in [0, 1) per row, a keyed hash of the row's values in `columns` (int64 ids).

    Each row's number depends on the seed, the purpose and that row's values only (splitmix64
    finaliser chained over the columns, top 53 bits), never on other rows or their order.
    """
    h = None
    for position, column in enumerate(columns, start=1):
        values = np.ascontiguousarray(column, dtype=np.int64).view(np.uint64)
        if h is None:
            h = np.full(values.shape, _key(seed, purpose), dtype=np.uint64)
        if values.shape != h.shape:
            raise UserError(f"row_uniform's columns must be equally long, got {h.size} and {values.size} rows")
        absorb_values(h, values, np.uint64((_GOLDEN * position) & 0xFFFFFFFFFFFFFFFF))  # compiled, in place
    if h is None:
        raise UserError("row_uniform needs at least one column")
    return (h >> np.uint64(11)).astype(np.float64) * 2.0**-53


def _parts(uniform: np.ndarray, holdout: float) -> np.ndarray:
    """0 (train) below 1 - h, 1 (valid) below 1 - h/2, 2 (test) above: fixed fractions 1 - h, h/2, h/2.
    With h = 0 everything is train (uniform < 1 always)."""
    return np.where(uniform < 1.0 - holdout, 0, np.where(uniform < 1.0 - holdout / 2, 1, 2))


def _canonical(interactions: pa.Table, count_repeats: bool = False) -> pa.Table:
    """Validated interactions in canonical row order (sorted by user, item, timestamp, label), one
    row per (user, item): a repeated rating keeps only its latest (the last in that order); with
    `count_repeats` (implicit feedback, each label a count: 1 per row, or `ssp ingest
    --count-col`'s) the kept row's label is how many times the pair came, its rows' counts summed:
    the confidence the ranking protocol weighs it by (trainer.solve.confidence).
    User-local: the privacy bounds count each (user, item) pair once."""
    table = validate_interactions(interactions)
    if table.num_rows == 0:
        raise UserError("cannot split an empty interactions table")
    order = pc.sort_indices(
        table,
        sort_keys=[
            ("user_id", "ascending"),
            ("item_id", "ascending"),
            ("timestamp", "ascending"),
            ("label", "ascending"),
        ],
    )  # null timestamps sort last (the default)
    table = table.take(order).combine_chunks()
    users, items = table["user_id"].to_numpy(), table["item_id"].to_numpy()
    last = np.r_[(users[1:] != users[:-1]) | (items[1:] != items[:-1]), True]
    if last.all():
        return table
    kept = table.filter(pa.array(last))
    # each pair's rows are contiguous, from the row after the previous pair's last: its count is their labels' sum
    if count_repeats:
        starts = np.r_[0, np.flatnonzero(last)[:-1] + 1]
        repeats = np.add.reduceat(table["label"].to_numpy(), starts)
        at = kept.column_names.index("label")
        kept = kept.set_column(at, kept.schema.field(at), pa.array(repeats))
    return kept


# ---------------------------------------------------------------------------------------------
# Regression protocol


def split_ratings(
    interactions: pa.Table, seed: int = DEFAULT_SEED, holdout: float = DEFAULT_HOLDOUT
) -> dict[str, pa.Table]:
    """Row-local train/valid/test split of the ratings (the regression benchmark; 80/10/10 by default).

    Repeated (user, item) ratings keep the latest (user-local). Each remaining row gets
    x = `row_uniform(seed, "rmse-row", user_id, item_id)` and goes to train if x < 1 - holdout, to
    valid if x < 1 - holdout/2 and to test otherwise: each part's size is binomial around its fixed
    fraction, and a row's part never depends on another row. holdout 0 puts every row in train.
    Every table is in canonical (user_id, item_id, timestamp, label) order.
    """
    holdout = check_holdout(holdout)
    table = _canonical(interactions)
    part = _parts(row_uniform(seed, "rmse-row", table["user_id"].to_numpy(), table["item_id"].to_numpy()), holdout)
    return {name: table.filter(pa.array(part == index)) for index, name in enumerate(RATING_PARTS)}


# ---------------------------------------------------------------------------------------------
# Ranking protocol


def split_heldout_users(
    interactions: pa.Table,
    seed: int = DEFAULT_SEED,
    *,
    positive_threshold: float | None = POSITIVE_THRESHOLD,
    min_positives: int = MIN_POSITIVES,
    target_fraction: float = TARGET_FRACTION,
    holdout: float = DEFAULT_HOLDOUT,
    restrict_to_train_items: bool = True,
    train_items: np.ndarray | None = None,
    require_eligible: bool = True,
) -> dict[str, pa.Table]:
    """The ranking protocol of Liang et al. 2018 (VAE-CF), as used for ML20M by the DP-ALS papers,
    with row-local (hash) decisions instead of a global shuffle.

    1. Rows with label > positive_threshold are the positives (labels are kept as they are); all
       other rows are dropped. `positive_threshold` None keeps every row (implicit feedback: every
       interaction is a positive).
    2. Users with at least `min_positives` positives are eligible; the others are dropped.
    3. Each eligible user is a training, validation or test user by x = `row_uniform(seed,
       "recall-user", user_id)`: train if x < 1 - holdout, validation if x < 1 - holdout/2, test
       otherwise (no exact number of held-out users, no cap: the groups are binomial around their
       fractions). holdout 0 makes every eligible user a training one.
    4. With `restrict_to_train_items` (the paper's rule, the default) held-out users' rows are
       restricted to the items that appear in the training users' positives (a held-out user left
       with no rows then appears in no table). This is the one step that looks at other users' rows;
       it shapes the held-out tables only, which feed the private evaluation and no release.
    5. Each held-out user's remaining n_u rows are split into fold-in history and targets: a row is
       a target when `row_uniform(seed, "recall-target", user_id, item_id)` < target_fraction and
       n_u >= 5. Users with fewer than 5 rows keep everything as history and have no targets
       (evaluation skips them, and users whose rows all came out history or all targets).

    Returns the tables train, valid_history, valid_targets, test_history, test_targets, each in
    (user_id, item_id, timestamp, label) order.

    Every step but 4 is user-local, so an engine applies this to tables of complete users (with
    `require_eligible` False: a chunk may have no eligible user) and gets the same rows, given in
    `train_items` the items of every training user's positives (`train_items_of`).
    """
    if not 0.0 <= target_fraction < 1.0:
        raise UserError(f"target_fraction must be in [0, 1), got {target_fraction}")
    holdout = check_holdout(holdout)
    table = _positives(_canonical(interactions, count_repeats=positive_threshold is None), positive_threshold)
    users = table["user_id"].to_numpy()
    ids, inverse, counts = np.unique(users, return_inverse=True, return_counts=True)
    eligible = counts >= min_positives
    if require_eligible and not eligible.any():
        which = "rows" if positive_threshold is None else f"labels above {positive_threshold}"
        raise UserError(
            f"the ranking protocol needs users with at least {min_positives} positives ({which}); there are none"
        )
    # per row; -1: dropped
    group = np.where(eligible, _parts(row_uniform(seed, "recall-user", ids), holdout), -1)[inverse]

    items = table["item_id"].to_numpy()
    train_mask = group == 0
    split = {"train": table.filter(pa.array(train_mask))}
    if train_items is None:
        train_items = np.unique(items[train_mask])
    known_item = np.isin(items, train_items) if restrict_to_train_items else np.ones(items.size, dtype=bool)
    target = row_uniform(seed, "recall-target", users, items) < target_fraction
    for index, name in ((1, "valid"), (2, "test")):
        rows = np.flatnonzero((group == index) & known_item)
        _, held_inverse, held_counts = np.unique(users[rows], return_inverse=True, return_counts=True)
        is_target = target[rows] & (held_counts >= MIN_TARGET_ROWS)[held_inverse]
        split[f"{name}_history"] = table.take(pa.array(rows[~is_target]))
        split[f"{name}_targets"] = table.take(pa.array(rows[is_target]))
    return split


def _positives(table: pa.Table, positive_threshold: float | None) -> pa.Table:
    """The rows with label > positive_threshold; every row when it is None (implicit feedback).
    Row-local: each row is kept or dropped by its own label."""
    return table if positive_threshold is None else table.filter(pc.greater(table["label"], positive_threshold))


def positive_threshold_for(
    data: Dataset, threshold: float | None = None, scale: tuple[float, float] | None = None
) -> float | None:
    """The ranking protocol's positive threshold for a data set: None (every row is a positive) for
    implicit feedback (`ssp ingest` without a label column); for ratings `threshold` when given
    (--positive-threshold), else the top of the data's declared rating scale (`scale_threshold`;
    `scale`, else DEFAULT_SCALE, for data that declares none)."""
    if data.manifest.get("feedback") == "implicit":
        if threshold is not None:
            raise UserError(
                f"--positive-threshold {threshold:g}: {data.path} holds implicit feedback (no labels), "
                "where every interaction is a positive"
            )
        return None
    if threshold is not None:
        if not math.isfinite(threshold):
            raise UserError(f"--positive-threshold must be finite, got {threshold}")
        return float(threshold)
    return scale_threshold(tuple(data.manifest.get("rating_scale") or scale or DEFAULT_SCALE))


def top_items(item_ids: np.ndarray, counts: np.ndarray, fraction: float = TRAIN_ITEM_FRACTION) -> np.ndarray:
    """The ids of the ceil(fraction * m) items with the largest counts, sorted ascending.

    Meant for DP (noised) counts: the ranking protocol restricts training to the top 10% items, and
    choosing them from exact counts would leak. Ties are broken by the smaller item id.
    """
    item_ids, counts = np.asarray(item_ids), np.asarray(counts, dtype=np.float64)
    if item_ids.ndim != 1 or counts.shape != item_ids.shape:
        raise UserError(
            f"item_ids and counts must be 1-D arrays of one length, got shapes {item_ids.shape} and {counts.shape}"
        )
    if not 0.0 < fraction <= 1.0:
        raise UserError(f"fraction must be in (0, 1], got {fraction}")
    if not np.all(np.isfinite(counts)):
        raise UserError("counts must be finite")
    if np.unique(item_ids).size != item_ids.size:
        raise UserError("item_ids must be unique")
    m = item_ids.size
    keep = math.ceil(round(fraction * m, 9))  # round first: 0.1 * 30 is 3.0000000000000004 in floats
    order = np.lexsort((item_ids, -counts))  # largest count first, then smaller id
    return np.sort(item_ids[order[:keep]])


# ---------------------------------------------------------------------------------------------
# Split folders


@dataclass(frozen=True)
class SplitRule:
    """A protocol with its settings: what this process, or an engine on tables of complete users,
    applies to the interactions (`make_split`)."""

    protocol: str
    seed: int = DEFAULT_SEED
    holdout: float = DEFAULT_HOLDOUT
    positive_threshold: float | None = POSITIVE_THRESHOLD  # recall only; None: implicit feedback

    @property
    def parts(self) -> tuple[str, ...]:
        return RATING_PARTS if self.protocol == "rmse" else HELDOUT_PARTS

    @property
    def needs_train_items(self) -> bool:
        """Whether held-out rows are restricted to the training users' items (a first pass on an engine)."""
        return self.protocol == "recall" and self.holdout > 0

    def apply(self, table: pa.Table, train_items: np.ndarray | None = None, whole: bool = True) -> dict[str, pa.Table]:
        """The parts of `table` (the whole log, or with `whole` False complete users of it)."""
        if self.protocol == "rmse":
            return split_ratings(table, self.seed, self.holdout)
        return split_heldout_users(
            table,
            self.seed,
            positive_threshold=self.positive_threshold,
            min_positives=MIN_POSITIVES,
            target_fraction=TARGET_FRACTION,
            holdout=self.holdout,
            train_items=train_items,
            require_eligible=whole,
        )

    def eligible_users(self, table: pa.Table) -> int:
        """Users of `table` the recall protocol keeps (0 for rmse, which has no such rule)."""
        return _eligible_users(table, self.positive_threshold) if self.protocol == "recall" else 0

    def manifest(self, source: str) -> dict:
        """split.json's description of the rule (the sizes are added when the tables are written)."""
        fractions = {"train": 1.0 - self.holdout, "valid": self.holdout / 2, "test": self.holdout / 2}
        document = {
            "protocol": self.protocol,
            "seed": int(self.seed),
            "holdout": self.holdout,
            "source": source,
            "assignment": "keyed hash (row-local)",
        }
        if self.protocol == "rmse":
            document["fractions"] = fractions  # of the rows
        else:
            document.update(
                user_fractions=fractions,  # of the eligible users
                positive_threshold=self.positive_threshold,
                min_positives=MIN_POSITIVES,
                target_fraction=TARGET_FRACTION,
                min_target_rows=MIN_TARGET_ROWS,
                restrict_heldout_to_train_items=True,
                train_item_fraction=TRAIN_ITEM_FRACTION,
            )
        return document


def sizes_of(split: dict[str, pa.Table]) -> dict[str, dict[str, int]]:
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
    document = {**manifest, "sizes": sizes_of(split)}
    storage.write_json(document, storage.join(out, SPLIT_MANIFEST))
    return document


def make_split(
    data: Dataset,
    protocol: str,
    out: str,
    seed: int = DEFAULT_SEED,
    holdout: float = DEFAULT_HOLDOUT,
    positive_threshold: float | None = None,
    scale: tuple[float, float] | None = None,
    *,
    engine,
) -> dict:
    """Split a data set's interactions with a protocol ("rmse" or "recall") into `out`; returns split.json.

    split.json records the protocol, the seed, the holdout, the fixed fractions the hash draws
    against and the (private, exact) table sizes; for recall also the positive threshold used
    (null for an implicit-feedback data set, where every row is a positive; `positive_threshold_for`
    of `positive_threshold` and `scale`). The rows are split on `engine` (pipelines.engines.engine),
    into the same tables on every engine."""
    if protocol not in PROTOCOLS:
        raise UserError(f"unknown protocol {protocol!r}; choose one of {', '.join(PROTOCOLS)}")
    rule = SplitRule(protocol, seed, check_holdout(holdout), positive_threshold_for(data, positive_threshold, scale))
    manifest = rule.manifest(data.path)
    storage.remove(storage.join(out, SPLIT_MANIFEST))
    sizes, eligible = engine.split(data.interactions, rule, out)
    if protocol == "recall":
        manifest["n_eligible_users"] = eligible
    document = {**manifest, "sizes": sizes}
    storage.write_json(document, storage.join(out, SPLIT_MANIFEST))
    return document


def _eligible_users(interactions: pa.Table, threshold: float | None = POSITIVE_THRESHOLD) -> int:
    """Users with at least MIN_POSITIVES labels above `threshold` (every row when None), after the
    dedup of repeated ratings: the rule `split_heldout_users` applies."""
    users = _positives(_canonical(interactions), threshold)["user_id"].to_numpy()
    _, counts = np.unique(users, return_counts=True)
    return int((counts >= MIN_POSITIVES).sum())


# ---------------------------------------------------------------------------------------------
# On an engine: partitions of rows sorted by user


SPLIT_WRITTEN = pa.schema(
    [
        ("table", pa.string()),
        ("name", pa.string()),
        ("rows", pa.int64()),
        ("users", pa.int64()),
        ("eligible", pa.int64()),
    ]
)


def train_items_of(batches: Iterable[pa.RecordBatch], rule: SplitRule) -> Iterator[pa.RecordBatch]:
    """The engines' first pass of a recall split: the distinct items of the training users'
    positives in one partition of rows sorted by user (their union is `train_items`)."""
    for table in complete_users(batches):
        train = rule.apply(table, train_items=np.zeros(0, np.int64), whole=False)["train"]
        yield pa.record_batch({"item_id": pa.array(np.unique(train["item_id"].to_numpy()), pa.int64())})


def split_partition(
    batches: Iterable[pa.RecordBatch],
    rule: SplitRule,
    staged: dict[str, storage.StagedWrite],
    part: int,
    train_items: np.ndarray | None,
) -> Iterator[pa.RecordBatch]:
    """Split one partition of rows sorted by user, complete users at a time, writing part `part` of
    each table through `staged` (so each part holds whole users in order: chunks.USERS_TOGETHER);
    yields what was written (SPLIT_WRITTEN rows: table, file, rows, users) and one row with the
    partition's eligible users (table ""). Each user's rows are in one partition, so the sums over
    partitions are the tables' sizes."""
    writers: dict[str, object] = {}
    rows = dict.fromkeys(rule.parts, 0)
    users = dict.fromkeys(rule.parts, 0)
    eligible = 0
    try:
        for table in complete_users(batches):
            eligible += rule.eligible_users(table)
            for name, piece in rule.apply(table, train_items, whole=False).items():
                if piece.num_rows == 0:
                    continue
                if name not in writers:
                    # whole users, in order
                    writers[name] = staged[name].open_part(part, INTERACTIONS.with_metadata(USERS_TOGETHER))
                writers[name].write_table(piece.cast(INTERACTIONS))
                rows[name] += piece.num_rows
                users[name] += int(pc.count_distinct(piece["user_id"]).as_py())
    finally:
        for writer in writers.values():
            writer.close()
    names = list(writers)
    yield pa.RecordBatch.from_pydict(
        {
            "table": names + [""],
            "name": [staged[name].part_name(part) for name in names] + [""],
            "rows": [rows[name] for name in names] + [0],
            "users": [users[name] for name in names] + [0],
            "eligible": [0] * len(names) + [eligible],
        },
        schema=SPLIT_WRITTEN,
    )


@contextmanager
def discarded_on_failure(staged: dict[str, storage.StagedWrite]):
    """Discard what an engine's split staged when it fails (on a local disk the staging folders;
    on gs:// the parts are unlisted and never published)."""
    try:
        yield
    except BaseException:
        for table in staged.values():
            table.abort([])
        raise


def commit_split(
    rule: SplitRule, staged: dict[str, storage.StagedWrite], written: pa.Table, interactions: str
) -> tuple[dict, int]:
    """Publish the tables an engine's `split_partition` tasks wrote (a table no task wrote is an
    empty one); returns (sizes, eligible users) for split.json. A recall split without eligible
    users is refused, as in this process, and nothing is published."""
    records = written.to_pylist()
    eligible = sum(record["eligible"] for record in records)
    problem = None
    if rule.protocol == "recall" and eligible == 0:
        which = "rows" if rule.positive_threshold is None else f"labels above {rule.positive_threshold}"
        problem = f"the ranking protocol needs users with at least {MIN_POSITIVES} positives ({which}); there are none"
    elif not any(record["table"] for record in records):
        problem = f"{interactions} has no interactions to split"
    if problem:
        for name, table in staged.items():
            table.abort([record["name"] for record in records if record["table"] == name])
        raise UserError(problem)
    sizes = {}
    for name in rule.parts:
        mine = [record for record in records if record["table"] == name]
        files = [record["name"] for record in mine]
        if not files:  # an empty table: one file with the schema (no task wrote part 0)
            files = [staged[name].write_part(0, INTERACTIONS.with_metadata(USERS_TOGETHER).empty_table())]
        staged[name].commit(files, sum(record["rows"] for record in mine))
        sizes[name] = {"rows": sum(record["rows"] for record in mine), "users": sum(record["users"] for record in mine)}
    return sizes, eligible


# ---------------------------------------------------------------------------------------------
# CLI hooks (`ssp split`)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Add the `ssp split` options to a parser."""
    parser.add_argument(
        "--data",
        metavar="DIR",
        help="MovieLens folder or data set folder written by ssp ingest / "
        "ssp synth (default: the bundled ml-latest-small)",
    )
    parser.add_argument(
        "--protocol",
        required=True,
        choices=PROTOCOLS,
        help="rmse: each rating is train, valid or test (80/10/10 by default); recall: Liang et al. 2018 held-out "
        "users "
        "(positives: labels in the top 30%% of the rating scale, or every row of implicit-feedback data; users with "
        ">= 5 positives, "
        "80/20 fold-in history/targets)",
    )
    parser.add_argument(
        "--positive-threshold",
        type=float,
        help="recall: labels above it are the positives "
        "(default: the top 30%% of the data "
        "set's declared rating scale, 3.65 on 0.5..5 stars)",
    )
    parser.add_argument(
        "--out",
        metavar="DIR",
        required=True,
        help="folder for the split tables and split.json (private: keep it in the run directory)",
    )
    parser.add_argument(
        "--seed",
        type=int,
        default=DEFAULT_SEED,
        help=f"key of the hash that assigns rows and users to parts (default {DEFAULT_SEED})",
    )
    parser.add_argument(
        "--holdout", type=float, default=DEFAULT_HOLDOUT, help=f"{HOLDOUT_HELP} (default {DEFAULT_HOLDOUT})"
    )


def run(args: argparse.Namespace, data: Dataset, engine) -> int:
    """Make the split (on `engine`, pipelines.engines.engine) and print one
    line per table (rows and users)."""
    document = make_split(
        data, args.protocol, args.out, args.seed, args.holdout, args.positive_threshold, engine=engine
    )
    width = max(len(name) for name in document["sizes"])
    for name, size in document["sizes"].items():
        print(f"{name:<{width}}  rows={size['rows']}  users={size['users']}")
    return 0
