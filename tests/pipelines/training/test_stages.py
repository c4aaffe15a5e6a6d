"""The end-to-end training run: quality and metrics on the bundled data, on Spark; resume, seed reuse,
stage commands, coverage and the ranking protocol on a small synthetic data set (their properties do
not depend on the data's size), on the local engine, which releases Spark's bits
(tests/pipelines/engines/test_local.py), except the stage commands: a DAG's tasks, on Spark. The
resumed run and the stage commands are compared with one whole run of the same settings and seed
(`reference`)."""

import json
import os

import numpy as np
import pytest

from pipelines.data import splits
from pipelines.training import evaluation, prepare, run_dir, settings, stages, stats_stage
from pipelines.training.model import build_encoder, item_vectors, normalise_embeddings, zero_item_biases
from privacy.ledger import Ledger
from privacy.seeds import SeedFile
from schemas import storage
from tests.pipelines.conftest import SMALL_ITEMS, SMALL_RATINGS, SMALL_USERS
from trainer import curves, ssp


def test_non_private_run_reaches_the_als_regime(tmp_path):
    """On the local engine (Spark's bits: tests/pipelines/engines/test_local.py; whole runs on Spark:
    there and tests/pipelines/training/test_train_gcs.py)."""
    assert (
        settings.TrainConfig.create(non_private=True).outer_steps == settings.NON_PRIVATE_OUTER_STEPS
    )  # no budget to split: until it converges
    # near the default 30 here (0.8645 against 0.8622 at 30 and 0.8632 at 10), in a sixth of the item updates' time
    epochs = 5
    metrics = stages.run(
        settings.TrainConfig.create(
            out=str(tmp_path / "run"), non_private=True, outer_steps=2, epochs=epochs, engine="local"
        ),
        progress=False,
    )
    # Plain ALS: 0.904 on this split (seed 1234); 0.880, 0.881, 0.897 with split seeds 1, 2, 3, and 0.878
    # on the former permutation split: which ratings fall in the 10% test part moves it by ~0.02.
    assert metrics["test_rmse"] < 0.91
    assert metrics["test_rmse"] < metrics["test_mean_predictor_rmse"] - 0.1
    assert len(metrics["test_rmse_sliced"]) == 5 and all(v > 0 for v in metrics["test_rmse_sliced"])
    assert metrics["epsilon_spent"] == float("inf") and metrics["non_private"]
    on_disk = json.load(open(tmp_path / "run" / "metrics.json"))
    for key in ("protocol", "test_rmse", "valid_rmse", "epsilon_spent", "delta", "sliced", "seconds"):
        assert key in on_disk
    assert on_disk["epsilon_spent"] == "inf"
    assert storage.read_table(str(tmp_path / "run" / "item_embeddings.parquet")).num_rows == 9742  # every catalog item
    # the curves: each outer step's SSP losses by epoch in metrics.json and in TensorBoard's event files
    losses = on_disk["curves"]["item_update_loss"]
    assert sorted(losses) == ["1", "2"] and all(
        len(losses[s]) == epochs and np.all(np.isfinite(losses[s])) for s in losses
    )
    assert losses["1"][-1] < losses["1"][0]  # the item update descends
    assert tensorboard_scalars(tmp_path / "run" / "tensorboard" / "step-2") == {
        "item_update/loss": [(e, pytest.approx(v, rel=1e-6)) for e, v in enumerate(losses["2"], 1)]
    }
    import tensorflow as tf  # the loss's description (TensorBoard shows it) says why it is negative

    events = next((tmp_path / "run" / "tensorboard" / "step-2").glob("events.*"))
    descriptions = {
        value.metadata.summary_description
        for event in tf.compat.v1.train.summary_iterator(str(events))
        for value in event.summary.value
    }
    assert descriptions == {curves.LOSS_DESCRIPTION} and "Negative values are expected" in curves.LOSS_DESCRIPTION
    by_step = tensorboard_scalars(tmp_path / "run" / "tensorboard" / "run")
    assert by_step["item_update/last_loss"] == [
        (1, pytest.approx(losses["1"][-1], rel=1e-6)),
        (2, pytest.approx(losses["2"][-1], rel=1e-6)),
    ]
    assert by_step["final/test_rmse"] == [(2, pytest.approx(metrics["test_rmse"], rel=1e-6))]
    assert sorted(os.listdir(tmp_path / "run" / "private")) == [
        ".ssp-private",  # the folder is its owner's alone, and so is what is written in it
        "data",
        "seed",
        "split",
        "stats_rows.parquet",
        "step-1",
        "step-2",
        "train_centred.parquet",
        "user_embeddings.parquet",
    ]


def tensorboard_scalars(folder) -> dict:
    """{tag: [(step, value)]} of the TensorBoard event files in `folder`."""
    import tensorflow as tf

    scalars = {}
    for name in sorted(os.listdir(folder)):
        if name.startswith("events."):
            for event in tf.compat.v1.train.summary_iterator(str(folder / name)):
                for value in event.summary.value:
                    scalars.setdefault(value.tag, []).append((event.step, float(tf.make_ndarray(value.tensor))))
    return scalars


def small(out, data, **kwargs):
    """The small data set's settings, on the local engine unless given."""
    kwargs = {"engine": "local", **kwargs}
    return settings.TrainConfig.create(data=data, out=str(out), epsilon=5.0, outer_steps=2, epochs=3, dim=8, **kwargs)


SEED = bytes(range(7, 39))  # the seed of the runs compared with `reference`


def seed_file(path) -> str:
    """A seed file of its own holding SEED (a seed file serves one ledger)."""
    return SeedFile.create(str(path), SEED).path


@pytest.fixture(scope="module")
def reference(small_data, tmp_path_factory):
    """One whole run of `small` settings with SEED, in one process: (its folder, its metrics)."""
    folder = tmp_path_factory.mktemp("reference")
    metrics = stages.run(small(folder / "run", small_data, seed_file=seed_file(folder / "seed")), progress=False)
    return folder / "run", metrics


def test_interrupted_run_resumes_without_spending_twice(tmp_path, monkeypatch, small_data, reference):
    calls = {"n": 0}
    real_train = ssp.train

    def dies_in_step_two(*args, **kwargs):
        calls["n"] += 1
        if calls["n"] == 2:
            raise KeyboardInterrupt("killed")
        return real_train(*args, **kwargs)

    monkeypatch.setattr(ssp, "train", dies_in_step_two)
    seed = seed_file(tmp_path / "seed")
    with pytest.raises(KeyboardInterrupt):
        stages.run(small(tmp_path / "run", small_data, seed_file=seed), progress=False)
    manifest = json.load(open(tmp_path / "run" / "manifest.json"))
    assert manifest["steps_done"] == [1] and manifest["status"] == "running"
    step1 = open(tmp_path / "run" / "step-1" / "item_embeddings.parquet" / "part-00000.parquet", "rb").read()
    monkeypatch.setattr(ssp, "train", real_train)
    metrics = stages.run(small(tmp_path / "run", small_data, seed_file=seed), progress=False)
    ledger = Ledger.open(str(tmp_path / "run" / "ledger.parquet"))
    assert [row["name"] for row in ledger.rows] == ["counts", "mean", "step-1/stats/r0", "step-2/stats/r0"]
    assert metrics["epsilon_spent"] == pytest.approx(5.0, rel=1e-6)
    assert open(tmp_path / "run" / "step-1" / "item_embeddings.parquet" / "part-00000.parquet", "rb").read() == step1
    # the finished run started again an hour later (its marks moved back an hour) reports its own time, not the hour
    manifest = json.load(open(tmp_path / "run" / "manifest.json"))
    manifest["prepared"]["started_at"] -= 3600
    manifest["prepared"]["at"] -= 3600
    manifest["step_done_at"] = {step: at - 3600 for step, at in manifest["step_done_at"].items()}
    (tmp_path / "run" / "manifest.json").write_text(json.dumps(manifest))
    again = stages.run(small(tmp_path / "run", small_data, seed_file=seed), progress=False)
    assert again["test_rmse"] == metrics["test_rmse"] and again["seconds"] < 600
    # a run with other settings in the same directory is refused
    with pytest.raises(ValueError, match=r"holds a run with other settings \(epsilon\)"):
        stages.run(small(tmp_path / "run", small_data, seed_file=seed).replace(epsilon=1.0), progress=False)

    # the resumed run's releases are byte for byte those of the run made in one go with its seed (`reference`)
    whole, whole_metrics = reference
    for step in (1, 2):
        folder = tmp_path / "run" / f"step-{step}" / "stats" / "resample-0.parquet"
        assert sorted(os.listdir(folder)) == sorted(os.listdir(whole / f"step-{step}" / "stats" / "resample-0.parquet"))
        for name in os.listdir(folder):
            assert (
                open(folder / name, "rb").read()
                == open(whole / f"step-{step}" / "stats" / "resample-0.parquet" / name, "rb").read()
            )
    assert whole_metrics["test_rmse"] == pytest.approx(metrics["test_rmse"], abs=1e-9)


def test_holdout_zero_is_the_production_mode(tmp_path, small_data):
    """--holdout 0: every row trains, and evaluate records the run (epsilon, releases, timings) and
    says there is no held-out data instead of reporting test metrics."""
    config = settings.TrainConfig.create(
        data=small_data,
        out=str(tmp_path / "run"),
        epsilon=5.0,
        outer_steps=1,
        epochs=3,
        dim=8,
        holdout=0.0,
        engine="local",
    )
    metrics = stages.run(config, progress=False)
    split = json.load(open(tmp_path / "run" / "private" / "split" / "split.json"))
    assert split["holdout"] == 0.0 and split["sizes"]["train"]["rows"] == SMALL_USERS * SMALL_RATINGS  # every rating
    assert split["sizes"]["valid"]["rows"] == split["sizes"]["test"]["rows"] == 0
    assert (
        not any(key.startswith(("test_", "valid_")) for key in metrics) and "--holdout 0" in metrics["no_heldout_data"]
    )
    assert (
        metrics["holdout"] == 0.0
        and metrics["epsilon_spent"] == pytest.approx(5.0, rel=1e-6)
        and metrics["releases"] == 3
    )
    assert json.load(open(tmp_path / "run" / "metrics.json"))["no_heldout_data"] == metrics["no_heldout_data"]
    text = evaluation.describe(metrics)
    assert (
        text.splitlines()[0].startswith("no test metrics: --holdout 0 (production mode)") and "epsilon spent 5" in text
    )
    with pytest.raises(ValueError, match=r"--holdout must be a number in \[0, 1\)"):
        small(tmp_path / "bad", small_data, holdout=1.0)


def test_recall_protocol_trains_an_id_encoder_on_top_items_by_dp_count(tmp_path, small_data):
    metrics = stages.run(small(tmp_path / "run", small_data, protocol="recall", encoder="id"), progress=False)
    assert 0.0 <= metrics["test_recall_at_20"] <= 1.0 and 0.0 <= metrics["valid_recall_at_20"] <= 1.0
    # every ranking metric, the model's and DP popularity's, in metrics.json and in the summary
    recorded = json.load(open(tmp_path / "run" / "metrics.json"))
    for key in ("recall_at_50", "ndcg_at_100", "coverage_at_20"):
        for name in (f"test_{key}", f"valid_{key}", f"test_popularity_{key}"):
            assert 0.0 <= recorded[name] <= 1.0 and recorded[name] == metrics[name], name
    assert metrics["test_coverage_at_20"] >= 20 / SMALL_ITEMS  # at least one user's whole top 20
    assert f"NDCG@100 {metrics['test_ndcg_at_100']:.4f}" in evaluation.describe(metrics)
    # DP popularity beside the model, and a loss to it said in words
    below = metrics["test_recall_at_20"] < metrics["test_popularity_recall_at_20"]
    assert ("the model is BELOW it" in evaluation.describe(metrics)) == below
    assert "BELOW" in evaluation.describe(
        {**metrics, "test_recall_at_20": metrics["test_popularity_recall_at_20"] - 0.01}
    )
    stats = storage.read_table(str(tmp_path / "run" / "step-1" / "stats" / "resample-0.parquet"))
    assert stats.num_rows == int(np.ceil(0.1 * SMALL_ITEMS))  # the top 10% items by DP count
    counts = storage.read_table(str(tmp_path / "run" / "counts" / "counts.parquet"))
    assert set(stats["item_id"].to_pylist()) == set(
        splits.top_items(counts["item_id"].to_numpy(), counts["count"].to_numpy(), 0.1).tolist()
    )
    names = [row["name"] for row in Ledger.open(str(tmp_path / "run" / "ledger.parquet")).rows]
    # no mean release in the ranking protocol; one users' Gram matrix (implicit-feedback gravity) per step
    assert names == ["counts", "step-1/stats/r0", "step-1/gram", "step-2/stats/r0", "step-2/gram"]
    assert metrics["epsilon_spent"] == pytest.approx(5.0, rel=1e-6)


def test_the_share_of_the_catalog_a_ranking_run_trains_on():
    """The id encoder keeps the paper's top 10% (its rare items would be noise alone); the features
    encoder covers the whole catalog (its rare items fall back on their features); a given share is
    kept; one outside (0, 1] is refused by name."""
    assert settings.TrainConfig.create(protocol="recall", encoder="id", item_update="als").train_item_fraction == 0.1
    assert settings.TrainConfig.create(protocol="recall").train_item_fraction == 1.0
    assert settings.TrainConfig.create(protocol="recall", train_item_fraction=0.25).train_item_fraction == 0.25
    for bad in (0.0, 1.5, float("nan"), True):
        with pytest.raises(ValueError, match="--train-item-fraction"):
            settings.TrainConfig.create(protocol="recall", train_item_fraction=bad)


def test_the_dimension_and_the_weights_follow_the_protocol():
    """Ratings: d 8 below epsilon 5, 16 from 5, and weights towards rare items (n^-1/4); ranking: d 16
    below epsilon 10, 32 from 10, and even weights (every hit is on a popular item); non-private: d 32.
    The bias coordinate k = min(2, sqrt(20 / epsilon)). A given value is kept; a non-finite exponent is
    refused by name, and the weights the stats job gets follow the config."""
    assert (
        settings.TrainConfig.create(epsilon=1).dim,
        settings.TrainConfig.create(epsilon=4.9).dim,
        settings.TrainConfig.create(epsilon=5).dim,
    ) == (8, 8, 16)
    assert (settings.TrainConfig.create().dim, settings.TrainConfig.create().weight_exponent) == (16, -0.25)
    biases = [settings.TrainConfig.create(epsilon=e).bias_coordinate for e in (0.5, 1, 5, 20, 80)]
    assert biases == [2.0, 2.0, 2.0, 1.0, 0.5]
    assert settings.TrainConfig.create(epsilon=10).bias_coordinate == pytest.approx(np.sqrt(2))
    assert settings.TrainConfig.create(epsilon=20, bias_coordinate=3.0).bias_coordinate == 3.0
    assert (
        settings.TrainConfig.create(protocol="recall", epsilon=5).dim,
        settings.TrainConfig.create(protocol="recall").weight_exponent,
    ) == (16, 0.0)
    assert (
        settings.TrainConfig.create(protocol="recall", epsilon=10).dim
        == settings.TrainConfig.create(protocol="recall", epsilon=20).dim
        == 32
    )
    assert settings.TrainConfig.create(epsilon=20).dim == 16
    assert (
        settings.TrainConfig.create(non_private=True).dim
        == settings.TrainConfig.create(protocol="recall", non_private=True).dim
        == 32
    )
    chosen = settings.TrainConfig.create(protocol="recall", dim=8, weight_exponent=-0.25)
    assert chosen.settings().weight_exponent == -0.25
    assert settings.TrainConfig.create(protocol="recall").settings().weight_exponent == 0.0
    with pytest.raises(ValueError, match="--weight-exponent"):
        settings.TrainConfig.create(weight_exponent=float("nan"))


def test_the_statistics_cover_the_items_whose_dp_count_clears_the_noise(tmp_path, small_data):
    """AM-SSP's statistics cover the items whose DP count is at least stats_threshold * N/S
    (N/S = 2 sqrt(d) z, from the run's planned multiplier z); the stats job reads exactly their
    rows, the user update every row; the items left out keep what their public features say."""
    from pipelines.training.run_dir import Run
    from trainer import encoder as encoders

    config = small(tmp_path / "run", small_data, stats_threshold=4.0)
    run = Run(config.out)
    stages.run(config, progress=False)
    counts = storage.read_table(run.counts)
    tau = 4.0 * 2 * np.sqrt(config.encoder_dim) * prepare.ledger_multiplier(run.ledger)  # d = 8 and the bias coordinate
    covered = counts["item_id"].to_numpy()[counts["count"].to_numpy() >= tau]
    assert 0 < covered.size < counts.num_rows
    assert sorted(storage.read_table(run.stats_items)["item_id"].to_pylist()) == sorted(covered.tolist())
    assert sorted(
        storage.read_table(str(tmp_path / "run" / "step-1" / "stats" / "resample-0.parquet"))["item_id"].to_pylist()
    ) == sorted(covered.tolist())

    def rows(path):
        table = storage.read_table(path)
        return sorted(
            zip(table["user_id"].to_pylist(), table["item_id"].to_pylist(), table["label"].to_pylist(), strict=True)
        )

    every = rows(run.centred)
    assert rows(run.stats_rows) == [row for row in every if row[1] in set(covered.tolist())]
    assert {row[1] for row in every} - set(covered.tolist())  # the user update keeps the other items' rows
    manifest = json.load(open(run.manifest_path))
    space, model = build_encoder(config, storage.read_table(manifest["prepared"]["items"]))
    encoders.restore_checkpoint(model, run.checkpoint(config.outer_steps - 1))
    inside = np.isin(space.item_ids, covered)
    residuals = model.embed_all() - model.embed_all(shared=True)
    assert np.all(residuals[~inside] == 0) and np.abs(residuals[inside]).max() > 0
    # the last step refits the shared encoder (what a new item gets) to the covered items' embeddings,
    # unless the refit's leave-one-out error is no better than the trained encoder's residuals
    encoders.restore_checkpoint(model, run.checkpoint(config.outer_steps))
    outputs, shared, x = model.embed_all(), model.embed_all(shared=True), encoders.public_inputs(space)
    counts = run_dir.catalog_counts(run, space)
    linear, loo_error = encoders.loo_ridge(x[inside], outputs[inside], counts[inside])
    if np.any(outputs[~inside] != shared[~inside]):  # refit: the others' residuals take the difference
        np.testing.assert_allclose(shared, x @ linear, rtol=0, atol=1e-4 * np.abs(x @ linear).max())
    else:
        assert loo_error >= counts[inside] @ np.sum(np.square(outputs[inside] - shared[inside]), axis=1)
    # the default rule: 6 N/S for AM-SSP's features encoder when sqrt(m) (N/S) / sqrt(C n) > 0.15 with biases, else 1
    # N/S
    # (hand-computed: 100 items of DP count 50, so C = 5,000; n = 1,000 users)
    items = np.full(100, 50.0)  # sqrt(100) / sqrt(5e6) = 0.00447 per unit of N/S: the rule switches at N/S = 33.54
    assert (
        prepare.stats_threshold_of(settings.TrainConfig.create(), items, 1000, 33.4) == 1.0
        and prepare.stats_threshold_of(settings.TrainConfig.create(), items, 1000, 33.7) == 6.0
    )
    ranking = settings.TrainConfig.create(protocol="recall")  # no biases: the cut at 0.03, N/S = 6.71
    assert (
        prepare.stats_threshold_of(ranking, items, 1000, 6.6) == 1.0
        and prepare.stats_threshold_of(ranking, items, 1000, 6.8) == 6.0
    )
    assert prepare.stats_threshold_of(settings.TrainConfig.create(), items, 1000, 0.0) == 0.0  # no noise: every item
    assert prepare.stats_threshold_of(settings.TrainConfig.create(item_update="dpsgd"), items, 1000, 50.0) == 0.0
    als_id = settings.TrainConfig.create(item_update="als", encoder="id")
    assert prepare.stats_threshold_of(als_id, items, 1000, 50.0) == 0.0
    assert prepare.stats_threshold_of(settings.TrainConfig.create(stats_threshold=0.5), items, 1000, 50.0) == 0.5
    with pytest.raises(ValueError, match="--stats-threshold needs the features encoder"):
        settings.TrainConfig.create(item_update="als", encoder="id", stats_threshold=1.0)
    with pytest.raises(ValueError, match="--stats-threshold must be >= 0"):
        settings.TrainConfig.create(stats_threshold=-1.0)


def test_a_run_whose_statistics_would_cover_nothing_keeps_its_starting_point_and_spends_nothing_on_them(
    tmp_path, small_data, caplog
):
    """No item's DP count clears the threshold (here an absurd one; in practice small data, a low
    epsilon, many resamples): the run does not fail after its counts were spent; it releases no
    statistics, keeps its starting point (the item embeddings of step 0) and says so in one line."""
    from pipelines.training.run_dir import Run

    config = small(tmp_path / "run", small_data, stats_threshold=1e6)
    metrics = stages.run(config, progress=False)
    run = Run(config.out)
    assert [row["name"] for row in Ledger.open(run.ledger).rows] == ["counts", "mean"]
    assert metrics["epsilon_spent"] < config.epsilon and np.isfinite(metrics["test_rmse"])
    assert json.load(open(run.manifest_path))["prepared"]["stats_cover"] == 0
    assert storage.read_table(run.stats_items).num_rows == 0 and not os.path.exists(run.stats(1))
    start, final = (
        storage.read_table(path).sort_by("item_id")
        for path in (run.item_embeddings(0), str(tmp_path / "run" / "item_embeddings.parquet"))
    )
    assert start.equals(final)
    warnings = [
        record.getMessage() for record in caplog.records if "the statistics would cover nothing" in record.getMessage()
    ]
    assert len(warnings) == 1 and "keeps its starting point" in warnings[0]
    assert stats_stage.stats_job_of_run(config.out, 1) is None  # a scheduler's stats task: nothing to release


def test_the_starting_point_is_the_principal_directions_of_the_features_weighted_by_dp_counts(tmp_path, small_data):
    """Prepare's initial item embeddings: the encoder's principal initialisation from the released DP
    counts (nothing else of the private data), at unit RMS norm; --encoder-init random keeps the
    seeded random projection."""
    from pipelines.training.run_dir import Run

    embeddings = {}
    for init in ("principal", "random"):
        config = small(tmp_path / init, small_data, encoder_init=init)
        prepare.prepare(config, progress=False)
        run = Run(config.out)
        table = storage.read_table(run.item_embeddings(0))
        embeddings[init] = np.array(table["embedding"].to_pylist())  # [v, b_j, 1]: every item starts at the DP mean
        np.testing.assert_allclose(np.sqrt(np.mean(np.sum(embeddings[init][:, :8] ** 2, axis=1))), 1.0, rtol=1e-5)
        assert np.all(embeddings[init][:, 8] == 0) and np.all(embeddings[init][:, 9] == 1)
    counts = storage.read_table(Run(str(tmp_path / "principal")).counts)
    space, model = build_encoder(
        config, storage.read_table(json.load(open(Run(config.out).manifest_path))["prepared"]["items"])
    )
    weights = np.ones(space.size)
    weights[space.index_of(counts["item_id"].to_numpy())] = counts["count"].to_numpy()
    model.init_principal(weights)
    zero_item_biases(model, config)
    normalise_embeddings(model, config)
    np.testing.assert_allclose(embeddings["principal"], item_vectors(config, model.embed_all()), rtol=0, atol=1e-5)
    _, fresh = build_encoder(
        config, storage.read_table(json.load(open(Run(config.out).manifest_path))["prepared"]["items"])
    )
    zero_item_biases(fresh, config)
    normalise_embeddings(fresh, config)
    np.testing.assert_allclose(embeddings["random"], item_vectors(config, fresh.embed_all()), rtol=0, atol=1e-5)
    assert not np.allclose(embeddings["principal"], embeddings["random"], atol=1e-2)
    with pytest.raises(ValueError, match="--encoder-init must be one of"):
        settings.TrainConfig.create(encoder_init="pca")


def test_stages_as_separate_commands_equal_the_one_process_run(spark, tmp_path, capsys, small_data, reference):
    """What the DAG does: one command per stage against one run directory, the later ones given only
    --run (and --step), on Spark; the stats job gets its flags. Same releases and metrics as run()
    with the same seed (`reference`, on the local engine)."""
    from pipelines.releases import stats_job
    from pipelines.training.run_dir import Run
    from ssp import cli

    run, steps = str(tmp_path / "staged"), 2
    flags = ["--data", small_data, "--epsilon", "5.0", "--outer-steps", str(steps), "--epochs", "3", "--dim", "8"]

    def ssp_ok(*args):
        assert cli.main(list(args)) == 0, capsys.readouterr().err

    def ssp_error(*args):
        assert cli.main(list(args)) == 2
        return capsys.readouterr().err.strip().splitlines()[-1]

    assert "holds no run" in ssp_error("item-update", "--run", run, "--step", "1")
    ssp_ok("train", "--stage", "prepare", "--out", run, *flags, "--seed-file", seed_file(tmp_path / "seed"))
    assert (
        not (tmp_path / "staged" / "metrics.json").exists() and (tmp_path / "staged" / "step-0" / "checkpoint").is_dir()
    )
    assert "statistics of step 1 are not released" in ssp_error("item-update", "--run", run, "--step", "1")
    assert "outer step 1 is not done" in ssp_error("user-update", "--run", run, "--step", "2")
    assert "drop --lambda-u" in ssp_error("user-update", "--run", run, "--step", "1", "--lambda-u", "2")
    assert "drop --dim, --epsilon" in ssp_error("stats", "--run", run, "--step", "1", "--dim", "9", "--epsilon", "5")
    assert "with --run give --step S" in ssp_error("stats", "--run", run)
    assert "one of the run's outer steps 1..2, got 3" in ssp_error("stats", "--run", run, "--step", "3")
    assert "give --interactions, --user-embeddings" in ssp_error("stats", "--dim", "8")
    config = settings.TrainConfig.create(
        data=small_data, out=run, epsilon=5.0, outer_steps=steps, epochs=3, dim=8, seed_file=str(tmp_path / "seed")
    )
    data_items = storage.join(run, "train_items.parquet")  # the catalog the statistics cover
    for s in range(1, steps + 1):
        ssp_ok("user-update", "--run", run, "--step", str(s))
        flags = [
            "--interactions",
            storage.join(run, "private", "stats_rows.parquet"),
            "--user-embeddings",
            storage.join(run, "private", f"step-{s}", "user_embeddings.parquet"),
            "--items",
            data_items,
            "--counts",
            storage.join(run, "counts", "counts.parquet"),
            "--out",
            storage.join(run, f"step-{s}", "stats"),
            "--step",
            str(s),
            "--dim",
            "9",
            "--bias",
            "2",
            "--clip-u",
            "0.3",
            "--clip-y",
            "1.5",  # d = 8 and the bias coordinate
            "--epsilon",
            "5.0",
            "--outer-steps",
            str(steps),
            "--gram-share",
            "0",  # the run plans no Gram release (ratings)
            "--ledger",
            storage.join(run, "ledger.parquet"),
            "--seed-file",
            str(tmp_path / "seed"),
        ]  # the run's ledger keeps its data source's account, its seed file the noise's seed
        parsed = cli.build_parser().parse_args(["stats", *flags])
        assert stats_job.StatsJob.from_args(parsed) == stats_stage.stats_job_for(Run(run), config, s, data_items)
        staged = cli.build_parser().parse_args(
            ["stats", "--run", run, "--step", str(s)]
        )  # the stage form: the same job from the manifest
        assert stats_job.StatsJob.from_args(staged, stats_stage.stats_job_of_run) == stats_stage.stats_job_for(
            Run(run), config, s, data_items
        )
        ssp_ok("stats", *flags) if s == 1 else ssp_ok("stats", "--run", run, "--step", str(s))
        ssp_ok("item-update", "--run", run, "--step", str(s))
    assert "no final user embeddings" in ssp_error("evaluate", "--run", run)
    ssp_ok("user-update", "--run", run, "--final")
    ssp_ok("evaluate", "--run", run)
    assert "test RMSE" in capsys.readouterr().out
    assert "exceeds the allowed 4" in ssp_error("privacy", run, "--max-epsilon", "4")
    ssp_ok("privacy", run, "--max-epsilon", "5", "--max-delta", "1e-5")
    ssp_ok("publish", "--run", run, "--to", str(tmp_path / "published"))
    assert sorted(os.listdir(tmp_path / "published")) == [
        "_PUBLISHED",
        "counts.parquet",
        "encoder",
        "item_embeddings.parquet",
        "model.json",
        "privacy.json",
        "privacy.md",
        "recommender",
        "titles.parquet",  # the synthetic catalog's titles
    ]
    report = (tmp_path / "published" / "privacy.md").read_text()
    assert report == open(os.path.join(run, "privacy.md")).read()  # written by evaluate, shipped by publish
    capsys.readouterr()
    ssp_ok("privacy", run, "--format", "md")
    assert capsys.readouterr().out == report
    for row in Ledger.open(os.path.join(run, "ledger.parquet")).rows:
        assert f"| {row['release']} | `{row['name']}` |" in report
    # the statistics' sensitivity as the release's noise was scaled: rows [Clip(u), k Gamma_u], k = 2 by the epsilon-5
    # rule
    assert (
        "A: wbar (1 + k^2) Gamma_u^2 = 0.45" in report and "k = 2, appended" in report and str(tmp_path) not in report
    )
    assert (
        report.startswith("# Privacy report: run `staged`")
        and "Symbols: A_j and b_j" in report
        and "ratings of one user" in report
    )

    staged = json.load(open(tmp_path / "staged" / "metrics.json"))
    whole_run, whole = reference
    assert staged["test_rmse"] == pytest.approx(whole["test_rmse"], abs=1e-9)
    for name in ("ledger.parquet",):
        assert [row["name"] for row in Ledger.open(str(tmp_path / "staged" / name)).rows] == [
            row["name"] for row in Ledger.open(str(whole_run / name)).rows
        ]
    assert staged["epsilon_spent"] == pytest.approx(5.0, rel=1e-6) and set(staged["step_seconds"]) == {"1", "2"}


def test_the_logistic_loss_needs_its_setting_and_brings_its_own_negatives():
    config = settings.TrainConfig.create(protocol="recall", loss="logistic")
    assert config.gravity == 0 and config.weight_exponent == 0 and config.settings().loss == "logistic"
    assert config.settings().noise_clips() == (config.clip_u / 2, 2.0)
    assert (
        settings.TrainConfig.create(protocol="recall", loss="logistic", item_update="dpsgd").dpsgd_config(100).loss
        == "logistic"
    )
    for change, flag in (
        ({"protocol": "rmse"}, "--protocol recall"),
        ({"gravity": 0.1}, "--gravity 0"),
        ({"item_update": "als", "encoder": "id"}, "--item-update ssp, dpsgd or none"),
        ({"weight_exponent": -0.25}, "--weight-exponent 0"),
    ):
        with pytest.raises(ValueError, match=f"--loss logistic \\(SSP-convex on implicit feedback\\) needs {flag}"):
            settings.TrainConfig.create(**{"protocol": "recall", "loss": "logistic", **change})
    with pytest.raises(
        ValueError,
        match="--engine beam cannot serve this run: its statistics pipeline sums no logistic expansion "
        ".* use --engine spark or local",
    ):
        settings.TrainConfig.create(protocol="recall", loss="logistic", engine="beam")
    with pytest.raises(ValueError, match="--loss must be one of"):
        settings.TrainConfig.create(loss="poisson")


def test_biases_need_the_square_loss_and_a_non_federated_engine_and_ranking_keeps_its_user_ridge():
    ranking = settings.TrainConfig.create(protocol="recall", biases=True)
    assert (ranking.biases, ranking.lambda_u, ranking.user_prior, ranking.settings().bias) == (
        True,
        0.1,
        0.0,
        ranking.bias_coordinate,
    )
    ratings = settings.TrainConfig.create()
    assert (ratings.biases, ratings.lambda_u, ratings.user_prior) == (True, 0.01, 20.0)
    with pytest.raises(ValueError, match="--biases needs --loss square"):
        settings.TrainConfig.create(
            protocol="recall", loss="logistic", engine="spark", gravity=0.0, weight_exponent=0.0, biases=True
        )
    with pytest.raises(
        ValueError,
        match="--engine federated cannot serve this run: its clients solve no bias "
        ".* use --engine spark or beam or local",
    ):
        settings.TrainConfig.create(engine="federated", biases=True)


def test_prepare_reads_the_interactions_digest_once_and_charges_the_account_it_names(
    tmp_path, small_data, monkeypatch, budget_account_registry
):
    """The run's identity and its data source's budget account both need the interactions' content
    digest: prepare takes it once (a pass over every row) and the account it charges is the one
    that digest names in the registry."""
    from pipelines.data import ingest
    from pipelines.releases import release
    from privacy import seeds
    from privacy.lifetime_budget import BudgetAccount

    digested = []

    def counted(path):
        digested.append(path)
        return seeds.content_digest_table(path)

    monkeypatch.setattr(prepare, "content_digest_table", counted)
    monkeypatch.setattr(release, "content_digest_table", counted)
    config = small(tmp_path / "run", small_data)
    prepare.prepare(config, progress=False)
    interactions = ingest.open_dataset(small_data).interactions
    assert digested.count(interactions) == 1
    account = Ledger.open(prepare.Run(config.out).ledger).budget["account"]
    assert account == BudgetAccount.for_source(seeds.content_digest_table(interactions)).path


def test_a_run_records_where_each_phase_starts(reference):
    """Each stage's start beside its wall time (Run.record_seconds): the run's timeline, stage after
    stage, which the manifest's sorted keys do not give."""
    run, _ = reference
    manifest = storage.read_json(str(run / "manifest.json"))
    starts, seconds = manifest["phase_started_at"], manifest["seconds"]
    assert set(starts) == set(seconds)
    order = sorted(starts, key=starts.get)
    assert order == [
        "prepare",
        *[f"step-{s}/{phase}" for s in (1, 2) for phase in ("user_update", "stats", "item_update")],
        "final_user_update",
        "evaluation",
    ]
    for earlier, later in zip(order, order[1:], strict=False):  # one after the other, none overlapping
        assert starts[earlier] + seconds[earlier] <= starts[later] + 1e-3
