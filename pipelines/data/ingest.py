"""`ssp ingest`: read a MovieLens folder, or any interactions table and item catalog
(`--interactions`, `--catalog`: see pipelines.data.generic), into the canonical data set folder
(interactions, items, manifest).

The catalog decides which items exist: every movie becomes an item row, rated or not. A rating of a
movie that is not in the catalog is an error by default (`--unknown-items fail`, reported with a
count), or is dropped and counted in the manifest (`--unknown-items drop`). Nothing is written when
the input is bad.

Privacy: the run declares which item feature families are public (`--public-features`, or
`--features` for a catalog table); the manifest records the declaration. Tags come from users, so
they are public only on request.
"""

from __future__ import annotations

import argparse
import math
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
from schemas.progress import bar as progress_bar

from pipelines.base import logs
from pipelines.data import generic, movielens
from pipelines.data.datasets import Dataset, is_dataset, open_dataset, require_dataset_target, write_dataset
from privacy.lifetime_budget import check_source_name
from schemas import storage
from schemas.errors import UserError
from schemas.tables import MULTIVALENT, NUMERIC, item_features

BUNDLED = str(Path(__file__).resolve().parent / "ml-latest-small")
UNKNOWN_ITEM_POLICIES = ("fail", "drop")


def ingest(
    source: str,
    out: str,
    public_features: tuple[str, ...] = movielens.DEFAULT_PUBLIC_FEATURES,
    unknown_items: str = "fail",
    progress: bool = False,
    rating_scale: tuple[float, float] = movielens.DEFAULT_RATING_SCALE,
    *,
    data_source: str | None = None,
) -> Dataset:
    """Ingest the MovieLens folder `source` into the data set folder `out`; every rating must lie
    on `rating_scale`, which the manifest records as the data's declared scale (and `data_source`,
    when given, as the name of the data source whose budget account its runs charge)."""
    if unknown_items not in UNKNOWN_ITEM_POLICIES:
        raise UserError(f"unknown_items must be one of {UNKNOWN_ITEM_POLICIES}, got {unknown_items!r}")
    low, high = rating_scale
    if not (math.isfinite(low) and math.isfinite(high) and low < high):
        raise UserError(f"--rating-scale must be two finite numbers MIN < MAX, got {low:g} {high:g}")
    layout = movielens.detect_layout(source)
    items = movielens.read_catalog(source, public_features)
    catalog = np.sort(items["item_id"].to_numpy())
    unknown = {"ratings": 0, "items": np.empty(0, np.int64), "seen": 0}

    def known_ratings() -> Iterator[pa.RecordBatch]:
        # closed (its line ended) before any error is printed
        with progress_bar(
            desc=f"ingest {layout.ratings}", unit=" ratings", unit_scale=True, enabled=logs.bars(progress)
        ) as bar:
            for batch in movielens.iter_ratings(source, scale=rating_scale):
                bar.update(batch.num_rows)
                unknown["seen"] += batch.num_rows
                known = np.isin(batch.column("item_id").to_numpy(), catalog)
                if not known.all():
                    unknown["ratings"] += int((~known).sum())
                    unknown["items"] = np.union1d(unknown["items"], batch.column("item_id").to_numpy()[~known])
                if unknown["ratings"] and unknown_items == "fail":
                    continue  # keep scanning to report the full count; nothing will be published
                yield batch.filter(pa.array(known))
        if unknown["seen"] == 0:
            raise movielens.IngestError(f"{storage.join(source, layout.ratings)} holds no ratings")
        if unknown["ratings"]:
            # write_dataset reads the manifest only after the last batch, so this lands in it
            manifest["unknown_items"].update(
                dropped_ratings=unknown["ratings"], dropped_items=int(unknown["items"].size)
            )
        if unknown["ratings"] and unknown_items == "fail":
            raise movielens.IngestError(
                f"{storage.join(source, layout.ratings)}: {unknown['ratings']} rating(s) refer to "
                f"{unknown['items'].size} movie(s) missing from {layout.movies} (e.g. {unknown['items'][0]}); "
                "rerun with --unknown-items drop to drop them"
            )

    manifest = {
        "source": source,
        "layout": layout.name,
        "unknown_items": {"policy": unknown_items},
        "rating_scale": [float(low), float(high)],
        **({"data_source": data_source} if data_source is not None else {}),
    }
    batches = known_ratings()
    try:
        return write_dataset(out, items, batches, manifest)
    finally:
        batches.close()  # its progress bar ends its line now, before an error of the write is printed


def load_or_ingest(path: str, workdir: str, progress: bool = False) -> Dataset:
    """A data set from either a canonical folder (used as is) or a MovieLens folder (ingested into
    `workdir` with the default public features, reused if already there)."""
    if is_dataset(path):
        return open_dataset(path)
    if is_dataset(workdir) and open_dataset(workdir).manifest.get("source") == path:
        return open_dataset(workdir)
    return ingest(path, workdir, progress=progress)


def describe(dataset: Dataset) -> str:
    """A short human summary of a data set: sizes and the public features."""
    m = dataset.manifest
    items = storage.read_table(dataset.items)
    lines = [
        f"data set {dataset.path} (from {m.get('source')}, layout {m.get('layout', 'synthetic')})",
        f"  feedback {_feedback(m)}",
        f"  {'interactions' if m.get('feedback') == 'implicit' else 'ratings':<12} {m['ratings']:>8,}",
        f"  users        {m['users']:>8,}",
        f"  items        {m['items']:>8,}  ({m['rated_items']:,} "
        + ("with interactions)" if m.get("feedback") == "implicit" else "rated)"),
    ]
    if m.get("label_range") and m.get("feedback") != "implicit":
        scale = m.get("rating_scale")
        lines.append(
            f"  ratings range {m['label_range'][0]:g} .. {m['label_range'][1]:g}"
            + (f" (scale {scale[0]:g} .. {scale[1]:g})" if scale else "")
        )
    dropped = m.get("unknown_items", {}).get("dropped_ratings")
    if dropped:
        lines.append(
            f"  dropped  {dropped:>12,} ratings of {'items' if m.get('layout') == 'table' else 'movies'} "
            "missing from the catalog"
        )
    lines.append("  public item features:")
    for name, kind in item_features(items.schema).items():
        column = items[name]
        if kind == MULTIVALENT:
            lengths = pc.list_value_length(column)
            values = pc.unique(pc.list_flatten(column))
            covered = pc.sum(pc.greater(lengths, 0)).as_py() or 0
            lines.append(
                f"    {name:<7} multivalent, {len(values):,} distinct values, "
                f"{pc.mean(lengths).as_py() or 0:.2f} per item, {covered:,} items with any"
            )
        elif kind == NUMERIC:
            low, high = pc.min_max(column).values()
            lines.append(
                f"    {name:<7} number from {low.as_py():g} to {high.as_py():g} (bucketed by the catalog's deciles), "
                f"{len(column) - column.null_count:,} items known"
                if column.null_count < len(column)
                else f"    {name:<7} number, no item known"
            )
        else:
            lines.append(
                f"    {name:<7} univalent, {len(pc.unique(column.drop_null())):,} distinct values, "
                f"{len(column) - column.null_count:,} items known"
            )
    return "\n".join(lines)


def _feedback(manifest: dict) -> str:
    """The kind of feedback a data set holds, in words."""
    if manifest.get("feedback") == "implicit":
        return "implicit (interactions without ratings: every row a positive, label 1)"
    return "explicit ratings"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--source",
        default=None,
        help="MovieLens folder (ml-100k, ml-1m, ml-10m, ml-20m, ml-latest "
        "layouts; local or gs://); "
        "default: the bundled ml-latest-small; not with --interactions",
    )
    parser.add_argument("--out", required=True, help="output data set folder (local or gs://)")
    parser.add_argument(
        "--data-source",
        default=None,
        help="the name of the data source these interactions come from, recorded in the data set: every run on it "
        "(this week's rows and next week's) charges that source's one budget account (default: none; a run then "
        "names the source by the interactions' content digest)",
    )
    parser.add_argument(
        "--public-features",
        default=",".join(movielens.DEFAULT_PUBLIC_FEATURES),
        help="comma-separated item feature families declared public: genres, year, tags "
        "(tags are written by users: declare them public only if your policy allows; default: %(default)s)",
    )
    parser.add_argument(
        "--rating-scale",
        nargs=2,
        type=float,
        metavar=("MIN", "MAX"),
        default=None,
        help="the data's rating scale: a rating outside it is refused; recorded as the data set's "
        "declared scale, "
        "which training uses to clip ratings (default for a MovieLens folder: 0.5 5.0, every "
        "MovieLens set; "
        "required with --label-col, refused without it)",
    )
    parser.add_argument(
        "--unknown-items",
        choices=UNKNOWN_ITEM_POLICIES,
        default="fail",
        help="what to do with "
        "ratings of movies "
        "(or interactions "
        "of items) missing from the catalog: fail names a count and an example, drop drops them and "
        "counts them in the manifest "
        "(default: %(default)s)",
    )
    table = parser.add_argument_group(
        "generic tables (instead of --source: any interactions table and item catalog, Parquet or CSV, local or gs://)"
    )
    table.add_argument(
        "--interactions",
        metavar="PATH",
        help="interactions table: a .parquet or .csv file, or a "
        "folder of Parquet or CSV parts, "
        "one row per (user, item) interaction; private user data; needs --catalog and --features",
    )
    table.add_argument(
        "--catalog",
        metavar="PATH",
        help="item catalog table (.parquet or .csv file or folder of "
        "parts): one row per item, "
        "rated or not; only its --item-col, --title-col and --features columns are read",
    )
    table.add_argument(
        "--user-col",
        default="user_id",
        metavar="NAME",
        help="interactions column holding the user ids, integers (default: %(default)s)",
    )
    table.add_argument(
        "--item-col",
        default="item_id",
        metavar="NAME",
        help="column holding the item ids, integers, "
        "in both the interactions "
        "and the catalog table (default: %(default)s)",
    )
    table.add_argument(
        "--label-col",
        default=None,
        metavar="NAME",
        help="interactions column holding explicit "
        "ratings (numbers on --rating-scale); "
        "without it the data are implicit feedback: every row is a positive with label 1, for "
        "--protocol recall only",
    )
    table.add_argument(
        "--count-col",
        default=None,
        metavar="NAME",
        help="interactions column holding how many times each row's user and item met (plays, "
        "clicks: numbers >= 1) in an aggregated log; implicit feedback only, a row with count c weighs as c "
        "rows of one (default: none, every row counts once)",
    )
    table.add_argument(
        "--timestamp-col",
        default=None,
        metavar="NAME",
        help="interactions column holding when each "
        "interaction happened: "
        "integer seconds since 1970, an Arrow timestamp, or ISO 8601 text in CSV (default: none, "
        "timestamps unknown)",
    )
    table.add_argument(
        "--title-col",
        default=None,
        metavar="NAME",
        help="catalog column holding a display title per "
        "item, published "
        "with the item (default: none, titles left empty)",
    )
    table.add_argument(
        "--features",
        metavar="SPEC",
        help="catalog columns declared PUBLIC item features, as "
        "COLUMN:KIND,... with KIND bag "
        "(a list of values, or text separated by '|', e.g. genres:bag), value (one category per item, "
        "e.g. brand:value) or number "
        "(a quantity per item, bucketed by the catalog's deciles, e.g. price:number); "
        "they are published with the model, so declare only columns no user wrote; an empty SPEC "
        "declares none",
    )


TABLE_ONLY = ("catalog", "features", "label_col", "count_col", "timestamp_col", "title_col")


def _check_arguments(args: argparse.Namespace) -> None:
    """The flags of one input form (a MovieLens folder, or tables), or an argparse-style error (exit status 2)."""
    if args.interactions is not None:
        if args.source is not None:
            _usage_error("--source and --interactions are two kinds of input: give one")
        missing = [f"--{name}" for name in ("catalog", "features") if getattr(args, name) is None]
        if missing:
            _usage_error(f"--interactions needs {' and '.join(missing)}")
        if args.public_features != ",".join(movielens.DEFAULT_PUBLIC_FEATURES):
            _usage_error(
                "--public-features is for a MovieLens folder: declare a catalog table's public columns with --features"
            )
    else:
        given = [f"--{name.replace('_', '-')}" for name in TABLE_ONLY if getattr(args, name) is not None]
        given += [
            f"--{dest.replace('_', '-')}"
            for dest in ("user_col", "item_col")
            if getattr(args, dest) != dest.removesuffix("_col") + "_id"
        ]
        if given:
            _usage_error(
                f"{', '.join(given)} describe(s) a generic table: give --interactions (and --catalog, "
                "--features) with it"
            )


def _usage_error(message: str) -> None:
    """Leave as argparse does on a bad command line: the usage, one error line, exit status 2."""
    print(
        "usage: ssp ingest [-h] --out OUT [--source SOURCE | --interactions PATH --catalog PATH --features SPEC] "
        "[options]\n"
        f"ssp ingest: error: {message}",
        file=sys.stderr,
    )
    raise SystemExit(2)


def run(args: argparse.Namespace) -> int:
    started = time.perf_counter()
    _check_arguments(args)
    if args.data_source is not None:
        check_source_name("--data-source", args.data_source)
    require_dataset_target(args.out)  # before any work
    if args.interactions is not None:
        columns = generic.Columns(
            user=args.user_col,
            item=args.item_col,
            label=args.label_col,
            count=args.count_col,
            timestamp=args.timestamp_col,
            title=args.title_col,
        )
        scale = tuple(args.rating_scale) if args.rating_scale is not None else None
        dataset = generic.ingest(
            args.interactions,
            args.catalog,
            args.out,
            args.features,
            columns=columns,
            unknown_items=args.unknown_items,
            rating_scale=scale,
            progress=True,
            data_source=args.data_source,
        )
        print(describe(dataset))
        print(f"wrote {dataset.interactions} and {dataset.items} in {time.perf_counter() - started:.1f} s")
        return 0
    source = args.source if args.source is not None else BUNDLED
    scale = tuple(args.rating_scale) if args.rating_scale is not None else movielens.DEFAULT_RATING_SCALE
    features = tuple(name.strip() for name in args.public_features.split(",") if name.strip())
    dataset = ingest(
        source, args.out, features, args.unknown_items, progress=True, rating_scale=scale, data_source=args.data_source
    )
    print(describe(dataset))
    print(f"wrote {dataset.interactions} and {dataset.items} in {time.perf_counter() - started:.1f} s")
    return 0
