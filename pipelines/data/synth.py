"""Synthetic data sets for scale tests: `ssp synth` and `generate()`.

Why: user-level differential privacy is only worth studying at 10^5-10^6 users, and no public rating
data set of that size comes with public item features, so the project plants a model and samples
from it.

What this module owns: the idealised generator (default), whose public features (`genres`, `tags`,
`year`) explain the ratings almost entirely through a planted low-rank model, with Zipf popularity
and exactly K distinct items per user; the dispatch (`generate`, its checks and manifest) to it or to
a realistic one, `like="movielens"` (ratings, pipelines.data.synth_movielens) or `like="plays"`
(a music service's play log, implicit feedback, pipelines.data.synth_plays); and the command line.
Interactions are produced chunk by chunk as Arrow record batches and streamed into Parquet by
`write_dataset`, so peak memory does not grow with the number of rows. Every chunk has its own
random stream (Philox keyed by SeedSequence(seed, spawn_key=(stream, chunk))), and so do the
catalog, the model and the popularity ranks: the same parameters and seed give identical tables.
docs/synthetic-data.md has both generators' models and constants.

Privacy: the generated interactions stand in for private data and are treated as such downstream;
the items table is public by declaration, like a real catalog.
"""

from __future__ import annotations

import argparse
import math
import numbers
import sys
import time

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from pipelines.base import logs
from pipelines.data import synth_plays
from pipelines.data.datasets import Dataset, write_dataset
from pipelines.data.synth_movielens import (
    CATALOG_GROWTH,
    KEY_BATCH,
    ML_GENERATOR_VERSION,
    ML_ITEMS,
    ML_MEAN_ACTIVITY,
    ML_USERS,
    _bag_mean,
    _draw,
    _ml_batches,
    _MovieLensModel,
    _offsets,
    _rng,
)
from schemas.errors import UserError
from schemas.tables import INTERACTIONS, MULTIVALENT, UNIVALENT, items_schema

GENERATOR_VERSION = 1  # bump when the output for given parameters changes

CHUNK_USERS = 20_000  # users per chunk (fewer when K is large, see _chunk_users)
MAX_CHUNK_ROWS = 1_000_000  # rows per chunk at most
MAX_CANDIDATES = 4_000_000  # with-replacement candidate draws per chunk at most

GENRES = 20
MAX_GENRES_PER_ITEM = 3
MAX_TAGS_PER_ITEM = 5
FIRST_YEAR, LAST_YEAR = 1950, 2023
FIRST_TIME, END_TIME = 946_684_800, 1_704_067_200  # 2000-01-01 .. 2024-01-01 (exclusive), UTC seconds

MEAN_RATING = 3.5
NOISE_SD = 0.5
RESIDUAL_SD = 0.3  # item-specific part of an item factor, per coordinate (feature vectors have sd 1)
USER_SCALE = 0.6  # user factors are N(0, I/r) * USER_SCALE
MIN_RATING, MAX_RATING = 0.5, 5.0

FEATURES = {"genres": MULTIVALENT, "tags": MULTIVALENT, "year": UNIVALENT}

# Random streams: SeedSequence(seed, spawn_key=(stream, ...)); 4..7 are the MovieLens-like
# generator's (pipelines.data.synth_movielens).
_CATALOG, _MODEL, _POPULARITY, _CHUNK = 0, 1, 2, 3

# The realistic generators (`like=`) and the public data set each is calibrated to:
# pipelines.data.synth_movielens and pipelines.data.synth_plays.
LIKES = {"movielens": "MovieLens-1M", "plays": "the Taste Profile subset of the Million Song Dataset"}


# ---------------------------------------------------------------------------------------------
# Parameters


def _check_positive_int(name: str, value) -> int:
    if isinstance(value, bool) or not isinstance(value, numbers.Integral) or value < 1:
        raise UserError(f"{name} must be a positive integer, got {value!r}")
    return int(value)


def _check_params(users, items, ratings_per_user, alpha, seed, rank) -> dict:
    params = {
        "users": _check_positive_int("users", users),
        "items": _check_positive_int("items", items),
        "ratings_per_user": _check_positive_int("ratings_per_user", ratings_per_user),
    }
    if params["ratings_per_user"] > params["items"]:
        raise UserError(
            f"ratings_per_user ({params['ratings_per_user']}) cannot exceed items ({params['items']}): "
            "each user rates distinct items"
        )
    if isinstance(alpha, bool) or not isinstance(alpha, numbers.Real) or not math.isfinite(alpha) or alpha < 0:
        raise UserError(f"alpha must be a finite number >= 0, got {alpha!r}")
    params["alpha"] = float(alpha)
    if isinstance(seed, bool) or not isinstance(seed, numbers.Integral) or seed < 0:
        raise UserError(f"seed must be a non-negative integer, got {seed!r}")
    params["seed"] = int(seed)
    params["rank"] = _check_positive_int("rank", rank)
    return params


def _chunk_users(ratings_per_user: int) -> int:
    return max(1, min(CHUNK_USERS, MAX_CHUNK_ROWS // ratings_per_user))


# ---------------------------------------------------------------------------------------------
# Catalog and planted model


class _Catalog:
    """Item features as integer codes: bags as (offsets, values), years as ints."""

    def __init__(self, items: int, seed: int):
        rng = _rng(seed, _CATALOG)
        self.items = items
        # Genres: 1-3 distinct of GENRES per item (a partial Fisher-Yates shuffle, vectorised).
        n_genres = rng.integers(1, MAX_GENRES_PER_ITEM + 1, size=items)
        g1 = rng.integers(0, GENRES, size=items)
        g2 = rng.integers(0, GENRES - 1, size=items)
        g2 += g2 >= g1
        lo, hi = np.minimum(g1, g2), np.maximum(g1, g2)
        g3 = rng.integers(0, GENRES - 2, size=items)
        g3 += g3 >= lo
        g3 += g3 >= hi
        triples = np.stack([g1, g2, g3], axis=1)
        self.genre_offsets = _offsets(n_genres)
        self.genre_values = triples[np.arange(MAX_GENRES_PER_ITEM) < n_genres[:, None]]
        # Tags: 0-5 per item, Zipf frequencies over the vocabulary, repeats allowed.
        self.tag_vocabulary = max(50, items // 10)
        n_tags = rng.integers(0, MAX_TAGS_PER_ITEM + 1, size=items)
        zipf = 1.0 / np.arange(1, self.tag_vocabulary + 1)
        self.tag_offsets = _offsets(n_tags)
        self.tag_values = _draw(rng, np.cumsum(zipf / zipf.sum()), int(n_tags.sum()))
        self.years = rng.integers(FIRST_YEAR, LAST_YEAR + 1, size=items)

    @property
    def decades(self) -> np.ndarray:
        return (self.years - FIRST_YEAR) // 10

    def table(self) -> pa.Table:
        ids = pa.array(np.arange(1, self.items + 1, dtype=np.int64))
        titles = pc.binary_join_element_wise("Synthetic item", ids.cast(pa.string()), " ")
        genre_names = pa.array([f"genre-{g:02d}" for g in range(GENRES)], pa.string())
        width = max(4, len(str(self.tag_vocabulary - 1)))
        tag_names = pa.array([f"tag-{t:0{width}d}" for t in range(self.tag_vocabulary)], pa.string())
        genres = pa.ListArray.from_arrays(pa.array(self.genre_offsets, pa.int32()), genre_names.take(self.genre_values))
        tags = pa.ListArray.from_arrays(pa.array(self.tag_offsets, pa.int32()), tag_names.take(self.tag_values))
        years = pa.array(self.years.astype(np.int64))
        return pa.Table.from_arrays([ids, titles, genres, tags, years], schema=items_schema(FEATURES))


def item_factors(catalog: _Catalog, rank: int, seed: int) -> np.ndarray:
    """The planted item factors (M x rank): feature vectors' means plus a small residual."""
    rng = _rng(seed, _MODEL, rank)
    genre_vectors = rng.standard_normal((GENRES, rank))
    tag_vectors = rng.standard_normal((catalog.tag_vocabulary, rank))
    decade_vectors = rng.standard_normal(((LAST_YEAR - FIRST_YEAR) // 10 + 1, rank))
    residual = RESIDUAL_SD * rng.standard_normal((catalog.items, rank))
    return (
        _bag_mean(catalog.genre_offsets, catalog.genre_values, genre_vectors)
        + _bag_mean(catalog.tag_offsets, catalog.tag_values, tag_vectors)
        + decade_vectors[catalog.decades]
        + residual
    )


def popularity(items: int, alpha: float, seed: int) -> np.ndarray:
    """Sampling probability of each item (index j is item id j + 1): rank^(-alpha), ranks permuted."""
    ranks = _rng(seed, _POPULARITY).permutation(items) + 1
    log_w = -float(alpha) * np.log(ranks)
    w = np.exp(log_w - log_w.max())
    return w / w.sum()


# ---------------------------------------------------------------------------------------------
# Interactions


def _candidates_per_user(p: np.ndarray, k: int, chunk_users: int) -> int:
    """How many with-replacement draws per user make fewer than K distinct items rare."""
    cap = max(2 * k, MAX_CANDIDATES // chunk_users)
    c = 2 * k
    with np.errstate(divide="ignore"):
        log_miss = np.log1p(-p)
    while c < cap and -np.expm1(c * log_miss).sum() < k + 3 * math.sqrt(k):
        c *= 2
    return min(c, cap)


def _first_distinct(candidates: np.ndarray, k: int, items: int) -> tuple[np.ndarray, np.ndarray]:
    """Per row, the first k distinct values in order (-1 padded) and how many were found."""
    n, c = candidates.shape
    keys = (np.arange(n, dtype=np.int64)[:, None] * items + candidates).ravel()
    order = np.argsort(keys, kind="stable")  # stable: a value's first position comes first
    sorted_keys = keys[order]
    first = np.ones(sorted_keys.size, bool)
    first[1:] = sorted_keys[1:] != sorted_keys[:-1]
    positions = np.sort(order[first])  # flat positions of first occurrences, row by row in order
    rows = positions // c
    counts = np.bincount(rows, minlength=n)
    rank = np.arange(positions.size) - (np.cumsum(counts) - counts)[rows]
    keep = rank < k
    picked = np.full((n, k), -1, np.int64)
    picked[rows[keep], rank[keep]] = candidates.ravel()[positions[keep]]
    return picked, np.minimum(counts, k)


def _complete(rng: np.random.Generator, picked: np.ndarray, found: np.ndarray, log_p: np.ndarray) -> None:
    """Fill the rows with fewer than k items, continuing their successive sampling exactly.

    Given the items already picked, the rest of a successive sample is a successive sample of the
    remaining items; the items with the smallest exponential keys E_j / p_j, in key order, are one.
    """
    n, k = picked.shape
    short = np.flatnonzero(found < k)
    batch = max(1, KEY_BATCH // log_p.size)
    for start in range(0, short.size, batch):
        rows = short[start : start + batch]
        keys = np.log(rng.standard_exponential((rows.size, log_p.size))) - log_p
        taken = picked[rows] >= 0
        r, c = np.nonzero(taken)
        keys[r, picked[rows][r, c]] = np.inf
        best = np.argpartition(keys, k - 1, axis=1)[:, :k] if k < log_p.size else np.tile(np.arange(k), (rows.size, 1))
        best = np.take_along_axis(
            best, np.argsort(np.take_along_axis(keys, best, axis=1), axis=1, kind="stable"), axis=1
        )
        have = found[rows]
        r, c = np.nonzero(np.arange(k)[None, :] >= have[:, None])
        picked[rows[r], c] = best[r, c - have[r]]
        found[rows] = k


def _interaction_batches(params: dict, v: np.ndarray, p: np.ndarray, progress):
    users, k, rank, seed = params["users"], params["ratings_per_user"], params["rank"], params["seed"]
    chunk = _chunk_users(k)
    c = _candidates_per_user(p, k, chunk)
    cdf = np.cumsum(p)
    log_p = np.log(np.maximum(p, np.finfo(float).tiny))
    for index, start in enumerate(range(0, users, chunk)):
        n = min(chunk, users - start)
        rng = _rng(seed, _CHUNK, index)
        u = rng.standard_normal((n, rank)) * (USER_SCALE / math.sqrt(rank))
        picked, found = _first_distinct(_draw(rng, cdf, (n, c)), k, p.size)
        if (found < k).any():
            _complete(rng, picked, found, log_p)
        score = np.einsum("nr,nkr->nk", u, v[picked])
        raw = MEAN_RATING + score + rng.normal(0.0, NOISE_SD, (n, k))
        labels = np.clip(np.round(2.0 * raw) / 2.0, MIN_RATING, MAX_RATING)
        stamps = rng.integers(FIRST_TIME, END_TIME, (n, k), dtype=np.int64)
        order = np.argsort(stamps, axis=1, kind="stable")  # each user's ratings in time order
        user_ids = np.repeat(np.arange(start + 1, start + n + 1, dtype=np.int64), k)
        yield pa.RecordBatch.from_arrays(
            [
                pa.array(user_ids),
                pa.array(np.take_along_axis(picked, order, axis=1).ravel() + 1),
                pa.array(np.take_along_axis(labels, order, axis=1).ravel()),
                pa.array(np.take_along_axis(stamps, order, axis=1).ravel()),
            ],
            schema=INTERACTIONS,
        )
        progress.update(n)


def generate(
    out: str,
    users: int | None = None,
    items: int | None = None,
    ratings_per_user: int | None = None,
    *,
    alpha: float | None = None,
    seed: int = 0,
    rank: int | None = None,
    progress: bool = False,
    like: str | None = None,
) -> Dataset:
    """Write a synthetic data set (interactions, items, manifest) to the folder `out`.

    Default (idealised): `users` users each rate exactly `ratings_per_user` distinct items out of
    `items`, sampled with popularity exponent `alpha` (default 1.0); ratings come from a planted
    rank-`rank` (default 8) model whose item factors depend on the public features.

    `like="movielens"`: the MovieLens-1M-calibrated generator; `users` (default 6040) sets the
    catalog and every user's number of ratings, `alpha` and `rank` must be left out
    (`ratings_per_user` rescales the activity, `items` replaces the catalog's size). `like="plays"`: the play log
    calibrated to the Taste Profile subset (implicit feedback, a row per play); `users` (default
    3500) is the only size. Same parameters and seed, same tables.
    `progress` shows a bar on stderr.
    """
    if not isinstance(out, str) or not out:
        raise UserError(f"out must be a non-empty path, got {out!r}")
    if like is not None:
        return _generate_like(
            out,
            like,
            users=users,
            items=items,
            ratings_per_user=ratings_per_user,
            alpha=alpha,
            seed=seed,
            rank=rank,
            progress=progress,
        )
    for name, value in (("users", users), ("items", items), ("ratings_per_user", ratings_per_user)):
        if value is None:
            raise UserError(f"{name} is required (unless like is given)")
    params = _check_params(
        users, items, ratings_per_user, 1.0 if alpha is None else alpha, seed, 8 if rank is None else rank
    )
    from schemas.progress import bar as progress_bar

    catalog = _Catalog(params["items"], params["seed"])
    v = item_factors(catalog, params["rank"], params["seed"])
    p = popularity(params["items"], params["alpha"], params["seed"])
    manifest = {
        "source": "synthetic",
        "generator": {**params, "version": GENERATOR_VERSION},
        "rating_scale": [MIN_RATING, MAX_RATING],
    }
    with progress_bar(
        total=params["users"], unit="user", desc="synth", enabled=logs.bars(progress), unit_scale=True
    ) as bar:
        return write_dataset(out, catalog.table(), _interaction_batches(params, v, p, bar), manifest)


def _generate_like(out, like, *, users, items, ratings_per_user, alpha, seed, rank, progress) -> Dataset:
    if like not in LIKES:
        raise UserError(f"like must be one of {', '.join(LIKES)}, got {like!r}")
    set_by_like = (("alpha", alpha), ("rank", rank)) + (
        (("ratings_per_user", ratings_per_user), ("items", items)) if like == "plays" else ()
    )
    for name, value in set_by_like:
        if value is not None:
            raise UserError(f"{name} is set by like={like!r} (calibrated to {LIKES[like]}); leave it out")
    default_users = ML_USERS if like == "movielens" else synth_plays.PLAYS_USERS
    users = _check_positive_int("users", default_users if users is None else users)
    if isinstance(seed, bool) or not isinstance(seed, numbers.Integral) or seed < 0:
        raise UserError(f"seed must be a non-negative integer, got {seed!r}")
    seed = int(seed)
    from schemas.progress import bar as progress_bar

    if like == "plays":
        model = synth_plays._PlaysModel(users, seed)
        version, extra = synth_plays.PLAYS_GENERATOR_VERSION, {}
        # implicit feedback, as `ssp ingest` writes it without a label column: a play is a row with label 1
        scale = {"feedback": "implicit"}
    else:
        model = _MovieLensModel(
            users,
            seed,
            1.0
            if ratings_per_user is None
            else _check_positive_int("ratings_per_user", ratings_per_user) / ML_MEAN_ACTIVITY,
            None if items is None else _check_positive_int("items", items),
        )
        version = ML_GENERATOR_VERSION
        extra = {} if ratings_per_user is None else {"mean_ratings_per_user": ratings_per_user}
        extra |= {} if items is None else {"catalog_given": True}
        # the MovieLens scale; this generator's whole stars 1..5 lie within it
        scale = {"rating_scale": [MIN_RATING, MAX_RATING]}
    manifest = {
        "source": "synthetic",
        "generator": {"like": like, "users": users, "items": model.items, "seed": seed, "version": version, **extra},
        **scale,
    }
    with progress_bar(
        total=users, unit="user", desc=f"synth ({like})", enabled=logs.bars(progress), unit_scale=True
    ) as bar:
        batches = synth_plays._plays_batches(model, seed, bar) if like == "plays" else _ml_batches(model, seed, bar)
        return write_dataset(out, model.table(), batches, manifest)


# ---------------------------------------------------------------------------------------------
# Command line (wired into `ssp synth` by ssp.cli)


def _number(kind: type, minimum: float, what: str):
    """An argparse type: a finite `kind` (int or float) of at least `minimum`."""

    def parse(text: str):
        try:
            value = kind(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected {what}, got {text!r}") from None
        if not math.isfinite(value) or value < minimum:
            raise argparse.ArgumentTypeError(f"expected {what}, got {text!r}")
        return value

    return parse


positive_int = _number(int, 1, "a positive integer")
_non_negative_int = _number(int, 0, "a non-negative integer")
_non_negative_float = _number(float, 0.0, "a finite number >= 0")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Add the `ssp synth` options to `parser`."""
    parser.add_argument(
        "--like",
        choices=LIKES,
        metavar="{" + ",".join(LIKES) + "}",
        help="realistic data calibrated to a public data set: 'movielens' (MovieLens-1M: user and item biases, "
        "heavy-tailed activity and popularity, whole stars 1-5, public genres and year) or 'plays' (a music "
        "service's play log calibrated to the Taste Profile subset of the Million Song Dataset: implicit feedback, "
        "a row per play, repeated plays of a track, public artist, genre, duration and tags); without it, the "
        "idealised generator whose features explain the ratings almost entirely",
    )
    parser.add_argument(
        "--users",
        type=positive_int,
        metavar="N",
        help="number of users (user ids 1..N); required without --like; default 6040 with --like movielens, "
        f"{synth_plays.PLAYS_USERS} with --like plays",
    )
    parser.add_argument(
        "--items",
        type=positive_int,
        metavar="M",
        help="number of catalog items (item ids 1..M); required without --like; with --like it is set by N "
        f"(sub-linear catalog growth): movielens {ML_ITEMS:,} x (N/{ML_USERS:,})^{CATALOG_GROWTH:g}, plays "
        f"{synth_plays.TP_SONGS:,} x (N/{synth_plays.TP_USERS:,})^{synth_plays.PLAYS_CATALOG_GROWTH:g}; "
        "--like movielens takes a given M too (another data set's shape: ML10M's 10,677 movies for 69,878 users)",
    )
    parser.add_argument(
        "--ratings-per-user",
        type=positive_int,
        metavar="K",
        help="distinct items each user rates (at most M); the data set has N*K ratings; required without --like; "
        "with --like movielens every user has their own number, drawn from MovieLens-1M's activity "
        "distribution (min 20, median 96, mean 166), and K rescales that distribution to mean about K (the same "
        "heavy-tailed "
        "shape, at least 1 each: fewer rows for studies at many users); not with --like plays",
    )
    parser.add_argument("--out", required=True, metavar="DIR", help="data set folder to write (local path or gs://)")
    parser.add_argument(
        "--alpha",
        type=_non_negative_float,
        metavar="A",
        help="popularity exponent: item sampling probability is proportional to rank^-A (0: uniform; default 1.0; "
        "not with --like)",
    )
    parser.add_argument(
        "--seed",
        type=_non_negative_int,
        default=0,
        metavar="S",
        help="random seed; same seed, same data (default %(default)s)",
    )
    parser.add_argument(
        "--rank", type=positive_int, metavar="R", help="rank of the planted rating model (default 8; not with --like)"
    )


def _check_args(args: argparse.Namespace) -> None:
    """Which options go together (argparse cannot say it): ValueError naming the flags."""
    sizes = (("--users", args.users), ("--items", args.items), ("--ratings-per-user", args.ratings_per_user))
    if args.like is None:
        missing = [flag for flag, value in sizes if value is None]
        if missing:
            raise UserError(f"{', '.join(missing)} required (or give --like movielens or --like plays)")
        return
    set_by_like = (("--alpha", args.alpha), ("--rank", args.rank)) + (
        (("--ratings-per-user", args.ratings_per_user), ("--items", args.items)) if args.like == "plays" else ()
    )
    extra = [flag for flag, value in set_by_like if value is not None]
    if extra:
        raise UserError(f"{', '.join(extra)} cannot be combined with --like {args.like}: the calibration sets them")


def run(args: argparse.Namespace) -> int:
    """Generate the data set the parsed options describe, with a progress bar; print a summary."""
    _check_args(args)
    started = time.perf_counter()
    dataset = generate(
        args.out,
        args.users,
        args.items,
        args.ratings_per_user,
        alpha=args.alpha,
        seed=args.seed,
        rank=args.rank,
        progress=True,
        like=args.like,
    )
    wall = time.perf_counter() - started
    m = dataset.manifest
    rows, seen = ("plays", "played") if m.get("feedback") == "implicit" else ("ratings", "rated")
    print(
        f"wrote {dataset.path}: {m['ratings']:,} {rows}, {m['users']:,} users, {m['items']:,} items "
        f"({m['rated_items']:,} {seen}) in {wall:.1f} s"
    )
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m pipelines.data.synth", description=__doc__.split("\n\n")[0])
    add_arguments(parser)
    args = parser.parse_args(argv)
    try:
        _check_args(args)
    except ValueError as exc:
        parser.error(str(exc))
    return run(args)


if __name__ == "__main__":
    sys.exit(main())
