"""`ssp train --plan --forecast-users N`: what quality to expect, before anything is spent.

The operator declares the shape of their data (the number of users, and for a MovieLens-like log
the mean history length); the forecast generates a synthetic log of that shape (`ssp synth --like
plays` for a ranking, `--like movielens` for ratings, or as chosen) and runs the same pipeline with
the same settings on it at half, the requested and twice the epsilon: how many of its catalog's
items got statistics, the test metric against the run's own baseline (DP popularity, or predicting
the DP mean), and a warning when the requested epsilon lands below that baseline or within one
run's noise of it. One run each, with fresh noise: a forecast, not a promise (the data's own taste
and popularity differ from the generator's).

Privacy: reads nothing private and spends nothing: the runs train on the synthetic log, with their
ledgers and a budget-account registry of their own in a temporary folder, removed at the end.
"""

from __future__ import annotations

import math
import os
import tempfile
from collections.abc import Callable

from pipelines.base import logs
from pipelines.data import synth
from pipelines.training.run_dir import Run
from pipelines.training.settings import TrainConfig
from privacy.lifetime_budget import registry_at
from schemas import storage
from schemas.errors import UserError

FACTORS = (0.5, 1.0, 2.0)  # the epsilons forecast, as multiples of the requested one
LIKES = {"recall": "plays", "rmse": "movielens"}  # the generator by protocol, unless chosen


def checked(epsilon: float, protocol: str, history: int | None, like: str | None) -> str:
    """The generator of a forecast of these settings, after refusing a combination it cannot run."""
    like = like or LIKES[protocol]
    if like == "plays" and protocol != "recall":
        raise UserError("--forecast-like plays is a play log (implicit feedback): forecast it with --protocol recall")
    if history is not None and like != "movielens":
        raise UserError(f"--forecast-history rescales a MovieLens-like log; a {like} log's histories are its own")
    if not math.isfinite(epsilon) or epsilon <= 0:
        raise UserError("--forecast-users forecasts a private run: give a finite --epsilon")
    return like


def forecast(
    config_at: Callable[[float, str, str], TrainConfig],
    epsilon: float,
    protocol: str,
    users: int,
    history: int | None = None,
    like: str | None = None,
) -> dict:
    """Generate the synthetic log and run `config_at(epsilon, data, out)` at each of FACTORS x
    `epsilon`; returns the log's shape and one row per epsilon (items with statistics, the model's
    test metric and its baseline's)."""
    from pipelines.training.stages import run

    like = checked(epsilon, protocol, history, like)
    with tempfile.TemporaryDirectory(prefix="ssp-forecast-") as folder, registry_at(os.path.join(folder, "accounts")):
        data = os.path.join(folder, "data")
        with logs.progress_hidden():
            dataset = synth.generate(data, users=users, ratings_per_user=history, like=like)
        rows = []
        for factor in FACTORS:
            out = os.path.join(folder, f"run-{factor:g}")
            with logs.progress_hidden():
                metrics = run(config_at(epsilon * factor, data, out), progress=False)
            logs.log(f"forecast: epsilon {epsilon * factor:g} done")
            key, base = ("test_recall_at_20", "test_popularity_recall_at_20")
            if protocol == "rmse":
                key, base = "test_rmse", "test_mean_predictor_rmse"
            rows.append(
                {
                    "epsilon": epsilon * factor,
                    "covered": storage.read_table(Run(out).stats_items, columns=["item_id"]).num_rows
                    if storage.exists(Run(out).stats_items)
                    else 0,
                    "model": metrics.get(key),
                    "baseline": metrics.get(base),
                }
            )
        generated = dataset.manifest
    return {"like": like, "users": users, "items": generated["items"], "rows": rows, "protocol": protocol}


NOISE = 0.01  # how far apart one run per epsilon lands from another with fresh noise (Recall@20 or RMSE)


def describe(result: dict, requested: float, catalog_items: int | None) -> str:
    """The forecast as a table, and a warning when the requested epsilon is below the baseline or
    within one run's noise of it."""
    ranking = result["protocol"] == "recall"
    metric, baseline = ("Recall@20", "DP popularity") if ranking else ("RMSE", "predicting the DP mean")
    lines = [
        "",
        f"forecast (nothing spent): the same settings on a synthetic {result['like']} log of {result['users']:,} "
        f"users and {result['items']:,} items, one run per epsilon (fresh noise: differences of about {NOISE:g} are "
        "within it)",
        "",
        f"| epsilon | items with statistics | test {metric} | {baseline} | model - baseline |",
        "| --- | --- | --- | --- | --- |",
    ]
    verdict = None
    for row in result["rows"]:
        share = row["covered"] / result["items"]
        gap = None if row["model"] is None or row["baseline"] is None else row["model"] - row["baseline"]
        lines.append(
            f"| {row['epsilon']:g} | {row['covered']:,} ({share:.0%}) | "
            f"{'-' if row['model'] is None else format(row['model'], '.4f')} | "
            f"{'-' if row['baseline'] is None else format(row['baseline'], '.4f')} | "
            f"{'-' if gap is None else format(gap, '+.4f')} |"
        )
        if math.isclose(row["epsilon"], requested):
            verdict = gap if ranking or gap is None else -gap  # positive: the model is better
    if catalog_items:
        lines.append(f"(items with statistics in your catalog of {catalog_items:,}: about the same share)")
    if verdict is None:
        lines.append("WARNING: the forecast run at the requested epsilon has no test metrics (too few users)")
    elif verdict <= 0:
        lines.append(
            f"WARNING: at epsilon {requested:g} the model is forecast at or BELOW {baseline} ({verdict:+.4f}): more "
            "users, a larger epsilon or --item-update gram may do better; see the other rows"
        )
    elif verdict < NOISE:
        lines.append(
            f"WARNING: at epsilon {requested:g} the model is forecast within the forecast's noise of {baseline} "
            f"({verdict:+.4f}, noise about {NOISE:g}): the run may land below it; more users or a larger epsilon "
            "may do better; see the other rows"
        )
    return "\n".join(lines)
