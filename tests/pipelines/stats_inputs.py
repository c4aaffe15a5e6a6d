"""Builders of small stats-job inputs shared by the Spark and Beam tests."""

from __future__ import annotations

import numpy as np
import pyarrow as pa

from schemas import storage
from schemas.tables import COUNTS, INTERACTIONS, USER_EMBEDDINGS, items_schema


def write_inputs(folder, interactions, embeddings, counts, catalog):
    """Write the four input tables; returns their paths as a dict."""
    folder = str(folder)
    paths = {
        name: storage.join(folder, f"{name}.parquet") for name in ("interactions", "user_embeddings", "counts", "items")
    }
    users, items, labels = zip(*interactions, strict=True)
    storage.write_table(
        pa.table(
            {"user_id": users, "item_id": items, "label": [float(v) for v in labels], "timestamp": [0] * len(users)},
            schema=INTERACTIONS,
        ),
        paths["interactions"],
    )
    storage.write_table(
        pa.table(
            {"user_id": list(embeddings), "embedding": [list(map(float, v)) for v in embeddings.values()]},
            schema=USER_EMBEDDINGS,
        ),
        paths["user_embeddings"],
    )
    storage.write_table(
        pa.table({"item_id": list(counts), "count": [float(v) for v in counts.values()]}, schema=COUNTS),
        paths["counts"],
    )
    storage.write_table(
        pa.table(
            {"item_id": catalog, "title": [f"item {i}" for i in catalog], "genres": [[] for _ in catalog]},
            schema=items_schema({"genres": "multivalent"}),
        ),
        paths["items"],
    )
    return paths


def expected_stats(
    interactions, embeddings, counts, catalog, clip_u, clip_y, wbar, exponent=-0.25, bias=False, confidence=False
):
    """A_j (full matrices) and b_j by the formulas, one row at a time in plain numpy. With `bias` the
    embeddings are [u, 1, b_u] and each row adds [Clip(u), clip_u] with label Clip(y - b_u). With
    `confidence` the label c is the row's confidence: weight wbar c n^e / sqrt(sum (c n^e)^2), label 1."""
    d = len(next(iter(embeddings.values()))) - (1 if bias else 0)
    a = {j: np.zeros((d, d)) for j in catalog}
    b = {j: np.zeros(d) for j in catalog}
    for user in {row[0] for row in interactions}:
        rows = [row for row in interactions if row[0] == user]
        scale = (lambda c: c) if confidence else (lambda c: 1.0)  # noqa: E731
        norm = sum((scale(c) * counts[j] ** exponent) ** 2 for _, j, c in rows)
        for _, j, y in rows:
            w = wbar * scale(y) * counts[j] ** exponent / np.sqrt(norm)
            y = 1.0 if confidence else y
            u = np.asarray(embeddings[user], float)
            if bias:
                u, y = np.r_[u[:-2] * min(1.0, clip_u / np.linalg.norm(u[:-2])), clip_u], y - u[-1]
            else:
                u = u * min(1.0, clip_u / np.linalg.norm(u))
            y = float(np.clip(y, -clip_y, clip_y))
            a[j] += w * np.outer(u, u)
            b[j] += w * y * u
    return a, b


def register_counts(counts: str, ledger_path: str, privacy, seed_file=None, unit: str = "user") -> None:
    """Record a hand-made counts table as the counts release of a ledger (as `ssp counts` would
    have released it): the stats job accepts only counts released into its ledger. A ledger that
    already has a counts release is left as it is."""
    from pipelines.releases import release
    from privacy import accounting

    ledger = privacy.open_ledger(ledger_path, unit)
    if ledger.find("counts") is None:
        seeds = release.open_seed_file(seed_file, ledger_path)
        digest = seeds.digest_table(counts)
        event = accounting.gaussian_event(ledger.budget["multipliers"]["counts"])
        index = release.make_release(ledger, seeds, "counts", event, {"inputs": {"counts": digest}})
        seeds.record_output(index, digest)


def registered(job):
    """The job, with its hand-made counts table recorded as the counts release of its ledger."""
    register_counts(job.counts, job.ledger_path, job.privacy, job.seed_file, job.settings.unit)
    return job


def engine_named(name: str, spark=None):
    """The engine `name` ("local", "spark" on the session `spark`, or "beam" on the DirectRunner)."""
    from pipelines.engines.local import LocalEngine
    from pipelines.engines.prepare_beam import BeamEngine
    from pipelines.engines.prepare_spark import SparkEngine

    return {"local": LocalEngine, "spark": lambda: SparkEngine(spark), "beam": BeamEngine}[name]()


def noise_free_release(engine: str, folder, interactions, embeddings, counts, catalog, settings, spark=None) -> str:
    """Run the stats job without noise on `engine` (`engine_named`) over the rows (the embeddings
    of the users who have rows); returns the path of its released table."""
    from pipelines.releases import stats_job
    from pipelines.releases.release import PrivacySettings

    paths = write_inputs(
        folder,
        interactions,
        {u: v for u, v in embeddings.items() if any(row[0] == u for row in interactions)},
        counts,
        catalog,
    )
    job = registered(
        stats_job.StatsJob(
            paths["interactions"],
            paths["user_embeddings"],
            paths["items"],
            paths["counts"],
            str(folder / "out"),
            settings,
            PrivacySettings(noise_multiplier=0.0),
        )
    )
    engine_named(engine, spark).release_stats(job)
    return str(folder / "out" / "resample-0.parquet")
