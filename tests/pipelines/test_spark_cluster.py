"""The Spark entry scripts on a real multi-process cluster: a standalone master and two 1-core workers
on 127.0.0.1, and the commands docs/operations.md gives, with the master a cluster user passes to
spark-submit (once, to spark-submit). The jobs must run on the cluster's executors, not in a
local-mode driver, and release the bits a local-mode run releases: the user update with the nodes'
Python named by spark.pyspark.python; the stats job from a folder holding only its entry script,
with what `ssp spark-package` ships (the project zip, a slim executor environment), in which an
executor killed by its pid while a task of the release runs is retried with the same bits and one
charge (one application for both: each costs a driver and two executors, each unpacking the
environment)."""

from __future__ import annotations

import importlib.metadata
import json
import os
import shutil
import signal
import subprocess
import sys
import textwrap
import time
from concurrent.futures import Future, ThreadPoolExecutor, wait
from contextlib import ExitStack, suppress
from pathlib import Path

import pyarrow.parquet as pq
import pytest

from pipelines.engines import shipping
from pipelines.engines.prepare_spark import SparkEngine
from pipelines.releases.stats_core import declared_item_shards
from pipelines.training import user_stage
from pipelines.training.prepare import prepare, run_directory
from pipelines.training.run_dir import Run
from pipelines.training.settings import TrainConfig
from pipelines.training.stats_stage import release_stats
from privacy.ledger import Ledger
from privacy.lifetime_budget import BudgetAccount
from tests.spark_cluster import ROOT, standalone_cluster

pytestmark = pytest.mark.cluster  # a standalone cluster, and what is shipped to its nodes

VENV_PYTHON = sys.executable  # the nodes' Python with the locked dependencies (Dataproc: /opt/ssp/venv/bin/python)
NODE_CONF = {"spark.pyspark.python": VENV_PYTHON}


@pytest.fixture(scope="module")
def background():
    """Two threads that start the cluster and build the shipment while the runs are made (the cluster's
    start is mostly waiting on its JVMs, the shipment's on gzip): neither waits for the other."""
    with ThreadPoolExecutor(max_workers=2, thread_name_prefix="cluster-setup") as pool:
        yield pool


@pytest.fixture(scope="module")
def cluster_started(tmp_path_factory, background) -> Future:
    """The standalone cluster, starting in the background; stopped at the module's end."""
    stack = ExitStack()
    started = background.submit(stack.enter_context, standalone_cluster(tmp_path_factory.mktemp("spark-cluster")))
    yield started
    wait([started])
    stack.close()


@pytest.fixture(scope="module")
def shipment_built(tmp_path_factory, background) -> Future:
    """`ssp spark-package`'s shipment, building in the background."""
    return background.submit(shipping.build, tmp_path_factory.mktemp("dist"))


@pytest.fixture(scope="module")
def cluster(cluster_started, shipment_built, runs):
    """The started cluster, once the runs are made (the shipment goes on building)."""
    return cluster_started.result()


@pytest.fixture(scope="module")
def shipment(shipment_built) -> shipping.Shipment:
    return shipment_built.result()


@pytest.fixture(scope="module")
def runs(small_data, spark, tmp_path_factory, module_budget_account_registry):
    """A run prepared on a local-mode Spark (`prepared`: its stats rows a row group per item shard,
    as a large log's are), its step-1 user embeddings (`users`: a copy of the run then), and that
    copy's step-1 statistics released in local mode (`local`)."""
    folder = tmp_path_factory.mktemp("cluster-runs")
    config = TrainConfig.create(data=small_data, out=str(folder / "prepared"), epsilon=8.0, outer_steps=2)
    with run_directory(config):
        prepare(config, progress=False, engine=SparkEngine(spark), local_rows=0)
    assert declared_item_shards(Run(str(folder / "prepared")).stats_rows) == config.shards
    shutil.copytree(folder / "prepared", folder / "local")
    user_stage.run_step(SparkEngine(spark), str(folder / "local"), 1)
    shutil.copytree(folder / "local", folder / "users")
    release_stats(Run(str(folder / "local")), 1, SparkEngine(spark))
    return {name: folder / name for name in ("prepared", "users", "local")}


def copy_run(source: Path, target: Path) -> str:
    shutil.copytree(source, target)
    return str(target)


def table_rows(path: str) -> list[dict]:
    return sorted(pq.read_table(path).to_pylist(), key=lambda row: tuple(row.values())[0])


def released(root: str) -> list[tuple]:
    return [
        (row["release"], row["name"], row["noise_multiplier"])
        for row in Ledger.open(str(Path(root) / "ledger.parquet")).rows
    ]


def assert_ran_on_both_workers(cluster, app: str, log: str) -> None:
    workers = {worker for worker, _ in cluster.executors_of(app)}
    assert workers == {worker["id"] for worker in cluster.state()["workers"]}, cluster.executors_of(app)
    assert "Starting executor ID driver on host" not in log  # no local-mode executor inside the driver


def assert_same_statistics(run: str, reference: str) -> None:
    stats, local = Path(Run(run).stats(1)), Path(Run(reference).stats(1))
    assert sorted(os.listdir(stats)) == sorted(os.listdir(local))
    for table in (name for name in os.listdir(local) if name.endswith(".parquet")):
        assert table_rows(str(stats / table)) == table_rows(str(local / table)), table
    assert released(run) == released(reference)  # one release of the step's statistics, as in local mode


@pytest.mark.cluster
def test_the_spark_jobs_run_on_a_standalone_cluster_with_the_local_bits(cluster, shipment_built, runs, tmp_path):
    """One test for the two applications, so that one test worker starts the cluster once (the
    suite's workers steal tests from each other): the documented user update (while the shipment
    is still building), and the shipped stats line with an executor killed during its release."""
    user_update_runs_on_the_cluster(cluster, runs, tmp_path / "user-update")
    the_shipped_line_runs_the_stats_job_from_a_folder_holding_only_its_script_through_a_killed_executor(
        cluster, shipment_built.result(), runs, tmp_path / "shipped"
    )


def user_update_runs_on_the_cluster(cluster, runs, tmp_path):
    """`spark-submit --master M pipelines/user_update.py --run R --step 1` from the repository root,
    the nodes' Python named by spark.pyspark.python: the local-mode embeddings. The application's
    settings, as its event log records them, are the submitted ones: the job set none of its
    local-mode settings over them (8 shuffle partitions, the UI off, its driver memory)."""
    tmp_path.mkdir()
    run = copy_run(runs["prepared"], tmp_path / "run")
    events = tmp_path / "events"
    events.mkdir()
    submitted = {
        "spark.sql.shuffle.partitions": "3",
        "spark.eventLog.enabled": "true",
        "spark.eventLog.dir": f"file://{events}",
        "spark.eventLog.compress": "false",
        "spark.eventLog.rolling.enabled": "false",
    }  # one plain JSON-lines file
    result = cluster.submit("pipelines/user_update.py", "--run", run, "--step", "1", conf={**NODE_CONF, **submitted})
    assert_ran_on_both_workers(cluster, "ssp-user-update", result.stderr)
    assert table_rows(Run(run).user_embeddings(1)) == table_rows(Run(str(runs["local"])).user_embeddings(1))
    settings = application_settings(events)
    assert settings["spark.master"] == cluster.master and settings["spark.sql.shuffle.partitions"] == "3"
    assert (
        "spark.ui.enabled" not in settings
        and "spark.driver.memory" not in settings
        and "spark.sql.adaptive.enabled" not in settings
    )


def application_settings(events: Path) -> dict[str, str]:
    """The Spark properties the one application logging into `events` ran with, from its event
    log's environment update."""
    for log in sorted(path for path in events.iterdir() if not path.name.startswith(".")):
        for line in log.read_text().splitlines():
            event = json.loads(line)
            if event["Event"] == "SparkListenerEnvironmentUpdate":
                properties = event["Spark Properties"]
                return dict(properties) if isinstance(properties, list) else properties
    raise AssertionError(f"{events} records no environment")


def test_the_executor_environment_holds_only_what_the_tasks_import(shipment):
    names = {name.split("==")[0].lower() for name in shipment.distributions}
    assert {"numpy", "pyarrow", "numba", "llvmlite", "gcsfs", "fsspec", "pyspark", "py4j"} <= names
    assert not names & {"tensorflow", "apache-beam", "pandas", "ssp-recsys"}
    pyspark = {str(file) for file in shipping.kept_files(importlib.metadata.distribution("pyspark"))}
    assert {"pyspark/worker.py", "pyspark/daemon.py"} <= pyspark
    assert not [
        file for file in pyspark if file.endswith((".jar", ".zip"))
    ]  # Spark's jars and python/lib zips: the nodes' Spark has them
    assert shipment.env_bytes < 600 << 20


GATE_WRAPPER = textwrap.dedent('''
    """Runs the stats entry script in the working folder (spark-submit's script, as copied there) with
    its release's first item shard held at a gate in its reduce task until it is killed."""
    import os, runpy, time
    from pipelines.engines import spark_stats  # from the shipped project zip (--py-files)

    GATE = os.environ["SSP_TEST_GATE"]

    item_shard = spark_stats.item_shard

    def gated(*args, **kwargs):
        """The first task to claim the gate writes its Python worker's pid and waits to be killed."""
        try:
            claim = os.open(os.path.join(GATE, "claimed"), os.O_CREAT | os.O_EXCL | os.O_WRONLY)
        except FileExistsError:
            yield from item_shard(*args, **kwargs)
            return
        os.write(claim, str(os.getpid()).encode())
        os.close(claim)
        deadline = time.monotonic() + 120
        while not os.path.exists(os.path.join(GATE, "open")):
            if time.monotonic() > deadline:
                raise RuntimeError("the test never killed the gated task")
            time.sleep(0.05)
        yield from item_shard(*args, **kwargs)

    spark_stats.item_shard = gated  # pickled by value with the job's reduce function, which looks it up by name
    runpy.run_path("stats.py", run_name="__main__")  # the script as spark-submit runs it; it exits with its status
''')


def executor_of(pid: int) -> int:
    """The executor JVM (CoarseGrainedExecutorBackend) whose Python worker is `pid`."""
    while pid > 1:
        with open(f"/proc/{pid}/cmdline", "rb") as handle:
            if b"CoarseGrainedExecutorBackend" in handle.read():
                return pid
        with open(f"/proc/{pid}/stat") as handle:
            pid = int(handle.read().rsplit(")", 1)[1].split()[1])
    raise AssertionError("no executor JVM above the gated Python worker")


def the_shipped_line_runs_the_stats_job_from_a_folder_holding_only_its_script_through_a_killed_executor(
    cluster, shipment, runs, tmp_path
):
    """`ssp spark-package`'s line: the executors run the shipped environment's Python (unpacked in
    each executor's folder; the line names no other, and the cluster's environment has no PYTHONPATH
    nor PYSPARK_PYTHON), the project comes from the shipped zip. The line runs from a folder holding
    only pipelines/stats.py; a wrapper in a folder of its own runs that script with its release's
    first reduce task held at a gate (it waits to be told, no sleep decides anything), whose
    executor's JVM is killed by pid: Spark retries the task elsewhere, with the same bits and one
    charge."""
    from tests.spark_cluster import spark_env

    tmp_path.mkdir()
    run = copy_run(runs["users"], tmp_path / "run")
    entry, wrapper, gate = tmp_path / "entry", tmp_path / "wrapper", tmp_path / "gate"
    for folder in (entry, wrapper, gate):
        folder.mkdir()
    shutil.copy(ROOT / "pipelines" / "stats.py", entry)
    (wrapper / "gated_stats.py").write_text(GATE_WRAPPER)
    line = shipping.spark_submit_line(shipment, cluster.master, "stats.py", ("--run", run, "--step", "1"))
    assert line[:3] == ["spark-submit", "--master", cluster.master] and "spark.pyspark.python=./env/bin/python" in line
    assert line[-5:] == ["stats.py", "--run", run, "--step", "1"]
    job = subprocess.Popen(
        cluster.command(*line[3:-5], wrapper / "gated_stats.py", *line[-4:]),  # the cluster's spark-submit and master
        cwd=entry,
        env=spark_env(SSP_TEST_GATE=str(gate)),
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        deadline = time.monotonic() + 180
        while not (gate / "claimed").exists() or not (gate / "claimed").read_text():
            assert job.poll() is None and time.monotonic() < deadline, "no task reached the gate"
            time.sleep(0.05)
        worker = int((gate / "claimed").read_text())
        os.kill(executor_of(worker), signal.SIGKILL)
        with suppress(ProcessLookupError):  # the worker may already have died with its executor
            os.kill(worker, signal.SIGKILL)
        _, err = job.communicate(timeout=240)
    finally:
        (gate / "open").touch()
        if job.poll() is None:
            job.kill()
    assert job.returncode == 0, err[-4000:]
    assert_ran_on_both_workers(cluster, "ssp-stats", err)
    apps = {executor["appid"] for _, executor in cluster.executors_of("ssp-stats")}
    unpacked = [
        path for app in apps for path in cluster.folder.glob(f"worker-*/{app}/*/{shipping.ENV_NAME}/bin/python")
    ]
    assert {path.parents[4].name for path in unpacked} == {"worker-0", "worker-1"}, unpacked
    assert "Lost executor" in err or "ExecutorLostFailure" in err, err[-4000:]
    assert_same_statistics(run, str(runs["local"]))
    ledger = Ledger.open(str(Path(run) / "ledger.parquet"))
    account = BudgetAccount.open(str(ledger.budget["account"]))
    charged = [c["release"] for c in account.document["charges"] if c["ledger"] == ledger.identity]
    assert sorted(charged) == [row["release"] for row in ledger.rows]


def test_spark_package_refuses_a_python_that_is_not_3_11_with_one_line_and_nothing_written(tmp_path):
    fake = tmp_path / "python3.10"
    fake.write_text("#!/bin/sh\necho 3.10\n")
    fake.chmod(0o755)
    ssp = str(Path(sys.executable).parent / "ssp")
    result = subprocess.run(
        [ssp, "spark-package", "--out", str(tmp_path / "dist"), "--python", str(fake)],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert result.returncode == 2 and not (tmp_path / "dist").exists()
    assert result.stderr.splitlines() == [
        f"ssp spark-package: error: --python {fake}: is Python 3.10, the environment needs Python 3.11"
    ]
    relative = subprocess.run(
        [ssp, "spark-package", "--python", "python3.11"], capture_output=True, text=True, timeout=120
    )
    assert relative.returncode == 2 and "give the absolute path" in relative.stderr
