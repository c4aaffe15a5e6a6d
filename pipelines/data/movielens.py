"""Readers for every MovieLens layout, producing the canonical interactions and items tables.

Layouts, recognised by their files:
- `ml-100k`: `u.data` (tab separated, no header), `u.item` (`|` separated, latin-1), `u.genre`;
- `dat` (ml-1m, ml-10m): `ratings.dat`, `movies.dat`, optional `tags.dat`, fields separated by `::`;
- `csv` (ml-20m, ml-25m, ml-latest, ml-latest-small): `ratings.csv`, `movies.csv`, optional `tags.csv`.

Item features: genres and the release year (parsed from the title) are curator metadata, public by
default. Tags are written by users; they become an item feature only when the run declares them
public. Every movie of the catalog becomes an item row, rated or not.

Ratings are read in large blocks by Arrow's CSV reader (no per-row Python). When a block fails to
parse, the file is scanned line by line to report the first bad line exactly.

Privacy: ratings (and tags, unless declared public) are private user data.
"""

from __future__ import annotations

import csv
import io
import re
from collections.abc import Callable, Iterator
from dataclasses import dataclass

import numpy as np
import pyarrow as pa
import pyarrow.csv as pacsv

from schemas import SchemaError, storage
from schemas.errors import UserError
from schemas.tables import INTERACTIONS, MULTIVALENT, UNIVALENT, items_schema, validate_interactions

FAMILIES = {"genres": MULTIVALENT, "year": UNIVALENT, "tags": MULTIVALENT}
DEFAULT_PUBLIC_FEATURES = ("genres", "year")
NO_GENRES = "(no genres listed)"
ML100K_GENRES = (
    "unknown Action Adventure Animation Children's Comedy Crime Documentary Drama Fantasy Film-Noir "
    "Horror Musical Mystery Romance Sci-Fi Thriller War Western"
).split()
_YEAR_IN_TITLE = re.compile(r"\((\d{4})(?:\s*[-\u2013]\s*(?:\d{4})?)?\)\s*$")
_INT64 = (-(2**63), 2**63 - 1)
_UTF8_MULTIBYTE = re.compile(rb"[\xc2-\xdf][\x80-\xbf]|[\xe0-\xef][\x80-\xbf]{2}|[\xf0-\xf4][\x80-\xbf]{3}")
# every MovieLens set: half stars 0.5..5 (ml-100k and ml-1m use whole stars 1..5 within it)
DEFAULT_RATING_SCALE = (0.5, 5.0)


class IngestError(UserError):
    """Input that cannot be read: a missing file, a malformed line, a bad value. Names the file and line."""


@dataclass(frozen=True)
class Layout:
    """Where one MovieLens layout keeps its files and how its ratings file is split."""

    name: str
    ratings: str
    movies: str
    tags: str | None
    delimiter: str  # the ratings file's field separator
    header: bool


LAYOUTS = (
    Layout("csv", "ratings.csv", "movies.csv", "tags.csv", ",", True),
    Layout("dat", "ratings.dat", "movies.dat", "tags.dat", "::", False),
    Layout("ml-100k", "u.data", "u.item", None, "\t", False),
)


def detect_layout(folder: str) -> Layout:
    """The layout of a MovieLens folder, by the ratings file it holds."""
    fs, inner = storage.filesystem(folder)
    if not fs.isdir(inner):
        raise IngestError(f"{folder}: no such folder")
    for layout in LAYOUTS:
        if fs.isfile(storage.join(inner, layout.ratings)):
            if not fs.isfile(storage.join(inner, layout.movies)):
                raise IngestError(f"{folder}: has {layout.ratings} but its catalog {layout.movies} is missing")
            return layout
    expected = " or ".join(layout.ratings for layout in LAYOUTS)
    raise IngestError(f"{folder}: not a MovieLens folder (no {expected} found)")


def year_from_title(title: str) -> int | None:
    """The release year at the end of a MovieLens title, e.g. 'Heat (1995)' -> 1995; None if absent."""
    match = _YEAR_IN_TITLE.search(title)
    return int(match.group(1)) if match else None


def _read_text(folder: str, name: str) -> str:
    """A whole small file as text: UTF-8 when it decodes, else latin-1 (ml-1m and ml-100k) when it
    holds no UTF-8 at all. A UTF-8 file with a stray byte of another encoding is refused at that
    byte's line: read as latin-1, each of its accented characters would become two wrong ones."""
    path = storage.join(folder, name)
    fs, inner = storage.filesystem(path)
    if not fs.isfile(inner):
        raise IngestError(f"{path}: file not found")
    raw = fs.cat_file(inner)
    try:
        return raw.decode("utf-8-sig")  # a byte-order mark (files saved by spreadsheets) is not part of the header
    except UnicodeDecodeError as exc:
        if _UTF8_MULTIBYTE.search(raw):
            line = raw.count(b"\n", 0, exc.start) + 1
            raise IngestError(
                f"{path}, line {line}: byte {raw[exc.start]:#04x} is not UTF-8, but the rest of the "
                "file is; "
                "re-save the file as UTF-8 (a file is read as UTF-8, or as latin-1 when it holds no "
                "UTF-8 at all)"
            ) from None
        return raw.decode("latin-1")


def _parse_int(value: str, what: str) -> int:
    try:
        number = int(value.strip())
    except ValueError:
        raise UserError(f"{what} {value!r} is not an integer") from None
    if not _INT64[0] <= number <= _INT64[1]:
        raise UserError(f"{what} {value.strip()} does not fit in a 64-bit integer")
    return number


def _parse_float(value: str, what: str) -> float:
    try:
        return float(value.strip())
    except ValueError:
        raise UserError(f"{what} {value!r} is not a number") from None


def _lines(
    folder: str, name: str, separator: str, csv_header: list[str] | None = None
) -> Iterator[tuple[int, list[str]]]:
    """(line number, fields) of a small text file: a `.csv` file (quoted fields, a header starting
    with `csv_header`) or a headerless file whose fields are split on `separator`; blank lines skipped."""
    text = _read_text(folder, name)
    if not name.endswith(".csv"):
        yield from ((n, line.split(separator)) for n, line in enumerate(text.splitlines(), 1) if line.strip())
        return
    reader = csv.reader(io.StringIO(text))
    header = next(reader, None)
    if header is None:
        raise IngestError(f"{storage.join(folder, name)} is empty (not even a header line)")
    if [h.strip() for h in header[: len(csv_header)]] != csv_header:
        raise IngestError(
            f"{storage.join(folder, name)}, line 1: expected the header {','.join(csv_header)}, found {header}"
        )
    try:
        for fields in reader:
            if fields:
                yield reader.line_num, fields
    except csv.Error as exc:
        raise IngestError(f"{storage.join(folder, name)}, line {reader.line_num}: {exc}") from None


# ---------------------------------------------------------------------------------------------
# Catalog


def _catalog_rows(folder: str, layout: Layout) -> Iterator[tuple[int, int, str, list[str]]]:
    """(line, item_id, title, genres) for every movie of the catalog file."""
    path = storage.join(folder, layout.movies)
    if layout.name == "ml-100k":
        genre_names = _ml100k_genres(folder)
        lines, width = _lines(folder, layout.movies, "|"), 5 + len(genre_names)
    else:
        lines, width = _lines(folder, layout.movies, "::", ["movieId", "title", "genres"]), 3
    for line, fields in lines:
        if len(fields) != width:
            raise IngestError(f"{path}, line {line}: expected {width} fields, found {len(fields)}")
        try:
            item_id = _parse_int(fields[0], "movie id")
        except ValueError as exc:
            raise IngestError(f"{path}, line {line}: {exc}") from None
        title = fields[1].strip()
        if layout.name == "ml-100k":
            flags = fields[5:]
            if any(flag.strip() not in ("0", "1") for flag in flags):
                raise IngestError(f"{path}, line {line}: genre flags must be 0 or 1")
            genres = [name for name, flag in zip(genre_names, flags, strict=False) if flag.strip() == "1"]
            if year_from_title(title) is None and re.search(r"\d{4}$", fields[2].strip()):
                title = f"{title} ({fields[2].strip()[-4:]})"
        else:
            genres = [g for g in fields[2].strip().split("|") if g and g != NO_GENRES]
        yield line, item_id, title, genres


def _ml100k_genres(folder: str) -> list[str]:
    fs, inner = storage.filesystem(storage.join(folder, "u.genre"))
    if not fs.isfile(inner):
        return list(ML100K_GENRES)
    pairs = [line.split("|") for line in _read_text(folder, "u.genre").splitlines() if line.strip()]
    return [name for name, _ in sorted(pairs, key=lambda pair: int(pair[1]))]


def _tags_by_item(folder: str, layout: Layout, catalog: set[int]) -> dict[int, list[str]]:
    """Normalised tag applications per catalog item (repeats kept: they weigh the tag)."""
    if layout.tags is None:
        raise IngestError(f"{folder}: tags were declared public but the {layout.name} layout has no tags file")
    fs, inner = storage.filesystem(storage.join(folder, layout.tags))
    if not fs.isfile(inner):
        raise IngestError(f"{storage.join(folder, layout.tags)}: tags were declared public but the file is missing")
    path = storage.join(folder, layout.tags)
    # tags.dat: user::movie::tag::timestamp, where the tag itself may contain '::'
    rows = _lines(folder, layout.tags, "::", ["userId", "movieId", "tag"])
    tags: dict[int, list[str]] = {}
    for line, fields in rows:
        if len(fields) < 4:
            raise IngestError(f"{path}, line {line}: expected 4 fields, found {len(fields)}")
        try:
            item_id = _parse_int(fields[1], "movie id")
        except ValueError as exc:
            raise IngestError(f"{path}, line {line}: {exc}") from None
        tag = " ".join(("::".join(fields[2:-1]) if layout.name == "dat" else fields[2]).split()).lower()
        if tag and item_id in catalog:
            tags.setdefault(item_id, []).append(tag)
    return tags


def read_catalog(folder: str, public_features: tuple[str, ...] = DEFAULT_PUBLIC_FEATURES) -> pa.Table:
    """The items table: every movie of the catalog with the feature families declared public."""
    unknown = [name for name in public_features if name not in FAMILIES]
    if unknown:
        raise IngestError(f"unknown feature family {', '.join(unknown)} (known: {', '.join(FAMILIES)})")
    layout = detect_layout(folder)
    path = storage.join(folder, layout.movies)
    ids, titles, genres, first_line = [], [], [], {}
    for line, item_id, title, item_genres in _catalog_rows(folder, layout):
        if item_id in first_line:
            raise IngestError(f"{path}, line {line}: movie id {item_id} already listed on line {first_line[item_id]}")
        first_line[item_id] = line
        ids.append(item_id)
        titles.append(title)
        genres.append(item_genres)
    if not ids:
        raise IngestError(f"{path} holds no movies (the catalog is empty)")
    columns = {"item_id": ids, "title": titles}
    if "genres" in public_features:
        columns["genres"] = genres
    if "year" in public_features:
        columns["year"] = [year_from_title(title) for title in titles]
    if "tags" in public_features:
        tags = _tags_by_item(folder, layout, set(ids))
        columns["tags"] = [tags.get(item_id, []) for item_id in ids]
    schema = items_schema({name: FAMILIES[name] for name in FAMILIES if name in public_features})
    return pa.Table.from_pydict(columns, schema=schema)


# ---------------------------------------------------------------------------------------------
# Ratings


def iter_ratings(
    folder: str, block_size: int = 1 << 26, scale: tuple[float, float] | None = None
) -> Iterator[pa.RecordBatch]:
    """Stream the ratings as canonical interaction batches (user_id, item_id, label, timestamp).

    Each batch is validated; a malformed line, a non-numeric or non-finite rating, or an id that
    does not fit in int64 raises `IngestError` naming the file and the line. Blank lines (and lines
    whose every field is empty) are skipped, as in the catalog. With `scale` (min, max), a rating
    outside it is refused the same way.
    """
    layout = detect_layout(folder)
    path = storage.join(folder, layout.ratings)
    fs, inner = storage.filesystem(path)
    if layout.name == "csv":
        names = ["userId", "movieId", "rating", "timestamp"]
        read_options = pacsv.ReadOptions(block_size=block_size)
        picked = names
    else:
        # '::' is split as ':' with empty fields between (Arrow takes one-character delimiters).
        width = 7 if layout.name == "dat" else 4
        names = [f"f{i}" for i in range(width)]
        read_options = pacsv.ReadOptions(column_names=names, block_size=block_size)
        picked = names[::2] if layout.name == "dat" else names
    types = dict(zip(picked, (pa.int64(), pa.int64(), pa.float64(), pa.int64()), strict=True))
    convert = pacsv.ConvertOptions(
        column_types=types, include_columns=picked, null_values=[""], quoted_strings_can_be_null=False
    )
    parse = pacsv.ParseOptions(delimiter=layout.delimiter[0], ignore_empty_lines=False)
    first_line = 2 if layout.header else 1
    with fs.open(inner, "rb") as handle:
        try:
            reader = pacsv.open_csv(handle, read_options=read_options, parse_options=parse, convert_options=convert)
        except (pa.ArrowInvalid, pa.ArrowKeyError) as exc:
            raise _locate_bad_line(path, layout, exc) from None
        while True:
            try:
                batch = reader.read_next_batch()
            except StopIteration:
                return
            except pa.ArrowInvalid as exc:
                raise _locate_bad_line(path, layout, exc) from None
            table = pa.Table.from_arrays([batch.column(name) for name in picked], schema=INTERACTIONS.remove_metadata())
            # a blank line parses as a row of nulls: skipped (as in movies.csv), but counted for the line numbers
            non_blank = np.flatnonzero(
                ~np.logical_and.reduce(
                    [table[name].is_null().to_numpy(zero_copy_only=False) for name in table.column_names]
                )
            )
            rows = table.num_rows
            if non_blank.size < rows:
                table = table.take(pa.array(non_blank))
            try:
                table = validate_interactions(table)
            except SchemaError as exc:
                column = {"label": "rating", "user_id": "user id", "item_id": "movie id"}.get(exc.column, exc.column)
                line = first_line + int(non_blank[exc.row or 0])
                raise IngestError(f"{path}, line {line}: {column} {exc.problem}") from None
            if scale is not None:
                labels = table["label"].to_numpy()
                outside = np.flatnonzero((labels < scale[0]) | (labels > scale[1]))
                if outside.size:
                    line = first_line + int(non_blank[outside[0]])
                    raise IngestError(
                        f"{path}, line {line}: rating {labels[outside[0]]:g} is outside the rating "
                        f"scale {scale[0]:g}..{scale[1]:g} "
                        f"({outside.size} such rating(s) in this block); ingest it with `ssp ingest "
                        "--rating-scale MIN MAX`"
                    )
            first_line += rows
            yield from table.to_batches()


def _split_line(layout: Layout) -> Callable[[str], list[str]]:
    if layout.name == "csv":
        return lambda line: next(csv.reader([line]))
    return lambda line: line.rstrip("\r\n").split(layout.delimiter)


def _locate_bad_line(path: str, layout: Layout, error: Exception) -> IngestError:
    """Scan the ratings file for the first line that does not parse, and describe it."""
    fs, inner = storage.filesystem(path)
    if "Empty CSV file" in str(error):
        return IngestError(f"{path} is empty" + (" (not even a header line)" if layout.header else ""))
    if "does not exist in CSV file" in str(error):
        with fs.open(inner, "rb") as raw:
            first = raw.readline().decode("utf-8", errors="replace").lstrip("\ufeff").rstrip("\r\n")
        return IngestError(
            f"{path}, line 1: expected the header userId,movieId,rating,timestamp separated by "
            f"{layout.delimiter!r}, found {first!r}"
        )
    split = _split_line(layout)
    what = ("user id", "movie id", "rating", "timestamp")
    with fs.open(inner, "rb") as raw:
        text = io.TextIOWrapper(raw, encoding="utf-8", errors="replace", newline="")
        for number, line in enumerate(text, 1):
            if number == 1 and layout.header:
                continue
            fields = split(line) if line.strip() else []
            if not any(field.strip() for field in fields):  # blank (or every field empty): skipped, as the reader does
                continue
            if len(fields) != 4:
                shown = line.rstrip("\r\n")
                return IngestError(
                    f"{path}, line {number}: expected 4 fields separated by {layout.delimiter!r}, "
                    f"found {len(fields)}: {shown!r}"
                )
            try:
                _parse_int(fields[0], what[0]), _parse_int(fields[1], what[1])
                _parse_float(fields[2], what[2]), _parse_int(fields[3], what[3])
            except ValueError as exc:
                return IngestError(f"{path}, line {number}: {exc}")
    return IngestError(f"{path}: could not be parsed ({error})")
