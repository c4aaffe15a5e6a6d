"""DP item counts: contribution cap per user, every catalog item, noise scale, floor, ledger."""

import numpy as np
import pyarrow as pa
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from pipelines.engines.local import LocalEngine
from pipelines.releases.counts import dp_counts, exact_aggregates, sampled_rows, sampling_hash
from pipelines.releases.release import PrivacySettings
from privacy.ledger import Ledger
from schemas import storage
from schemas.tables import INTERACTIONS, items_schema


def write(tmp_path, rows, catalog):
    users, items = zip(*rows, strict=True)
    storage.write_table(
        pa.table(
            {"user_id": users, "item_id": items, "label": [1.0] * len(rows), "timestamp": [0] * len(rows)},
            schema=INTERACTIONS,
        ),
        str(tmp_path / "i.parquet"),
    )
    storage.write_table(
        pa.table(
            {"item_id": catalog, "title": [""] * len(catalog), "genres": [[]] * len(catalog)},
            schema=items_schema({"genres": "multivalent"}),
        ),
        str(tmp_path / "items.parquet"),
    )
    return str(tmp_path / "i.parquet"), str(tmp_path / "items.parquet")


def counts_of(path):
    table = storage.read_table(path)
    return dict(zip(table["item_id"].to_pylist(), table["count"].to_pylist(), strict=True))


def test_exact_counts_with_cap_and_floor(tmp_path):
    rows = [(1, 10), (1, 20), (1, 30), (2, 10), (3, 10), (3, 30)]
    interactions, items = write(tmp_path, rows, [10, 20, 30, 40])
    summary = dp_counts(
        interactions,
        items,
        str(tmp_path / "uncapped"),
        PrivacySettings(noise_multiplier=0.0),
        max_items_per_user=3,
        engine=LocalEngine(),
    )
    assert counts_of(str(tmp_path / "uncapped" / "counts.parquet")) == {
        10: 3.0,
        20: 1.0,
        30: 2.0,
        40: 1.0,
    }  # item 40: 0, floored at 1
    assert summary["epsilon_spent"] == float("inf")
    dp_counts(
        interactions,
        items,
        str(tmp_path / "capped"),
        PrivacySettings(noise_multiplier=0.0),
        max_items_per_user=1,
        engine=LocalEngine(),
    )
    capped = counts_of(str(tmp_path / "capped" / "counts.parquet"))
    # each user adds 1 to one item only: 3 contributions in all, so at most 3 - 1 items reach 2
    assert all(capped[j] <= uncapped for j, uncapped in {10: 3.0, 20: 1.0, 30: 2.0, 40: 1.0}.items())
    assert sum(value for value in capped.values() if value > 1.0) <= 3.0 and capped != {
        10: 3.0,
        20: 1.0,
        30: 2.0,
        40: 1.0,
    }
    dp_counts(
        interactions,
        items,
        str(tmp_path / "example"),
        PrivacySettings(noise_multiplier=0.0),
        unit="example",
        max_items_per_user=1,
        engine=LocalEngine(),
    )
    assert counts_of(str(tmp_path / "example" / "counts.parquet")) == {10: 3.0, 20: 1.0, 30: 2.0, 40: 1.0}


def test_sampling_keeps_at_most_k_rows_per_user_uniformly():
    users = np.repeat(np.arange(2000), 10)
    items = np.tile(np.arange(10), 2000)
    kept = sampled_rows(users, items, 3, key=12345)
    assert np.all(np.bincount(users[kept]) == 3)
    share = np.bincount(items[kept], minlength=10) / kept.size
    assert np.allclose(share, 0.1, atol=0.01)  # every item equally likely to be kept
    assert not np.array_equal(kept, sampled_rows(users, items, 3, key=54321))
    reversed_kept = sampled_rows(users[::-1].copy(), items[::-1].copy(), 3, key=12345)
    assert set(zip(users[kept], items[kept], strict=True)) == set(
        zip(users[::-1][reversed_kept], items[::-1][reversed_kept], strict=True)
    )  # row order is irrelevant


@settings(max_examples=60, deadline=None)
@given(seed=st.integers(0, 2**31), k=st.integers(1, 6), sorted_users=st.booleans())
def test_exact_aggregates_are_the_distinct_pairs_of_each_users_sample(seed, k, sorted_users):
    # by hand: each distinct (user, item) once; a user with more than K items keeps the K whose
    # keyed hash ranks lowest; the units are the users; rows in any order (sorted by user or not)
    rng = np.random.default_rng(seed)
    catalog = np.unique(rng.integers(-20, 10**9, 12))
    users = rng.integers(-3, 9, 150) * 10**11
    users = np.sort(users) if sorted_users else users
    rated = catalog[rng.integers(0, catalog.size, users.size)]
    got, units = exact_aggregates(users, rated, catalog, "user", k, key=777)
    want = np.zeros(catalog.size)
    for user in np.unique(users):
        items = np.unique(rated[users == user])
        ranked = items[np.argsort(sampling_hash(np.full(items.size, user), items, 777), kind="stable")][:k]
        want[np.searchsorted(catalog, ranked)] += 1
    assert np.array_equal(got, want) and units == np.unique(users).size
    assert np.array_equal(
        exact_aggregates(users, rated, catalog, "example", k, key=777)[0],
        np.bincount(np.searchsorted(catalog, rated), minlength=catalog.size),
    )


def test_noise_scale_and_ledger(tmp_path):
    catalog = list(range(1, 3001))
    interactions, items = write(tmp_path, [(1, 5)], catalog)
    summary = dp_counts(
        interactions,
        items,
        str(tmp_path / "out"),
        PrivacySettings(noise_multiplier=2.0),
        max_items_per_user=4,
        engine=LocalEngine(),
    )
    values = np.array(list(counts_of(str(tmp_path / "out" / "counts.parquet")).values()))
    assert values.size == 3000 and values.min() >= 1.0
    # noise std = multiplier * sqrt(K + 1) = 2 sqrt(5) (the counts are released with the number of
    # users); counts are 0 + noise, floored at 1: compare the share floored
    from scipy.stats import norm

    std = 2.0 * np.sqrt(5.0)
    assert np.mean(values == 1.0) == pytest.approx(norm.cdf(1.0 / std), abs=0.03)
    above = values[values > 1.0]
    share = (1 - norm.cdf(1.0)) / (1 - norm.cdf(1.0 / std))
    assert np.mean(above > std) == pytest.approx(
        share, abs=5 * np.sqrt(share * (1 - share) / above.size)
    )  # 5 binomial sds: ~0.07
    assert summary["noise_std"] == std
    ledger = Ledger.open(str(tmp_path / "out" / "ledger.parquet"))
    assert [(row["name"], row["noise_multiplier"]) for row in ledger.rows] == [("counts", 2.0)]


def test_unknown_items_and_bad_cap(tmp_path):
    interactions, items = write(tmp_path, [(1, 5), (1, 99)], [5])
    with pytest.raises(ValueError, match=r"1 interaction\(s\) refer to items missing from the catalog \(e.g. 99\)"):
        dp_counts(
            interactions, items, str(tmp_path / "out"), PrivacySettings(noise_multiplier=1.0), engine=LocalEngine()
        )
    with pytest.raises(ValueError, match="--max-items-per-user must be a positive integer"):
        dp_counts(
            interactions,
            items,
            str(tmp_path / "out"),
            PrivacySettings(noise_multiplier=1.0),
            max_items_per_user=0,
            engine=LocalEngine(),
        )
    assert not (tmp_path / "out").exists()


def test_a_repeated_rating_counts_once_per_user(tmp_path):
    interactions, items = write(tmp_path, [(1, 10), (1, 10), (1, 10), (2, 10)], [10, 20])
    dp_counts(
        interactions,
        items,
        str(tmp_path / "out"),
        PrivacySettings(noise_multiplier=0.0),
        max_items_per_user=5,
        engine=LocalEngine(),
    )
    assert counts_of(str(tmp_path / "out" / "counts.parquet")) == {10: 2.0, 20: 1.0}  # two users, whatever the repeats


def test_the_number_of_users_is_released_with_dp(tmp_path):
    """The counts release also releases the number of units (users; rows at example level): each
    adds 1 to it, so the vector (item counts, units) has sensitivity sqrt(K + 1), and that count gets
    the same noise std. It lands in the table's metadata (rounded, at least 1), never the exact one."""
    from scipy.stats import kstest

    from pipelines.releases.counts import dp_units
    from privacy.seeds import SeedFile

    rng = np.random.default_rng(0)
    rows = sorted({(int(u), int(rng.integers(1, 40))) for u in range(1, 2001) for _ in range(int(rng.integers(1, 6)))})
    interactions, items = write(tmp_path, rows, list(range(1, 40)))
    exact = 2000
    released = []
    for k in range(40):  # independent seeds: the released value is N(exact, (z sqrt(K + 1))^2), rounded
        summary = dp_counts(
            interactions,
            items,
            str(tmp_path / f"out{k}"),
            PrivacySettings(noise_multiplier=3.0),
            max_items_per_user=3,
            seed_file=SeedFile.create(str(tmp_path / f"seed{k}")).path,
            engine=LocalEngine(),
        )
        path = str(tmp_path / f"out{k}" / "counts.parquet")
        assert summary["dp_units"] == dp_units(path) == int(storage.read_schema(path).metadata[b"dp_units"])
        assert summary["noise_std"] == 3.0 * 2.0  # sqrt(K + 1) = 2
        released.append(summary["dp_units"])
    released = np.array(released)
    assert np.all(np.abs(released - exact) <= 5 * 6.0)  # within 5 std of the truth
    assert kstest((released - exact) / 6.0, "norm").pvalue > 1e-3
    assert len(set(released.tolist())) > 10  # noised, not the exact count
    # a pure function of (seed, release, inputs): the same seed gives the same value, and the units' noise is not any
    # item's
    again = dp_counts(
        interactions,
        items,
        str(tmp_path / "again"),
        PrivacySettings(noise_multiplier=3.0),
        max_items_per_user=3,
        seed_file=SeedFile.create(str(tmp_path / "seed0-again"), SeedFile.load(str(tmp_path / "seed0")).seed).path,
        engine=LocalEngine(),
    )
    assert again["dp_units"] == released[0]
    # without noise the exact numbers: distinct users at user level, rows at example level
    assert (
        dp_counts(
            interactions,
            items,
            str(tmp_path / "exact"),
            PrivacySettings(noise_multiplier=0.0),
            max_items_per_user=3,
            engine=LocalEngine(),
        )["dp_units"]
        == exact
    )
    assert dp_counts(
        interactions,
        items,
        str(tmp_path / "rows"),
        PrivacySettings(noise_multiplier=0.0),
        unit="example",
        engine=LocalEngine(),
    )["dp_units"] == len(rows)
    # at least 1
    (tmp_path / "tiny").mkdir()
    tiny, tiny_items = write(tmp_path / "tiny", [(1, 5)], [5])
    low = [
        dp_counts(
            tiny,
            tiny_items,
            str(tmp_path / f"tiny{k}"),
            PrivacySettings(noise_multiplier=50.0),
            max_items_per_user=1,
            engine=LocalEngine(),
        )["dp_units"]
        for k in range(5)
    ]
    assert min(low) >= 1


@pytest.mark.parametrize("unit", ["user", "example"])
def test_the_counts_aggregated_on_an_engine_are_the_same_release(engine, tmp_path, unit):
    """On Spark or Beam the rows stay on the workers and the driver gets per-item counts; with the
    same seed the release is the same, byte for byte: the keyed sample of K items per user (ties in
    the hash broken by item id), repeated pairs once, negative and extreme ids included."""
    from privacy.seeds import SeedFile

    rng = np.random.default_rng(5)
    rows = [
        (int(u), int(rng.choice([-(2**62), -3, 7, 2**62, *range(100, 160)])))
        for u in [*range(1, 300), -5, 2**62]
        for _ in range(int(rng.integers(1, 40)))
    ]
    interactions, items = write(tmp_path, rows, [-(2**62), -3, 7, 2**62, *range(100, 170)])
    seed = SeedFile.create(str(tmp_path / "seed")).seed
    tables = {}
    for name, where in (
        ("local", LocalEngine()),
        ("engine", engine),
    ):  # one seed, a seed file per run (a seed serves one ledger)
        out = tmp_path / name
        dp_counts(
            interactions,
            items,
            str(out),
            PrivacySettings(epsilon=1.0),
            unit=unit,
            max_items_per_user=10,
            ledger_path=str(out / "ledger.parquet"),
            seed_file=SeedFile.create(str(tmp_path / f"seed-{name}"), seed).path,
            engine=where,
        )
        tables[name] = storage.read_table(str(out / "counts.parquet"))
    assert (
        tables["engine"].equals(tables["local"]) and tables["engine"].schema.metadata == tables["local"].schema.metadata
    )
    unsampled = np.unique(np.array(rows), axis=0)[:, 1] if unit == "user" else np.array(rows)[:, 1]
    assert len(unsampled) > 10 * 300 // 2  # the cap of 10 bites for many users


def test_an_engine_refuses_what_the_local_reader_refuses(engine, tmp_path):
    interactions, items = write(tmp_path, [(1, 5), (1, 99)], [5])
    with pytest.raises(ValueError, match=r"items missing from the catalog \(e.g. 99\)"):
        dp_counts(interactions, items, str(tmp_path / "out"), PrivacySettings(noise_multiplier=1.0), engine=engine)
    storage.write_table(
        pa.table(
            {"user_id": [1, 2], "item_id": [5, 5], "label": [4.0, float("nan")], "timestamp": [0, 0]},
            schema=INTERACTIONS,
        ),
        interactions,
    )
    with pytest.raises(
        ValueError, match=r"(the label of user 2, item 5 is not finite \(nan\)|label.*(NaN|nan|finite))"
    ):
        dp_counts(interactions, items, str(tmp_path / "out"), PrivacySettings(noise_multiplier=1.0), engine=engine)
    assert not (tmp_path / "out").exists()
