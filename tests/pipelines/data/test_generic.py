"""`ssp ingest --interactions --catalog`: generic Parquet / CSV tables into the canonical data set,
implicit feedback, exact expected tables and manifests, bad input, and the ranking split of an
implicit-feedback data set (every row a positive, row-local)."""

import hashlib
import json
import os

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq
import pytest

from pipelines.data import generic, ingest, splits
from pipelines.data.datasets import open_dataset
from pipelines.data.movielens import IngestError
from pipelines.engines.local import LocalEngine
from schemas import storage
from schemas.tables import validate_interactions, validate_items
from ssp import cli

COLUMNS = generic.Columns(user="customer", item="product", timestamp="ts", title="name")
FEATURES = "tags:bag,brand:value,year:value"


def rows(table):
    return table.to_pylist()


def write_csv(path, text):
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text)
    return str(path)


@pytest.fixture
def tables(tmp_path):
    """An implicit-feedback interactions table with its own column names (timestamps in ms) and a
    catalog with a list column, a string column and an integer column."""
    interactions = tmp_path / "events.parquet"
    pq.write_table(
        pa.table(
            {
                "customer": pa.array([7, 7, 8, 9], pa.int32()),
                "product": pa.array([100, 200, 100, 300], pa.int64()),
                "ts": pa.array([1_000_500, 2_000_000, None, -1], pa.timestamp("ms", tz="UTC")),
                "ignored": ["a", "b", "c", "d"],
            }
        ),
        interactions,
    )
    catalog = tmp_path / "catalog.parquet"
    pq.write_table(
        pa.table(
            {
                "product": [100, 200, 300, 400],
                "name": ["Kettle", "Toaster", None, "Mug"],
                "tags": [["kitchen", " steel "], [], None, ["kitchen", "", "cup"]],
                "brand": ["Acme", None, "Bolt", "Acme"],
                "year": pa.array([2019, None, 2021, 2020], pa.int16()),
            }
        ),
        catalog,
    )
    return str(interactions), str(catalog)


EXPECTED_ITEMS = [
    {"item_id": 100, "title": "Kettle", "tags": ["kitchen", "steel"], "brand": "Acme", "year": 2019},
    {"item_id": 200, "title": "Toaster", "tags": [], "brand": None, "year": None},
    {"item_id": 300, "title": None, "tags": [], "brand": "Bolt", "year": 2021},
    {"item_id": 400, "title": "Mug", "tags": ["kitchen", "cup"], "brand": "Acme", "year": 2020},
]


def test_parquet_implicit_feedback_gives_exact_tables(tables, tmp_path):
    interactions, catalog = tables
    data = generic.ingest(interactions, catalog, str(tmp_path / "out"), FEATURES, columns=COLUMNS)
    assert rows(storage.read_table(data.interactions)) == [
        {"user_id": 7, "item_id": 100, "label": 1.0, "timestamp": 1000},  # 1 000 500 ms floored to seconds
        {"user_id": 7, "item_id": 200, "label": 1.0, "timestamp": 2000},
        {"user_id": 8, "item_id": 100, "label": 1.0, "timestamp": None},
        {"user_id": 9, "item_id": 300, "label": 1.0, "timestamp": -1},  # -1 ms is before 1970: floored to -1 s
    ]
    items = validate_items(storage.read_table(data.items))
    assert rows(items) == EXPECTED_ITEMS
    assert items.schema.field("brand").type == pa.string() and items.schema.field("year").type == pa.int64()
    m = data.manifest
    assert m["source"] == interactions and m["catalog"] == catalog and m["layout"] == "table"
    assert m["columns"] == {
        "user": "customer",
        "item": "product",
        "label": None,
        "count": None,
        "timestamp": "ts",
        "title": "name",
    }
    assert m["feedback"] == "implicit" and "rating_scale" not in m
    assert m["unknown_items"] == {"policy": "fail"}
    assert m["public_features"] == {"tags": "multivalent", "brand": "univalent", "year": "univalent"}
    assert (m["ratings"], m["users"], m["items"], m["rated_items"], m["label_range"]) == (4, 3, 4, 3, [1.0, 1.0])
    assert open_dataset(str(tmp_path / "out")).manifest == m
    summary = ingest.describe(data)
    assert "feedback implicit" in summary and "layout table" in summary


def test_csv_with_bags_as_text_and_explicit_labels(tmp_path):
    interactions = write_csv(
        tmp_path / "ratings.csv", "uid,iid,stars,when\n1,10,4.5,100\n1,20, 2 ,2001-09-09T01:46:40\n2,10,5,\n"
    )
    catalog = write_csv(
        tmp_path / "items.csv", 'iid,genres,studio,year\n10,Drama|War,Ghibli,1995\n20,"",,\n30,a|| b ,007,2001\n'
    )
    columns = generic.Columns(user="uid", item="iid", label="stars", timestamp="when")
    with pytest.raises(
        IngestError,
        match=r"ratings.csv, row 2: column .when. holds .2001-09-09T01:46:40.; a timestamp must be integer seconds .* "
        r"throughout the column \(earlier rows hold .100.\)",
    ):  # seconds and ISO 8601 mixed in one file
        generic.ingest(
            interactions, catalog, str(tmp_path / "mixed"), "genres:bag", columns=columns, rating_scale=(1, 5)
        )
    interactions = write_csv(
        tmp_path / "ratings.csv", "uid,iid,stars,when\n1,10,4.5,100\n1,20, 2 ,1000000000\n2,10,5,\n"
    )
    data = generic.ingest(
        interactions,
        catalog,
        str(tmp_path / "out"),
        "genres:bag,studio:value,year:value",
        columns=columns,
        rating_scale=(1, 5),
    )
    assert rows(storage.read_table(data.interactions)) == [
        {"user_id": 1, "item_id": 10, "label": 4.5, "timestamp": 100},
        {"user_id": 1, "item_id": 20, "label": 2.0, "timestamp": 1_000_000_000},
        {"user_id": 2, "item_id": 10, "label": 5.0, "timestamp": None},
    ]
    assert rows(storage.read_table(data.items)) == [
        {"item_id": 10, "title": None, "genres": ["Drama", "War"], "studio": "Ghibli", "year": 1995},
        {"item_id": 20, "title": None, "genres": [], "studio": None, "year": None},
        {"item_id": 30, "title": None, "genres": ["a", "b"], "studio": "007", "year": 2001},
    ]
    m = data.manifest
    assert m["feedback"] == "explicit" and m["rating_scale"] == [1.0, 5.0] and m["label_range"] == [2.0, 5.0]
    assert "feedback explicit ratings" in ingest.describe(data)


def test_csv_iso_timestamps(tmp_path):
    interactions = write_csv(
        tmp_path / "a.csv", "user_id,item_id,t\n1,10,2001-09-09T01:46:40\n1,20,2001-09-09 01:46:41+01:00\n"
    )
    catalog = write_csv(tmp_path / "c.csv", "item_id\n10\n20\n")
    with pytest.raises(
        IngestError, match=r"a.csv, row 2: .*in one form throughout the column"
    ):  # naive and offset forms mixed
        generic.ingest(interactions, catalog, str(tmp_path / "out"), "", columns=generic.Columns(timestamp="t"))
    interactions = write_csv(
        tmp_path / "a.csv", "user_id,item_id,t\n1,10,2001-09-09T01:46:40\n1,20,2001-09-09 01:46:41\n"
    )
    data = generic.ingest(interactions, catalog, str(tmp_path / "out"), "", columns=generic.Columns(timestamp="t"))
    assert storage.read_table(data.interactions)["timestamp"].to_pylist() == [1_000_000_000, 1_000_000_001]


def test_folder_of_parquet_parts(tables, tmp_path):
    _, catalog = tables
    parts = tmp_path / "events"
    parts.mkdir()
    pq.write_table(pa.table({"customer": [7, 7], "product": [100, 200], "ts": [5, 6]}), parts / "part-00000.parquet")
    pq.write_table(pa.table({"customer": [8], "product": [100], "ts": [7]}), parts / "part-00001.parquet")
    (parts / "_SUCCESS_not_a_marker").write_text("")  # skipped: an underscore file
    (parts / ".part-00000.parquet.crc").write_text("x")  # skipped: a hidden file
    data = generic.ingest(str(parts), catalog, str(tmp_path / "out"), FEATURES, columns=COLUMNS)
    assert rows(storage.read_table(data.interactions)) == [
        {"user_id": 7, "item_id": 100, "label": 1.0, "timestamp": 5},
        {"user_id": 7, "item_id": 200, "label": 1.0, "timestamp": 6},
        {"user_id": 8, "item_id": 100, "label": 1.0, "timestamp": 7},
    ]
    pq.write_table(pa.table({"customer": ["u9"], "product": [100], "ts": [8]}), parts / "part-00002.parquet")
    data = generic.ingest(str(parts), catalog, str(tmp_path / "text"), FEATURES, columns=COLUMNS)  # a text user id
    assert storage.read_table(data.interactions)["user_id"].to_pylist() == [7, 7, 8, generic.user_key_id("u9")]
    assert data.manifest["ids"] == {"user": "text", "item": "integer"} and data.item_keys is None
    pq.write_table(pa.table({"customer": [9.5], "product": [100], "ts": [8]}), parts / "part-00002.parquet")
    with pytest.raises(
        IngestError, match=r"part-00002.parquet: column 'customer' has type double; ids must be integers or text"
    ):
        generic.ingest(str(parts), catalog, str(tmp_path / "bad"), FEATURES, columns=COLUMNS)
    assert not (tmp_path / "bad").exists()


def test_missing_columns_name_the_column_the_file_and_what_exists(tables, tmp_path):
    interactions, catalog = tables
    with pytest.raises(IngestError) as info:
        generic.ingest(
            interactions,
            catalog,
            str(tmp_path / "out"),
            FEATURES,
            columns=generic.Columns(user="client", item="product"),
        )
    assert str(info.value) == (
        f"{interactions}: no column 'client' (its columns: customer, product, ts, ignored); "
        "name the right column with the ingest flags"
    )
    with pytest.raises(
        IngestError, match=r"catalog.parquet: no column 'colour' \(its columns: product, name, tags, brand, year\)"
    ):
        generic.ingest(interactions, catalog, str(tmp_path / "out"), "colour:value", columns=COLUMNS)
    with pytest.raises(IngestError, match=r"events.parquet: no column 'rating'"):
        generic.ingest(
            interactions,
            catalog,
            str(tmp_path / "out"),
            FEATURES,
            columns=generic.Columns(user="customer", item="product", label="rating"),
            rating_scale=(1, 5),
        )
    assert not (tmp_path / "out").exists()


def test_ids_are_integers_or_text_each_user_id_by_itself(tables, tmp_path):
    """A text user id that is not an integer becomes a 64-bit hash of itself alone (user-local); a
    decimal one stays that integer, in a batch with text ids as in one without; other types and
    empty ids are refused."""
    _, catalog = tables
    columns = generic.Columns(user="customer", item="product")
    text = write_csv(tmp_path / "text.csv", "customer,product\n1,100\nbob,100\n 007 ,200\n")
    data = generic.ingest(text, catalog, str(tmp_path / "text"), FEATURES, columns=columns)
    ids = storage.read_table(data.interactions)["user_id"].to_pylist()
    assert sorted(ids) == sorted([1, generic.user_key_id("bob"), 7]) and generic.user_key_id("bob") not in (1, 7)
    assert generic.user_key_id("bob") == int.from_bytes(
        hashlib.blake2b(b"bob", digest_size=8, person=b"ssp-user-id").digest(), "big", signed=True
    )
    alone = write_csv(tmp_path / "alone.csv", "customer,product\n1,100\n7,200\n")  # integers alone: the same ids
    together = storage.read_table(
        generic.ingest(alone, catalog, str(tmp_path / "alone"), FEATURES, columns=columns).interactions
    )
    assert sorted(together["user_id"].to_pylist()) == [1, 7]
    hexadecimal = write_csv(tmp_path / "hex.csv", "customer,product\n0x10,100\n")  # alone: text, as beside text
    alone = generic.ingest(hexadecimal, catalog, str(tmp_path / "hex"), FEATURES, columns=columns)
    assert storage.read_table(alone.interactions)["user_id"].to_pylist() == [generic.user_key_id("0x10")]
    blank = write_csv(tmp_path / "blank.csv", "customer,product\nann,100\n   ,100\n")
    with pytest.raises(IngestError, match=r"blank.csv, row 2: column 'customer' is empty"):
        generic.ingest(blank, catalog, str(tmp_path / "out"), FEATURES, columns=columns)
    floats = tmp_path / "floats.parquet"
    pq.write_table(pa.table({"customer": [1], "product": [100.0]}), floats)
    with pytest.raises(IngestError, match=r"column 'product' has type double; ids must be integers or text"):
        generic.ingest(str(floats), catalog, str(tmp_path / "out"), FEATURES, columns=columns)
    empty = write_csv(tmp_path / "empty.csv", "customer,product\n1,100\n,100\n")
    with pytest.raises(IngestError, match=r"empty.csv, row 2: column 'customer' is empty"):
        generic.ingest(empty, catalog, str(tmp_path / "out"), FEATURES, columns=columns)
    assert not (tmp_path / "out").exists()


def test_a_catalog_with_text_ids_numbers_them_in_key_order_and_maps_the_interactions(tmp_path):
    catalog = write_csv(tmp_path / "c.csv", "sku,name\nsku-B,Bee\nsku-A,Ay\n0042,Zero\n")
    log = write_csv(tmp_path / "l.csv", "who,sku\nu1,sku-A\nu1,0042\nu2,sku-B\n")
    columns = generic.Columns(user="who", item="sku", title="name")
    data = generic.ingest(log, catalog, str(tmp_path / "out"), "", columns=columns)
    keys = storage.read_table(data.item_keys)
    assert keys.to_pydict() == {
        "item_id": [1, 2, 3],
        "item_key": ["0042", "sku-A", "sku-B"],
    }  # text: 0042 keeps its zeros
    assert storage.read_table(data.items).to_pydict()["title"] == ["Zero", "Ay", "Bee"]
    table = storage.read_table(data.interactions)
    by_user = sorted(zip(table["user_id"].to_pylist(), table["item_id"].to_pylist(), strict=True))
    u1, u2 = generic.user_key_id("u1"), generic.user_key_id("u2")
    assert by_user == sorted([(u1, 2), (u1, 1), (u2, 3)])
    assert data.manifest["ids"] == {"user": "text", "item": "text"}
    unknown = write_csv(tmp_path / "u.csv", "who,sku\nu1,sku-A\nu2,sku-Z\nu3,sku-Y\n")
    with pytest.raises(
        IngestError, match=r"2 interaction\(s\) refer to 2 item\(s\) missing from the catalog .* \(e.g. 'sku-Y'\)"
    ):
        generic.ingest(unknown, catalog, str(tmp_path / "bad"), "", columns=columns)
    dropped = generic.ingest(unknown, catalog, str(tmp_path / "drop"), "", columns=columns, unknown_items="drop")
    assert dropped.manifest["unknown_items"] == {"policy": "drop", "dropped_ratings": 2, "dropped_items": 2}
    twice = write_csv(tmp_path / "twice.csv", "sku,name\nsku-A,Ay\nsku-A,Ay\n")
    with pytest.raises(IngestError, match=r"column 'sku' holds 'sku-A' more than once; item ids must be unique"):
        generic.ingest(log, twice, str(tmp_path / "bad"), "", columns=columns)


def test_labels_must_be_finite_numbers_on_the_scale(tables, tmp_path):
    _, catalog = tables
    columns = generic.Columns(user="customer", item="product", label="stars")
    path = tmp_path / "r.parquet"
    pq.write_table(pa.table({"customer": [1, 1, 2], "product": [100, 200, 100], "stars": [4.0, 11.0, 12.0]}), path)
    with pytest.raises(IngestError) as info:
        generic.ingest(str(path), catalog, str(tmp_path / "out"), FEATURES, columns=columns, rating_scale=(1, 10))
    assert str(info.value) == (
        f"{path}, row 2: rating 11 is outside the rating scale 1..10 (2 such rating(s) in this batch); "
        "ingest it with `ssp ingest --rating-scale MIN MAX`"
    )
    pq.write_table(pa.table({"customer": [1, 1], "product": [100, 200], "stars": [4.0, float("nan")]}), path)
    with pytest.raises(IngestError, match=r"r.parquet, row 2: column 'stars' is not finite"):
        generic.ingest(str(path), catalog, str(tmp_path / "out"), FEATURES, columns=columns, rating_scale=(1, 10))
    pq.write_table(pa.table({"customer": [1], "product": [100], "stars": ["good"]}), path)
    with pytest.raises(IngestError, match=r"column 'stars' has type string; labels must be numbers"):
        generic.ingest(str(path), catalog, str(tmp_path / "out"), FEATURES, columns=columns, rating_scale=(1, 10))
    with pytest.raises(IngestError, match="needs --rating-scale"):
        generic.ingest(str(path), catalog, str(tmp_path / "out"), FEATURES, columns=columns)
    with pytest.raises(IngestError, match="--rating-scale needs --label-col"):
        generic.ingest(
            str(path),
            catalog,
            str(tmp_path / "out"),
            FEATURES,
            columns=generic.Columns(user="customer", item="product"),
            rating_scale=(1, 5),
        )
    assert not (tmp_path / "out").exists()


def test_feature_declarations(tables, tmp_path):
    interactions, catalog = tables
    assert generic.parse_features(" genres:bag , brand:value,,") == {"genres": "multivalent", "brand": "univalent"}
    assert generic.parse_features("") == {}
    for spec, pattern in (
        ("tags:list", r"unknown kind 'list' for column 'tags'; use bag .*, value .* or number"),
        ("tags", r"'tags' must be COLUMN:KIND"),
        ("tags:bag,tags:value", "declared twice"),
        ("title:value", "canonical items column"),
    ):
        with pytest.raises(IngestError, match=pattern):
            generic.ingest(interactions, catalog, str(tmp_path / "out"), spec, columns=COLUMNS)
    with pytest.raises(IngestError, match=r"bag column 'year' has type int16"):
        generic.ingest(interactions, catalog, str(tmp_path / "out"), "year:bag", columns=COLUMNS)
    with pytest.raises(
        IngestError, match=r"value column 'tags' has type list<element: string>, which is not one value per item"
    ):
        generic.ingest(interactions, catalog, str(tmp_path / "out"), "tags:value", columns=COLUMNS)
    assert not (tmp_path / "out").exists()


def test_values_and_numbers_read_the_same_from_csv_and_parquet(tmp_path):
    """One catalog as CSV and as Parquet gives one items table: a value column of whole numbers is
    int64 (9, 9.0, "9.0" alike), one of other numbers is text by one rule, a number column is
    float64; empty, null and NaN are unknown."""
    csv = write_csv(
        tmp_path / "catalog.csv", "sku,price,size,brand\n10,9.0,9.0,acme\n20,9.5,10,bolt\n30,,,acme\n40,nan,11.5,\n"
    )
    parquet = tmp_path / "catalog.parquet"
    pq.write_table(
        pa.table(
            {
                "sku": [10, 20, 30, 40],
                "price": pa.array([9, 9.5, None, float("nan")], pa.float32()),
                "size": [9.0, 10.0, None, 11.5],
                "brand": ["acme", "bolt", "acme", None],
            }
        ),
        parquet,
    )
    whole = write_csv(tmp_path / "whole.csv", "sku,size\n10,9.0\n20, 10\n")
    columns = generic.Columns(item="sku")
    expected = [
        {"item_id": 10, "title": None, "price": 9.0, "size": "9", "brand": "acme"},
        {"item_id": 20, "title": None, "price": 9.5, "size": "10", "brand": "bolt"},
        {"item_id": 30, "title": None, "price": None, "size": None, "brand": "acme"},
        {"item_id": 40, "title": None, "price": None, "size": "11.5", "brand": None},
    ]
    for catalog in (csv, str(parquet)):
        items = generic.read_keyed_catalog(catalog, columns, "price:number,size:value,brand:value")[0]
        assert rows(items) == expected and items.schema.field("price").type == pa.float64(), catalog
    assert generic.read_keyed_catalog(whole, columns, "size:value")[0]["size"].to_pylist() == [9, 10]


def test_the_ingest_summary_gives_a_number_features_range(tmp_path):
    catalog = write_csv(tmp_path / "c.csv", "sku,price,brand\n10,9.5,acme\n20,,bolt\n30,120,acme\n")
    clicks = write_csv(tmp_path / "i.csv", "user_id,sku\n1,10\n2,30\n")
    data = generic.ingest(
        clicks, catalog, str(tmp_path / "data"), "price:number,brand:value", columns=generic.Columns(item="sku")
    )
    summary = ingest.describe(data)
    assert "    price   number from 9.5 to 120 (bucketed by the catalog's deciles), 2 items known" in summary
    assert "    brand   univalent, 2 distinct values, 3 items known" in summary


def test_bad_values_and_numbers_are_named(tmp_path):
    columns = generic.Columns(item="sku")
    for text, spec, pattern in (
        (
            "sku,brand\n10,acme\n20,a|b\n",
            "brand:value",
            r"catalog.csv, row 2: value column 'brand' holds 'a\|b', several values separated by '\|'; "
            r"declare the column a bag \(brand:bag\)",
        ),
        (
            "sku,price\n10,9\n20,cheap\n",
            "price:number",
            r"catalog.csv, row 2: number column 'price' holds 'cheap', not a number",
        ),
        ("sku,price\n10,inf\n", "price:number", r"catalog.csv, row 1: 'price' holds inf, not a finite number"),
    ):
        catalog = write_csv(tmp_path / "catalog.csv", text)
        with pytest.raises(IngestError, match=pattern):
            generic.read_keyed_catalog(catalog, columns, spec)[0]
    parquet = tmp_path / "bags.parquet"
    pq.write_table(pa.table({"sku": [10], "price": [["9"]]}), parquet)
    with pytest.raises(IngestError, match=r"number column 'price' has type list<element: string>; give numbers"):
        generic.read_keyed_catalog(str(parquet), columns, "price:number")[0]


def test_bad_catalogs(tables, tmp_path):
    interactions, _ = tables
    catalog = tmp_path / "dupes.parquet"
    pq.write_table(pa.table({"product": [100, 200, 100, 300]}), catalog)
    with pytest.raises(
        IngestError, match=r"column 'product' value 100 appears more than once; item ids must be unique"
    ):
        generic.ingest(
            interactions,
            str(catalog),
            str(tmp_path / "out"),
            "",
            columns=generic.Columns(user="customer", item="product"),
        )
    pq.write_table(pa.table({"product": pa.array([], pa.int64())}), catalog)
    with pytest.raises(IngestError, match="holds no items"):
        generic.ingest(
            interactions,
            str(catalog),
            str(tmp_path / "out"),
            "",
            columns=generic.Columns(user="customer", item="product"),
        )
    with pytest.raises(IngestError, match="no such file or folder"):
        generic.ingest(
            interactions,
            str(tmp_path / "nowhere.parquet"),
            str(tmp_path / "out"),
            "",
            columns=generic.Columns(user="customer", item="product"),
        )
    unknown = tmp_path / "catalog.json"
    unknown.write_text("{}")
    with pytest.raises(IngestError, match="name the file .parquet or .csv"):
        generic.ingest(
            interactions,
            str(unknown),
            str(tmp_path / "out"),
            "",
            columns=generic.Columns(user="customer", item="product"),
        )
    assert not (tmp_path / "out").exists()


def test_unknown_items_fail_with_count_or_are_dropped(tables, tmp_path):
    interactions, catalog = tables
    events = tmp_path / "more.parquet"
    pq.write_table(pa.table({"customer": [7, 7, 8, 8], "product": [100, 555, 555, 556], "ts": [1, 2, 3, 4]}), events)
    with pytest.raises(IngestError) as info:
        generic.ingest(str(events), catalog, str(tmp_path / "out"), FEATURES, columns=COLUMNS)
    assert str(info.value) == (
        f"{events}: 3 interaction(s) refer to 2 item(s) missing from the catalog {catalog} (e.g. 555); "
        "rerun with --unknown-items drop to drop them"
    )
    assert not (tmp_path / "out").exists()
    data = generic.ingest(str(events), catalog, str(tmp_path / "kept"), FEATURES, columns=COLUMNS, unknown_items="drop")
    assert rows(storage.read_table(data.interactions)) == [{"user_id": 7, "item_id": 100, "label": 1.0, "timestamp": 1}]
    assert data.manifest["unknown_items"] == {"policy": "drop", "dropped_ratings": 3, "dropped_items": 2}
    assert "dropped             3 ratings of items missing from the catalog" in ingest.describe(data)


# ---------------------------------------------------------------------------------------------
# The ranking split of an implicit-feedback data set


def _implicit_tables(tmp_path, users):
    """user u has u + 2 interactions (items 0 .. u + 1), labels absent: users 0..2 have fewer than
    5 positives, the others 5 or more."""
    pairs = [(u, i) for u in users for i in range(u + 2)]
    path = tmp_path / f"events-{len(users)}.parquet"
    pq.write_table(pa.table({"user_id": [u for u, _ in pairs], "item_id": [i for _, i in pairs]}), path)
    catalog = tmp_path / "items.parquet"
    pq.write_table(pa.table({"item_id": list(range(60))}), catalog)
    return str(path), str(catalog)


def test_implicit_recall_split_keeps_every_row(tmp_path):
    users = list(range(30))
    interactions, catalog = _implicit_tables(tmp_path, users)
    data = generic.ingest(interactions, catalog, str(tmp_path / "data"), "")
    assert data.manifest["feedback"] == "implicit"
    document = splits.make_split(data, "recall", str(tmp_path / "all"), holdout=0.0, engine=LocalEngine())
    assert document["positive_threshold"] is None
    # every row is a positive: users 3..29 have u + 2 >= 5 rows, users 0..2 (2, 3, 4 rows) are not eligible
    assert document["n_eligible_users"] == 27
    assert document["sizes"]["train"] == {"rows": sum(u + 2 for u in range(3, 30)), "users": 27}
    train = storage.read_table(str(tmp_path / "all" / "train.parquet"))
    assert sorted(zip(train["user_id"].to_pylist(), train["item_id"].to_pylist(), strict=True)) == [
        (u, i) for u in range(3, 30) for i in range(u + 2)
    ]
    assert json.loads((tmp_path / "all" / "split.json").read_text())["positive_threshold"] is None
    # holdout 0.2 (seed 1234): the user hash (row_uniform 0.817, 0.823, 0.897, 0.910) puts users 12,
    # 13, 15 in validation (x < 0.9) and 21 in test; user 29 trains and has every item 0..30, so no
    # held-out row is dropped by the train-items restriction: 5 + 6 + ... + 31 = 486 rows in all.
    document = splits.make_split(data, "recall", str(tmp_path / "held"), engine=LocalEngine())
    sizes = document["sizes"]
    assert sizes["train"] == {"rows": 486 - (14 + 15 + 17 + 23), "users": 23}
    assert (
        sizes["valid_history"]["users"] == 3
        and sizes["valid_history"]["rows"] + sizes["valid_targets"]["rows"] == 14 + 15 + 17
    )
    assert sizes["test_history"]["users"] == 1 and sizes["test_history"]["rows"] + sizes["test_targets"]["rows"] == 23
    for name in splits.HELDOUT_PARTS:
        assert set(storage.read_table(str(tmp_path / "held" / f"{name}.parquet"))["label"].to_pylist()) <= {1.0}


def test_a_count_column_trains_as_that_many_rows_of_one(tmp_path):
    """An aggregated log (user, item, plays) and the same log with one row per play give the same
    split, labels the summed counts; a count below 1 or not a number is refused naming the row."""
    counted = [(u, i, 1 + (u * 7 + i) % 4) for u in range(3, 30) for i in range(u + 2)]
    catalog = write_csv(tmp_path / "c.csv", "item_id\n" + "".join(f"{i}\n" for i in range(60)))
    aggregated = write_csv(
        tmp_path / "a.csv", "listener,item_id,plays\n" + "".join(f"{u},{i},{c}\n" for u, i, c in counted)
    )
    per_play = write_csv(
        tmp_path / "p.csv", "user_id,item_id\n" + "".join(f"{u},{i}\n" for u, i, c in counted for _ in range(c))
    )
    columns = generic.Columns(user="listener", count="plays")
    tables = {}
    for name, source, given in (("aggregated", aggregated, columns), ("per_play", per_play, generic.Columns())):
        data = generic.ingest(source, catalog, str(tmp_path / f"data-{name}"), "", columns=given)
        splits.make_split(data, "recall", str(tmp_path / f"split-{name}"), holdout=0.2, engine=LocalEngine())
        tables[name] = [
            storage.read_table(str(tmp_path / f"split-{name}" / f"{part}.parquet")).drop(["timestamp"])
            for part in ("train", *splits.HELDOUT_PARTS)
        ]
    assert data.manifest["ratings"] == sum(c for _, _, c in counted)
    for mine, theirs in zip(tables["aggregated"], tables["per_play"], strict=True):
        assert mine.equals(theirs)
    assert set(tables["aggregated"][0]["label"].to_pylist()) == {1.0, 2.0, 3.0, 4.0}
    for bad, shown in (("0", "0"), ("-2", "-2"), ("", "empty"), ("x", "'x'")):
        source = write_csv(tmp_path / "bad.csv", f"listener,item_id,plays\n3,1,2\n3,2,{bad}\n")
        with pytest.raises(IngestError, match=f"bad.csv, row 2: column 'plays' holds {shown}"):
            generic.ingest(source, catalog, str(tmp_path / "bad"), "", columns=columns)
        assert not (tmp_path / "bad").exists()
    with pytest.raises(IngestError, match="--count-col is for implicit feedback"):
        generic.ingest(
            aggregated,
            catalog,
            str(tmp_path / "bad"),
            "",
            columns=generic.Columns(label="plays", count="plays"),
            rating_scale=(1, 5),
        )


def test_explicit_data_keep_the_rating_threshold(tmp_path):
    ratings = write_csv(
        tmp_path / "r.csv", "user_id,item_id,rating\n" + "".join(f"1,{i},{3.0 if i < 3 else 5.0}\n" for i in range(8))
    )
    catalog = write_csv(tmp_path / "c.csv", "item_id\n" + "".join(f"{i}\n" for i in range(8)))
    data = generic.ingest(
        ratings, catalog, str(tmp_path / "data"), "", columns=generic.Columns(label="rating"), rating_scale=(1, 5)
    )
    document = splits.make_split(data, "recall", str(tmp_path / "split"), holdout=0.0, engine=LocalEngine())
    assert document["positive_threshold"] == splits.scale_threshold((1, 5)) == 3.8  # the top 30% of the declared 1..5
    assert document["sizes"]["train"] == {"rows": 5, "users": 1}  # the three 3.0 ratings are not positives


def test_removing_a_user_changes_only_that_users_train_rows(tmp_path):
    """Neighbouring data sets: the split of the input without one user's rows has the same training
    table minus exactly that user's rows (row-local: no step looks at other users' rows)."""
    users = list(range(3, 40))
    full, catalog = _implicit_tables(tmp_path, users)
    data = generic.ingest(full, catalog, str(tmp_path / "data-full"), "")
    splits.make_split(data, "recall", str(tmp_path / "split-full"), holdout=0.5, engine=LocalEngine())
    full_train = storage.read_table(str(tmp_path / "split-full" / "train.parquet"))
    in_train = set(full_train["user_id"].to_pylist())
    assert 0 < len(in_train) < len(users)  # holdout 0.5: some users train, some are held out
    for removed in (min(in_train), max(in_train), min(set(users) - in_train)):
        neighbour, _ = _implicit_tables(tmp_path, [u for u in users if u != removed])
        data = generic.ingest(neighbour, catalog, str(tmp_path / f"data-{removed}"), "")
        splits.make_split(data, "recall", str(tmp_path / f"split-{removed}"), holdout=0.5, engine=LocalEngine())
        train = storage.read_table(str(tmp_path / f"split-{removed}" / "train.parquet"))
        assert train.equals(full_train.filter(pc.not_equal(full_train["user_id"], removed)))
        assert full_train.num_rows - train.num_rows == (removed + 2 if removed in in_train else 0)


# ---------------------------------------------------------------------------------------------
# Through the command line


def test_cli_ingests_generic_tables(tables, tmp_path, capsys):
    interactions, catalog = tables
    out = tmp_path / "data"
    code = cli.main(
        [
            "ingest",
            "--interactions",
            interactions,
            "--catalog",
            catalog,
            "--user-col",
            "customer",
            "--item-col",
            "product",
            "--timestamp-col",
            "ts",
            "--title-col",
            "name",
            "--features",
            FEATURES,
            "--out",
            str(out),
        ]
    )
    assert code == 0
    printed = capsys.readouterr().out
    assert "feedback implicit" in printed and "layout table" in printed
    data = open_dataset(str(out))
    assert data.manifest["feedback"] == "implicit" and data.manifest["public_features"]["tags"] == "multivalent"
    assert rows(storage.read_table(data.items)) == EXPECTED_ITEMS
    assert validate_interactions(storage.read_table(data.interactions)).num_rows == 4


@pytest.mark.parametrize(
    "extra, message",
    [
        (["--source", "x", "--catalog", "c", "--features", ""], "--source and --interactions are two kinds of input"),
        (["--features", ""], "--interactions needs --catalog"),
        (["--catalog", "c"], "--interactions needs --features"),
    ],
)
def test_cli_flag_combinations_are_argparse_errors(tables, tmp_path, capsys, extra, message):
    interactions, _ = tables
    with pytest.raises(SystemExit) as info:
        cli.main(["ingest", "--interactions", interactions, "--out", str(tmp_path / "out"), *extra])
    assert info.value.code == 2
    assert f"ssp ingest: error: {message}" in capsys.readouterr().err
    assert not (tmp_path / "out").exists()


def test_cli_table_flags_need_interactions(tmp_path, capsys):
    with pytest.raises(SystemExit) as info:
        cli.main(["ingest", "--out", str(tmp_path / "out"), "--label-col", "stars"])
    assert info.value.code == 2
    assert "--label-col describe(s) a generic table: give --interactions" in capsys.readouterr().err
    assert not (tmp_path / "out").exists()


def test_cli_bad_table_is_one_line_error(tables, tmp_path, capsys):
    interactions, catalog = tables
    code = cli.main(
        [
            "ingest",
            "--interactions",
            interactions,
            "--catalog",
            catalog,
            "--features",
            "tags:list",
            "--out",
            str(tmp_path / "out"),
        ]
    )
    assert code == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err[-1].startswith("ssp ingest: error: --features: unknown kind 'list' for column 'tags'")
    assert not os.path.exists(tmp_path / "out")


def test_implicit_feedback_parses_help(capsys):
    with pytest.raises(SystemExit):
        cli.main(["ingest", "--help"])
    text = " ".join(capsys.readouterr().out.split())
    assert "PUBLIC item features" in text and "implicit feedback" in text


def test_numpy_ids_round_trip(tmp_path):
    """uint64 ids beyond int64 are refused with the row; large int64 ids pass unchanged."""
    big = np.iinfo(np.int64).max
    events = tmp_path / "e.parquet"
    pq.write_table(pa.table({"user_id": pa.array([1, 2**63], pa.uint64()), "item_id": [5, 5]}), events)
    catalog = tmp_path / "c.parquet"
    pq.write_table(pa.table({"item_id": [5, big]}), catalog)
    with pytest.raises(
        IngestError,
        match=r"e.parquet, row 2: column 'user_id' holds 9223372036854775808; ids must be integers that fit in 64 bits",
    ):
        generic.ingest(str(events), str(catalog), str(tmp_path / "out"), "")
    pq.write_table(pa.table({"user_id": [big], "item_id": [big]}), events)
    data = generic.ingest(str(events), str(catalog), str(tmp_path / "out"), "")
    assert rows(storage.read_table(data.interactions)) == [
        {"user_id": big, "item_id": big, "label": 1.0, "timestamp": None}
    ]


def test_tables_on_gs(gcs_path, tmp_path):
    """A folder of Parquet parts and a CSV catalog on gs:// (read through the fsspec filesystem)."""
    fs, inner = storage.filesystem(gcs_path)
    for index, table in enumerate((pa.table({"customer": [7, 7]}), pa.table({"customer": [8]}))):
        table = table.append_column("product", pa.array([100, 200][: table.num_rows], pa.int64()))
        local = tmp_path / f"part-{index}.parquet"
        pq.write_table(table, local)
        fs.pipe(f"{inner}/events/part-{index:05d}.parquet", local.read_bytes())
    fs.pipe(f"{inner}/items.csv", b"product,genres\n100,a|b\n200,\n")
    data = generic.ingest(
        f"{gcs_path}/events",
        f"{gcs_path}/items.csv",
        f"{gcs_path}/out",
        "genres:bag",
        columns=generic.Columns(user="customer", item="product"),
    )
    assert rows(storage.read_table(data.interactions)) == [
        {"user_id": 7, "item_id": 100, "label": 1.0, "timestamp": None},
        {"user_id": 7, "item_id": 200, "label": 1.0, "timestamp": None},
        {"user_id": 8, "item_id": 100, "label": 1.0, "timestamp": None},
    ]
    assert rows(storage.read_table(f"{gcs_path}/out/items.parquet")) == [
        {"item_id": 100, "title": None, "genres": ["a", "b"]},
        {"item_id": 200, "title": None, "genres": []},
    ]
    fs.pipe(f"{inner}/bad/part-00000.parquet", (tmp_path / "part-0.parquet").read_bytes())
    with pytest.raises(IngestError, match=rf"{gcs_path}/bad/part-00000.parquet: no column 'user_id'"):
        generic.ingest(
            f"{gcs_path}/bad", f"{gcs_path}/items.csv", f"{gcs_path}/out2", "", columns=generic.Columns(item="product")
        )
