"""Spark sessions for the jobs: local by default, the cluster's when launched by spark-submit.

The Python workers must import this project: locally the session puts the repository on their
PYTHONPATH; on a cluster the project ships as its wheel, under a .zip name in --py-files
(infra/build.sh). Arrow batches are large so that each numpy call works on many rows, and BLAS runs
one thread per worker (Spark already runs one worker per core).
"""

from __future__ import annotations

import os
import sys
from contextlib import contextmanager
from pathlib import Path

ROOT = str(Path(__file__).resolve().parent.parent)
ARROW_BATCH_ROWS = 100_000


@contextmanager
def session(app: str, master: str | None = None):
    """A SparkSession for the duration of a job (stopped afterwards). A session that is already
    active (a scheduler's, a test suite's) is used as it is and left running."""
    from pyspark import SparkConf
    from pyspark.sql import SparkSession

    active = SparkSession.getActiveSession()
    if active is not None:
        yield active
        return

    os.environ["PYTHONPATH"] = os.pathsep.join(p for p in (ROOT, os.environ.get("PYTHONPATH")) if p)
    os.environ.setdefault("OPENBLAS_NUM_THREADS", "1")
    os.environ.setdefault("PYSPARK_PYTHON", sys.executable)
    conf = SparkConf()
    builder = SparkSession.builder.appName(app)
    if master or not conf.contains("spark.master"):
        builder = builder.master(master or "local[*]")
    spark = (
        builder.config("spark.sql.execution.arrow.maxRecordsPerBatch", str(ARROW_BATCH_ROWS))
        .config("spark.driver.memory", os.environ.get("SSP_SPARK_DRIVER_MEMORY", "3g"))  # local mode: the executor's heap too
        .config("spark.sql.shuffle.partitions", "8")
        .config("spark.ui.enabled", "false")
        .config("spark.ui.showConsoleProgress", "false")
        .config("spark.sql.adaptive.enabled", "false")  # keep the partitioning the job asks for
        .getOrCreate()
    )
    spark.sparkContext.setLogLevel("WARN")
    try:
        yield spark
    finally:
        spark.stop()
