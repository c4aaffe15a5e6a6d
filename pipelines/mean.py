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
from functools import partial

import numpy as np

from pipelines import logs, release
from privacy import accounting
from privacy.ledger import Ledger
from privacy.noise import add_noise, standard_normal
from privacy.seeds import SeedFile, digest_table
from schemas import storage

DEFAULT_USER_CAP = 50.0


def weighted_sums(interactions: str, rating_range: tuple[float, float], unit: str, user_cap: float) -> tuple[float, float]:
    """(weighted sum of the labels about the middle of the range, weighted count), in this process."""
    low, high = rating_range
    table = storage.read_table(interactions, columns=["user_id", "label"])
    users = table["user_id"].to_numpy()
    labels = np.clip(table["label"].to_numpy(), low, high) - (low + high) / 2  # in [-half, half]: half the sensitivity of raw labels
    if unit == "user":
        _, inverse, per_user = np.unique(users, return_inverse=True, return_counts=True)
        weights = np.minimum(1.0, user_cap / per_user[inverse])
    else:
        weights = np.ones(users.size)
    return float(weights @ labels), float(weights.sum())


def spark_weighted_sums(spark, interactions: str, rating_range: tuple[float, float], unit: str, user_cap: float) -> tuple[float, float]:
    """`weighted_sums` on Spark: per-user sums on the executors, two numbers to the driver (equal to
    float64 rounding: the order of the additions differs)."""
    from pyspark.sql import functions as F

    from pipelines.spark import readable_tables

    low, high = rating_range
    with readable_tables(spark, interactions) as (files,):
        rows = spark.read.parquet(*files).select("user_id", F.least(F.greatest(F.col("label"), F.lit(low)), F.lit(high)).alias("label"))
        centred = F.col("label") - F.lit((low + high) / 2)
        if unit == "user":
            per_user = rows.groupBy("user_id").agg(F.sum(centred).alias("total"), F.count(F.lit(1)).alias("n"))
            weight = F.least(F.lit(1.0), F.lit(user_cap) / F.col("n"))
            sums = per_user.agg(F.sum(weight * F.col("total")).alias("sum"), F.sum(weight * F.col("n")).alias("count")).first()
        else:
            sums = rows.agg(F.sum(centred).alias("sum"), F.count(F.lit(1)).cast("double").alias("count")).first()
    return float(sums["sum"] or 0.0), float(sums["count"] or 0.0)


def dp_mean(
    interactions: str, ledger: Ledger, seeds: SeedFile, rating_range: tuple[float, float], unit: str = "user", user_cap: float = DEFAULT_USER_CAP,
    spark=None,
) -> dict:
    """Release the DP mean label of `interactions`; returns {"mean", "release", ...}. With a Spark
    session the weighted sums are computed on Spark (`spark_weighted_sums`)."""
    low, high = rating_range
    if not (math.isfinite(low) and math.isfinite(high) and low < high):
        raise ValueError(f"rating range must be two finite numbers low < high, got {rating_range}")
    if not math.isfinite(user_cap) or user_cap <= 0:
        raise ValueError(f"the per-user cap of the mean must be > 0, got {user_cap}")
    sums = weighted_sums if spark is None else partial(spark_weighted_sums, spark)
    total, count = sums(interactions, (low, high), unit, user_cap)
    middle, half = (low + high) / 2, (high - low) / 2
    scale = user_cap if unit == "user" else 1.0
    multiplier = ledger.budget["multipliers"].get("mean", 0.0)
    event = accounting.gaussian_event(multiplier, 2)
    description = {"unit": unit, "user_cap": user_cap, "rating_range": [low, high], "inputs": {"interactions": digest_table(interactions)}}
    index = release.make_release(ledger, seeds, "mean", event, description)
    z = standard_normal(seeds.seed, index, np.array([0]), 2)[0]
    weighted_sum = float(add_noise(z[:1], multiplier * scale * half, total)[0])  # on the noise's grid
    weighted_count = float(add_noise(z[1:], multiplier * scale, count)[0])
    mean = float(np.clip(middle + weighted_sum / max(weighted_count, 1.0), low, high))
    logs.log(f"mean: release {index}, DP mean label {mean:.4f} (noise multiplier {multiplier:.4g})")
    return {"mean": mean, "release": index, "noise_multiplier": multiplier, "user_cap": user_cap if unit == "user" else None}
