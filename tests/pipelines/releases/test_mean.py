"""The DP mean's weighted sums, by hand, and the same on Spark and Beam; the release for the same seed."""

import numpy as np
import pyarrow as pa
import pytest

from pipelines.engines.local import LocalEngine
from pipelines.releases.mean import dp_mean, weighted_sums, weighted_sums_of
from pipelines.releases.release import PrivacySettings
from privacy.seeds import SeedFile
from schemas import storage
from schemas.tables import INTERACTIONS

RANGE = (0.5, 5.0)  # middle 2.75


@pytest.fixture
def rows(tmp_path):
    """User 1 rates 5 and 1, user 2 rates 4, user 3 rates 0.2 (clipped to 0.5)."""
    path = str(tmp_path / "rows.parquet")
    storage.write_table(
        pa.table(
            {"user_id": [1, 1, 2, 3], "item_id": [10, 20, 10, 30], "label": [5.0, 1.0, 4.0, 0.2], "timestamp": [0] * 4},
            schema=INTERACTIONS,
        ),
        path,
    )
    return path


def test_each_user_adds_at_most_the_cap(rows):
    # cap 1: user 1's ratings weigh 1/2 each; centred labels 2.25, -1.75 | 1.25 | -2.25
    assert weighted_sums(rows, RANGE, "user", 1.0) == pytest.approx(
        (0.5 * (2.25 - 1.75) + 1.25 - 2.25, 0.5 * 2 + 1 + 1)
    )
    assert weighted_sums(rows, RANGE, "user", 50.0) == pytest.approx(
        (2.25 - 1.75 + 1.25 - 2.25, 4.0)
    )  # under the cap: every rating 1
    assert weighted_sums(rows, RANGE, "example", 1.0) == pytest.approx((-0.5, 4.0))


def test_users_out_of_order_weigh_as_users_in_order():
    """The rows of the fixture shuffled (user 1's two rows apart): the same per-user weights, by
    counting each user's rows whether or not they come together."""
    users, labels = np.array([2, 1, 3, 1]), np.array([4.0, 5.0, 0.2, 1.0])
    assert weighted_sums_of(users, labels, RANGE, "user", 1.0) == pytest.approx(
        (0.5 * (2.25 - 1.75) + 1.25 - 2.25, 3.0)
    )
    in_order = np.argsort(users, kind="stable")
    assert weighted_sums_of(users[in_order], labels[in_order], RANGE, "user", 1.0) == pytest.approx(
        weighted_sums_of(users, labels, RANGE, "user", 1.0)
    )


@pytest.mark.parametrize("unit, cap", [("user", 1.0), ("user", 50.0), ("example", 1.0)])
def test_an_engine_gives_the_same_sums(engine, rows, unit, cap):
    assert engine.mean_sums(rows, RANGE, unit, cap) == pytest.approx(
        weighted_sums(rows, RANGE, unit, cap), rel=1e-12, abs=1e-12
    )


def test_the_release_on_an_engine_is_the_in_process_one(engine, rows, tmp_path):
    seed = SeedFile.create(str(tmp_path / "seed")).seed
    released = {}
    for name, where in (
        ("local", LocalEngine()),
        ("engine", engine),
    ):  # one seed, a seed file per run (a seed serves one ledger)
        ledger = PrivacySettings(epsilon=1.0).open_ledger(str(tmp_path / name / "ledger.parquet"), "user")
        released[name] = dp_mean(
            rows, ledger, SeedFile.create(str(tmp_path / f"seed-{name}"), seed), RANGE, engine=where
        )
    assert released["engine"] == released["local"] and 0.5 <= released["local"]["mean"] <= 5.0


def test_files_of_whole_users_give_the_same_sums_a_file_per_task_and_a_user_in_two_files_is_refused(
    spark, rows, tmp_path
):
    # Spark sums a table whose files declare whole users in order a file per task (no shuffle);
    # a user in two such files would be capped twice, so that table is refused
    from pipelines.data.chunks import USERS_TOGETHER
    from pipelines.engines.prepare_spark import SparkEngine

    table = storage.read_table(rows)
    for name, edges in (("whole", [0, 3, 4]), ("torn", [0, 1, 4])):  # torn: user 1's two rows in both files
        staged = storage.StagedWrite(str(tmp_path / f"{name}.parquet"))
        staged.commit(
            [
                staged.write_part(k, table.slice(a, b - a).replace_schema_metadata(USERS_TOGETHER))
                for k, (a, b) in enumerate(zip(edges[:-1], edges[1:], strict=True))
            ],
            table.num_rows,
        )
    assert SparkEngine(spark).mean_sums(str(tmp_path / "whole.parquet"), RANGE, "user", 1.0) == pytest.approx(
        weighted_sums(rows, RANGE, "user", 1.0), rel=1e-12
    )
    with pytest.raises(ValueError, match="a user's rows are in two of its files"):
        SparkEngine(spark).mean_sums(str(tmp_path / "torn.parquet"), RANGE, "user", 1.0)


def test_a_digest_handed_over_binds_the_release_as_the_one_it_takes_itself(rows, tmp_path):
    # prepare hands the mean the digest its counts release took of the same table: the release's
    # binding (its fingerprint in the seed file) is the one the mean's own digest gives; another
    # table's digest would bind another release
    from pipelines.releases.counts import dp_counts

    items = str(tmp_path / "items.parquet")
    storage.write_table(pa.table({"item_id": [10, 20, 30]}), items)
    seed = SeedFile.create(str(tmp_path / "seed")).seed
    bound = {}
    for name in ("handed", "taken", "other"):
        ledger_path = str(tmp_path / name / "ledger.parquet")
        privacy = PrivacySettings(epsilon=1.0, mean_share=0.2)
        seeds = SeedFile.create(str(tmp_path / f"seed-{name}"), seed)
        counted = dp_counts(
            rows,
            items,
            str(tmp_path / name),
            privacy,
            ledger_path=ledger_path,
            seed_file=seeds.path,
            engine=LocalEngine(),
        )
        assert counted["inputs"]["interactions"] == seeds.digest_table(rows)
        digest = {"handed": counted["inputs"]["interactions"], "taken": None, "other": counted["inputs"]["items"]}[name]
        seeds = SeedFile.load(seeds.path)
        index = dp_mean(
            rows,
            privacy.open_ledger(ledger_path, "user"),
            seeds,
            RANGE,
            engine=LocalEngine(),
            interactions_digest=digest,
        )["release"]
        bound[name] = SeedFile.load(seeds.path).releases[index]
    assert bound["handed"] == bound["taken"] != bound["other"]
