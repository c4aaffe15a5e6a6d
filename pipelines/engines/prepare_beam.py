"""The prepare stage's row work on Apache Beam (any runner; DirectRunner by default): the split, the
aggregates of the DP counts and the DP mean, and the centred training tables.

The same contract as pipelines.engines.prepare_spark: rows stay on the workers, and what comes back is
per-item and per-release aggregates only, through a small JSON file in a scratch folder that the
driver reads once the pipeline has finished (runner-agnostic: no driver-side collect). Users are
sent to shards by a hash of the user id (splitmix64), each shard's rows are sorted by user and
cut into complete users (pipelines.data.chunks), and the in-process math (pipelines.data.splits,
pipelines.releases.counts, pipelines.releases.mean) runs on them: the tables and, for the same seed, the releases
are this process's (counts exactly, the mean's sums to float64 rounding). A shard holds about
`shard_rows` rows, so a worker's memory is bounded by that, not by the log.

Privacy: reads private interactions and writes private tables (the split, the centred rows) and
private aggregates (into the scratch folder, removed afterwards) in the run directory; releases
nothing itself (pipelines.releases.counts and pipelines.releases.mean noise the aggregates and record the releases).
The runner's workers must be inside the trusted zone, as for the Beam stats job.

`ssp train --engine beam` runs it with the pipeline options of $SSP_BEAM_PIPELINE_OPTIONS (the
scheduled DAG sets Dataflow's there); without them, on the DirectRunner, which holds a shuffle in
memory: fine for tests and small logs, not for a log larger than the machine.

Privacy: as pipelines.engines.prepare_spark: private rows on the trusted side; the counts and the
mean are released through pipelines.releases.
"""

from __future__ import annotations

import math
import tempfile
import uuid
from collections.abc import Callable, Iterable, Iterator

import apache_beam as beam
import numpy as np
import pyarrow as pa
from apache_beam.options.pipeline_options import PipelineOptions

from pipelines.data import splits
from pipelines.data.chunks import users_together
from pipelines.engines.beam_release import ReadTable, pinned
from pipelines.releases import train_sums
from pipelines.releases.counts import exact_aggregates, row_problem
from pipelines.releases.mean import CentredOutput, weighted_sums_of, write_centred_parts
from privacy.accumulator import packed_size
from privacy.seeds import mix64
from schemas import storage
from schemas.errors import UserError
from schemas.tables import INTERACTIONS

SHARD_ROWS = 2_000_000  # rows per shard of users (a worker sorts one shard at a time)
OPTIONS_ENV = "SSP_BEAM_PIPELINE_OPTIONS"  # the Beam pipeline options of `ssp train`'s prepare stage, as flags
INTERACTION_COLUMNS = ["user_id", "item_id", "label", "timestamp"]


def _by_shard(batch: pa.RecordBatch, shards: int) -> Iterator[tuple[int, pa.RecordBatch]]:
    """(shard, the batch's rows of that shard's users) for every shard present in the batch."""
    users = np.asarray(batch.column("user_id").to_numpy(), np.int64).view(np.uint64)
    shard = (mix64(users) % np.uint64(shards)).astype(np.int64)
    for index in np.unique(shard).tolist():
        yield index, batch.filter(pa.array(shard == index))


def _sorted(batches: Iterable[pa.RecordBatch], order: tuple[str, ...] = ("user_id",)) -> list[pa.RecordBatch]:
    """A shard's rows sorted by `order` (user first), as batches (the input `chunks.complete_users` expects)."""
    table = pa.Table.from_batches(list(batches))
    return (
        table.sort_by([(name, "ascending") for name in order]).to_batches(max_chunksize=65_536)
        if table.num_rows
        else []
    )


def _columns(batches: list[pa.RecordBatch], *names: str) -> list[np.ndarray]:
    """The named columns of a shard's batches (a shard exists only when it has rows), as arrays."""
    table = pa.Table.from_batches(batches)
    return [table[name].to_numpy() for name in names]


def _sum_aggregates(parts: Iterable[tuple]) -> tuple:
    """Elementwise sums of equal-length tuples of numbers or arrays (an empty input sums to ())."""
    parts = list(parts)
    return tuple(sum(values) for values in zip(*parts, strict=True)) if parts else ()


def options_from_environment() -> PipelineOptions | None:
    """The prepare stage's Beam pipeline options from $SSP_BEAM_PIPELINE_OPTIONS ("--runner
    DataflowRunner --project P ..."; unset: the DirectRunner). A flag Beam does not know is refused:
    a typo would otherwise run the pipeline somewhere else than meant."""
    import os
    import shlex

    flags = shlex.split(os.environ.get(OPTIONS_ENV, ""))
    if not flags:
        return None
    options = PipelineOptions(flags)
    unknown = sorted(set(options.get_all_options(retain_unknown_options=True)) - set(options.get_all_options()))
    if unknown:
        raise UserError(f"${OPTIONS_ENV}: {', '.join('--' + name for name in unknown)} is not a Beam pipeline option")
    return options


class BeamEngine:
    """Every operation of pipelines.engines.engine.Engine as Beam pipelines run with `options`."""

    name = "beam"
    solves_users_in_release = False

    def __init__(
        self, options: PipelineOptions | None = None, scratch: str | None = None, shard_rows: int = SHARD_ROWS
    ):
        self.options, self.scratch, self.shard_rows = options, scratch, shard_rows

    def _collect(self, build: Callable[[beam.Pipeline], beam.PCollection]) -> list:
        """Run a pipeline whose `build` returns a PCollection of JSON values; returns them as a list."""
        with tempfile.TemporaryDirectory(prefix="ssp-beam-") as local:
            path = storage.join(self.scratch or local, f".collected-{uuid.uuid4().hex}.json")
            try:
                with beam.Pipeline(options=pinned(self.options)) as pipeline:
                    _ = (
                        build(pipeline)
                        | "Gather" >> beam.combiners.ToList()
                        | "Write" >> beam.Map(lambda values: storage.write_json({"values": values}, path))
                    )
                return storage.read_json(path)["values"]
            finally:
                storage.remove(path)

    def _shards(
        self, pipeline: beam.Pipeline, interactions: str, columns: list[str], order: tuple[str, ...] = ("user_id",)
    ) -> beam.PCollection:
        """(shard, rows of that shard's users sorted by `order`, as batches), about `shard_rows` rows each."""
        rows = storage.row_count(interactions)
        shards = max(1, math.ceil(rows / self.shard_rows))
        return (
            pipeline
            | "Read" >> ReadTable(interactions, columns)
            | "ToShards" >> beam.FlatMap(_by_shard, shards)
            | "GroupShards" >> beam.GroupByKey()
            | "SortShards" >> beam.MapTuple(lambda shard, batches: (shard, _sorted(batches, order)))
        )

    def release_stats(self, job) -> dict:
        """The statistics release of `job` (pipelines.engines.beam_release)."""
        from pipelines.engines import beam_release

        return beam_release.run(job, self.options)

    def user_update(self, interactions: str, item_embeddings: str, out: str, solve):
        """The user update (pipelines.engines.user_solves) as a pipeline, with the Spark tasks' bits:
        a table whose files hold whole users in order a file per task, any other by shards of users
        sorted by (user, item), as Spark's shuffle sorts them."""
        from pipelines.engines import user_solves

        vectors, gram, d = user_solves.item_vectors(item_embeddings, solve)
        staged = storage.StagedWrite(out)
        sources = (interactions, item_embeddings)

        def solved(part: int, batches) -> Iterator[dict]:
            for record in user_solves.solve_part(
                iter(batches), vectors, gram, solve, staged=staged, part=part, sources=sources
            ):
                yield from pa.Table.from_batches([record]).to_pylist()

        try:
            if users_together(interactions):
                files = list(enumerate(storage.table_files(interactions)))
                written = self._collect(
                    lambda p: (
                        p
                        | "Files" >> beam.Create(files)
                        | "Spread" >> beam.Reshuffle()
                        | "Solve" >> beam.FlatMapTuple(lambda index, file: solved(index, user_solves.file_rows(file)))
                    )
                )
            else:
                written = self._collect(
                    lambda p: (
                        self._shards(p, interactions, ["user_id", "item_id", "label"], ("user_id", "item_id"))
                        | "Solve" >> beam.FlatMapTuple(solved)
                    )
                )
        except BaseException:
            staged.abort([])
            raise
        return user_solves.commit(staged, written, out, d, solve.lambda_u)

    def split(self, interactions: str, rule: splits.SplitRule, out: str) -> tuple[dict, int]:
        """`splits.make_split`'s tables of `rule`, written into `out`; returns (sizes, eligible users)."""
        staged = {name: storage.StagedWrite(storage.join(out, f"{name}.parquet")) for name in rule.parts}
        with splits.discarded_on_failure(staged):
            return self._split(interactions, rule, staged)

    def _split(self, interactions: str, rule: splits.SplitRule, staged: dict) -> tuple[dict, int]:
        train_items = None
        if rule.needs_train_items:  # a first pass: the items of every training user's positives
            found = self._collect(
                lambda p: (
                    self._shards(p, interactions, INTERACTION_COLUMNS)
                    | "TrainItems" >> beam.FlatMapTuple(lambda _, batches: splits.train_items_of(batches, rule))
                    | "Ids" >> beam.FlatMap(lambda batch: batch.column("item_id").to_pylist())
                    | "Distinct" >> beam.Distinct()
                )
            )
            train_items = np.sort(np.array(found, dtype=np.int64))

        def write(shard: int, batches: list[pa.RecordBatch]) -> Iterator[dict]:
            for written in splits.split_partition(batches, rule, staged, shard, train_items):
                yield from written.to_pylist()

        records = self._collect(
            lambda p: self._shards(p, interactions, INTERACTION_COLUMNS) | "Split" >> beam.FlatMapTuple(write)
        )
        return splits.commit_split(
            rule, staged, pa.Table.from_pylist(records, schema=splits.SPLIT_WRITTEN), interactions
        )

    def check_count_rows(self, interactions: str, catalog: np.ndarray) -> None:
        """`counts.read_rows`'s refusals, with its messages (`counts.row_problem` on every batch)."""
        found = self._collect(
            lambda p: (
                p
                | "Read" >> ReadTable(interactions)
                | "Check" >> beam.FlatMap(lambda batch: [problem] if (problem := row_problem(batch, catalog)) else [])
            )
        )
        if found:
            raise UserError(f"{interactions}: {sorted(found)[0]}")

    def count_aggregates(
        self, interactions: str, catalog: np.ndarray, unit: str, max_items_per_user: int, key: int
    ) -> tuple[np.ndarray, int]:
        """`counts.exact_aggregates`, per shard of users, summed: the same numbers."""

        def aggregate(_, batches):
            return exact_aggregates(*_columns(batches, "user_id", "item_id"), catalog, unit, max_items_per_user, key)

        found = self._collect(
            lambda p: (
                self._shards(p, interactions, ["user_id", "item_id"])
                | "Aggregate" >> beam.MapTuple(aggregate)
                | "Sum" >> beam.CombineGlobally(_sum_aggregates)
                | "Json" >> beam.Map(lambda total: [np.asarray(total[0]).tolist(), int(total[1])] if total else None)
            )
        )
        if not found or found[0] is None:
            return np.zeros(catalog.size), 0
        exact, units = found[0]
        return np.asarray(exact, dtype=np.float64), int(units)

    def train_sums(self, interactions: str, request: train_sums.TrainSumsRequest) -> train_sums.TrainSums:
        """The prepare stage's sums (pipelines.releases.train_sums), a pipeline per operation."""
        return train_sums.one_by_one(self, interactions, request)

    def item_gram_sums(self, interactions: str, items: np.ndarray) -> np.ndarray:
        """`item_gram.item_gram_sums` per shard of users, summed (equal to float64 rounding)."""
        from pipelines.releases.item_gram import item_gram_sums

        def sums(_, batches):
            return (item_gram_sums(*_columns(batches, "user_id", "item_id"), items),)

        found = self._collect(
            lambda p: (
                self._shards(p, interactions, ["user_id", "item_id"])
                | "Sums" >> beam.MapTuple(sums)
                | "Total" >> beam.CombineGlobally(_sum_aggregates)
                | "Json" >> beam.Map(lambda total: np.asarray(total[0]).tolist() if total else None)
            )
        )
        return (
            np.asarray(found[0], dtype=np.float64)
            if found and found[0] is not None
            else np.zeros(packed_size(items.size))
        )

    def mean_sums(
        self, interactions: str, rating_range: tuple[float, float], unit: str, user_cap: float
    ) -> tuple[float, float]:
        """`mean.weighted_sums`: per shard of users, summed (equal to float64 rounding)."""

        def sums(_, batches):
            return weighted_sums_of(*_columns(batches, "user_id", "label"), rating_range, unit, user_cap)

        found = self._collect(
            lambda p: (
                self._shards(p, interactions, ["user_id", "label"])
                | "Sums" >> beam.MapTuple(sums)
                | "Total" >> beam.CombineGlobally(_sum_aggregates)
                | "Json" >> beam.Map(lambda total: [float(v) for v in total])
            )
        )
        return (float(found[0][0]), float(found[0][1])) if found and found[0] else (0.0, 0.0)

    def write_centred(
        self,
        train: str,
        outputs: list[CentredOutput],
        mean: float,
        protocol: str,
        confidence_alpha: float | None = None,
    ) -> None:
        """`mean.centred` over every row of `train`, in one pass, written to each output (a path and
        the items it keeps), one part per input file."""
        staged = [(storage.StagedWrite(output.path), output) for output in outputs]

        def write(index: int, file: str) -> Iterator[list]:
            written = write_centred_parts(
                storage.iter_batches(file, columns=INTERACTION_COLUMNS),
                staged,
                index,
                mean=mean,
                protocol=protocol,
                confidence_alpha=confidence_alpha,
                users_together=together,
            )
            yield from ([k, *part] for k, part in enumerate(written) if part is not None)

        files = list(enumerate(storage.table_files(train)))
        together = users_together(
            train
        )  # each file whole users in order (the split's parts): so is each part written from one
        written = self._collect(
            lambda p: (
                p | "Files" >> beam.Create(files) | "Spread" >> beam.Reshuffle() | "Centre" >> beam.FlatMapTuple(write)
            )
        )
        for k, (table, _) in enumerate(staged):
            mine = [(name, count) for output, name, count in written if output == k]
            table.commit(
                [name for name, _ in mine] or [table.write_part(0, INTERACTIONS.empty_table())],
                sum(count for _, count in mine),
            )  # no task wrote part 0
