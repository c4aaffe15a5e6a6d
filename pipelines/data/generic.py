"""`ssp ingest --interactions TABLE --catalog TABLE`: any interactions table and item catalog into the
canonical data set folder (not only MovieLens).

Reads a table of (user, item[, label][, time]) rows and a catalog of items, in Parquet or CSV (a
file or a folder of parts), on a local disk or gs://, with the columns named as they are in the
table; interactions are streamed in record batches, the catalog is read whole. Ids are integers
or text (a text catalog numbered in key order, its map public; a text user id hashed alone, so that
each user's id depends on its own only); without a label column the data are implicit feedback (every row a positive, label 1.0,
or the count column's number of times the pair met),
with one the labels must lie on the declared `rating_scale`; timestamps become int64 epoch seconds;
catalog features are declared with their kind (`bag`, `value`, `number`). Every check refuses the
input naming the file, the column, the row and the value. docs/own-data.md ("Your own tables") has
every rule.

Privacy: the interactions table is private user data. The catalog's declared feature columns (and
the title) are declared PUBLIC by the run (`--features`) and the manifest records the declaration:
declare only columns that no user wrote (a column derived from users' behaviour, such as a
popularity or a tag list written by users, is not public). User ids are mapped user by user (a
text id by a hash of itself alone), item keys from the public catalog: removing a user from the log
removes exactly its rows.
"""

from __future__ import annotations

import hashlib
import math
import posixpath
import re
import sys
from collections.abc import Iterator
from dataclasses import asdict, dataclass

import numpy as np
import pandas as pd
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.csv as pacsv
import pyarrow.dataset as ds
import pyarrow.fs as pafs
from schemas.progress import bar as progress_bar

from pipelines.base import logs
from pipelines.data.datasets import Dataset, write_dataset
from pipelines.data.movielens import IngestError
from schemas import SchemaError, storage
from schemas.errors import UserError
from schemas.tables import MULTIVALENT, NUMERIC, UNIVALENT, items_schema, validate_interactions, validate_items

FEATURE_KINDS = {"bag": MULTIVALENT, "value": UNIVALENT, "number": NUMERIC}
FORMATS = {".parquet": "parquet", ".csv": "csv"}
BAG_SEPARATOR = "|"
UNKNOWN_ITEM_POLICIES = ("fail", "drop")
RESERVED = ("item_id", "title")  # the canonical items columns: no feature family may take their names
BATCH_SIZE = 1 << 16
DECIMAL = r"^[+-]?[0-9]+$"  # a text id that is an integer
_TO_SECONDS = {"s": 1, "ms": 10**3, "us": 10**6, "ns": 10**9}


@dataclass(frozen=True)
class Columns:
    """Which columns of the input tables hold what. `label` None: implicit feedback, where `count`
    (None: 1 per row) is how many times a row's user and item met. The catalog's item ids are in
    its `item` column, as in the interactions table."""

    user: str = "user_id"
    item: str = "item_id"
    label: str | None = None
    count: str | None = None
    timestamp: str | None = None
    title: str | None = None


def parse_features(spec: str) -> dict[str, str]:
    """The feature declaration `name:kind,...` (kind `bag`, `value` or `number`) as {column:
    multivalent, univalent or numeric}, in the given order; an empty spec declares no feature."""
    features: dict[str, str] = {}
    for entry in (part.strip() for part in spec.split(",")):
        if not entry:
            continue
        name, colon, kind = (text.strip() for text in entry.rpartition(":"))
        if not colon or not name:
            raise IngestError(
                f"--features: {entry!r} must be COLUMN:KIND with KIND bag (a list of values), value "
                "(one category per item) "
                "or number (a quantity per item)"
            )
        if kind not in FEATURE_KINDS:
            raise IngestError(
                f"--features: unknown kind {kind!r} for column {name!r}; use bag (a list of values, "
                "e.g. genres), value (one "
                "category per item, e.g. brand) or number (a quantity per item, e.g. price)"
            )
        if name in features:
            raise IngestError(f"--features: column {name!r} is declared twice")
        if name in RESERVED:
            raise IngestError(
                f"--features: {name!r} is the name of a canonical items column "
                f"({', '.join(RESERVED)}); rename the column"
            )
        features[name] = FEATURE_KINDS[kind]
    return features


# ---------------------------------------------------------------------------------------------
# Reading tables


@dataclass(frozen=True)
class _Part:
    """Where a batch comes from, for error messages: a data file, whether it is CSV (its columns read
    as text), and the 1-based row number of the batch's first row (header not counted)."""

    file: str
    csv: bool
    row: int = 1

    def at(self, offset: int) -> str:
        return f"{self.file}, row {self.row + offset}"


def _arrow_fs(fs) -> pafs.FileSystem:
    return pafs.LocalFileSystem() if storage.is_local(fs) else pafs.PyFileSystem(pafs.FSSpecHandler(fs))


def _files(path: str) -> tuple[object, list[str], str]:
    """(filesystem, data files inside it, format) of a table: one `.parquet` or `.csv` file, or a
    folder of them (hidden and `_` files skipped; a folder with a `_SUCCESS` list of its parts is read
    by that list)."""
    fs, inner = storage.filesystem(path)
    fs.invalidate_cache()
    if fs.isfile(inner):
        files = [inner]
    elif fs.isdir(inner):
        if fs.exists(posixpath.join(inner, storage.SUCCESS)):
            files = [storage.filesystem(f)[1] for f in storage.table_files(path)]
        else:
            found = sorted(fs.find(inner))
            files = [
                f
                for f in found
                if not any(part.startswith((".", "_")) for part in posixpath.relpath(f, inner).split("/"))
            ]
            files = [f for f in files if posixpath.splitext(f)[1].lower() in FORMATS]
        if not files:
            raise IngestError(f"{path}: the folder holds no .parquet or .csv files")
    else:
        raise IngestError(f"{path}: no such file or folder")
    formats = {FORMATS.get(posixpath.splitext(f)[1].lower()) for f in files}
    if None in formats:
        raise IngestError(f"{path}: cannot tell the format; name the file .parquet or .csv")
    if len(formats) > 1:
        raise IngestError(f"{path}: the folder mixes .parquet and .csv files; give one format")
    return fs, files, formats.pop()


def _table_batches(path: str, columns: list[str]) -> Iterator[tuple[_Part, pa.RecordBatch]]:
    """(where, batch) of `columns` for every record batch of a table, file by file, after checking
    that each file has those columns. CSV columns are read as text (empty = null) and converted by
    the callers, so a bad value is reported with its column and row."""
    columns = list(dict.fromkeys(columns))
    fs, files, kind = _files(path)
    if kind == "csv":
        convert = pacsv.ConvertOptions(
            column_types={name: pa.string() for name in columns}, null_values=[""], strings_can_be_null=True
        )
        file_format = ds.CsvFileFormat(convert_options=convert, read_options=pacsv.ReadOptions(block_size=1 << 24))
    else:
        file_format = ds.ParquetFileFormat()
    try:
        dataset = ds.dataset(files, format=file_format, filesystem=_arrow_fs(fs))
    except (pa.ArrowInvalid, OSError) as exc:
        if isinstance(exc, FileNotFoundError):
            raise
        raise IngestError(f"{path} cannot be read as {kind.upper()}: {' '.join(str(exc).split())}") from None
    _, root = storage.filesystem(path)
    for fragment in dataset.get_fragments():
        inner = fragment.path
        if len(files) == 1 and inner == root:
            file = path
        else:
            file = inner if storage.is_local(fs) else storage.join(path, posixpath.relpath(inner, root))
        part = _Part(file, kind == "csv")
        try:
            have = fragment.physical_schema.names
            missing = [name for name in columns if name not in have]
            if missing:
                raise IngestError(
                    f"{file}: no column {missing[0]!r} (its columns: {', '.join(have) or 'none'}); "
                    "name the right column with the ingest flags"
                )
            for batch in fragment.to_batches(columns=columns, batch_size=BATCH_SIZE, use_threads=False):
                if batch.num_rows:
                    yield part, batch
                    part = _Part(file, part.csv, part.row + batch.num_rows)
        except (pa.ArrowInvalid, OSError) as exc:
            if isinstance(exc, FileNotFoundError):
                raise
            raise IngestError(f"{file} cannot be read as {kind.upper()}: {' '.join(str(exc).split())}") from None


def _first(mask) -> int:
    return int(np.flatnonzero(np.asarray(mask, dtype=bool))[0])


def _is_text(kind: pa.DataType) -> bool:
    return pa.types.is_string(kind) or pa.types.is_large_string(kind)


def _decoded(column: pa.Array) -> pa.Array:
    return column.dictionary_decode() if pa.types.is_dictionary(column.type) else column


# ---------------------------------------------------------------------------------------------
# Column conversions (each error names the file, the row and the column as the input names it)


def _refuse_empty(empty: pa.Array, name: str, part: _Part) -> None:
    """Refuse an id column where `empty` (null, or blank text) holds, naming the first such row."""
    mask = empty.to_numpy(zero_copy_only=False)
    if mask.any():
        raise IngestError(f"{part.at(_first(mask))}: column {name!r} is empty; every row needs an id")


def _ids(column: pa.Array, name: str, part: _Part) -> pa.Array:
    """An id column as int64: an integer type, or (CSV) text holding integers."""
    column = _decoded(column)
    text = part.csv and _is_text(column.type)
    if not (text or pa.types.is_integer(column.type)):
        raise IngestError(
            f"{part.file}: column {name!r} has type {column.type}; ids must be integers or text"
        )
    _refuse_empty(column.is_null(), name, part)
    if text:
        column = pc.utf8_trim_whitespace(column)
        decimal = pc.match_substring_regex(column, DECIMAL).to_numpy(zero_copy_only=False)
        if not decimal.all():  # Arrow's cast would also read 0x10: an id is read one way, whatever the batch
            row = int(np.flatnonzero(~decimal)[0])
            raise IngestError(
                f"{part.at(row)}: column {name!r} holds {column[row].as_py()!r}; ids must be integers that fit in "
                "64 bits (or text)"
            )
    try:
        return column.cast(pa.int64())
    except pa.ArrowInvalid:
        values = column.to_pylist()
        row = next(
            (
                i
                for i, value in enumerate(values)
                if not (isinstance(value, int) or _parses(value, int)) or not -(2**63) <= int(value) < 2**63
            ),
            0,
        )
        raise IngestError(
            f"{part.at(row)}: column {name!r} holds {values[row]!r}; ids must be integers that fit in "
            "64 bits "
            "(map the ids to 64-bit integers before ingesting)"
        ) from None


def _text_ids(column: pa.Array, name: str, part: _Part) -> pa.Array:
    """An id column as text keys (trimmed in CSV); an integer column as its decimal text."""
    column = _decoded(column)
    if pa.types.is_integer(column.type):
        column = column.cast(pa.string())
    elif not _is_text(column.type):
        raise IngestError(f"{part.file}: column {name!r} has type {column.type}; ids must be integers or text")
    _refuse_empty(column.is_null(), name, part)
    column = pc.utf8_trim_whitespace(column) if part.csv else column
    _refuse_empty(pc.equal(column, ""), name, part)
    return column


def user_key_id(key: str) -> int:
    """The 64-bit id of a text user id that is not a decimal integer: a hash of that id alone, so
    each user's id depends on nothing but its own (two ids sharing a hash, about 1 in 2^64 a pair,
    would train as one user, whose whole contribution is still bounded)."""
    return int.from_bytes(hashlib.blake2b(key.encode(), digest_size=8, person=b"ssp-user-id").digest(), "big", signed=True)


def _user_ids(column: pa.Array, name: str, part: _Part) -> tuple[pa.Array, pa.Array | None]:
    """(int64 user ids, each row's text id where it was hashed, else null; None: no text id): integers
    as they are, a text id that is a decimal integer within 64 bits as that integer (as a batch of
    such ids alone would be read), any other text id by `user_key_id`."""
    try:
        return _ids(column, name, part), None
    except IngestError:
        if not _is_text(_decoded(column).type):
            raise
    text = _text_ids(column, name, part)
    distinct = pc.unique(text)
    keys = distinct.to_pylist()
    integer = [bool(re.fullmatch(DECIMAL, key)) and -(2**63) <= int(key) < 2**63 for key in keys]
    values = [int(key) if whole else user_key_id(key) for key, whole in zip(keys, integer, strict=True)]
    at = pc.index_in(text, distinct).to_numpy()
    hashed = ~np.array(integer, bool)[at]
    return pa.array(np.array(values, np.int64)[at]), pc.if_else(pa.array(hashed), text, None)


def _parses(text: str, convert) -> bool:
    """Whether `convert` (int, float) reads `text`."""
    try:
        convert(text)
    except (TypeError, ValueError):
        return False
    return True


def _labels(column: pa.Array, name: str, part: _Part) -> pa.Array:
    """A label column as float64: a numeric type, or (CSV) text holding numbers."""
    column = _decoded(column)
    if part.csv and _is_text(column.type):
        try:
            return pc.utf8_trim_whitespace(column).cast(pa.float64())
        except pa.ArrowInvalid:
            values = column.to_pylist()
            row = next((i for i, value in enumerate(values) if value is not None and not _parses(value, float)), 0)
            raise IngestError(
                f"{part.at(row)}: column {name!r} holds {values[row]!r}; labels must be numbers"
            ) from None
    if pa.types.is_integer(column.type) or pa.types.is_floating(column.type) or pa.types.is_decimal(column.type):
        return column.cast(pa.float64())
    raise IngestError(f"{part.file}: column {name!r} has type {column.type}; labels must be numbers")


def _counts(column: pa.Array, name: str, part: _Part) -> pa.Array:
    """A count column (implicit feedback) as float64 numbers >= 1, each row's weight in rows of one."""
    counts = _labels(column, name, part)
    values = counts.to_numpy(zero_copy_only=False)
    bad = np.flatnonzero(~(values >= 1) | ~np.isfinite(values))  # NaN (a null) fails both
    if bad.size:
        shown = "empty" if counts[int(bad[0])].as_py() is None else f"{values[bad[0]]:g}"
        raise IngestError(
            f"{part.at(int(bad[0]))}: column {name!r} holds {shown}; a count must be a number >= 1 (how many "
            "times the user met the item; drop the rows of items never met)"
        )
    return counts


# seconds, ISO 8601 (UTC), ISO 8601 with an offset
_TEXT_TIMES = (pa.int64(), pa.timestamp("ns"), pa.timestamp("ns", tz="UTC"))


def _timestamps(column: pa.Array, name: str, part: _Part) -> pa.Array:
    """A timestamp column as int64 seconds since 1970 (null: unknown). Integer types are seconds;
    Arrow timestamps of any unit are floored to seconds; CSV text is integer seconds or ISO 8601."""
    column = _decoded(column)
    if part.csv and _is_text(column.type):
        text = pc.utf8_trim_whitespace(column)
        for target in _TEXT_TIMES:
            try:
                column = text.cast(target)
                break
            except pa.ArrowInvalid:
                continue
        else:
            values = text.to_pylist()
            first = next((value for value in values if value is not None and _time_form(value) is not None), None)
            form = _time_form(first) if first is not None else None
            row = next(
                (
                    i
                    for i, value in enumerate(values)
                    if value is not None and (_time_form(value) if form is None else _time_form(value, form)) is None
                ),
                0,
            )
            raise IngestError(
                f"{part.at(row)}: column {name!r} holds {values[row]!r}; a timestamp must be integer "
                "seconds since 1970 "
                "or an ISO 8601 date-time, in one form throughout the column"
                + (f" (earlier rows hold {first!r})" if first is not None else "")
            )
    kind = column.type
    if pa.types.is_integer(kind):
        try:
            return column.cast(pa.int64())
        except pa.ArrowInvalid:
            raise IngestError(
                f"{part.file}: column {name!r} holds a timestamp that does not fit in a 64-bit integer"
            ) from None
    if pa.types.is_timestamp(kind):
        raw = column.cast(pa.timestamp(kind.unit)).cast(pa.int64())  # the time zone only changes how it prints
        seconds = np.floor_divide(raw.fill_null(0).to_numpy(), _TO_SECONDS[kind.unit])
        return pa.array(seconds, pa.int64(), mask=raw.is_null().to_numpy(zero_copy_only=False))
    raise IngestError(
        f"{part.file}: column {name!r} has type {kind}; a timestamp must be integer seconds since 1970 "
        "or an Arrow timestamp"
    )


def _time_form(text: str, form: pa.DataType | None = None) -> pa.DataType | None:
    """The first of the text forms (or just `form`) that `text` parses as; None if none does."""
    for target in _TEXT_TIMES if form is None else (form,):
        try:
            pa.array([text]).cast(target)
            return target
        except pa.ArrowInvalid:
            continue
    return None


def _bag(column: pa.Array, name: str, part: _Part) -> pa.Array:
    """A bag (multivalent) column as list<string>: a list column, or text of values separated by
    `|`; values are trimmed, empty values dropped, null means no values."""
    column = _decoded(column)
    kind = column.type
    if _is_text(kind):
        column = pc.split_pattern(column, BAG_SEPARATOR)
    elif not (pa.types.is_list(kind) or pa.types.is_large_list(kind)):
        raise IngestError(
            f"{part.file}: bag column {name!r} has type {kind}; give a list of strings or a text of "
            "values separated by "
            f"'{BAG_SEPARATOR}', or declare it a value (one value per item)"
        )
    try:
        lists = column.cast(pa.list_(pa.string()))
    except (pa.ArrowInvalid, pa.ArrowNotImplementedError):
        raise IngestError(
            f"{part.file}: bag column {name!r} has type {kind}, whose values cannot be read as text"
        ) from None
    values = pc.utf8_trim_whitespace(pc.list_flatten(lists))
    parents = pc.list_parent_indices(lists).to_numpy()
    keep = np.asarray(
        pc.fill_null(pc.greater(pc.utf8_length(values), 0), False).to_numpy(zero_copy_only=False), dtype=bool
    )
    counts = np.bincount(parents[keep], minlength=len(lists))
    offsets = np.concatenate([[0], np.cumsum(counts)]).astype(np.int32)
    return pa.ListArray.from_arrays(pa.array(offsets, pa.int32()), values.filter(pa.array(keep)))


def _as_floats(column: pa.Array, name: str, part: _Part, strict: bool) -> pa.Array | None:
    """A column of numbers (an integer, floating or decimal type; in CSV, text) as float64, NaN as
    null. A value that is not a number: an error naming its row when `strict`, else None."""
    column = _decoded(column)
    kind = column.type
    text = part.csv and _is_text(kind)
    if not (text or pa.types.is_integer(kind) or pa.types.is_floating(kind) or pa.types.is_decimal(kind)):
        if strict:
            raise IngestError(
                f"{part.file}: number column {name!r} has type {kind}; give numbers (a price, a "
                "duration), or declare it a value"
            )
        return None
    source = pc.utf8_trim_whitespace(column) if text else column
    try:
        floats = source.cast(pa.float64())
    except (pa.ArrowInvalid, pa.ArrowNotImplementedError):
        if not strict:
            return None
        for offset, value in enumerate(source.to_pylist()):
            try:
                pa.array([value]).cast(pa.float64())
            except (pa.ArrowInvalid, pa.ArrowNotImplementedError):
                raise IngestError(
                    f"{part.at(offset)}: number column {name!r} holds {value!r}, not a number (leave "
                    "an unknown value empty)"
                ) from None
        raise IngestError(f"{part.file}: number column {name!r} cannot be read as numbers") from None
    floats = pc.if_else(pc.is_nan(floats), pa.scalar(None, pa.float64()), floats)
    infinite = np.flatnonzero(pc.fill_null(pc.is_inf(floats), False).to_numpy(zero_copy_only=False))
    if infinite.size:
        raise IngestError(
            f"{part.at(int(infinite[0]))}: {name!r} holds {floats[int(infinite[0])].as_py()}, not a finite number"
        )
    return floats


def _numbers(chunks: list[tuple[_Part, pa.Array]], name: str) -> list[pa.Array]:
    """The chunks of a number column as float64 (null: unknown)."""
    return [_as_floats(column, name, part, strict=True) for part, column in chunks]


def _values(chunks: list[tuple[_Part, pa.Array]], name: str) -> list[pa.Array]:
    """The chunks of a value (univalent) column, as one type whatever the file format: int64 when
    every value is a whole number (an integer type, whole floats, in CSV text of numbers), text
    otherwise, numbers written by one rule (Arrow's float to text); null (and NaN) means unknown."""
    chunks = [(part, _decoded(column)) for part, column in chunks]
    for part, column in chunks:
        kind = column.type
        if pa.types.is_nested(kind) or pa.types.is_binary(kind) or pa.types.is_large_binary(kind):
            raise IngestError(
                f"{part.file}: value column {name!r} has type {kind}, which is not one value per item; "
                "declare a list column a bag"
            )
    as_ints = []
    for part, column in chunks:  # integers first, exactly (ids beyond 2^53 are not floats)
        source = pc.utf8_trim_whitespace(column) if part.csv and _is_text(column.type) else column
        if not (pa.types.is_integer(source.type) or (part.csv and _is_text(source.type))):
            break
        try:
            as_ints.append(source.cast(pa.int64()))
        except pa.ArrowInvalid:
            break
    else:
        return as_ints
    floats = [_as_floats(column, name, part, strict=False) for part, column in chunks]
    # every value a number: whole numbers as int64, the rest as one text rule
    if all(chunk is not None for chunk in floats):
        flat = np.concatenate([chunk.to_numpy(zero_copy_only=False) for chunk in floats]) if floats else np.zeros(0)
        known = flat[np.isfinite(flat)]
        if np.all(known == np.round(known)) and np.all(np.abs(known) < 2.0**53):
            return [chunk.cast(pa.int64()) for chunk in floats]
        return [chunk.cast(pa.string()) for chunk in floats]
    out = []
    for part, column in chunks:
        try:
            text = column.cast(pa.string())
        except (pa.ArrowInvalid, pa.ArrowNotImplementedError):
            raise IngestError(
                f"{part.file}: value column {name!r} has type {column.type}, which cannot be read as text"
            ) from None
        if part.csv:
            text = pc.utf8_trim_whitespace(text)
            several = np.flatnonzero(
                pc.fill_null(pc.match_substring(text, BAG_SEPARATOR), False).to_numpy(zero_copy_only=False)
            )
            if several.size:
                raise IngestError(
                    f"{part.at(int(several[0]))}: value column {name!r} holds "
                    f"{text[int(several[0])].as_py()!r}, several values "
                    f"separated by '{BAG_SEPARATOR}'; declare the column a bag ({name}:bag)"
                )
        out.append(text)
    return out


# ---------------------------------------------------------------------------------------------
# Catalog and interactions


def _declared(features: dict[str, str] | str) -> dict[str, str]:
    """A feature declaration as {column: multivalent, univalent or numeric}: the spec
    `genres:bag,year:value,price:number` or a dict of kinds (bag/value/number or their schema names)."""
    if isinstance(features, str):
        return parse_features(features)
    spec = ",".join(
        f"{name}:{next((k for k, v in FEATURE_KINDS.items() if v == kind), kind)}" for name, kind in features.items()
    )
    return parse_features(spec)


def _title(column: pa.Array, name: str, part: _Part) -> pa.Array:
    try:
        return column.cast(pa.string())
    except (pa.ArrowInvalid, pa.ArrowNotImplementedError):
        raise IngestError(
            f"{part.file}: title column {name!r} has type {column.type}, which cannot be read as text"
        ) from None


def _catalog_ids(chunks: list[tuple[_Part, pa.Array]], name: str, catalog: str) -> tuple[pa.ChunkedArray, pa.Array | None]:
    """(item ids, the sorted text keys or None): integer ids as they are; text ids (any that is not
    an integer) numbered 1..m in their sorted order, the catalog being public."""
    try:
        return pa.chunked_array([_ids(column, name, part) for part, column in chunks], pa.int64()), None
    except IngestError as why:
        if not all(_is_text(_decoded(column).type) for _, column in chunks):
            raise
        text = pa.chunked_array([_text_ids(column, name, part) for part, column in chunks], pa.string())
        first = str(why).split(";")[0]  # where the first id that is not an integer is, without the refusal's rule
        logs.log(f"{catalog}: item ids read as text keys, numbered in their sorted order ({first})")
    keys = pc.unique(text).sort()
    if len(keys) < len(text):
        counts = pc.value_counts(text)
        repeated = counts.filter(pc.greater(counts.field("counts"), 1))[0]["values"].as_py()
        raise IngestError(f"{catalog}: column {name!r} holds {repeated!r} more than once; item ids must be unique")
    return pc.add(pc.index_in(text, keys).cast(pa.int64()), 1), keys


def read_keyed_catalog(
    catalog: str, columns: Columns, features: dict[str, str] | str
) -> tuple[pa.Table, pa.Array | None]:
    """The items table from a catalog table (ids, titles, null without a title column, and the
    declared feature columns, one item per catalog row), and the sorted text keys of a catalog
    whose ids are text (item id i is keys[i - 1]; None for integer ids)."""
    features = _declared(features)
    wanted = [columns.item] + ([columns.title] if columns.title else []) + list(features)
    ids, titles, raw = [], [], {name: [] for name in features}
    for part, batch in _table_batches(catalog, wanted):
        ids.append((part, batch.column(columns.item)))
        titles.append(
            _title(batch.column(columns.title), columns.title, part)
            if columns.title
            else pa.nulls(batch.num_rows, pa.string())
        )
        for name, family in features.items():
            raw[name].append(
                _bag(batch.column(name), name, part) if family == MULTIVALENT else (part, batch.column(name))
            )
    if not ids:
        raise IngestError(f"{catalog} holds no items (the catalog is empty)")
    item_ids, keys = _catalog_ids(ids, columns.item, catalog)
    data = {"item_id": item_ids, "title": pa.chunked_array(titles, pa.string())}
    univalent = {}
    for name, family in features.items():
        if family == MULTIVALENT:
            data[name] = pa.chunked_array(raw[name], pa.list_(pa.string()))
        elif family == NUMERIC:
            data[name] = pa.chunked_array(_numbers(raw[name], name), pa.float64())
        else:
            chunks = _values(raw[name], name)
            univalent[name] = chunks[0].type
            data[name] = pa.chunked_array(chunks, chunks[0].type)
    items = pa.Table.from_pydict(data, schema=items_schema(features, univalent))
    try:
        return validate_items(items).combine_chunks(), keys
    except SchemaError as exc:
        column = columns.item if exc.column == "item_id" else exc.column
        raise IngestError(
            f"{catalog}: column {column!r} {exc.problem}"
            + ("; item ids must be unique" if "more than once" in exc.problem else "")
        ) from None


def iter_interactions(
    source: str,
    columns: Columns,
    rating_scale: tuple[float, float] | None = None,
    item_keys: pa.Array | None = None,
    seen: dict | None = None,
) -> Iterator[pa.RecordBatch]:
    """Stream the interactions table as canonical batches (user_id, item_id, label, timestamp).
    Without a label column the label is the count column's value, or 1.0 (implicit feedback); with
    `rating_scale` a label outside it is refused, naming the file, the row and the value. User ids
    that are text become `user_key_id`s; with the catalog's `item_keys` the item column is looked up
    there (an unknown key: item id 0). `seen` collects whether a user id was text ("text_users") and
    the distinct unknown item keys met ("unknown_keys")."""
    seen = {} if seen is None else seen
    lookup = None if item_keys is None else pd.Index(item_keys.to_numpy(zero_copy_only=False))  # hashed once
    seen.setdefault("text_users", False)
    seen.setdefault("unknown_keys", set())
    names = {
        "user_id": columns.user,
        "item_id": columns.item,
        "label": columns.label or columns.count,
        "timestamp": columns.timestamp,
    }
    for part, batch in _table_batches(source, [name for name in names.values() if name]):
        n = batch.num_rows
        users, user_keys = _user_ids(batch.column(columns.user), columns.user, part)
        seen["text_users"] |= user_keys is not None
        if item_keys is None:
            items = _ids(batch.column(columns.item), columns.item, part)
        else:
            keys = _text_ids(batch.column(columns.item), columns.item, part).to_numpy(zero_copy_only=False)
            positions = lookup.get_indexer(keys)  # -1: not in the catalog
            if (positions < 0).any():
                seen["unknown_keys"].update(np.unique(keys[positions < 0]).tolist())
            items = pa.array(np.where(positions >= 0, positions + 1, 0))
        table = pa.table(
            {
                "user_id": users,
                "item_id": items,
                "label": _labels(batch.column(columns.label), columns.label, part)
                if columns.label
                else _counts(batch.column(columns.count), columns.count, part)
                if columns.count
                else pa.array(np.ones(n)),
                "timestamp": _timestamps(batch.column(columns.timestamp), columns.timestamp, part)
                if columns.timestamp
                else pa.nulls(n, pa.int64()),
            }
        )
        try:
            table = validate_interactions(table)
        except SchemaError as exc:
            raise IngestError(
                f"{part.at(exc.row or 0)}: column {names.get(exc.column, exc.column)!r} {exc.problem}"
            ) from None
        if rating_scale is not None:
            labels = table["label"].to_numpy()
            outside = np.flatnonzero((labels < rating_scale[0]) | (labels > rating_scale[1]))
            if outside.size:
                raise IngestError(
                    f"{part.at(int(outside[0]))}: rating {labels[outside[0]]:g} is outside the rating "
                    "scale "
                    f"{rating_scale[0]:g}..{rating_scale[1]:g} ({outside.size} such rating(s) in this "
                    "batch); "
                    "ingest it with `ssp ingest --rating-scale MIN MAX`"
                )
        if user_keys is not None:  # the hashed users' own ids, to the data set's private user_keys.parquet
            table = table.append_column("user_key", user_keys)
        yield from table.to_batches()


def ingest(
    interactions: str,
    catalog: str,
    out: str,
    features: dict[str, str] | str,
    *,
    columns: Columns = Columns(),
    unknown_items: str = "fail",
    rating_scale: tuple[float, float] | None = None,
    progress: bool = False,
    data_source: str | None = None,
) -> Dataset:
    """Ingest an interactions table and a catalog table into the data set folder `out`.

    `features` is the declaration of the public feature columns ({column: kind} or the spec
    `genres:bag,brand:value`). With `columns.label` the labels are ratings and `rating_scale`
    (min, max) is required; without it the data are implicit feedback (every label 1.0) and no
    scale may be given. Nothing is written when the input is bad."""
    if unknown_items not in UNKNOWN_ITEM_POLICIES:
        raise UserError(f"unknown_items must be one of {UNKNOWN_ITEM_POLICIES}, got {unknown_items!r}")
    features = _declared(features)
    if columns.label is not None and columns.count is not None:
        raise IngestError(
            "--count-col is for implicit feedback (plays, clicks): with --label-col the rows are ratings, "
            "each counted once; give one of them"
        )
    if columns.label is None and rating_scale is not None:
        raise IngestError(
            "--rating-scale needs --label-col: without a label column the data are implicit feedback "
            "(every row a positive), which has no rating scale"
        )
    if columns.label is not None:
        if rating_scale is None:
            raise IngestError(
                f"--label-col {columns.label} needs --rating-scale MIN MAX: the scale of the ratings, "
                "which training clips to"
            )
        low, high = rating_scale
        if not (math.isfinite(low) and math.isfinite(high) and low < high):
            raise UserError(f"--rating-scale must be two finite numbers MIN < MAX, got {low:g} {high:g}")
    items, item_keys = read_keyed_catalog(catalog, columns, features)
    known_ids = np.sort(items["item_id"].to_numpy())
    unknown = {"rows": 0, "items": np.empty(0, np.int64), "seen": 0}
    seen: dict = {}

    def known_rows() -> Iterator[pa.RecordBatch]:
        with progress_bar(
            desc=f"ingest {interactions}", unit=" rows", unit_scale=True, enabled=logs.bars(progress)
        ) as bar:
            for batch in iter_interactions(interactions, columns, rating_scale, item_keys, seen):
                bar.update(batch.num_rows)
                unknown["seen"] += batch.num_rows
                ids = batch.column("item_id").to_numpy()
                known = np.isin(ids, known_ids)
                if not known.all():
                    unknown["rows"] += int((~known).sum())
                    unknown["items"] = np.union1d(unknown["items"], ids[~known])
                if unknown["rows"] and unknown_items == "fail":
                    continue  # keep scanning to report the full count; nothing will be published
                yield batch.filter(pa.array(known))
        if unknown["seen"] == 0:
            raise IngestError(f"{interactions} holds no interactions")
        if unknown["rows"]:
            # write_dataset reads the manifest only after the last batch, so this lands in it
            dropped = len(seen["unknown_keys"]) if item_keys is not None else int(unknown["items"].size)
            manifest["unknown_items"].update(dropped_ratings=unknown["rows"], dropped_items=dropped)
        manifest["ids"]["user"] = "text" if seen["text_users"] else "integer"
        if unknown["rows"] and unknown_items == "fail":
            example = repr(min(seen["unknown_keys"])) if item_keys is not None else unknown["items"][0]
            raise IngestError(
                f"{interactions}: {unknown['rows']} interaction(s) refer to {dropped} item(s) missing from the catalog "
                f"{catalog} (e.g. {example}); rerun with --unknown-items drop to drop them"
            )

    manifest = {
        "source": interactions,
        "catalog": catalog,
        "layout": "table",
        "columns": asdict(columns),
        "feedback": "explicit" if columns.label else "implicit",
        "unknown_items": {"policy": unknown_items},
        "ids": {"item": "integer" if item_keys is None else "text"},
        **({"data_source": data_source} if data_source is not None else {}),
    }
    if columns.label:
        manifest["rating_scale"] = [float(rating_scale[0]), float(rating_scale[1])]
    if not columns.label:
        logs.log(
            "implicit feedback: every row is kept; a (user, item) pair that comes more than once (repeated "
            "plays) is one positive whose count, "
            + ("its rows' counts summed" if columns.count else "its number of rows")
            + ", sets its confidence in training and serving (ssp train --confidence-alpha; 0 counts it once)"
        )
    batches = known_rows()
    try:
        keys = None if item_keys is None else pa.table({"item_id": pa.array(np.arange(1, len(item_keys) + 1)), "item_key": item_keys})
        return write_dataset(out, items, batches, manifest, keys)
    finally:
        batches.close()  # its progress bar ends its line now, before an error of the write is printed
