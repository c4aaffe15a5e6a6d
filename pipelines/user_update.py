"""`ssp user-update`: the user update of alternating minimization, on Spark.

Per user, `u_k = (sum v v^T + lambda_u n_k I)^-1 sum y v` over the user's n_k rows (weighted-lambda
ALS), with the item
embeddings table broadcast to every task; each partition (sorted by user) solves its users in
batches with numpy (trainer.solve.ridge_solve) and writes its part of the user embeddings table,
which the driver commits.

Privacy: reads private interactions and released item embeddings; the user embeddings it writes
are private (they stay in the run directory and only ever enter the stats job, which clips them).
"""

from __future__ import annotations

import argparse
from collections.abc import Iterator

import numpy as np
import pyarrow as pa

from pipelines.release import log
from schemas.arrays import list_column_to_matrix, matrix_to_list_column
from schemas import storage
from schemas.tables import USER_EMBEDDINGS, validate_item_embeddings
from trainer.solve import ridge_solve

WRITTEN_DDL = "name string, rows long"
SOLVE_ROWS = 262_144  # complete users' rows per batched solve


def _solve_partition(batches: Iterator[pa.RecordBatch], d: int, lam: float, staged: storage.StagedWrite, part: int, gravity=None) -> Iterator[pa.RecordBatch]:
    """Users of one partition (rows sorted by user) -> one part of the user embeddings table."""
    writer = None
    rows = 0
    pending: list[pa.RecordBatch] = []
    pending_rows = 0

    def solve(tables):
        nonlocal writer, rows
        table = pa.Table.from_batches(tables).combine_chunks()
        users, u = ridge_solve(table["user_id"].to_numpy(), list_column_to_matrix(table["embedding"], d, "item embedding"), table["label"].to_numpy(), lam, scale_by_rows=True, gravity=gravity)
        out = pa.Table.from_arrays([pa.array(users, pa.int64()), matrix_to_list_column(u)], schema=USER_EMBEDDINGS)
        if writer is None:
            writer = staged.open_part(part, USER_EMBEDDINGS)
        writer.write_table(out)
        rows += out.num_rows

    for batch in batches:
        if batch.num_rows == 0:
            continue
        users = batch.column("user_id").to_numpy()
        cut = int(np.searchsorted(users, users[-1], side="left"))
        if cut > 0:
            pending.append(batch.slice(0, cut))
            pending_rows += cut
            if pending_rows >= SOLVE_ROWS:
                solve(pending)
                pending, pending_rows = [], 0
        pending.append(batch.slice(cut))
    if pending:
        solve(pending)
    if writer is not None:
        writer.close()
        yield pa.RecordBatch.from_pydict({"name": [staged.part_name(part)], "rows": [rows]}, schema=pa.schema([("name", pa.string()), ("rows", pa.int64())]))


def run(spark, interactions: str, item_embeddings: str, out: str, lambda_u: float, dim: int | None = None, gravity: float = 0.0) -> int:
    """Solve every user of `interactions` against `item_embeddings`; write `out`; returns the user count.

    `gravity` alpha > 0 (implicit feedback) adds alpha V^T V over every catalog item to each user's
    system: the item embeddings are released data, so this costs no privacy.
    """
    from pyspark import TaskContext

    if not np.isfinite(lambda_u) or lambda_u <= 0:
        raise ValueError(f"--lambda-u must be > 0, got {lambda_u}")
    items = validate_item_embeddings(storage.read_table(item_embeddings), dim=dim)
    d = len(items["embedding"][0].as_py()) if items.num_rows else dim
    gram = None
    if gravity > 0:
        v = list_column_to_matrix(items["embedding"], d, "item embedding")
        gram = gravity * (v.T @ v)
    rated = spark.read.parquet(*storage.table_files(interactions)).select("user_id", "item_id", "label")
    vectors = spark.read.parquet(*storage.table_files(item_embeddings)).select("item_id", "embedding")
    missing = rated.join(vectors, "item_id", "left_anti").limit(1).collect()
    if missing:
        raise ValueError(f"{item_embeddings}: no embedding for item {missing[0]['item_id']} of the interactions")
    joined = rated.join(vectors.hint("broadcast"), "item_id")
    by_user = joined.repartition(max(2, spark.sparkContext.defaultParallelism), "user_id").sortWithinPartitions("user_id", "item_id")
    staged = storage.StagedWrite(out)
    written = by_user.mapInArrow(lambda batches: _solve_partition(batches, d, lambda_u, staged, TaskContext.get().partitionId(), gram), WRITTEN_DDL).collect()
    users = sum(row["rows"] for row in written)
    staged.commit([row["name"] for row in written], users)
    log(f"user update: {users:,} users solved (d={d}, lambda_u={lambda_u:g})")
    return users


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--interactions", required=True, help="interactions table (private)")
    parser.add_argument("--item-embeddings", required=True, help="item embeddings table (a release or public initialisation)")
    parser.add_argument("--out", required=True, help="user embeddings table to write (private)")
    parser.add_argument("--lambda-u", type=float, default=1.0, help="ridge regularisation of the user solve (default: %(default)s)")
    parser.add_argument("--dim", type=int, help="expected embedding dimension (checked)")
    parser.add_argument("--master", help="Spark master (default: local[*] unless spark-submit sets one)")


def main(args: argparse.Namespace) -> int:
    from pipelines.spark import session

    with session("ssp-user-update", args.master) as spark:
        users = run(spark, args.interactions, args.item_embeddings, args.out, args.lambda_u, args.dim)
    print(f"wrote {users:,} user embeddings to {args.out}")
    return 0
