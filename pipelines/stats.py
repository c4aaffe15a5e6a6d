"""The stats job on Spark: `spark-submit pipelines/stats.py --help` (also `ssp stats`).

One pass over the interactions: joined with user embeddings and the (broadcast) DP counts,
repartitioned by user and sorted, each partition turns complete users into clipped, weighted
contributions and pre-aggregates them per item with numpy (`mapInArrow`, grouped GEMM over Arrow
batches, no per-row Python); the partial sums (one per item per partition) are shuffled by item
together with one empty row per catalog item, merged in a fixed order, noised once per item and
written by each shard straight into the staged stats tables; the driver commits them. Shuffle
volume is O(partitions x items per partition x d^2/2).

Privacy: the same as pipelines.stats_job / privacy.accumulator: the noise is added after the merge,
to every catalog item, keyed by the release index the ledger gave.
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
from pipelines.stats_core import PARTIALS, PartialSums, list_column_to_matrix, partials_batch, release_metadata, stats_table, user_contributions  # noqa: E402
from privacy import accumulator  # noqa: E402
from schemas import storage  # noqa: E402

PARTIALS_DDL = "item_id long, source long, a_upper array<double>, b array<double>"
WRITTEN_DDL = "resample int, name string, rows long"
KERNEL_ROWS = 262_144  # complete users' rows gathered before one grouped-sums call


def per_user_partials(settings, batches: Iterator[pa.RecordBatch], partition: int) -> Iterator[pa.RecordBatch]:
    """One partition (sorted by user, then item) -> its partial sums per item, emitted once.

    A user's rows may straddle Arrow batches: the last user of a batch waits for the next one.
    Sums run over the partition's rows in their sorted order, so reruns are bit-identical.
    """
    d = settings.dim
    running = None
    pending: list[pa.RecordBatch] = []
    pending_rows = 0

    def flush(tables: list[pa.RecordBatch]):
        nonlocal running
        table = pa.Table.from_batches(tables).combine_chunks()
        items, x, c = user_contributions(
            table["user_id"].to_numpy(), table["item_id"].to_numpy(), table["label"].to_numpy(),
            list_column_to_matrix(table["embedding"], d, "user embedding"), table["count"].to_numpy(), settings,
        )
        keys, a, b = accumulator.grouped_sums(items, x, c)
        if running is not None:
            keys, a, b = accumulator.reduce_by_key(np.r_[running[0], keys], np.vstack([running[1], a]), np.vstack([running[2], b]))
        running = (keys, a, b)

    for batch in batches:
        if batch.num_rows == 0:
            continue
        users = batch.column("user_id").to_numpy()
        cut = int(np.searchsorted(users, users[-1], side="left"))  # the last user's first row
        if cut > 0:
            pending.append(batch.slice(0, cut))
            pending_rows += cut
            if pending_rows >= KERNEL_ROWS:
                flush(pending)
                pending, pending_rows = [], 0
        pending.append(batch.slice(cut))  # rows of a user who may continue in the next batch
    if pending:
        flush(pending)
    if running is not None:
        yield partials_batch(*running, source=partition)


def merge_and_write(settings, specs, staged, batches: Iterator[pa.RecordBatch], shard: int) -> Iterator[pa.RecordBatch]:
    """One shard of items: merge partials, noise once per item and resample, write the parts."""
    sums = PartialSums(settings.dim)
    for batch in batches:
        sums.add_batch(batch)
    items, a, b = sums.result()
    if items.size == 0:
        return
    for resample, (spec, target) in enumerate(zip(specs, staged)):
        noised_a, noised_b = accumulator.finalize(items, a, b, spec)
        name = target.write_part(shard, stats_table(items, noised_a, noised_b, release_metadata(settings, spec, resample)))
        yield pa.RecordBatch.from_pydict({"resample": [resample], "name": [name], "rows": [int(items.size)]},
                                         schema=pa.schema([("resample", pa.int32()), ("name", pa.string()), ("rows", pa.int64())]))


def run(job: stats_job.StatsJob, spark) -> dict:
    """Prepare the releases, compute and write them with Spark, commit; returns the step summary."""
    from pyspark import TaskContext
    from pyspark.sql import functions as F

    specs = job.prepare()
    staged = job.staged_writes()
    settings = job.settings
    read = lambda path: spark.read.parquet(*storage.table_files(path))  # noqa: E731
    interactions = read(job.interactions).select("user_id", "item_id", "label")
    embeddings = read(job.user_embeddings).select("user_id", "embedding")
    counts = read(job.counts).select("item_id", "count")
    joined = interactions.join(embeddings, "user_id").join(F.broadcast(counts), "item_id")
    partitions = max(2, spark.sparkContext.defaultParallelism)
    by_user = joined.repartition(partitions, "user_id").sortWithinPartitions("user_id", "item_id")
    partials = by_user.mapInArrow(lambda batches: per_user_partials(settings, batches, TaskContext.get().partitionId()), PARTIALS_DDL)
    catalog = spark.createDataFrame(
        pa.table({"item_id": job.catalog, "source": np.zeros(job.catalog.size, np.int64),
                  "a_upper": pa.nulls(job.catalog.size, pa.list_(pa.float64())), "b": pa.nulls(job.catalog.size, pa.list_(pa.float64()))},
                 schema=PARTIALS)
    )
    shards = partials.unionByName(catalog).repartition(job.shards, "item_id")
    written = shards.mapInArrow(lambda batches: merge_and_write(settings, specs, staged, batches, TaskContext.get().partitionId()), WRITTEN_DDL).collect()
    names = [[row["name"] for row in written if row["resample"] == k] for k in range(len(specs))]
    rows = [sum(row["rows"] for row in written if row["resample"] == k) for k in range(len(specs))]
    return job.commit(names, rows)


def main(argv: list[str] | None = None) -> int:
    from pipelines.spark import session

    parser = argparse.ArgumentParser(prog="stats.py", description="The AM-SSP stats job on Spark: noised A_j, b_j for every catalog item.")
    stats_job.add_arguments(parser)
    parser.add_argument("--master", help="Spark master (default: the one spark-submit gives, else local[*])")
    args = parser.parse_args(argv)
    try:
        job = stats_job.StatsJob.from_args(args)
        with session("ssp-stats", args.master) as spark:
            summary = run(job, spark)
    except (ValueError, storage.MissingTableError) as exc:
        print(f"stats: error: {exc}", file=sys.stderr)
        return 2
    print(stats_job.describe(summary))
    return 0


if __name__ == "__main__":
    sys.exit(main())
