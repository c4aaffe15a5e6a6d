"""The tables of the pipeline: one Arrow schema and one validator each.

A validator takes an Arrow table, checks it against its contract and returns it conformed to the
canonical schema (columns in order, integer/float widths cast safely). A table that breaks the
contract raises `SchemaError` naming the table, the column and the first offending row.

Privacy: interactions, user embeddings and exact counts are private; items are public by
declaration (the `features` metadata names the feature families a run declared public); DP counts,
stats and everything computed from them are released (noised) tables.
"""

from __future__ import annotations

import json

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from schemas.errors import SchemaError

FLOAT_LIST = pa.list_(pa.float64())
STRING_LIST = pa.list_(pa.string())

INTERACTIONS = pa.schema(
    [
        pa.field("user_id", pa.int64(), nullable=False),
        pa.field("item_id", pa.int64(), nullable=False),
        pa.field("label", pa.float64(), nullable=False),
        pa.field("timestamp", pa.int64()),
    ]
)

# Items: the key and a display title, then one column per feature family. The families and their
# kind ("multivalent": list<string>, a bag of values where repeats weigh more; "univalent": one
# int64 or string value, null when unknown) are listed in the schema metadata under b"features".
ITEMS_BASE = pa.schema([pa.field("item_id", pa.int64(), nullable=False), pa.field("title", pa.string())])
MULTIVALENT, UNIVALENT, NUMERIC = "multivalent", "univalent", "numeric"
CATALOG = pa.schema(
    [ITEMS_BASE.field("item_id")]
)  # the keys of an items table: what jobs that only need the catalog read

USER_EMBEDDINGS = pa.schema(
    [pa.field("user_id", pa.int64(), nullable=False), pa.field("embedding", FLOAT_LIST, nullable=False)]
)
ITEM_EMBEDDINGS = pa.schema(
    [pa.field("item_id", pa.int64(), nullable=False), pa.field("embedding", FLOAT_LIST, nullable=False)]
)

# DP item counts: one row per catalog item, noised and floored at 1.
COUNTS = pa.schema([pa.field("item_id", pa.int64(), nullable=False), pa.field("count", pa.float64(), nullable=False)])

# Stats: one row per catalog item; a_upper holds the d(d+1)/2 upper-triangle entries of A_j (row by
# row, diagonal included), b holds b_j. The release parameters live in the file metadata.
STATS = pa.schema(
    [
        pa.field("item_id", pa.int64(), nullable=False),
        pa.field("a_upper", FLOAT_LIST, nullable=False),
        pa.field("b", FLOAT_LIST, nullable=False),
    ]
)
STATS_METADATA_KEYS = ("d", "noise_multiplier", "clip_u", "clip_y", "wbar", "release", "resample")

# The privacy ledger: one row per release, in order. `event` is the JSON description of the
# dp-accounting event the release amounts to; `epsilon_spent` is the run's total after it.
LEDGER = pa.schema(
    [
        pa.field("release", pa.int64(), nullable=False),
        pa.field("name", pa.string(), nullable=False),
        pa.field("event", pa.string(), nullable=False),
        pa.field("noise_multiplier", pa.float64(), nullable=False),
        pa.field("epsilon_spent", pa.float64(), nullable=False),
        pa.field("delta", pa.float64(), nullable=False),
        pa.field("data_fingerprint", pa.string(), nullable=False),
        pa.field("recorded_at", pa.string(), nullable=False),
    ]
)


def items_schema(features: dict[str, str], univalent_types: dict[str, pa.DataType] | None = None) -> pa.Schema:
    """The items schema for the given feature families ({name: kind}), families in the given order."""
    univalent_types = univalent_types or {}
    fields = list(ITEMS_BASE)
    for name, kind in features.items():
        if kind == MULTIVALENT:
            fields.append(pa.field(name, STRING_LIST))
        elif kind == UNIVALENT:
            fields.append(pa.field(name, univalent_types.get(name, pa.int64())))
        elif (
            kind == NUMERIC
        ):  # a number per item (null: unknown), bucketed by the catalog's quantiles (trainer.features)
            fields.append(pa.field(name, pa.float64()))
        else:
            raise SchemaError(
                "items",
                f"feature family kind must be '{MULTIVALENT}', '{UNIVALENT}' or '{NUMERIC}', got {kind!r}",
                name,
            )
    return pa.schema(fields, metadata={b"features": json.dumps(features).encode()})


def item_features(schema: pa.Schema) -> dict[str, str]:
    """The declared feature families ({name: kind}) of an items table."""
    raw = (schema.metadata or {}).get(b"features")
    if raw is None:
        raise SchemaError("items", "metadata has no 'features' entry declaring the public feature families")
    return json.loads(raw)


# ---------------------------------------------------------------------------------------------
# Validators


def validate_interactions(table: pa.Table) -> pa.Table:
    """Interactions: non-null ids and labels, labels finite."""
    table = _conform(table, INTERACTIONS, "interactions")
    _require_finite(table, "label", "interactions")
    return table


def validate_items(table: pa.Table) -> pa.Table:
    """Items: unique non-null item ids, declared feature columns of the declared kinds."""
    features = item_features(table.schema)
    univalent_types = {}
    for name, kind in features.items():
        if name not in table.column_names:
            raise SchemaError("items", "declared feature family is missing", name)
        if kind == UNIVALENT:
            kept = table.schema.field(name).type
            univalent_types[name] = (
                pa.string() if pa.types.is_string(kept) or pa.types.is_large_string(kept) else pa.int64()
            )
    table = _conform(table, items_schema(features, univalent_types), "items")
    _require_unique(table, "item_id", "items")
    for name, kind in features.items():
        if kind == NUMERIC:  # null is unknown; a value is a finite number
            bad = np.flatnonzero(
                pc.fill_null(pc.invert(pc.is_finite(table[name])), False).to_numpy(zero_copy_only=False)
            )
            if bad.size:
                raise SchemaError(
                    "items",
                    f"holds a non-finite number ({table[name][int(bad[0])].as_py()}); leave an unknown value empty",
                    name,
                    int(bad[0]),
                )
    return table


def validate_catalog(table: pa.Table) -> pa.Table:
    """The catalog's keys (an items table, or just its `item_id` column): unique non-null int64 ids."""
    table = _conform(table.select(["item_id"]) if "item_id" in table.column_names else table, CATALOG, "items")
    _require_unique(table, "item_id", "items")
    return table


def validate_user_embeddings(table: pa.Table, dim: int | None = None) -> pa.Table:
    """User embeddings (private): one finite vector of a common length per user."""
    return _validate_embeddings(table, USER_EMBEDDINGS, "user_id", "user embeddings", dim)


def validated_user_batches(batches, dim: int | None = None):
    """User embeddings read as record batches, each yielded as a table validated as
    `validate_user_embeddings` validates the whole (rows counted across the batches), and no id twice
    in the whole once the last is read: the same checks and errors, one batch in memory."""
    ids, at = [], 0
    for batch in batches:
        table = validated_user_batch(batch, dim, at)
        ids.append(table["user_id"].to_numpy())
        at += table.num_rows
        yield table
    if not ids:
        validate_user_embeddings(USER_EMBEDDINGS.empty_table(), dim)
    require_unique_users(np.concatenate(ids) if ids else np.zeros(0, np.int64))


def validated_user_batch(batch: pa.RecordBatch, dim: int | None, at: int) -> pa.Table:
    """A batch of user embeddings as a table validated as `validate_user_embeddings` validates the
    whole, its errors naming rows counted from `at` (the batch's first row in the table)."""
    try:
        return validate_user_embeddings(pa.Table.from_batches([batch]), dim)
    except SchemaError as exc:
        raise SchemaError(exc.table, exc.problem, exc.column, None if exc.row is None else exc.row + at) from None


def require_unique_users(ids: np.ndarray) -> None:
    """Refuses user embeddings that give an id twice (`ids`: the whole table's, in its order)."""
    _require_unique(pa.table({"user_id": ids}), "user_id", "user embeddings")


def validate_item_embeddings(table: pa.Table, dim: int | None = None) -> pa.Table:
    """Item embeddings (released): one finite vector of a common length per item."""
    return _validate_embeddings(table, ITEM_EMBEDDINGS, "item_id", "item embeddings", dim)


def validate_counts(table: pa.Table) -> pa.Table:
    """DP item counts: one finite count >= 1 per item."""
    table = _conform(table, COUNTS, "counts")
    _require_unique(table, "item_id", "counts")
    _require_finite(table, "count", "counts")
    low = pc.less(table["count"], 1.0)
    if pc.any(low).as_py():
        raise SchemaError(
            "counts", f"count {table['count'][_first(low)].as_py()} is below the floor of 1", "count", _first(low)
        )
    return table


def validate_stats(table: pa.Table) -> pa.Table:
    """Stats: one row per item, release parameters in the metadata, packed sizes matching d."""
    meta = stats_metadata(table.schema)
    metadata = table.schema.metadata
    table = _conform(table, STATS, "stats").replace_schema_metadata(metadata)
    _require_unique(table, "item_id", "stats")
    d = int(meta["d"])
    _require_list_length(table, "a_upper", d * (d + 1) // 2, "stats")
    _require_list_length(table, "b", d, "stats")
    _require_finite(table, "a_upper", "stats")
    _require_finite(table, "b", "stats")
    return table


def stats_metadata(schema: pa.Schema) -> dict[str, float]:
    """The release parameters stored in a stats table's metadata, as numbers."""
    raw = schema.metadata or {}
    missing = [key for key in STATS_METADATA_KEYS if key.encode() not in raw]
    if missing:
        raise SchemaError("stats", f"metadata lacks {', '.join(missing)}")
    values = {key: float(raw[key.encode()]) for key in STATS_METADATA_KEYS}
    values["bias"] = float(
        raw.get(b"bias", b"0")
    )  # 1: the last coordinate is the bias coordinate (absent before biases: 0)
    if values["d"] < 1 or values["d"] != int(values["d"]):
        raise SchemaError("stats", f"metadata d must be a positive integer, got {values['d']}")
    return values


def validate_ledger(table: pa.Table) -> pa.Table:
    """Ledger: releases numbered 0, 1, 2, ... in order, with a parseable event each."""
    table = _conform(table, LEDGER, "ledger")
    releases = table["release"].to_numpy()
    wrong = np.flatnonzero(releases != np.arange(len(releases)))
    if wrong.size:
        raise SchemaError(
            "ledger", f"release numbers must run 0, 1, 2, ...; found {releases[wrong[0]]}", "release", int(wrong[0])
        )
    for row, event in enumerate(table["event"].to_pylist()):
        try:
            json.loads(event)
        except json.JSONDecodeError as exc:
            raise SchemaError("ledger", f"event is not JSON ({exc})", "event", row) from None
    return table


# ---------------------------------------------------------------------------------------------
# Checks shared by the validators


def _validate_embeddings(table: pa.Table, schema: pa.Schema, key: str, name: str, dim: int | None) -> pa.Table:
    table = _conform(table, schema, name)
    _require_unique(table, key, name)
    lengths = pc.list_value_length(table["embedding"]).to_numpy(zero_copy_only=False)
    if len(lengths):
        expected = dim if dim is not None else int(lengths[0])
        _require_list_length(table, "embedding", expected, name)
    elif dim is not None and dim < 1:
        raise SchemaError(name, f"dimension must be positive, got {dim}")
    _require_finite(table, "embedding", name)
    return table


def _conform(table: pa.Table, schema: pa.Schema, name: str) -> pa.Table:
    """Select the schema's columns in order, cast each safely, and reject nulls in non-null fields."""
    if not isinstance(table, pa.Table):
        raise SchemaError(name, f"expected an Arrow table, got {type(table).__name__}")
    columns = []
    for field in schema:
        if field.name not in table.column_names:
            raise SchemaError(name, f"missing column (have {', '.join(table.column_names) or 'none'})", field.name)
        column = table[field.name]
        if column.type != field.type:
            try:
                column = column.cast(field.type, safe=True)
            except (pa.ArrowInvalid, pa.ArrowNotImplementedError) as exc:
                raise SchemaError(name, f"has type {column.type}, expected {field.type} ({exc})", field.name) from None
        if not field.nullable and column.null_count:
            raise SchemaError(name, "is null", field.name, _first(pc.is_null(column)))
        columns.append(column)
    metadata = table.schema.metadata or schema.metadata
    return pa.Table.from_arrays(
        columns, schema=schema.with_metadata(metadata) if metadata else schema.remove_metadata()
    )


def _first(mask) -> int:
    """Index of the first True in a boolean Arrow array or chunked array."""
    return int(np.flatnonzero(np.asarray(mask.to_numpy(zero_copy_only=False), dtype=bool))[0])


def _require_finite(table: pa.Table, column: str, name: str) -> None:
    values = table[column]
    if pa.types.is_list(values.type):
        values = pa.chunked_array([chunk.flatten() for chunk in values.chunks], type=pa.float64())
        flat = values.to_numpy()
        bad = np.flatnonzero(~np.isfinite(flat))
        if bad.size:
            offsets = np.concatenate(
                [[0], np.cumsum(pc.list_value_length(table[column]).to_numpy(zero_copy_only=False))]
            )
            row = int(np.searchsorted(offsets, bad[0], side="right") - 1)
            raise SchemaError(name, f"holds a non-finite value ({flat[bad[0]]})", column, row)
        return
    flat = values.to_numpy(zero_copy_only=False)
    bad = np.flatnonzero(~np.isfinite(flat))
    if bad.size:
        raise SchemaError(name, f"is not finite ({flat[bad[0]]})", column, int(bad[0]))


def _require_unique(table: pa.Table, column: str, name: str) -> None:
    keys = table[column].to_numpy()
    order = np.argsort(keys, kind="stable")
    repeated = np.flatnonzero(keys[order][1:] == keys[order][:-1])
    if repeated.size:
        rows = np.sort(order[repeated + 1])
        raise SchemaError(name, f"value {keys[rows[0]]} appears more than once", column, int(rows[0]))


def _require_list_length(table: pa.Table, column: str, expected: int, name: str) -> None:
    lengths = pc.list_value_length(table[column]).to_numpy(zero_copy_only=False)
    bad = np.flatnonzero(lengths != expected)
    if bad.size:
        raise SchemaError(name, f"has length {lengths[bad[0]]}, expected {expected}", column, int(bad[0]))
