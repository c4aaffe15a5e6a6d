"""Where a stand-alone command's row work runs: `--engine local|spark|beam` of `ssp split` and `ssp counts`.

`spark` (the default, as for `ssp train`: a local session, or the cluster's under spark-submit)
and `beam` (DirectRunner, or any runner) keep the rows on their workers (pipelines.engines.prepare_spark,
pipelines.engines.prepare_beam); `local` reads the table into this process (small tables, no JVM). All
three write the same tables and make the same releases for the same seed. `ssp train` runs its prepare stage on the run's --engine.
"""

from __future__ import annotations

import argparse
from contextlib import contextmanager

ENGINES = ("local", "spark", "beam")


def add_engine_argument(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--engine", choices=ENGINES, default="spark",
                        help="where the rows are read: spark (the default) or beam, on their workers, for logs of any size; or local, this process "
                             "(small tables, no JVM); the same output on each")


@contextmanager
def engine_of(name: str):
    """The engine object for `name` (None for local) for the duration of the block."""
    if name == "spark":
        from pipelines.engines.prepare_spark import SparkEngine
        from pipelines.engines.spark import session

        with session("ssp-prepare") as spark:
            yield SparkEngine(spark)
    elif name == "beam":
        from pipelines.engines.prepare_beam import BeamEngine

        yield BeamEngine()
    else:
        yield None
