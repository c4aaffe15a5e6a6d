"""The stats job on Spark: `spark-submit pipelines/stats.py --help` (also `ssp stats`).

One pass over the interactions, with rows partitioned by ITEM so that no partial sums are shuffled:
the narrow rows (user, item, label), unioned with one empty row per catalog item, are repartitioned
by item. Each task then holds complete items: it looks up its rows' DP counts and, at user level,
their users' weight normalisers (sums over all of a user's rows, computed by `StatsJob.prepare()`
with `privacy.weights`) in a broadcast, turns the rows into clipped, weighted contributions, sums
them per item with one numpy call (`mapInArrow`, grouped GEMM, no per-row Python), adds the noise
once to every item it holds (rows or not) and writes its part of each resample's stats table; the
driver commits them. Shuffle volume is O(rows) of narrow rows. The user embeddings (users x d,
which bounds a task's memory) are read once per Python worker and release: Spark reuses workers
across tasks.

Privacy: the same as pipelines.stats_job / privacy.accumulator: the noise is added after the sums
are complete, to every catalog item, keyed by the release index the ledger gave.
"""

from __future__ import annotations

import os
import sys

if __package__ in (None, ""):  # run as a script by spark-submit: make the project importable
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import argparse  # noqa: E402
from collections.abc import Iterator  # noqa: E402

import numpy as np  # noqa: E402
import pyarrow as pa  # noqa: E402

from pipelines import stats_job  # noqa: E402
from pipelines.spark import readable_tables  # noqa: E402
from pipelines.stats_core import RowLookups, release_metadata, stats_table, user_contributions  # noqa: E402
from schemas.arrays import list_column_to_matrix  # noqa: E402
from privacy import accumulator  # noqa: E402
from schemas import storage  # noqa: E402

WRITTEN_DDL = "resample int, name string, rows long"
CHUNK_ROWS = 32_768  # rows summed at a time within a task (whole items; a bigger item is one chunk)
ROWS_PER_PARTITION = 2_000_000  # bounds a task's memory: its rows and their d-wide contributions (about 3 GiB at d=64)


_last_vectors: dict = {}  # per Python worker (Spark reuses them across tasks): the last embeddings read, by content digest


def user_vectors(path: str, digest: str, d: int) -> tuple[np.ndarray, np.ndarray]:
    """(sorted user ids, their embeddings) of a user embeddings table whose content digest
    (from prepare()) is `digest`; a worker's next task of the same release reuses them."""
    if _last_vectors.get("digest") != digest:
        table = storage.read_table(path)
        users = table["user_id"].to_numpy()
        order = np.argsort(users)
        _last_vectors.clear()
        _last_vectors.update(digest=digest, value=(users[order], list_column_to_matrix(table["embedding"], d, "user embedding")[order]))
    return _last_vectors["value"]


def item_shard(settings, specs, staged, embeddings: tuple[str, str], lookups: RowLookups, batches: Iterator[pa.RecordBatch], shard: int) -> Iterator[pa.RecordBatch]:
    """One shard of complete items -> its noised statistics, written as part `shard` of each table.

    Rows are summed in (item, user) order, so reruns are bit-identical whatever order the shuffle
    delivered them in.
    """
    collected = [batch for batch in batches if batch.num_rows]
    if not collected:
        return
    table = pa.Table.from_batches(collected)
    items = np.unique(table["item_id"].to_numpy())  # every item of the shard, rows or not
    rows = table.filter(table["user_id"].is_valid())
    a = np.zeros((items.size, accumulator.packed_size(settings.dim)))
    b = np.zeros((items.size, settings.dim))
    if rows.num_rows:
        owners, vectors = user_vectors(*embeddings, settings.dim)
        users, rated = rows["user_id"].to_numpy(), rows["item_id"].to_numpy()
        by_user = accumulator.stable_argsort(users)
        order = by_user[accumulator.stable_argsort(rated[by_user])]  # by (item, user): np.lexsort((users, rated)), radix-fast
        users, rated, labels = users[order], rated[order], rows["label"].to_numpy()[order]
        counts, normalisers = lookups.of(users, rated)
        # Chunks of whole items: small arrays the allocator reuses (fresh GB-sized arrays cost page faults)
        item_starts = np.flatnonzero(np.r_[True, rated[1:] != rated[:-1]])
        bounds = np.unique(np.r_[item_starts[np.searchsorted(item_starts, np.arange(0, rated.size, CHUNK_ROWS), side="right") - 1], rated.size])
        for start, end in zip(bounds[:-1], bounds[1:]):
            part = slice(start, end)
            keys, x, c = user_contributions(users[part], rated[part], labels[part], vectors[np.searchsorted(owners, users[part])], counts[part], settings,
                                            None if normalisers is None else normalisers[part])
            keys, sums_a, sums_b = accumulator.grouped_sums(keys, x, c)
            at = np.searchsorted(items, keys)
            a[at], b[at] = sums_a, sums_b
    for resample, (spec, target) in enumerate(zip(specs, staged)):
        noised_a, noised_b = accumulator.finalize(items, a, b, spec)
        name = target.write_part(shard, stats_table(items, noised_a, noised_b, release_metadata(settings, spec, resample)))
        yield pa.RecordBatch.from_pydict({"resample": [resample], "name": [name], "rows": [int(items.size)]},
                                         schema=pa.schema([("resample", pa.int32()), ("name", pa.string()), ("rows", pa.int64())]))


def _maybe_failing(results: Iterator[pa.RecordBatch], fail_first_attempt: bool) -> Iterator[pa.RecordBatch]:
    """Pass a task's results through, or (fault injection) fail its first attempt at the end."""
    from pyspark import TaskContext

    produced = list(results)
    if fail_first_attempt and TaskContext.get().attemptNumber() == 0:
        raise RuntimeError("injected failure of a first task attempt")
    yield from produced


def run(job: stats_job.StatsJob, spark, fail_first_attempts: bool = False) -> dict:
    """Prepare the releases, compute and write them with Spark, commit; returns the step summary.

    `fail_first_attempts` is fault injection for tests: every item task fails on its first attempt,
    after writing its part files, so Spark's retry must reproduce them exactly (keyed noise and a
    fixed summation order make that so).
    """
    from pyspark import TaskContext

    specs = job.prepare()
    staged = job.staged_writes()
    settings = job.settings
    users, normalisers = job.normalisers if settings.unit == "user" and job.normalisers else (None, None)  # by prepare(), privacy.weights
    lookups = spark.sparkContext.broadcast(RowLookups(job.catalog, job.catalog_counts, users, normalisers))
    with readable_tables(spark, job.interactions) as (interactions,):
        rows = spark.read.parquet(*interactions).select("user_id", "item_id", "label")
        catalog = spark.createDataFrame(pa.table({"user_id": pa.nulls(job.catalog.size, pa.int64()), "item_id": job.catalog, "label": pa.nulls(job.catalog.size, pa.float64())}))
        partitions = max(job.shards, -(-job.rows // ROWS_PER_PARTITION))
        by_item = rows.unionByName(catalog).repartition(partitions, "item_id")
        embeddings = (job.user_embeddings, job.digests["user_embeddings"])
        written = by_item.mapInArrow(
            lambda batches: _maybe_failing(item_shard(settings, specs, staged, embeddings, lookups.value, batches, TaskContext.get().partitionId()), fail_first_attempts),
            WRITTEN_DDL
        ).collect()
    lookups.unpersist()
    names = [[row["name"] for row in written if row["resample"] == k] for k in range(len(specs))]
    written_rows = [sum(row["rows"] for row in written if row["resample"] == k) for k in range(len(specs))]
    return job.commit(names, written_rows)


def main(argv: list[str] | None = None) -> int:
    from pipelines.spark import session

    parser = argparse.ArgumentParser(prog="stats.py", description="The AM-SSP stats job on Spark: noised A_j, b_j for every catalog item.")
    stats_job.add_arguments(parser)
    parser.add_argument("--master", help="Spark master (default: the one spark-submit gives, else local[*])")
    args = parser.parse_args(argv)
    def compute() -> dict:
        job = stats_job.StatsJob.from_args(args)
        with session("ssp-stats", args.master) as spark:
            return run(job, spark)

    return stats_job.run_and_report(compute)


if __name__ == "__main__":
    sys.exit(main())
