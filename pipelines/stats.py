"""The stats job on Spark: `spark-submit pipelines/stats.py --help` (also `ssp stats`).

One pass over the interactions: the narrow rows (user, item, label, DP count from a broadcast
join) and the user embeddings (as fixed-width binary) are unioned and repartitioned by user, so each
partition holds complete users with their embeddings, without a sort or a wide join in the JVM.
Each partition turns its users into clipped, weighted contributions and pre-aggregates them per item
with one numpy call (`mapInArrow`, grouped GEMM, no per-row Python); the partial sums (one per item
per partition, as binary) are shuffled by item together with one empty row per catalog item, merged
in a fixed order, noised once per item and written by each shard straight into the staged stats
tables; the driver commits them. Shuffle volume is O(rows + partitions x items per partition x d^2/2).

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
from pipelines.stats_core import PARTIALS, PartialSums, partials_batches, release_metadata, stats_table, user_contributions  # noqa: E402
from schemas.arrays import binary_to_matrix, list_column_to_matrix, matrix_to_binary  # noqa: E402
from privacy import accumulator  # noqa: E402
from schemas import storage  # noqa: E402

PARTIALS_DDL = "item_id long, source long, sums binary"
ROWS_DDL = "user_id long, item_id long, label double, count double, embedding binary"
WRITTEN_DDL = "resample int, name string, rows long"
ROWS_PER_PARTITION = 2_000_000  # bounds a task's memory: its rows and their d-wide contributions (about 3 GiB at d=64)


def embeddings_as_binary(batches: Iterator[pa.RecordBatch], d: int) -> Iterator[pa.RecordBatch]:
    """User embeddings (list<double>) -> rows of the union schema with the vector as binary."""
    for batch in batches:
        n = batch.num_rows
        yield pa.RecordBatch.from_arrays(
            [batch.column("user_id"), pa.nulls(n, pa.int64()), pa.nulls(n, pa.float64()), pa.nulls(n, pa.float64()),
             matrix_to_binary(list_column_to_matrix(batch.column("embedding"), d, "user embedding"))],
            names=["user_id", "item_id", "label", "count", "embedding"],
        )


def partition_partials(settings, batches: Iterator[pa.RecordBatch], partition: int) -> Iterator[pa.RecordBatch]:
    """One partition (complete users: their rows and their embeddings) -> partial sums per item.

    Rows are put in (item, user) order before summing, so reruns are bit-identical whatever order
    the shuffle delivered them in.
    """
    collected = [batch for batch in batches if batch.num_rows]
    if not collected:
        return
    table = pa.Table.from_batches(collected)
    is_embedding = table["embedding"].is_valid().to_numpy(zero_copy_only=False)
    embeddings = table.filter(pa.array(is_embedding))
    rows = table.filter(pa.array(~is_embedding))
    if rows.num_rows == 0:
        return
    owners = embeddings["user_id"].to_numpy()
    by_owner = np.argsort(owners)
    vectors = binary_to_matrix(embeddings["embedding"], settings.dim)[by_owner]
    users, items = rows["user_id"].to_numpy(), rows["item_id"].to_numpy()
    order = np.lexsort((users, items))
    users, items = users[order], items[order]
    u = vectors[np.searchsorted(owners[by_owner], users)]
    items, x, c = user_contributions(users, items, rows["label"].to_numpy()[order], u, rows["count"].to_numpy()[order], settings)
    keys, a, b = accumulator.grouped_sums(items, x, c)
    yield from partials_batches(keys, a, b, source=partition)


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
    counts = read(job.counts).select("item_id", "count")
    rows = (
        read(job.interactions).select("user_id", "item_id", "label").join(F.broadcast(counts), "item_id")
        .select("user_id", "item_id", "label", "count", F.lit(None).cast("binary").alias("embedding"))
    )
    embeddings = read(job.user_embeddings).select("user_id", "embedding").mapInArrow(lambda batches: embeddings_as_binary(batches, settings.dim), ROWS_DDL)
    partitions = max(spark.sparkContext.defaultParallelism, -(-job.rows // ROWS_PER_PARTITION))  # few: partials scale with it
    by_user = rows.unionByName(embeddings).repartition(partitions, "user_id")
    partials = by_user.mapInArrow(lambda batches: partition_partials(settings, batches, TaskContext.get().partitionId()), PARTIALS_DDL)
    catalog = spark.createDataFrame(
        pa.table({"item_id": job.catalog, "source": np.zeros(job.catalog.size, np.int64), "sums": pa.nulls(job.catalog.size, pa.binary())}, schema=PARTIALS)
    )
    shards = partials.unionByName(catalog).repartition(job.shards, "item_id")
    written = shards.mapInArrow(lambda batches: merge_and_write(settings, specs, staged, batches, TaskContext.get().partitionId()), WRITTEN_DDL).collect()
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
