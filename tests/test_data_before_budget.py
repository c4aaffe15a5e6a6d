"""No data-dependent failure after the first release: whatever catalog and log a user brings (ids in
any order, sparse or near the int64 limit, a repeated catalog id, items missing from the catalog, a
feature column with no value, repeated pairs), ingest refuses it in one line with nothing written,
or a run refuses it before its ledger holds a release, or the run finishes."""

from __future__ import annotations

import tempfile
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
from hypothesis import HealthCheck, Phase, given, settings
from hypothesis import strategies as st

from pipelines.data import generic
from pipelines.training import settings as run_settings
from pipelines.training import stages
from privacy.ledger import Ledger
from schemas.errors import UserError
from ssp import cli
from tests.test_hostile_cli import ssp

LAYOUTS = ("dense", "shuffled", "sparse", "huge")


def catalog_ids(layout: str, items: int, rng: np.random.Generator) -> np.ndarray:
    ids = np.arange(items, dtype=np.int64) + 1
    if layout == "shuffled":
        ids = rng.permutation(ids)
    elif layout == "sparse":
        ids = rng.permutation(ids * 1_000_003)
    elif layout == "huge":
        ids = rng.permutation((2**62) + ids * (2**40))
    return ids


def write_case(folder: Path, case: dict) -> tuple[Path, Path]:
    rng = np.random.default_rng(case["seed"])
    ids = catalog_ids(case["layout"], case["items"], rng)
    if case["repeated_item"]:
        ids = np.append(ids, ids[0])
    genres = [None] * ids.size if case["no_features"] else [f"g{i % 3}" for i in range(ids.size)]
    pq.write_table(pa.table({"item": ids, "genre": pa.array(genres, pa.string())}), folder / "items.parquet")
    users = np.repeat(np.arange(case["users"], dtype=np.int64) * 7 + 3, case["per_user"])
    items = rng.choice(np.unique(ids), users.size)
    if case["missing_item"]:
        items[0] = ids.max() + 1 if ids.max() < 2**62 else ids.min() - 1
    columns = {"user": users, "item": items}
    if case["protocol"] == "rmse":
        columns["stars"] = rng.integers(1, 6, users.size).astype(float)
    pq.write_table(pa.table(columns), folder / "log.parquet")
    return folder / "log.parquet", folder / "items.parquet"


RARELY = st.sampled_from((False, False, False, True))  # most cases valid: they train
CASES = st.fixed_dictionaries(
    {
        "layout": st.sampled_from(LAYOUTS),
        "items": st.integers(8, 40),
        "users": st.integers(30, 60),
        "per_user": st.integers(3, 8),
        "repeated_item": RARELY,
        "missing_item": RARELY,
        "no_features": RARELY,
        "protocol": st.sampled_from(("rmse", "recall")),
        "seed": st.integers(0, 2**16),
    }
)


@settings(
    max_examples=10,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow],
    phases=[Phase.explicit, Phase.reuse, Phase.generate],  # each case is a whole run: no shrinking
)
@given(CASES)
def test_a_generated_data_set_is_refused_before_any_release_or_trains(case):
    with tempfile.TemporaryDirectory() as temporary:
        folder = Path(temporary)
        log, catalog = write_case(folder, case)
        columns = generic.Columns(user="user", item="item", label="stars" if case["protocol"] == "rmse" else None)
        try:
            generic.ingest(
                str(log),
                str(catalog),
                str(folder / "data"),
                {"genre": "value"},
                columns=columns,
                rating_scale=(1.0, 5.0) if case["protocol"] == "rmse" else None,
            )
        except UserError:
            assert case["repeated_item"] or case["missing_item"] or case["no_features"], case
            assert not (folder / "data" / "manifest.json").exists()
            return
        config = run_settings.TrainConfig.create(
            data=str(folder / "data"),
            out=str(folder / "run"),
            protocol=case["protocol"],
            engine="local",
            epsilon=4.0,
            dim=2,
            epochs=1,
            outer_steps=1,  # the refusals come before any release; one step trains the rest
            model_seed=case["seed"],
        )
        try:
            metrics = stages.run(config, progress=False)
        except UserError:
            ledger = folder / "run" / "ledger.parquet"
            assert not ledger.exists() or Ledger.open(str(ledger)).rows == [], case
            return
        assert metrics["epsilon_spent"] <= 4.0 * (1 + 1e-9) and (folder / "run" / "metrics.json").exists()


def test_an_unsorted_sparse_catalog_trains_through_the_installed_command(tmp_path):
    case = dict(layout="huge", items=30, users=60, per_user=6, repeated_item=False, missing_item=False)
    log, catalog = write_case(tmp_path, {**case, "no_features": False, "protocol": "recall", "seed": 7})
    flags = ["--user-col", "user", "--item-col", "item", "--features", "genre:value"]
    ingest = ["ingest", "--interactions", log, "--catalog", catalog, *flags, "--out", tmp_path / "data"]
    assert cli.main([*map(str, ingest)]) == 0  # the stage, in this process; the run through the installed `ssp`
    run = ["--protocol", "recall", "--engine", "local", "--epsilon", 4, "--dim", 4, "--epochs", 2]
    result = ssp("train", "--data", tmp_path / "data", "--out", tmp_path / "run", *run)
    assert result.returncode == 0, result.stderr[-2000:]
    assert (tmp_path / "run" / "metrics.json").exists()
