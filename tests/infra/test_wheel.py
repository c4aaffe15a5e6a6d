"""The project as it ships to a cluster: the built wheel, and the Spark entry scripts run by
spark-submit from outside the repository (as on Dataproc, where the main file is downloaded alone
and the project arrives in --py-files).

PySpark puts only .zip, .egg and .jar py-files on the executors' sys.path (pyspark's
SparkContext.PACKAGE_EXTENSIONS): a .whl there reaches the driver only. So the wheel ships to Spark
under a .zip name (the same bytes; a pure-Python wheel is zip-importable), as infra/build.sh does.
"""

import fcntl
import os
import shutil
import subprocess
import sys
import tomllib
from pathlib import Path

import numpy as np
import pyarrow as pa
import pytest

from schemas import storage
from schemas.tables import COUNTS, INTERACTIONS, ITEM_EMBEDDINGS, items_schema, USER_EMBEDDINGS, validate_stats, validate_user_embeddings

ROOT = Path(__file__).resolve().parents[2]
VERSION = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["version"]


@pytest.fixture(scope="module")
def wheel(tmp_path_factory):
    """`python -m pip wheel . -w dist`, as infra/build.sh builds it; one build at a time (the test
    workers share the repository's build/ folder)."""
    out = tmp_path_factory.mktemp("dist")
    with open(tmp_path_factory.getbasetemp().parent / "wheel-build.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        subprocess.run([sys.executable, "-m", "pip", "wheel", "--quiet", "--no-deps", "--no-build-isolation", str(ROOT), "-w", str(out)],
                       check=True, capture_output=True, cwd=out)
    path = out / f"ssp_recsys-{VERSION}-py3-none-any.whl"
    assert path.exists(), os.listdir(out)
    return path


@pytest.fixture(scope="module")
def py_files(wheel):
    """The wheel under the name Spark ships to executors (infra/build.sh: dist/ssp_recsys-VERSION.zip)."""
    return shutil.copy(wheel, wheel.parent / f"ssp_recsys-{VERSION}.zip")


@pytest.fixture
def cluster_dir(tmp_path):
    """A working folder outside the repository holding only the entry scripts (the job's main files)."""
    for script in ("stats.py", "user_update.py"):
        shutil.copy(ROOT / "pipelines" / script, tmp_path / script)
    return tmp_path


def spark_submit(py_files, folder, *args):
    env = {key: value for key, value in os.environ.items() if key != "PYTHONPATH"}
    env["PYSPARK_PYTHON"] = sys.executable
    result = subprocess.run([str(Path(sys.executable).parent / "spark-submit"), "--master", "local[2]", "--py-files", str(py_files), *map(str, args)],
                            capture_output=True, text=True, cwd=folder, env=env, timeout=300)
    assert result.returncode == 0, result.stderr[-3000:]
    return result.stdout


def test_py_files_wheel_comes_first(py_files, cluster_dir):
    (cluster_dir / "probe.py").write_text("import pipelines.engines.spark_stats, pipelines.engines.user_update\nprint(pipelines.engines.spark_stats.__file__)\n")
    assert spark_submit(py_files, cluster_dir, cluster_dir / "probe.py").strip().startswith(str(py_files))


def test_the_stats_script_runs_from_the_wheel(py_files, cluster_dir):
    catalog = [1, 2, 3, 4]
    paths = {name: str(cluster_dir / f"{name}.parquet") for name in ("interactions", "user_embeddings", "counts", "items")}
    storage.write_table(pa.table({"user_id": [1, 1, 2, 3], "item_id": [1, 2, 2, 3], "label": [4.0, 3.0, 5.0, 1.0], "timestamp": [0] * 4}, schema=INTERACTIONS), paths["interactions"])
    storage.write_table(pa.table({"user_id": [1, 2, 3], "embedding": [[0.5, 0.1], [0.2, -0.3], [1.0, 1.0]]}, schema=USER_EMBEDDINGS), paths["user_embeddings"])
    storage.write_table(pa.table({"item_id": catalog, "count": [2.0] * 4}, schema=COUNTS), paths["counts"])
    storage.write_table(pa.table({"item_id": catalog, "title": [f"item {i}" for i in catalog], "genres": [[] for _ in catalog]}, schema=items_schema({"genres": "multivalent"})), paths["items"])
    out = cluster_dir / "stats"
    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "pipelines"))
    from stats_inputs import register_counts

    from pipelines.releases.release import PrivacySettings

    register_counts(paths["counts"], str(out / "ledger.parquet"), PrivacySettings(noise_multiplier=1.0))  # the job takes released counts only
    stdout = spark_submit(py_files, cluster_dir, "stats.py", "--interactions", paths["interactions"], "--user-embeddings", paths["user_embeddings"],
                          "--items", paths["items"], "--counts", paths["counts"], "--out", out, "--dim", "2", "--clip-u", "1", "--clip-y", "2",
                          "--noise-multiplier", "1", "--shards", "2")
    assert "stats step 1" in stdout
    assert validate_stats(storage.read_table(str(out / "resample-0.parquet"))).num_rows == len(catalog)


def test_the_user_update_script_runs_from_the_wheel(py_files, cluster_dir):
    catalog = [1, 2, 3, 4]
    interactions = str(cluster_dir / "interactions.parquet")
    storage.write_table(pa.table({"user_id": [1, 1, 2, 3], "item_id": [1, 2, 2, 3], "label": [4.0, 3.0, 5.0, 1.0], "timestamp": [0] * 4}, schema=INTERACTIONS), interactions)
    storage.write_table(pa.table({"item_id": catalog, "embedding": list(np.eye(4)[:, :2])}, schema=ITEM_EMBEDDINGS), str(cluster_dir / "v.parquet"))
    spark_submit(py_files, cluster_dir, "user_update.py", "--interactions", interactions, "--item-embeddings", cluster_dir / "v.parquet",
                 "--out", cluster_dir / "u.parquet", "--dim", "2")
    assert validate_user_embeddings(storage.read_table(str(cluster_dir / "u.parquet")), dim=2).num_rows == 3
