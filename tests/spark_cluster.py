"""A real Spark standalone cluster on 127.0.0.1 for tests: a master and workers started with pyspark's
`bin/spark-class` (pip's pyspark has no sbin/start-*.sh), each on free ports, in a process group of
its own so that stopping it also ends the executors the workers launched; and `spark-submit` run as
a cluster user runs it."""

from __future__ import annotations

import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import pyspark

ROOT = Path(__file__).resolve().parents[1]
SPARK_HOME = Path(pyspark.__file__).resolve().parent
BIN = Path(sys.executable).parent  # spark-submit, next to the venv's python
START_SECONDS = 90
# JVMs that start fast on a 2-core machine (C1 only, serial GC): about 10 s less per application.
# Test tuning, passed the way a user would (--conf), not something the jobs need.
FAST_JVM = "-XX:TieredStopAtLevel=1 -XX:+UseSerialGC"


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def spark_env(**extra: str) -> dict[str, str]:
    """The environment of the daemons and of spark-submit: this pyspark as SPARK_HOME, everything on
    the loopback address, no PYTHONPATH of this process (the project must reach the executors by
    what the job ships)."""
    env = {
        key: value
        for key, value in os.environ.items()
        if key not in ("PYTHONPATH", "PYSPARK_PYTHON", "PYSPARK_DRIVER_PYTHON")
    }
    env.update(
        SPARK_HOME=str(SPARK_HOME),
        SPARK_LOCAL_IP="127.0.0.1",
        SPARK_LOCAL_HOSTNAME="127.0.0.1",
        PATH=f"{BIN}{os.pathsep}{env.get('PATH', '')}",
    )
    env.update(extra)
    return env


def get_json(url: str) -> dict:
    with urllib.request.urlopen(url, timeout=5) as response:
        return json.load(response)


@dataclass
class Cluster:
    master: str  # spark://127.0.0.1:PORT, what a cluster user passes to spark-submit
    web: str  # the master's web UI, whose /json/ lists workers and applications
    folder: Path  # logs and the workers' work directories

    @property
    def scratch(self) -> Path:
        """The executors' temporary folder (a shipped archive is downloaded there before it is unpacked)."""
        return self.folder / "scratch"

    def state(self) -> dict:
        return get_json(f"{self.web}/json/")

    def executors_of(self, app_name: str) -> list[tuple[str, dict]]:
        """(worker id, executor) of every executor that ran for the applications named `app_name`,
        as the master's workers report them."""
        apps = {
            app["id"] for app in self.state()["completedapps"] + self.state()["activeapps"] if app["name"] == app_name
        }
        found = []
        for worker in self.state()["workers"]:
            report = get_json(f"{worker['webuiaddress'].replace(socket.gethostname(), '127.0.0.1')}/json/")
            found += [
                (worker["id"], executor)
                for executor in report["executors"] + report["finishedexecutors"]
                if executor["appid"] in apps
            ]
        return found

    def command(self, *args, conf: dict[str, str] | None = None) -> list[str]:
        """`spark-submit --master MASTER [--conf k=v ...] ARGS`, as a cluster user writes it."""
        executor = f"{FAST_JVM} -Djava.io.tmpdir={self.scratch}"  # what a killed executor leaves, in the folder
        conf = {"spark.executor.extraJavaOptions": executor, "spark.driver.extraJavaOptions": FAST_JVM, **(conf or {})}
        confs = [part for key, value in conf.items() for part in ("--conf", f"{key}={value}")]
        return [str(BIN / "spark-submit"), "--master", self.master, *confs, *map(str, args)]

    def submit(
        self,
        *args,
        cwd: Path = ROOT,
        conf: dict[str, str] | None = None,
        timeout: float = 240,
        check: bool = True,
        env: dict[str, str] | None = None,
    ) -> subprocess.CompletedProcess:
        """Run `command(ARGS)` from `cwd` and wait for it."""
        result = subprocess.run(
            self.command(*args, conf=conf),
            cwd=cwd,
            env=env or spark_env(),
            capture_output=True,
            text=True,
            timeout=timeout,
        )
        if check:
            assert result.returncode == 0, result.stderr[-4000:]
        return result


@contextmanager
def standalone_cluster(folder: Path, workers: int = 2, cores: int = 1, memory: str = "1g"):
    """A master and `workers` workers of `cores` cores each, until the block ends; every daemon and
    executor they started is stopped then."""
    folder.mkdir(parents=True, exist_ok=True)
    port, web = free_port(), free_port()
    env = spark_env(SPARK_LOG_DIR=str(folder), SPARK_DAEMON_JAVA_OPTS=FAST_JVM)
    spark_class = str(SPARK_HOME / "bin" / "spark-class")
    daemons = []

    def start(name: str, *args: str) -> None:
        log = open(folder / f"{name}.log", "w")
        daemons.append(
            subprocess.Popen(
                [spark_class, *args], stdout=log, stderr=subprocess.STDOUT, env=env, start_new_session=True
            )
        )
        log.close()

    try:
        start(
            "master",
            "org.apache.spark.deploy.master.Master",
            "--host",
            "127.0.0.1",
            "--port",
            str(port),
            "--webui-port",
            str(web),
        )
        cluster = Cluster(f"spark://127.0.0.1:{port}", f"http://127.0.0.1:{web}", folder)
        cluster.scratch.mkdir(exist_ok=True)
        _wait(lambda: cluster.state()["status"] == "ALIVE", "the master", daemons)
        for k in range(workers):
            work = folder / f"worker-{k}"
            work.mkdir(exist_ok=True)
            start(
                f"worker-{k}",
                "org.apache.spark.deploy.worker.Worker",
                "--host",
                "127.0.0.1",
                "--cores",
                str(cores),
                "--memory",
                memory,
                "--webui-port",
                str(free_port()),
                "--work-dir",
                str(work),
                cluster.master,
            )
        _wait(lambda: cluster.state()["aliveworkers"] == workers, f"{workers} workers", daemons)
        yield cluster
    finally:
        for daemon in daemons:
            _stop_group(daemon)
        _drop_executor_files(folder)
        shutil.rmtree(folder / "scratch", ignore_errors=True)


def _drop_executor_files(folder: Path) -> None:
    """What each executor unpacked and copied into its work folder (a shipped environment is about
    600 MB an executor), its stdout and stderr kept for a failure's diagnosis."""
    for executor in folder.glob("worker-*/app-*/*"):
        for entry in executor.iterdir():
            if entry.name in ("stdout", "stderr"):
                continue
            if entry.is_dir() and not entry.is_symlink():
                shutil.rmtree(entry, ignore_errors=True)  # an executor's own shutdown may be deleting it too
            else:
                entry.unlink(missing_ok=True)


def _wait(ready, what: str, daemons: list[subprocess.Popen]) -> None:
    deadline = time.monotonic() + START_SECONDS
    while True:
        try:
            if ready():
                return
        except OSError:
            pass
        if time.monotonic() > deadline or any(daemon.poll() is not None for daemon in daemons):
            raise RuntimeError(f"{what} of the standalone Spark cluster did not start")
        time.sleep(0.2)


def _stop_group(process: subprocess.Popen) -> None:
    """Stop a daemon and everything in its process group (a worker's executors and their Python workers)."""
    for sig, wait in ((signal.SIGTERM, 10), (signal.SIGKILL, 10)):
        try:
            os.killpg(process.pid, sig)
        except ProcessLookupError:
            return
        try:
            process.wait(timeout=wait)
            break
        except subprocess.TimeoutExpired:
            continue
    try:  # executors the worker started linger in its group for a moment after it ends
        os.killpg(process.pid, signal.SIGKILL)
    except ProcessLookupError:
        pass
