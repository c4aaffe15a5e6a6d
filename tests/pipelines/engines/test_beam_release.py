"""The stats job on Beam (DirectRunner): exact values, every item once, and the same release as Spark."""

import os

import apache_beam as beam
import numpy as np
import pyarrow as pa
import pytest
from apache_beam.options.pipeline_options import PipelineOptions
from apache_beam.testing.util import assert_that

from pipelines import beam_stats as beam_script  # the entry script
from pipelines.engines import beam_release
from pipelines.engines import spark_stats as stats
from pipelines.releases import stats_job
from pipelines.releases.release import PrivacySettings
from pipelines.releases.stats_core import StatsSettings
from privacy.accumulator import NoiseSpec, pack_upper, packed_size, unpack_upper
from privacy.seeds import SeedFile
from schemas import storage
from schemas.tables import COUNTS, INTERACTIONS, USER_EMBEDDINGS, items_schema, stats_metadata, validate_stats
from tests.pipelines.stats_inputs import expected_stats, register_counts, registered, write_inputs

pytestmark = pytest.mark.beam  # the stats job on Beam

DIRECT = ["--runner=DirectRunner"]

# 3 users, catalog of 4 items (item 40 has no rows), d = 2; user 1's and user 3's embeddings and
# two labels exceed the clip norms (clip_u 1, clip_y 2).
INTERACTIONS_ROWS = [(1, 10, 4.0), (1, 20, -3.0), (2, 10, 1.5), (2, 30, 2.5), (3, 10, 0.5), (3, 20, 1.0), (3, 30, -1.0)]
EMBEDDINGS = {1: [1.2, 1.6], 2: [0.3, -0.4], 3: [-1.0, 0.5]}
COUNTS_BY_ITEM = {10: 3.0, 20: 2.0, 30: 1.0, 40: 5.0}
CATALOG = [10, 20, 30, 40]


def make_job(paths, out, privacy, settings, **kwargs):
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
    table = validate_stats(storage.read_table(path))
    return table.schema.metadata, table.sort_by("item_id")


def by_formula(unit, wbar, clip_u=1.0, clip_y=2.0, exponent=-0.25):
    """Packed A_j and b_j of the example, row by row from the paper's formulas."""
    a = {j: np.zeros(3) for j in CATALOG}
    b = {j: np.zeros(2) for j in CATALOG}
    for user, emb in EMBEDDINGS.items():
        rows = [(j, y) for u, j, y in INTERACTIONS_ROWS if u == user]
        norm = sum(COUNTS_BY_ITEM[j] ** (2 * exponent) for j, _ in rows)
        u = np.array(emb) * min(1.0, clip_u / np.hypot(*emb))
        for j, y in rows:
            w = wbar * COUNTS_BY_ITEM[j] ** exponent / np.sqrt(norm) if unit == "user" else 1.0
            y = min(max(y, -clip_y), clip_y)
            a[j] += w * np.array([u[0] * u[0], u[0] * u[1], u[1] * u[1]])  # upper triangle, row by row
            b[j] += w * y * u
    return a, b


@pytest.mark.parametrize("unit, wbar", [("user", 1.5), ("example", 1.0)])
def test_exact_statistics_for_every_catalog_item(tmp_path, unit, wbar):
    paths = write_inputs(tmp_path / "in", INTERACTIONS_ROWS, EMBEDDINGS, COUNTS_BY_ITEM, [40, 30, 20, 10])
    settings = StatsSettings(2, 1.0, 2.0, unit, wbar)
    job = make_job(paths, tmp_path / "out", PrivacySettings(noise_multiplier=0.0), settings, shards=3)
    summary = beam_release.run(job, PipelineOptions(DIRECT))

    metadata, table = read_stats(str(tmp_path / "out" / "resample-0.parquet"))
    assert table["item_id"].to_pylist() == CATALOG  # every catalog item exactly once
    want_a, want_b = by_formula(unit, wbar)
    got_a, got_b = np.array(table["a_upper"].to_pylist()), np.array(table["b"].to_pylist())
    for row, j in enumerate(CATALOG):
        np.testing.assert_allclose(got_a[row], want_a[j], rtol=1e-12, atol=1e-15)
        np.testing.assert_allclose(got_b[row], want_b[j], rtol=1e-12, atol=1e-15)
    assert np.all(got_a[3] == 0) and np.all(got_b[3] == 0)  # item 40: no rows, zero statistics
    if (
        unit == "user"
    ):  # item 30 by hand: user 2 (items 10, 30; label 2.5 clipped to 2) and user 3 (items 10, 20, 30; u clipped)
        w2, w3 = 1.5 / np.sqrt(3**-0.5 + 1.0), 1.5 / np.sqrt(3**-0.5 + 2**-0.5 + 1.0)
        u2, u3 = np.array([0.3, -0.4]), np.array([-1.0, 0.5]) / np.sqrt(1.25)
        np.testing.assert_allclose(got_b[2], w2 * 2.0 * u2 + w3 * -1.0 * u3, rtol=1e-12)
        np.testing.assert_allclose(got_a[2], pack_upper(w2 * np.outer(u2, u2) + w3 * np.outer(u3, u3)), rtol=1e-12)
        full = expected_stats(INTERACTIONS_ROWS, EMBEDDINGS, COUNTS_BY_ITEM, CATALOG, 1.0, 2.0, wbar)[
            0
        ]  # the shared helper agrees
        np.testing.assert_allclose(got_a, np.array([pack_upper(full[j]) for j in CATALOG]), rtol=1e-12, atol=1e-15)
    meta = stats_metadata(table.schema)
    assert (meta["d"], meta["noise_multiplier"], meta["wbar"], meta["release"], meta["resample"]) == (
        2,
        0.0,
        wbar,
        1,
        0,
    )  # release 0: the counts
    assert metadata[b"unit"] == unit.encode()
    assert summary["items"] == 4 and summary["releases"] == [1]
    assert sorted(os.listdir(tmp_path / "out")) == [
        "ledger.parquet",
        "ledger.parquet.lock",
        "private",
        "release.json",
        "resample-0.parquet",
    ]  # no staging left (the lock file of the ledger stays)
    assert len(storage.table_files(str(tmp_path / "out" / "resample-0.parquet"))) == 3  # shards 0, 1, 2 by item_id % 3


def test_item_stats_composes_in_a_pipeline():
    # The transform on its own, fed from Create: one output per catalog item, zeros for item 40.
    settings = StatsSettings(2, 1.0, 2.0, "user", 1.5)
    spec = NoiseSpec(0.0, 1.5, 1.0, 2.0, bytes(32), 0)
    users, items, labels = (list(column) for column in zip(*INTERACTIONS_ROWS, strict=True))
    want_a, want_b = by_formula("user", 1.5)

    def check(rows):
        assert sorted(row[0] for row in rows) == CATALOG
        for item, ((a, b),) in rows:
            np.testing.assert_allclose(a, want_a[item], rtol=1e-12, atol=1e-15)
            np.testing.assert_allclose(b, want_b[item], rtol=1e-12, atol=1e-15)

    with beam.Pipeline(options=PipelineOptions(DIRECT)) as p:
        inputs = (
            p
            | "I"
            >> beam.Create(
                [
                    pa.table({"user_id": users[:4], "item_id": items[:4], "label": labels[:4]}),
                    pa.table({"user_id": users[4:], "item_id": items[4:], "label": labels[4:]}),
                ]
            ),
            p | "E" >> beam.Create([pa.table({"user_id": list(EMBEDDINGS), "embedding": list(EMBEDDINGS.values())})]),
            p
            | "C" >> beam.Create([pa.table({"item_id": list(COUNTS_BY_ITEM), "count": list(COUNTS_BY_ITEM.values())})]),
            p | "M" >> beam.Create([pa.table({"item_id": CATALOG[:2]}), pa.table({"item_id": CATALOG[2:]})]),
        )
        assert_that(inputs | beam_release.ItemStats(settings, [spec]), check)


def write_random_inputs(folder, users=60, catalog=25, d=3, seed=0):
    """Random inputs; interactions in shuffled order over 3 part files, so users straddle files."""
    rng = np.random.default_rng(seed)
    rated_items = np.arange(100, 100 + catalog - 5)  # the last 5 catalog items have no rows
    pairs = [(u, j) for u in range(users) for j in rng.choice(rated_items, rng.integers(1, 8), replace=False)]
    order = rng.permutation(len(pairs))
    folder = str(folder)
    paths = {
        name: storage.join(folder, f"{name}.parquet") for name in ("interactions", "user_embeddings", "counts", "items")
    }
    items = np.arange(100, 100 + catalog)
    storage.write_table(
        pa.table(
            {
                "user_id": np.array([pairs[k][0] for k in order], np.int64),
                "item_id": np.array([pairs[k][1] for k in order], np.int64),
                "label": rng.normal(3.0, 2.0, len(pairs)),
                "timestamp": np.zeros(len(pairs), np.int64),
            },
            schema=INTERACTIONS,
        ),
        paths["interactions"],
        rows_per_file=len(pairs) // 3 + 1,
    )
    storage.write_table(
        pa.table(
            {"user_id": np.arange(users), "embedding": list(rng.normal(0, 0.8, (users, d)))}, schema=USER_EMBEDDINGS
        ),
        paths["user_embeddings"],
    )
    storage.write_table(
        pa.table({"item_id": items, "count": 1.0 + rng.exponential(10.0, catalog)}, schema=COUNTS), paths["counts"]
    )
    storage.write_table(
        pa.table(
            {"item_id": items, "title": [f"item {i}" for i in items], "genres": [[] for _ in items]},
            schema=items_schema({"genres": "multivalent"}),
        ),
        paths["items"],
    )
    return paths


def test_beam_and_spark_give_the_same_release(spark, tmp_path):
    paths = write_random_inputs(tmp_path / "in")
    settings = StatsSettings(3, 1.0, 4.0, "user", 2.0)
    results = {}
    for multiplier in (0.0, 0.7):
        seed = SeedFile.create(
            str(tmp_path / f"seed-{multiplier}")
        ).seed  # one seed for both engines, a seed file per run (it serves one ledger)
        seed_file = {
            engine: SeedFile.create(str(tmp_path / f"seed-{engine}-{multiplier}"), seed) for engine in ("beam", "spark")
        }
        privacy = PrivacySettings(noise_multiplier=multiplier, resamples=2)
        out = {engine: tmp_path / f"{engine}-{multiplier}" for engine in ("beam", "spark")}
        beam_summary = beam_release.run(
            make_job(paths, out["beam"], privacy, settings, seed_file=seed_file["beam"].path, shards=3),
            PipelineOptions(DIRECT),
        )
        spark_summary = stats.run(
            make_job(paths, out["spark"], privacy, settings, seed_file=seed_file["spark"].path, shards=2), spark
        )
        assert beam_summary["releases"] == spark_summary["releases"] == [1, 2]  # release 0: the counts
        for resample in range(2):
            (beam_meta, beam), (spark_meta, spark_table) = (
                read_stats(str(out[e] / f"resample-{resample}.parquet")) for e in ("beam", "spark")
            )
            assert beam_meta == spark_meta
            assert beam["item_id"].to_pylist() == spark_table["item_id"].to_pylist() == list(range(100, 125))
            for column in ("a_upper", "b"):
                got, want = np.array(beam[column].to_pylist()), np.array(spark_table[column].to_pylist())
                np.testing.assert_allclose(got, want, rtol=1e-12, atol=1e-12)
            results[multiplier, resample] = np.array(beam["a_upper"].to_pylist()), np.array(beam["b"].to_pylist())
    # the noised releases do carry noise, different per resample, on items with and without rows
    noise = results[0.7, 0][0] - results[0.0, 0][0]
    assert np.all(np.abs(noise) > 1e-6) and np.std(noise) == pytest.approx(0.7 * 2.0, rel=0.5)
    assert not np.allclose(results[0.7, 0][1], results[0.7, 1][1])
    assert results[0.7, 0][0].shape == (25, packed_size(3))
    assert np.all(results[0.0, 0][0][-5:] == 0)  # no rows, no noise: zeros
    full = unpack_upper(results[0.0, 0][0], 3)
    assert np.all(np.linalg.eigvalsh(full) > -1e-12)  # un-noised A_j are PSD


def test_cli_runs_beam_options_through_and_reports_errors_in_one_line(tmp_path, capsys):
    paths = write_inputs(tmp_path / "in", INTERACTIONS_ROWS, EMBEDDINGS, COUNTS_BY_ITEM, CATALOG)
    flags = [
        "--interactions",
        paths["interactions"],
        "--user-embeddings",
        paths["user_embeddings"],
        "--items",
        paths["items"],
        "--counts",
        paths["counts"],
        "--dim",
        "2",
        "--clip-u",
        "1",
        "--clip-y",
        "2",
        "--wbar",
        "1.5",
        "--noise-multiplier",
        "0",
    ]
    register_counts(paths["counts"], str(tmp_path / "out" / "ledger.parquet"), PrivacySettings(noise_multiplier=0.0))
    assert (
        beam_script.main(
            [
                *flags,
                "--out",
                str(tmp_path / "out"),
                "--shards",
                "2",
                "--runner",
                "DirectRunner",
                "--direct_num_workers",
                "1",
            ]
        )
        == 0
    )
    assert "stats step 1: 1 table(s) of 4 items, releases [1]" in capsys.readouterr().out
    _, table = read_stats(str(tmp_path / "out" / "resample-0.parquet"))
    np.testing.assert_allclose(np.array(table["b"].to_pylist())[0], by_formula("user", 1.5)[1][10], rtol=1e-12)

    missing = [*flags[:5], str(tmp_path / "nowhere.parquet"), *flags[6:]]
    assert beam_script.main([*missing, "--out", str(tmp_path / "bad")]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err[-1] == f"stats: error: table not found: {tmp_path / 'nowhere.parquet'}"
    assert not (tmp_path / "bad" / "resample-0.parquet").exists()

    with pytest.raises(SystemExit) as info:  # a mistyped flag is refused before any release is recorded
        beam_script.main([*flags, "--out", str(tmp_path / "typo"), "--shardz", "2"])
    assert info.value.code == 2 and "unrecognized arguments" in capsys.readouterr().err
    assert not (tmp_path / "typo").exists()

    with pytest.raises(SystemExit) as info:
        beam_script.main(["--help"])
    assert info.value.code == 0
    assert "--clip-u" in capsys.readouterr().out


def test_runs_on_gs_paths(gcs_path):
    # Inputs, staged parts, manifests and outputs on a GCS emulator bucket: the same statistics.
    paths = write_inputs(f"{gcs_path}/in", INTERACTIONS_ROWS, EMBEDDINGS, COUNTS_BY_ITEM, CATALOG)
    settings = StatsSettings(2, 1.0, 2.0, "user", 1.5)
    beam_release.run(
        make_job(paths, f"{gcs_path}/out", PrivacySettings(noise_multiplier=0.0), settings, shards=2),
        PipelineOptions(DIRECT),
    )
    _, table = read_stats(f"{gcs_path}/out/resample-0.parquet")
    assert table["item_id"].to_pylist() == CATALOG
    want_a, want_b = by_formula("user", 1.5)
    np.testing.assert_allclose(
        np.array(table["a_upper"].to_pylist()), np.array([want_a[j] for j in CATALOG]), rtol=1e-12, atol=1e-15
    )
    np.testing.assert_allclose(
        np.array(table["b"].to_pylist()), np.array([want_b[j] for j in CATALOG]), rtol=1e-12, atol=1e-15
    )
    fs, inner = storage.filesystem(f"{gcs_path}/out")
    assert not [f for f in fs.ls(inner, detail=False) if beam_release.MANIFESTS in f]  # staging removed
