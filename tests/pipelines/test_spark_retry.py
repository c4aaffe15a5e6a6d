"""Fault tolerance: a Spark task that fails on its first attempt is retried, and the release is
byte-identical to an undisturbed run (keyed noise, fixed summation order).

The disturbed run needs a Spark of its own (`local[2,2]`: two attempts per task; the test session's
`local[2]` allows none), so it runs in a subprocess; the undisturbed one runs on the test session's
Spark, which has the same two cores (so the same task layout)."""

import os
import re
import subprocess
import sys
import textwrap

from stats_inputs import registered, write_inputs

from pipelines.engines import spark_stats as stats
from pipelines.releases import stats_job
from pipelines.releases.release import PrivacySettings
from pipelines.releases.stats_core import StatsSettings
from privacy.seeds import SeedFile

INTERACTIONS = [(1, 10, 4.0), (1, 20, 5.0), (2, 10, 1.0), (2, 30, 3.0), (3, 30, 2.5), (4, 40, 1.5), (4, 10, 3.0)]
EMBEDDINGS = {1: [3.0, 4.0], 2: [0.5, -0.5], 3: [0.0, 2.0], 4: [1.0, 1.0]}
COUNTS = {10: 16.0, 20: 1.0, 30: 81.0, 40: 2.0, 50: 3.0}


def stats_job_of(paths, out, seed):
    """The release both runs make: the same inputs, settings, seed and shards."""
    return registered(stats_job.StatsJob(paths["interactions"], paths["user_embeddings"], paths["items"], paths["counts"], out,
                                         StatsSettings(2, 1.0, 5.0), PrivacySettings(noise_multiplier=1.0), seed_file=seed, shards=3))


DRIVER = textwrap.dedent("""
    import json, sys
    sys.path.insert(0, "tests/pipelines")
    from test_spark_retry import stats_job_of
    from pipelines.engines import spark_stats as stats
    from pipelines.engines.spark import session
    paths, out, seed = json.loads(sys.argv[1]), sys.argv[2], sys.argv[3]
    job = stats_job_of(paths, out, seed)
    with session("retry-test", "local[2,2]") as spark:  # two attempts per task
        stats.run(job, spark, fail_first_attempts=True)
        tracker = spark.sparkContext.statusTracker()
        stages = [tracker.getStageInfo(s) for j in tracker.getJobIdsForGroup() for s in tracker.getJobInfo(j).stageIds]
        print("failed task attempts:", sum(stage.numFailedTasks for stage in stages if stage is not None))
""")


def run_disturbed(paths, out, seed):
    """The release with every item task failing on its first attempt, on a Spark of its own; its output."""
    import json

    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    result = subprocess.run([sys.executable, "-c", DRIVER, json.dumps(paths), out, seed], cwd=root, capture_output=True, text=True, timeout=300,
                            env={**os.environ, "PYTHONPATH": root})
    assert result.returncode == 0, result.stderr[-3000:]
    return result.stdout


def test_retried_tasks_reproduce_the_release_byte_for_byte(spark, tmp_path):
    paths = write_inputs(tmp_path / "in", INTERACTIONS, EMBEDDINGS, COUNTS, list(COUNTS))
    seed = SeedFile.create(str(tmp_path / "seed"), bytes(range(32))).path
    log = run_disturbed(paths, str(tmp_path / "disturbed"), seed)
    seed = SeedFile.create(str(tmp_path / "seed-calm"), bytes(range(32))).path  # the same seed (a seed file serves one ledger)
    assert int(re.search(r"failed task attempts: (\d+)", log).group(1)) > 0  # the first attempts really failed (Spark's own count)
    assert spark.sparkContext.defaultParallelism == 2  # the disturbed run's local[2,2]: the same task layout
    stats.run(stats_job_of(paths, str(tmp_path / "calm"), seed), spark)
    for name in ("resample-0.parquet",):
        disturbed, calm = tmp_path / "disturbed" / name, tmp_path / "calm" / name
        assert sorted(os.listdir(disturbed)) == sorted(os.listdir(calm))
        for part in os.listdir(calm):
            assert (disturbed / part).read_bytes() == (calm / part).read_bytes(), part
