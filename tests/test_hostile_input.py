"""Hostile and malformed input, through the real entry points (`ssp <command>`, as `ssp.cli.main`).

Every case either ends with exit status 2 and ONE line `ssp <command>: error: ...` naming the
problem, with nothing published (no output table, no data set manifest, no stats summary) and, for
jobs that release, the privacy ledger and seed byte for byte unchanged; or has a documented handling
(README, "Hostile input") that is checked here: a byte-order mark is skipped, unicode round-trips,
a repeated rating keeps its latest value in the split and counts once, a user with 10^5 rows moves
the statistics by no more than the stated sensitivity.
"""

from __future__ import annotations

import json
import os
import re
import shutil

import numpy as np
import pyarrow as pa
import pytest

from pipelines.data.datasets import open_dataset
from pipelines.releases.release import PrivacySettings
from pipelines.releases.stats_core import StatsSettings, release_metadata, stats_table
from privacy.accumulator import NoiseSpec, unpack_upper
from privacy.ledger import Ledger
from schemas import storage
from schemas.tables import (
    COUNTS,
    INTERACTIONS,
    ITEM_EMBEDDINGS,
    USER_EMBEDDINGS,
    items_schema,
    validate_items,
    validate_stats,
)
from ssp import cli
from tests.pipelines.stats_inputs import register_counts

INT64_MAX, INT64_MIN = 2**63 - 1, -(2**63)

# ---------------------------------------------------------------------------------------------
# Helpers


def write_files(folder, files: dict) -> str:
    """A MovieLens-like folder from {name: text}; returns its path."""
    folder.mkdir(parents=True, exist_ok=True)
    for name, text in files.items():
        (folder / name).write_bytes(text.encode("utf-8") if isinstance(text, str) else text)
    return str(folder)


def refused(capsys, command: str, *args: str, pattern: str) -> str:
    """Run `ssp command args`; it must exit 2 with exactly one error line, `ssp command: error: ...`
    matching `pattern`, and no traceback. Returns that line."""
    status = cli.main([command, *map(str, args)])
    err = capsys.readouterr().err
    errors = [line for line in re.split(r"[\r\n]+", err) if ": error: " in line]
    assert status == 2, err
    assert "Traceback" not in err, err
    assert len(errors) == 1 and errors[0].startswith(f"ssp {command}: error: "), err
    assert re.search(pattern, errors[0]), errors[0]
    return errors[0]


def ok(capsys, command: str, *args: str) -> str:
    status = cli.main([command, *map(str, args)])
    out, err = capsys.readouterr()
    assert status == 0, err
    return out


def snapshot(*paths) -> dict:
    """Every file under `paths` (files or folders) with its bytes: to show nothing changed."""
    found = {}
    for path in map(str, paths):
        if os.path.isfile(path):
            found[path] = open(path, "rb").read()
        for root, _, names in os.walk(path):
            for name in names:
                found[os.path.join(root, name)] = open(os.path.join(root, name), "rb").read()
    return found


def nothing_at(path) -> bool:
    return not os.path.exists(path) or not os.listdir(path)


def write_tables(folder, interactions, embeddings: dict, catalog, counts: dict | None = None) -> dict:
    """Canonical tables (interactions, user embeddings, items, and DP counts if given); their paths."""
    folder = str(folder)
    paths = {
        name: os.path.join(folder, f"{name}.parquet") for name in ("interactions", "user_embeddings", "items", "counts")
    }
    users, items, labels = (
        (list(column) for column in zip(*interactions, strict=True)) if interactions else ([], [], [])
    )
    storage.write_table(
        pa.table(
            {
                "user_id": pa.array(users, pa.int64()),
                "item_id": pa.array(items, pa.int64()),
                "label": pa.array(labels, pa.float64()),
                "timestamp": pa.array(range(len(users)), pa.int64()),
            },
            schema=INTERACTIONS,
        ),
        paths["interactions"],
    )
    storage.write_table(
        pa.table(
            {"user_id": list(embeddings), "embedding": [list(map(float, v)) for v in embeddings.values()]},
            schema=USER_EMBEDDINGS,
        ),
        paths["user_embeddings"],
    )
    storage.write_table(
        pa.table(
            {
                "item_id": pa.array(catalog, pa.int64()),
                "title": [f"item {j}" for j in catalog],
                "genres": [[] for _ in catalog],
            },
            schema=items_schema({"genres": "multivalent"}),
        ),
        paths["items"],
    )
    if counts is not None:
        storage.write_table(
            pa.table({"item_id": list(counts), "count": [float(c) for c in counts.values()]}, schema=COUNTS),
            paths["counts"],
        )
    return paths


# A small MovieLens csv folder, and the dat layout of the same ratings
RATINGS = "userId,movieId,rating,timestamp\n1,10,4.0,100\n1,20,3.5,101\n2,10,0.5,102\n"  # + an appended line is line 5
MOVIES = "movieId,title,genres\n10,Heat (1995),Action|Crime\n20,Up (2009),Animation\n"
RATINGS_DAT = "1::10::4::100\n2::20::3::101\n"  # + an appended line is line 3
MOVIES_DAT = "10::Heat (1995)::Action|Crime\n20::Up (2009)::Animation\n"
TAGS = "userId,movieId,tag,timestamp\n1,10,heist,5\n"


def csv_folder(ratings=RATINGS, movies=MOVIES, **others):
    return {
        "ratings.csv": ratings,
        "movies.csv": movies,
        **{name.replace("_", "."): text for name, text in others.items()},
    }


def dat_folder(ratings=RATINGS_DAT, movies=MOVIES_DAT):
    return {"ratings.dat": ratings, "movies.dat": movies}


# ---------------------------------------------------------------------------------------------
# MovieLens files: empty, header only, wrong delimiters, overflowing ids, NaN/inf ratings


INGEST_REFUSED = {
    # empty files
    "empty ratings.csv": (csv_folder(ratings=""), r"ratings.csv is empty \(not even a header line\)"),
    "empty movies.csv": (csv_folder(movies=""), r"movies.csv is empty \(not even a header line\)"),
    "empty ratings.dat": (dat_folder(ratings=""), r"ratings.dat is empty$"),
    "empty movies.dat": (dat_folder(movies=""), r"movies.dat holds no movies \(the catalog is empty\)"),
    "empty tags.csv (tags public)": (csv_folder(tags_csv=""), r"tags.csv is empty \(not even a header line\)"),
    # header only
    "header-only ratings.csv": (
        csv_folder(ratings="userId,movieId,rating,timestamp\n"),
        r"ratings.csv holds no ratings",
    ),
    "header-only movies.csv": (csv_folder(movies="movieId,title,genres\n"), r"movies.csv holds no movies"),
    "header-only both": (
        csv_folder("userId,movieId,rating,timestamp\n", "movieId,title,genres\n"),
        r"movies.csv holds no movies",
    ),
    "blank ratings.dat": (
        dat_folder(ratings="\n\n"),
        r"ratings.dat holds no ratings",
    ),  # blank lines are skipped: nothing is left
    # wrong delimiters
    "ratings.csv with ';'": (
        csv_folder(ratings=RATINGS.replace(",", ";")),
        r"ratings.csv, line 1: expected the header userId,movieId,rating,timestamp separated by ',', found "
        r"'userId;movieId;rating;timestamp'",
    ),
    "ratings.csv with tabs": (
        csv_folder(ratings=RATINGS.replace(",", "\t")),
        r"ratings.csv, line 1: expected the header .* separated by ',', found 'userId\\tmovieId",
    ),
    "ratings.csv rows with ';'": (
        csv_folder(ratings="userId,movieId,rating,timestamp\n1;10;4.0;100\n"),
        r"ratings.csv, line 2: expected 4 fields separated by ',', found 1: '1;10;4.0;100'",
    ),
    "movies.csv with ';'": (
        csv_folder(movies=MOVIES.replace(",", ";")),
        r"movies.csv, line 1: expected the header movieId,title,genres, found \['movieId;title;genres'\]",
    ),
    "ratings.dat with ','": (
        dat_folder(ratings=RATINGS_DAT.replace("::", ",")),
        r"ratings.dat, line 1: expected 4 fields separated by '::', found 1: '1,10,4,100'",
    ),
    "ratings.dat with ':'": (
        dat_folder(ratings=RATINGS_DAT.replace("::", ":")),
        r"ratings.dat, line 1: expected 4 fields separated by '::', found 1",
    ),
    "ratings.dat with tabs": (
        dat_folder(ratings=RATINGS_DAT.replace("::", "\t")),
        r"ratings.dat, line 1: expected 4 fields separated by '::', found 1",
    ),
    "movies.dat with ','": (
        dat_folder(movies=MOVIES_DAT.replace("::", ",")),
        r"movies.dat, line 1: expected 3 fields, found 1",
    ),
    # ids that overflow int64 (ratings and catalog; csv and dat)
    "user id 2^63": (
        csv_folder(RATINGS + f"{INT64_MAX + 1},10,4.0,5\n"),
        r"ratings.csv, line 5: user id 9223372036854775808 does not fit in a 64-bit integer",
    ),
    "user id -2^63-1": (
        csv_folder(RATINGS + f"{INT64_MIN - 1},10,4.0,5\n"),
        r"ratings.csv, line 5: user id -9223372036854775809 does not fit in a 64-bit integer",
    ),
    "movie id 10^20 in ratings": (
        csv_folder(RATINGS + "3,100000000000000000000,4.0,5\n"),
        r"ratings.csv, line 5: movie id 100000000000000000000 does not fit",
    ),
    "timestamp 10^20": (
        csv_folder(RATINGS + "3,10,4.0,100000000000000000000\n"),
        r"ratings.csv, line 5: timestamp 100000000000000000000 does not fit",
    ),
    "movie id 2^63 in movies.csv": (
        csv_folder(movies=MOVIES + f"{INT64_MAX + 1},Big (1988),Comedy\n"),
        r"movies.csv, line 4: movie id 9223372036854775808 does not fit",
    ),
    "user id 2^63 in ratings.dat": (
        dat_folder(RATINGS_DAT + f"{INT64_MAX + 1}::10::4::5\n"),
        r"ratings.dat, line 3: user id 9223372036854775808 does not fit",
    ),
    "movie id 2^63 in movies.dat": (
        dat_folder(movies=MOVIES_DAT + f"{INT64_MAX + 1}::Big (1988)::Comedy\n"),
        r"movies.dat, line 3: movie id 9223372036854775808 does not fit",
    ),
    "movie id 2^63 in tags.csv": (
        csv_folder(tags_csv=TAGS + f"1,{INT64_MAX + 1},big,6\n"),
        r"tags.csv, line 3: movie id 9223372036854775808 does not fit",
    ),
    # NaN and infinite ratings
    "rating nan": (csv_folder(RATINGS + "3,10,nan,5\n"), r"ratings.csv, line 5: rating is not finite \(nan\)"),
    "rating NaN": (csv_folder(RATINGS + "3,10,NaN,5\n"), r"ratings.csv, line 5: rating is not finite \(nan\)"),
    "rating inf": (csv_folder(RATINGS + "3,10,inf,5\n"), r"ratings.csv, line 5: rating is not finite \(inf\)"),
    "rating -inf": (csv_folder(RATINGS + "3,10,-inf,5\n"), r"ratings.csv, line 5: rating is not finite \(-inf\)"),
    "rating Infinity": (
        csv_folder(RATINGS + "3,10,Infinity,5\n"),
        r"ratings.csv, line 5: rating is not finite \(inf\)",
    ),
    "rating nan in ratings.dat": (
        dat_folder(RATINGS_DAT + "3::10::nan::5\n"),
        r"ratings.dat, line 3: rating is not finite \(nan\)",
    ),
    "rating inf in ratings.dat": (
        dat_folder(RATINGS_DAT + "3::10::inf::5\n"),
        r"ratings.dat, line 3: rating is not finite \(inf\)",
    ),
}


@pytest.mark.parametrize("files, pattern", INGEST_REFUSED.values(), ids=INGEST_REFUSED.keys())
def test_malformed_movielens_files_are_refused_and_nothing_is_written(tmp_path, capsys, files, pattern):
    source = write_files(tmp_path / "ml", files)
    features = ["--public-features", "genres,year,tags"] if "tags.csv" in files else []
    refused(capsys, "ingest", "--source", source, "--out", tmp_path / "out", *features, pattern=pattern)
    assert nothing_at(tmp_path / "out")


def test_train_on_a_malformed_movielens_folder_releases_nothing(tmp_path, capsys):
    source = write_files(tmp_path / "ml", csv_folder(RATINGS + "3,10,nan,5\n"))
    refused(
        capsys,
        "train",
        "--data",
        source,
        "--out",
        tmp_path / "run",
        "--epsilon",
        "1",
        pattern=r"ratings.csv, line 5: rating is not finite \(nan\)",
    )
    assert not (tmp_path / "run" / "ledger.parquet").exists() and not (tmp_path / "run" / "private" / "seed").exists()
    assert nothing_at(tmp_path / "run" / "private" / "data")


def test_a_failed_ingest_leaves_the_previous_data_set_whole(tmp_path, capsys):
    good = write_files(tmp_path / "good", csv_folder())
    ok(capsys, "ingest", "--source", good, "--out", tmp_path / "data")
    before = snapshot(tmp_path / "data")
    bad = write_files(
        tmp_path / "bad", csv_folder(RATINGS + "3,10,4.0,5\n" * 1000 + "3,20,inf,5\n")
    )  # fails after 1000 good rows
    refused(capsys, "ingest", "--source", bad, "--out", tmp_path / "data", pattern=r"line 1005: rating is not finite")
    assert snapshot(tmp_path / "data") == before
    assert open_dataset(str(tmp_path / "data")).manifest["ratings"] == 3


def test_ids_at_the_int64_limits_and_spreadsheet_csv_are_accepted(tmp_path, capsys):
    """The extreme int64 ids are valid; a UTF-8 byte-order mark and CRLF line ends (a csv saved by
    a spreadsheet) are read as the plain file."""
    ratings = (
        f"userId,movieId,rating,timestamp\r\n{INT64_MAX},{INT64_MIN},4.0,{INT64_MAX}\r\n"
        f"{INT64_MIN},10,1.0,{INT64_MIN}\r\n"
    )
    movies = f"movieId,title,genres\r\n{INT64_MIN},Min (2000),Drama\r\n10,Ten (2010),Comedy\r\n"
    source = write_files(tmp_path / "ml", {"ratings.csv": "\ufeff" + ratings, "movies.csv": "\ufeff" + movies})
    ok(capsys, "ingest", "--source", source, "--out", tmp_path / "data")
    data = open_dataset(str(tmp_path / "data"))
    assert storage.read_table(data.interactions).to_pylist() == [
        {"user_id": INT64_MAX, "item_id": INT64_MIN, "label": 4.0, "timestamp": INT64_MAX},
        {"user_id": INT64_MIN, "item_id": 10, "label": 1.0, "timestamp": INT64_MIN},
    ]
    assert storage.read_table(data.items)["title"].to_pylist() == ["Min (2000)", "Ten (2010)"]


def test_ids_that_overflow_int64_in_a_data_set_folder_are_refused_before_any_release(spark, tmp_path, capsys):
    """Parquet tables (not MovieLens text) with unsigned ids >= 2^63: refused by the table contracts
    (on the counts' default engine, Spark: the test session's, not one started and stopped per command)."""
    paths = write_tables(tmp_path, [(1, 10, 4.0)], {1: [1.0, 0.0]}, [10])
    big = pa.array([INT64_MAX + 6], pa.uint64())
    storage.write_table(
        pa.table({"user_id": big, "item_id": [10], "label": [4.0], "timestamp": [0]}),
        str(tmp_path / "big_users.parquet"),
    )
    refused(
        capsys,
        "counts",
        "--interactions",
        tmp_path / "big_users.parquet",
        "--items",
        paths["items"],
        "--out",
        tmp_path / "c1",
        "--epsilon",
        "1",
        pattern=r"interactions: column 'user_id': has type uint64, expected int64 "
        r"\(Integer value 9223372036854775813 not in range",
    )
    items = pa.table({"item_id": pa.array([10, INT64_MAX + 6], pa.uint64()), "title": ["a", "b"], "genres": [[], []]})
    storage.write_table(
        items.replace_schema_metadata(items_schema({"genres": "multivalent"}).metadata),
        str(tmp_path / "big_items.parquet"),
    )
    refused(
        capsys,
        "counts",
        "--interactions",
        paths["interactions"],
        "--items",
        tmp_path / "big_items.parquet",
        "--out",
        tmp_path / "c2",
        "--epsilon",
        "1",
        pattern=r"items: column 'item_id': has type uint64, expected int64",
    )
    assert nothing_at(tmp_path / "c1") and nothing_at(tmp_path / "c2")  # no counts, no ledger, no seed


# ---------------------------------------------------------------------------------------------
# Unicode in titles, genres and tags


UNICODE_MOVIES = [
    (1, "Amélie (2001)", "Comédie|Romance"),
    (2, "千と千尋の神隠し (2001)", "Animation|ファンタジー"),
    (3, 'Ünïcödé, "quoted" title (1999)', "Drama"),
    (4, "😀 Emoji: the Movie (2017)", "Comedy"),
    (5, "שלום עולם (2005)", "Drama"),
    (6, "Babylon 5 (1994\u20131998)", "Sci-Fi"),
]
UNICODE_TAGS = [(1, "Ärger"), (1, "ÄRGER"), (2, "日本"), (4, "😀 fun"), (5, "\u05e2\u05d1\u05e8\u05d9\u05ea")]
EXPECTED_YEARS = {1: 2001, 2: 2001, 3: 1999, 4: 2017, 5: 2005, 6: 1994}


def unicode_movielens(folder, users=12) -> str:
    """A csv MovieLens folder whose titles, genres and tags are unicode; every user rates every movie."""

    def quoted(text):
        return '"' + text.replace('"', '""') + '"'

    ratings = "userId,movieId,rating,timestamp\n" + "".join(
        f"{u},{j},{1 + (u * j) % 5}.0,{100 * u + j}\n" for u in range(1, users + 1) for j, _, _ in UNICODE_MOVIES
    )
    movies = "movieId,title,genres\n" + "".join(
        f"{j},{quoted(title)},{genres}\n" for j, title, genres in UNICODE_MOVIES
    )
    tags = "userId,movieId,tag,timestamp\n" + "".join(f"1,{j},{quoted(tag)},7\n" for j, tag in UNICODE_TAGS)
    return write_files(folder, {"ratings.csv": ratings, "movies.csv": movies, "tags.csv": tags})


def test_unicode_titles_genres_and_tags_round_trip(tmp_path, capsys):
    ok(
        capsys,
        "ingest",
        "--source",
        unicode_movielens(tmp_path / "ml"),
        "--out",
        tmp_path / "data",
        "--public-features",
        "genres,year,tags",
    )
    items = validate_items(storage.read_table(str(tmp_path / "data" / "items.parquet")))
    assert items["title"].to_pylist() == [title for _, title, _ in UNICODE_MOVIES]
    assert items["genres"].to_pylist() == [genres.split("|") for _, _, genres in UNICODE_MOVIES]
    assert items["year"].to_pylist() == [EXPECTED_YEARS[j] for j, _, _ in UNICODE_MOVIES]
    assert items["tags"].to_pylist() == [
        ["ärger", "ärger"],
        ["日本"],
        [],
        ["😀 fun"],
        ["\u05e2\u05d1\u05e8\u05d9\u05ea"],
        [],
    ]  # normalised: lower case, spaces collapsed
    # the dat layout (UTF-8, '::' separated; a ':' inside a title is kept)
    dat = write_files(
        tmp_path / "dat",
        {"ratings.dat": "1::1::5::10\n", "movies.dat": "1::Star Wars: Épisode IV (1977)::Aventure|Sci-Fi\n"},
    )
    ok(capsys, "ingest", "--source", dat, "--out", tmp_path / "dat-data")
    assert storage.read_table(str(tmp_path / "dat-data" / "items.parquet")).to_pylist() == [
        {"item_id": 1, "title": "Star Wars: Épisode IV (1977)", "genres": ["Aventure", "Sci-Fi"], "year": 1977}
    ]


# ---------------------------------------------------------------------------------------------
# Duplicate ratings: ingest keeps the log, the split keeps the latest, the counts count once,
# the stats job refuses a repeated pair


def test_duplicate_ratings_have_a_documented_handling(spark, tmp_path, capsys):
    ratings = RATINGS + "1,10,1.5,300\n1,10,5.0,200\n"  # user 1 rated movie 10 three times; the latest (t=300) says 1.5
    source = write_files(tmp_path / "ml", csv_folder(ratings))
    ok(capsys, "ingest", "--source", source, "--out", tmp_path / "data")
    data = open_dataset(str(tmp_path / "data"))
    assert data.manifest["ratings"] == 5  # ingest keeps the raw log as it is

    ok(capsys, "split", "--data", data.path, "--protocol", "rmse", "--out", tmp_path / "split")
    parts = pa.concat_tables(
        [storage.read_table(str(tmp_path / "split" / f"{part}.parquet")) for part in ("train", "valid", "test")]
    )
    pairs = list(
        zip(parts["user_id"].to_pylist(), parts["item_id"].to_pylist(), parts["label"].to_pylist(), strict=True)
    )
    assert sorted(pairs) == [(1, 10, 1.5), (1, 20, 3.5), (2, 10, 0.5)]  # one row per (user, item): the latest

    run = tmp_path / "run"
    ok(
        capsys,
        "counts",
        "--interactions",
        data.interactions,
        "--items",
        data.items,
        "--out",
        run,
        "--noise-multiplier",
        "0",
    )
    counts = storage.read_table(str(run / "counts.parquet"))
    assert dict(zip(counts["item_id"].to_pylist(), counts["count"].to_pylist(), strict=True)) == {
        10: 2.0,
        20: 1.0,
    }  # user 1 counts once for movie 10

    paths = write_tables(tmp_path / "emb", [], {1: [0.5, 0.5], 2: [0.1, 0.9]}, [10, 20])
    before = snapshot(run / "ledger.parquet", run / "private")
    refused(
        capsys,
        "stats",
        "--interactions",
        data.interactions,
        "--user-embeddings",
        paths["user_embeddings"],
        "--items",
        data.items,
        "--counts",
        run / "counts.parquet",
        "--out",
        run / "step-1" / "stats",
        "--ledger",
        run / "ledger.parquet",
        "--dim",
        "2",
        "--clip-u",
        "1",
        "--clip-y",
        "2",
        "--noise-multiplier",
        "0",
        pattern=r"2 duplicate \(user, item\) pair\(s\), e.g. user 1 item 10; each pair must appear once",
    )
    assert snapshot(run / "ledger.parquet", run / "private") == before and not (run / "step-1").exists()


# ---------------------------------------------------------------------------------------------
# A user with 10^5 rows: the weights bound that user's contribution to the statistics


def test_a_user_with_100k_rows_moves_the_statistics_by_at_most_the_sensitivity(spark, tmp_path, capsys):
    n, heavy = 100_000, 7
    catalog = list(range(1, n + 1))
    counts = {j: 1.0 + j % 97 for j in catalog}  # DP counts: weights differ across the user's items
    others = [(1, 3, 4.0), (1, 50, -1.0), (2, 3, 2.0), (2, 99_999, 0.5), (3, 3, 1.0)]
    labels = np.where(np.arange(n) % 2 == 0, 10.0, -10.0)  # |y| = 10 > clip_y: clipped to 2
    heavy_rows = list(zip([heavy] * n, catalog, labels.tolist(), strict=True))
    embeddings = {1: [0.3, 0.1], 2: [-0.2, 0.4], 3: [0.0, 0.5], heavy: [3.0, 4.0]}  # |u| = 5 > clip_u: clipped to 1
    wbar, clip_u, clip_y = 1.5, 1.0, 2.0

    def release(name, rows):
        paths = write_tables(tmp_path / name, rows, embeddings, catalog, counts)
        out = tmp_path / name / "stats"
        register_counts(
            paths["counts"], str(out / "ledger.parquet"), PrivacySettings(noise_multiplier=0.0)
        )  # the job takes released counts only
        ok(
            capsys,
            "stats",
            "--interactions",
            paths["interactions"],
            "--user-embeddings",
            paths["user_embeddings"],
            "--items",
            paths["items"],
            "--counts",
            paths["counts"],
            "--out",
            out,
            "--dim",
            "2",
            "--clip-u",
            clip_u,
            "--clip-y",
            clip_y,
            "--wbar",
            wbar,
            "--noise-multiplier",
            "0",
            "--shards",
            "2",
        )
        table = validate_stats(storage.read_table(str(out / "resample-0.parquet"))).sort_by("item_id")
        assert table["item_id"].to_pylist() == catalog
        return unpack_upper(np.array(table["a_upper"].to_pylist()), 2), np.array(table["b"].to_pylist())

    a_with, b_with = release("with", others + heavy_rows)
    a_without, b_without = release("without", others)
    change_a = np.sqrt(np.sum((a_with - a_without) ** 2))  # Frobenius norm over every item's A_j
    change_b = np.sqrt(np.sum((b_with - b_without) ** 2))
    assert change_a <= wbar * clip_u**2 * (1 + 1e-9)
    assert change_b <= wbar * clip_y * clip_u * (1 + 1e-9)
    # both clipped to the limit, so the bound is met exactly: the weights (sum of squares wbar^2) do
    # the bounding, not the size of the history (unweighted rows would move A by sqrt(10^5) * 1)
    assert change_a == pytest.approx(wbar * clip_u**2, rel=1e-9)
    assert change_b == pytest.approx(wbar * clip_y * clip_u, rel=1e-9)
    assert np.max(np.abs(a_with - a_without)) < 0.1 * wbar  # spread thin over the 10^5 items


# ---------------------------------------------------------------------------------------------
# NaN and infinite labels and embeddings in the tables given to the jobs


@pytest.fixture(scope="module")
def released(tmp_path_factory, spark):
    """A run folder after its first release (DP counts at epsilon 1): a ledger and a seed that the
    refused jobs below must leave exactly as they are. Returns (tables, run folder). (`spark`: the
    counts' default engine, here and in the refused `ssp counts` below, runs on the test session's
    Spark instead of starting a JVM per command.)"""
    folder = tmp_path_factory.mktemp("released")
    paths = write_tables(
        folder,
        [(1, 10, 4.0), (1, 20, 1.0), (2, 10, 3.0), (3, 30, 2.5)],
        {1: [0.6, 0.8], 2: [0.5, -0.5], 3: [0.0, 1.0]},
        [10, 20, 30, 40],
    )
    assert (
        cli.main(
            [
                "counts",
                "--interactions",
                paths["interactions"],
                "--items",
                paths["items"],
                "--out",
                str(folder / "run"),
                "--epsilon",
                "1",
            ]
        )
        == 0
    )
    return paths, folder / "run"


def stats_flags(paths, run, **replace):
    flags = {
        "--interactions": paths["interactions"],
        "--user-embeddings": paths["user_embeddings"],
        "--items": paths["items"],
        "--counts": run / "counts.parquet",
        "--out": run / "step-1" / "stats",
        "--ledger": run / "ledger.parquet",
        "--dim": "2",
        "--clip-u": "1",
        "--clip-y": "2",
        "--epsilon": "1",
        **replace,
    }
    return [str(part) for flag, value in flags.items() if value is not None for part in (flag, value)]


NON_FINITE = {"nan": float("nan"), "inf": float("inf"), "-inf": float("-inf")}


@pytest.mark.parametrize("value", NON_FINITE, ids=NON_FINITE)
def test_non_finite_labels_and_embeddings_are_refused_before_any_release(spark, released, tmp_path, capsys, value):
    paths, run = released
    bad = NON_FINITE[value]
    shown = re.escape(f"({bad})")
    before = snapshot(run)
    interactions = tmp_path / "interactions.parquet"
    storage.write_table(
        pa.table(
            {"user_id": [1, 2], "item_id": [10, 20], "label": [4.0, bad], "timestamp": [0, 1]}, schema=INTERACTIONS
        ),
        str(interactions),
    )
    user_embeddings = tmp_path / "user_embeddings.parquet"
    storage.write_table(
        pa.table({"user_id": [1, 2, 3], "embedding": [[0.6, 0.8], [0.5, bad], [0.0, 1.0]]}, schema=USER_EMBEDDINGS),
        str(user_embeddings),
    )
    item_embeddings = tmp_path / "item_embeddings.parquet"
    storage.write_table(
        pa.table(
            {"item_id": [10, 20, 30, 40], "embedding": [[1.0, 0.0], [0.0, bad], [1.0, 1.0], [0.5, 0.5]]},
            schema=ITEM_EMBEDDINGS,
        ),
        str(item_embeddings),
    )
    good_items = tmp_path / "good_item_embeddings.parquet"
    storage.write_table(
        pa.table(
            {"item_id": [10, 20, 30, 40], "embedding": [[1.0, 0.0], [0.0, 1.0], [1.0, 1.0], [0.5, 0.5]]},
            schema=ITEM_EMBEDDINGS,
        ),
        str(good_items),
    )

    refused(
        capsys,
        "stats",
        *stats_flags(paths, run, **{"--interactions": interactions}),
        pattern=rf"interactions: column 'label', row 1: is not finite {shown} \(in .*interactions.parquet\)",
    )
    refused(
        capsys,
        "stats",
        *stats_flags(paths, run, **{"--user-embeddings": user_embeddings}),
        pattern=rf"user embeddings: column 'embedding', row 1: holds a non-finite value {shown} "
        r"\(in .*user_embeddings.parquet\)",
    )
    for engine in ("local", "spark"):  # the same words: the engines check each batch as this process does
        refused(
            capsys,
            "counts",
            "--interactions",
            interactions,
            "--items",
            paths["items"],
            "--out",
            tmp_path / "counts",
            "--ledger",
            run / "ledger.parquet",
            "--epsilon",
            "1",
            "--engine",
            engine,
            pattern=rf"interactions: column 'label', row 1: is not finite {shown}",
        )
    assert snapshot(run) == before and not (tmp_path / "counts").exists()
    refused(
        capsys,
        "user-update",
        "--interactions",
        paths["interactions"],
        "--item-embeddings",
        item_embeddings,
        "--out",
        tmp_path / "users",
        pattern=rf"item embeddings: column 'embedding', row 1: holds a non-finite value {shown}",
    )
    refused(
        capsys,
        "user-update",
        "--interactions",
        interactions,
        "--item-embeddings",
        good_items,
        "--out",
        tmp_path / "users",
        pattern=rf"interactions.parquet: the label of user 2, item 20 is not finite {shown}",
    )
    assert not (tmp_path / "users").exists()


# ---------------------------------------------------------------------------------------------
# Negative, zero, non-finite and absurd privacy parameters


BUDGET_REFUSED = {  # flags -> the error, for `ssp counts`, `ssp stats` and `ssp train` alike
    "epsilon 0": (["--epsilon", "0"], r"epsilon must be > 0, got 0.0"),
    "epsilon -1": (["--epsilon", "-1"], r"epsilon must be > 0, got -1.0"),
    "epsilon nan": (["--epsilon", "nan"], r"epsilon must be > 0, got nan"),
    "epsilon inf": (["--epsilon", "inf"], r"epsilon must be finite \(inf would add no noise\)"),
    "delta 1": (["--epsilon", "1", "--delta", "1"], r"delta must be in \(0, 1\), got 1.0"),
    "delta 0": (["--epsilon", "1", "--delta", "0"], r"delta must be in \(0, 1\), got 0.0"),
    "delta -0.001": (["--epsilon", "1", "--delta", "-0.001"], r"delta must be in \(0, 1\)"),
    "delta nan": (["--epsilon", "1", "--delta", "nan"], r"delta must be in \(0, 1\), got nan"),
    "outer steps 0": (["--epsilon", "1", "--outer-steps", "0"], r"outer.steps must be a positive integer, got 0"),
    "count share 1": (["--epsilon", "1", "--count-share", "1"], r"count share must be in \(0, 1\), got 1.0"),
    "count share 1.5": (["--epsilon", "1", "--count-share", "1.5"], r"count share must be in \(0, 1\)"),
    "count share 0": (["--epsilon", "1", "--count-share", "0"], r"count share must be in \(0, 1\)"),
    "mean share nan": (
        ["--epsilon", "1", "--mean-share", "nan"],
        r"mean, gram and item gram shares must be >= 0|--mean-share must be a finite number, got nan",
    ),
}
JOB_REFUSED = {
    "counts": {
        **BUDGET_REFUSED,
        "noise multiplier -1": (
            ["--noise-multiplier", "-1"],
            r"noise multiplier must be a finite number >= 0, got -1.0",
        ),
        "noise multiplier nan": (
            ["--noise-multiplier", "nan"],
            r"noise multiplier must be a finite number >= 0, got nan",
        ),
        "epsilon and noise multiplier": (
            ["--epsilon", "1", "--noise-multiplier", "1"],
            r"give either --epsilon \(with --delta\) or --noise-multiplier",
        ),
        "resamples 0": (["--epsilon", "1", "--resamples", "0"], r"resamples must be a positive integer, got 0"),
        "K 0": (
            ["--epsilon", "1", "--max-items-per-user", "0"],
            r"--max-items-per-user must be a positive integer, got 0",
        ),
        "K -5": (
            ["--epsilon", "1", "--max-items-per-user", "-5"],
            r"--max-items-per-user must be a positive integer, got -5",
        ),
    },
    "stats": {
        **BUDGET_REFUSED,
        "noise multiplier -1": (["--noise-multiplier", "-1"], r"noise multiplier must be a finite number >= 0"),
        "noise multiplier inf": (
            ["--noise-multiplier", "inf"],
            r"noise multiplier must be a finite number >= 0, got inf",
        ),
        "clip-u 0": (["--epsilon", "1", "--clip-u", "0"], r"--clip-u must be a finite number > 0, got 0.0"),
        "clip-u -1": (["--epsilon", "1", "--clip-u", "-1"], r"--clip-u must be a finite number > 0, got -1.0"),
        "clip-u nan": (["--epsilon", "1", "--clip-u", "nan"], r"--clip-u must be a finite number > 0, got nan"),
        "clip-u inf, noised": (["--epsilon", "1", "--clip-u", "inf"], r"--clip-u must be a finite number > 0, got inf"),
        "clip-y 0": (["--epsilon", "1", "--clip-y", "0"], r"--clip-y must be a finite number > 0, got 0.0"),
        "clip-y inf, noised": (
            ["--noise-multiplier", "1", "--clip-y", "inf"],
            r"--clip-y must be a finite number > 0, got inf",
        ),
        "wbar 0": (["--epsilon", "1", "--wbar", "0"], r"--wbar must be a finite number > 0, got 0.0"),
        "dim 0": (["--epsilon", "1", "--dim", "0"], r"--dim must be a positive integer, got 0"),
        "resamples 0": (["--epsilon", "1", "--resamples", "0"], r"resamples must be a positive integer, got 0"),
    },
    "train": {
        **BUDGET_REFUSED,
        "clip-u 0": (["--epsilon", "1", "--clip-u", "0"], r"--clip-u must be a finite number > 0, got 0.0"),
        "clip-y -1": (["--epsilon", "1", "--clip-y", "-1"], r"--clip-y must be a finite number > 0, got -1.0"),
        "clip-u inf": (["--epsilon", "1", "--clip-u", "inf"], r"--clip-u must be a finite number > 0, got inf"),
        "wbar 0": (["--epsilon", "1", "--wbar", "0"], r"--wbar must be a finite number > 0, got 0.0"),
        "K 0": (
            ["--epsilon", "1", "--max-items-per-user", "0"],
            r"--max-items-per-user must be a positive integer, got 0",
        ),
        "K -1": (
            ["--epsilon", "1", "--max-items-per-user", "-1"],
            r"--max-items-per-user must be a positive integer, got -1",
        ),
        "DP-SGD clip 0": (
            ["--epsilon", "1", "--item-update", "dpsgd", "--dpsgd-clip", "0"],
            r"--dpsgd-clip must be a finite number > 0, got 0.0",
        ),
        "resamples 0": (["--epsilon", "1", "--resamples", "0"], r"resamples must be a positive integer, got 0"),
        "dim 0": (["--epsilon", "1", "--dim", "0"], r"--dim must be a positive integer, got 0"),
    },
}
PARAMETER_CASES = [
    pytest.param(command, flags, pattern, id=f"{command}: {name}")
    for command, cases in JOB_REFUSED.items()
    for name, (flags, pattern) in cases.items()
]


def _without(flags: list[str], names: set[str]) -> list[str]:
    pairs = list(zip(flags[::2], flags[1::2], strict=True))
    return [part for flag, value in pairs if flag not in names for part in (flag, value)]


@pytest.mark.parametrize("command, flags, pattern", PARAMETER_CASES)
def test_impossible_privacy_parameters_are_refused_before_anything_is_written(
    released, tmp_path, capsys, command, flags, pattern
):
    paths, run = released
    before = snapshot(run)
    given = {flag for flag in flags[::2]}
    if command == "counts":
        args = [
            "--interactions",
            paths["interactions"],
            "--items",
            paths["items"],
            "--out",
            tmp_path / "out",
            "--ledger",
            run / "ledger.parquet",
            *flags,
        ]
    elif command == "stats":
        args = [*_without(stats_flags(paths, run, **{"--out": tmp_path / "out"}), given | {"--epsilon"}), *flags]
    else:
        args = ["--data", tmp_path / "no-data-needed", "--out", tmp_path / "out", *flags]
    refused(capsys, command, *args, pattern=pattern)
    assert not (tmp_path / "out").exists()  # no output, no run directory, no manifest, no seed
    assert snapshot(run) == before  # the run's ledger and seed are untouched


def test_absurd_budgets_are_refused_and_large_ones_caught_by_the_ledger_check(tmp_path, capsys):
    """epsilon 10^6 protects no one and is refused before anything; epsilon 50 or delta 0.5 are
    numbers a run can be given: the ledger records them as they are, and the check that guards
    publishing (`ssp privacy --max-epsilon/--max-delta`, the DAG's check_privacy) refuses them.
    (The counts on the local engine: the budget is checked and recorded before any engine runs.)"""
    paths = write_tables(tmp_path, [(1, 10, 4.0), (2, 10, 3.0)], {1: [1.0, 0.0]}, [10, 20])
    refused(
        capsys,
        "counts",
        "--interactions",
        paths["interactions"],
        "--items",
        paths["items"],
        "--out",
        tmp_path / "huge-eps",
        "--epsilon",
        "1e6",
        pattern=r"epsilon 1e\+06 is over 100, where the noise no longer protects anyone",
    )
    assert not (tmp_path / "huge-eps").exists()
    ok(
        capsys,
        "counts",
        "--interactions",
        paths["interactions"],
        "--items",
        paths["items"],
        "--out",
        tmp_path / "big-eps",
        "--epsilon",
        "50",
        "--engine",
        "local",
    )
    refused(
        capsys,
        "privacy",
        tmp_path / "big-eps",
        "--max-epsilon",
        "10",
        pattern=r"epsilon spent .* exceeds the allowed 10",
    )
    ok(
        capsys,
        "counts",
        "--interactions",
        paths["interactions"],
        "--items",
        paths["items"],
        "--out",
        tmp_path / "big-delta",
        "--epsilon",
        "1",
        "--delta",
        "0.5",
        "--engine",
        "local",
    )
    refused(
        capsys,
        "privacy",
        tmp_path / "big-delta",
        "--max-epsilon",
        "10",
        "--max-delta",
        "1e-5",
        pattern=r"the run's delta 0.5 exceeds the allowed 1e-05",
    )


# ---------------------------------------------------------------------------------------------
# A stats table from another run (another d, other clip norms, no noise) given to the item update


@pytest.fixture(scope="module")
def prepared_run(tmp_path_factory):
    """A run prepared by `ssp train --stage prepare` (d = 2 and the bias coordinate, clip_u 1, clip_y 2, wbar 1) on a
    data set with unicode titles, genres and tags declared public. Statistics cover every item
    (--stats-threshold 0): 12 users' DP counts are noise, and a threshold on them would make the
    fixture depend on the draw."""
    folder = tmp_path_factory.mktemp("prepared")
    assert (
        cli.main(
            [
                "ingest",
                "--source",
                unicode_movielens(folder / "ml"),
                "--out",
                str(folder / "data"),
                "--public-features",
                "genres,year,tags",
            ]
        )
        == 0
    )
    run = folder / "run"
    assert (
        cli.main(
            [
                "train",
                "--stage",
                "prepare",
                "--data",
                str(folder / "data"),
                "--out",
                str(run),
                "--epsilon",
                "5",
                "--outer-steps",
                "1",
                "--dim",
                "2",
                "--epochs",
                "1",
                "--clip-u",
                "1",
                "--clip-y",
                "2",
                "--stats-threshold",
                "0",
            ]
        )
        == 0
    )
    return run


def plant_stats(run, settings: StatsSettings, noise_multiplier: float, summary_multiplier: float | None = None) -> str:
    """Step 1's statistics replaced by a complete, well-formed release made with other settings
    (its release.json saying `summary_multiplier` when given: a table swapped in under it)."""
    out = run / "step-1" / "stats"
    shutil.rmtree(out, ignore_errors=True)
    catalog = json.load(open(run / "manifest.json"))["prepared"]["stats_items"]
    items = np.sort(storage.read_table(catalog)["item_id"].to_numpy())
    d = settings.dim
    spec = NoiseSpec(noise_multiplier, settings.wbar, settings.clip_u, settings.clip_y, bytes(32), 2)
    a = np.tile(np.eye(d)[np.triu_indices(d)], (items.size, 1))
    storage.write_table(
        stats_table(items, a, np.zeros((items.size, d)), release_metadata(settings, spec, 0)),
        str(out / "resample-0.parquet"),
    )
    summary_multiplier = noise_multiplier if summary_multiplier is None else summary_multiplier
    storage.write_json(
        {
            "step": 1,
            "resamples": 1,
            "releases": [2],
            "noise_multiplier": summary_multiplier,
            "settings": settings.to_json(),
            "items": int(items.size),
            "epsilon_spent": 5.0,
            "ledger": "elsewhere/ledger.parquet",
        },
        str(out / "release.json"),
    )
    return str(out / "resample-0.parquet")


FOREIGN_STATS = {
    "another d": (dict(dim=4), r"stats were released with d=4, but this run expects d=3"),
    "a table without the bias coordinate": (
        dict(bias=0.0),
        r"stats were released with bias=0, but this run expects bias=2",
    ),
    "another clip_u": (dict(clip_u=0.5), r"stats were released with clip_u=0.5, but this run expects clip_u=1"),
    "another clip_y": (dict(clip_y=5.0), r"stats were released with clip_y=5, but this run expects clip_y=2"),
    "another wbar": (dict(wbar=2.0), r"stats were released with wbar=2, but this run expects wbar=1"),
    "a run without noise or clipping": (
        dict(clip_u=float("inf"), clip_y=float("inf"), unit="example", noise_multiplier=0.0),
        r"released with noise multiplier 0, but this run planned \d",
    ),
    "an un-noised table under this run's release.json": (
        dict(noise_multiplier=0.0, swapped=True),
        r"stats were released with noise_multiplier=0, but this run expects noise_multiplier=\d",
    ),
}


@pytest.mark.parametrize("change, pattern", FOREIGN_STATS.values(), ids=FOREIGN_STATS.keys())
def test_stats_from_another_run_are_refused_by_the_item_update(prepared_run, capsys, change, pattern):
    run = prepared_run
    multiplier = Ledger.open(str(run / "ledger.parquet")).budget["multipliers"]["stats"]
    change = dict(change)
    noise = change.pop("noise_multiplier", multiplier)
    swapped = change.pop("swapped", False)
    settings = StatsSettings(
        **{"dim": 3, "clip_u": 1.0, "clip_y": 2.0, "unit": "user", "wbar": 1.0, "bias": 2.0, **change}
    )
    plant_stats(run, settings, noise, multiplier if swapped else None)
    before = snapshot(run / "ledger.parquet", run / "manifest.json", run / "step-0")
    refused(capsys, "item-update", "--run", run, "--step", "1", pattern=pattern)
    assert snapshot(run / "ledger.parquet", run / "manifest.json", run / "step-0") == before  # steps_done unchanged
    assert not (run / "step-1" / "item_embeddings.parquet").exists() and not (run / "step-1" / "checkpoint").exists()
    assert not (run / "encoder").exists() and not (run / "item_embeddings.parquet").exists()
    assert json.load(open(run / "manifest.json"))["steps_done"] == []


def test_the_planted_release_is_accepted_with_the_runs_own_settings(prepared_run, tmp_path, capsys):
    """The control for the refusals above: the same planted table, made with the run's settings, trains."""
    run = tmp_path / "run"
    shutil.copytree(prepared_run, run)
    multiplier = Ledger.open(str(run / "ledger.parquet")).budget["multipliers"]["stats"]
    plant_stats(run, StatsSettings(3, 1.0, 2.0, "user", 1.0, bias=2.0), multiplier)
    ok(capsys, "item-update", "--run", run, "--step", "1")
    assert json.load(open(run / "manifest.json"))["steps_done"] == [1] and (run / "encoder").is_dir()
