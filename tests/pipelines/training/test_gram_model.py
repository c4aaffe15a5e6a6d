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


@pytest.mark.parametrize(
    "settings, refusal",
    [
        ({"item_update": "gram", "encoder": "id"}, "use it with --protocol recall"),
        ({"item_update": "gram", "protocol": "recall"}, "use it with --encoder id"),
        ({"item_update": "ssp", "protocol": "recall", "item_gram_share": 0.3}, "positive with it, 0 otherwise"),
    ],
)
def test_settings_the_gram_model_cannot_run_are_refused(settings, refusal):
    with pytest.raises(UserError, match=refusal):
        TrainConfig.create(epsilon=5, **settings)


def test_the_gram_model_plans_counts_and_the_item_gram_and_nothing_else():
    config = TrainConfig.create(epsilon=5, protocol="recall", item_update="gram", encoder="id")
    assert config.outer_steps == 1 and config.item_gram_share == pytest.approx(1 - config.count_share)
    assert [group.name for group in config.privacy().plan()] == ["counts", "item_gram"]
