"""Shared fixtures: a real GCS emulator (gcp-storage-emulator) serving gs:// paths for storage tests,
one Spark session per test worker, and a budget-account registry of each test's own (no test's
runs charge another's data sources, nor the machine's ~/.ssp)."""

from __future__ import annotations

import atexit
import os
import shutil
import socket
import subprocess
import sys
import tempfile
import time
import uuid

import pytest

os.environ.setdefault("GCSFS_EXPERIMENTAL_ZB_HNS_SUPPORT", "false")  # before gcsfs is imported
# One BLAS thread per process, before numpy is imported: the two test workers share two cores, and
# OpenBLAS's spinning threads then starve each other (the non-private run: 132 s beside one busy
# core, 24 s with one thread). Spark's Python workers get the same setting (pipelines.engines.spark).
os.environ.setdefault("OPENBLAS_NUM_THREADS", "1")
os.environ["SSP_BUDGET_ACCOUNTS"] = tempfile.mkdtemp(prefix="ssp-accounts-")  # session-scoped fixtures' runs
atexit.register(shutil.rmtree, os.environ["SSP_BUDGET_ACCOUNTS"], ignore_errors=True)  # gone with this process


ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def pytest_configure(config):
    """When the DAG tests are in the run, start creating .venv-airflow (infra/airflow/setup.sh, a few
    minutes of mostly disk work, once per machine) in the background at once, so that it overlaps
    the other tests instead of holding a worker; the DAG tests' fixture waits for it (the script's
    lock) and finds it done."""
    if os.environ.get("PYTEST_XDIST_WORKER") is not None or config.option.collectonly:
        return
    targets = [os.path.abspath(arg.split("::")[0]) for arg in config.args] or [os.path.join(ROOT, "tests")]
    dags = os.path.join(ROOT, "tests", "infra")
    if any(dags.startswith(target) or target.startswith(dags) for target in targets):
        subprocess.Popen(
            ["bash", os.path.join(ROOT, "infra", "airflow", "setup.sh")],
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
            start_new_session=True,
        )


# What a test needs beyond this process, as markers (registered in pyproject.toml), applied here by the
# fixtures it uses, so that they cannot drift from what it does; a module whose tests start Spark or
# Beam some other way (an installed `ssp` in a subprocess, a pipeline built in the test) says so with
# a module-level `pytestmark`. The fast loop deselects them all (pyproject.toml, [tool.pytest.ini_options]).
SPARK_FIXTURES = {"spark", "cluster"}  # the session's local Spark; a standalone cluster (and its spark-submit)
GCS_FIXTURES = {"gcs_bucket"}  # gcs_path and every gs:// fixture go through it
NO_JVM = "/nonexistent/java-home-of-a-test-not-marked-spark"  # see no_jvm_unless_marked


# The module whose one test runs longest (a standalone cluster: about two minutes on two cores) is run
# first: collected in the middle, it could start when the other worker has little left and keep the
# run waiting on it alone. Its whole module moves, so that its module fixtures are made once.
RUN_FIRST = ("tests/pipelines/test_spark_cluster.py",)


def pytest_collection_modifyitems(config, items):
    items.sort(key=lambda item: item.nodeid.split("::")[0] not in RUN_FIRST)  # stable: the rest keep their order
    for item in items:
        names = set(getattr(item, "fixturenames", ()))
        params = getattr(getattr(item, "callspec", None), "params", {})
        engines = {value for key, value in params.items() if "engine" in key and isinstance(value, str)}
        if names & SPARK_FIXTURES or "spark" in engines:
            item.add_marker(pytest.mark.spark)
        if "cluster" in names:
            item.add_marker(pytest.mark.cluster)
        if "beam" in engines:
            item.add_marker(pytest.mark.beam)
        if names & GCS_FIXTURES:
            item.add_marker(pytest.mark.gcs)


@pytest.fixture(autouse=True)
def no_jvm_unless_marked(request, monkeypatch):
    """A test not marked `spark` gets no Java: JAVA_HOME points nowhere, so a Spark it starts after all,
    in this process or in a subprocess, fails at once instead of slowing the fast loop unnoticed (a
    session already running in this worker is found and used, so the guard bites in the fast loop)."""
    if request.node.get_closest_marker("spark") is None:
        monkeypatch.setenv("JAVA_HOME", NO_JVM)


@pytest.fixture(scope="module", autouse=True)
def module_budget_account_registry(tmp_path_factory):
    """Each test module's own registry for the runs its module-scoped fixtures make: a data source's
    account then holds that module's charges only, whichever tests share a worker process."""
    folder = tmp_path_factory.mktemp("module-budget-accounts")
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("SSP_BUDGET_ACCOUNTS", str(folder))
        yield folder


@pytest.fixture(autouse=True)
def budget_account_registry(tmp_path_factory, monkeypatch):
    """Each test's own registry of budget accounts (subprocesses inherit it)."""
    folder = tmp_path_factory.mktemp("budget-accounts")
    monkeypatch.setenv("SSP_BUDGET_ACCOUNTS", str(folder))
    return folder


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


@pytest.fixture(scope="session")
def gcs_bucket():
    """A bucket on a gcp-storage-emulator process; yields its gs:// URL."""
    port, bucket = _free_port(), "ssp-test"
    server = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "gcp_storage_emulator",
            "start",
            "--host",
            "127.0.0.1",
            "--port",
            str(port),
            "--in-memory",
            "--default-bucket",
            bucket,
            "--quiet",
        ],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    deadline = time.monotonic() + 30
    while True:
        try:
            socket.create_connection(("127.0.0.1", port), timeout=0.5).close()
            break
        except OSError:
            if time.monotonic() > deadline or server.poll() is not None:
                server.kill()
                raise RuntimeError("gcp-storage-emulator did not start") from None
            time.sleep(0.1)
    saved = {key: os.environ.get(key) for key in ("STORAGE_EMULATOR_HOST", "FSSPEC_GS_TOKEN")}
    os.environ["STORAGE_EMULATOR_HOST"] = f"http://127.0.0.1:{port}"
    os.environ["FSSPEC_GS_TOKEN"] = "anon"
    try:
        yield f"gs://{bucket}"
    finally:
        server.terminate()
        server.wait(timeout=10)
        for key, value in saved.items():
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value


@pytest.fixture
def gcs_path(gcs_bucket):
    """A fresh, empty gs:// folder for one test."""
    return f"{gcs_bucket}/{uuid.uuid4().hex}"


@pytest.fixture
def sample_tables():
    """One small valid example of every table, with its validator: {name: (table, validate)}."""
    import json

    import pyarrow as pa

    from schemas import tables as t

    items = pa.Table.from_pydict(
        {
            "item_id": [1, 2, 3],
            "title": ["A (1995)", "B", "Ç (2001)"],
            "genres": [["Comedy"], [], ["Drama", "War"]],
            "year": [1995, None, 2001],
        },
        schema=t.items_schema({"genres": t.MULTIVALENT, "year": t.UNIVALENT}),
    )
    stats_meta = {
        b"d": b"2",
        b"noise_multiplier": b"0.5",
        b"clip_u": b"1.0",
        b"clip_y": b"2.0",
        b"wbar": b"1.0",
        b"release": b"3",
        b"resample": b"0",
    }
    return {
        "interactions": (
            pa.Table.from_pydict(
                {"user_id": [1, 1, 2], "item_id": [1, 3, 3], "label": [4.0, 2.5, 5.0], "timestamp": [10, 11, None]},
                schema=t.INTERACTIONS,
            ),
            t.validate_interactions,
        ),
        "items": (items, t.validate_items),
        "user_embeddings": (
            pa.Table.from_pydict({"user_id": [1, 2], "embedding": [[0.1, 0.2], [0.3, -0.4]]}, schema=t.USER_EMBEDDINGS),
            t.validate_user_embeddings,
        ),
        "item_embeddings": (
            pa.Table.from_pydict({"item_id": [1, 2, 3], "embedding": [[1.0], [2.0], [3.0]]}, schema=t.ITEM_EMBEDDINGS),
            t.validate_item_embeddings,
        ),
        "counts": (
            pa.Table.from_pydict({"item_id": [1, 2, 3], "count": [1.0, 7.5, 2.0]}, schema=t.COUNTS),
            t.validate_counts,
        ),
        "stats": (
            pa.Table.from_pydict(
                {"item_id": [1, 2], "a_upper": [[1.0, 0.5, 2.0], [0.0, 0.0, 0.0]], "b": [[1.0, -1.0], [0.0, 0.0]]},
                schema=t.STATS.with_metadata(stats_meta),
            ),
            t.validate_stats,
        ),
        "ledger": (
            pa.Table.from_pydict(
                {
                    "release": [0, 1],
                    "name": ["counts", "step-1/A"],
                    "event": [
                        json.dumps({"type": "gaussian", "noise_multiplier": 4.0}),
                        json.dumps({"type": "gaussian", "noise_multiplier": 2.0}),
                    ],
                    "noise_multiplier": [4.0, 2.0],
                    "epsilon_spent": [0.5, 1.2],
                    "delta": [1e-5, 1e-5],
                    "data_fingerprint": ["ab12", "ab12"],
                    "recorded_at": ["2026-01-01T00:00:00Z"] * 2,
                },
                schema=t.LEDGER,
            ),
            t.validate_ledger,
        ),
    }


@pytest.fixture(scope="session")
def spark():
    """One local Spark session (2 cores) for the whole test session."""
    from pipelines.engines.spark import session

    with session("ssp-tests", "local[2]") as spark_session:
        yield spark_session


@pytest.fixture(params=["local", "spark", "beam"])
def engine(request):
    """Each engine the prepare stage runs on: this process, Spark (the session above) and Beam's
    DirectRunner, with small shards so that even a small table is spread over several."""
    if request.param == "local":
        from pipelines.engines.local import LocalEngine

        return LocalEngine()
    if request.param == "spark":
        from pipelines.engines.prepare_spark import SparkEngine

        return SparkEngine(request.getfixturevalue("spark"))
    from pipelines.engines.prepare_beam import BeamEngine

    return BeamEngine(shard_rows=50)
