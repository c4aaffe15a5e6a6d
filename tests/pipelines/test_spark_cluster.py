"""The Spark entry scripts on a real multi-process cluster: a standalone master and two 1-core workers
on 127.0.0.1, and the commands docs/operations.md gives, with the master a cluster user passes to
spark-submit (once, to spark-submit). The jobs must run on the cluster's executors, not in a
local-mode driver, and release the bits a local-mode run releases; an executor killed by its pid
while a task of the release runs is retried with the same bits and one charge."""

from __future__ import annotations

import os
import shutil
import signal
import sys
import textwrap
import time
from pathlib import Path

import pyarrow.parquet as pq
import pytest

from pipelines.training import user_stage
from pipelines.training.item_update import release_stats
from pipelines.training.prepare import prepare, run_directory
from pipelines.training.run_dir import Run
from pipelines.training.settings import TrainConfig
from privacy.account import BudgetAccount
from privacy.ledger import Ledger
from spark_cluster import ROOT, standalone_cluster

VENV_PYTHON = sys.executable  # the nodes' Python with the locked dependencies (Dataproc: /opt/ssp/venv/bin/python)
NODE_CONF = {"spark.pyspark.python": VENV_PYTHON}


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    with standalone_cluster(tmp_path_factory.mktemp("spark-cluster")) as running:
        yield running


@pytest.fixture(scope="module")
def runs(small_data, tmp_path_factory, module_budget_account_registry):
    """A prepared run (`prepared`), its step-1 user embeddings from a local-mode Spark (`users`: a
    copy of the run then), and that copy's step-1 statistics released in local mode (`local`)."""
    from pipelines.engines.spark import session

    folder = tmp_path_factory.mktemp("cluster-runs")
    config = TrainConfig(data=small_data, out=str(folder / "prepared"), epsilon=8.0, outer_steps=2)
    with run_directory(config):
        prepare(config, progress=False)
    shutil.copytree(folder / "prepared", folder / "local")
    with session("cluster-reference", "local[2]") as spark:
        user_stage.run_step(spark, str(folder / "local"), 1)
        shutil.copytree(folder / "local", folder / "users")
        release_stats(Run(str(folder / "local")), 1, spark)
    return {name: folder / name for name in ("prepared", "users", "local")}


def copy_run(source: Path, target: Path) -> str:
    shutil.copytree(source, target)
    return str(target)


def table_rows(path: str) -> list[dict]:
    return sorted(pq.read_table(path).to_pylist(), key=lambda row: tuple(row.values())[0])


def released(root: str) -> list[tuple]:
    return [(row["release"], row["name"], row["noise_multiplier"]) for row in Ledger.open(str(Path(root) / "ledger.parquet")).rows]


def assert_ran_on_both_workers(cluster, app: str, log: str) -> None:
    workers = {worker for worker, _ in cluster.executors_of(app)}
    assert workers == {worker["id"] for worker in cluster.state()["workers"]}, cluster.executors_of(app)
    assert "Starting executor ID driver on host" not in log  # no local-mode executor inside the driver


def test_the_documented_spark_submit_commands_run_on_the_cluster_with_local_bits(cluster, runs, tmp_path):
    run = copy_run(runs["prepared"], tmp_path / "run")
    result = cluster.submit("pipelines/user_update.py", "--run", run, "--step", "1", conf=NODE_CONF)
    assert_ran_on_both_workers(cluster, "ssp-user-update", result.stderr)
    local = Run(str(runs["local"]))
    assert table_rows(Run(run).user_embeddings(1)) == table_rows(local.user_embeddings(1))

    result = cluster.submit("pipelines/stats.py", "--run", run, "--step", "1", conf=NODE_CONF)
    assert_ran_on_both_workers(cluster, "ssp-stats", result.stderr)
    stats = Path(Run(run).stats(1))
    assert sorted(os.listdir(stats)) == sorted(os.listdir(local.stats(1)))
    for table in (name for name in os.listdir(stats) if name.endswith(".parquet")):
        assert table_rows(str(stats / table)) == table_rows(str(Path(local.stats(1)) / table)), table
    assert released(run) == released(str(runs["local"]))


GATED_DRIVER = textwrap.dedent('''
    """pipelines/stats.py with its release's first item task held at a gate until it is killed."""
    import os, sys, time
    sys.path.insert(0, os.getcwd())
    from pipelines.engines import spark_stats
    import pipelines.stats

    GATE = os.environ["SSP_TEST_GATE"]

    def gated(results, fail_first_attempt):
        """The first task to claim the gate writes its Python worker's pid and waits to be killed."""
        try:
            claim = os.open(os.path.join(GATE, "claimed"), os.O_CREAT | os.O_EXCL | os.O_WRONLY)
        except FileExistsError:
            yield from results
            return
        os.write(claim, str(os.getpid()).encode())
        os.close(claim)
        deadline = time.monotonic() + 120
        while not os.path.exists(os.path.join(GATE, "open")):
            if time.monotonic() > deadline:
                raise RuntimeError("the test never killed the gated task")
            time.sleep(0.05)
        yield from results

    spark_stats._maybe_failing = gated  # pickled by value with the job's reduce function
    sys.exit(pipelines.stats.main())
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


def test_an_executor_killed_during_the_release_is_retried_with_the_same_bits_and_one_charge(cluster, runs, tmp_path):
    import subprocess

    from spark_cluster import spark_env

    run = copy_run(runs["users"], tmp_path / "run")
    gate = tmp_path / "gate"
    gate.mkdir()
    (tmp_path / "gated_stats.py").write_text(GATED_DRIVER)
    command = cluster.command(tmp_path / "gated_stats.py", "--run", run, "--step", "1", conf=NODE_CONF)
    job = subprocess.Popen(command, cwd=ROOT, env=spark_env(SSP_TEST_GATE=str(gate)), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        deadline = time.monotonic() + 180
        while not (gate / "claimed").exists() or not (gate / "claimed").read_text():
            assert job.poll() is None and time.monotonic() < deadline, "no task reached the gate"
            time.sleep(0.05)
        worker = int((gate / "claimed").read_text())
        os.kill(executor_of(worker), signal.SIGKILL)
        os.kill(worker, signal.SIGKILL)
        _, err = job.communicate(timeout=240)
    finally:
        (gate / "open").touch()
        if job.poll() is None:
            job.kill()
    assert job.returncode == 0, err[-4000:]
    assert "Lost executor" in err or "ExecutorLostFailure" in err, err[-4000:]
    local = Run(str(runs["local"]))
    for table in (name for name in os.listdir(local.stats(1)) if name.endswith(".parquet")):
        assert table_rows(str(Path(Run(run).stats(1)) / table)) == table_rows(str(Path(local.stats(1)) / table)), table
    assert released(run) == released(str(runs["local"]))  # one release of the step's statistics, as without the kill
    ledger = Ledger.open(str(Path(run) / "ledger.parquet"))
    account = BudgetAccount.open(str(ledger.budget["account"]))
    charged = [c["release"] for c in account.document["charges"] if c["ledger"] == ledger.identity]
    assert sorted(charged) == [row["release"] for row in ledger.rows]
