"""`run(TrainConfig)`: every stage of a training run in one process, with one Spark session
(`ssp train`, `ssp demo`).

    prepare       data -> split (protocol) -> DP item counts -> DP mean label -> centred, clipped
                  labels -> initial item embeddings from public features only (no privacy cost)
    step s=1..S   user update (Spark) -> stats release (Spark or Beam) -> item update (TensorFlow:
                  SSP trainer; or the DP-ALS / DP-CMF solves; or, with no stats release, AM-DPSGD's
                  TF-Privacy trainer); the last step exports the encoder and item embeddings
    final         user update against the final item embeddings (Spark)
    evaluate      RMSE or Recall@20, sliced by popularity -> metrics.json
    (publish      pipelines.training.publish, once the ledger is checked)

A scheduler runs the same stage functions as separate tasks against one run directory (see
infra/dags/retrain.py): `ssp train --stage prepare` is the only one given the configuration, which
it records in RUN/manifest.json; every later stage takes only `--run RUN` (and `--step s`) and reads
the rest from the manifest (pipelines.training.run_dir).

Everything lands in the run directory RUN: `ledger.parquet` (every release), `manifest.json`
(settings, what prepare produced, steps done), `counts/`, `step-<s>/stats/` (released statistics of
step s), `step-<s>/item_embeddings.parquet` and `step-<s>/checkpoint/` (the encoder after step s;
step 0: the initial one), `encoder/` (SavedModel), `item_embeddings.parquet`, `metrics.json`; and
`RUN/private/`, which must never leave the trusted zone: the noise seed, the ingested data, the
split, the centred training labels, the user embeddings. A run killed mid-way resumes after its last
completed step, and its releases are not spent twice (the ledger and seed binding recognise a
release made before).

Privacy: that of each stage; the releases all go through the run's one ledger.
"""

from __future__ import annotations

import time
from contextlib import contextmanager

from pipelines.engines.spark import jobs_started
from pipelines.training import user_stage
from pipelines.training.evaluation import evaluate
from pipelines.training.item_update import item_update
from pipelines.training.prepare import prepare, run_directory
from pipelines.training.run_dir import Run
from pipelines.training.settings import FIXED_UPDATES, TrainConfig
from pipelines.training.stats_stage import covers_items, release_stats, run_engine


def run(
    config: TrainConfig, spark=None, progress: bool = True, count_jobs: bool = False, metrics_at: tuple[int, ...] = ()
) -> dict:
    """Run (or resume) the whole training in this process; returns the metrics written to RUN/metrics.json.

    The same stages a scheduler runs as separate tasks, on the run's engine (with `spark`, a Spark
    engine uses that session; else it opens one when a stage first needs it);
    each stage's wall time goes into the manifest's `seconds` and its start into `phase_started_at`
    (Run.record_seconds).
    With `count_jobs` (a benchmark's measure) each stage's number of Spark jobs goes into
    `spark_jobs`; off by default: reading Spark's status leaves Java proxies whose collection,
    should a Ctrl-C land in it, would swallow the interrupt.
    Holds the run directory's lock throughout: a second run on the same directory is refused.
    """
    with run_directory(config):
        layout = Run(config.out)

        @contextmanager
        def timed(phase: str):
            begun, started, jobs = time.time(), time.perf_counter(), jobs_started() if count_jobs else 0
            yield
            layout.record_seconds(phase, time.perf_counter() - started, started_at=begun)
            if count_jobs:
                layout.record_seconds(phase, jobs_started() - jobs, "spark_jobs")

        with run_engine(
            layout, config, spark
        ) as engine:  # a Spark session is opened when a stage first needs it (a refused run starts no JVM)
            with timed("prepare"):  # on a resumed run: the check of its recorded settings
                prepare(config, progress, engine)
            for s in range(1, config.outer_steps + 1):
                if s in layout.read_manifest()["steps_done"]:
                    continue
                if not engine.solves_users_in_release:  # federated clients solve their embeddings in the stats round
                    with timed(f"step-{s}/user_update"):
                        user_stage.run_step(engine, layout.root, s)
                if config.item_update not in ("dpsgd", *FIXED_UPDATES) and covers_items(
                    layout.read_manifest()
                ):  # AM-DPSGD releases no statistics, the starting point none
                    with timed(f"step-{s}/stats"):
                        summary = release_stats(layout, s, engine)
                    if "kernel_task_seconds" in summary:  # the Spark and local jobs' (Beam's runners time their own)
                        layout.record_seconds(f"step-{s}/stats", summary["kernel_task_seconds"], "kernel_seconds")
                with timed(f"step-{s}/item_update"):
                    item_update(layout, s, progress)
            with timed("final_user_update"):
                user_stage.run_step(engine, layout.root, None)
        with timed("evaluation"):
            metrics = evaluate(layout, metrics_at)
        return metrics
