"""`ssp train` with every path on gs:// (gcp-storage-emulator) equals the same run on a local disk."""

import shutil

import numpy as np
import pytest
import tensorflow as tf

from pipelines.base.lock import LOCK_NAME
from pipelines.data import ingest
from pipelines.training import settings, stages
from pipelines.training.publish import PUBLISHED
from pipelines.training.run_dir import Run
from privacy.ledger import Ledger
from privacy.seeds import SeedFile
from schemas import storage
from ssp import cli

SETTINGS = dict(epsilon=10.0, outer_steps=1, epochs=2, dim=8)
RATINGS = 20_000
NOT_COMPARED = ("seconds", "step_seconds", "outputs")  # timings, and where the outputs are


def _embed(encoder: str, item_ids: list[int]) -> np.ndarray:
    with storage.read_folder(encoder) as local:
        return (
            tf.saved_model.load(local)
            .signatures["embed"](item_ids=tf.constant(item_ids, tf.int64))["embedding"]
            .numpy()
        )


def test_gs_run_equals_the_local_run(spark, gcs_path, tmp_path, capsys):
    # `spark` comes first: its Python workers may predate the emulator's settings, which must reach them anyway
    local_source = tmp_path / "ml-latest-small"  # the bundled folder's first RATINGS ratings: a quicker run
    shutil.copytree(ingest.BUNDLED, local_source)
    lines = (local_source / "ratings.csv").read_text().splitlines(keepends=True)
    (local_source / "ratings.csv").write_text("".join(lines[: RATINGS + 1]))
    fs, source = storage.filesystem(f"{gcs_path}/ml-latest-small")
    for name in ("movies.csv", "ratings.csv", "tags.csv"):
        fs.put_file(str(local_source / name), f"{source}/{name}")
    root = f"{gcs_path}/run"
    flags = [f"--{key.replace('_', '-')}={value}" for key, value in SETTINGS.items()]
    status = cli.main(["train", "--data", f"{gcs_path}/ml-latest-small", "--out", root, *flags])
    assert status == 0, capsys.readouterr().err
    on_gs = storage.read_json(f"{root}/metrics.json")

    # the same run on a local disk, with the gs:// run's seed: the same releases, the same metrics
    seed = SeedFile.create(
        str(tmp_path / "seed"), SeedFile.load(f"{root}/private/seed").seed
    ).path  # a seed file serves one ledger
    local = stages.run(
        settings.TrainConfig.create(data=str(local_source), out=str(tmp_path / "run"), seed_file=seed, **SETTINGS),
        spark=spark,
        progress=False,
    )
    assert {k: v for k, v in on_gs.items() if k not in NOT_COMPARED} == {
        k: v for k, v in storage.read_json(str(tmp_path / "run" / "metrics.json")).items() if k not in NOT_COMPARED
    }
    assert on_gs["test_rmse"] == local["test_rmse"] and on_gs["epsilon_spent"] == local[
        "epsilon_spent"
    ] == pytest.approx(10.0, rel=1e-6)
    ledgers = [
        [{k: v for k, v in row.items() if k != "recorded_at"} for row in Ledger.open(f"{run}/ledger.parquet").rows]
        for run in (root, str(tmp_path / "run"))
    ]
    assert ledgers[0] == ledgers[1] and [row["name"] for row in ledgers[0]] == ["counts", "mean", "step-1/stats/r0"]

    # every output is on gs://, complete
    run = Run(root)
    for path in (
        run.manifest_path,
        run.ledger,
        run.counts,
        run.step(1, "stats", "resample-0.parquet"),
        run.step(1, "stats", "release.json"),
        run.path("encoder"),
        run.path("item_embeddings.parquet"),
        run.path("metrics.json"),
        run.private("seed"),
        run.private("data", "manifest.json"),
        run.private("split", "test.parquet"),
        run.centred,
        run.user_embeddings(1),
        run.user_embeddings(None),
    ):
        assert storage.exists(path), path
    for step in (0, 1):
        assert storage.exists(run.item_embeddings(step)) and storage.exists(run.checkpoint(step)), step
    assert storage.read_json(run.manifest_path)["steps_done"] == [1]
    assert not storage.exists(run.path(LOCK_NAME))  # released
    embeddings = storage.read_table(run.path("item_embeddings.parquet"))
    assert embeddings.equals(storage.read_table(str(tmp_path / "run" / "item_embeddings.parquet")))
    items = embeddings["item_id"].to_pylist()[:5]
    np.testing.assert_array_equal(_embed(run.path("encoder"), items), _embed(str(tmp_path / "run" / "encoder"), items))
    np.testing.assert_allclose(
        _embed(run.path("encoder"), items), np.array(embeddings["embedding"].to_pylist()[:5]), rtol=1e-6
    )

    # and published from gs:// to gs://
    assert cli.main(["publish", "--run", root, "--to", f"{gcs_path}/published"]) == 0, capsys.readouterr().err
    assert storage.exists(f"{gcs_path}/published/{PUBLISHED}")
    np.testing.assert_array_equal(_embed(f"{gcs_path}/published/encoder", items), _embed(run.path("encoder"), items))
