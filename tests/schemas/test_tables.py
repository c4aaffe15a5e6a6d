"""Table contracts: valid tables pass unchanged, and each kind of breakage names its column and row."""

import json

import numpy as np
import pyarrow as pa
import pytest

from schemas import SchemaError
from schemas import tables as t

TABLES = ["interactions", "items", "user_embeddings", "item_embeddings", "counts", "stats", "ledger"]


@pytest.mark.parametrize("name", TABLES)
def test_valid_tables_pass_and_keep_metadata(sample_tables, name):
    table, validate = sample_tables[name]
    out = validate(table)
    assert out.equals(table)
    assert out.schema.metadata == table.schema.metadata


def _replace(table, column, values):
    index = table.column_names.index(column)
    return table.set_column(
        index, pa.field(column, table.schema.field(column).type), pa.array(values, table.schema.field(column).type)
    )


def test_interactions_are_conformed_from_narrower_types():
    narrow = pa.table(
        {
            "timestamp": pa.array([5], pa.int32()),
            "label": pa.array([3.5], pa.float32()),
            "item_id": pa.array([2], pa.int32()),
            "user_id": pa.array([1], pa.int16()),
        }
    )
    out = t.validate_interactions(narrow)
    assert out.schema.remove_metadata() == t.INTERACTIONS.remove_metadata()
    assert out.to_pylist() == [{"user_id": 1, "item_id": 2, "label": 3.5, "timestamp": 5}]


@pytest.mark.parametrize(
    "label, message",
    [
        (float("nan"), "column 'label', row 1: is not finite (nan)"),
        (float("inf"), "column 'label', row 1: is not finite (inf)"),
        (None, "column 'label', row 1: is null"),
    ],
)
def test_interactions_reject_bad_labels_naming_row(sample_tables, label, message):
    table, _ = sample_tables["interactions"]
    with pytest.raises(SchemaError, match=message.replace("(", r"\(").replace(")", r"\)")) as info:
        t.validate_interactions(_replace(table, "label", [4.0, label, 5.0]))
    assert (info.value.column, info.value.row) == ("label", 1)


def test_missing_column_and_wrong_type_are_named(sample_tables):
    table, _ = sample_tables["interactions"]
    with pytest.raises(SchemaError, match="interactions: column 'item_id': missing column"):
        t.validate_interactions(table.drop(["item_id"]))
    as_text = table.set_column(2, "label", pa.array(["4", "x", "5"]))
    with pytest.raises(SchemaError, match="column 'label': has type string, expected double"):
        t.validate_interactions(as_text)


def test_items_require_unique_ids_and_declared_features(sample_tables):
    items, _ = sample_tables["items"]
    with pytest.raises(SchemaError, match="items: column 'item_id', row 2: value 1 appears more than once"):
        t.validate_items(_replace(items, "item_id", [1, 2, 1]))
    with pytest.raises(SchemaError, match="column 'year': declared feature family is missing"):
        t.validate_items(items.drop(["year"]))
    with pytest.raises(SchemaError, match="no 'features' entry"):
        t.validate_items(items.replace_schema_metadata(None))
    assert t.item_features(items.schema) == {"genres": "multivalent", "year": "univalent"}


def test_items_schema_rejects_unknown_kind():
    with pytest.raises(SchemaError, match="kind must be"):
        t.items_schema({"genres": "bag"})


def test_embeddings_need_one_length_and_finite_values(sample_tables):
    table, _ = sample_tables["user_embeddings"]
    with pytest.raises(SchemaError, match="column 'embedding', row 1: has length 3, expected 2"):
        t.validate_user_embeddings(_replace(table, "embedding", [[0.1, 0.2], [0.3, 0.4, 0.5]]))
    with pytest.raises(SchemaError, match="column 'embedding', row 1: holds a non-finite value"):
        t.validate_user_embeddings(_replace(table, "embedding", [[0.1, 0.2], [np.nan, 0.4]]))
    with pytest.raises(SchemaError, match="has length 2, expected 3"):
        t.validate_user_embeddings(table, dim=3)


def test_user_ids_from_batches_refuse_what_the_whole_table_refuses_at_the_same_row():
    """validated_user_batches reads the table a batch at a time: a bad row in a later batch, and an id
    repeated across batches, get the error validate_user_embeddings gives the whole table."""
    ids = np.array([5, 3, 9, 7, 1], np.int64)

    def both(embedding, user_ids=ids):
        whole = pa.table({"user_id": user_ids, "embedding": embedding})
        errors = []
        for check in (
            lambda: t.validate_user_embeddings(whole, 2),
            lambda: list(t.validated_user_batches(whole.to_batches(2), 2)),
        ):
            with pytest.raises(SchemaError) as caught:
                check()
            errors.append(str(caught.value))
        return errors

    good = [[0.1, 0.2]] * 5
    batches = t.validated_user_batches(pa.table({"user_id": ids, "embedding": good}).to_batches(2), 2)
    assert [int(i) for table in batches for i in table["user_id"].to_numpy()] == list(ids)
    bad_length, bad_value = (both(good[:3] + [row] + good[4:]) for row in ([0.1], [np.inf, 0.0]))
    assert bad_length[0] == bad_length[1] and "row 3: has length 1, expected 2" in bad_length[0]
    assert bad_value[0] == bad_value[1] and "row 3: holds a non-finite value" in bad_value[0]
    repeated = both(good, np.array([5, 3, 9, 3, 1], np.int64))  # 3 in the first batch and the second
    assert repeated[0] == repeated[1] and "row 3: value 3 appears more than once" in repeated[0]


def test_counts_floor(sample_tables):
    table, _ = sample_tables["counts"]
    with pytest.raises(SchemaError, match="counts: column 'count', row 2: count 0.5 is below the floor of 1"):
        t.validate_counts(_replace(table, "count", [1.0, 2.0, 0.5]))


def test_stats_sizes_follow_d_from_metadata(sample_tables):
    table, _ = sample_tables["stats"]
    assert t.stats_metadata(table.schema)["d"] == 2.0
    with pytest.raises(SchemaError, match="column 'a_upper', row 0: has length 4, expected 3"):
        t.validate_stats(_replace(table, "a_upper", [[1.0, 0.5, 2.0, 9.0], [0.0, 0.0, 0.0]]))
    meta = dict(table.schema.metadata)
    del meta[b"wbar"], meta[b"clip_u"]
    with pytest.raises(SchemaError, match="stats: metadata lacks clip_u, wbar"):
        t.validate_stats(table.replace_schema_metadata(meta))


def test_ledger_numbering_and_events(sample_tables):
    table, _ = sample_tables["ledger"]
    with pytest.raises(
        SchemaError, match="ledger: column 'release', row 1: release numbers must run 0, 1, 2, ...; found 2"
    ):
        t.validate_ledger(_replace(table, "release", [0, 2]))
    with pytest.raises(SchemaError, match="column 'event', row 0: event is not JSON"):
        t.validate_ledger(_replace(table, "event", ["{", json.dumps({})]))
