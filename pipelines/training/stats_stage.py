"""The stats release of one outer step: the stage between a step's user update and its item update.

`release_stats` makes step s's stats release on the run's engine (Spark, Beam, or the federated
round) with the job `stats_job_for` derives from the run's settings; `stats_job_of_run` is the same
job for the stage entry points (`ssp stats --run`, `pipelines/stats.py`, `python -m
pipelines.beam_stats`); `run_engine` holds the run's engine for the duration of a stage.

Privacy: the release goes through the run's ledger and accountant (pipelines.releases.stats_job);
this module only names its inputs and settings.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

from pipelines.base import logs
from pipelines.engines.engine import Engine, engine_of
from pipelines.releases import stats_job
from pipelines.training.run_dir import Run, config_of
from pipelines.training.settings import STATS_UPDATES, TrainConfig
from schemas.errors import UserError


def covers_items(manifest: dict) -> bool:
    """Whether the run's statistics cover any item: prepare found none whose DP count clears the
    noise when `stats_cover` is 0 (prepare.stats_catalog); such a run makes no stats release and
    keeps its starting point, as `--item-update none` does."""
    return manifest["prepared"].get("stats_cover") != 0


def stats_job_of_run(root: str, step: int) -> stats_job.StatsJob | None:
    """`ssp stats --run RUN --step S`: the prepared run's stats job of step S, from its manifest;
    None (and one line saying so) when its statistics cover no item: nothing to release."""
    run = Run(root)
    manifest = run.prepared()
    config = config_of(run, manifest)
    if config.item_update not in STATS_UPDATES:
        raise UserError(f"{root} runs --item-update {config.item_update}, which releases no statistics")
    if not 1 <= step <= config.outer_steps:
        raise UserError(f"--step must be one of the run's outer steps 1..{config.outer_steps}, got {step}")
    if not covers_items(manifest):
        logs.warn(
            f"{root}: no catalog item's DP count clears the noise, so step {step} has no statistics to release (the "
            "run keeps its starting point)"
        )
        return None
    return stats_job_for(run, config, step, manifest["prepared"]["stats_items"])


def stats_job_for(run: Run, config: TrainConfig, step: int, stats_items: str) -> stats_job.StatsJob:
    """The stats release of outer step `step` (the job `pipelines/stats.py` or the Beam pipeline runs)."""
    return stats_job.StatsJob(
        run.stats_rows,
        run.user_embeddings(step),
        stats_items,
        run.counts,
        run.stats(step),
        config.settings(),
        config.privacy(),
        step=step,
        ledger_path=run.ledger,
        seed_file=config.seed_file,
        shards=config.shards,
        expansion=run.item_embeddings(step - 1) if config.loss == "logistic" else None,
    )


def release_stats(run: Run, step: int, engine: Engine) -> dict:
    """Stage 2b of step s: release the noised statistics on `engine`, the run's; returns the step summary."""
    manifest = run.prepared()
    config = config_of(run, manifest)
    return engine.release_stats(stats_job_for(run, config, step, manifest["prepared"]["stats_items"]))


@contextmanager
def run_engine(
    run: Run, config: TrainConfig, spark=None, master: str | None = None, app: str = "ssp-train"
) -> Iterator[Engine]:
    """The run's engine (--engine) for the duration of the block: a Spark engine's session (given,
    or opened on first use), a Beam engine's scratch folder in the run, the federated rounds of its steps."""

    def rounds(job: stats_job.StatsJob):
        from pipelines.engines import federated

        return federated.FederatedJob(
            job,
            run.centred,
            run.item_embeddings(job.step - 1),
            config.lambda_u,
            config.gravity,
            config.federated_dropout,
            config.federated_max_dropout,
            scratch=run.private("federated"),
            server=config.federated_server,
        )

    with engine_of(
        config.engine, app=app, master=master, spark=spark, scratch=run.private("beam"), rounds=rounds
    ) as engine:
        yield engine
