"""The comparators under `ssp train`: DP-ALS, DP-CMF and AM-DPSGD on the bundled data, same pipeline,
on the local engine (it releases the Spark engine's bits: tests/pipelines/engines/test_local.py; the
item updates read only released tables, whichever engine released them)."""

import numpy as np
import pytest

from pipelines.training import item_update, prepare, run_dir, settings, stages
from pipelines.training.model import build_encoder
from privacy import accounting
from privacy.ledger import Ledger
from schemas import storage
from schemas.arrays import list_column_to_matrix
from trainer.solve import ridge_solve


def small(out, **kwargs):
    return settings.TrainConfig.create(out=str(out), outer_steps=2, epochs=2, engine="local", **kwargs)


def vectors(path: str, dim: int) -> tuple[np.ndarray, np.ndarray]:
    table = storage.read_table(path)
    table = table.sort_by(table.column_names[0])
    return table.column(0).to_numpy(), list_column_to_matrix(table["embedding"], dim, "embedding")


@pytest.mark.parametrize("biases", [False, True])
def test_dp_als_without_noise_is_plain_als(tmp_path, biases):
    """Noise off, DP-ALS equals weighted-lambda ALS computed here from the exact training rows; with
    biases, each user's [u, b_u] against [v, 1] on y - b_j, and each item's [v, b_j] against [u, 1]
    on y - b_u (the bias coordinate c = --bias-coordinate without clipping; the item's bias is c times its
    coefficient)."""
    config = small(tmp_path / "run", non_private=True, item_update="als", encoder="id", dim=4, biases=biases)
    metrics = stages.run(config, progress=False)
    run = run_dir.Run(config.out)
    rows = storage.read_table(run.centred)
    users, items, labels = rows["user_id"].to_numpy(), rows["item_id"].to_numpy(), rows["label"].to_numpy()
    width = 6 if biases else 4  # items [v, b_j, 1], users [u, 1, b_u]
    catalog, item_v = vectors(run.item_embeddings(0), width)
    if biases:
        assert np.all(item_v[:, 4] == 0) and np.all(item_v[:, 5] == 1)  # every item starts at the DP mean
    counts = storage.read_table(run.counts).sort_by("item_id")
    scale = counts["count"].to_numpy()[
        np.searchsorted(counts["item_id"].to_numpy(), catalog)
    ]  # non-private: lambda_j = lambda n_j
    for step in (1, 2):
        owners, user_u = ridge_solve(
            users,
            item_v[np.searchsorted(catalog, items)],
            labels,
            config.lambda_u,
            scale_by_rows=True,
            bias_ridge=config.lambda_bias if biases else None,
            prior=config.user_prior,
        )
        u = user_u[np.searchsorted(owners, users)]
        c = config.settings().bias_scale
        x, y = (
            (np.hstack([u[:, :4], np.full((u.shape[0], 1), c)]), labels - u[:, 5]) if biases else (u, labels)
        )  # [u, c] and the label less the user's bias
        solved = np.zeros((catalog.size, x.shape[1]))  # items without rows: no statistics, vector 0
        order = np.argsort(items, kind="stable")
        for group in np.split(order, np.flatnonzero(np.diff(items[order])) + 1):
            at = np.searchsorted(catalog, items[group[0]])
            a = x[group].T @ x[group] + config.ridge * scale[at] * np.eye(x.shape[1])
            solved[at] = np.linalg.solve(a, x[group].T @ y[group])
        solved[:, :4] /= np.sqrt(
            np.mean(np.sum(solved[:, :4] ** 2, axis=1))
        )  # released at unit RMS norm (model.normalise_embeddings), the bias as it is
        item_v = np.hstack([solved[:, :4], c * solved[:, 4:], np.ones((catalog.size, 1))]) if biases else solved
        got_items, got = vectors(run.item_embeddings(step), width)
        assert np.array_equal(got_items, catalog)
        np.testing.assert_allclose(got, item_v, rtol=1e-4, atol=1e-5)  # the encoder's table is float32
    assert metrics["test_rmse"] < 1.0


@pytest.mark.parametrize("biases", [False, True])
def test_dp_cmf_with_feature_weight_zero_is_dp_als(tmp_path, biases, small_data):
    """mu = 0 drops the feature term: DP-CMF is DP-ALS, biases included (DP-ALS is checked by hand above)."""
    als = stages.run(
        small(
            tmp_path / "als", data=small_data, non_private=True, item_update="als", encoder="id", dim=4, biases=biases
        ),
        progress=False,
    )
    cmf0 = stages.run(
        small(
            tmp_path / "cmf0",
            data=small_data,
            non_private=True,
            item_update="cmf",
            encoder="id",
            dim=4,
            feature_weight=0.0,
            biases=biases,
        ),
        progress=False,
    )
    assert cmf0["test_rmse"] == pytest.approx(als["test_rmse"], abs=1e-9)
    width = 6 if biases else 4
    np.testing.assert_allclose(
        vectors(str(tmp_path / "cmf0" / "item_embeddings.parquet"), width)[1],
        vectors(str(tmp_path / "als" / "item_embeddings.parquet"), width)[1],
        atol=1e-6,
    )
    if not biases:
        return
    cmf = stages.run(
        small(tmp_path / "cmf", data=small_data, epsilon=5.0, item_update="cmf", encoder="id"),
        progress=False,
    )
    assert np.isfinite(cmf["test_rmse"]) and cmf["epsilon_spent"] == pytest.approx(5.0, rel=1e-6)
    assert (
        tmp_path / "cmf" / "step-2" / "stats" / "psd-resample-0.parquet" / "_SUCCESS"
    ).exists()  # projected once per step


def test_am_dpsgd_spends_the_budget_through_the_ledger(tmp_path):
    """AM-DPSGD plans its sampling over the DP number of users released with the counts: the exact
    number appears nowhere outside RUN/private/ (manifest, ledger event, logs)."""
    import json
    import re

    from pipelines.releases.counts import dp_units
    from privacy.seeds import SeedFile

    seed = SeedFile.create(
        str(tmp_path / "seed"), bytes(range(32))
    ).path  # a fixed test seed: the DP number of users below is reproducible
    config = small(
        tmp_path / "run", epsilon=5.0, item_update="dpsgd", dpsgd_epochs=1.0, dpsgd_batch_size=64, seed_file=seed
    )
    metrics = stages.run(config, progress=False)
    ledger = Ledger.open(str(tmp_path / "run" / "ledger.parquet"))
    assert [row["name"] for row in ledger.rows] == ["counts", "mean", "step-1/dpsgd", "step-2/dpsgd"]
    assert metrics["epsilon_spent"] == pytest.approx(5.0, rel=1e-6) and metrics["epsilon_spent"] <= 5.0
    exact = len(
        storage.read_table(str(tmp_path / "run" / "private" / "split" / "train.parquet"), columns=["user_id"])[
            "user_id"
        ].unique()
    )
    manifest = json.load(open(tmp_path / "run" / "manifest.json"))
    units = manifest["prepared"]["units"]
    assert units == dp_units(
        str(tmp_path / "run" / "counts" / "counts.parquet")
    )  # the DP release, not a count of the rows
    assert units != exact and abs(units - exact) < 5 * ledger.budget["multipliers"]["counts"] * np.sqrt(
        config.max_items_per_user + 1
    )
    assert not re.search(
        rf"(?<![\d.]){exact}(?![\d.])", json.dumps(manifest)
    )  # as a number of its own, not inside a timestamp
    q, steps = config.dpsgd_schedule(units)
    assert (q, steps) == (64 / units, int(np.ceil(units / 64)))
    z = manifest["prepared"]["dpsgd_multiplier"]
    assert z == config.privacy(units).multipliers()["dpsgd"]
    assert ledger.events()[2] == accounting.dpsgd_event(z, q, steps)
    assert (
        set(ledger.budget["multipliers"]) == {"counts", "mean"} and not (tmp_path / "run" / "step-1" / "stats").exists()
    )
    assert storage.read_table(str(tmp_path / "run" / "item_embeddings.parquet")).num_rows == 9742  # every catalog item
    assert np.isfinite(metrics["test_rmse"]) and metrics["test_rmse"] < 1.5


def test_am_dpsgd_with_biases_fits_the_item_bias_to_what_the_user_bias_leaves(tmp_path):
    """With biases AM-DPSGD fits [Clip(u), c] . [v, b] to the label less the user's bias, as the
    statistics do: non-private, the items' biases it writes follow their mean residual y - b_u."""
    from privacy.seeds import SeedFile

    seed = SeedFile.create(
        str(tmp_path / "seed"), bytes(range(32))
    ).path  # DP-SGD's sampling is drawn from the run's seed
    config = settings.TrainConfig.create(
        out=str(tmp_path / "run"),
        non_private=True,
        item_update="dpsgd",
        outer_steps=1,
        dim=4,
        dpsgd_epochs=1.0,
        dpsgd_batch_size=256,  # one pass in 256-row steps: a twentieth of the defaults' steps, as close a fit
        seed_file=seed,
        engine="local",
    )
    stages.run(config, progress=False)
    run = run_dir.Run(config.out)
    catalog, item_v = vectors(run.item_embeddings(1), 6)
    assert np.all(item_v[:, 5] == 1)
    owners, user_v = vectors(run.user_embeddings(1), 6)
    rows = storage.read_table(run.centred)
    items = np.searchsorted(catalog, rows["item_id"].to_numpy())
    residual = rows["label"].to_numpy() - user_v[np.searchsorted(owners, rows["user_id"].to_numpy()), 5]
    counts = np.bincount(items, minlength=catalog.size)
    rated = counts >= 50
    item_means = np.bincount(items, residual, minlength=catalog.size)[rated] / counts[rated]
    assert np.corrcoef(item_v[rated, 4], item_means)[0, 1] > 0.75  # 0.89 here; an item bias DP-SGD cannot move stays 0


def unit_rms(vectors: np.ndarray) -> np.ndarray:
    """Item vectors as the item update releases them: rescaled to RMS norm 1 over the catalog."""
    return vectors / np.sqrt(np.mean(np.sum(vectors**2, axis=1)))


def test_dp_als_solves_from_the_mean_of_the_resamples(tmp_path):
    """With R resamples the budget pays for R noisy copies: DP-ALS uses their mean (1/R of the noise
    variance, and a noise ridge floor 1/sqrt(R) as high), not only the last copy."""
    from pipelines.releases import stats_job
    from trainer import als

    config = settings.TrainConfig.create(
        out=str(tmp_path / "run"),
        epsilon=5.0,
        outer_steps=1,
        resamples=2,
        item_update="als",
        encoder="id",
        dim=4,
        biases=False,
        engine="local",
    )
    stages.run(config, progress=False)
    run = run_dir.Run(config.out)
    tables = stats_job.stats_tables(run.stats(1))
    assert len(tables) == 2 and [row["name"] for row in Ledger.open(run.ledger).rows] == [
        "counts",
        "mean",
        "step-1/stats/r0",
        "step-1/stats/r1",
    ]
    mean = storage.join(run.stats(1), "mean-of-resamples.parquet")
    by_item = [storage.read_table(path).sort_by("item_id") for path in (*tables, mean)]
    for column, width in (("a_upper", 10), ("b", 4)):
        r0, r1, averaged = (list_column_to_matrix(table[column], width, column) for table in by_item)
        np.testing.assert_allclose(averaged, (r0 + r1) / 2, rtol=1e-14, atol=1e-14)
    space, _ = build_encoder(config, storage.read_table(run.prepared()["prepared"]["items"]))
    ridge = item_update._ridge_scale(
        config, space, prepare.ledger_multiplier(run.ledger), storage.read_table(run.counts), averaged=2
    )
    want = unit_rms(als.solve_items(mean, space, 4, config.ridge, ridge_scale=ridge, psd_projection=True))
    items, got = vectors(run.item_embeddings(1), 4)
    np.testing.assert_allclose(got, want[space.index_of(items)], rtol=1e-4, atol=1e-5)  # the encoder's table is float32
    last_only = unit_rms(
        als.solve_items(
            tables[-1],
            space,
            4,
            config.ridge,
            ridge_scale=item_update._ridge_scale(
                config, space, prepare.ledger_multiplier(run.ledger), storage.read_table(run.counts)
            ),
            psd_projection=True,
        )
    )
    assert not np.allclose(got, last_only[space.index_of(items)], rtol=1e-4, atol=1e-5)


def test_dp_item_mean_is_the_posterior_mean_of_its_release(tmp_path):
    """--item-update item-mean on the bundled data: every user is [1, 0] (no embedding, no bias), so
    each step's release holds each item's weighted count and label sum alone (d = 1, the bias
    coordinate), and the items are [b_j, 1] with b_j the posterior mean trainer.item_mean computes
    from that release; it beats predicting the DP mean. Refused without biases or the id encoder."""
    from trainer import item_mean
    from trainer.features import FeatureSpace

    config = settings.TrainConfig.create(
        out=str(tmp_path / "run"), epsilon=20.0, item_update="item-mean", encoder="id", outer_steps=1, engine="local"
    )
    assert (config.embedding_dim, config.encoder_dim, config.vector_dim) == (0, 1, 2)
    metrics = stages.run(config, progress=False)
    run = run_dir.Run(config.out)
    assert [row["name"] for row in Ledger.open(run.ledger).rows] == ["counts", "mean", "step-1/stats/r0"]
    _, users = vectors(run.user_embeddings(None), 2)
    assert np.all(users == [1.0, 0.0])
    catalog, items = vectors(str(tmp_path / "run" / "item_embeddings.parquet"), 2)
    assert np.all(items[:, 1] == 1.0)
    table = run.stats(1) + "/resample-0.parquet"
    space = FeatureSpace(catalog, [])
    c = config.settings().bias_scale
    want = (
        item_mean.item_means(
            table, space, c, item_mean.noise_std_b(table), prepare.prepared_rating_range(run.prepared()["prepared"])
        )[:, 0]
        * c
    )
    np.testing.assert_allclose(items[:, 0], want, rtol=1e-5, atol=1e-6)  # the id encoder's table is float32
    assert metrics["test_rmse"] < metrics["test_mean_predictor_rmse"]
    assert settings.TrainConfig.create(item_update="item-mean", encoder="id").outer_steps == 1
    with pytest.raises(ValueError, match="item biases alone: drop --no-biases"):
        settings.TrainConfig.create(item_update="item-mean", encoder="id", biases=False)
    with pytest.raises(ValueError, match="use it with --encoder id"):
        settings.TrainConfig.create(item_update="item-mean")
    with pytest.raises(ValueError, match="releases the same statistics at every step"):
        small(tmp_path / "x", item_update="item-mean", encoder="id")
