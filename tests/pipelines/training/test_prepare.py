"""The prepare stage on Spark and on Beam: the same split tables, the same releases (DP counts, DP
mean) and the same centred rows as in this process, for the same seed; the log never comes to
the driver (pipelines.engines.prepare_spark, pipelines.engines.prepare_beam)."""

import json

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pytest

from pipelines.data import splits
from pipelines.data.chunks import users_together
from pipelines.data.datasets import open_dataset, write_dataset
from pipelines.data.synth import generate
from pipelines.engines.local import LocalEngine
from pipelines.engines.prepare_beam import BeamEngine
from pipelines.engines.prepare_spark import SparkEngine
from pipelines.releases import counts, mean, stats_core
from pipelines.releases.item_gram import item_gram_sums
from pipelines.releases.train_sums import TrainSumsRequest
from pipelines.training import prepare, run_dir, settings
from privacy.accumulator import unpack_upper
from privacy.ledger import Ledger
from privacy.seeds import SeedFile, keyed_digest_batches
from schemas import storage
from schemas.tables import INTERACTIONS, items_schema


def _rows(table):
    return sorted(zip(*(table[c].to_pylist() for c in INTERACTIONS.names), strict=True), key=repr)


def _ratings_with_repeats(seed=0, users=60, items=80):
    """Ratings 0.5..5 with repeated (user, item) pairs (later and earlier timestamps, null ones),
    negative and extreme ids: what the split's user-local dedup must treat as this process does;
    and rare items, which the recall protocol's restriction to training items removes."""
    rng = np.random.default_rng(seed)
    user_ids = np.array([-7, 2**62, *range(1, users - 1)], dtype=np.int64)
    item_ids = np.array([-3, 2**61, *range(100, 100 + items - 2)], dtype=np.int64)
    n = 40 * users
    user = rng.choice(user_ids, n)
    item = rng.choice(item_ids, n)
    item[:users] = 5000 + np.arange(users)  # rare items, one rating each: some only held-out users have
    label = rng.integers(1, 11, n) / 2.0
    label[:users] = 5.0
    stamp = pa.array(rng.integers(0, 1000, n), pa.int64()).to_pylist()
    stamp = [None if rng.random() < 0.05 else value for value in stamp]
    return pa.table(
        {"user_id": user, "item_id": item, "label": label, "timestamp": pa.array(stamp, pa.int64())},
        schema=INTERACTIONS,
    )


def _dataset(path, table, catalog=None):
    catalog = np.unique(table["item_id"].to_numpy()) if catalog is None else catalog
    items = pa.table({"item_id": catalog, "title": [f"item {i}" for i in catalog]}, schema=items_schema({}))
    write_dataset(str(path), items, table.to_batches(max_chunksize=500), {"source": "test"})
    return open_dataset(str(path))


def _assert_whole_users_in_order(path):
    """The table declares chunks.USERS_TOGETHER, and rightly: each file sorted by user, no user in two files."""
    assert users_together(path)
    seen = set()
    for file in storage.table_files(path):
        users = storage.read_table(file)["user_id"].to_numpy()
        assert np.all(users[1:] >= users[:-1]) and not seen & set(users.tolist())
        seen |= set(users.tolist())


def _assert_one_item_shard_per_row_group(path, shards):
    """The table declares stats_core.ITEM_SHARDS, and rightly: every row group's items are of one
    shard, and a file's rows keep the input's order within a shard (here: by user)."""
    assert stats_core.declared_item_shards(path) == shards and not users_together(path)
    for file, group, rows in storage.row_groups(path):
        table = pa.Table.from_batches(list(storage.iter_row_group(file, group)))
        assert (
            table.num_rows == rows > 0 and np.unique(stats_core.shard_of(table["item_id"].to_numpy(), shards)).size == 1
        )
        users = table["user_id"].to_numpy()
        assert np.all(users[1:] >= users[:-1])


@pytest.mark.parametrize("protocol, holdout", [("rmse", 0.2), ("recall", 0.2), ("recall", 0.0)])
def test_the_split_on_an_engine_is_the_in_process_split(engine, tmp_path, protocol, holdout):
    data = _dataset(tmp_path / "data", _ratings_with_repeats())
    local = splits.make_split(data, protocol, str(tmp_path / "local"), seed=11, holdout=holdout, engine=LocalEngine())
    distributed = splits.make_split(
        data, protocol, str(tmp_path / engine.name), seed=11, holdout=holdout, engine=engine
    )
    assert distributed == local == json.loads((tmp_path / engine.name / splits.SPLIT_MANIFEST).read_text())
    for name in local["sizes"]:
        expected = storage.read_table(str(tmp_path / "local" / f"{name}.parquet"))
        got = storage.read_table(str(tmp_path / engine.name / f"{name}.parquet"))
        assert got.schema.equals(INTERACTIONS) and _rows(got) == _rows(expected)
        if (
            engine.name != "local"
        ):  # the distributed engines write whole users in order; this process one table as the rule gave it
            _assert_whole_users_in_order(str(tmp_path / engine.name / f"{name}.parquet"))
    centred = str(
        tmp_path / engine.name / "centred.parquet"
    )  # written a part per file of the split's train: whole users in order too
    by_shard = str(tmp_path / engine.name / "by-shard.parquet")  # the stats job's rows: a row group per item shard
    engine.write_centred(
        str(tmp_path / engine.name / "train.parquet"),
        [mean.CentredOutput(centred), mean.CentredOutput(by_shard, item_shards=3)],
        3.0,
        protocol,
    )
    if engine.name != "local":
        _assert_whole_users_in_order(centred)
        _assert_one_item_shard_per_row_group(by_shard, 3)
    expected = _rows(mean.centred(storage.read_table(str(tmp_path / "local" / "train.parquet")), 3.0, protocol, None))
    assert _rows(storage.read_table(centred)) == _rows(storage.read_table(by_shard)) == expected
    assert local["sizes"]["train"]["rows"] > 0 and (
        holdout == 0 or local["sizes"][splits.RATING_PARTS[1] if protocol == "rmse" else "test_targets"]["rows"] > 0
    )
    if protocol == "recall" and holdout:  # the restriction of held-out rows to training items bit
        unrestricted = splits.split_heldout_users(
            _ratings_with_repeats(), 11, holdout=holdout, restrict_to_train_items=False
        )
        assert sum(unrestricted[name].num_rows for name in splits.HELDOUT_PARTS[1:]) > sum(
            local["sizes"][name]["rows"] for name in splits.HELDOUT_PARTS[1:]
        )


@pytest.mark.parametrize("unit", ["user", "example"])
def test_the_count_aggregates_on_an_engine_are_the_in_process_ones(engine, tmp_path, unit):
    """Repeated pairs counted once and each user's keyed sample of 3 items (user level), every row
    (example level): the engine's per-item counts and number of units are exact_aggregates'."""
    table = _ratings_with_repeats()
    data = _dataset(tmp_path / "data", table)
    catalog = np.sort(storage.read_table(data.items)["item_id"].to_numpy())
    expected = counts.exact_aggregates(
        table["user_id"].to_numpy(), table["item_id"].to_numpy(), catalog, unit, 3, key=12345
    )
    got = engine.count_aggregates(data.interactions, catalog, unit, 3, 12345)
    assert np.array_equal(got[0], expected[0]) and got[1] == expected[1]
    assert expected[1] == (60 if unit == "user" else table.num_rows) and expected[0].sum() == (
        3 * 60 if unit == "user" else table.num_rows
    )


def test_the_item_gram_sums_on_an_engine_are_the_in_process_ones(engine, tmp_path):
    """Every engine adds up `item_gram_sums` of complete users: the same matrix (to float64 rounding)
    as one pass over the whole table, over every other catalog item (repeats counted once)."""
    table = _ratings_with_repeats()
    data = _dataset(tmp_path / "data", table)
    items = np.sort(storage.read_table(data.items)["item_id"].to_numpy())[::2]
    expected = item_gram_sums(table["user_id"].to_numpy(), table["item_id"].to_numpy(), items)
    got = engine.item_gram_sums(data.interactions, items)
    np.testing.assert_allclose(got, expected, rtol=1e-12, atol=1e-12)
    diagonal = unpack_upper(expected, items.size).diagonal()
    assert expected.size == items.size * (items.size + 1) // 2 and diagonal.sum() == pytest.approx(
        np.unique(table["user_id"].to_numpy()[np.isin(table["item_id"].to_numpy(), items)]).size
    )  # each user's row has unit norm: the trace counts the users with an item among them


def test_count_aggregates_from_files_of_whole_users_are_the_same_and_a_user_in_two_files_is_refused(spark, tmp_path):
    """Spark reads a table whose files declare whole users in order a file per task (no shuffle):
    the same counts; a user whose rows are in two such files would have two samples of K items, so
    that table is refused."""
    from pipelines.data.chunks import USERS_TOGETHER

    table = _ratings_with_repeats().sort_by([("user_id", "ascending")])
    catalog = np.unique(table["item_id"].to_numpy())
    expected = counts.exact_aggregates(
        table["user_id"].to_numpy(), table["item_id"].to_numpy(), catalog, "user", 3, key=12345
    )
    start = int(
        np.searchsorted(table["user_id"].to_numpy(), np.unique(table["user_id"].to_numpy())[20])
    )  # the 21st user's first row
    for name, edges in (
        ("whole", [0, start, table.num_rows]),
        ("torn", [0, start + 2, table.num_rows]),
    ):  # torn: that user's rows in both files
        staged = storage.StagedWrite(str(tmp_path / f"{name}.parquet"))
        staged.commit(
            [
                staged.write_part(k, table.slice(a, b - a).replace_schema_metadata(USERS_TOGETHER))
                for k, (a, b) in enumerate(zip(edges[:-1], edges[1:], strict=True))
            ],
            table.num_rows,
        )
    got = SparkEngine(spark).count_aggregates(str(tmp_path / "whole.parquet"), catalog, "user", 3, 12345)
    assert np.array_equal(got[0], expected[0]) and got[1] == expected[1] == 60
    gram = item_gram_sums(table["user_id"].to_numpy(), table["item_id"].to_numpy(), catalog)
    np.testing.assert_allclose(SparkEngine(spark).item_gram_sums(str(tmp_path / "whole.parquet"), catalog), gram)
    with pytest.raises(ValueError, match="a user's rows are in two of its files"):
        SparkEngine(spark).count_aggregates(str(tmp_path / "torn.parquet"), catalog, "user", 3, 12345)
    with pytest.raises(ValueError, match="the item Gram would scale the user twice"):
        SparkEngine(spark).item_gram_sums(str(tmp_path / "torn.parquet"), catalog)


def _train_sums_request(catalog, rating_range=(0.5, 5.0)):
    return TrainSumsRequest(catalog, "user", 3, 12345, rating_range, 2.0, b"k" * 32)


@pytest.mark.parametrize("protocol", ["rmse", "recall"])
def test_the_train_sums_on_an_engine_are_its_operations_one_by_one(engine, tmp_path, protocol):
    """The prepare stage's sums of the split's train (whole users in order: Spark's one pass): the
    exact counts and units of the whole table, the mean's sums of the engine's own `mean_sums` to
    the bit (none for the ranking protocol), and the table's keyed digest."""
    data = _dataset(tmp_path / "data", _ratings_with_repeats())
    splits.make_split(data, "rmse", str(tmp_path / "split"), seed=11, holdout=0.2, engine=engine)
    train = str(tmp_path / "split" / "train.parquet")
    table = storage.read_table(train)
    catalog = np.sort(storage.read_table(data.items)["item_id"].to_numpy())
    rating_range = (0.5, 5.0) if protocol == "rmse" else None
    got = engine.train_sums(train, _train_sums_request(catalog, rating_range))
    exact, units = counts.exact_aggregates(
        table["user_id"].to_numpy(), table["item_id"].to_numpy(), catalog, "user", 3, key=12345
    )
    assert np.array_equal(got.counts, exact) and got.units == units == 60
    if protocol == "rmse":
        assert got.mean_sums == engine.mean_sums(train, (0.5, 5.0), "user", 2.0)
        assert got.mean_sums == pytest.approx(mean.weighted_sums(train, (0.5, 5.0), "user", 2.0), rel=1e-12)
    else:
        assert got.mean_sums is None
    assert got.digest == keyed_digest_batches(storage.iter_batches(train), b"k" * 32)
    assert got.digest != keyed_digest_batches(storage.iter_batches(train), b"j" * 32)


def test_removing_one_user_from_the_raw_input_moves_the_train_sums_by_that_users_own_terms(engine, tmp_path):
    """Neighbouring data sets, one user (with a repeated pair and more than K = 3 items) removed from
    the raw input, split and summed on the engine: everyone else's training rows are the same, the
    counts move by that user's own sample of K items and the units by 1, the mean's sums by that
    user's own capped terms, and the digest changes."""
    table = _ratings_with_repeats()
    catalog = np.unique(table["item_id"].to_numpy())
    user = -7
    sums, trains = {}, {}
    for name, rows in (("full", table), ("without", table.filter(pc.not_equal(table["user_id"], user)))):
        data = _dataset(tmp_path / name, rows, catalog)
        splits.make_split(data, "rmse", str(tmp_path / name / "split"), seed=11, holdout=0.2, engine=engine)
        trains[name] = storage.read_table(str(tmp_path / name / "split" / "train.parquet"))
        sums[name] = engine.train_sums(str(tmp_path / name / "split" / "train.parquet"), _train_sums_request(catalog))
    full_rows, mine = _rows(trains["full"]), [row for row in _rows(trains["full"]) if row[0] == user]
    assert _rows(trains["without"]) == [row for row in full_rows if row[0] != user] and len(mine) > 3
    own = trains["full"].filter(pc.equal(trains["full"]["user_id"], user))
    users, items, labels = own["user_id"].to_numpy(), own["item_id"].to_numpy(), own["label"].to_numpy()
    own_counts, own_units = counts.exact_aggregates(users, items, catalog, "user", 3, key=12345)
    assert own_counts.sum() == 3 and own_units == 1
    assert np.array_equal(sums["full"].counts - sums["without"].counts, own_counts)
    assert sums["full"].units - sums["without"].units == 1
    own_mean = mean.weighted_sums_of(users, labels, (0.5, 5.0), "user", 2.0)
    assert np.subtract(sums["full"].mean_sums, sums["without"].mean_sums) == pytest.approx(own_mean, abs=1e-9)
    assert sums["full"].digest != sums["without"].digest


def test_spark_train_sums_refuse_a_bad_row_and_a_user_in_two_files_in_their_one_pass(spark, tmp_path):
    """The one pass refuses as the engine's `check_count_rows` does, in its words (an item missing
    from the catalog, in the second file), and a user whose rows are in two files of whole users."""
    from pipelines.data.chunks import USERS_TOGETHER

    table = _ratings_with_repeats().sort_by([("user_id", "ascending")])
    catalog = np.unique(table["item_id"].to_numpy())
    start = int(np.searchsorted(table["user_id"].to_numpy(), np.unique(table["user_id"].to_numpy())[20]))
    unknown = table.set_column(1, "item_id", pa.array(np.r_[table["item_id"].to_numpy()[:-1], 7777]))
    for name, rows, edges in (
        ("unknown", unknown, [0, start, table.num_rows]),
        ("torn", table, [0, start + 2, table.num_rows]),
    ):
        staged = storage.StagedWrite(str(tmp_path / f"{name}.parquet"))
        staged.commit(
            [
                staged.write_part(k, rows.slice(a, b - a).replace_schema_metadata(USERS_TOGETHER))
                for k, (a, b) in enumerate(zip(edges[:-1], edges[1:], strict=True))
            ],
            rows.num_rows,
        )
    with pytest.raises(ValueError) as expected:
        SparkEngine(spark).check_count_rows(str(tmp_path / "unknown.parquet"), catalog)
    assert "items missing from the catalog (e.g. 7777)" in str(expected.value)
    with pytest.raises(ValueError) as refused:
        SparkEngine(spark).train_sums(str(tmp_path / "unknown.parquet"), _train_sums_request(catalog))
    assert str(refused.value) == str(expected.value)
    with pytest.raises(ValueError, match="a user's rows are in two of its files"):
        SparkEngine(spark).train_sums(str(tmp_path / "torn.parquet"), _train_sums_request(catalog))


@pytest.mark.parametrize("protocol", ["rmse", "recall"])
def test_a_split_of_files_of_whole_users_takes_a_file_per_task_and_gives_the_same_tables(spark, tmp_path, protocol):
    """Spark splits a table whose files declare whole users in order, with disjoint user ranges, a
    file per task (no shuffle): the in-process tables. Files whose ranges overlap (a user could be
    in two) are shuffled by user as any table: the same tables again."""
    from pipelines.data.chunks import USERS_TOGETHER
    from pipelines.engines.prepare_spark import files_of_whole_users

    table = _ratings_with_repeats().sort_by([("user_id", "ascending")])
    data = _dataset(tmp_path / "data", table)
    local = splits.make_split(data, protocol, str(tmp_path / "local"), seed=11, holdout=0.2, engine=LocalEngine())
    users = table["user_id"].to_numpy()
    cut = [
        0,
        int(np.searchsorted(users, np.unique(users)[20])),
        int(np.searchsorted(users, np.unique(users)[41])),
        table.num_rows,
    ]
    whole = [table.slice(a, b - a) for a, b in zip(cut[:-1], cut[1:], strict=True)]
    overlapping = [
        pa.concat_tables([whole[0], whole[2]]),
        whole[1],
    ]  # each file whole users in order, but the first file's range holds the second's
    for layout, pieces in (("whole", whole), ("overlapping", overlapping)):
        staged = storage.StagedWrite(data.interactions)
        staged.commit(
            [staged.write_part(k, piece.replace_schema_metadata(USERS_TOGETHER)) for k, piece in enumerate(pieces)],
            table.num_rows,
        )
        assert (files_of_whole_users(data.interactions) is not None) == (layout == "whole")
        got = splits.make_split(data, protocol, str(tmp_path / layout), seed=11, holdout=0.2, engine=SparkEngine(spark))
        assert got == local
        for name in local["sizes"]:
            assert _rows(storage.read_table(str(tmp_path / layout / f"{name}.parquet"))) == _rows(
                storage.read_table(str(tmp_path / "local" / f"{name}.parquet"))
            )
            _assert_whole_users_in_order(str(tmp_path / layout / f"{name}.parquet"))


def test_a_ranking_split_without_eligible_users_is_refused_and_publishes_nothing(engine, tmp_path):
    table = _ratings_with_repeats().slice(0, 30)
    data = _dataset(
        tmp_path / "data", table.set_column(2, INTERACTIONS.field("label"), pa.array(np.ones(30)))
    )  # no label above 3.5
    with pytest.raises(ValueError, match="needs users with at least 5 positives"):
        splits.make_split(data, "recall", str(tmp_path / "split"), engine=engine)
    assert not (tmp_path / "split").exists() or not any(
        p.name.endswith(".parquet") for p in (tmp_path / "split").iterdir()
    )


@pytest.mark.parametrize("protocol", ["rmse", "recall"])
def test_the_prepare_stage_on_spark_and_beam_makes_the_in_process_releases(spark, tmp_path, protocol):
    """The acceptance test of the distributed prepare stage: one seed, three engines, the same
    releases (counts and the DP number of users byte for byte, the DP mean) and the same tables
    (`local_rows=0`: on the engine however small the log)."""
    data = generate(str(tmp_path / "data"), like="movielens", users=300)
    prepared = {}
    seed = None
    for name, engine in (("local", LocalEngine()), ("spark", SparkEngine(spark)), ("beam", BeamEngine())):
        config = settings.TrainConfig.create(
            out=str(tmp_path / name), data=data.path, protocol=protocol, epsilon=2.0, dim=8, seed_file=seed, engine=name
        )
        prepared[name] = prepare.prepare(config, progress=False, engine=engine, local_rows=0)
        seed = SeedFile.create(
            str(tmp_path / f"seed-after-{name}"), SeedFile.load(str(tmp_path / "local" / "private" / "seed")).seed
        ).path  # one ledger a file
    runs = {name: run_dir.Run(str(tmp_path / name)) for name in prepared}
    for name in ("spark", "beam"):
        counts, expected = storage.read_table(runs[name].counts), storage.read_table(runs["local"].counts)
        assert counts.equals(expected) and counts.schema.metadata == expected.schema.metadata, name
        assert prepared[name]["prepared"]["mean"] == prepared["local"]["prepared"]["mean"], name
        ledger, expected_ledger = Ledger.open(runs[name].ledger), Ledger.open(runs["local"].ledger)
        assert [r["name"] for r in ledger.rows] == [
            r["name"] for r in expected_ledger.rows
        ] and ledger.epsilon_spent() == expected_ledger.epsilon_spent(), name
        for table in ("split/train.parquet", "train_centred.parquet", "stats_rows.parquet"):
            got = storage.read_table(runs[name].private(table))
            assert _rows(got) == _rows(storage.read_table(runs["local"].private(table))), (name, table)
    assert (
        prepared["local"]["prepared"]["mean"] != 0.0
        if protocol == "rmse"
        else prepared["local"]["prepared"]["mean"] == 0.0
    )


def test_beam_options_come_from_the_environment_and_a_typo_is_refused(monkeypatch):
    from pipelines.engines.prepare_beam import OPTIONS_ENV, options_from_environment

    monkeypatch.delenv(OPTIONS_ENV, raising=False)
    assert options_from_environment() is None  # the DirectRunner
    monkeypatch.setenv(
        OPTIONS_ENV, "--runner DataflowRunner --project p --region europe-west4 --temp_location gs://b/tmp"
    )
    options = options_from_environment().get_all_options()
    assert (options["runner"], options["project"], options["temp_location"]) == ("DataflowRunner", "p", "gs://b/tmp")
    monkeypatch.setenv(OPTIONS_ENV, "--runner DataflowRunner --projet p")
    with pytest.raises(ValueError, match="--projet is not a Beam pipeline option"):
        options_from_environment()
