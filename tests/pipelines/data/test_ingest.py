"""Ingest: every MovieLens layout into the canonical tables, exact expected values, and bad input."""

import math
import os

import pytest

from pipelines.data import ingest, movielens
from pipelines.data.datasets import open_dataset
from schemas import storage
from schemas.tables import validate_interactions, validate_items


def write(folder, name, text, encoding="utf-8"):
    folder.mkdir(parents=True, exist_ok=True)
    (folder / name).write_bytes(text.encode(encoding))


def rows(table):
    return table.to_pylist()


@pytest.fixture
def csv_source(tmp_path):
    src = tmp_path / "ml-latest"
    write(src, "ratings.csv", "userId,movieId,rating,timestamp\n1,10,4.0,100\n1,20,3.5,101\n2,10,0.5,102\n")
    write(
        src,
        "movies.csv",
        'movieId,title,genres\n10,"Good, the Bad (1966)",Western\n20,Heat (1995),Action|Crime|Thriller\n'
        "30,Unrated Film,(no genres listed)\n40,Babylon 5 (1994\u20131998),Sci-Fi\n",
    )
    write(
        src, "tags.csv", "userId,movieId,tag,timestamp\n1,10,Classic,5\n2,10,classic ,6\n2,20,heist,7\n3,99,orphan,8\n"
    )
    return src


def test_csv_layout_gives_exact_tables(csv_source, tmp_path):
    data = ingest.ingest(str(csv_source), str(tmp_path / "out"), ("genres", "year", "tags"))
    assert rows(storage.read_table(data.interactions)) == [
        {"user_id": 1, "item_id": 10, "label": 4.0, "timestamp": 100},
        {"user_id": 1, "item_id": 20, "label": 3.5, "timestamp": 101},
        {"user_id": 2, "item_id": 10, "label": 0.5, "timestamp": 102},
    ]
    items = validate_items(storage.read_table(data.items))
    assert rows(items) == [
        {
            "item_id": 10,
            "title": "Good, the Bad (1966)",
            "genres": ["Western"],
            "year": 1966,
            "tags": ["classic", "classic"],
        },
        {
            "item_id": 20,
            "title": "Heat (1995)",
            "genres": ["Action", "Crime", "Thriller"],
            "year": 1995,
            "tags": ["heist"],
        },
        {"item_id": 30, "title": "Unrated Film", "genres": [], "year": None, "tags": []},
        {"item_id": 40, "title": "Babylon 5 (1994\u20131998)", "genres": ["Sci-Fi"], "year": 1994, "tags": []},
    ]
    m = data.manifest
    assert (m["ratings"], m["users"], m["items"], m["rated_items"], m["layout"]) == (3, 2, 4, 2, "csv")
    assert m["public_features"] == {"genres": "multivalent", "year": "univalent", "tags": "multivalent"}
    assert open_dataset(str(tmp_path / "out")).manifest == m


def test_tags_are_not_features_unless_declared_public(csv_source, tmp_path):
    data = ingest.ingest(str(csv_source), str(tmp_path / "out"))
    items = storage.read_table(data.items)
    assert items.column_names == ["item_id", "title", "genres", "year"]
    assert data.manifest["public_features"] == {"genres": "multivalent", "year": "univalent"}


def test_ml1m_dat_layout_latin1(tmp_path):
    src = tmp_path / "ml-1m"
    write(src, "ratings.dat", "1::1193::5::978300760\n1::661::3::978302109\n7::1193::4::978300000\n")
    write(
        src,
        "movies.dat",
        "1193::One Flew Over the Cuckoo's Nest (1975)::Drama\n661::Caf\xe9 Society: A Story "
        "(1996)::Animation|Children's\n5::Unrated::Drama\n",
        "latin-1",
    )
    data = ingest.ingest(str(src), str(tmp_path / "out"))
    assert rows(storage.read_table(data.interactions)) == [
        {"user_id": 1, "item_id": 1193, "label": 5.0, "timestamp": 978300760},
        {"user_id": 1, "item_id": 661, "label": 3.0, "timestamp": 978302109},
        {"user_id": 7, "item_id": 1193, "label": 4.0, "timestamp": 978300000},
    ]
    assert rows(storage.read_table(data.items)) == [  # the catalog canonical: in item id order
        {"item_id": 5, "title": "Unrated", "genres": ["Drama"], "year": None},
        {
            "item_id": 661,
            "title": "Caf\xe9 Society: A Story (1996)",
            "genres": ["Animation", "Children's"],
            "year": 1996,
        },
        {"item_id": 1193, "title": "One Flew Over the Cuckoo's Nest (1975)", "genres": ["Drama"], "year": 1975},
    ]
    assert data.manifest["layout"] == "dat"
    with pytest.raises(movielens.IngestError, match="has no tags file|file is missing"):
        ingest.ingest(str(src), str(tmp_path / "out2"), ("genres", "tags"))


def test_ml10m_dat_layout_with_half_stars_and_tags(tmp_path):
    src = tmp_path / "ml-10m"
    write(src, "ratings.dat", "5::122::4.5::838985046\n5::185::1::838983525\n")
    write(src, "movies.dat", "122::Boomerang (1992)::Comedy|Romance\n185::Net, The (1995)::Action|Crime|Thriller\n")
    write(src, "tags.dat", "15::122::dark::1215184630\n20::185::sci-fi::with colons::1188263867\n")
    data = ingest.ingest(str(src), str(tmp_path / "out"), ("genres", "year", "tags"))
    assert storage.read_table(data.interactions)["label"].to_pylist() == [4.5, 1.0]
    assert storage.read_table(data.items)["tags"].to_pylist() == [["dark"], ["sci-fi::with colons"]]


def test_ml100k_layout(tmp_path):
    src = tmp_path / "ml-100k"
    write(src, "u.data", "196\t242\t3\t881250949\n186\t302\t3\t891717742\n")
    genres = "".join(f"{name}|{i}\n" for i, name in enumerate(movielens.ML100K_GENRES))
    write(src, "u.genre", genres)
    flags = ["0"] * 19
    flags_a, flags_b = flags.copy(), flags.copy()
    flags_a[5] = flags_a[8] = "1"  # Comedy, Drama
    flags_b[0] = "1"  # unknown
    write(
        src,
        "u.item",
        f"242|Kolya (1996)|24-Jan-1997||http://x|{'|'.join(flags_a)}\n302|L.A. Confidential|01-Jan-1997||http://y|{'|'.join(flags_b)}\n",
        "latin-1",
    )
    data = ingest.ingest(str(src), str(tmp_path / "out"))
    assert rows(storage.read_table(data.interactions)) == [
        {"user_id": 196, "item_id": 242, "label": 3.0, "timestamp": 881250949},
        {"user_id": 186, "item_id": 302, "label": 3.0, "timestamp": 891717742},
    ]
    assert rows(storage.read_table(data.items)) == [
        {"item_id": 242, "title": "Kolya (1996)", "genres": ["Comedy", "Drama"], "year": 1996},
        {"item_id": 302, "title": "L.A. Confidential (1997)", "genres": ["unknown"], "year": 1997},
    ]
    assert data.manifest["layout"] == "ml-100k"


def test_bundled_ml_latest_small(tmp_path):
    data = ingest.ingest(ingest.BUNDLED, str(tmp_path / "out"))
    m = data.manifest
    assert (m["ratings"], m["users"], m["items"]) == (100_836, 610, 9_742)
    items = storage.read_table(data.items)
    assert items.num_rows == 9_742
    genres = items["genres"].to_pylist()
    years = items["year"].to_pylist()
    assert sum(1 for g in genres if g) > 9_700 and sum(1 for y in years if y is not None) > 9_700
    toy_story = items.filter(items["item_id"].to_numpy() == 1).to_pylist()[0]
    assert (
        toy_story["genres"] == ["Adventure", "Animation", "Children", "Comedy", "Fantasy"] and toy_story["year"] == 1995
    )
    interactions = validate_interactions(storage.read_table(data.interactions))
    assert math.isclose(sum(interactions["label"].to_pylist()) / 100_836, 3.501556983616962, rel_tol=1e-12)


# ---------------------------------------------------------------------------------------------
# Bad input: a clear error naming the problem, and nothing written


def assert_refused(src, out, pattern, **kwargs):
    with pytest.raises(movielens.IngestError, match=pattern):
        ingest.ingest(str(src), str(out), **kwargs)
    assert not out.exists() or os.listdir(out) == [], os.listdir(out)


@pytest.mark.parametrize(
    "line, pattern",
    [
        ("3,10,4.0", r"ratings.csv, line 5: expected 4 fields separated by ',', found 3"),
        ("3,10,four,5", r"ratings.csv, line 5: rating 'four' is not a number"),
        ("3,10,NaN,5", r"ratings.csv, line 5: rating is not finite \(nan\)"),
        ("3,10,,5", r"ratings.csv, line 5: rating is null"),
        (
            "3,99999999999999999999,4.0,5",
            r"ratings.csv, line 5: movie id 99999999999999999999 does not fit in a 64-bit integer",
        ),
        (",10,4.0,5", r"ratings.csv, line 5: user id is null"),
    ],
)
def test_bad_rating_lines_are_located(csv_source, tmp_path, line, pattern):
    with open(csv_source / "ratings.csv", "a") as f:
        f.write(line + "\n3,20,1.0,7\n")
    assert_refused(csv_source, tmp_path / "out", pattern)


def test_blank_rating_lines_are_skipped_and_later_lines_keep_their_numbers(csv_source, tmp_path):
    """As in movies.csv: a blank line (or one whose fields are all empty), in the middle or at the
    end, is skipped; an error after one still names its own line."""
    rows = len(open(csv_source / "ratings.csv").read().splitlines()) - 1
    with open(csv_source / "ratings.csv", "a") as f:
        f.write("\n3,20,1.0,7\n,,,\n\n")
    data = ingest.ingest(str(csv_source), str(tmp_path / "out"))
    assert data.manifest["ratings"] == rows + 1
    with open(csv_source / "ratings.csv", "a") as f:
        f.write("3,30,bad,8\n")
    assert_refused(csv_source, tmp_path / "refused", rf"ratings.csv, line {rows + 6}: rating 'bad' is not a number")


def test_unknown_items_fail_with_count_or_are_dropped(csv_source, tmp_path):
    with open(csv_source / "ratings.csv", "a") as f:
        f.write("3,77,4.0,5\n4,77,2.0,6\n4,78,2.0,6\n")
    assert_refused(
        csv_source,
        tmp_path / "out",
        r"3 rating\(s\) refer to 2 movie\(s\) missing from movies.csv \(e.g. 77\); rerun with --unknown-items drop",
    )
    data = ingest.ingest(str(csv_source), str(tmp_path / "kept"), unknown_items="drop")
    assert data.manifest["ratings"] == 3
    assert data.manifest["unknown_items"] == {"policy": "drop", "dropped_ratings": 3, "dropped_items": 2}
    assert open_dataset(str(tmp_path / "kept")).manifest["unknown_items"]["dropped_ratings"] == 3


def test_missing_inputs(tmp_path, csv_source):
    with pytest.raises(movielens.IngestError, match="no such folder"):
        ingest.ingest(str(tmp_path / "nowhere"), str(tmp_path / "out"))
    empty = tmp_path / "empty"
    empty.mkdir()
    with pytest.raises(movielens.IngestError, match="not a MovieLens folder"):
        ingest.ingest(str(empty), str(tmp_path / "out"))
    os.remove(csv_source / "movies.csv")
    assert_refused(csv_source, tmp_path / "out", "has ratings.csv but its catalog movies.csv is missing")


def test_bad_catalogs(csv_source, tmp_path):
    write(csv_source, "movies.csv", "movieId,title,genres\n10,A (1990),Drama\n10,B (1991),Drama\n20,C,Drama\n")
    assert_refused(csv_source, tmp_path / "out", r"movies.csv, line 3: movie id 10 already listed on line 2")
    write(csv_source, "movies.csv", "id,name\n10,A\n")
    assert_refused(csv_source, tmp_path / "out", r"movies.csv, line 1: expected the header movieId,title,genres")
    write(csv_source, "movies.csv", "movieId,title,genres\nten,A,Drama\n")
    assert_refused(csv_source, tmp_path / "out", r"movies.csv, line 2: movie id 'ten' is not an integer")
    write(csv_source, "ratings.csv", "user,movie,stars,when\n1,10,4,5\n")
    write(csv_source, "movies.csv", "movieId,title,genres\n10,A,Drama\n")
    assert_refused(
        csv_source, tmp_path / "out", r"ratings.csv, line 1: expected the header userId,movieId,rating,timestamp"
    )


def test_bad_dat_line_is_located(tmp_path):
    src = tmp_path / "ml-1m"
    write(src, "ratings.dat", "1::1193::5::978300760\n1::1193::5\n")
    write(src, "movies.dat", "1193::A (1975)::Drama\n")
    assert_refused(src, tmp_path / "out", r"ratings.dat, line 2: expected 4 fields separated by '::', found 3")


def test_unknown_feature_family(csv_source, tmp_path):
    assert_refused(csv_source, tmp_path / "out", "unknown feature family cast", public_features=("genres", "cast"))


def test_ingest_from_gs(gcs_path, csv_source):
    fs, inner = storage.filesystem(gcs_path)
    for name in ("ratings.csv", "movies.csv"):
        fs.pipe(f"{inner}/src/{name}", (csv_source / name).read_bytes())
    data = ingest.ingest(f"{gcs_path}/src", f"{gcs_path}/out")
    assert data.manifest["ratings"] == 3
    assert storage.read_table(f"{gcs_path}/out/items.parquet").num_rows == 4


def test_year_from_title():
    assert movielens.year_from_title("Heat (1995)") == 1995
    assert movielens.year_from_title("Heat (1995) ") == 1995
    assert movielens.year_from_title("1984 (1984)") == 1984
    assert movielens.year_from_title("Twin Peaks (1990-1991)") == 1990
    assert movielens.year_from_title("Babylon 5 (1994\u2013)") == 1994
    assert movielens.year_from_title("Hyena Road") is None
    assert movielens.year_from_title("Film (a.k.a. 1995)") is None


def test_empty_and_header_only_ratings_are_refused(csv_source, tmp_path):
    (csv_source / "ratings.csv").write_bytes(b"")
    assert_refused(csv_source, tmp_path / "out", r"ratings.csv is empty \(not even a header line\)")
    (csv_source / "ratings.csv").write_bytes(b"userId,movieId,rating,timestamp\n")
    assert_refused(csv_source, tmp_path / "out", r"ratings.csv holds no ratings")
    (csv_source / "ratings.csv").write_bytes(b"userId;movieId;rating;timestamp\n1;10;4.0;5\n")  # wrong delimiter
    assert_refused(
        csv_source, tmp_path / "out", r"ratings.csv, line 1: expected the header userId,movieId,rating,timestamp"
    )
