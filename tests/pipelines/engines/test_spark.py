"""Spark and storage: gs:// tables staged for a Spark without a GCS connector; storage settings reach the Python
tasks."""

import os
import uuid

import pyarrow as pa

from pipelines.engines.spark import (
    ARROW_BATCH_ROWS,
    forward_storage_settings,
    has_filesystem,
    readable_tables,
    session_settings,
)
from schemas import storage


def test_python_tasks_get_storage_settings_set_after_the_session_started(spark, monkeypatch):
    def seen_by_a_task():
        return spark.sparkContext.parallelize([0], 1).map(lambda _: os.environ.get("FSSPEC_GS_SSP_PROBE")).collect()[0]

    value = uuid.uuid4().hex
    monkeypatch.setenv("FSSPEC_GS_SSP_PROBE", value)
    assert seen_by_a_task() is None  # the JVM and its Python workers predate the variable
    forward_storage_settings(spark)
    assert seen_by_a_task() == value
    monkeypatch.delenv("FSSPEC_GS_SSP_PROBE")
    forward_storage_settings(spark)
    assert seen_by_a_task() is None


def test_gs_table_is_read_from_a_local_copy_without_a_gcs_connector(spark, gcs_path):
    path = f"{gcs_path}/t.parquet"
    storage.write_table(pa.table({"a": list(range(10))}), path, rows_per_file=4)
    assert has_filesystem(spark, "file") and not has_filesystem(spark, "gs")  # pyspark from pip: no connector
    with readable_tables(spark, path, path) as (files, again):
        assert len(files) == 3 and all(os.path.isfile(f) for f in files) and set(files).isdisjoint(again)
        assert sorted(row["a"] for row in spark.read.parquet(*files).collect()) == list(range(10))
    assert not any(os.path.exists(f) for f in files)  # the copy lives for the block only


def test_under_spark_submit_the_session_keeps_the_clusters_settings():
    """spark-submit puts the master in the conf: then only the Arrow batch size (which the jobs
    need) is set, and the cluster's UI, shuffle partitions and adaptive execution stay its own."""
    from pyspark import SparkConf

    submitted = SparkConf(loadDefaults=False).set("spark.master", "yarn")
    assert session_settings(submitted, None) == {"spark.sql.execution.arrow.maxRecordsPerBatch": str(ARROW_BATCH_ROWS)}
    local = session_settings(SparkConf(loadDefaults=False), None)
    assert (
        local["spark.master"] == "local[*]"
        and local["spark.ui.enabled"] == "false"
        and local["spark.sql.shuffle.partitions"] == "8"
    )
    assert (
        session_settings(submitted, "local[2]")["spark.master"] == "local[2]"
    )  # a master given on the command line: a local session


def test_a_session_on_demand_is_opened_once_when_first_asked_for_and_never_otherwise(monkeypatch):
    from contextlib import contextmanager

    from pipelines.engines import spark as spark_module

    events = []

    @contextmanager
    def recording_session(app, master=None):
        events.append(("open", app, master))
        yield f"session of {app}"
        events.append(("stop", app))

    monkeypatch.setattr(spark_module, "session", recording_session)
    with spark_module.session_on_demand("unused"):
        pass
    assert events == []  # a command that never asks starts no JVM
    with spark_module.session_on_demand("used", "local[1]") as get:
        assert get() == get() == "session of used"
        assert events == [("open", "used", "local[1]")]
    assert events == [("open", "used", "local[1]"), ("stop", "used")]
