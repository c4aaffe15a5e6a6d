"""The local engine (this process, no JVM) makes the Spark engine's releases bit for bit, and a whole
`ssp train --engine local` run gives the metrics of the same run on Spark."""

import os

import pytest

from pipelines.engines.local import LocalEngine
from pipelines.engines.prepare_spark import SparkEngine
from pipelines.releases.release import PrivacySettings
from pipelines.releases.stats_core import StatsSettings
from privacy.seeds import SeedFile
from schemas import storage
from tests.pipelines.engines.test_beam_release import make_job, write_random_inputs
from tests.pipelines.releases.test_logistic_stats import inputs as logistic_inputs


def released_tables(out) -> dict[str, object]:
    """Every released table of a stats folder, its rows sorted by item."""
    return {
        name: storage.read_table(str(out / name)).sort_by("item_id")
        for name in sorted(os.listdir(out))
        if name.startswith("resample-")
    }


@pytest.mark.parametrize("loss", ["square", "logistic"])
def test_the_local_statistics_release_is_the_spark_release_bit_for_bit(spark, tmp_path, loss):
    if loss == "square":
        paths = write_random_inputs(tmp_path / "in")
        settings, extra = StatsSettings(3, 1.0, 4.0, "user", 2.0), {}
    else:
        paths = logistic_inputs(tmp_path / "in")[0]
        settings, extra = StatsSettings(3, 1.0, 1.0, "user", 2.0, 0.0, "logistic"), {"expansion": paths["expansion"]}
    seed = SeedFile.create(str(tmp_path / "seed")).seed
    summaries, tables = {}, {}
    for name, engine in (("spark", SparkEngine(spark)), ("local", LocalEngine())):
        seed_file = SeedFile.create(
            str(tmp_path / f"seed-{name}"), seed
        ).path  # one seed, a seed file per run (it serves one ledger)
        job = make_job(
            paths,
            tmp_path / name,
            PrivacySettings(noise_multiplier=0.7, resamples=2),
            settings,
            seed_file=seed_file,
            shards=3,
            **extra,
        )
        summaries[name] = engine.release_stats(job)
        tables[name] = released_tables(tmp_path / name)
    assert summaries["local"]["releases"] == summaries["spark"]["releases"] == [1, 2]
    assert summaries["local"]["kernel_task_seconds"] > 0
    assert list(tables["local"]) == list(tables["spark"]) == ["resample-0.parquet", "resample-1.parquet"]
    for name, table in tables["local"].items():
        assert table.equals(tables["spark"][name]) and table.schema.metadata == tables["spark"][name].schema.metadata, (
            name
        )
    assert sorted(os.listdir(tmp_path / "local" / "resample-0.parquet")) == sorted(
        os.listdir(tmp_path / "spark" / "resample-0.parquet")
    )


def test_a_whole_run_on_the_local_engine_is_the_spark_run(spark, tmp_path, small_data):
    """`ssp train --engine local` (no JVM) and the same run on Spark, one seed: the same releases,
    item embeddings and metrics."""
    from pipelines.training import stages
    from pipelines.training.run_dir import Run
    from pipelines.training.settings import TrainConfig
    from privacy.ledger import Ledger

    seed = SeedFile.create(str(tmp_path / "seed")).seed
    metrics = {}
    for engine in ("spark", "local"):
        seed_file = SeedFile.create(str(tmp_path / f"seed-{engine}"), seed).path
        config = TrainConfig.create(
            data=small_data,
            out=str(tmp_path / engine),
            epsilon=5.0,
            outer_steps=1,
            epochs=3,
            dim=8,
            engine=engine,
            seed_file=seed_file,
        )
        metrics[engine] = stages.run(config, spark=spark if engine == "spark" else None, progress=False)
    runs = {engine: Run(str(tmp_path / engine)) for engine in metrics}
    assert [row["name"] for row in Ledger.open(runs["local"].ledger).rows] == [
        row["name"] for row in Ledger.open(runs["spark"].ledger).rows
    ]
    assert storage.read_table(runs["local"].item_embeddings(1)).equals(
        storage.read_table(runs["spark"].item_embeddings(1))
    )
    assert metrics["local"]["test_rmse"] == metrics["spark"]["test_rmse"]
