"""The stats job on Spark (`spark-submit pipelines/stats.py`, `ssp stats`): its kernel.

One pass over the interactions, with rows partitioned by ITEM so that no partial sums are shuffled.
Map side: each task reads row groups of the interactions (schemas.storage, so local paths and
gs:// alike) and packs their narrow rows (user, item, label) into one binary block per item shard
(stats_core.shard_of, a fixed hash); the task reading the first row group also declares every
shard with an empty block, so a shard without rows still gets its task. Spark shuffles the blocks
(a few records per task and shard: the JVM never touches a row) to the reduce tasks: one per
shard, or fewer when the shards outnumber the cores (`partition_keys`: a task then takes several).
Reduce side: each task holds complete items: it looks up its rows' DP counts and, at user level,
their users' weight normalisers (from `StatsJob.prepare()`) in a broadcast, sums the clipped,
weighted rows per item (grouped GEMM, no per-row Python), adds the noise once to every item of the
shard (rows or not) and writes its part of each resample's stats table, a row group at a time; the
driver commits them. Shuffle volume is O(rows) x 24 bytes. An executor's Python workers map one
copy of the release's clipped user vectors (users x d), written once into its local folder.

Rows already a row group per item shard (prepare's, stats_core.ITEM_SHARDS, checked row by row
by `StatsJob.prepare()`) skip the map side and the shuffle: each reduce task reads its shards' row
groups (`run`) and sums them alike, to the same bits.

Privacy: as pipelines.releases.stats_job / privacy.accumulator: the noise is added once the sums
are complete, to every catalog item, keyed by the ledger's release index.
"""

from __future__ import annotations

import fcntl
import glob
import hashlib
import json
import os
import shutil
import tempfile
import time
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import pyarrow as pa

from pipelines.engines.spark import forward_storage_settings
from pipelines.releases import stats_job
from pipelines.releases.stats_core import (
    STATS_PARQUET,
    RowLookups,
    by_shard,
    clipped_users,
    item_sums,
    item_user_order,
    release_metadata,
    shard_of,
    shards_for,
    stats_table,
)
from privacy import accumulator, quadratic
from schemas import storage
from schemas.arrays import fill_by_file, list_column_to_matrix, vectors_of_batches
from schemas.ids import IdIndex
from schemas.tables import STATS

WRITTEN_DDL = "resample int, name string, rows long, seconds double"
BLOCK_SCHEMA = pa.schema(
    [("key", pa.int32()), ("shard", pa.int32()), ("block", pa.binary())]
)  # rows of one item shard, shuffled as one record
BLOCK_SCHEMA_DDL = "key int, shard int, block binary"
CHUNK_ROWS = 32_768  # rows summed at a time within a task (whole items; a bigger item is one group)
ITEMS_PER_ROW_GROUP = 1024  # items noised and written at a time, at most (about 17 MiB of statistics at d=64)
READ_BATCH_ROWS = 262_144  # rows per Arrow batch read, and so per round of blocks
READ_TASKS_PER_CORE = 1  # row groups are read by at most this many tasks per core
CLIPPED_PREFIX = "ssp-clipped-"  # an executor's shared copy of a release's clipped user vectors, and its lock


# per Python worker (Spark reuses them across tasks): the embeddings tables read last, by content digest
_last_vectors: dict = {}
_last_clipped: dict = {}  # the user vectors clipped last, by digest and settings


def embedding_vectors(path: str, digest: str, d: int, id_column: str = "user_id") -> tuple[IdIndex, np.ndarray]:
    """(index of the ids, their embeddings) of an embeddings table (users', or items' with
    `id_column` "item_id") whose content digest (from prepare()) is `digest`; a worker's next task of
    the same release reuses them (the last two tables read are kept: a logistic release reads both)."""
    if digest not in _last_vectors:
        if len(_last_vectors) >= 2:
            _last_vectors.clear()
        _last_vectors[digest] = read_vectors(path, d, id_column)
    return _last_vectors[digest]


def read_vectors(path: str, d: int, id_column: str = "user_id") -> tuple[IdIndex, np.ndarray]:
    """(index of the ids, their embeddings) of an embeddings table, in file order, streamed."""
    rows = storage.row_count(path)
    batches = storage.read_ahead(storage.iter_batches(path, [id_column, "embedding"], READ_BATCH_ROWS))
    ids, vectors = vectors_of_batches(batches, rows, id_column, d, id_column.replace("_id", " embedding"))
    return IdIndex(ids), vectors


def clipped_vectors(embeddings: tuple[str, str], settings) -> tuple[IdIndex, tuple[np.ndarray, np.ndarray | None]]:
    """(index of the users, stats_core.clipped_users of their embeddings) of the user embeddings
    (path, content digest); a worker's next task of the same release reuses them (the last one is
    kept, without the unclipped vectors: at 10^7 users each copy is 1.4 GiB). The Python workers
    of one Spark executor share one copy (`shared_clipped`)."""
    path, digest = embeddings
    key = (digest, settings)
    if key not in _last_clipped:
        _last_clipped.clear()
        folder = executor_folder()
        _last_clipped[key] = (
            read_clipped(path, settings) if folder is None else shared_clipped(path, digest, settings, folder)
        )
    return _last_clipped[key]


def executor_folder() -> str | None:
    """The first local folder of this Spark Python worker's executor (SPARK_LOCAL_DIRS, which Spark
    gives its workers for their spills: its shuffle files' folder, removed when the executor
    stops), or None outside a Spark worker."""
    folders = os.environ.get("SPARK_LOCAL_DIRS")
    return folders.split(",")[0] if folders else None


def shared_clipped(
    path: str, digest: str, settings, folder: str
) -> tuple[IdIndex, tuple[np.ndarray, np.ndarray | None]]:
    """`read_clipped`, made once per executor: under a lock in `folder`, the first of its workers to
    need them writes them there (a folder renamed into place when complete, after removing the
    copies of earlier releases), and every worker maps the same files, so that an executor's k
    workers read the table and hold its clipped vectors once, not k times. The maps are copy on
    write (nothing writes them) and stay valid after a later release removes their files.

    Privacy: the clipped vectors are private, like the shuffle files Spark keeps in the same
    folder: mode 0700, removed with it."""
    name = CLIPPED_PREFIX + hashlib.sha256(json.dumps([digest, settings.to_json()]).encode()).hexdigest()[:32]
    copy = os.path.join(folder, name)
    names = ["ids", "vectors", "offsets"] if settings.bias else ["ids", "vectors"]
    lock = os.open(os.path.join(folder, CLIPPED_PREFIX + "lock"), os.O_RDWR | os.O_CREAT, 0o600)
    try:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if not os.path.isdir(copy):
            for earlier in glob.glob(os.path.join(folder, CLIPPED_PREFIX + "*/")):  # other releases, or a torn write
                shutil.rmtree(earlier, ignore_errors=True)
            building = tempfile.mkdtemp(prefix=CLIPPED_PREFIX, dir=folder)
            rows, width = storage.row_count(path), settings.user_dim - (1 if settings.bias else 0)
            types = {
                "ids": (np.int64, (rows,)),
                "vectors": (np.float64, (rows, width)),
                "offsets": (np.float64, (rows,)),
            }
            arrays = {
                key: np.lib.format.open_memmap(os.path.join(building, f"{key}.npy"), "w+", *types[key]) for key in names
            }
            read_clipped(path, settings, out=(arrays["ids"], arrays["vectors"], arrays.get("offsets")))
            for array in arrays.values():
                array.flush()
            os.rename(building, copy)
        mapped = {key: np.asarray(np.load(os.path.join(copy, f"{key}.npy"), mmap_mode="c")) for key in names}
    finally:
        os.close(lock)  # and so the lock
    return IdIndex(mapped["ids"]), (mapped["vectors"], mapped.get("offsets"))


def read_clipped(
    path: str, settings, out: tuple[np.ndarray, np.ndarray, np.ndarray | None] | None = None
) -> tuple[IdIndex, tuple[np.ndarray, np.ndarray | None]]:
    """`clipped_vectors` read from the table (`fill_by_file`: a file per core), each batch clipped
    as it is read, so that no unclipped copy of the table is made; into `out` (ids, vectors, offsets
    or None) when given."""
    rows, width = storage.row_count(path), settings.user_dim - (1 if settings.bias else 0)
    ids, vectors, offsets = out or (
        np.empty(rows, np.int64),
        np.empty((rows, width)),
        np.empty(rows) if settings.bias else None,
    )

    def fill(part: slice, batch: pa.RecordBatch) -> None:
        ids[part] = batch.column("user_id").to_numpy()
        clipped_users(
            list_column_to_matrix(batch.column("embedding"), settings.user_dim, "user embedding"),
            settings,
            out=(vectors[part], None if offsets is None else offsets[part]),
        )

    fill_by_file(path, fill, "user embedding", ["user_id", "embedding"], READ_BATCH_ROWS)
    return IdIndex(ids), (vectors, offsets)


def read_and_pack(
    units: list[tuple[str, int, int]], picked: Iterator[pa.RecordBatch], shards: int, keys: np.ndarray
) -> Iterator[pa.RecordBatch]:
    """Map side: the row groups `units[i]` for the ids i in `picked` -> their rows, as blocks per
    item shard. The task given id 0 also declares every shard (an empty block each), so that a
    shard with no rows reaches its task too."""
    for batch in picked:
        for unit in batch.column("id").to_pylist():
            if unit == 0:
                yield pa.RecordBatch.from_arrays(
                    [
                        pa.array(keys, pa.int32()),
                        pa.array(np.arange(shards), pa.int32()),
                        pa.array([b""] * shards, pa.binary()),
                    ],
                    schema=BLOCK_SCHEMA,
                )
            if unit < len(units):
                file, group, _ = units[unit]
                yield from pack_rows(
                    storage.iter_row_group(file, group, ["user_id", "item_id", "label"], READ_BATCH_ROWS), shards, keys
                )


def pack_rows(batches: Iterator[pa.RecordBatch], shards: int, keys: np.ndarray) -> Iterator[pa.RecordBatch]:
    """Each Arrow batch of (user_id, item_id, label) rows (checked by prepare(): no nulls) -> one
    binary block of rows per item shard it touches (stats_core.shard_of), keyed for the shuffle by `keys[shard]`."""
    for batch in batches:
        if not batch.num_rows:
            continue
        users, rated, labels = (batch.column(name).to_numpy() for name in ("user_id", "item_id", "label"))
        order, cuts = by_shard(rated, shards)
        present = np.flatnonzero(np.diff(cuts))
        blocks = [
            encode_rows(users[rows], rated[rows], labels[rows])
            for rows in (order[cuts[k] : cuts[k + 1]] for k in present)
        ]
        yield pa.RecordBatch.from_arrays(
            [pa.array(keys[present], pa.int32()), pa.array(present, pa.int32()), pa.array(blocks, pa.binary())],
            schema=BLOCK_SCHEMA,
        )


def item_shards(
    batches: Iterator[pa.RecordBatch], reduce_shard: Callable[[int, tuple], Iterator[pa.RecordBatch]]
) -> Iterator[pa.RecordBatch]:
    """Reduce side: the blocks of one or more item shards (each with its declaration, so that a
    shard with no rows arrives too) -> `reduce_shard(shard, rows)` of each (`item_shard`)."""
    received: dict[int, list[bytes]] = {}
    for batch in batches:
        for shard, block in zip(batch.column("shard").to_pylist(), batch.column("block").to_pylist(), strict=True):
            received.setdefault(shard, []).append(block)
    for shard in sorted(received):
        yield from reduce_shard(shard, decode_rows(received[shard]))


def item_shard(
    settings,
    specs,
    staged,
    *,
    embeddings: tuple[str, str],
    lookups: RowLookups,
    shards: int,
    shard: int,
    rows: tuple[np.ndarray, np.ndarray, np.ndarray],
    expansion: tuple[str, str] | None = None,
) -> Iterator[pa.RecordBatch]:
    """One shard of complete items: every catalog item with shard_of == shard, and all their rows
    (users, items, labels) -> noised statistics, written as part `shard` of each table.

    Items go in groups of at most ITEMS_PER_ROW_GROUP items and CHUNK_ROWS rows (a Parquet row
    group each): their rows' sums (one grouped_sums), then each resample's noise and write, so a
    task's memory stays small whatever the shard's size. Rows are summed in (item, user) order, so
    reruns are bit-identical whatever order the shuffle delivered them in. The logistic loss
    (`expansion`: the item embeddings to expand around) sums its positives' H_j, g_j from the rows
    and every user's negative terms densely (`_logistic_sums`).
    """
    catalog = lookups.catalog.ids
    items = catalog[shard_of(catalog, shards) == shard]  # sorted: every item of the shard, rows or not
    if not items.size:
        return
    users, rated, labels = rows
    if rated.size and not np.all(shard_of(rated, shards) == shard):
        raise RuntimeError(f"item shard {shard} received rows of other shards")
    order = item_user_order(users, rated)
    users, rated, labels = users[order], rated[order], labels[order]
    counts, normalisers = lookups.of(users, rated)
    owners = vectors = clipped = None
    if expansion:
        owners, vectors = embedding_vectors(*embeddings, settings.user_dim)
    elif rated.size:
        owners, clipped = clipped_vectors(embeddings, settings)
    negatives = _negatives(settings, lookups, owners, vectors, *expansion) if expansion else None
    tables = [release_metadata(settings, spec, resample) for resample, spec in enumerate(specs)]
    writers = [
        target.open_part(shard, STATS.with_metadata(metadata), **STATS_PARQUET)
        for target, metadata in zip(staged, tables, strict=True)
    ]
    kernel = 0.0  # seconds in the statistics kernel (weights, clipping, grouped sums)
    try:
        with ThreadPoolExecutor(
            max_workers=1
        ) as output:  # writes (they release the GIL and may wait on the disk) beside the next group's work
            pending: list = []
            for group, part in _groups(items, rated):
                if negatives is not None:
                    started = time.perf_counter()
                    keys, sums_a, sums_b = _logistic_sums(
                        settings,
                        lookups,
                        negatives,
                        group=group,
                        users=users[part],
                        rated=rated[part],
                        owners=owners,
                        vectors=vectors,
                    )
                    kernel += time.perf_counter() - started
                elif part.stop > part.start:
                    started = time.perf_counter()
                    keys, sums_a, sums_b = item_sums(
                        users[part],
                        rated[part],
                        labels[part],
                        users=clipped,
                        user_rows=owners.positions(users[part], "user embedding"),
                        counts=counts[part],
                        settings=settings,
                        normalisers=None if normalisers is None else normalisers[part],
                    )
                    kernel += time.perf_counter() - started
                else:  # no rows: noise only
                    keys, sums_a, sums_b = (
                        group[:0],
                        np.zeros((0, accumulator.packed_size(settings.dim))),
                        np.zeros((0, settings.dim)),
                    )
                at = np.searchsorted(group, keys)
                for writer, spec, metadata in zip(writers, specs, tables, strict=True):
                    pending.append(
                        output.submit(
                            writer.write_table,
                            stats_table(group, *accumulator.finalize(group, sums_a, sums_b, spec, at), metadata),
                        )
                    )
                while len(pending) > len(writers):  # at most one group waiting to be written
                    pending.pop(0).result()
            for write in pending:
                write.result()
    finally:
        for writer in writers:
            writer.close()
    for resample, target in enumerate(staged):
        yield pa.RecordBatch.from_pydict(
            {
                "resample": [resample],
                "name": [target.part_name(shard)],
                "rows": [int(items.size)],
                "seconds": [kernel if resample == 0 else 0.0],
            },
            schema=pa.schema(
                [("resample", pa.int32()), ("name", pa.string()), ("rows", pa.int64()), ("seconds", pa.float64())]
            ),
        )


def _negatives(settings, lookups: RowLookups, owners: IdIndex, vectors: np.ndarray, path: str, digest: str):
    """What every group of a logistic release needs: the expansion points (by item), and each user
    with rows (every one a negative of every item) with its embedding and weights."""
    w_p, w_n = quadratic.logistic_weights(
        lookups.normalisers, lookups.catalog.ids.size, settings.wbar
    )  # exponent 0: the normaliser is the count
    return (
        embedding_vectors(path, digest, settings.dim, "item_id"),
        vectors[owners.positions(lookups.users.ids, "user embedding")],
        w_p,
        w_n,
    )


def _logistic_sums(
    settings,
    lookups: RowLookups,
    negatives,
    *,
    group: np.ndarray,
    users: np.ndarray,
    rated: np.ndarray,
    owners: IdIndex,
    vectors: np.ndarray,
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(every item of the group, packed H_j, g_j) of the logistic loss: the rows as positives
    (label 1, weight w_p of their user) plus every user as a negative of every item (weight w_n)."""
    (expansion_index, points), all_u, w_p, w_n = negatives
    v0 = points[expansion_index.positions(group, "item with an expansion point")]
    h, g = quadratic.all_items_sums(all_u, w_n, v0, settings.clip_u)
    if rated.size:
        curvature_rows, slope_rows = quadratic.kernel_rows(
            vectors[owners.positions(users, "user embedding")],
            np.ones(rated.size),
            w_p[lookups.users.positions(users, "user")],
            points[expansion_index.positions(rated, "item with an expansion point")],
            settings.clip_u,
        )
        keys, h_rows, _ = accumulator.grouped_sums(rated, curvature_rows)
        _, _, g_rows = accumulator.grouped_sums(rated, slope_rows)
        at = np.searchsorted(group, keys)
        h[at] += h_rows
        g[at] += g_rows
    return group, h, g


def _groups(
    items: np.ndarray, rated: np.ndarray, max_items: int = ITEMS_PER_ROW_GROUP, max_rows: int = CHUNK_ROWS
) -> Iterator[tuple[np.ndarray, slice]]:
    """(items, their rows) of consecutive groups of the shard's sorted items, each at most
    `max_items` items and `max_rows` rows (or a single item with more rows); `rated` (the rows'
    items, sorted) holds only items of `items`."""
    ends = np.searchsorted(rated, items, side="right")  # rows up to and including each item
    first = 0
    while first < items.size:
        begin = int(ends[first - 1]) if first else 0
        last = min(first + max_items, int(np.searchsorted(ends, begin + max_rows, side="right")), items.size)
        last = max(last, first + 1)
        yield items[first:last], slice(begin, int(ends[last - 1]))
        first = last


def encode_rows(users: np.ndarray, items: np.ndarray, labels: np.ndarray) -> bytes:
    """Rows as one block: n user ids, n item ids (int64), n labels (float64)."""
    return np.concatenate(
        [
            users.astype(np.int64, copy=False),
            items.astype(np.int64, copy=False),
            labels.astype(np.float64, copy=False).view(np.int64),
        ]
    ).tobytes()


def decode_rows(blocks: list[bytes]) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Blocks of `encode_rows` -> (user ids, item ids, labels) of all their rows."""
    parts = [np.frombuffer(block, dtype=np.int64).reshape(3, -1) for block in blocks if block]
    if not parts:
        return np.zeros(0, np.int64), np.zeros(0, np.int64), np.zeros(0)
    users, items, labels = np.concatenate(parts, axis=1)
    return users, items, labels.view(np.float64)


def spark_int_hash(values: np.ndarray) -> np.ndarray:
    """Spark SQL's `hash` of int (32-bit) values: Murmur3 x86_32 of each value with seed 42, as a
    signed int (org.apache.spark.unsafe.hash.Murmur3_x86_32.hashInt), vectorised."""

    def rotl(x, r):
        return (x << np.uint32(r)) | (x >> np.uint32(32 - r))

    with np.errstate(over="ignore"):
        k = np.asarray(values, dtype=np.int32).view(np.uint32) * np.uint32(0xCC9E2D51)
        k = rotl(k, 15) * np.uint32(0x1B873593)
        h = rotl(np.uint32(42) ^ k, 13) * np.uint32(5) + np.uint32(0xE6546B64)
        h ^= np.uint32(4)  # the length in bytes
        h ^= h >> np.uint32(16)
        h *= np.uint32(0x85EBCA6B)
        h ^= h >> np.uint32(13)
        h *= np.uint32(0xC2B2AE35)
        h ^= h >> np.uint32(16)
    return h.view(np.int32)


def partition_keys(partitions: int) -> np.ndarray:
    """For each k < partitions, the smallest non-negative int key that Spark's hash partitioning
    (pmod of the SQL `hash`, as `repartition(n, column)` does) sends to partition k, computed here
    (`spark_int_hash`) rather than asked of Spark with a query. Were the mapping ever different, the
    job would stay correct (a task handles whatever shards it gets), only less balanced."""
    candidates = np.arange(64 * partitions, dtype=np.int32)
    shard = spark_int_hash(candidates).astype(np.int64) % partitions  # Python's % of a negative hash is Java's pmod
    keys = np.arange(partitions, dtype=np.int32)  # a partition no candidate reaches (never seen) keeps its own number
    first = np.unique(shard, return_index=True)
    keys[first[0]] = candidates[first[1]]
    return keys


def row_lookups(job: stats_job.StatsJob) -> RowLookups:
    """What every reduce task looks its rows up in: the catalog's DP counts and, at user level (or
    for the logistic loss), the users' weight normalisers that `job.prepare()` found."""
    settings = job.settings
    users, normalisers = (
        job.normalisers
        if (settings.unit == "user" or settings.loss == "logistic") and job.normalisers
        else (None, None)
    )
    return RowLookups(IdIndex(job.catalog), job.catalog_counts, None if users is None else IdIndex(users), normalisers)


def shard_count(job: stats_job.StatsJob) -> int:
    """The release's item shards: the job's, or more when its rows need more reduce tasks' memory."""
    return shards_for(job.rows, job.shards)


def read_shard(units: list[tuple[str, int, int]]) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(users, items, labels) of the row groups `units`: one item shard's rows, as prepare() checked them."""
    batches = [
        batch
        for file, group, _ in units
        for batch in storage.iter_row_group(file, group, ["user_id", "item_id", "label"], READ_BATCH_ROWS)
    ]
    if not batches:
        return np.zeros(0, np.int64), np.zeros(0, np.int64), np.zeros(0)
    rows = pa.Table.from_batches(batches)
    return tuple(rows[name].to_numpy() for name in ("user_id", "item_id", "label"))


def commit_written(job: stats_job.StatsJob, specs, written: list[dict]) -> dict:
    """Commit the parts the reduce tasks wrote (`item_shard`'s records); the step summary, with the
    seconds the tasks spent in the statistics kernel (`kernel_task_seconds`)."""
    names = [[row["name"] for row in written if row["resample"] == k] for k in range(len(specs))]
    written_rows = [sum(row["rows"] for row in written if row["resample"] == k) for k in range(len(specs))]
    return {**job.commit(names, written_rows), "kernel_task_seconds": sum(row["seconds"] for row in written)}


def job_inputs(job: stats_job.StatsJob) -> tuple[tuple[str, str], tuple[str, str] | None]:
    """(the user embeddings, the expansion points or None), each as (path, content digest); a local
    path made absolute, as the tasks read it from their own working folder (a cluster's executors)."""
    return (storage.canonical(job.user_embeddings), job.digests["user_embeddings"]), (
        (storage.canonical(job.expansion), job.digests["expansion"]) if job.expansion else None
    )


def run(job: stats_job.StatsJob, spark) -> dict:
    """Prepare the releases, compute and write them with Spark, commit; returns the step summary
    (with the seconds the tasks spent in the statistics kernel, `kernel_task_seconds`). A task Spark
    retries (a lost executor) writes the same part files again: keyed noise and a fixed summation
    order make them so (tests/pipelines/test_spark_cluster.py)."""

    specs = job.prepare()
    staged = job.staged_writes()
    settings = job.settings
    lookups = spark.sparkContext.broadcast(row_lookups(job))
    embeddings, expansion = job_inputs(job)
    forward_storage_settings(spark)
    declared = job.unit_shards is not None and job.unit_shards[0] >= shard_count(job)
    shards = job.unit_shards[0] if declared else shard_count(job)

    def reduce_shard(shard: int, rows: tuple) -> Iterator[pa.RecordBatch]:
        return item_shard(
            settings,
            specs,
            staged,
            embeddings=embeddings,
            lookups=lookups.value,
            shards=shards,
            shard=shard,
            rows=rows,
            expansion=expansion,
        )

    tasks = min(
        shards, max(shards_for(job.rows, 1), spark.sparkContext.defaultParallelism)
    )  # no more waves of reduce tasks than memory needs
    if declared:  # each reduce task reads its shards' row groups: no map side, no shuffle
        units_of = [
            [unit for unit, at in zip(job.units, job.unit_shards[1], strict=True) if at == k] for k in range(shards)
        ]
        written = spark.range(0, shards, 1, tasks).mapInArrow(
            lambda picked: (
                record
                for batch in picked
                for shard in batch.column("id").to_pylist()
                for record in reduce_shard(shard, read_shard(units_of[shard]))
            ),
            WRITTEN_DDL,
        )
    else:
        keys = partition_keys(tasks)[np.arange(shards) % tasks]  # shard k goes to task k mod tasks
        units = job.units  # the row groups prepare() read the footers of
        read_tasks = max(1, min(len(units), READ_TASKS_PER_CORE * spark.sparkContext.defaultParallelism))
        blocks = spark.range(0, max(1, len(units)), 1, read_tasks).mapInArrow(
            lambda picked: read_and_pack(units, picked, shards, keys), BLOCK_SCHEMA_DDL
        )
        written = blocks.repartition(tasks, "key").mapInArrow(
            lambda batches: item_shards(batches, reduce_shard), WRITTEN_DDL
        )
    records = written.collect()
    lookups.unpersist()
    return commit_written(job, specs, [row.asDict() for row in records])
