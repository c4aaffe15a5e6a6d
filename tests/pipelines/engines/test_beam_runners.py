"""The stats job on Beam runners beyond the plain DirectRunner: the PortableRunner (embedded job server,
LOOPBACK workers) and the DirectRunner in multi_processing mode give Spark's release on the same inputs
and seed, with one ledger release per run."""

import numpy as np
import pyarrow as pa
import pytest
from apache_beam.options.pipeline_options import PipelineOptions

from pipelines.engines import beam_release, spark_stats
from pipelines.releases import stats_job
from pipelines.releases.release import PrivacySettings
from pipelines.releases.stats_core import StatsSettings
from privacy.ledger import Ledger
from privacy.seeds import SeedFile
from schemas import storage, tables
from tests.pipelines.stats_inputs import registered, write_inputs

pytestmark = pytest.mark.beam  # Beam's PortableRunner and multi-processing DirectRunner

RUNNERS = {
    "portable": ["--runner", "PortableRunner", "--job_endpoint", "embed", "--environment_type", "LOOPBACK"],
    "multi_processing": ["--direct_num_workers", "2", "--direct_running_mode", "multi_processing"],
}

# 5 users, 6 catalog items (item 60 has no rows); users 1 and 3's embeddings and three labels exceed the clips.
INTERACTIONS = [
    (1, 10, 4.0),
    (1, 20, -3.0),
    (1, 50, 1.0),
    (2, 10, 1.5),
    (2, 30, 2.5),
    (3, 10, 0.5),
    (3, 20, 1.0),
    (3, 30, -1.0),
    (4, 40, 2.0),
    (4, 50, -0.5),
    (5, 20, 0.25),
    (5, 40, 1.75),
]
EMBEDDINGS = {1: [1.2, 1.6], 2: [0.3, -0.4], 3: [-1.0, 0.5], 4: [0.1, 0.9], 5: [-0.6, -0.2]}
COUNTS = {10: 3.0, 20: 2.0, 30: 1.0, 40: 4.0, 50: 2.5, 60: 5.0}
SEED = bytes(range(32))


def write_split_inputs(folder):
    """The inputs, the interactions in 3 part files of 4 rows (user 2's rows straddle two of them)."""
    paths = write_inputs(folder, INTERACTIONS, EMBEDDINGS, COUNTS, list(COUNTS))
    users, items, labels = (list(column) for column in zip(*INTERACTIONS, strict=True))
    paths["interactions"] = storage.join(str(folder), "interactions-split.parquet")
    columns = {"user_id": users, "item_id": items, "label": labels, "timestamp": [0] * len(users)}
    storage.write_table(pa.table(columns, schema=tables.INTERACTIONS), paths["interactions"], rows_per_file=4)
    assert len(storage.table_files(paths["interactions"])) == 3
    return paths


def release(paths, out, seed_file, shards):
    """The job both engines run: the same inputs, settings, noise and seed; its own ledger under `out`."""
    job = stats_job.StatsJob(
        paths["interactions"],
        paths["user_embeddings"],
        paths["items"],
        paths["counts"],
        str(out),
        StatsSettings(2, 1.0, 2.0, "user", 1.5),
        PrivacySettings(noise_multiplier=0.8),
        seed_file=SeedFile.create(str(seed_file), SEED).path,
        shards=shards,
    )
    return registered(job)


def read_stats(out):
    table = tables.validate_stats(storage.read_table(str(out / "resample-0.parquet")))
    return table.schema.metadata, table.sort_by("item_id")


@pytest.mark.parametrize("runner", list(RUNNERS))
def test_runner_gives_sparks_release(spark, tmp_path, runner):
    paths = write_split_inputs(tmp_path / "in")
    options = PipelineOptions(RUNNERS[runner])
    beam_summary = beam_release.run(release(paths, tmp_path / "beam", tmp_path / "seed-beam", 3), options)
    spark_summary = spark_stats.run(release(paths, tmp_path / "spark", tmp_path / "seed-spark", 2), spark)

    assert beam_summary["releases"] == spark_summary["releases"] == [1]  # release 0: the counts
    assert beam_summary["items"] == spark_summary["items"] == 6
    for engine in ("beam", "spark"):
        rows = Ledger.open(str(tmp_path / engine / "ledger.parquet")).rows
        assert [row["name"] for row in rows] == ["counts", "step-1/stats/r0"]  # exactly one stats release per run
    (beam_meta, beam), (spark_meta, spark_table) = read_stats(tmp_path / "beam"), read_stats(tmp_path / "spark")
    assert beam_meta == spark_meta
    assert beam["item_id"].to_pylist() == spark_table["item_id"].to_pylist() == list(COUNTS)
    for column in ("a_upper", "b"):  # partial sums in runner-dependent order: equal to float64 rounding
        got, want = np.array(beam[column].to_pylist()), np.array(spark_table[column].to_pylist())
        np.testing.assert_allclose(got, want, rtol=1e-12, atol=1e-12)
    assert np.all(np.array(beam["b"].to_pylist())[-1] != 0)  # item 60 has no rows: its row is the (shared) noise alone
    assert len(storage.table_files(str(tmp_path / "beam" / "resample-0.parquet"))) == 3  # shards 0, 1, 2 by item_id % 3


@pytest.mark.parametrize("flags", [[], ["--runner", "DirectRunner"]])
def test_the_direct_runner_runs_in_process_and_downloads_no_prism(flags, caplog):
    """Beam's DirectRunner first tries to download the Prism runner from GitHub; the engines' pipelines
    name its in-process FnApiRunner instead (any other runner is left as given)."""
    import apache_beam as beam

    caplog.set_level("INFO", logger="apache_beam")
    options = beam_release.pinned(PipelineOptions(flags))
    with beam.Pipeline(options=options) as pipeline:
        _ = pipeline | beam.Create([1, 2, 3]) | beam.CombineGlobally(sum) | beam.Map(lambda total: total == 6)
    assert options.get_all_options()["runner"] == "FnApiRunner"
    assert not [record for record in caplog.records if "prism" in record.getMessage().lower()]
    assert beam_release.pinned(PipelineOptions(["--runner", "PortableRunner"])).get_all_options()["runner"] == (
        "PortableRunner"
    )
