"""The DP mean rating: labels are centred by it before training, predictions add it back.

Each user's contribution is bounded by weighting, not by truncating long histories: a user with
n ratings gives each of them weight c = min(1, C / n), so the user adds at most C to the weighted
count and at most C * (max - min) / 2 to the weighted sum of labels taken about the middle of the
public rating range, yet every rating is used (truncation would keep
an arbitrary C of a heavy user's ratings, and capping at one rating per user would bias the mean
toward light users). Two Gaussian releases (sum, count) with the run's "mean" noise multiplier;
the mean is their ratio, clipped to the public rating range (post-processing).

Privacy: reads private interactions; releases two noised numbers through the ledger (release
name "mean"). Example level: c = 1 and the sensitivities are (max - min) / 2 and 1.
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from typing import NamedTuple

import numpy as np
import pyarrow as pa

from pipelines.base import logs
from pipelines.data.chunks import USERS_TOGETHER
from pipelines.releases import release
from pipelines.releases.stats_core import ITEM_SHARDS, by_shard
from privacy import accounting
from privacy.ledger import Ledger
from privacy.noise import add_noise, standard_normal
from privacy.seeds import SeedFile
from schemas import storage
from schemas.errors import UserError
from schemas.tables import INTERACTIONS

DEFAULT_USER_CAP = 50.0


def weighted_sums_of(
    users: np.ndarray, labels: np.ndarray, rating_range: tuple[float, float], unit: str, user_cap: float
) -> tuple[float, float]:
    """(weighted sum of the labels about the middle of the range, weighted count) of complete users' rows."""
    low, high = rating_range
    labels = np.clip(labels, low, high) - (low + high) / 2  # in [-half, half]: half the sensitivity of raw labels
    if unit == "user":
        if users.size and np.all(users[1:] >= users[:-1]):  # complete users in order, as the engines' chunks come
            first = np.r_[True, users[1:] != users[:-1]]
            inverse, per_user = np.cumsum(first) - 1, np.diff(np.r_[np.flatnonzero(first), users.size])
        else:
            _, inverse, per_user = np.unique(users, return_inverse=True, return_counts=True)
        weights = np.minimum(1.0, user_cap / per_user[inverse])
    else:
        weights = np.ones(users.size)
    return float(weights @ labels), float(weights.sum())


def weighted_sums(
    interactions: str, rating_range: tuple[float, float], unit: str, user_cap: float
) -> tuple[float, float]:
    """`weighted_sums_of` every row of `interactions`, in this process."""
    table = storage.read_table(interactions, columns=["user_id", "label"])
    return weighted_sums_of(table["user_id"].to_numpy(), table["label"].to_numpy(), rating_range, unit, user_cap)


def kept(table: pa.Table, keep_items: np.ndarray | None) -> pa.Table:
    """The rows of `table` whose item is in `keep_items` (every row for None)."""
    return table if keep_items is None else table.filter(pa.array(np.isin(table["item_id"].to_numpy(), keep_items)))


def centred(
    table: pa.Table, mean: float, protocol: str, keep_items: np.ndarray | None, confidence_alpha: float | None = None
) -> pa.Table:
    """Training rows with labels centred by the DP mean (regression) or, ranking, each positive's
    confidence: 1, or for implicit feedback (`confidence_alpha` given) trainer.solve.confidence of
    how many times the pair came (the split's label); restricted to `keep_items` when given. Row-local."""
    from trainer.solve import confidence

    table = kept(table, keep_items)
    if protocol == "recall":
        labels = (
            np.ones(table.num_rows)
            if confidence_alpha is None
            else confidence(table["label"].to_numpy(), confidence_alpha)
        )
    else:
        labels = table["label"].to_numpy() - mean
    return table.set_column(2, INTERACTIONS.field("label"), pa.array(labels, pa.float64()))


def dp_mean(
    interactions: str,
    ledger: Ledger,
    seeds: SeedFile,
    rating_range: tuple[float, float],
    unit: str = "user",
    *,
    user_cap: float = DEFAULT_USER_CAP,
    engine,
    interactions_digest: str | None = None,
    sums: tuple[float, float] | None = None,
) -> dict:
    """Release the DP mean label of `interactions`; returns {"mean", "release", ...}. The weighted
    sums are computed on `engine` (pipelines.engines.engine), or given (`sums`: the prepare stage's,
    pipelines.releases.train_sums). `interactions_digest`: the table's keyed digest under `seeds`,
    when a release of the same table just took it (prepare's counts)."""
    low, high = rating_range
    if not (math.isfinite(low) and math.isfinite(high) and low < high):
        raise UserError(f"rating range must be two finite numbers low < high, got {rating_range}")
    if not math.isfinite(user_cap) or user_cap <= 0:
        raise UserError(f"the per-user cap of the mean must be > 0, got {user_cap}")
    total, count = sums if sums is not None else engine.mean_sums(interactions, (low, high), unit, user_cap)
    middle, half = (low + high) / 2, (high - low) / 2
    scale = user_cap if unit == "user" else 1.0
    multiplier = ledger.multipliers.get("mean", 0.0)
    event = accounting.gaussian_event(multiplier, 2)
    description = {
        "unit": unit,
        "user_cap": user_cap,
        "rating_range": [low, high],
        "inputs": {"interactions": interactions_digest or seeds.digest_table(interactions)},
    }
    index = release.make_release(ledger, seeds, "mean", event, description)
    z = standard_normal(seeds.release_seed(index), index, np.array([0]), 2)[0]
    weighted_sum = float(add_noise(z[:1], multiplier * scale * half, total)[0])  # on the noise's grid
    weighted_count = float(add_noise(z[1:], multiplier * scale, count)[0])
    mean = float(np.clip(middle + weighted_sum / max(weighted_count, 1.0), low, high))
    logs.log(f"mean: release {index}, DP mean label {mean:.4f} (noise multiplier {multiplier:.4g})")
    return {
        "mean": mean,
        "release": index,
        "noise_multiplier": multiplier,
        "user_cap": user_cap if unit == "user" else None,
    }


class CentredOutput(NamedTuple):
    """Where an engine's `write_centred` puts `centred` rows: a table, the items it keeps (None:
    all), and its parts' layout. `item_shards` S: each part's rows grouped by item shard
    (stats_core.shard_of), a row group per shard, declared in the part's metadata
    (stats_core.ITEM_SHARDS), so that the Spark stats job reads each shard's rows with no shuffle;
    None: the input's order (engines that write one file keep that order either way)."""

    path: str
    keep_items: np.ndarray | None = None
    item_shards: int | None = None


def write_centred_parts(
    batches: Iterable[pa.RecordBatch],
    outputs: list[tuple[storage.StagedWrite, CentredOutput]],
    part: int,
    *,
    mean: float,
    protocol: str,
    confidence_alpha: float | None = None,
    users_together: bool = False,
) -> list[tuple[str, int] | None]:
    """`centred` rows of a stream of interaction batches, once, written as part `part` of each
    output (a staged table and where it goes) (an engine's task); per output, (the part's file
    name, its rows), or None when no row is left. `users_together`: the batches are one file's
    whole users in order, and so is each part kept in that order (chunks.USERS_TOGETHER)."""
    schema = INTERACTIONS.with_metadata(USERS_TOGETHER) if users_together else INTERACTIONS
    writers, counts = [None] * len(outputs), [0] * len(outputs)
    held: list[list[pa.Table]] = [[] for _ in outputs]  # the rows of outputs grouped by item shard, until the end
    for batch in batches:
        every = centred(pa.Table.from_batches([batch]).cast(INTERACTIONS), mean, protocol, None, confidence_alpha)
        for k, (staged, output) in enumerate(outputs):
            table = kept(every, output.keep_items)
            if not table.num_rows:
                continue
            counts[k] += table.num_rows
            if output.item_shards:
                held[k].append(table)
                continue
            writers[k] = writers[k] or staged.open_part(part, schema)
            writers[k].write_table(table)
    for k, (staged, output) in enumerate(outputs):
        if held[k]:
            writers[k] = staged.open_part(part, INTERACTIONS.with_metadata({ITEM_SHARDS: b"%d" % output.item_shards}))
            write_by_item_shard(writers[k], pa.concat_tables(held[k]), output.item_shards)
    for writer in writers:
        if writer is not None:
            writer.close()
    return [
        None if writer is None else (staged.part_name(part), count)
        for writer, (staged, _), count in zip(writers, outputs, counts, strict=True)
    ]


def write_by_item_shard(writer, table: pa.Table, shards: int) -> None:
    """The rows of `table` grouped by item shard (in their order within a shard), a row group per shard."""
    order, cuts = by_shard(table["item_id"].to_numpy(), shards)
    table = table.take(order)
    for k in np.flatnonzero(np.diff(cuts)):
        writer.write_table(table.slice(cuts[k], cuts[k + 1] - cuts[k]))
