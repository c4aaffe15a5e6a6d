"""`spark-submit pipelines/stats.py FLAGS`: the stats job as a Spark application (the flags of
`ssp stats`; `--run RUN --step S` for a prepared run's own release). A thin script: the job is
pipelines.engines.spark_stats. Run it from the repository root, or from anywhere with the project's
zip in `--py-files` (`ssp spark-package`); what a cluster's nodes need: docs/operations.md.

Privacy: that of pipelines.releases.stats_job (every release goes through the run's ledger).
"""

from __future__ import annotations

import os
import sys

if __package__ in (None, ""):  # run as a script by spark-submit: make the project importable
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import argparse  # noqa: E402

from pipelines.engines.engine import engine_of  # noqa: E402
from pipelines.releases import stats_job  # noqa: E402
from pipelines.training.stats_stage import stats_job_of_run  # noqa: E402


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="stats.py", description="The AM-SSP stats job on Spark: noised A_j, b_j for every catalog item."
    )
    stats_job.add_arguments(parser)
    parser.add_argument("--master", help="Spark master (default: the one spark-submit gives, else local[*])")
    args = parser.parse_args(argv)

    def compute() -> dict | None:
        job = stats_job.StatsJob.from_args(args, stats_job_of_run)
        if job is None:  # a run whose statistics cover no item: nothing to release
            return None
        with engine_of("spark", app="ssp-stats", master=args.master) as engine:
            return engine.release_stats(job)

    return stats_job.run_and_report(compute)


if __name__ == "__main__":
    sys.exit(main())
