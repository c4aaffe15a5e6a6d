"""`ssp counts`: the DP item counts and the DP number of units, one Gaussian release.

The release is one vector: the count of every catalog item and the number of privacy units (users;
rows at example level). User level: each user contributes to at most K of their items (a keyed
random sample), 1 each, and 1 to the number of users, so one user changes the vector by at most
sqrt(K + 1) in L2 norm and the noise standard deviation of every entry is noise_multiplier *
sqrt(K + 1). Example level: a row adds 1 to one item and 1 to the number of rows (sqrt(2)). Noise
is keyed (privacy.noise) and every catalog item gets a noised count, floored at 1; the number of
units is rounded and floored at 1 (post-processing) and stored in the table's metadata
(`dp_units`). The counts feed the user-level weights and the popularity-based choices of later
steps; the number of units is what AM-DPSGD plans its sampling rate over (the exact number is never
written outside the run's private directory).

The units' noise is keyed like an item's, but by a key of its own: `standard_normal` with the seed
HMAC-SHA256(seed, "ssp-unit-count") (a pseudorandom function of the secret seed, so its stream is
independent of every item's), the release's index and id 0. No item id is reserved for it, so the
catalog may hold any int64 id.

Privacy: reads private interactions; releases only the noised counts, through the run's ledger.
"""

from __future__ import annotations

import argparse
import hashlib
import hmac
import math
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import pyarrow as pa

from pipelines.base import logs
from pipelines.releases import release
from pipelines.releases.train_sums import TrainSums
from privacy import accounting
from privacy.noise import add_noise, standard_normal
from privacy.seeds import mix64
from schemas import storage
from schemas.errors import UserError
from schemas.ids import IdIndex
from schemas.tables import COUNTS, validate_catalog, validate_counts, validate_interactions

COUNTS_TABLE = "counts.parquet"
DEFAULT_MAX_ITEMS_PER_USER = 100
UNITS_KEY = b"dp_units"  # the counts table's metadata: the DP number of units of the release


def units_noise_seed(seed: bytes) -> bytes:
    """The seed the units' noise is drawn with (module docstring): HMAC-SHA256 of the run's seed."""
    return hmac.new(seed, b"ssp-unit-count", hashlib.sha256).digest()


def dp_units(counts_path: str) -> int:
    """The DP number of units (users) released with the counts table at `counts_path`."""
    metadata = storage.read_schema(counts_path).metadata or {}
    if UNITS_KEY not in metadata:
        raise UserError(
            f"{counts_path}: the counts release has no DP number of units ({UNITS_KEY.decode()}); release the counts "
            "again"
        )
    return int(metadata[UNITS_KEY])


def sensitivity_of(unit: str, max_items_per_user: int) -> float:
    """The L2 sensitivity of the item counts together with the number of units."""
    return math.sqrt((max_items_per_user if unit == "user" else 1) + 1)


def dp_units_std(counts_path: str) -> float:
    """The noise std of the DP number of units at `counts_path` (public: the release's multiplier and
    sensitivity, in its metadata)."""
    metadata = storage.read_schema(counts_path).metadata or {}
    unit = metadata[b"unit"].decode()
    return float(metadata[b"noise_multiplier"]) * sensitivity_of(unit, int(metadata[b"max_items_per_user"]))


def sampling_hash(user_ids: np.ndarray, item_ids: np.ndarray, key: int) -> np.ndarray:
    """The keyed hash (uint64) that ranks a user's items for the sample of K."""
    with np.errstate(over="ignore"):
        return mix64(
            mix64(np.asarray(user_ids).astype(np.uint64) ^ np.uint64(key)) + np.asarray(item_ids).astype(np.uint64)
        )


def sampled_rows(user_ids: np.ndarray, item_ids: np.ndarray, max_items: int, key: int) -> np.ndarray:
    """Indices of the rows kept when each user keeps at most `max_items` rows, chosen by a keyed
    hash of (user, item): a uniform sample per user that any engine reproduces (ties, which the
    64-bit hash all but never has, go to the smaller item id of rows in (user, item) order)."""
    h = sampling_hash(user_ids, item_ids, key)
    order = np.lexsort((h, user_ids))
    users = user_ids[order]
    starts = np.flatnonzero(np.r_[True, users[1:] != users[:-1]]) if users.size else np.zeros(0, np.int64)
    rank = np.arange(users.size) - np.repeat(starts, np.diff(np.r_[starts, users.size]))
    return np.sort(order[rank < max_items])


def sampling_key(seed: bytes) -> int:
    """The key of the per-user sample of K items: a pseudorandom function of the run's secret seed."""
    return int.from_bytes(hmac.new(seed, b"ssp-count-sampling", hashlib.sha256).digest()[:8], "big")


def read_rows(interactions: str, catalog: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(user ids, item ids) of every interaction, validated, in this process; refuses an item missing
    from the catalog."""
    batches = [
        validate_interactions(pa.Table.from_batches([b])) for b in storage.iter_batches(interactions)
    ]  # the engines: row_problem
    users = np.concatenate([t["user_id"].to_numpy() for t in batches]) if batches else np.zeros(0, np.int64)
    rated = np.concatenate([t["item_id"].to_numpy() for t in batches]) if batches else np.zeros(0, np.int64)
    _refuse_unknown(interactions, rated, catalog)
    return users, rated


def row_problem(batch: pa.RecordBatch, catalog: np.ndarray | IdIndex) -> str | None:
    """What `read_rows` refuses in one batch of interactions, as its message; None when it is fine.
    The engines check their tables batch by batch with it, so they refuse with the same words.
    `catalog`: the sorted catalog ids, or their IdIndex (a task checking many batches builds it once)."""
    try:
        table = validate_interactions(pa.Table.from_batches([batch]))
    except ValueError as exc:
        return str(exc)
    ids = table["item_id"].to_numpy()
    _, known = (catalog if isinstance(catalog, IdIndex) else IdIndex(catalog)).lookup(ids)
    return None if known.all() else f"interactions refer to items missing from the catalog (e.g. {ids[~known].min()})"


def exact_aggregates(
    users: np.ndarray, rated: np.ndarray, catalog: np.ndarray, unit: str, max_items_per_user: int, key: int
) -> tuple[np.ndarray, int]:
    """(exact count of every catalog item, exact number of units): user level, each distinct
    (user, item) once and each user's keyed sample of at most K items (a repeated rating must not
    add twice, or a user's count vector could move by K in one coordinate instead of sqrt(K) in L2
    norm); example level, every row. Private: they are only ever noised. Rows must be of catalog
    items (the engines check them first)."""
    users, rated = np.asarray(users), np.asarray(rated)
    positions = IdIndex(catalog).lookup(rated)[0]
    if unit != "user":
        return np.bincount(positions, minlength=catalog.size).astype(np.float64), int(users.size)
    if users.size and np.all(users[1:] >= users[:-1]):  # complete users in order, as the engines' chunks come: no sort
        first = np.r_[True, users[1:] != users[:-1]]
        distinct, group = users[first], np.cumsum(first) - 1
    else:
        distinct, group = np.unique(users, return_inverse=True)
    pairs = np.unique(group.astype(np.int64) * catalog.size + positions)  # the distinct pairs, in (user, item) order
    group, positions = np.divmod(pairs, catalog.size)
    keep = _sampled(distinct[group], catalog[positions], group, max_items_per_user, key)
    kept_groups = group[keep]  # in order: one run per user with a kept pair
    units = int(np.count_nonzero(kept_groups[1:] != kept_groups[:-1]) + 1) if kept_groups.size else 0
    return np.bincount(positions[keep], minlength=catalog.size).astype(np.float64), units


def _sampled(user_ids: np.ndarray, item_ids: np.ndarray, group: np.ndarray, max_items: int, key: int) -> np.ndarray:
    """`sampled_rows` as a mask, for distinct pairs in (user, item) order with each user's group
    index: only the rows of users with more than `max_items` items are ranked (the rest are kept whole)."""
    keep = np.ones(group.size, dtype=bool)
    over = np.flatnonzero((np.bincount(group) > max_items)[group]) if group.size else group[:0]
    if over.size:
        keep[over] = False
        keep[over[sampled_rows(user_ids[over], item_ids[over], max_items, key)]] = True
    return keep


def _refuse_unknown(interactions: str, rated: np.ndarray, catalog: np.ndarray) -> None:
    unknown = rated[~np.isin(rated, catalog)]
    if unknown.size:
        raise UserError(
            f"{interactions}: {unknown.size} interaction(s) refer to items missing from the catalog (e.g. {unknown[0]})"
        )


def dp_counts(
    interactions: str,
    items: str,
    out: str,
    privacy: release.PrivacySettings,
    unit: str = "user",
    max_items_per_user: int = DEFAULT_MAX_ITEMS_PER_USER,
    ledger_path: str | None = None,
    seed_file: str | None = None,
    *,
    engine,
    sums: TrainSums | None = None,
) -> dict:
    """Release the DP counts of every catalog item into `<out>/counts.parquet`; returns a summary.
    The exact counts are aggregated on `engine` (pipelines.engines.engine), or given: `sums`, the
    prepare stage's of these rows under this run's seed (their rows checked when they were taken)."""
    if not isinstance(max_items_per_user, int) or max_items_per_user < 1:
        raise UserError(f"--max-items-per-user must be a positive integer, got {max_items_per_user}")
    if unit not in ("user", "example"):
        raise UserError(f"unit of privacy must be 'user' or 'example', got {unit!r}")
    ledger_path = ledger_path or storage.join(out, "ledger.parquet")
    catalog = np.sort(validate_catalog(storage.read_table(items, columns=["item_id"]))["item_id"].to_numpy())
    if sums is None:
        engine.check_count_rows(interactions, catalog)  # bad input is refused before the ledger and seed are touched
    ledger = privacy.open_ledger(ledger_path, unit, interactions)  # a new run charges its data source's account
    seeds = release.open_seed_file(seed_file, ledger_path)
    if sums is not None:
        exact, units = sums.counts, sums.units
        digests = {"interactions": sums.digest, "items": seeds.digest_table(items)}
    else:
        with ThreadPoolExecutor(max_workers=1) as pool:  # the inputs' digests while the engine aggregates
            inputs = pool.submit(
                lambda: {"interactions": seeds.digest_table(interactions), "items": seeds.digest_table(items)}
            )
            exact, units = engine.count_aggregates(
                interactions, catalog, unit, max_items_per_user, sampling_key(seeds.seed)
            )
            digests = inputs.result()
    multiplier = ledger.multipliers["counts"]
    sensitivity = sensitivity_of(unit, max_items_per_user)
    description = {
        "unit": unit,
        "max_items_per_user": max_items_per_user if unit == "user" else None,
        "sensitivity": sensitivity,  # of the item counts with the number of units
        "inputs": digests,
    }
    index = release.make_release(ledger, seeds, "counts", accounting.gaussian_event(multiplier), description)
    logs.log(f"counts: release {index}, noise multiplier {multiplier:.4g} (std {multiplier * sensitivity:.4g})")
    noised = add_noise(
        standard_normal(seeds.release_seed(index), index, catalog, 1)[:, 0], multiplier * sensitivity, exact
    )  # on the noise's grid
    counts = np.maximum(noised, 1.0)
    noised_units = add_noise(
        standard_normal(units_noise_seed(seeds.release_seed(index)), index, np.zeros(1, np.int64), 1)[:, 0],
        multiplier * sensitivity,
        np.array([float(units)]),
    )[0]
    released_units = max(1, int(np.rint(noised_units)))
    metadata = {
        b"noise_multiplier": repr(multiplier).encode(),
        b"release": str(index).encode(),
        b"unit": unit.encode(),
        b"max_items_per_user": str(max_items_per_user).encode(),
        UNITS_KEY: str(released_units).encode(),
    }
    table = pa.Table.from_arrays([pa.array(catalog), pa.array(counts)], schema=COUNTS.with_metadata(metadata))
    storage.write_table(validate_counts(table), storage.join(out, COUNTS_TABLE))
    seeds.record_output(
        index, seeds.digest_table(storage.join(out, COUNTS_TABLE))
    )  # later jobs check they are handed this release
    summary = {
        "release": index,
        "noise_multiplier": multiplier,
        "noise_std": multiplier * sensitivity,
        "items": int(catalog.size),
        "dp_units": released_units,
        "epsilon_spent": ledger.epsilon_spent(),
        "ledger": ledger_path,
        "inputs": description["inputs"],  # the keyed digests, for a later release of the same tables
    }
    return summary


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--interactions", required=True, help="interactions table (private)")
    parser.add_argument("--items", required=True, help="items table (the public catalog: every item gets a count)")
    parser.add_argument(
        "--out", required=True, help="output folder: counts.parquet (and ledger.parquet unless --ledger)"
    )
    parser.add_argument(
        "--unit", choices=("user", "example"), default="user", help="unit of privacy (default: %(default)s)"
    )
    parser.add_argument(
        "--max-items-per-user",
        type=int,
        default=DEFAULT_MAX_ITEMS_PER_USER,
        help="K: items a user contributes at most (user level; default: %(default)s)",
    )
    release.add_privacy_arguments(parser)


def run(args: argparse.Namespace, engine) -> int:
    """`ssp counts`: the release on `engine` (pipelines.engines.engine)."""
    summary = dp_counts(
        args.interactions,
        args.items,
        args.out,
        release.privacy_settings(args),
        args.unit,
        args.max_items_per_user,
        args.ledger,
        args.seed_file,
        engine=engine,
    )
    print(
        f"released DP counts of {summary['items']:,} items and the DP number of {args.unit}s, "
        f"{summary['dp_units']:,} (noise std {summary['noise_std']:.4g}); "
        f"epsilon spent so far {summary['epsilon_spent']:.4g} (ledger {summary['ledger']})"
    )
    return 0
