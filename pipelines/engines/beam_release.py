"""The stats job on Apache Beam (`python -m pipelines.beam_stats`, any runner, DirectRunner default): its pipeline.

The same transform as the Spark engine (`pipelines/stats.py`), as a composite `ItemStats` PTransform:

    interactions --(per batch: rows grouped by user)--> (user, rows) --+
                                                                       +- CoGroupByKey by user
    user embeddings --(per row)--> (user, embedding) -----------------+
        -> per complete user: weights (DP counts as a side input), clip, weight
           (stats_core.user_contributions), pre-aggregated per item within a bundle
           (privacy.accumulator.grouped_sums): (item, (a_upper, b))
        + one declaration (item, None) for EVERY catalog item
        -> CombinePerKey(ItemSums): accumulator.create / sums of partials / merge
        -> noised once per item and resample (accumulator.finalize, keyed by the release index)

`WriteStatsParts` writes one part per shard and resample through the job's `StagedWrite`s, with a
small JSON manifest; `run` reads the manifests once the pipeline has finished and lets
`StatsJob.commit` publish the tables (no driver-side collect). The large inputs are read part file by part file through
`schemas.storage` (local paths
and gs://); the small ones (catalog, DP counts) are read on the driver. The workers must be able to
import this project (on a cluster: the wheel, see infra/) and reach the input and output paths.

Privacy: the same as pipelines.releases.stats_job and the Spark job: the statistics are summed
before any noise, which is added after the merge to every catalog item, keyed by (secret seed,
release index, item id), so both engines add identical noise. The release is recorded in the ledger
by `StatsJob.prepare()` before the pipeline starts; nothing is published unless every catalog item
was written. The serialized pipeline carries the secret seed to the workers: the runner must be
inside the trusted zone, as the private inputs already require. Partial sums arrive in
runner-dependent order, so reruns agree with Spark to float64 rounding; the noise is identical.
"""

from __future__ import annotations

import uuid
from collections.abc import Iterable, Sequence

import apache_beam as beam
import numpy as np
import pyarrow as pa
from apache_beam.options.pipeline_options import PipelineOptions, StandardOptions
from apache_beam.transforms.window import GlobalWindows

from pipelines.base import logs
from pipelines.releases import stats_job
from pipelines.releases.stats_core import (
    STATS_PARQUET,
    StatsSettings,
    release_metadata,
    stats_table,
    user_contributions,
)
from privacy import accumulator
from schemas import storage
from schemas.arrays import list_column_to_matrix
from schemas.errors import UserError
from schemas.ids import IdIndex

INPUTS = ("interactions", "user_embeddings", "counts", "items")
KERNEL_ROWS = 262_144  # complete users' rows gathered before one grouped-sums call (as in Spark)
RUNNING_FLOATS = 32 * 1024 * 1024  # a bundle's running partial sums emitted early past this size (256 MiB)
DRIVER_CHUNK = 65_536  # catalog / counts rows per created element
MANIFESTS = ".beam-parts-"  # staging folder of the shards' manifests, under --out, removed after the commit


# ---------------------------------------------------------------------------------------------
# Reading tables


class ReadTable(beam.PTransform):
    """A committed table (`schemas.storage` layout) as a PCollection of Arrow record batches.

    The part files are listed on the driver, then each is streamed by a worker through
    `schemas.storage.iter_batches` (a bounded batch size).
    """

    def __init__(self, path: str, columns: list[str] | None = None):
        super().__init__()
        self.path, self.columns = path, columns

    def expand(self, pbegin):
        columns = self.columns
        return (
            pbegin
            | "Files" >> beam.Create(storage.table_files(self.path))
            | "Spread" >> beam.Reshuffle()
            | "Batches" >> beam.FlatMap(lambda part: storage.iter_batches(part, columns=columns))
        )


def table_chunks(table: pa.Table, rows: int = DRIVER_CHUNK) -> list[pa.Table]:
    """A small table read on the driver, cut into elements for `beam.Create`."""
    return [table.slice(start, rows) for start in range(0, table.num_rows, rows)] or [table]


# ---------------------------------------------------------------------------------------------
# The composite transform and its steps


def rows_by_user(batch: pa.RecordBatch | pa.Table) -> Iterable[tuple[int, tuple[np.ndarray, np.ndarray]]]:
    """A batch of interactions -> one (user, (item ids, labels)) per user present in it."""
    users = np.asarray(batch.column("user_id").to_numpy(), np.int64)
    if users.size == 0:
        return
    order = np.argsort(users, kind="stable")
    users = users[order]
    items = np.asarray(batch.column("item_id").to_numpy(), np.int64)[order]
    labels = np.asarray(batch.column("label").to_numpy(), np.float64)[order]
    starts = np.flatnonzero(np.r_[True, users[1:] != users[:-1]])
    ends = np.r_[starts[1:], users.size]
    for user, start, end in zip(users[starts].tolist(), starts.tolist(), ends.tolist(), strict=True):
        yield user, (items[start:end].copy(), labels[start:end].copy())


def embeddings_by_user(batch: pa.RecordBatch | pa.Table, dim: int) -> Iterable[tuple[int, np.ndarray]]:
    """A batch of user embeddings -> (user, embedding of length dim) per row."""
    users = np.asarray(batch.column("user_id").to_numpy(), np.int64)
    matrix = list_column_to_matrix(batch.column("embedding"), dim, "user embedding")
    for user, row in zip(users.tolist(), matrix, strict=True):
        yield user, row.copy()


def counts_lookup(tables: list[pa.Table | pa.RecordBatch]) -> tuple[IdIndex, np.ndarray]:
    """DP count tables -> (index of the sorted item ids, their counts), the side input of the weights."""
    ids = [np.asarray(t.column("item_id").to_numpy(), np.int64) for t in tables]
    counts = [np.asarray(t.column("count").to_numpy(), np.float64) for t in tables]
    ids = np.concatenate(ids) if ids else np.zeros(0, np.int64)
    counts = np.concatenate(counts) if counts else np.zeros(0)
    order = np.argsort(ids, kind="stable")
    ids, counts = ids[order], counts[order]
    if ids.size > 1 and np.any(ids[1:] == ids[:-1]):
        raise UserError(f"DP counts: item {ids[1:][ids[1:] == ids[:-1]][0]} has more than one count")
    return IdIndex(ids), counts


def catalog_declarations(batch: pa.RecordBatch | pa.Table) -> Iterable[tuple[int, None]]:
    """A batch of catalog item ids -> (item, None): every item gets a row, with data or not."""
    for item in np.asarray(batch.column("item_id").to_numpy(), np.int64).tolist():
        yield item, None


class UserPartials(beam.DoFn):
    """Complete users -> per-item partial sums, pre-aggregated over the users of a bundle.

    Each element is one user with all their rows (from CoGroupByKey), so the user-level weights
    see complete users. Users are buffered and turned into contributions KERNEL_ROWS rows at a
    time (one grouped-sums call each); the bundle's running sums are emitted per item in
    `finish_bundle` (or earlier when they grow past RUNNING_FLOATS).
    """

    def __init__(self, settings: StatsSettings):
        self.settings = settings

    def start_bundle(self):
        self._buffer: list[tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]] = []
        self._rows = 0
        self._running = None
        self._counts = None

    def process(self, element, counts):
        user, grouped = element
        chunks = list(grouped["rows"])  # none: a user with an embedding but no rows contributes nothing
        if chunks:
            self._add_user(user, chunks, list(grouped["embedding"]), counts)
        if self._rows >= KERNEL_ROWS:
            self._flush()
            running_floats = self._running[0].size * (accumulator.packed_size(self.settings.dim) + self.settings.dim)
            if running_floats >= RUNNING_FLOATS:
                yield from self._emit()

    def _add_user(self, user: int, chunks: list, embeddings: list, counts) -> None:
        if len(embeddings) != 1:
            raise UserError(f"user {user} has {len(embeddings)} embeddings, expected exactly one")
        self._counts = counts
        items = np.concatenate([chunk[0] for chunk in chunks])
        labels = np.concatenate([chunk[1] for chunk in chunks])
        self._buffer.append(
            (
                np.full(items.size, user, np.int64),
                items,
                labels,
                np.broadcast_to(embeddings[0], (items.size, self.settings.user_dim)),
            )
        )
        self._rows += items.size

    def finish_bundle(self):
        self._flush()
        for partial in self._emit():
            yield GlobalWindows.windowed_value(partial)

    def _flush(self) -> None:
        if not self._buffer:
            return
        users, items, labels, embeddings = (np.concatenate(part) for part in zip(*self._buffer, strict=True))
        self._buffer, self._rows = [], 0
        index, values = self._counts
        where, known = index.lookup(items)
        if not known.all():
            raise UserError(f"no DP count for item {items[~known][0]} (counts must cover the catalog)")
        keys, a, b = accumulator.grouped_sums(
            *user_contributions(users, items, labels, embeddings, values[where], settings=self.settings)
        )
        if self._running is not None:
            previous = self._running
            keys, a, b = accumulator.reduce_by_key(
                np.r_[previous[0], keys], np.vstack([previous[1], a]), np.vstack([previous[2], b])
            )
        self._running = (keys, a, b)

    def _emit(self):
        if self._running is None:
            return
        keys, a, b = self._running
        self._running = None
        for k, item in enumerate(keys.tolist()):
            yield item, (a[k], b[k])


class ItemSums(beam.CombineFn):
    """Per item: the sum of its partials (a_upper, b); `None` inputs only declare the item."""

    def __init__(self, dim: int):
        self.dim = dim

    def create_accumulator(self):
        return accumulator.create(self.dim)

    def add_input(self, acc, partial):
        if partial is None:
            return acc
        a, b = acc
        a += partial[0]  # the accumulator is ours to mutate; the input is not
        b += partial[1]
        return acc

    def merge_accumulators(self, accumulators):
        return accumulator.merge(accumulators)

    def extract_output(self, acc):
        return acc


def noise_item(element, specs: Sequence[accumulator.NoiseSpec]):
    """(item, (a_upper, b)) -> (item, ((noised a_upper, noised b) for each resample))."""
    item, (a, b) = element
    ids = np.array([item], np.int64)
    noised = []
    for spec in specs:
        noised_a, noised_b = accumulator.finalize(ids, a[None, :], b[None, :], spec)
        noised.append((noised_a[0], noised_b[0]))
    return item, tuple(noised)


class ItemStats(beam.PTransform):
    """The stats transform: noised A_j, b_j of every catalog item, for each resample's NoiseSpec.

    Input: a dict with keys INPUTS (or a tuple in that order) of PCollections of Arrow tables or
    record batches, in the global window: interactions (user_id, item_id, label), user embeddings
    (user_id, embedding of length settings.dim), DP counts (item_id, count; a side input, so they
    must fit a worker's memory: m rows) and the catalog (item_id). The inputs must satisfy what
    `StatsJob.prepare()` checks (each (user, item) pair once, every user with an embedding, every
    item in the catalog and counted).

    Output: a PCollection with one element per catalog item, exactly once:
    `(item_id, ((a_upper, b) for resample 0, (a_upper, b) for resample 1, ...))`, float64 arrays
    of d(d+1)/2 and d entries, noised with `specs[k]` for resample k.
    """

    def __init__(self, settings: StatsSettings, specs: Sequence[accumulator.NoiseSpec]):
        super().__init__()
        if not specs:
            raise UserError("ItemStats needs at least one NoiseSpec (one per resample)")
        self.settings, self.specs = settings, list(specs)

    def expand(self, inputs):
        if not isinstance(inputs, dict):
            inputs = dict(zip(INPUTS, inputs, strict=False))
        missing = [name for name in INPUTS if name not in inputs]
        if missing:
            raise UserError(f"ItemStats needs the inputs {INPUTS}; missing {missing}")
        settings, specs = self.settings, self.specs
        rows = inputs["interactions"] | "RowsByUser" >> beam.FlatMap(rows_by_user)
        embeddings = inputs["user_embeddings"] | "EmbeddingsByUser" >> beam.FlatMap(
            embeddings_by_user, settings.user_dim
        )
        counts = (
            inputs["counts"] | "GatherCounts" >> beam.combiners.ToList() | "CountsLookup" >> beam.Map(counts_lookup)
        )
        users = {"rows": rows, "embedding": embeddings} | "JoinByUser" >> beam.CoGroupByKey()
        partials = users | "UserPartials" >> beam.ParDo(UserPartials(settings), counts=beam.pvalue.AsSingleton(counts))
        declared = inputs["items"] | "DeclareCatalog" >> beam.FlatMap(catalog_declarations)
        sums = (
            (partials, declared)
            | "WithCatalog" >> beam.Flatten()
            | "SumPerItem" >> beam.CombinePerKey(ItemSums(settings.dim))
        )
        return sums | "Noise" >> beam.Map(noise_item, specs)


class WriteShard(beam.DoFn):
    """One shard of noised items -> one part per resample, and the shard's manifest."""

    def __init__(self, settings: StatsSettings, specs, staged: Sequence[storage.StagedWrite], manifests: str | None):
        self.settings, self.specs, self.staged, self.manifests = settings, list(specs), list(staged), manifests

    def process(self, element):
        shard, rows = element
        rows = sorted(rows, key=lambda row: row[0])
        items = np.array([row[0] for row in rows], np.int64)  # a group is never empty
        written = []
        for resample, (spec, target) in enumerate(zip(self.specs, self.staged, strict=True)):
            a = np.stack([row[1][resample][0] for row in rows])
            b = np.stack([row[1][resample][1] for row in rows])
            name = target.write_part(
                shard, stats_table(items, a, b, release_metadata(self.settings, spec, resample)), **STATS_PARQUET
            )
            written.append({"resample": resample, "name": name, "rows": int(items.size)})
        if self.manifests is not None:
            storage.write_json({"shard": int(shard), "parts": written}, manifest_path(self.manifests, shard))
        yield from written


class WriteStatsParts(beam.PTransform):
    """Noised rows of ItemStats -> part files (shard = item_id % shards), one per shard and resample.

    Output: one {"resample", "name", "rows"} dict per written part; with `manifests` set, each
    shard also writes them as `shard-NNNNN.json` there (what `run` reads back on the driver).
    """

    def __init__(
        self,
        settings: StatsSettings,
        specs,
        staged: Sequence[storage.StagedWrite],
        shards: int,
        manifests: str | None = None,
    ):
        super().__init__()
        if len(staged) != len(specs):
            raise UserError(f"{len(specs)} resample(s) but {len(staged)} staged table(s)")
        self.settings, self.specs, self.staged, self.shards, self.manifests = (
            settings,
            list(specs),
            list(staged),
            shards,
            manifests,
        )

    def expand(self, noised):
        shards = self.shards
        return (
            noised
            | "KeyByShard" >> beam.Map(lambda row: (row[0] % shards, row))
            | "GroupByShard" >> beam.GroupByKey()
            | "WriteParts" >> beam.ParDo(WriteShard(self.settings, self.specs, self.staged, self.manifests))
        )


def manifest_path(manifests: str, shard: int) -> str:
    return storage.join(manifests, f"shard-{shard:05d}.json")


# ---------------------------------------------------------------------------------------------
# Driver


def read_manifests(manifests: str, shards: int, resamples: int) -> tuple[list[list[str]], list[int]]:
    """The part names and row counts per resample written by the shards (empty shards write none)."""
    names: list[list[str]] = [[] for _ in range(resamples)]
    rows = [0] * resamples
    for shard in range(shards):
        path = manifest_path(manifests, shard)
        if not storage.exists(path):
            continue
        for part in storage.read_json(path)["parts"]:
            names[part["resample"]].append(part["name"])
            rows[part["resample"]] += int(part["rows"])
    return names, rows


def build(pipeline: beam.Pipeline, job: stats_job.StatsJob, manifests: str | None = None):
    """Add the stats job (reads, ItemStats, WriteStatsParts) to `pipeline`; `job.prepare()` must have run."""
    if not job.releases or job.catalog is None:
        raise UserError("StatsJob.prepare() must run before the pipeline is built")
    settings = job.settings
    counts = storage.read_table(job.counts, columns=["item_id", "count"])
    inputs = {
        "interactions": pipeline | "ReadInteractions" >> ReadTable(job.interactions, ["user_id", "item_id", "label"]),
        "user_embeddings": pipeline | "ReadUserEmbeddings" >> ReadTable(job.user_embeddings, ["user_id", "embedding"]),
        "counts": pipeline | "CreateCounts" >> beam.Create(table_chunks(counts)),
        "items": pipeline
        | "CreateCatalog" >> beam.Create(table_chunks(pa.table({"item_id": pa.array(job.catalog, pa.int64())}))),
    }
    noised = inputs | "ItemStats" >> ItemStats(settings, job.releases)
    return noised | "WriteStats" >> WriteStatsParts(settings, job.releases, job.staged_writes(), job.shards, manifests)


LOCAL_RUNNER = "FnApiRunner"  # what Beam's DirectRunner runs our pipelines on, named so that it downloads nothing


def pinned(options: PipelineOptions | None) -> PipelineOptions:
    """`options` (none: the DirectRunner) with the DirectRunner named as its in-process engine: Beam's
    DirectRunner first tries to download and start the Prism runner (a binary from GitHub), a
    download at run time and, where it succeeds, another engine than the one tested."""
    options = options or PipelineOptions([])
    standard = options.view_as(StandardOptions)
    named = str(standard.runner or "direct").rsplit(".", 1)[-1].lower().removesuffix("runner")
    if named in ("direct", "switchingdirect"):
        standard.runner = LOCAL_RUNNER
    return options


def run(job: stats_job.StatsJob, pipeline_options: PipelineOptions | None = None) -> dict:
    """Prepare the releases, compute and write them with Beam, commit; returns the step summary."""
    if job.settings.loss != "square":
        raise UserError(f"--loss {job.settings.loss} releases its statistics on the Spark engine only, not on Beam")
    job.prepare()
    manifests = storage.join(job.out, f"{MANIFESTS}{uuid.uuid4().hex}")
    try:
        try:
            with beam.Pipeline(options=pinned(pipeline_options)) as pipeline:
                build(pipeline, job, manifests)
        except BaseException:
            _discard_parts(job, manifests)
            raise
        names, rows = read_manifests(manifests, job.shards, len(job.releases))
        return job.commit(names, rows)  # aborts what it does not publish
    finally:
        storage.remove(manifests)


def _discard_parts(job: stats_job.StatsJob, manifests: str) -> None:
    """Best effort after a failed pipeline: drop the parts the finished shards reported."""
    try:
        names, _ = read_manifests(manifests, job.shards, len(job.releases))
        for staged, written in zip(job.staged_writes(), names, strict=True):
            staged.abort(written)
    except Exception as exc:  # the pipeline's own error is the one to report
        logs.warn(f"stats: could not clean up the staged parts ({exc})")
