"""`spark-submit` of a job script from outside the repository, with the project in --py-files (as on
Dataproc, where the main file is downloaded alone): the shipped zip comes first on the path, and the
job's session keeps what was submitted. The standalone-cluster runs are tests/pipelines/test_spark_cluster.py."""

import os
import subprocess
import sys
from pathlib import Path

from pipelines.engines.spark import project_zip

PROBE = """
import pipelines.engines.spark_stats, pipelines.engines.user_update
from pipelines.engines.spark import session
print(pipelines.engines.spark_stats.__file__)
with session("probe") as spark:
    conf = spark.sparkContext.getConf()
    print(conf.get("spark.master"), conf.get("spark.sql.shuffle.partitions"), conf.get("spark.ui.enabled"), spark.sparkContext.pythonExec)
"""


def test_the_shipped_zip_comes_first_and_the_session_keeps_what_was_submitted(tmp_path):
    """Under spark-submit the job's session keeps the submitted master and settings (none of its
    local-mode ones: 8 shuffle partitions, the UI off) and leaves the executors' Python to the submitter."""
    zipped = project_zip(str(tmp_path / "ssp_recsys.zip"))
    (tmp_path / "probe.py").write_text(PROBE)
    env = {key: value for key, value in os.environ.items() if key != "PYTHONPATH"}
    env["PYSPARK_PYTHON"] = sys.executable
    result = subprocess.run([str(Path(sys.executable).parent / "spark-submit"), "--master", "local[2]", "--py-files", zipped,
                             "--conf", "spark.sql.shuffle.partitions=3", "probe.py"], capture_output=True, text=True, cwd=tmp_path, env=env, timeout=300)
    assert result.returncode == 0, result.stderr[-3000:]
    found, settings = result.stdout.strip().splitlines()[-2:]
    assert found.startswith(zipped)
    assert settings.split() == ["local[2]", "3", "None", sys.executable]
