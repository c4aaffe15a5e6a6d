"""The stats job on a real local Spark: exact values, every item once, noise, seeds, ledger, bad input."""

import os

import numpy as np
import pyarrow as pa
import pytest

from pipelines import stats as stats_script  # the entry script
from pipelines.engines import spark_stats as stats
from pipelines.engines.local import LocalEngine
from pipelines.releases import stats_job
from pipelines.releases.counts import dp_counts
from pipelines.releases.mean import write_by_item_shard
from pipelines.releases.pairs import files_in_user_order
from pipelines.releases.release import PrivacySettings
from pipelines.releases.stats_core import ITEM_SHARDS, StatsSettings
from privacy.accumulator import unpack_upper
from privacy.ledger import BudgetExceededError, Ledger
from privacy.seeds import SeedFile, SeedReuseError
from schemas import storage
from schemas import tables as schemas
from schemas.tables import stats_metadata, validate_stats
from tests.pipelines.stats_inputs import expected_stats, registered, write_inputs

# 3 users, catalog of 4 items (item 40 has no rows), d = 2
pytestmark = pytest.mark.spark  # the stats job on a local Spark, and its entry point's own

INTERACTIONS = [(1, 10, 4.0), (1, 20, 5.0), (2, 10, 1.0), (2, 30, 3.0), (2, 20, -7.0), (3, 30, 2.5)]
EMBEDDINGS = {1: [3.0, 4.0], 2: [0.5, -0.5], 3: [0.0, 2.0]}
COUNTS = {10: 16.0, 20: 1.0, 30: 81.0, 40: 2.0}
CATALOG = [10, 20, 30, 40]


SETTINGS = StatsSettings(2, 1.0, 5.0, "user", 2.0)


def make_job(paths, out, privacy, settings=SETTINGS, **kwargs):
    return registered(
        stats_job.StatsJob(
            paths["interactions"],
            paths["user_embeddings"],
            paths["items"],
            paths["counts"],
            str(out),
            settings,
            privacy,
            **kwargs,
        )
    )


def read_stats(path):
    table = validate_stats(storage.read_table(path)).sort_by("item_id")
    d = int(stats_metadata(table.schema)["d"])
    return table["item_id"].to_pylist(), np.array(table["a_upper"].to_pylist()), np.array(table["b"].to_pylist()), d


def test_the_tasks_get_the_inputs_of_a_relative_run_as_absolute_paths(monkeypatch, tmp_path):
    """An executor of a cluster reads from its own working folder: a run named by a relative path
    (`--run RUN` from the folder that holds it) hands its tasks absolute paths."""
    monkeypatch.chdir(tmp_path)
    job = stats_job.StatsJob(
        "rows", "run/users.parquet", "items", "counts", "out", SETTINGS, PrivacySettings(noise_multiplier=1.0)
    )
    job.digests = {"user_embeddings": "u", "expansion": "e"}
    assert stats.job_inputs(job) == ((str(tmp_path / "run" / "users.parquet"), "u"), None)
    job.expansion = "expansion.parquet"
    assert stats.job_inputs(job)[1] == (str(tmp_path / "expansion.parquet"), "e")


def test_partition_keys_are_computed_as_spark_hashes_them(spark):
    # Spark's own hash of ints (negative, zero, large) is ours, and each key of partition_keys(n)
    # lands in partition k when Spark repartitions by it
    values = np.r_[np.arange(-300, 300), [2**31 - 1, -(2**31), 123456789, -987654321]].astype(np.int32)
    frame = spark.createDataFrame([(int(v),) for v in values], "v int")
    got = {row["v"]: row["h"] for row in frame.selectExpr("v", "hash(v) as h").collect()}
    np.testing.assert_array_equal(stats.spark_int_hash(values), [got[int(v)] for v in values])
    for partitions in (3, 8):  # with the hash right, pmod does the rest: two partition counts suffice
        keys = stats.partition_keys(partitions)
        placed = (
            spark.createDataFrame([(int(k),) for k in keys], "key int")
            .repartition(partitions, "key")
            .selectExpr("key", "spark_partition_id() as p")
        )
        assert {row["key"]: row["p"] for row in placed.collect()} == {int(k): p for p, k in enumerate(keys)}


def test_noise_off_gives_exact_statistics_for_every_item(spark, tmp_path):
    paths = write_inputs(tmp_path, INTERACTIONS, EMBEDDINGS, COUNTS, CATALOG)
    summary = stats.run(make_job(paths, tmp_path / "out", PrivacySettings(noise_multiplier=0.0)), spark)
    items, a, b, d = read_stats(str(tmp_path / "out" / "resample-0.parquet"))
    assert items == CATALOG and d == 2
    want_a, want_b = expected_stats(INTERACTIONS, EMBEDDINGS, COUNTS, CATALOG, clip_u=1.0, clip_y=5.0, wbar=2.0)
    for row, j in enumerate(CATALOG):
        np.testing.assert_allclose(unpack_upper(a[row], 2), want_a[j], rtol=1e-12, atol=1e-15)
        np.testing.assert_allclose(b[row], want_b[j], rtol=1e-12, atol=1e-15)
    # hand-computed: user 1 has items 10 (n=16) and 20 (n=1): weights 2*(1/2)/sqrt(1/4+1) and 2*1/sqrt(5/4);
    # u = (3,4) clipped to (0.6, 0.8); labels 4 and 5 within the clip. User 2 rates 10 too.
    w1_10, w1_20 = 1 / np.sqrt(1.25), 2 / np.sqrt(1.25)
    norm2 = 16**-0.5 + 81**-0.5 + 1.0
    w2_10 = 2 * 16**-0.25 / np.sqrt(norm2)
    u2 = np.array([0.5, -0.5])
    np.testing.assert_allclose(b[0], w1_10 * 4.0 * np.array([0.6, 0.8]) + w2_10 * 1.0 * u2, rtol=1e-12)
    np.testing.assert_allclose(
        b[1], w1_20 * 5.0 * np.array([0.6, 0.8]) + 2 * 1 / np.sqrt(norm2) * -5.0 * u2, rtol=1e-12
    )
    assert np.all(a[3] == 0) and np.all(b[3] == 0)
    assert summary["releases"] == [1] and summary["epsilon_spent"] == float("inf")  # release 0: the counts
    ledger = Ledger.open(str(tmp_path / "out" / "ledger.parquet"))
    assert [row["name"] for row in ledger.rows] == ["counts", "step-1/stats/r0"]


def test_noise_scale_and_reproducible_release(spark, tmp_path):
    catalog = list(range(1, 1501))  # most items have no rows: their statistics are pure noise
    paths = write_inputs(
        tmp_path, INTERACTIONS[:2] + [(3, 5, 1.0)], {1: [3.0, 4.0], 3: [1.0, 0.0]}, {j: 3.0 for j in catalog}, catalog
    )
    seed = SeedFile.create(
        str(tmp_path / "seed"), bytes(range(32))
    ).path  # a fixed test seed: the statistics below are reproducible
    settings = StatsSettings(2, 0.5, 2.0, "user", 1.5)
    privacy = PrivacySettings(noise_multiplier=1.2, resamples=2)
    stats.run(make_job(paths, tmp_path / "out", privacy, settings, seed_file=seed), spark)
    items, a, b, _ = read_stats(str(tmp_path / "out" / "resample-0.parquet"))
    assert len(items) == 1500
    empty = ~np.isin(items, [10, 20, 5])
    sigma = 1.2 * 1.5
    diagonal = [0, 2]  # packed (0,0), (0,1), (1,1)
    assert a[empty][:, diagonal].std() == pytest.approx(sigma * 0.5**2, rel=0.05)
    assert a[empty][:, 1].std() == pytest.approx(sigma * 0.5**2, rel=0.07)
    assert b[empty].std() == pytest.approx(sigma * 2.0 * 0.5, rel=0.05)
    assert abs(a[empty].mean()) < 0.05 * sigma * 0.25
    other = read_stats(str(tmp_path / "out" / "resample-1.parquet"))
    assert not np.allclose(other[1], a)  # the second resample has its own noise
    before = {
        name: open(os.path.join(tmp_path / "out" / "resample-0.parquet", name), "rb").read()
        for name in os.listdir(tmp_path / "out" / "resample-0.parquet")
    }
    stats.run(make_job(paths, tmp_path / "out", privacy, settings, seed_file=seed), spark)  # a rerun: same releases
    after = {
        name: open(os.path.join(tmp_path / "out" / "resample-0.parquet", name), "rb").read()
        for name in os.listdir(tmp_path / "out" / "resample-0.parquet")
    }
    assert before == after
    assert len(Ledger.open(str(tmp_path / "out" / "ledger.parquet")).rows) == 3  # the counts and the two resamples


def test_seed_drawn_when_absent_and_bound_to_its_data(spark, tmp_path):
    paths = write_inputs(tmp_path / "in", INTERACTIONS, EMBEDDINGS, COUNTS, CATALOG)
    privacy = PrivacySettings(noise_multiplier=1.0)
    stats.run(make_job(paths, tmp_path / "run", privacy), spark)
    seed_path = str(tmp_path / "run" / "private" / "seed")
    seed = SeedFile.load(seed_path)
    assert len(seed.seed) == 32 and list(seed.releases) == [0, 1]  # the counts, the stats
    stats.run(make_job(paths, tmp_path / "run2", privacy), spark)
    assert SeedFile.load(str(tmp_path / "run2" / "private" / "seed")).seed != seed.seed
    # the same seed file on neighbouring data (one user less) is refused before anything is written: it serves another
    # run's ledger
    other = write_inputs(tmp_path / "other", INTERACTIONS[:-1], {1: EMBEDDINGS[1], 2: EMBEDDINGS[2]}, COUNTS, CATALOG)
    with pytest.raises(SeedReuseError, match="bound to another privacy ledger"):
        stats.run(make_job(other, tmp_path / "run3", privacy, seed_file=seed_path), spark)
    assert not (tmp_path / "run3" / "resample-0.parquet").exists()


def test_budget_is_enforced_across_steps(spark, tmp_path):
    paths = write_inputs(tmp_path, INTERACTIONS, EMBEDDINGS, COUNTS, CATALOG)
    privacy = PrivacySettings(
        epsilon=2.0, delta=1e-5, outer_steps=1, count_share=0.5, mean_share=0.0, gram_share=0.0
    )  # counts and stats only
    ledger = str(tmp_path / "ledger.parquet")
    dp_counts(
        paths["interactions"],
        paths["items"],
        str(tmp_path / "counts"),
        privacy,
        ledger_path=ledger,
        engine=LocalEngine(),
    )
    paths = {
        **paths,
        "counts": str(tmp_path / "counts" / "counts.parquet"),
    }  # the released counts: the job refuses any other
    summary = stats.run(make_job(paths, tmp_path / "s1", privacy, ledger_path=ledger), spark)
    assert summary["epsilon_spent"] == pytest.approx(2.0, rel=1e-6)  # the plan spends exactly the budget
    with pytest.raises(BudgetExceededError, match="over its budget of 2"):
        stats.run(make_job(paths, tmp_path / "s2", privacy, ledger_path=ledger, step=2), spark)
    assert not (tmp_path / "s2").exists() or not os.listdir(tmp_path / "s2")
    assert [row["name"] for row in Ledger.open(ledger).rows] == ["counts", "step-1/stats/r0"]


def _write_by_item_shard(interactions, path, shards, declared, mixed=False):
    """`interactions` as a table whose two files declare `declared` item shards and hold their rows
    a row group per item shard of `shards` (the layout prepare writes: mean.write_by_item_shard);
    `mixed`: one row group of the first file also holds a row of another shard."""
    users, items, labels = (np.array(column) for column in zip(*interactions, strict=True))
    table = pa.table(
        {
            "user_id": users,
            "item_id": items,
            "label": labels.astype(float),
            "timestamp": np.zeros(users.size, np.int64),
        },
        schema=schemas.INTERACTIONS,
    )
    staged, names = storage.StagedWrite(path), []
    for part, rows in enumerate((table.slice(0, table.num_rows // 2), table.slice(table.num_rows // 2))):
        with staged.open_part(part, schemas.INTERACTIONS.with_metadata({ITEM_SHARDS: b"%d" % declared})) as writer:
            if mixed and part == 0:
                writer.write_table(rows.slice(0, 2))  # two rows whatever their shards
                rows = rows.slice(2)
            write_by_item_shard(writer, rows, shards)
        names.append(staged.part_name(part))
    staged.commit(names, table.num_rows)


@pytest.mark.parametrize(
    "shards, declared, mixed, straight",
    [(4, 4, False, True), (4, 4, True, False), (2, 2, False, False), (4, 3, False, False)],
)
def test_declared_item_shards_skip_the_shuffle_and_give_the_same_bits(
    spark, tmp_path, monkeypatch, shards, declared, mixed, straight
):
    # rows whose row groups each hold one item shard (as prepare writes the stats job's rows) go
    # straight to the reduce tasks: the same statistics, bit for bit, as the shuffle gives of the
    # same table, and as the same rows in user order give up to the users' normalisers' order of
    # addition. A declaration the rows break (a mixed row group), or one of fewer shards than the
    # job needs (2 < 4), or not the shard function's (3 declared, 4 written), is checked before the
    # release and read through the shuffle instead
    rng = np.random.default_rng(5)
    catalog = list(range(100, 160))
    pairs = sorted({(int(u), int(j)) for u, j in zip(rng.integers(0, 40, 400), rng.choice(catalog, 400), strict=True)})
    interactions = [(u, j, float(rng.normal() * 2)) for u, j in pairs]
    embeddings = {u: list(rng.normal(size=2)) for u in range(40)}
    counts = {j: float(rng.integers(1, 30)) for j in catalog}
    released, shuffled = {}, []
    keys_of, layout_of = stats.partition_keys, stats_job.ItemShardLayout.of
    monkeypatch.setattr(stats, "partition_keys", lambda n: shuffled.append(n) or keys_of(n))  # the shuffle's plan
    for run in ("by user", "by item shard", "by item shard, shuffled"):
        paths = write_inputs(tmp_path / run, interactions, embeddings, counts, catalog)
        if run != "by user":
            _write_by_item_shard(interactions, paths["interactions"], shards, declared, mixed)
        monkeypatch.setattr(  # the last run's job ignores the declaration
            stats_job.ItemShardLayout, "of", (lambda *args: None) if run.endswith("shuffled") else layout_of
        )
        seed = SeedFile.create(str(tmp_path / run / "seed"), bytes(range(32))).path  # the same noise for all
        job = make_job(paths, tmp_path / run / "out", PrivacySettings(noise_multiplier=1.0), seed_file=seed)
        stats.run(job, spark)
        released[run] = read_stats(str(tmp_path / run / "out" / "resample-0.parquet"))
        assert job.rows == len(interactions)
        if run == "by item shard":
            assert (job.unit_shards is None) == (mixed or declared != shards)  # the check before the release
            if straight:
                assert job.unit_shards[0] == 4 and set(job.unit_shards[1]) == {0, 1, 2, 3}
    assert len(shuffled) == (
        2 if straight else 3
    )  # "by user" and the forced shuffle always, by item shard if not straight
    (items, a, b, _), (items_direct, a_direct, b_direct, _), (items_shuffled, a_shuffled, b_shuffled, _) = (
        released.values()
    )
    assert items == items_direct == items_shuffled == catalog
    np.testing.assert_array_equal(a_direct, a_shuffled)
    np.testing.assert_array_equal(b_direct, b_shuffled)
    np.testing.assert_allclose(a_direct, a, rtol=1e-12, atol=1e-12)
    np.testing.assert_allclose(b_direct, b, rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize(
    "change, message",
    [
        ({"settings": StatsSettings(3, 1.0, 5.0)}, r"column 'embedding', row 0: has length 2, expected 3"),
        (
            {"embeddings": {1: [3.0, 4.0], 2: [0.5, -0.5]}},
            r"missing user embeddings for 1 user\(s\) of the interactions \(e.g. 3\)",
        ),
        ({"counts": {10: 16.0, 20: 1.0, 30: 81.0}}, r"no DP count for 1 catalog item\(s\) \(e.g. 40\)"),
        ({"interactions": INTERACTIONS + [(1, 10, 2.0)]}, r"1 duplicate \(user, item\) pair\(s\), e.g. user 1 item 10"),
        ({"interactions": INTERACTIONS + [(3, 99, 2.0)]}, r"items missing from the catalog \(e.g. 99\)"),
    ],
)
def test_bad_inputs_are_refused_before_any_release(spark, tmp_path, change, message):
    paths = write_inputs(
        tmp_path,
        change.get("interactions", INTERACTIONS),
        change.get("embeddings", EMBEDDINGS),
        change.get("counts", COUNTS),
        CATALOG,
    )
    job = make_job(
        paths,
        tmp_path / "out",
        PrivacySettings(noise_multiplier=1.0),
        change.get("settings", StatsSettings(2, 1.0, 5.0)),
        ledger_path=str(tmp_path / "ledger.parquet"),
    )
    with pytest.raises(ValueError, match=message):
        stats.run(job, spark)
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize(
    "build, message",
    [
        (lambda: PrivacySettings(epsilon=0.0), "epsilon must be > 0"),
        (lambda: PrivacySettings(epsilon=-1.0), "epsilon must be > 0"),
        (lambda: PrivacySettings(epsilon=1.0, delta=1.0), r"delta must be in \(0, 1\)"),
        (lambda: PrivacySettings(epsilon=1.0, delta=0.0), r"delta must be in \(0, 1\)"),
        (lambda: PrivacySettings(), "give either --epsilon"),
        (lambda: PrivacySettings(noise_multiplier=-1.0), "noise multiplier must be"),
        (lambda: StatsSettings(2, 0.0, 1.0), "--clip-u must be a finite number > 0"),
        (lambda: StatsSettings(2, 1.0, -1.0), "--clip-y must be a finite number > 0"),
        (lambda: StatsSettings(0, 1.0, 1.0), "--dim must be a positive integer"),
    ],
)
def test_impossible_parameters(build, message):
    with pytest.raises(ValueError, match=message):
        build()


def test_entry_point_errors_are_one_line(tmp_path, capsys):
    args = [
        "--interactions",
        "x",
        "--user-embeddings",
        "y",
        "--items",
        "z",
        "--counts",
        "c",
        "--out",
        str(tmp_path / "bad"),
        "--dim",
        "2",
        "--clip-u",
        "1",
        "--clip-y",
        "1",
    ]
    assert stats_script.main(args + ["--epsilon", "-1"]) == 2
    assert capsys.readouterr().err.strip() == "stats: error: epsilon must be > 0, got -1.0"
    assert stats_script.main(args + ["--epsilon", "1", "--delta", "2"]) == 2
    assert capsys.readouterr().err.strip() == "stats: error: delta must be in (0, 1), got 2.0"
    assert stats_script.main(args + ["--noise-multiplier", "0"]) == 2
    assert capsys.readouterr().err.strip() == "stats: error: table not found: z"
    assert not (tmp_path / "bad").exists()


@pytest.mark.parametrize(
    "embeddings, message",
    [
        (
            pa.table({"user_id": [1, 2, 3, 2], "embedding": [[3.0, 4.0], [0.5, -0.5], [0.0, 2.0], [1.0, 1.0]]}),
            r"column 'user_id', row 3: value 2 appears more than once",
        ),
        (
            pa.table(
                {"user_id": pa.array([1, 2, None], pa.int64()), "embedding": [[3.0, 4.0], [0.5, -0.5], [0.0, 2.0]]}
            ),
            r"column 'user_id', row 2: is null",
        ),
        (
            pa.table({"user_id": [1, 2, 3], "embedding": [[3.0, 4.0], [0.5, float("nan")], [0.0, 2.0]]}),
            r"column 'embedding', row 1: holds a non-finite value \(nan\)",
        ),
    ],
)
def test_bad_user_embeddings_are_refused_before_any_release_while_the_rows_are_checked(tmp_path, embeddings, message):
    # the embeddings are validated beside the pass over the rows (their ids read alone when they are
    # plain int64 without nulls): the same refusals, before the ledger is opened
    paths = write_inputs(tmp_path, INTERACTIONS, EMBEDDINGS, COUNTS, CATALOG)
    storage.remove(paths["user_embeddings"])
    storage.write_table(embeddings, paths["user_embeddings"])
    ledger = tmp_path / "ledger.parquet"
    job = make_job(paths, tmp_path / "out", PrivacySettings(noise_multiplier=1.0), ledger_path=str(ledger))
    with pytest.raises(ValueError, match=message):
        job.prepare()
    assert len(Ledger.open(str(ledger)).rows) == 1 and not (tmp_path / "out").exists()  # the counts' release alone


@pytest.mark.parametrize("change", ["none", "a repeated pair", "rows out of order"])
def test_rows_in_order_are_checked_for_repeats_without_keeping_their_keys(tmp_path, monkeypatch, change):
    # a run's stats rows (files of increasing user ranges, each item shard's rows by user and item)
    # pass the duplicate check by their order alone; rows that break it (a repeat, or a user's items
    # backwards) are read again and every key compared: a repeat is refused before any release
    catalog = list(range(100, 112))
    interactions = [(u, 100 + (3 * u + 5 * k) % 12, float(k)) for u in range(10) for k in range(4)]  # 4 items each
    if change == "a repeated pair":
        interactions.append((2, 106, 9.0))  # user 2's item 106, twice
    interactions.sort(key=lambda row: (row[0], -row[1] if change == "rows out of order" else row[1]))
    paths = write_inputs(
        tmp_path, interactions, {u: [1.0, 0.5] for u in range(10)}, dict.fromkeys(catalog, 4.0), catalog
    )
    rows = pa.table(
        dict(zip(("user_id", "item_id", "label"), map(list, zip(*interactions, strict=True)), strict=True))
        | {"timestamp": [0] * len(interactions)},
        schema=schemas.INTERACTIONS,
    )
    staged = storage.StagedWrite(paths["interactions"])
    half = [user for user, _, _ in interactions].index(5)
    for part, table in enumerate((rows.slice(0, half), rows.slice(half))):  # users 0-4, then 5-9
        with staged.open_part(part, schemas.INTERACTIONS.with_metadata({ITEM_SHARDS: b"3"})) as writer:
            write_by_item_shard(writer, table, 3)
    staged.commit([staged.part_name(0), staged.part_name(1)], rows.num_rows)
    assert files_in_user_order(paths["interactions"])
    spilled, pair_keys = [], stats_job.PairKeys
    monkeypatch.setattr(stats_job, "PairKeys", lambda *args: spilled.append(args) or pair_keys(*args))
    ledger = tmp_path / "ledger.parquet"
    job = make_job(paths, tmp_path / "out", PrivacySettings(noise_multiplier=1.0), ledger_path=str(ledger))
    if change == "a repeated pair":
        with pytest.raises(ValueError, match=r"1 duplicate \(user, item\) pair\(s\), e.g. user 2 item 106"):
            job.prepare()
        assert len(Ledger.open(str(ledger)).rows) == 1  # the counts' release alone
    else:
        job.prepare()
        assert job.rows == len(interactions) and job.unit_shards[0] == 3
    assert spilled == ([] if change == "none" else [(len(interactions), 10, 12)])


def test_the_user_embeddings_one_read_gives_their_ids_and_the_digest_of_the_table_as_stored(tmp_path):
    paths = write_inputs(tmp_path, INTERACTIONS, EMBEDDINGS, COUNTS, CATALOG)
    seeds = SeedFile.create(str(tmp_path / "seed"), bytes(range(32)))
    ids, digest = stats_job._validated_and_digested(paths["user_embeddings"], seeds, 2)
    assert ids.tolist() == list(EMBEDDINGS) and digest == seeds.digest_table(paths["user_embeddings"])
