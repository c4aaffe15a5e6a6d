"""Fault tolerance: a Spark task that fails on its first attempt is retried, and the release is
byte-identical to an undisturbed run (keyed noise, fixed summation order)."""

import os
import re
import subprocess
import sys
import textwrap

from stats_inputs import write_inputs

from privacy.seeds import SeedFile

INTERACTIONS = [(1, 10, 4.0), (1, 20, 5.0), (2, 10, 1.0), (2, 30, 3.0), (3, 30, 2.5), (4, 40, 1.5), (4, 10, 3.0)]
EMBEDDINGS = {1: [3.0, 4.0], 2: [0.5, -0.5], 3: [0.0, 2.0], 4: [1.0, 1.0]}
COUNTS = {10: 16.0, 20: 1.0, 30: 81.0, 40: 2.0, 50: 3.0}

DRIVER = textwrap.dedent("""
    import json, sys
    from pipelines.engines import spark_stats as stats
    from pipelines.releases import stats_job
    from pipelines.releases.release import PrivacySettings
    from pipelines.engines.spark import session
    from pipelines.releases.stats_core import StatsSettings
    paths, out, seed, fail = json.loads(sys.argv[1]), sys.argv[2], sys.argv[3], sys.argv[4] == "fail"
    sys.path.insert(0, "tests/pipelines")
    from stats_inputs import registered
    job = registered(stats_job.StatsJob(paths["interactions"], paths["user_embeddings"], paths["items"], paths["counts"], out,
                                        StatsSettings(2, 1.0, 5.0), PrivacySettings(noise_multiplier=1.0), seed_file=seed, shards=3))
    with session("retry-test", "local[2,2]") as spark:  # two attempts per task
        stats.run(job, spark, fail_first_attempts=fail)
        tracker = spark.sparkContext.statusTracker()
        stages = [tracker.getStageInfo(s) for j in tracker.getJobIdsForGroup() for s in tracker.getJobInfo(j).stageIds]
        print("failed task attempts:", sum(stage.numFailedTasks for stage in stages if stage is not None))
""")


def run_job(paths, out, seed, mode):
    import json

    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    result = subprocess.run([sys.executable, "-c", DRIVER, json.dumps(paths), out, seed, mode], cwd=root, capture_output=True, text=True, timeout=300,
                            env={**os.environ, "PYTHONPATH": root})
    assert result.returncode == 0, result.stderr[-3000:]
    return result.stdout


def test_retried_tasks_reproduce_the_release_byte_for_byte(tmp_path):
    paths = write_inputs(tmp_path / "in", INTERACTIONS, EMBEDDINGS, COUNTS, list(COUNTS))
    seed = SeedFile.create(str(tmp_path / "seed"), bytes(range(32))).path
    log = run_job(paths, str(tmp_path / "disturbed"), seed, "fail")
    seed = SeedFile.create(str(tmp_path / "seed-calm"), bytes(range(32))).path  # the same seed (a seed file serves one ledger)
    assert int(re.search(r"failed task attempts: (\d+)", log).group(1)) > 0  # the first attempts really failed (Spark's own count)
    run_job(paths, str(tmp_path / "calm"), seed, "calm")
    for name in ("resample-0.parquet",):
        disturbed, calm = tmp_path / "disturbed" / name, tmp_path / "calm" / name
        assert sorted(os.listdir(disturbed)) == sorted(os.listdir(calm))
        for part in os.listdir(calm):
            assert (disturbed / part).read_bytes() == (calm / part).read_bytes(), part
