"""Each phase of a training run beside what this machine allows for it (`ssp bench scale`).

A phase's limit is the larger of two lower bounds, plus the fixed cost of the Spark jobs it starts:
- I/O: the bytes of the tables it reads and writes (the Parquet files, as stored), at the rate this
  process reads Parquet into Arrow (decoding included; writing is slower, so this bounds from below);
- arithmetic: its floating-point operations at this machine's GEMM rate (float64, every core). The
  user update: each user's Gram matrix and solve (2 n d^2 + d^3 / 3 per user of n ratings, d with the
  bias coordinate); the statistics: one packed outer product and one b_j update per row; the item
  update: A_j v_j and its gradient for every covered item in every epoch (6 d^2);
- jobs: the Spark jobs it started (`pipelines.engines.spark.jobs_started`) at the measured cost of
  one small Python job.
The machine's rates are measured in the same process as the report, so the ratios hold on a noisy
machine (`machine`). Prepare and the evaluation do no arithmetic to speak of: their bound is I/O.
"""

from __future__ import annotations

import os
import time

import numpy as np
import pyarrow.parquet as pq

from pipelines.training.run_dir import Run
from schemas import storage

PHASES = ("prepare", "user_update", "stats", "item_update", "final_user_update", "evaluation")


def _bytes(*paths: str) -> int:
    """The stored bytes of files and folders (0 for a path that does not exist)."""
    total = 0
    for path in paths:
        if os.path.isfile(path):
            total += os.path.getsize(path)
        for folder, _, names in os.walk(path):
            total += sum(os.path.getsize(os.path.join(folder, name)) for name in names)
    return total


def work(run: Run, data: str, steps: int, epochs: int) -> dict[str, dict[str, float]]:
    """{phase: {"bytes", "flops"}} of a finished run (outer steps summed), from its tables."""
    rows = storage.row_count(run.centred)
    stats_rows = storage.row_count(run.stats_rows)
    users = storage.row_count(run.user_embeddings(None))
    items = storage.row_count(run.stats_items)
    d = (
        len(next(storage.iter_batches(run.user_embeddings(None), ["embedding"], batch_size=1)).column(0)[0]) + 1
    )  # with the bias coordinate
    solve = 2 * rows * d * d + users * d**3 / 3
    stats_tables = [run.stats(s) for s in range(1, steps + 1)]
    user_steps = [run.user_embeddings(s) for s in range(1, steps + 1)]
    return {
        "prepare": {
            "bytes": _bytes(
                os.path.join(data, "interactions.parquet"), run.split, run.centred, run.stats_rows, run.counts
            ),
            "flops": 0.0,
        },
        "user_update": {"bytes": steps * _bytes(run.centred) + _bytes(*user_steps), "flops": steps * solve},
        "stats": {
            "bytes": steps * _bytes(run.stats_rows) + _bytes(*user_steps, *stats_tables),
            "flops": steps * stats_rows * (d * (d + 1) + 2 * d),
        },
        "item_update": {"bytes": _bytes(*stats_tables), "flops": steps * epochs * items * 6 * d * d},
        "final_user_update": {"bytes": _bytes(run.centred, run.user_embeddings(None)), "flops": solve},
        "evaluation": {
            "bytes": _bytes(run.split, run.user_embeddings(None)) - _bytes(os.path.join(run.split, "train.parquet")),
            "flops": 0.0,
        },
    }


def machine(spark, parquet: str) -> dict[str, float]:
    """This machine's rates, measured now: GEMM flop/s (float64, 2048 x 2048, the best of 3), the
    bytes per second of reading `parquet` into Arrow (the best of 3), and the seconds of one small Spark job through
    Python workers (the fastest of 5: a lower bound, as the others)."""
    a = np.random.default_rng(0).standard_normal((2048, 2048))
    gemm = []
    for _ in range(3):
        started = time.perf_counter()
        a @ a
        gemm.append(time.perf_counter() - started)
    reads = []
    for _ in range(3):  # the first may wait on the disk: the runs read from the page cache
        started = time.perf_counter()
        pq.read_table(parquet)
        reads.append(time.perf_counter() - started)
    jobs = []
    for _ in range(5):
        started = time.perf_counter()
        spark.range(0, 2, 1, 2).mapInArrow(lambda batches: batches, "id long").collect()
        jobs.append(time.perf_counter() - started)
    return {
        "gemm_flops": 2 * 2048**3 / min(gemm),
        "read_bytes_per_s": _bytes(parquet) / min(reads),
        "job_seconds": min(jobs),
    }


def limits(cell: dict, rates: dict[str, float]) -> dict[str, float]:
    """{phase: the seconds this machine needs at least} of a cell with "work" and "spark_jobs"."""
    out = {}
    for phase in PHASES:
        done = cell["work"][phase]
        out[phase] = (
            max(done["bytes"] / rates["read_bytes_per_s"], done["flops"] / rates["gemm_flops"])
            + cell["spark_jobs"].get(phase, 0) * rates["job_seconds"]
        )
    return out


def rows(cell: dict, rates: dict[str, float]) -> list[list[str]]:
    """The report's rows of one cell: phase, wall seconds, bytes, flops, Spark jobs, limit, wall over limit."""
    bound = limits(cell, rates)
    table = []
    for phase in PHASES:
        done, wall = cell["work"][phase], cell["seconds"][phase]
        table.append(
            [
                phase,
                f"{wall:.1f}",
                f"{done['bytes'] / 1e6:,.0f}",
                f"{done['flops'] / 1e9:,.1f}",
                str(cell["spark_jobs"].get(phase, 0)),
                f"{bound[phase]:.1f}",
                f"{wall / bound[phase]:.1f}x" if bound[phase] > 0 else "-",
            ]
        )
    wall, bound_total = sum(cell["seconds"][p] for p in PHASES), sum(bound.values())
    table.append(
        [
            "whole run",
            f"{wall:.1f}",
            "",
            "",
            str(sum(cell["spark_jobs"].values())),
            f"{bound_total:.1f}",
            f"{wall / bound_total:.1f}x",
        ]
    )
    return table
