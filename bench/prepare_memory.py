"""Peak memory of the prepare stage (split, DP counts, DP mean, centred rows) as the log grows.

Runs `pipelines.training.prepare.prepare` on each --data set in a fresh child interpreter and samples the
child's process tree (bench.child.run_tree_measured): the driver (the child), Spark's JVM (driver
and executor in local mode) and Spark's Python workers. With `--engine spark` the rows stay in
Spark (pipelines.engines.prepare_spark): the driver keeps per-item aggregates and the catalog, so its peak
is bounded by the catalog, the JVM's by its configured heap (spilling to disk beyond it) and the
workers' by a batch of rows. `--engine local` reads the log into the driver, for comparison.

    ssp synth --like movielens --users 61000  --out /data/ml-1e7    # 10^7 ratings
    ssp synth --like movielens --users 610000 --out /data/ml-1e8    # 10^8 ratings
    python -m bench.prepare_memory --data /data/ml-1e7 /data/ml-1e8 --out bench/results/prepare-memory

Each (engine, data) cell is appended to OUT/results.json as it finishes (a rerun skips finished
cells); OUT/report.md is the table of every cell. The run folders are temporary (--work).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import tempfile

from bench.child import run_tree_measured

_CHILD = """
import time
from pipelines.training import prepare, run_dir, settings
config = settings.TrainConfig.create(**json.loads(sys.argv[1])["config"])
started = time.perf_counter()
if json.loads(sys.argv[1])["engine"] == "spark":
    from pipelines.engines.spark import session
    with session("bench-prepare-memory") as spark:
        manifest = prepare.prepare(config, progress=False, spark=spark, local_rows=0)
else:
    manifest = prepare.prepare(config, progress=False)
result = {
    "prepare_seconds": time.perf_counter() - started,
    "items": len(__import__("schemas.storage", fromlist=["x"]).read_table(run_dir.Run(config.out).counts)),
}
"""


def measure(data: str, engine: str, work: str, epsilon: float, driver_memory: str | None) -> dict:
    """Prepare a run on `data` in a child; its wall time and the peaks of its process tree."""
    from pipelines.data.datasets import open_dataset

    run = os.path.join(work, "run")
    shutil.rmtree(run, ignore_errors=True)
    config = {"out": run, "data": data, "epsilon": epsilon, "protocol": "rmse"}
    try:
        if driver_memory:
            os.environ["SSP_SPARK_DRIVER_MEMORY"] = (
                driver_memory  # the child's local Spark heap (pipelines.engines.spark)
            )
        report = run_tree_measured(_CHILD, {"config": config, "engine": engine})
    finally:
        shutil.rmtree(run, ignore_errors=True)
    manifest = open_dataset(data).manifest
    return {
        "engine": engine,
        "data": data,
        "spark_driver_memory": (driver_memory or "3g") if engine == "spark" else None,
        "ratings": manifest["ratings"],
        "users": manifest["users"],
        **report,
    }


def report(cells: list[dict]) -> str:
    lines = [
        "| engine | Spark heap | ratings | users | items | prepare (s) | driver peak (MiB) | JVM peak (MiB) | largest "
        "Python worker (MiB) | Python workers together (MiB) |",
        "| --- | --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |",
    ]
    for c in sorted(cells, key=lambda c: (c["engine"], c.get("spark_driver_memory") or "", c["ratings"])):
        lines.append(
            f"| {c['engine']} | {c.get('spark_driver_memory') or '-'} | {c['ratings']:,} | {c['users']:,} | "
            f"{c['items']:,} | {c['prepare_seconds']:.0f} | {c['driver_peak_mib']:.0f} | "
            f"{c['jvm_peak_mib']:.0f} | {c['worker_peak_mib']:.0f} | {c['workers_peak_total_mib']:.0f} |"
        )
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.prepare_memory", description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--data", nargs="+", required=True, help="data set folders (ssp synth / ssp ingest), smallest first"
    )
    parser.add_argument(
        "--engine", nargs="+", choices=("spark", "local"), default=["spark"], help="engines to measure (default: spark)"
    )
    parser.add_argument("--out", required=True, help="folder of results.json and report.md (finished cells are kept)")
    parser.add_argument("--work", help="scratch folder for the run directories (default: a temporary folder)")
    parser.add_argument("--epsilon", type=float, default=5.0, help="the run's epsilon (default %(default)s)")
    parser.add_argument(
        "--spark-driver-memory",
        help="heap of the local Spark JVM (driver and executor), e.g. 1g (default: pipelines.engines.spark's, 3g): "
        "the JVM's memory is this setting, not the log's size (Spark spills to disk)",
    )
    args = parser.parse_args(argv)
    os.makedirs(args.out, exist_ok=True)
    path = os.path.join(args.out, "results.json")
    cells = json.load(open(path)) if os.path.exists(path) else []
    with tempfile.TemporaryDirectory(prefix="prepare-memory-", dir=args.work) as work:
        for engine in args.engine:
            for data in args.data:
                heap = (args.spark_driver_memory or "3g") if engine == "spark" else None
                if any(
                    c["engine"] == engine and c["data"] == data and c.get("spark_driver_memory") == heap for c in cells
                ):
                    continue
                print(f"prepare_memory: {engine} on {data} ...", file=sys.stderr, flush=True)
                try:
                    cells.append(measure(data, engine, work, args.epsilon, args.spark_driver_memory))
                except RuntimeError as exc:
                    print(f"prepare_memory: {engine} on {data} failed: {exc}", file=sys.stderr)
                    return 2
                with open(path, "w") as handle:
                    json.dump(cells, handle, indent=1)
                with open(os.path.join(args.out, "report.md"), "w") as handle:
                    handle.write(report(cells))
                print(report(cells), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
