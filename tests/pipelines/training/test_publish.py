"""`ssp publish`: the ledger gate, what is copied, atomicity and idempotence (local and gs://).

The runs here are built by hand (a manifest, a real ledger, an encoder folder, an item embeddings
table), so each refusal can be staged precisely; the staged run in test_train publishes a real one.
"""

import json
import os

import pyarrow as pa
import pytest

from pipelines.data.datasets import MANIFEST as DATA_MANIFEST
from pipelines.training.publish import PUBLISHED, publish
from pipelines.training.run_dir import Run
from privacy import accounting
from privacy.ledger import Ledger
from privacy.seeds import SeedFile
from schemas import storage
from schemas.tables import ITEM_EMBEDDINGS
from ssp import cli


def finished_run(
    root: str,
    epsilon=1.0,
    delta=1e-5,
    spent_multiplier=8.0,
    steps_done=(1, 2),
    non_private=False,
    encoder_committed=True,
    protocol="rmse",
) -> Run:
    """A run directory as the last item update leaves it."""
    run = Run(root)
    data = run.private("data")
    storage.write_json({"public_features": ["genres", "year"]}, storage.join(data, DATA_MANIFEST))
    storage.write_table(
        pa.table({"item_id": [1, 2, 3], "title": ["One", None, "Three"]}), storage.join(data, "items.parquet")
    )
    config = {
        "outer_steps": 2,
        "epsilon": epsilon,
        "delta": delta,
        "non_private": non_private,
        "unit": "user",
        "protocol": protocol,
        "dim": 2,
        "popularity_column": protocol == "recall",
        "clip_u": 1.0,
        "data": "secret/location",
        "seed_file": None,
        "lambda_u": 0.1,
        "gravity": 0.0,
        "encoder": "features",
    }
    run.write_manifest(
        {
            "config": config,
            "steps_done": list(steps_done),
            "status": "running",
            "prepared": {
                "data": data,
                "items": storage.join(data, "items.parquet"),
                "stats_items": "",
                "mean": 3.5,
                "started_at": 0,
                "at": 0,
            },
        }
    )
    ledger = Ledger.create(run.ledger, epsilon=epsilon, delta=delta)
    ledger.record("counts", accounting.gaussian_event(spent_multiplier), "ab12")
    storage.write_table(
        pa.table({"item_id": [1, 2, 3], "embedding": [[0.1, 0.2], [0.3, 0.4], [0.5, 0.6]]}, schema=ITEM_EMBEDDINGS),
        run.path("item_embeddings.parquet"),
    )
    with storage.write_folder(run.path("encoder")) as local:
        for name, payload in (("saved_model.pb", b"model"), ("variables/variables.index", b"index")):
            storage.write_json({"bytes": payload.decode()}, os.path.join(local, name))
    if not encoder_committed:  # an export that died before its commit
        storage.remove(run.path("encoder", storage.SUCCESS))
    seeds = SeedFile.create(run.private("seed"))
    seeds.bind(0, "ab12", ledger.identity)  # the run's secret seed, witness of its release
    storage.write_table(pa.table({"item_id": pa.array([1, 2, 3], pa.int64()), "count": [4.0, 1.0, 9.0]}), run.counts)
    seeds.record_output(
        0, seeds.digest_table(run.counts)
    )  # the counts release, as pipelines.releases.counts records it
    return run


def test_publishes_encoder_embeddings_and_privacy_summary_only(tmp_path):
    run = finished_run(str(tmp_path / "run"))
    marker = publish(run, str(tmp_path / "out"))
    assert sorted(os.listdir(tmp_path / "out")) == [
        PUBLISHED,
        "counts.parquet",
        "encoder",
        "item_embeddings.parquet",
        "model.json",
        "privacy.json",
        "privacy.md",
        "recommender",
        "titles.parquet",
    ]
    assert marker["contents"] == [
        "counts.parquet",
        "encoder/",
        "item_embeddings.parquet",
        "model.json",
        "privacy.json",
        "privacy.md",
        "recommender/",
        "titles.parquet",
    ]
    titles = storage.read_table(str(tmp_path / "out" / "titles.parquet"))  # the catalog's titled items only
    assert titles.to_pylist() == [{"item_id": 1, "title": "One"}, {"item_id": 3, "title": "Three"}]
    assert sorted(marker["encoder_files"]) == [
        "encoder/_SUCCESS",
        "encoder/saved_model.pb",
        "encoder/variables/variables.index",
    ]  # a committed folder
    assert storage.read_table(str(tmp_path / "out" / "item_embeddings.parquet")).equals(
        storage.read_table(run.path("item_embeddings.parquet"))
    )
    summary = json.load(open(tmp_path / "out" / "privacy.json"))
    spent = Ledger.open(run.ledger).epsilon_spent()
    assert summary["epsilon_spent"] == pytest.approx(spent) and 0 < spent <= 1.0
    assert [row["name"] for row in summary["releases"]] == ["counts"] and summary["public_features"] == [
        "genres",
        "year",
    ]
    assert "data" not in summary["settings"] and "secret" not in json.dumps(summary)
    report = (tmp_path / "out" / "privacy.md").read_text()  # the same, for a reviewer
    assert (
        "**Unit of privacy: user.**" in report
        and "**epsilon 1, delta 1e-05**" in report
        and "within a factor e^epsilon (e^1 = 2.72 here), plus delta" in report
        and f"Spent: epsilon {spent:.4g} of 1" in report
    )
    assert "| 0 | `counts` |" in report and f"Gaussian, noise multiplier {8:.4g}" in report and "genres, year" in report
    assert (
        "secret/location" not in report and "sqrt(K + 1)" in report
    )  # the private data location is not a public setting
    assert str(tmp_path) not in report and report.startswith(
        "# Privacy report: run `run`"
    )  # no local path: the run's folder name
    assert not [name for name in os.listdir(tmp_path) if name.startswith(".out.tmp")]
    assert json.load(open(tmp_path / "out" / "model.json")) == {  # the user side's public settings, for ssp recommend
        "protocol": "rmse",
        "dim": 2,
        "loss": "square",
        "lambda_u": 0.1,
        "gravity": 0.0,
        "dp_mean": 3.5,
        "rating_range": [0.5, 5.0],
        "positive_threshold": None,
        "encoder": "features",
        "feature_families": ["genres", "year"],
        "popularity_column": False,
        "biases": False,
        "lambda_bias": None,
        "user_prior": 0.0,
        "confidence_alpha": None,
    }  # a run recorded without biases (or a user prior) has none
    # publishing the same run again is a no-op; another run to the same place is refused
    assert publish(run, str(tmp_path / "out")) == marker
    other = finished_run(str(tmp_path / "other"))
    with pytest.raises(ValueError, match="already holds the publication of run"):
        publish(other, str(tmp_path / "out"))


@pytest.mark.parametrize(
    "change, message",
    [
        (dict(steps_done=(1,)), "outer step 2 is not done"),
        (dict(non_private=True), "non-private run"),
        (dict(spent_multiplier=0.3), "exceeds the run's budget"),
        (dict(encoder_committed=False), r"encoder is missing"),
    ],
)
def test_refusals_write_nothing(tmp_path, change, message):
    kwargs = dict(change)
    if "spent_multiplier" in kwargs:  # a ledger whose budget was raised to let a release through, then set back
        run = finished_run(str(tmp_path / "run"), epsilon=100.0, **kwargs)
        ledger = Ledger.open(run.ledger)
        ledger.budget["epsilon"] = 1.0
        ledger.save()
        manifest = run.read_manifest()
        manifest["config"]["epsilon"] = 1.0
        run.write_manifest(manifest)
    else:
        run = finished_run(str(tmp_path / "run"), **kwargs)
    with pytest.raises(ValueError, match=message):
        publish(run, str(tmp_path / "out"))
    assert sorted(os.listdir(tmp_path)) == ["run"]


def test_a_shipped_counts_table_must_be_the_recorded_release(tmp_path):
    from pipelines.training.publish import privacy_summary

    run = finished_run(str(tmp_path / "run"), protocol="recall")
    assert privacy_summary(run)["releases"][0]["name"] == "counts"
    storage.write_table(
        pa.table({"item_id": pa.array([1, 2, 3], pa.int64()), "count": [4.0, 2.0, 9.0]}), run.counts
    )  # exact counts, say
    with pytest.raises(ValueError, match="is not the DP counts release recorded in the ledger"):
        publish(run, str(tmp_path / "out"))
    assert sorted(os.listdir(tmp_path)) == ["run"]


def test_a_ledger_with_another_budget_is_refused_by_the_cli(tmp_path, capsys):
    run = finished_run(str(tmp_path / "run"))
    manifest = run.read_manifest()
    manifest["config"]["epsilon"] = 0.5  # the run was configured for less than its ledger allows
    run.write_manifest(manifest)
    assert cli.main(["publish", "--run", run.root, "--to", str(tmp_path / "out")]) == 2
    assert capsys.readouterr().err.strip().endswith("is not the run's (epsilon 0.5, delta 1e-05); not published")
    assert not (tmp_path / "out").exists()


def test_publishes_to_gcs(tmp_path, gcs_path):
    run = finished_run(str(tmp_path / "run"))
    publish(run, gcs_path)
    assert storage.read_json(storage.join(gcs_path, PUBLISHED))["run"] == run.root
    assert storage.read_table(storage.join(gcs_path, "item_embeddings.parquet")).num_rows == 3
    assert storage.read_json(storage.join(gcs_path, "encoder", "saved_model.pb")) == {"bytes": "model"}
