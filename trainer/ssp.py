"""SSP2 (and SSP1) training of the item encoder from released statistics and public features only.

Per item j, with released A_j, b_j: `loss_j = 1/2 v_j^T (A_j + lambda I) v_j - b_j^T v_j`, whose
gradient is `J_j^T ((A_j + lambda I) v_j - b_j)` (the paper's Proposition 1). Minibatches sample
ITEMS: the statistics are streamed from Parquet in item batches through a bounded shuffle buffer,
so memory does not grow with the number of items. The optional projection of noised A_j onto the
PSD cone is post-processing and runs once per table. SSP1 passes R resampled tables, one per phase
of the epochs.

The item update must do no harm under noise, then gain: it starts from the public-feature encoder
with a zero per-item residual, anchored to that start; every ridge and penalty is stated in the
release's own units (S = wbar Gamma_u^2, N = 2 sqrt(d) z S); with biases each item's bias residual
has its own penalty and is solved exactly after the epochs (`solve_residuals`); the embeddings are
rescaled to unit RMS norm after each update. docs/models.md ("Why AM-SSP's item update looks the
way it does") has each choice and its reason; the measurements are in docs/results.md.

Privacy: there is deliberately no way to give this module interactions: its inputs are stats
tables (with their release parameters checked against what the caller expects) and the encoder's
public feature space, so everything it computes is post-processing of the DP releases.
"""

from __future__ import annotations

import collections
import dataclasses
import math
import os
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

import numpy as np
import pyarrow as pa
import tensorflow as tf

from privacy import quadratic
from privacy.accumulator import packed_size, project_psd, unpack_upper, upper_indices
from schemas import storage
from schemas.arrays import list_column_to_matrix, matrix_to_list_column
from schemas.errors import UserError
from schemas.ids import IdIndex
from schemas.progress import bar as progress_bar
from schemas.tables import ITEM_EMBEDDINGS, STATS, stats_metadata, validate_item_embeddings
from trainer import optimizers
from trainer.encoder import ItemEncoder
from trainer.solve import cholesky_solve


@dataclass(frozen=True)
class SSPConfig:
    """Optimisation settings of the item update."""

    epochs: int = 30
    batch_size: int | None = None  # items per minibatch; None: `auto_batch_size` of the covered catalog
    learning_rate: float = 0.01
    ridge: float = 1.0  # lambda: lambda * scale_j I is added to every A_j (scale_j: DP count, or 1)
    weight_decay: float = 0.0  # L2 on the encoder's dense kernel
    cosine_decay: bool = True  # the learning rate decays to 0 along a cosine over the run's steps
    psd_projection: bool = True
    shuffle_batches: int = 8  # batches held in the shuffle buffer
    seed: int = 0
    solve_residuals: bool = (
        False  # after the epochs, each covered item's residual set to its exact minimiser (`solve_residuals`)
    )

    def __post_init__(self):
        for name in ("epochs", "batch_size", "shuffle_batches"):
            if name == "batch_size" and self.batch_size is None:
                continue
            if not isinstance(getattr(self, name), int) or getattr(self, name) < 1:
                raise UserError(f"{name} must be a positive integer, got {getattr(self, name)}")
        for name in ("learning_rate", "ridge", "weight_decay"):
            value = getattr(self, name)
            if not math.isfinite(value) or value < 0 or (name == "learning_rate" and value == 0):
                raise UserError(
                    f"{name} must be a finite number {'> 0' if name == 'learning_rate' else '>= 0'}, got {value}"
                )


EPOCH_STEPS = 8  # the regime the defaults were tuned in: 6,040 users cover about 3,500 items, 7 batches of 512
MIN_BATCH = 512
SHUFFLE_BUFFER_BYTES = 256 << 20  # the packed A_j the shuffle buffer holds, at most (float64)
CACHED_TABLE_BYTES = (
    256 << 20
)  # a stats table at most this large (decoded, in the trainer's float32) is read once per training, not once per epoch


def auto_batch_size(items: int, d: int, shuffle_batches: int) -> int:
    """The default minibatch of a catalog of `items` items: an epoch of about EPOCH_STEPS steps, at
    least MIN_BATCH items, and no more than the shuffle buffer's memory allows. Adam updates every
    residual at every step, so a step costs O(catalog): with batches of 512 the item update grew as
    the catalog squared (83,000 items: 3,600 steps, 28 s; 240 steps of 7,700: 16 s, the same test
    RMSE). The catalog's size is the DP counts' (the items they cover): no privacy cost."""
    fits = SHUFFLE_BUFFER_BYTES // (shuffle_batches * packed_size(d) * 8)
    return max(MIN_BATCH, min(math.ceil(items / EPOCH_STEPS), fits))


def check_stats(path: str, expected: dict) -> dict:
    """The release parameters of a stats table, after checking its schema and the expected values
    (d, clip norms, noise multiplier, wbar: whatever `expected` names)."""
    schema = storage.read_schema(path)
    missing = [f.name for f in STATS if f.name not in schema.names or schema.field(f.name).type != f.type]
    if missing:
        raise UserError(f"{path} is not a stats table: column(s) {missing} missing or of the wrong type")
    meta = stats_metadata(schema)
    for key, value in expected.items():
        if key not in meta:
            raise UserError(f"{path}: stats metadata has no {key!r}")
        if not math.isclose(meta[key], float(value), rel_tol=1e-9, abs_tol=0.0):
            raise UserError(
                f"{path}: stats were released with {key}={meta[key]:g}, but this run expects {key}={float(value):g}"
            )
    return meta


def project_table(path: str, out: str, batch_size: int = 2048) -> str:
    """Stream a stats table into `out` with every A_j projected onto the PSD cone; returns `out`.
    Batches are projected on every core (numpy's eigh releases the GIL; each matrix alone, so the
    same bits), a few at a time, and written in order (62,251 items at d 17 on 2 cores: 1.3 s against 2.7 s)."""
    schema = STATS.with_metadata(storage.read_schema(path).metadata)
    d = int(stats_metadata(schema)["d"])

    def projected(batch: pa.RecordBatch) -> pa.RecordBatch:
        a = list_column_to_matrix(batch.column("a_upper"), packed_size(d), "a_upper")
        return pa.RecordBatch.from_arrays(
            [batch.column("item_id"), matrix_to_list_column(project_psd(a, d)), batch.column("b")], schema=schema
        )

    workers = os.cpu_count() or 1
    with storage.TableWriter(out, schema) as writer, ThreadPoolExecutor(workers) as pool:
        pending: collections.deque = collections.deque()
        for batch in storage.iter_batches(path, batch_size=batch_size):
            pending.append(pool.submit(projected, batch))
            if len(pending) > 2 * workers:  # bounded: memory stays a few batches whatever the catalog
                writer.write(pending.popleft().result())
        while pending:
            writer.write(pending.popleft().result())
    return out


def expand_table(
    path: str, out: str, expansion: tuple[np.ndarray, np.ndarray], psd_projection: bool, batch_size: int = 2048
) -> str:
    """Stream a logistic release (noised H_j, g_j) into `out` as SSP2's A_j = H_j, b_j = H_j v0_j - g_j
    around the expansion points (sorted item ids, their vectors; privacy.quadratic.expansion), H_j
    projected onto the PSD cone first when asked (post-processing of the release); returns `out`."""
    schema = storage.read_schema(path)
    if (schema.metadata or {}).get(b"loss") != b"logistic":
        raise UserError(
            f"{path} is not a logistic release (its metadata names no loss 'logistic'); it cannot be expanded"
        )
    d = int(stats_metadata(schema)["d"])
    index, vectors = IdIndex(expansion[0]), expansion[1]
    with storage.TableWriter(out, STATS.with_metadata(schema.metadata)) as writer:
        for batch in storage.iter_batches(path, batch_size=batch_size):
            h = list_column_to_matrix(batch.column("a_upper"), packed_size(d), "a_upper")
            at = index.positions(batch.column("item_id").to_numpy(), f"item of {path} with an expansion point")
            a_upper, b = quadratic.expansion(
                project_psd(h, d) if psd_projection else h,
                list_column_to_matrix(batch.column("b"), d, "b"),
                vectors[at],
            )
            writer.write(
                pa.RecordBatch.from_arrays(
                    [batch.column("item_id"), matrix_to_list_column(a_upper), matrix_to_list_column(b)],
                    schema=STATS.with_metadata(schema.metadata),
                )
            )
    return out


def shuffled_chunks(
    path: str,
    encoder: ItemEncoder,
    config: SSPConfig,
    rng: np.random.Generator,
    *,
    ridge_scale: np.ndarray | None = None,
    cache: dict | None = None,
    dtype=np.float64,
    convert=None,
) -> Iterator[tuple[np.ndarray, tuple]]:
    """The table's items in buffers of `shuffle_batches` record batches, each with its shuffle:
    (order, (catalog positions (n,), packed A_j (n, d(d+1)/2), b_j (n, d), ridge scales (n, d))), the
    buffer's rows in the table's order and `order` a permutation of them. `ridge_scale` is one number
    per catalog position, or one row of d (a diagonal: the bias coordinate's own ridge). Values come
    as `dtype`, and `convert` (e.g. to tensors) is applied to each buffer once. With `cache` (a dict
    the caller keeps across epochs), a table of at most CACHED_TABLE_BYTES keeps its converted
    buffers there, so that later epochs neither read, decode nor convert it: the same buffers and
    the same shuffles."""
    d = encoder.dim
    buffers = cache.get(path) if cache is not None else None
    if buffers is None:
        buffers = _decoded_buffers(path, encoder, config, ridge_scale, dtype)
        if convert is not None:
            buffers = map(convert, buffers)
        items = storage.row_count(path) if cache is not None else 0
        if (
            cache is not None
            and items * (8 + (packed_size(d) + 2 * d) * np.dtype(dtype).itemsize) <= CACHED_TABLE_BYTES
        ):
            buffers = cache[path] = list(buffers)
    for buffer in buffers:
        yield rng.permutation(len(buffer[0])), buffer


def _decoded_buffers(
    path: str, encoder: ItemEncoder, config: SSPConfig, ridge_scale: np.ndarray | None, dtype=np.float64
) -> Iterator[tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]]:
    """`shuffled_chunks`' buffers before their conversion: (positions, packed A_j, b_j, ridge scales (n, d)) in the
    table's order, values as `dtype`."""
    d = encoder.dim
    buffer: list[pa.RecordBatch] = []

    def decode(batches):
        table = pa.Table.from_batches(batches).combine_chunks()
        positions = encoder.space.index_of(table["item_id"].to_numpy())
        scale = ridge_scale[positions] if ridge_scale is not None else np.ones(positions.size)
        scale = np.broadcast_to(scale[:, None] if scale.ndim == 1 else scale, (positions.size, d))
        a, b = (
            list_column_to_matrix(table["a_upper"], packed_size(d), "a_upper"),
            list_column_to_matrix(table["b"], d, "b"),
        )
        return positions, a.astype(dtype, copy=False), b.astype(dtype, copy=False), scale.astype(dtype)

    for batch in storage.iter_batches(path, batch_size=config.batch_size):
        buffer.append(batch)
        if len(buffer) >= config.shuffle_batches:
            yield decode(buffer)
            buffer = []
    if buffer:
        yield decode(buffer)


def item_batches(
    path: str,
    encoder: ItemEncoder,
    config: SSPConfig,
    ridge_scale: np.ndarray | None = None,
    gravity: np.ndarray | None = None,
) -> Iterator[tuple[np.ndarray, np.ndarray, np.ndarray]]:
    """(catalog positions, A_j + ridge diag(scale_j) (+ gravity) (B, d, d), b_j (B, d)) in the
    table's order, batches of `config.batch_size`: the residual solve's matrices, their diagonal
    added in place (no diagonal matrices built)."""
    d, diagonal = encoder.dim, np.arange(encoder.dim)
    for positions, packed, b, scale in _decoded_buffers(
        path, encoder, dataclasses.replace(config, shuffle_batches=1), ridge_scale
    ):
        a = unpack_upper(packed, d)
        a[:, diagonal, diagonal] += config.ridge * scale
        if gravity is not None:
            a += gravity
        yield positions, a, b


def dense_product(a):
    """v -> A_j v_j for each item of a batch, from its dense matrices A (B, d, d)."""
    return lambda v: tf.einsum("bij,bj->bi", a, v)


def packed_product(packed, scale, ridge: float, gravity):
    """v -> (A_j + ridge diag(scale_j) + gravity) v_j for each item of a batch: `item_batches`'
    matrices (packed A_j (B, d(d+1)/2), scale (B, d), gravity (d, d)) applied to the items' vectors
    without building them. The packed rows are unpacked coordinate-major, (d, d, B): a gather of
    whole rows of the transposed batch, and A_j v_j an elementwise product summed over j; the ridge
    is a product with the diagonal. Gathering each item's d^2 entries along the packed axis and
    adding a (B, d, d) diagonal took twice the step's time."""
    d = gravity.shape[-1]
    rows, cols = upper_indices(d)
    unpacking = np.empty((d, d), np.int64)  # the packed position of each (i, j)
    unpacking[rows, cols] = unpacking[cols, rows] = np.arange(rows.size)
    a = tf.reshape(tf.gather(tf.transpose(packed), unpacking.ravel()), [d, d, -1])

    def product(v):
        return (
            tf.transpose(tf.reduce_sum(a * tf.transpose(v)[None, :, :], axis=1))
            + ridge * scale * v
            + tf.matmul(v, gravity, transpose_b=True)
        )

    return product


def diagonals(scales: np.ndarray, d: int) -> np.ndarray:
    """(B, d, d) matrices s_j I for scales (B,), or diag(s_j) for scales (B, d)."""
    scales = np.asarray(scales, dtype=np.float64)
    return scales[:, None, None] * np.eye(d) if scales.ndim == 1 else scales[:, :, None] * np.eye(d)


def ssp_loss(
    encoder: ItemEncoder, positions, product, b, *, residual_penalty=None, anchor=None, start=None, residual_start=None
):
    """Mean over the batch's items of 1/2 v^T A v - b^T v, with `product(v)` giving A v (A already
    holding the ridge term: `packed_product`, or `dense_product` of matrices), plus
    1/2 mu_j ||r_j - r0_j||^2 on the items' residuals when `residual_penalty` (mu of each item: (B,),
    or (B, d) per coordinate) is given (r0_j: `residual_start`, or 0), plus 1/2 kappa ||f(j) - f0(j)||^2
    when `anchor` (kappa: a number, or (d,) per coordinate) is given: the shared encoder's output f(j) held near `start`
    (f0, where the step began) as strongly as the noise calls for."""
    v = encoder(positions)
    loss = 0.5 * tf.reduce_sum(v * product(v), axis=-1) - tf.reduce_sum(b * v, axis=-1)
    if residual_penalty is not None:
        penalty = residual_penalty if residual_penalty.shape.rank == 2 else residual_penalty[:, None]
        residual = encoder.residual(positions) - (residual_start if residual_start is not None else 0.0)
        loss += 0.5 * tf.reduce_sum(penalty * tf.square(residual), axis=-1)
    if anchor is not None:
        loss += 0.5 * tf.reduce_sum(anchor * tf.square(encoder.shared(positions) - start), axis=-1)
    return tf.reduce_mean(loss)


def train(
    encoder: ItemEncoder,
    stats_paths: list[str],
    config: SSPConfig,
    *,
    expected: dict | None = None,
    progress: bool = True,
    ridge_scale: np.ndarray | None = None,
    gravity: np.ndarray | None = None,
    residual_penalty: np.ndarray | None = None,
    anchor: float | np.ndarray = 0.0,
    hold_residuals: bool = False,
) -> list[float]:
    """Fit the encoder on released statistics (one table: SSP2; R tables: SSP1 phases).

    Returns the mean loss of every epoch. `expected` lists release parameters the tables must
    carry (e.g. d, clip_u, clip_y, noise_multiplier from the ledger). `ridge_scale` (one value per
    catalog position, e.g. the DP item counts: weighted-lambda ALS, or a row of d per position)
    scales each item's ridge;
    `gravity` (d x d, e.g. alpha times the released users' Gram matrix) is added to every A_j: the
    implicit-feedback penalty on every item's scores. `residual_penalty` (one mu_j per catalog
    position, or a row of d) penalises the per-item residuals of a features encoder with the item
    id, about zero, or with `hold_residuals` about the residuals the update starts from. `anchor`
    (kappa > 0, or one per coordinate) holds the shared encoder's output near where this update
    began: the item update moves away from its starting point only as far as the statistics outweigh the noise.
    """
    if not stats_paths:
        raise UserError("no stats tables to train on")
    expected = {"d": encoder.dim, **(expected or {})}
    for path in stats_paths:
        check_stats(path, expected)
    if config.epochs < len(stats_paths):
        raise UserError(f"{len(stats_paths)} resampled tables need at least as many epochs, got {config.epochs}")
    tables = stats_paths
    if config.psd_projection:
        tables = [project_table(path, _projected_path(path)) for path in stats_paths]
    items = storage.row_count(tables[0])  # the catalog the tables cover
    if config.batch_size is None:
        config = dataclasses.replace(config, batch_size=auto_batch_size(items, encoder.dim, config.shuffle_batches))
    steps = config.epochs * max(1, math.ceil(items / config.batch_size))
    rate = (
        tf.keras.optimizers.schedules.CosineDecay(config.learning_rate, steps)
        if config.cosine_decay
        else config.learning_rate
    )
    optimizer = optimizers.compiled("adam", rate)
    encoder(tf.zeros([1], tf.int64))  # a layer not yet called creates its weights now
    optimizer.build(encoder.trainable_variables)  # and Adam its slots, before the step is traced
    dense = [w for w in encoder.trainable_variables if "kernel" in w.name]
    use_residual = residual_penalty is not None and encoder.has_residual
    penalty_of = tf.constant(residual_penalty if use_residual else np.zeros(1), tf.float32)
    held = encoder.residual_values() if use_residual and hold_residuals else None
    held_of = tf.constant(held if held is not None else np.zeros((1, encoder.dim)), tf.float32)
    anchor = np.asarray(anchor, dtype=np.float64)
    use_anchor = bool(np.any(anchor > 0)) and encoder.kind == "features"
    start_of = tf.constant(encoder.embed_all(shared=True) if use_anchor else np.zeros((1, encoder.dim)), tf.float32)
    anchor_of = tf.constant(anchor, tf.float32)

    d = encoder.dim
    gravity_of = tf.constant(gravity if gravity is not None else np.zeros((d, d)), tf.float32)

    def step(positions, product, b):
        with tf.GradientTape() as tape:
            loss = ssp_loss(
                encoder,
                positions,
                product,
                b,
                residual_penalty=tf.gather(penalty_of, positions) if use_residual else None,
                anchor=anchor_of if use_anchor else None,
                start=tf.gather(start_of, positions) if use_anchor else None,
                residual_start=tf.gather(held_of, positions) if held is not None else None,
            )
            penalty = (
                config.weight_decay * tf.add_n([tf.reduce_sum(tf.square(w)) for w in dense])
                if dense and config.weight_decay
                else 0.0
            )
            total = loss + penalty
        grads = tape.gradient(total, encoder.trainable_variables)
        optimizer.apply_gradients(zip(grads, encoder.trainable_variables, strict=True))
        return loss

    # A chunk's batches in one call (one trace for every chunk): a call per batch cost more in
    # Python than the batch's arithmetic. Each batch gathers its rows of the chunk's tensors by the
    # epoch's shuffle, so a cached chunk is converted to tensors once, not shuffled and converted
    # every epoch.
    @tf.function(
        input_signature=[
            tf.TensorSpec([None], tf.int64),
            tf.TensorSpec([None], tf.int64),
            tf.TensorSpec([None, packed_size(d)], tf.float32),
            tf.TensorSpec([None, d], tf.float32),
            tf.TensorSpec([None, d], tf.float32),
        ]
    )
    def run_chunk(order, positions, packed, b, scale):
        n = tf.shape(order)[0]
        total = tf.constant(0.0, tf.float64)
        for start in tf.range(0, n, config.batch_size):
            end = tf.minimum(start + config.batch_size, n)
            rows = order[start:end]
            product = packed_product(tf.gather(packed, rows), tf.gather(scale, rows), config.ridge, gravity_of)
            loss = step(tf.gather(positions, rows), product, tf.gather(b, rows))
            total += tf.cast(loss, tf.float64) * tf.cast(end - start, tf.float64)
        return total

    def tensors(buffer):
        positions, packed, b, scale = buffer
        return (
            tf.constant(positions),
            tf.constant(packed, tf.float32),
            tf.constant(b, tf.float32),
            tf.constant(scale, tf.float32),
        )

    rng = np.random.default_rng(config.seed)
    losses = []
    decoded: dict = {}  # shuffled_chunks' cache: a small table is read, decoded and converted once, not once per epoch
    bar = progress_bar(range(config.epochs), desc="ssp", unit="epoch", enabled=progress, mininterval=2.0)
    for epoch in bar:
        path = tables[epoch * len(tables) // config.epochs]
        total, count = 0.0, 0
        for order, buffer in shuffled_chunks(
            path, encoder, config, rng, ridge_scale=ridge_scale, cache=decoded, dtype=np.float32, convert=tensors
        ):
            total += float(run_chunk(tf.constant(order), *buffer))
            count += order.size
        losses.append(total / max(count, 1))
        bar.set_postfix(loss=f"{losses[-1]:.4g}", refresh=False)
    if (
        config.solve_residuals
        and use_residual
        and (config.psd_projection or stats_metadata(storage.read_schema(tables[0]))["noise_multiplier"] == 0)
    ):
        solve_residuals(encoder, tables, config, residual_penalty, ridge_scale, gravity, held)
    return losses


def solve_residuals(
    encoder: ItemEncoder,
    tables: list[str],
    config: SSPConfig,
    residual_penalty: np.ndarray,
    ridge_scale: np.ndarray | None = None,
    gravity: np.ndarray | None = None,
    held: np.ndarray | None = None,
) -> None:
    """Set every covered item's residual to its exact minimiser of the SSP loss, the shared encoder
    as trained: with A = A_j + lambda s_j I (+ gravity), f_j the shared output and r0_j the residual
    the penalty holds it at (`held`, catalog order; zero when None),
        r_j = (A + mu_j I)^-1 (b_j - A f_j + mu_j r0_j)
    (the mean of R resampled tables for SSP1). Each item's loss is convex in r_j, so this block
    step never raises the loss; it is what minibatch steps approach slowly where the penalty is
    small against A_j (the item bias's, with biases).
    Needs PSD A_j: projected, or exact (non-private)."""
    path = tables[0]
    if len(tables) > 1:
        path = mean_table(tables, path.rstrip("/").removesuffix(".parquet") + ".mean.parquet")
    d, diagonal = encoder.dim, np.arange(encoder.dim)
    in_order = dataclasses.replace(config, batch_size=max(config.batch_size or 0, 2048))
    for positions, a, b in item_batches(path, encoder, in_order, ridge_scale, gravity):
        shared = encoder.shared(tf.constant(positions)).numpy().astype(np.float64)
        rhs = b - np.einsum("bij,bj->bi", a, shared)
        penalty = np.broadcast_to(residual_penalty[positions].reshape(positions.size, -1), (positions.size, d))
        if held is not None:
            rhs += penalty * held[positions]
        a[:, diagonal, diagonal] += penalty
        encoder.set_residuals(positions, cholesky_solve(a, rhs))


def _aligned_batches(paths: list[str], batch_size: int):
    """The tables' rows in lockstep: lists of equally long record batches, one per table."""
    iterators = [storage.iter_batches(path, batch_size=batch_size) for path in paths]
    pending = [None] * len(paths)
    while True:
        for k, iterator in enumerate(iterators):
            while pending[k] is None or pending[k].num_rows == 0:
                pending[k] = next(iterator, None)
                if pending[k] is None:
                    break
        ends = [batch is None for batch in pending]
        if all(ends):
            return
        if any(ends):
            raise UserError(f"the stats tables {paths} have different numbers of rows")
        rows = min(batch.num_rows for batch in pending)
        yield [batch.slice(0, rows) for batch in pending]
        pending = [batch.slice(rows) for batch in pending]


def mean_table(paths: list[str], out: str, batch_size: int = 2048) -> str:
    """The item-by-item mean of a step's R stats tables (its resamples), streamed into `out`;
    returns `out`. The resamples list the same items in the same order (each engine writes every
    resample of a shard from one array of items); anything else is refused. Metadata: the first
    table's, plus `averaged_resamples` (R) and `averaged_releases` (the R release indices): the
    mean's noise standard deviation is noise_multiplier / sqrt(R) times the sensitivity."""
    metas = [stats_metadata(storage.read_schema(path)) for path in paths]
    for key in ("d", "noise_multiplier", "clip_u", "clip_y", "wbar"):
        if len({meta[key] for meta in metas}) != 1:
            raise UserError(
                f"the stats tables {paths} were released with different {key}; only resamples of one release can be "
                "averaged"
            )
    d = int(metas[0]["d"])
    schema = STATS.with_metadata(
        {
            **storage.read_schema(paths[0]).metadata,
            b"averaged_resamples": str(len(paths)).encode(),
            b"averaged_releases": ",".join(str(int(meta["release"])) for meta in metas).encode(),
        }
    )
    with storage.TableWriter(out, schema) as writer:
        for batches in _aligned_batches(paths, batch_size):
            items = batches[0].column("item_id")
            if any(not batch.column("item_id").equals(items) for batch in batches[1:]):
                raise UserError(f"the stats tables {paths} list their items in different orders")
            a = sum(
                list_column_to_matrix(batch.column("a_upper"), packed_size(d), "a_upper") for batch in batches
            ) / len(batches)
            b = sum(list_column_to_matrix(batch.column("b"), d, "b") for batch in batches) / len(batches)
            writer.write(
                pa.RecordBatch.from_arrays([items, matrix_to_list_column(a), matrix_to_list_column(b)], schema=schema)
            )
    return out


def _projected_path(path: str) -> str:
    return path.rstrip("/").removesuffix(".parquet") + ".psd.parquet"


def item_embeddings_table(encoder: ItemEncoder, vectors: np.ndarray | None = None) -> pa.Table:
    """The encoder's embedding of every catalog item (or `vectors`, what a run makes of them, in
    catalog order), as an ITEM_EMBEDDINGS table."""
    vectors = encoder.embed_all() if vectors is None else vectors
    return validate_item_embeddings(
        pa.Table.from_arrays(
            [pa.array(encoder.space.item_ids, pa.int64()), matrix_to_list_column(vectors)], schema=ITEM_EMBEDDINGS
        )
    )
