"""The prepare stage's row work on Spark: the split, the aggregates of the DP counts and the DP mean,
and the centred training tables.

The rows stay on the executors; the driver receives per-item and per-release aggregates only (a
count per item and task, two sums, the training users' items, the written parts' names and sizes), so no
step holds the log in one process (ARCHITECTURE.md, Scale). The math is the in-process one
(pipelines.data.splits, pipelines.releases.counts, pipelines.releases.mean) applied to partitions of complete users
(rows repartitioned by user and sorted within partitions), so the tables and, for the same seed,
the releases are the ones this process would make: counts exactly, the mean's sums to float64
rounding (the order of the additions differs).

Privacy: reads private interactions and writes private tables into the run directory; releases
nothing itself (pipelines.releases.counts and pipelines.releases.mean noise the aggregates and record the releases).
"""

from __future__ import annotations

import json
from collections.abc import Iterator

import numpy as np
import pyarrow as pa

from pipelines.data import splits
from pipelines.data.chunks import complete_users, sorted_by_user, users_together
from pipelines.engines.spark import forward_storage_settings, per_file, readable_tables
from pipelines.releases import train_sums
from pipelines.releases.counts import exact_aggregates, row_problem
from pipelines.releases.mean import CentredOutput, weighted_sums_of, write_centred_parts
from privacy.accumulator import packed_size
from privacy.seeds import keyed_digest_of, keyed_digest_part
from schemas import storage
from schemas.errors import UserError
from schemas.ids import IdIndex
from schemas.tables import INTERACTIONS

WRITTEN_DDL = "name string, rows long"
SPLIT_DDL = "table string, name string, rows long, users long, eligible long"
INTERACTION_COLUMNS = ("user_id", "item_id", "label", "timestamp")


def files_of_whole_users(interactions: str) -> list[str] | None:
    """The table's files when each declares whole users in order (chunks.USERS_TOGETHER, checked
    as it is read) and their user_id ranges (Parquet statistics) do not overlap, so that no user
    is in two files; else None (the rows are then shuffled by user)."""
    if not users_together(interactions):
        return None
    files = storage.table_files(interactions)
    ranges = [storage.value_range(file, "user_id") for file in files]
    if any(span is None for span in ranges):
        return None
    bounds = sorted(span for span in ranges)
    if any(high >= low for (_, high), (low, _) in zip(bounds, bounds[1:], strict=False)):
        return None
    return files


TRAIN_SUMS_DDL = "at long, value double, user long, digest string, problem string"
TRAIN_SUMS = pa.schema(
    [
        ("at", pa.int64()),  # a position of the sums: the counts, the number of units, the mean's two sums
        ("value", pa.float64()),
        ("user", pa.int64()),  # a user of the task's file
        ("digest", pa.string()),  # a keyed digest part (JSON)
        ("problem", pa.string()),  # the file's first bad row, as check_count_rows words it
    ]
)


def _train_sums_rows(**columns) -> pa.RecordBatch:
    """A batch of `SparkEngine.train_sums`' task rows: the given columns, the others null."""
    rows = len(next(iter(columns.values())))
    return pa.record_batch(
        [pa.array(columns[f.name], f.type) if f.name in columns else pa.nulls(rows, f.type) for f in TRAIN_SUMS],
        schema=TRAIN_SUMS,
    )


def _file_sums(batches: Iterator[pa.RecordBatch], file: str, of_chunk, width: int) -> tuple[np.ndarray, np.ndarray]:
    """(the sum of `of_chunk(chunk)`, `width` numbers, over the chunks of complete users of one
    file's batches, which it declares sorted by user; the file's users), in a task."""
    total, users = np.zeros(width), []
    for chunk in complete_users(sorted_by_user(batches, file)):
        total += of_chunk(chunk)
        ids = chunk["user_id"].to_numpy()
        users.append(ids[np.r_[True, ids[1:] != ids[:-1]]])
    return total, np.concatenate(users) if users else np.zeros(0, np.int64)


def _sums_of_files(found: pa.Table, interactions: str, width: int, broken: str) -> np.ndarray:
    """The tasks' sums (`found`'s "at" and "value" rows: each file's nonzero entries) added up in
    their order, after refusing a user found in two files ("user" rows): `broken` says what its two
    partial histories would break."""
    users = np.sort(found["user"].drop_null().to_numpy())  # the column alone: the table's other columns not copied
    if np.any(users[1:] == users[:-1]):
        raise UserError(
            f"{interactions}: a user's rows are in two of its files, though each file declares whole users; {broken}"
        )
    summed = found["at"].is_valid()
    return np.bincount(
        found["at"].filter(summed).to_numpy(), weights=found["value"].filter(summed).to_numpy(), minlength=width
    )


class SparkEngine:
    """Every operation of pipelines.engines.engine.Engine on a Spark session: `spark`, or a function
    that returns it (engines.spark.session_on_demand: opened when an operation first needs it)."""

    name = "spark"
    solves_users_in_release = False

    def __init__(self, spark):
        self._spark = spark if callable(spark) else (lambda: spark)

    @property
    def spark(self):
        return self._spark()

    def release_stats(self, job) -> dict:
        """The statistics release of `job` (pipelines.engines.spark_stats)."""
        from pipelines.engines import spark_stats

        return spark_stats.run(job, self.spark)

    def user_update(self, interactions: str, item_embeddings: str, out: str, solve):
        """The user update (pipelines.engines.user_solves)."""
        from pipelines.engines import user_solves

        return user_solves.run_spark(self.spark, interactions, item_embeddings, out, solve)

    def _by_user(self, files: list[str], columns: tuple[str, ...] = INTERACTION_COLUMNS):
        """The interactions' `columns` repartitioned by user (spark.sql.shuffle.partitions parts), each sorted by
        user."""
        return self.spark.read.parquet(*files).select(*columns).repartition("user_id").sortWithinPartitions("user_id")

    def split(self, interactions: str, rule: splits.SplitRule, out: str) -> tuple[dict, int]:
        """`splits.make_split`'s tables of `rule`, written into `out`; returns (sizes, eligible users)."""
        from pyspark import TaskContext

        staged = {name: storage.StagedWrite(storage.join(out, f"{name}.parquet")) for name in rule.parts}
        user_files = files_of_whole_users(interactions)
        if user_files:
            with splits.discarded_on_failure(staged):
                return self._split_per_file(interactions, user_files, rule, staged)
        with splits.discarded_on_failure(staged), readable_tables(self.spark, interactions) as (files,):
            by_user = self._by_user(files)
            train_items = None
            if rule.needs_train_items:  # a first pass: the items of every training user's positives
                found = (
                    by_user.mapInArrow(lambda batches: splits.train_items_of(batches, rule), "item_id long")
                    .distinct()
                    .collect()
                )
                train_items = np.sort(np.array([row["item_id"] for row in found], dtype=np.int64))
            written = by_user.mapInArrow(
                lambda batches: splits.split_partition(
                    batches, rule, staged, TaskContext.get().partitionId(), train_items
                ),
                SPLIT_DDL,
            ).collect()
        return splits.commit_split(
            rule,
            staged,
            pa.Table.from_pylist([row.asDict() for row in written], schema=splits.SPLIT_WRITTEN),
            interactions,
        )

    def _split_per_file(
        self, interactions: str, files: list[str], rule: splits.SplitRule, staged: dict
    ) -> tuple[dict, int]:
        """`split` with a task per file of whole users (`files_of_whole_users`): no shuffle by user."""

        def rows_of(file: str) -> Iterator[pa.RecordBatch]:
            return sorted_by_user(storage.iter_batches(file, columns=list(INTERACTION_COLUMNS)), file)

        train_items = None
        if rule.needs_train_items:
            found = per_file(
                self.spark, files, lambda index, file: splits.train_items_of(rows_of(file), rule), "item_id long"
            )
            train_items = np.unique(found["item_id"].to_numpy())
        written = per_file(
            self.spark,
            files,
            lambda index, file: splits.split_partition(rows_of(file), rule, staged, index, train_items),
            SPLIT_DDL,
        )
        return splits.commit_split(rule, staged, written.cast(splits.SPLIT_WRITTEN), interactions)

    def check_count_rows(self, interactions: str, catalog: np.ndarray) -> None:
        """`counts.read_rows`'s refusals, with its messages: each row group of the table is read and
        validated by a Python task (`counts.row_problem`); the first problem found is raised."""
        forward_storage_settings(self.spark)
        units = storage.row_groups(interactions)
        if not units:
            return
        work = self.spark.createDataFrame([(file, group) for file, group, _ in units], "file string, row_group int")

        def check(batches: Iterator[pa.RecordBatch]) -> Iterator[pa.RecordBatch]:
            known = IdIndex(catalog)
            for batch in batches:
                for file, group in zip(
                    batch.column("file").to_pylist(), batch.column("row_group").to_pylist(), strict=True
                ):
                    for rows in storage.iter_row_group(file, group):
                        problem = row_problem(rows, known)
                        if problem:
                            yield pa.record_batch({"problem": [problem]})
                            return

        found = (
            work.repartition(min(len(units), max(2, self.spark.sparkContext.defaultParallelism)))
            .mapInArrow(check, "problem string")
            .limit(1)
            .collect()
        )
        if found:
            raise UserError(f"{interactions}: {found[0]['problem']}")

    def count_aggregates(
        self, interactions: str, catalog: np.ndarray, unit: str, max_items_per_user: int, key: int
    ) -> tuple[np.ndarray, int]:
        """`counts.exact_aggregates` (rows checked by `check_count_rows`) applied to chunks of complete
        users (user level: one shuffle by user, or a task per file of a table whose files hold whole
        users in order, the split's train; example level: the table's own partitions); each task
        returns its nonzero counts and its number of units, which the driver adds up: the same
        numbers. A user's sample of at most K items is drawn once, so without the shuffle each file
        also returns its users, and a user found in two files is refused."""
        size = catalog.size  # the row at this position carries a task's number of units
        if unit == "user" and users_together(interactions):
            return self._count_aggregates_per_file(interactions, catalog, max_items_per_user, key)

        def aggregate(batches: Iterator[pa.RecordBatch]) -> Iterator[pa.RecordBatch]:
            totals, units = np.zeros(size, dtype=np.int64), 0
            for chunk in (
                complete_users(batches) if unit == "user" else (pa.Table.from_batches([batch]) for batch in batches)
            ):
                exact, found = exact_aggregates(
                    chunk["user_id"].to_numpy(), chunk["item_id"].to_numpy(), catalog, unit, max_items_per_user, key
                )
                totals += exact.astype(np.int64)
                units += found
            positions = np.flatnonzero(totals)
            yield pa.record_batch({"position": np.r_[positions, size], "count": np.r_[totals[positions], units]})

        with readable_tables(self.spark, interactions) as (files,):
            rows = (
                self._by_user(files, ("user_id", "item_id"))
                if unit == "user"
                else self.spark.read.parquet(*files).select("user_id", "item_id")
            )
            found = rows.mapInArrow(aggregate, "position long, count long").toArrow()
        totals = np.bincount(found["position"].to_numpy(), weights=found["count"].to_numpy(), minlength=size + 1)
        return totals[:size], int(totals[size])

    def _count_aggregates_per_file(
        self, interactions: str, catalog: np.ndarray, max_items_per_user: int, key: int
    ) -> tuple[np.ndarray, int]:
        """`count_aggregates` at user level, a task per file of whole users in order (no shuffle)."""

        def of_chunk(chunk: pa.Table) -> np.ndarray:
            exact, found = exact_aggregates(
                chunk["user_id"].to_numpy(), chunk["item_id"].to_numpy(), catalog, "user", max_items_per_user, key
            )
            return np.r_[exact, found]

        totals = self._sums_per_file(
            interactions, ["user_id", "item_id"], of_chunk, catalog.size + 1, "the counts would sample the user twice"
        )
        return totals[: catalog.size], int(totals[catalog.size])

    def train_sums(self, interactions: str, request: train_sums.TrainSumsRequest) -> train_sums.TrainSums:
        """The prepare stage's sums (pipelines.releases.train_sums). Of a table whose files declare
        whole users in order, at user level (the split's train), one job: a task per file reads it
        once, refuses its first bad row as `check_count_rows` does, takes its chunks' counts and
        mean sums as `count_aggregates` and `mean_sums` do (the same per-file totals, added up in
        the same order: the same bits) and its part of the keyed digest. Otherwise each operation
        in turn."""
        if request.unit != "user" or not users_together(interactions):
            return train_sums.one_by_one(self, interactions, request)
        catalog, mean_at = request.catalog, request.catalog.size + 1  # counts, units, then the mean's two sums

        def of_chunk(chunk: pa.Table) -> np.ndarray:
            users = chunk["user_id"].to_numpy()
            exact, units = exact_aggregates(
                users, chunk["item_id"].to_numpy(), catalog, "user", request.max_items_per_user, request.sampling_key
            )
            if request.rating_range is None:
                return np.r_[exact, units, 0.0, 0.0]
            labels = chunk["label"].to_numpy()
            return np.r_[exact, units, weighted_sums_of(users, labels, request.rating_range, "user", request.user_cap)]

        def task(index: int, file: str) -> Iterator[pa.RecordBatch]:
            known, parts, problems = IdIndex(catalog), [], []

            def checked(batches: Iterator[pa.RecordBatch]) -> Iterator[pa.RecordBatch]:
                for batch in batches:
                    problem = row_problem(batch, known)
                    if problem:
                        problems.append(problem)
                        return
                    parts.append(keyed_digest_part([batch], request.digest_key))
                    yield batch

            total, ids = _file_sums(checked(storage.iter_batches(file)), file, of_chunk, mean_at + 2)
            if problems:
                yield _train_sums_rows(problem=problems)
                return
            at = np.flatnonzero(total)
            yield _train_sums_rows(at=at, value=total[at])
            yield _train_sums_rows(user=ids)
            yield _train_sums_rows(digest=[json.dumps(part) for part in parts])

        found = per_file(self.spark, storage.table_files(interactions), task, TRAIN_SUMS_DDL)
        problems = found["problem"].drop_null().to_pylist()
        if problems:
            raise UserError(f"{interactions}: {sorted(problems)[0]}")
        totals = _sums_of_files(found, interactions, mean_at + 2, "the counts would sample the user twice")
        parts = found["digest"].drop_null().to_pylist()
        digest = keyed_digest_of(json.loads(part) for part in parts)
        return train_sums.TrainSums(
            totals[: catalog.size],
            int(totals[catalog.size]),
            None if request.rating_range is None else (float(totals[mean_at]), float(totals[mean_at + 1])),
            digest,
        )

    def item_gram_sums(self, interactions: str, items: np.ndarray) -> np.ndarray:
        """`item_gram.item_gram_sums` of chunks of complete users (one shuffle by user, or a task per
        file of whole users in order), each task's nonzero entries added up on the driver."""
        from pipelines.releases.item_gram import item_gram_sums

        width = packed_size(items.size)

        def of_chunk(chunk: pa.Table) -> np.ndarray:
            return item_gram_sums(chunk["user_id"].to_numpy(), chunk["item_id"].to_numpy(), items)

        if users_together(interactions):
            return self._sums_per_file(
                interactions, ["user_id", "item_id"], of_chunk, width, "the item Gram would scale the user twice"
            )

        def aggregate(batches: Iterator[pa.RecordBatch]) -> Iterator[pa.RecordBatch]:
            total = np.zeros(width)
            for chunk in complete_users(batches):
                total += of_chunk(chunk)
            at = np.flatnonzero(total)
            yield pa.record_batch({"at": at, "value": total[at]})

        with readable_tables(self.spark, interactions) as (files,):
            found = (
                self._by_user(files, ("user_id", "item_id")).mapInArrow(aggregate, "at long, value double").toArrow()
            )
        return np.bincount(found["at"].to_numpy(), weights=found["value"].to_numpy(), minlength=width)

    def mean_sums(
        self, interactions: str, rating_range: tuple[float, float], unit: str, user_cap: float
    ) -> tuple[float, float]:
        """`mean.weighted_sums`: per-user sums on the executors, two numbers to the driver."""
        from pyspark.sql import functions as F

        if unit == "user" and users_together(interactions):
            return self._mean_sums_per_file(interactions, rating_range, user_cap)
        low, high = rating_range
        with readable_tables(self.spark, interactions) as (files,):
            rows = self.spark.read.parquet(*files).select(
                "user_id", F.least(F.greatest(F.col("label"), F.lit(low)), F.lit(high)).alias("label")
            )
            middle = F.col("label") - F.lit((low + high) / 2)
            if unit == "user":
                per_user = rows.groupBy("user_id").agg(F.sum(middle).alias("total"), F.count(F.lit(1)).alias("n"))
                weight = F.least(F.lit(1.0), F.lit(user_cap) / F.col("n"))
                sums = per_user.agg(
                    F.sum(weight * F.col("total")).alias("sum"), F.sum(weight * F.col("n")).alias("count")
                ).first()
            else:
                sums = rows.agg(F.sum(middle).alias("sum"), F.count(F.lit(1)).cast("double").alias("count")).first()
        return float(sums["sum"] or 0.0), float(sums["count"] or 0.0)

    def _mean_sums_per_file(
        self, interactions: str, rating_range: tuple[float, float], user_cap: float
    ) -> tuple[float, float]:
        """`mean_sums` at user level, a task per file of whole users in order (no shuffle)."""

        def of_chunk(chunk: pa.Table) -> np.ndarray:
            return np.array(
                weighted_sums_of(chunk["user_id"].to_numpy(), chunk["label"].to_numpy(), rating_range, "user", user_cap)
            )

        total, count = self._sums_per_file(
            interactions, ["user_id", "label"], of_chunk, 2, "the mean would cap the user twice"
        )
        return float(total), float(count)

    def _sums_per_file(self, interactions: str, columns: list[str], of_chunk, width: int, broken: str) -> np.ndarray:
        """The sum of `of_chunk(chunk)` (`width` numbers) over the chunks of complete users of a table
        whose files declare whole users in order, a task per file (no shuffle by user). Each task
        also returns its users, and a user found in two files is refused: `broken` says what its
        two partial histories would break."""

        def task(index: int, file: str) -> Iterator[pa.RecordBatch]:
            total, ids = _file_sums(storage.iter_batches(file, columns=columns), file, of_chunk, width)
            at = np.flatnonzero(total)  # a count per catalog item is mostly zeros in one file
            yield pa.record_batch({"at": at, "value": total[at], "user": pa.nulls(at.size, pa.int64())})
            yield pa.record_batch(
                {"at": pa.nulls(ids.size, pa.int64()), "value": pa.nulls(ids.size, pa.float64()), "user": ids}
            )

        found = per_file(self.spark, storage.table_files(interactions), task, "at long, value double, user long")
        return _sums_of_files(found, interactions, width, broken)

    def write_centred(
        self,
        train: str,
        outputs: list[CentredOutput],
        mean: float,
        protocol: str,
        confidence_alpha: float | None = None,
    ) -> None:
        """`mean.centred` over every row of `train`, in one pass, written to each output (a path and
        the items it keeps), a part per input partition; from a table whose files hold whole users
        in order (the split's), a part per file, which then holds whole users in order too."""
        from pyspark import TaskContext

        staged = [(storage.StagedWrite(output.path), output) for output in outputs]

        def write(batches: Iterator[pa.RecordBatch], index: int, together: bool = False) -> Iterator[pa.RecordBatch]:
            written = write_centred_parts(
                batches,
                staged,
                index,
                mean=mean,
                protocol=protocol,
                confidence_alpha=confidence_alpha,
                users_together=together,
            )
            found = [(k, *part) for k, part in enumerate(written) if part is not None]
            if found:
                yield pa.record_batch(
                    dict(zip(("output", "name", "rows"), map(list, zip(*found, strict=True)), strict=True))
                )

        ddl = "output long, " + WRITTEN_DDL
        if users_together(train):
            written = per_file(
                self.spark,
                storage.table_files(train),
                lambda index, file: write(storage.iter_batches(file, columns=list(INTERACTION_COLUMNS)), index, True),
                ddl,
            ).to_pylist()
        else:
            with readable_tables(self.spark, train) as (files,):
                written = (
                    self.spark.read.parquet(*files)
                    .select(*INTERACTION_COLUMNS)
                    .mapInArrow(lambda batches: write(batches, TaskContext.get().partitionId()), ddl)
                    .collect()
                )
        for k, (table, _) in enumerate(staged):
            mine = [row for row in written if row["output"] == k]
            table.commit(
                [row["name"] for row in mine] or [table.write_part(0, INTERACTIONS.empty_table())],
                sum(row["rows"] for row in mine),
            )  # no task wrote part 0
