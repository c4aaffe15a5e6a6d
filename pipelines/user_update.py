"""`ssp user-update` / `spark-submit pipelines/user_update.py`: the user update of alternating
minimization, on Spark.

Per user, `u_k = (sum v v^T + lambda_u n_k I)^-1 sum y v` over the user's n_k rows (weighted-lambda
ALS), with the item
embeddings table broadcast to every task; each partition (sorted by user) solves its users in
batches with numpy (trainer.solve.ridge_solve) and writes its part of the user embeddings table,
which the driver commits.

Two modes: explicit tables (`--interactions --item-embeddings --out`), or a stage of a training
run (`--run RUN --step s`: step s's users against step s-1's item embeddings; `--run RUN --final`:
against the last step's, for evaluation), where inputs, output and settings come from the run's
manifest (pipelines.run_dir). As a script (spark-submit, from the repository root or with the
project's wheel in `--py-files` on a cluster) it takes the same flags as `ssp user-update`.

Privacy: reads private interactions and released item embeddings; the user embeddings it writes
are private (they stay in the run directory and only ever enter the stats job, which clips them).
"""

from __future__ import annotations

import os
import sys

if __package__ in (None, ""):  # run as a script by spark-submit: make the project importable
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import argparse  # noqa: E402
import contextlib  # noqa: E402
import io  # noqa: E402
import pickle  # noqa: E402
import time  # noqa: E402
from collections.abc import Iterator  # noqa: E402
from typing import NamedTuple  # noqa: E402

import numpy as np  # noqa: E402
import pyarrow as pa  # noqa: E402

from pipelines.chunks import complete_users  # noqa: E402
from pipelines.lock import existing_run_lock  # noqa: E402
from pipelines.logs import log  # noqa: E402
from pipelines.run_dir import Run, require_steps  # noqa: E402
from pipelines.spark import readable_tables, task_errors_raised_here  # noqa: E402
from pipelines.stats_core import LOSSES  # noqa: E402
from schemas.arrays import list_column_to_matrix, matrix_to_list_column  # noqa: E402
from schemas import storage  # noqa: E402
from schemas.ids import IdIndex  # noqa: E402
from schemas.tables import USER_EMBEDDINGS, validate_item_embeddings  # noqa: E402
from trainer.solve import logistic_solve, ridge_solve  # noqa: E402

DEFAULT_LAMBDA_U = 0.1  # `ssp train --lambda-u` has the same default

WRITTEN_DDL = "name string, rows long, seconds double"
SOLVE_ROWS = 262_144  # complete users' rows per batched solve


def _solve_partition(batches: Iterator[pa.RecordBatch], vectors: tuple[IdIndex, np.ndarray], lam: float, staged: storage.StagedWrite, part: int,
                     sources: tuple[str, str], gravity=None, logistic: bool = False) -> Iterator[pa.RecordBatch]:
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
            raise ValueError(f"{interactions}: the label of user {users[bad][0]}, item {items[bad][0]} is not finite ({labels[bad][0]})")
        at, found = index.lookup(items)
        if not found.all():
            raise ValueError(f"{item_embeddings}: no embedding for item {items[~found][0]} of the interactions")
        started = time.perf_counter()
        if logistic:  # implicit feedback's logistic loss: the rows are positives, every catalog item a negative
            solved, u = logistic_solve(users, matrix[at], matrix, lam)
        else:
            solved, u = ridge_solve(users, matrix[at], labels, lam, scale_by_rows=True, gravity=gravity)
        seconds += time.perf_counter() - started
        out = pa.Table.from_arrays([pa.array(solved, pa.int64()), matrix_to_list_column(u)], schema=USER_EMBEDDINGS)
        if writer is None:
            writer = staged.open_part(part, USER_EMBEDDINGS)
        writer.write_table(out)
        rows += out.num_rows
    if writer is not None:
        writer.close()
        yield pa.RecordBatch.from_pydict({"name": [staged.part_name(part)], "rows": [rows], "seconds": [seconds]},
                                         schema=pa.schema([("name", pa.string()), ("rows", pa.int64()), ("seconds", pa.float64())]))


class Solved(NamedTuple):
    """What a user update did: the users solved, and the seconds its tasks spent in the solves
    (summed over tasks: the kernel's share of the job, for the scaling benchmark)."""

    users: int
    solve_seconds: float


def run(spark, interactions: str, item_embeddings: str, out: str, lambda_u: float, dim: int | None = None, gravity: float = 0.0,
        loss: str = "square") -> Solved:
    """Solve every user of `interactions` against `item_embeddings`; write `out`.

    `gravity` alpha > 0 (implicit feedback) adds alpha V^T V over every catalog item to each user's
    system: the item embeddings are released data, so this costs no privacy. `loss` "logistic"
    solves implicit feedback's logistic loss instead (trainer.solve.logistic_solve): the rows are
    positives and every item of `item_embeddings` a negative, weighted as SSP-convex weighs them.
    """
    if loss not in LOSSES:
        raise ValueError(f"loss must be one of {LOSSES}, got {loss!r}")
    from pyspark import TaskContext

    if not np.isfinite(lambda_u) or lambda_u <= 0:
        raise ValueError(f"--lambda-u must be > 0, got {lambda_u}")
    items = validate_item_embeddings(storage.read_table(item_embeddings), dim=dim)
    d = len(items["embedding"][0].as_py()) if items.num_rows else dim
    v = list_column_to_matrix(items["embedding"], d, "item embedding")
    gram = gravity * (v.T @ v) if gravity > 0 else None
    try:  # PySpark prints the traceback of a broadcast file it cannot write (a full disk, a file-size limit), then raises PicklingError
        with contextlib.redirect_stderr(io.StringIO()):
            vectors = spark.sparkContext.broadcast((IdIndex(items["item_id"].to_numpy()), v))
    except pickle.PicklingError as exc:
        if isinstance(exc.__context__, OSError):
            raise exc.__context__ from None  # the disk's error, which the CLI reports in one line
        raise
    staged = storage.StagedWrite(out)
    try:
        with readable_tables(spark, interactions) as (rated_files,), task_errors_raised_here():
            rated = spark.read.parquet(*rated_files).select("user_id", "item_id", "label")
            by_user = rated.repartition(max(2, spark.sparkContext.defaultParallelism), "user_id").sortWithinPartitions("user_id", "item_id")
            written = by_user.mapInArrow(lambda batches: _solve_partition(batches, vectors.value, lambda_u, staged, TaskContext.get().partitionId(),
                                                                           (interactions, item_embeddings), gram, loss == "logistic"), WRITTEN_DDL).collect()
    except BaseException:
        staged.abort([])
        raise
    finally:
        vectors.unpersist()
    users = sum(row["rows"] for row in written)
    staged.commit([row["name"] for row in written], users)
    log(f"user update: user embeddings solved into {out} (d={d}, lambda_u={lambda_u:g})")  # not how many: the exact number of users stays private
    return Solved(users, sum(row["seconds"] for row in written))


def run_step(spark, root: str, step: int | None) -> int:
    """The user update of outer step `step` of the run at `root` (against step s-1's item
    embeddings), or the final one (`step` None: against the last step's); returns the user count.
    The solves' task seconds go into the manifest's `kernel_seconds`."""
    layout = Run(root)
    manifest = layout.prepared()
    config = manifest["config"]
    steps = config["outer_steps"]
    if step is not None and not (isinstance(step, int) and 1 <= step <= steps):
        raise ValueError(f"--step must be an outer step of the run, 1..{steps}, got {step}")
    require_steps(layout, manifest, steps + 1 if step is None else step)
    source = layout.item_embeddings(steps if step is None else step - 1)
    solved = run(spark, layout.centred, source, layout.user_embeddings(step), config["lambda_u"], config["dim"], config["gravity"],
                 config.get("loss", "square"))
    layout.record_seconds("final_user_update" if step is None else f"step-{step}/user_update", solved.solve_seconds, "kernel_seconds")
    return solved.users


def add_arguments(parser: argparse.ArgumentParser) -> None:
    stage = parser.add_argument_group("a stage of a training run (inputs and settings from RUN/manifest.json)")
    stage.add_argument("--run", help="run directory prepared by `ssp train --stage prepare`")
    stage.add_argument("--step", type=int, help="with --run: outer step s (its users against step s-1's item embeddings)")
    stage.add_argument("--final", action="store_true", help="with --run: the final user update (against the last step's item embeddings), for evaluation")
    tables = parser.add_argument_group("explicit tables")
    tables.add_argument("--interactions", help="interactions table (private)")
    tables.add_argument("--item-embeddings", help="item embeddings table (a release or public initialisation)")
    tables.add_argument("--out", help="user embeddings table to write (private)")
    tables.add_argument("--lambda-u", type=float, help=f"ridge of the user solve, lambda_u n I for a user with n ratings (trusted side: no privacy effect; default: {DEFAULT_LAMBDA_U})")
    tables.add_argument("--dim", type=int, help="expected embedding dimension (checked)")
    parser.add_argument("--master", help="Spark master URL for a job run outside spark-submit (default: local[*], every core of this machine, unless spark-submit sets one)")


def main(args: argparse.Namespace) -> int:
    from pipelines.spark import session

    explicit = {"--interactions": args.interactions, "--item-embeddings": args.item_embeddings, "--out": args.out, "--lambda-u": args.lambda_u, "--dim": args.dim}
    if args.run is not None:
        given = [flag for flag, value in explicit.items() if value is not None]
        if given:
            raise ValueError(f"--run takes the inputs and settings from the run's manifest; drop {', '.join(given)}")
        if (args.step is None) == (not args.final):
            raise ValueError("with --run give exactly one of --step S and --final")
        with existing_run_lock(args.run), session("ssp-user-update", args.master) as spark:
            run_step(spark, args.run, None if args.final else args.step)
        print(f"wrote the user embeddings of {args.run} ({'final' if args.final else f'step {args.step}'}; private)")
        return 0
    if args.step is not None or args.final:
        raise ValueError("--step and --final belong to --run RUN")
    missing = [flag for flag in ("--interactions", "--item-embeddings", "--out") if explicit[flag] is None]
    if missing:
        raise ValueError(f"give --run RUN with --step S or --final, or the tables: missing {', '.join(missing)}")
    lambda_u = DEFAULT_LAMBDA_U if args.lambda_u is None else args.lambda_u
    with session("ssp-user-update", args.master) as spark:
        run(spark, args.interactions, args.item_embeddings, args.out, lambda_u, args.dim)
    print(f"wrote the user embeddings to {args.out} (private)")
    return 0


if __name__ == "__main__":  # spark-submit pipelines/user_update.py FLAGS: the same command as `ssp user-update FLAGS`
    from pipelines import cli

    sys.exit(cli.main(["user-update", *sys.argv[1:]]))
