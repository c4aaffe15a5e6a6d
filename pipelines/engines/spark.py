"""Spark sessions for the jobs: local by default, the cluster's when launched by spark-submit.

The Python workers must import this project: locally the session puts the repository on their
PYTHONPATH; on a cluster it ships as a zip of its packages, in --py-files (`ssp spark-package`) or
added by the driver itself (`ship_project`). Arrow batches are large so that each numpy call works on many rows, and
BLAS runs
one thread per worker (Spark already runs one worker per core).

Tables on gs://: a job whose Spark reads input tables opens them with `readable_tables`. Spark reads a gs:// table
directly when its Hadoop has a gs:// filesystem: the Cloud Storage connector, which Dataproc
clusters carry. Without one (pyspark from pip, as here and in the tests), a local-mode session
reads a copy downloaded to a temporary local folder for the duration of the job; a cluster without
the connector is refused with an error that says to install it, since its executors cannot see the
driver's disk. Tables written by the jobs' Python tasks (schemas.storage.StagedWrite, through
gcsfs) and the user embeddings they read go through schemas.storage on any filesystem; in local
mode the tasks get the driver's storage settings (emulator host, credentials) even when the session
was started before they were set.

Privacy: sessions only; the jobs hold the privacy logic. Executors read private rows: run them in
the trusted zone (docs/operations.md).
"""

from __future__ import annotations

import atexit
import logging
import os
import shutil
import sys
import tempfile
import threading
from collections.abc import Iterator
from contextlib import ExitStack, contextmanager
from pathlib import Path

import pyarrow as pa

from pipelines.base.interrupts import kept_interrupts
from schemas import storage
from schemas.errors import UserError

ROOT = str(Path(__file__).resolve().parents[2])
ARROW_BATCH_ROWS = 100_000
LOG_CONFIG = str(
    Path(__file__).resolve().parent / "log4j2.properties"
)  # failed tasks are reported once, by the driver's error
STORAGE_ENV_PREFIXES = (
    "STORAGE_EMULATOR_HOST",
    "FSSPEC_",
    "GCSFS_",
    "GOOGLE_",
)  # how gcsfs finds its endpoint and credentials


@contextmanager
def session(app: str, master: str | None = None):
    """A SparkSession for the duration of a job (stopped afterwards). A session that is already
    active (a scheduler's, a test suite's) is used as it is and left running.

    Under spark-submit (a launcher started the JVM: PYSPARK_GATEWAY_PORT) the driver attaches to
    that JVM first and reads its conf, so the master and every setting the user or the cluster gave
    stay; the project then sets only what nobody set (`session_settings`), leaves the executors'
    Python to the cluster (spark.pyspark.python), and ships the project to the executors unless
    --py-files already does (`ship_project`)."""
    from pyspark import SparkConf, SparkContext
    from pyspark.sql import SparkSession

    active = SparkSession.getActiveSession()
    if active is not None:
        yield active
        return

    launched = launched_by_spark_submit()
    if launched:
        SparkContext._ensure_initialized()  # attach to the launcher's JVM: its conf holds what was submitted
    else:  # this process starts the JVM: its Python workers run this interpreter and import this checkout
        os.environ["PYTHONPATH"] = os.pathsep.join(p for p in (ROOT, os.environ.get("PYTHONPATH")) if p)
        os.environ.setdefault("PYSPARK_PYTHON", sys.executable)
    os.environ.setdefault("OPENBLAS_NUM_THREADS", "1")
    builder = SparkSession.builder.appName(app)
    for key, value in session_settings(SparkConf(), master).items():
        builder = builder.master(value) if key == "spark.master" else builder.config(key, value)
    if not any(isinstance(item, _Py4jRootRecords) for item in logging.getLogger().filters):
        logging.getLogger().addFilter(_Py4jRootRecords())
    with _jvm_notices_dropped():
        spark = builder.getOrCreate()
    if not is_local(spark):
        ship_project(spark)
    # PySpark's Ctrl-C handler cancels the jobs through the gateway connection the interrupted call
    # is still using (re-entrant calls: pages of Python and Java traces). A job of ours is simply
    # interrupted once its session runs: the command stops and its JVM ends with it (stdin closes).
    # py4j's finalizers can swallow that KeyboardInterrupt: kept_interrupts raises it again.
    with kept_interrupts():
        spark.sparkContext.setLogLevel("WARN")
        interrupted = False
        try:
            yield spark
        except KeyboardInterrupt:
            interrupted = True
            raise
        finally:
            if not interrupted:  # stopping would talk to a gateway left mid-call
                spark.stop()


class _Py4jRootRecords(logging.Filter):
    """py4j logs on the root logger too ("KeyboardInterrupt while sending command.", "Exception
    while sending command.", with their tracebacks) when Ctrl-C lands inside a gateway call; the
    command's own line says what happened. Shown with -v."""

    def filter(self, record: logging.LogRecord) -> bool:
        return f"{os.sep}py4j{os.sep}" not in record.pathname or logging.getLogger("py4j").isEnabledFor(logging.DEBUG)


JVM_NOTICES = (
    b"WARNING: Using incubator modules",
)  # Spark 4's launcher always adds jdk.incubator.vector; the JDK says so on every start


@contextmanager
def _jvm_notices_dropped():
    """Start the JVM inside this block with a pipe for its stderr: a thread forwards every line it
    writes, for its whole life, to this process's stderr, except the JDK's notices above (nothing a
    user can act on). This process's own stderr is restored when the block ends."""
    sys.stderr.flush()
    read_end, write_end = os.pipe()
    saved, target = os.dup(2), os.dup(2)  # `target` stays open for the forwarder
    os.dup2(write_end, 2)
    os.close(write_end)

    def forward():
        with os.fdopen(read_end, "rb") as pipe:
            for line in iter(pipe.readline, b""):
                if not line.startswith(JVM_NOTICES):
                    os.write(target, line)

    threading.Thread(target=forward, name="jvm-stderr", daemon=True).start()
    try:
        yield
    finally:
        sys.stderr.flush()
        os.dup2(saved, 2)
        os.close(saved)


@contextmanager
def session_on_demand(app: str, master: str | None = None):
    """A function that opens `session(app, master)` the first time it is called, for a command that
    may not need Spark at all (a small log is prepared in this process): no JVM is started for it.
    The session, if opened, is stopped at the end of the block."""
    with ExitStack() as stack:
        opened = []

        def get():
            if not opened:
                opened.append(stack.enter_context(session(app, master)))
            return opened[0]

        yield get


def session_settings(conf, master: str | None) -> dict[str, str]:
    """What the session sets: the Arrow batch size the jobs need, always; the master, memory, shuffle
    partitions, UI, adaptive execution and console log only when this process starts the JVM (no
    spark-submit: `conf` has no master) or a master is given. Under spark-submit the cluster's and the
    job's own settings stay as they are."""
    settings = {"spark.sql.execution.arrow.maxRecordsPerBatch": str(ARROW_BATCH_ROWS)}
    if master or not conf.contains("spark.master"):
        settings.update(
            {
                "spark.master": master or "local[*]",
                "spark.driver.extraJavaOptions": f"-Dlog4j2.configurationFile={LOG_CONFIG}",
                "spark.driver.memory": os.environ.get(
                    "SSP_SPARK_DRIVER_MEMORY", "3g"
                ),  # local mode: the executor's heap too
                "spark.sql.shuffle.partitions": "8",
                "spark.ui.enabled": "false",
                "spark.ui.showConsoleProgress": "false",
                # as the DAG's job settings (infra/dags/retrain/dataproc-job.yaml)
                "spark.sql.adaptive.enabled": "false",
            }
        )
    return settings


def launched_by_spark_submit() -> bool:
    """Whether spark-submit (or another launcher) started this driver's JVM and handed it over."""
    return "PYSPARK_GATEWAY_PORT" in os.environ


PROJECT_PACKAGES = ("schemas", "privacy", "trainer", "pipelines")  # what the executors' tasks import of this project


def ship_project(spark) -> None:
    """Put this project on a cluster's executors when nothing else does: a driver that imports it
    from a checkout (not from a --py-files zip) adds a zip of its packages with addPyFile, so that
    `spark-submit pipelines/stats.py` from the repository root runs on any cluster whose nodes have
    the dependencies. A project already shipped (its modules imported from a zip) is left as it is."""
    import pipelines

    if not os.path.isdir(os.path.dirname(pipelines.__file__)):
        return
    folder = tempfile.mkdtemp(prefix="ssp-py-files-")
    atexit.register(shutil.rmtree, folder, True)  # served to the executors for the session's life
    archive = project_zip(os.path.join(folder, "ssp_project.zip"))
    spark.sparkContext.addPyFile(archive)


def project_zip(path: str) -> str:
    """A zip of this checkout's Python packages (PROJECT_PACKAGES, .py files only) at `path`:
    importable from sys.path, as a --py-files entry."""
    import zipfile

    with zipfile.ZipFile(path, "w", zipfile.ZIP_DEFLATED) as archive:
        for package in PROJECT_PACKAGES:
            for folder, _, names in sorted(os.walk(os.path.join(ROOT, package))):
                for name in sorted(names):
                    if name.endswith((".py", ".properties")):
                        full = os.path.join(folder, name)
                        archive.write(full, os.path.relpath(full, ROOT))
    return path


def jobs_started() -> int:
    """How many Spark jobs this process's active session has started (0 without one): a stage's
    count of jobs, each with its fixed cost of scheduling and Python workers, is the difference."""
    from pyspark.sql import SparkSession

    active = SparkSession.getActiveSession()
    if active is None:
        return 0
    return max(active.sparkContext.statusTracker().getJobIdsForGroup(None), default=-1) + 1


def is_local(spark) -> bool:
    """Whether the session runs its tasks on this machine (local master)."""
    return spark.sparkContext.master.startswith("local")


def has_filesystem(spark, scheme: str) -> bool:
    """Whether this Spark's Hadoop has a filesystem for URLs `scheme://` (gs: the GCS connector)."""
    from py4j.protocol import Py4JJavaError

    context = spark.sparkContext
    try:
        context._jvm.org.apache.hadoop.fs.FileSystem.getFileSystemClass(scheme, context._jsc.hadoopConfiguration())
    except Py4JJavaError:
        return False
    return True


def forward_storage_settings(spark) -> None:
    """Give a local session's Python tasks the driver's current storage settings (the environment
    variables gcsfs reads): a JVM started earlier passes its own, older environment to its workers."""
    if not is_local(spark):
        return
    environment = spark.sparkContext.environment
    for key in [key for key in environment if key.startswith(STORAGE_ENV_PREFIXES) and key not in os.environ]:
        del environment[key]
    environment.update({key: value for key, value in os.environ.items() if key.startswith(STORAGE_ENV_PREFIXES)})


@contextmanager
def readable_tables(spark, *paths: str) -> Iterator[list[list[str]]]:
    """The data files of each committed table at `paths`, as paths this session can read, for the
    duration of the block (the job's reads must happen inside it). See the module docstring."""
    forward_storage_settings(spark)
    with tempfile.TemporaryDirectory(prefix="ssp-spark-") as staging:
        files = []
        for index, path in enumerate(paths):
            fs, _ = storage.filesystem(path)
            scheme = path.split("://", 1)[0]
            if storage.is_local(fs) or has_filesystem(spark, scheme):
                files.append(storage.table_files(path))
            elif is_local(spark):
                files.append(storage.download_table(path, os.path.join(staging, str(index))))
            else:
                raise UserError(
                    f"{path}: this Spark cluster has no {scheme}:// filesystem; install the Cloud Storage connector "
                    "(Dataproc images carry it) or run the job with a local master"
                )
        yield files


def per_file(spark, files: list[str], task, ddl: str) -> pa.Table:
    """A job of one Python task per file: `task(index, file)` (record batches of `ddl`) reads the
    file itself (schemas.storage: local paths and gs:// alike), with no shuffle of its rows;
    returns what the tasks yielded, as one Arrow table."""
    if not files:
        return spark.createDataFrame([], ddl).toArrow()
    forward_storage_settings(spark)

    def run(batches):
        for batch in batches:
            for index, file in zip(batch.column("index").to_pylist(), batch.column("file").to_pylist(), strict=True):
                yield from task(index, file)

    return (
        spark.createDataFrame(list(enumerate(files)), "index int, file string")
        .repartition(len(files))
        .mapInArrow(run, ddl)
        .toArrow()
    )


@contextmanager
def task_errors_raised_here() -> Iterator[None]:
    """A UserError raised in a Python task of the block's jobs (a row the job refuses) is raised
    here as a UserError with the task's message, not wrapped in Spark's errors."""
    from pipelines.base.failures import task_refusal

    try:
        yield
    except Exception as exc:
        message = task_refusal(exc)
        if message is None:
            raise
        raise UserError(message) from None
