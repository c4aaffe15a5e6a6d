"""`ssp train --item-update gram`: the ranking model of one DP item Gram release, end to end, and the
settings it refuses before anything is spent."""

import numpy as np
import pytest

from pipelines.releases.item_gram import read_item_gram
from pipelines.training.settings import TrainConfig
from privacy.ledger import Ledger
from schemas import storage
from schemas.errors import UserError
from ssp import cli


def test_the_gram_model_spends_the_budget_on_counts_and_one_item_gram_and_embeds_only_the_top_items(tmp_path):
    data, run = tmp_path / "data", tmp_path / "run"
    assert (
        cli.main(["synth", "--users", "300", "--items", "120", "--ratings-per-user", "15", "--out", str(data), "-q"])
        == 0
    )
    assert (
        cli.main(
            [
                "train",
                "--data",
                str(data),
                "--out",
                str(run),
                "--protocol",
                "recall",
                "--epsilon",
                "5",
                "--item-update",
                "gram",
                "--encoder",
                "id",
                "--engine",
                "local",
                "-q",
            ]
        )
        == 0
    )
    ledger = Ledger.open(str(run / "ledger.parquet"))
    assert [row["name"] for row in ledger.rows] == ["counts", "item_gram"]
    assert ledger.epsilon_spent() == pytest.approx(5.0, rel=1e-3)
    items, gram, multiplier = read_item_gram(str(run / "item_gram" / "item_gram.parquet"))
    assert multiplier == ledger.budget["multipliers"]["item_gram"] > 0 and gram.shape == (items.size, items.size)
    embeddings = storage.read_table(str(run / "item_embeddings.parquet"))
    vectors = np.stack(embeddings["embedding"].to_numpy(zero_copy_only=False))
    embedded = embeddings["item_id"].to_numpy()[np.any(vectors != 0, axis=1)]
    assert embedded.size > 0 and set(embedded.tolist()) <= set(items.tolist())  # the top items only, by DP count
    report = (run / "privacy.md").read_text()  # every release says what it covers and one user's most
    assert "| `item_gram` | the item Gram: for each pair of the most popular items" in report
    assert "||x_u||^2 = 1" in report and "a release of the run" not in report
    settings = report[report.index("## Settings") :]  # a release's own setting only where the run made it
    assert "| `item_gram_share` | 0.9 |" in settings
    assert not any(f"`{name}`" in settings for name in ("mean_share", "gram_share", "dpsgd_clip"))


@pytest.mark.parametrize(
    "settings, refusal",
    [
        ({"item_update": "gram", "encoder": "id"}, "use it with --protocol recall"),
        ({"item_update": "gram", "protocol": "recall"}, "use it with --encoder id"),
        ({"item_update": "gram", "protocol": "recall", "encoder": "id", "item_gram_share": 0.0}, "a positive"),
        ({"item_gram_share": 0.3}, "use it with --protocol recall"),
        ({"protocol": "recall", "item_gram_share": 0.3, "item_id_feature": False}, "drop --no-item-id-feature"),
        ({"protocol": "recall", "item_gram_share": 0.85}, "none of the budget for them"),
    ],
)
def test_settings_the_gram_model_cannot_run_are_refused(settings, refusal):
    with pytest.raises(UserError, match=refusal):
        TrainConfig.create(epsilon=5, **settings)


def test_the_gram_model_plans_counts_and_the_item_gram_and_nothing_else():
    config = TrainConfig.create(epsilon=5, protocol="recall", item_update="gram", encoder="id")
    assert config.outer_steps == 1 and config.item_gram_share == pytest.approx(1 - config.count_share)
    assert [group.name for group in config.privacy().plan()] == ["counts", "item_gram"]


@pytest.mark.parametrize(
    "settings, share",
    [
        ({"protocol": "recall"}, 0.5),  # a private ranking AM-SSP starts from the item Gram
        ({"protocol": "recall", "item_id_feature": False}, 0.0),  # nothing to hold the Gram's directions
        ({"protocol": "recall", "non_private": True}, 0.0),
        ({"protocol": "recall", "engine": "federated"}, 0.0),  # its clients release statistics only
        ({"protocol": "recall", "encoder": "id"}, 0.0),
        ({"protocol": "recall", "item_update": "als", "encoder": "id"}, 0.0),
        ({"protocol": "recall", "loss": "logistic"}, 0.0),  # SSP-convex: not measured with the start
        ({}, 0.0),  # ratings
    ],
)
def test_the_item_grams_share_by_default(settings, share):
    assert TrainConfig.create(epsilon=5, **settings).item_gram_share == share


def test_an_item_gram_share_beside_the_statistics_plans_both():
    config = TrainConfig.create(epsilon=5, protocol="recall", item_gram_share=0.4)
    plan = {group.name: group.share for group in config.privacy().plan()}
    assert list(plan) == ["counts", "gram", "item_gram", "item_gram_more", "stats"]
    assert plan["item_gram"] == plan["item_gram_more"] == 0.2
    assert plan["stats"] == pytest.approx(1 - plan["counts"] - plan["gram"] - 0.4)


@pytest.mark.parametrize(
    ("epsilon", "second", "dim"),
    [(0.5, "stats", ["--dim", "24"]), (50.0, "item_gram", ["--dim", "16", "--dim-from-item-gram"])],
)  # at 0.5 on 300 users no taste stands above the noise; at 50 all of it
def test_the_item_grams_second_part_follows_what_the_first_detected(tmp_path, monkeypatch, epsilon, second, dim):
    """Prepare releases the first half of the item Gram's share, then the second half as another
    Gram release when the first detects directions beyond popularity, else gives it to the statistics:
    the ledger's settled multipliers; either way the run's plan composes to its epsilon, and a
    resumed prepare makes the same choice. Then d, in the manifest and the start's embeddings: a
    given --dim (24), or with --dim-from-item-gram the d the released Gram raises (from 16 to 32,
    the threshold lowered to 1 for a catalog of 120 items), the encoder rebuilt at it."""
    from pipelines.releases import item_gram
    from pipelines.training import settings
    from pipelines.training.run_dir import Run, config_of
    from privacy import accounting

    monkeypatch.setattr(settings, "DIM_32_FROM_KEPT", 1)

    data, run = tmp_path / "data", tmp_path / "run"
    assert cli.main(["synth", "--users", "300", "--items", "120", "--ratings-per-user", "15", "--out", str(data)]) == 0
    flags = ["train", "--stage", "prepare", "--data", str(data), "--out", str(run), "--protocol", "recall"]
    flags += ["--epsilon", str(epsilon), "--engine", "local", "-q", *dim]
    assert cli.main(flags) == 0
    releases = [read_item_gram(str(path)) for path in sorted((run / "item_gram").glob("*.parquet"))]
    gram, multiplier = item_gram.pooled([(g, z) for _, g, z in releases])
    kept = item_gram.kept_directions(gram, multiplier, item_gram.KEEP_ABOVE)
    assert kept <= releases[0][0].size == 12
    raised = "--dim-from-item-gram" in dim
    expected = settings.raised_dim(16, kept) if raised else 24
    assert expected == (32 if raised else 24) and Run(str(run)).read_manifest()["prepared"]["dim"] == expected
    assert config_of(Run(str(run)), Run(str(run)).read_manifest()).dim == expected
    start = storage.read_table(str(run / "step-0" / "item_embeddings.parquet"))
    assert {len(vector) for vector in start["embedding"].to_pylist()} == {expected}
    ledger = Ledger.open(str(run / "ledger.parquet"))
    names = [row["name"] for row in ledger.rows]
    config = TrainConfig.create(epsilon=epsilon, protocol="recall")
    if second == "stats":
        assert names == ["counts", "item_gram"] and "settled" in ledger.budget
        assert ledger.multipliers["stats"] == pytest.approx(config.privacy().item_gram_to_stats()["stats"])
        assert ledger.multipliers["stats"] < ledger.budget["multipliers"]["stats"]
    else:
        assert names == ["counts", "item_gram", "item_gram_more"] and "settled" not in ledger.budget
        assert (run / "item_gram" / "item_gram_more.parquet").exists()
    rest = [
        accounting.gaussian_event(ledger.multipliers["gram"], 2),
        accounting.gaussian_event(ledger.multipliers["stats"], 4),
    ]
    assert accounting.epsilon_of(ledger.events() + rest, 1e-5) == pytest.approx(epsilon, rel=1e-3)
    assert cli.main(flags) == 0  # resumed: the same releases, the same choice
    assert Ledger.open(str(run / "ledger.parquet")).rows == ledger.rows


def _features_encoder(dim: int):
    import pyarrow as pa

    from pipelines.training.model import build_encoder
    from schemas.tables import items_schema

    items = pa.table(
        {
            "item_id": np.arange(1, 13),
            "title": [f"t{i}" for i in range(12)],
            "genres": [["a"], ["b"], ["a", "b"], ["c"], ["d"], ["c", "e"]] * 2,
        },
        schema=items_schema({"genres": "multivalent"}),
    )
    return build_encoder(TrainConfig.create(epsilon=5, protocol="recall", dim=dim), items)[1]


@pytest.mark.parametrize("kept", [3, 2])
def test_a_features_encoder_starts_at_the_directions_on_the_gram_items_in_one_map_of_its_features(kept):
    """The start from the item Gram: the Gram's items start at its kept directions (scaled to the
    features' root-mean-square norm there), and every item's features embedding goes through one
    invertible linear map (nothing the features said is lost, every item in the same coordinates)."""
    from pipelines.training.prepare import start_from_directions

    model = _features_encoder(dim=3)
    before = model.embed_all(shared=True)
    positions = np.array([1, 4, 6, 9])
    directions = np.random.default_rng(0).normal(size=(4, 3))
    directions[:, kept:] = 0.0
    start_from_directions(model, positions, directions)
    after = model.embed_all()
    scale = np.sqrt(np.mean(np.sum(before[positions] ** 2, axis=1)) / np.mean(np.sum(directions**2, axis=1)))
    np.testing.assert_allclose(after[positions, :kept], directions[:, :kept] * scale, atol=1e-5)
    shared = model.embed_all(shared=True)
    others = np.setdiff1d(np.arange(12), positions)
    np.testing.assert_allclose(after[others], shared[others], atol=1e-6)  # no residual beyond the Gram's items
    biased = np.c_[before, np.ones(12)]  # the output layer is affine: one map of [features, 1]
    mapping = np.linalg.lstsq(biased, shared, rcond=None)[0]
    np.testing.assert_allclose(biased @ mapping, shared, atol=1e-5)
    assert np.linalg.matrix_rank(shared, tol=1e-6) == np.linalg.matrix_rank(before, tol=1e-6)


def test_a_features_encoder_keeps_its_start_when_no_direction_stands_above_the_noise():
    from pipelines.training.prepare import start_from_directions

    model = _features_encoder(dim=3)
    before = model.embed_all()
    start_from_directions(model, np.array([1, 4]), np.zeros((2, 3)))
    np.testing.assert_allclose(model.embed_all(), before)


def test_removing_a_user_from_the_raw_input_moves_the_item_gram_by_that_users_term_only(tmp_path):
    """Neighbouring data end to end: the raw log with and without one training user, each through
    the prepare stage (split, counts, centred rows, the item Gram), without noise so that the two
    releases can be compared (a noised release's key carries its inputs' digest). Every stage
    before the release treats the other users' rows alike: the Grams differ by the removed user's
    unit-norm x x^T over the Gram's items, nothing else."""
    import pyarrow.compute as pc

    from pipelines.data.datasets import open_dataset, write_dataset
    from pipelines.releases.item_gram import item_gram_sums
    from privacy.accumulator import pack_upper

    data = tmp_path / "data"
    assert (
        cli.main(["synth", "--users", "300", "--items", "80", "--ratings-per-user", "15", "--out", str(data), "-q"])
        == 0
    )
    full = open_dataset(str(data))
    log = storage.read_table(full.interactions)

    def prepared(folder, table):
        write_dataset(str(folder / "data"), storage.read_table(full.items), table.to_batches(), full.manifest)
        flags = ["--protocol", "recall", "--item-update", "gram", "--encoder", "id", "--non-private"]
        assert (
            cli.main(
                [
                    "train",
                    "--stage",
                    "prepare",
                    "--data",
                    str(folder / "data"),
                    "--out",
                    str(folder / "run"),
                    "--engine",
                    "local",
                    *flags,
                    "-q",
                ]
            )
            == 0
        )
        return read_item_gram(str(folder / "run" / "item_gram" / "item_gram.parquet"))

    items, gram, _ = prepared(tmp_path / "all", log)
    train = storage.read_table(str(tmp_path / "all" / "run" / "private" / "split" / "train.parquet"))
    for user in np.unique(train["user_id"].to_numpy())[::7]:  # a training user whose removal keeps the top items
        without = log.filter(pc.not_equal(log["user_id"], user))
        folder = tmp_path / f"without-{user}"
        others, gram_without, _ = prepared(folder, without)
        if np.array_equal(others, items):
            break
    else:
        pytest.fail("every user tried changes the top items")
    mine = train.filter(pc.equal(train["user_id"], user))
    own = item_gram_sums(mine["user_id"].to_numpy(), mine["item_id"].to_numpy(), items)
    assert own.any()
    np.testing.assert_allclose(pack_upper(gram - gram_without), own, atol=1e-9)
