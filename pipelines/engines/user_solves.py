"""The user update of alternating minimization, on Spark (the kernel of `ssp user-update`).

Per user, `u_k = (sum v v^T + lambda_u n_k I)^-1 sum y v` over the user's n_k rows (weighted-lambda
ALS), with the item embeddings table broadcast to every task; each partition (sorted by user)
solves its users in batches (trainer.solve.ridge_solve, compiled kernels) and writes its part of the user
embeddings table, which the driver commits. A table whose files each hold whole users in order (a
run's centred rows: pipelines.data.chunks.USERS_TOGETHER) is read a file per task, with no
shuffle. A run's user-update stage and the command are pipelines.training.user_stage.

Privacy: reads private interactions and released item embeddings; the user embeddings it writes
are private (they stay in the run directory and only ever enter the stats job, which clips them).
"""

from __future__ import annotations

import contextlib
import io
import pickle
import time
from collections.abc import Iterator
from dataclasses import dataclass
from typing import NamedTuple

import numpy as np
import pyarrow as pa

from pipelines.base.logs import log
from pipelines.data.chunks import complete_users, sorted_by_user, users_together
from pipelines.engines.spark import per_file, readable_tables, task_errors_raised_here
from pipelines.releases.stats_core import LOSSES
from schemas import storage
from schemas.arrays import list_column_to_matrix, matrix_to_list_column
from schemas.errors import UserError
from schemas.ids import IdIndex
from schemas.tables import USER_EMBEDDINGS, validate_item_embeddings
from trainer.solve import logistic_solve, ridge_solve

DEFAULT_LAMBDA_U = 0.1  # `ssp train --lambda-u` has the same default

WRITTEN_DDL = "name string, rows long, seconds double"
SOLVE_ROWS = 262_144  # complete users' rows per batched solve


def _solve_partition(
    batches: Iterator[pa.RecordBatch],
    vectors: tuple[IdIndex, np.ndarray],
    lam: float,
    *,
    staged: storage.StagedWrite,
    part: int,
    sources: tuple[str, str],
    gravity=None,
    logistic: bool = False,
    bias_ridge: float | None = None,
    constant: bool = False,
    prior: float = 0.0,
    confidence: bool = False,
) -> Iterator[pa.RecordBatch]:
    """Users of one partition (rows sorted by user) -> one part of the user embeddings table. Each
    row's item embedding is looked up here (`vectors`: the broadcast table), so the shuffle moves
    ids and labels only; a row without an embedding or with a label that is not finite is refused."""
    index, matrix = vectors
    interactions, item_embeddings = sources
    writer = None
    rows, seconds = 0, 0.0
    for table in complete_users(batches, SOLVE_ROWS):
        users, items, labels = (table[name].to_numpy() for name in ("user_id", "item_id", "label"))
        bad = ~np.isfinite(labels)
        if bad.any():
            raise UserError(
                f"{interactions}: the label of user {users[bad][0]}, item {items[bad][0]} is not finite "
                f"({labels[bad][0]})"
            )
        at, found = index.lookup(items)
        if not found.all():
            raise UserError(f"{item_embeddings}: no embedding for item {items[~found][0]} of the interactions")
        started = time.perf_counter()
        if constant:  # the per-item mean: no embedding, no bias, [1, 0] for every user
            solved = np.unique(users)
            u = np.tile([1.0, 0.0], (solved.size, 1))
        elif logistic:  # implicit feedback's logistic loss: the rows are positives, every catalog item a negative
            solved, u = logistic_solve(users, matrix[at], matrix, lam)
        else:
            solved, u = ridge_solve(
                users,
                matrix[at],
                labels,
                lam,
                scale_by_rows=True,
                gravity=gravity,
                bias_ridge=bias_ridge,
                prior=prior,
                confidence=confidence,
            )
        seconds += time.perf_counter() - started
        out = pa.Table.from_arrays([pa.array(solved, pa.int64()), matrix_to_list_column(u)], schema=USER_EMBEDDINGS)
        if writer is None:
            writer = staged.open_part(part, USER_EMBEDDINGS)
        writer.write_table(out)
        rows += out.num_rows
    if writer is not None:
        writer.close()
        yield pa.RecordBatch.from_pydict(
            {"name": [staged.part_name(part)], "rows": [rows], "seconds": [seconds]},
            schema=pa.schema([("name", pa.string()), ("rows", pa.int64()), ("seconds", pa.float64())]),
        )


class Solved(NamedTuple):
    """What a user update did: the users solved, and the seconds its tasks spent in the solves
    (summed over tasks: the kernel's share of the job, for the scaling benchmark)."""

    users: int
    solve_seconds: float


@dataclass(frozen=True)
class UserSolve:
    """The settings of a user update (see `run`): what every engine's user update is given."""

    lambda_u: float
    dim: int | None = None
    gravity: float = 0.0
    loss: str = "square"
    bias_ridge: float | None = None
    constant: bool = False
    prior: float = 0.0
    confidence: bool = False


def item_vectors(item_embeddings: str, solve: UserSolve) -> tuple[tuple[IdIndex, np.ndarray], np.ndarray | None, int]:
    """The checked solve settings' inputs: ((index of the item ids, their embeddings), the gravity
    Gram or None, d); refuses a bad loss or ridge before any row is read."""
    if solve.loss not in LOSSES:
        raise UserError(f"loss must be one of {LOSSES}, got {solve.loss!r}")
    if not np.isfinite(solve.lambda_u) or solve.lambda_u <= 0:
        raise UserError(f"--lambda-u must be > 0, got {solve.lambda_u}")
    items = validate_item_embeddings(storage.read_table(item_embeddings), dim=solve.dim)
    d = len(items["embedding"][0].as_py()) if items.num_rows else solve.dim
    v = list_column_to_matrix(items["embedding"], d, "item embedding")
    gram = solve.gravity * (v.T @ v) if solve.gravity > 0 else None
    return (IdIndex(items["item_id"].to_numpy()), v), gram, d


def solve_part(
    batches: Iterator[pa.RecordBatch],
    vectors: tuple[IdIndex, np.ndarray],
    gram,
    solve: UserSolve,
    *,
    staged: storage.StagedWrite,
    part: int,
    sources: tuple[str, str],
) -> Iterator[pa.RecordBatch]:
    """One engine task: the users of `batches` (sorted by user) -> part `part` of the table."""
    return _solve_partition(
        batches,
        vectors,
        solve.lambda_u,
        staged=staged,
        part=part,
        sources=sources,
        gravity=gram,
        logistic=solve.loss == "logistic",
        bias_ridge=solve.bias_ridge,
        constant=solve.constant,
        prior=solve.prior,
        confidence=solve.confidence,
    )


def file_rows(file: str) -> Iterator[pa.RecordBatch]:
    """The rows of one file of a table whose files hold whole users in order (chunks.USERS_TOGETHER)."""
    return sorted_by_user(storage.iter_batches(file, columns=["user_id", "item_id", "label"]), file)


def commit(staged: storage.StagedWrite, written: list[dict], out: str, d: int, lambda_u: float) -> Solved:
    """Commit the parts the tasks wrote; the update's summary."""
    users = sum(row["rows"] for row in written)
    staged.commit([row["name"] for row in written], users)
    log(
        f"user update: user embeddings solved into {out} (d={d}, lambda_u={lambda_u:g})"
    )  # not how many: the exact number of users stays private
    return Solved(users, sum(row["seconds"] for row in written))


def run(
    spark,
    interactions: str,
    item_embeddings: str,
    out: str,
    lambda_u: float,
    *,
    dim: int | None = None,
    gravity: float = 0.0,
    loss: str = "square",
    bias_ridge: float | None = None,
    constant: bool = False,
    prior: float = 0.0,
    confidence: bool = False,
) -> Solved:
    """Solve every user of `interactions` against `item_embeddings` on Spark; write `out`.

    `gravity` alpha > 0 (implicit feedback) adds alpha V^T V over every catalog item to each user's
    system: the item embeddings are released data, so this costs no privacy. `loss` "logistic"
    solves implicit feedback's logistic loss instead (trainer.solve.logistic_solve): the rows are
    positives and every item of `item_embeddings` a negative, weighted as SSP-convex weighs them.
    `bias_ridge` (a model with biases): the item embeddings are [v, item bias, 1] and the users
    [u, 1, b_u], each user's bias with that fixed ridge (trainer.solve.ridge_solve). `constant`: the
    per-item mean's users, [1, 0] each (no embedding, no bias), so that the statistics are each
    item's weighted label sum and count. `prior` is added to every user's ridge on the embedding
    (trainer.solve.ridge_solve): a fixed prior precision, which matters most for light users.
    `confidence` (the ranking protocol): the labels are the rows' confidences, each row a positive
    weighing its confidence (trainer.solve.ridge_solve).
    """
    return run_spark(
        spark,
        interactions,
        item_embeddings,
        out,
        UserSolve(lambda_u, dim, gravity, loss, bias_ridge, constant, prior, confidence),
    )


def run_spark(spark, interactions: str, item_embeddings: str, out: str, solve: UserSolve) -> Solved:
    """`run` with its settings as a UserSolve."""
    from pyspark import TaskContext

    vectors, gram, d = item_vectors(item_embeddings, solve)
    # PySpark prints the traceback of a broadcast file it cannot write (a full disk, a file-size limit), then raises
    # PicklingError
    try:
        with contextlib.redirect_stderr(io.StringIO()):
            shared = spark.sparkContext.broadcast(vectors)
    except pickle.PicklingError as exc:
        if isinstance(exc.__context__, OSError):
            raise exc.__context__ from None  # the disk's error, which the CLI reports in one line
        raise
    staged = storage.StagedWrite(out)

    def task(batches: Iterator[pa.RecordBatch], part: int) -> Iterator[pa.RecordBatch]:
        return solve_part(
            batches, shared.value, gram, solve, staged=staged, part=part, sources=(interactions, item_embeddings)
        )

    try:
        with task_errors_raised_here():
            if users_together(
                interactions
            ):  # each file whole users in order (a run's centred rows): a task per file, no shuffle
                written = per_file(
                    spark,
                    storage.table_files(interactions),
                    lambda index, file: task(file_rows(file), index),
                    WRITTEN_DDL,
                ).to_pylist()
            else:
                with readable_tables(spark, interactions) as (rated_files,):
                    rated = spark.read.parquet(*rated_files).select("user_id", "item_id", "label")
                    by_user = rated.repartition(
                        max(2, spark.sparkContext.defaultParallelism), "user_id"
                    ).sortWithinPartitions("user_id", "item_id")
                    written = [
                        row.asDict()
                        for row in by_user.mapInArrow(
                            lambda batches: task(batches, TaskContext.get().partitionId()), WRITTEN_DDL
                        ).collect()
                    ]
    except BaseException:
        staged.abort([])
        raise
    finally:
        shared.unpersist()
    return commit(staged, written, out, d, solve.lambda_u)


def run_local(interactions: str, item_embeddings: str, out: str, solve: UserSolve) -> Solved:
    """`run` in this process, with Spark's tasks' bits: a table whose files hold whole users in
    order is solved a file at a time, any other sorted by (user, item), as Spark's shuffle sorts it."""
    vectors, gram, d = item_vectors(item_embeddings, solve)
    staged = storage.StagedWrite(out)
    sources = (interactions, item_embeddings)
    try:
        if users_together(interactions):
            parts = [
                solve_part(file_rows(file), vectors, gram, solve, staged=staged, part=index, sources=sources)
                for index, file in enumerate(storage.table_files(interactions))
            ]
        else:
            rows = storage.read_table(interactions, columns=["user_id", "item_id", "label"]).sort_by(
                [("user_id", "ascending"), ("item_id", "ascending")]
            )
            parts = [solve_part(iter(rows.to_batches()), vectors, gram, solve, staged=staged, part=0, sources=sources)]
        written = [row for part in parts for batch in part for row in pa.Table.from_batches([batch]).to_pylist()]
    except BaseException:
        staged.abort([])
        raise
    return commit(staged, written, out, d, solve.lambda_u)
