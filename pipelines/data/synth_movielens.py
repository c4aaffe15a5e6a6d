"""The MovieLens-like synthetic generator: `ssp synth --like movielens`, `generate(like="movielens")`.

Why: the idealised generator of `pipelines.data.synth` says little about how a private model fares
on real rating data; this one produces data that look like MovieLens-1M (biases, heavy-tailed
activity and popularity, personal taste, whole stars) at any number of users.

What this module owns: the model and the interaction batches of `like="movielens"`, and the small
sampling helpers both generators use (`_rng`, `_offsets`, `_draw`, `_bag_mean`, `KEY_BATCH`).
`pipelines.data.synth` owns the dispatch and the command line, and imports from here; this module
imports nothing from it.

Every constant below is either a published figure of MovieLens-1M itself (`bench.ladder.MOVIELENS_1M`
and `LADDER_1M`), or a choice, or was tuned (generate 6,040 users, print the summary and the ladder,
adjust) to the figure its comment names; docs/synthetic-data.md has the whole model (catalog,
activity, popularity, taste, ratings, timestamps), what each constant is calibrated to, and the
known gap. Interactions are produced chunk by chunk (`ML_CHUNK_USERS` users) with a random stream
per chunk: the same parameters and seed give identical tables.

Privacy: the generated interactions stand in for private data and are treated as such downstream;
the items table (genres, year) is public by declaration, like a real catalog. No real rating is read:
the only MovieLens-1M input is the published aggregate figures built into the constants below.
"""

from __future__ import annotations

import math
from statistics import NormalDist

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from schemas.tables import INTERACTIONS, MULTIVALENT, UNIVALENT, items_schema

KEY_BATCH = 1 << 22  # exponential keys drawn at once when completing short users (both generators)

# Random streams: SeedSequence(seed, spawn_key=(stream, ...)); 0..3 are the idealised generator's
# (pipelines.data.synth).
_ML_CATALOG, _ML_MODEL, _ML_CHUNK, _ML_PILOT = 4, 5, 6, 7

# --- like="movielens" (see the module docstring: each constant's role and what it is calibrated to)
ML_GENERATOR_VERSION = 1  # bump when the movielens output for given parameters changes
ML_USERS, ML_ITEMS = 6040, 3883  # MovieLens-1M: users, catalog movies
MIN_ML_ITEMS = 50
CATALOG_GROWTH = 0.6  # catalog = ML_ITEMS * (users / ML_USERS) ** CATALOG_GROWTH
ML_CHUNK_USERS = 4000  # users per chunk (about 660,000 rows)
ML_GENRES = (
    "Action",
    "Adventure",
    "Animation",
    "Children's",
    "Comedy",
    "Crime",
    "Documentary",
    "Drama",
    "Fantasy",
    "Film-Noir",
    "Horror",
    "Musical",
    "Mystery",
    "Romance",
    "Sci-Fi",
    "Thriller",
    "War",
    "Western",
)
# ~ML-1M movies per genre
ML_GENRE_WEIGHTS = (503, 283, 105, 251, 1200, 211, 127, 1603, 68, 44, 343, 114, 106, 471, 276, 492, 143, 68)
GENRE_COUNT_SHARES = (0.52, 0.34, 0.115, 0.022, 0.003)  # movies with 1, 2, .., 5 genres: mean 1.65 (published)
FIRST_ML_YEAR, LAST_ML_YEAR = 1919, 2000
RECENT_SHARE, RECENT_YEARS, OLDER_MEAN_AGE = 0.55, 11, 18.0  # year shape: a choice, not a fit
FIRST_ML_TIME, END_ML_TIME = 956_620_800, 1_046_476_800  # 2000-04-25 .. 2003-03-01 (exclusive), UTC seconds
ML_FEATURES = {"genres": MULTIVALENT, "year": UNIVALENT}
ACTIVITY_KNOTS = ((0.0, 20), (0.25, 44), (0.5, 96), (0.75, 208), (0.9, 400))  # (quantile, ratings): published
ACTIVITY_TAIL = 2.6  # Pareto exponent above the 90th percentile: tuned to the mean, 165.6 ratings per user
ACTIVITY_MAX = 2314  # the tail's end: the published max
ACTIVITY_CAP = 0.62  # at most this share of the catalog (2,314 / 3,706 in ML-1M)
ML_MEAN_ACTIVITY = 165.6  # the mean of the activity distribution; ratings_per_user K rescales it to mean about K
POPULARITY_KNOTS = (  # (popularity rank, relative weight): tuned to the item-count figures (docstring)
    (1, 17340),
    (37, 2630),
    (370, 479.1),
    (927, 171.9),
    (1853, 46.6),
    (2780, 11.02),
    (3417, 1.494),
    (3704, 0.259),
    (3883, 0.0259),
)
STAR_SHARES = (0.056, 0.108, 0.261, 0.349, 0.226)  # stars 1..5: published
USER_BIAS_SD = 0.44  # tuned: sd of user means 0.43
FEATURE_BIAS_SD = 0.39  # public part of the item effect; tuned: encoder RMSE 0.987
AGE_EFFECT = 0.3  # older movies rated higher, per decade, inside the public part (a choice)
POPULARITY_BIAS_SD = 0.0  # tuned (to 0): popularity Recall@20 0.176
ITEM_BIAS_SD = 0.445  # the item's own effect; tuned: per-item mean RMSE 0.982
ITEM_TAIL_SPREAD = 0.6  # the own effect widens to the tail; tuned: sd of item means 0.67
ML_RANK = 16  # rank of u.v (a choice)
INTERACTION_SD = 0.45  # sd of u.v (a choice, with NOISE_SD_ML tuned)
FACTOR_FEATURE_SHARE = 0.5  # share of an item factor's variance from its public features (a choice)
NOISE_SD_ML = 0.79  # tuned: matrix factorisation RMSE 0.851
TASTE_CLUSTERS = 16  # selection; the four taste constants tuned to popularity / implicit ALS Recall@20
MEMBERSHIP_CONCENTRATION = 0.05
TASTE_CONCENTRATION = 0.18
TASTE_SHARE = 1.0
DRAW_FACTOR = 1.3  # first-round draws per wanted rating (mechanics only: the sample is exact anyway)
DRAW_ROUNDS = 4
PILOT_USERS = 1000  # pilot users for the star thresholds


# ---------------------------------------------------------------------------------------------
# Sampling helpers, shared with the idealised generator (pipelines.data.synth imports them)


def _rng(seed: int, *key: int) -> np.random.Generator:
    return np.random.Generator(np.random.Philox(np.random.SeedSequence(seed, spawn_key=key)))


def _offsets(counts: np.ndarray) -> np.ndarray:
    return np.concatenate([[0], np.cumsum(counts)]).astype(np.int64)


def _draw(rng: np.random.Generator, cdf: np.ndarray, size) -> np.ndarray:
    """Independent draws of indices with the given cumulative probabilities."""
    return np.minimum(np.searchsorted(cdf, rng.random(size), side="right"), cdf.size - 1)


def _bag_mean(offsets: np.ndarray, values: np.ndarray, vectors: np.ndarray) -> np.ndarray:
    """Per item, the mean of its bag's vectors (zero for an empty bag); repeats weigh more."""
    items = offsets.size - 1
    counts = np.diff(offsets)
    rows = np.repeat(np.arange(items), counts)
    sums = np.stack(
        [np.bincount(rows, weights=vectors[values, d], minlength=items) for d in range(vectors.shape[1])], axis=1
    )
    return sums / np.maximum(counts, 1)[:, None]


# ---------------------------------------------------------------------------------------------
# MovieLens-like data (`like="movielens"`): see the module docstring for the model and its constants


class _MovieLensModel:
    """The catalog, item parameters and selection mixture of the MovieLens-like generator."""

    def __init__(self, users: int, seed: int, activity_scale: float = 1.0, items: int | None = None):
        self.users, self.activity_scale = users, activity_scale
        self.items = catalog_size(users) if items is None else items  # a given catalog: another data set's shape
        m = self.items
        rng = _rng(seed, _ML_CATALOG)
        # Genres: 1..5 per movie, drawn successively with ML_GENRE_WEIGHTS (exponential keys).
        n_genres = 1 + _draw(rng, np.cumsum(GENRE_COUNT_SHARES) / sum(GENRE_COUNT_SHARES), m)
        keys = rng.standard_exponential((m, len(ML_GENRES))) / np.asarray(ML_GENRE_WEIGHTS, float)
        ranked = np.argsort(keys, axis=1)
        chosen = np.arange(len(ML_GENRES))[None, :] < n_genres[:, None]
        # chosen ones first, sorted
        self.genre_values = np.sort(np.where(chosen, ranked, len(ML_GENRES)), axis=1)[chosen]
        self.genre_offsets = _offsets(n_genres)
        # Years: most movies recent, a tail back to FIRST_ML_YEAR.
        recent = rng.random(m) < RECENT_SHARE
        age = np.where(
            recent, rng.integers(0, RECENT_YEARS, m), RECENT_YEARS + rng.exponential(OLDER_MEAN_AGE, m).astype(int)
        )
        self.years = np.maximum(LAST_ML_YEAR - age, FIRST_ML_YEAR).astype(np.int64)

        model = _rng(seed, _ML_MODEL)
        # Popularity: the calibrated curve over popularity ranks, ranks a random permutation of ids.
        rank = model.permutation(m)
        self.weight = popularity_curve(m)[rank]
        # Item bias: public features (genre means, age), popularity, and an item-specific part.
        genre_effect = _normal_scores(model, len(ML_GENRES))
        counts = np.diff(self.genre_offsets)
        rows = np.repeat(np.arange(m), counts)
        from_genres = np.bincount(rows, genre_effect[self.genre_values], m) / counts
        from_features = _standardise(from_genres + AGE_EFFECT * (LAST_ML_YEAR - self.years) / 10.0)
        from_popularity = _standardise(np.log(self.weight))
        depth = rank / max(m - 1, 1)  # 0 for the most popular item, 1 for the least
        self.bias = (
            FEATURE_BIAS_SD * from_features
            + POPULARITY_BIAS_SD * from_popularity
            + ITEM_BIAS_SD * (1 + ITEM_TAIL_SPREAD * depth) * model.standard_normal(m)
        )
        # Item factors: genre and 5-year-bucket vectors (public part) plus an item-specific part.
        r = ML_RANK
        genre_vectors = model.standard_normal((len(ML_GENRES), r))
        bucket = (self.years - FIRST_ML_YEAR) // 5
        bucket_vectors = model.standard_normal((int(bucket.max()) + 1, r))
        public = _bag_mean(self.genre_offsets, self.genre_values, genre_vectors) + bucket_vectors[bucket]
        public = public / public.std(axis=0)
        self.factors = math.sqrt(FACTOR_FEATURE_SHARE) * public + math.sqrt(
            1 - FACTOR_FEATURE_SHARE
        ) * model.standard_normal((m, r))
        # Selection: a global component (row 0) and TASTE_CLUSTERS taste clusters over the items.
        membership = model.gamma(MEMBERSHIP_CONCENTRATION, size=(m, TASTE_CLUSTERS))
        membership /= membership.sum(axis=1, keepdims=True)
        q = np.vstack([self.weight[None, :], (self.weight[:, None] * membership).T])
        self.q = q / q.sum(axis=1, keepdims=True)  # (1 + clusters) x items, rows sum to 1
        self.cdf = _stacked_cdf(self.q)
        # Star thresholds: the STAR_SHARES quantiles of the latent score over rated (user, item) pairs.
        # Given the item, the rest of the score (user bias, u.v, noise) is normal with a known
        # variance, whoever rated it; the rated items are those of a pilot sample of users.
        self.thresholds = np.full(len(STAR_SHARES) - 1, np.inf)
        pilot = _ml_users(_rng(seed, _ML_PILOT), self, PILOT_USERS)
        sd = np.sqrt(
            USER_BIAS_SD**2 + INTERACTION_SD**2 * (self.factors[pilot["item"]] ** 2).sum(axis=1) / r + NOISE_SD_ML**2
        )
        self.thresholds = _mixture_quantiles(pilot["latent_mean"], sd, np.cumsum(STAR_SHARES)[:-1])

    def table(self) -> pa.Table:
        ids = pa.array(np.arange(1, self.items + 1, dtype=np.int64))
        titles = pc.binary_join_element_wise("Synthetic movie", ids.cast(pa.string()), " ")
        names = pa.array(list(ML_GENRES), pa.string())
        genres = pa.ListArray.from_arrays(pa.array(self.genre_offsets, pa.int32()), names.take(self.genre_values))
        return pa.Table.from_arrays([ids, titles, genres, pa.array(self.years)], schema=items_schema(ML_FEATURES))


def catalog_size(users: int) -> int:
    """Catalog items for `users` users: ML_ITEMS at ML_USERS, growing as users^CATALOG_GROWTH."""
    return max(MIN_ML_ITEMS, int(round(ML_ITEMS * (users / ML_USERS) ** CATALOG_GROWTH)))


def popularity_curve(items: int) -> np.ndarray:
    """Relative sampling weight of the items in popularity order (most popular first)."""
    rank = np.arange(1, items + 1, dtype=float)
    ml_rank = rank ** (math.log(ML_ITEMS) / math.log(max(items, 2)))  # log-rank stretch onto 1..ML_ITEMS
    f = np.log(ml_rank / ML_ITEMS)
    knots_f = np.log(np.array([k for k, _ in POPULARITY_KNOTS]) / ML_ITEMS)
    knots_w = np.log(np.array([w for _, w in POPULARITY_KNOTS], float))
    return np.exp(np.interp(f, knots_f, knots_w))


def activity(u: np.ndarray, items: int) -> np.ndarray:
    """Ratings per user from uniforms u: log-linear between the ACTIVITY_KNOTS quantiles, a Pareto
    tail (exponent ACTIVITY_TAIL) truncated at ACTIVITY_MAX above the last knot; at most
    ACTIVITY_CAP of the catalog."""
    q = np.array([k for k, _ in ACTIVITY_KNOTS])
    n = np.array([v for _, v in ACTIVITY_KNOTS], float)
    body = np.exp(np.interp(u, q, np.log(n)))
    v = np.clip((u - q[-1]) / (1 - q[-1]), 0.0, 1.0)
    tail = n[-1] * (1 - v * (1 - (n[-1] / ACTIVITY_MAX) ** ACTIVITY_TAIL)) ** (-1.0 / ACTIVITY_TAIL)
    out = np.floor(np.where(u <= q[-1], body, tail))
    return np.minimum(out, max(1, int(ACTIVITY_CAP * items))).astype(np.int64)


def _normal_scores(rng: np.random.Generator, n: int) -> np.ndarray:
    """n equally spaced standard normal quantiles in random order (variance close to 1 for any seed)."""
    scores = np.array([NormalDist().inv_cdf((k + 0.5) / n) for k in range(n)])
    return rng.permutation(scores / scores.std())


def _normal_cdf(x: np.ndarray) -> np.ndarray:
    """The standard normal cdf (Abramowitz and Stegun 7.1.26; absolute error below 1e-7)."""
    z = np.abs(x) / math.sqrt(2.0)
    t = 1.0 / (1.0 + 0.3275911 * z)
    poly = t * (0.254829592 + t * (-0.284496736 + t * (1.421413741 + t * (-1.453152027 + t * 1.061405429))))
    half_erfc = 0.5 * poly * np.exp(-z * z)
    return np.where(x >= 0, 1.0 - half_erfc, half_erfc)


def _mixture_quantiles(means: np.ndarray, sds: np.ndarray, qs: np.ndarray) -> np.ndarray:
    """The qs-quantiles of the equal-weight mixture of N(means_j, sds_j^2), by bisection."""
    lo = np.full(len(qs), float((means - 10 * sds).min()))
    hi = np.full(len(qs), float((means + 10 * sds).max()))
    for _ in range(50):
        mid = 0.5 * (lo + hi)
        below = np.array([_normal_cdf((t - means) / sds).mean() for t in mid]) < qs
        lo, hi = np.where(below, mid, lo), np.where(below, hi, mid)
    return 0.5 * (lo + hi)


def _standardise(x: np.ndarray) -> np.ndarray:
    sd = x.std()
    return (x - x.mean()) / (sd if sd > 0 else 1.0)


def _stacked_cdf(weights: np.ndarray) -> np.ndarray:
    """Row k's cumulative probabilities plus k, rows end to end (row k ends at exactly k + 1)."""
    cdf = np.cumsum(weights, axis=1)
    return (cdf / cdf[:, -1:] + np.arange(weights.shape[0])[:, None]).ravel()


def _draw_stacked(rng: np.random.Generator, cdf: np.ndarray, rows: np.ndarray, width: int) -> np.ndarray:
    """One independent draw from each given row of a stacked cdf (indices 0..width-1)."""
    flat = np.searchsorted(cdf, rows + rng.random(rows.size), side="right")
    return np.clip(flat - rows * width, 0, width - 1)


def _ragged_first_distinct(row: np.ndarray, item: np.ndarray, need: np.ndarray, items: int):
    """Per row, the first need[row] distinct items of its sequence (rows grouped, in sequence order)."""
    keys = row * items + item
    order = np.argsort(keys, kind="stable")
    sorted_keys = keys[order]
    first = np.ones(sorted_keys.size, bool)
    first[1:] = sorted_keys[1:] != sorted_keys[:-1]
    positions = np.sort(order[first])
    rows = row[positions]
    counts = np.bincount(rows, minlength=need.size)
    rank = np.arange(positions.size) - (np.cumsum(counts) - counts)[rows]
    keep = rank < need[rows]
    return rows[keep], item[positions[keep]], np.minimum(counts, need)


def _ml_select(rng, model: _MovieLensModel, mixture: np.ndarray, need: np.ndarray):
    """Each user's need[u] distinct items by successive sampling from its mixture of model.q rows."""
    n = need.size
    mix_cdf = _stacked_cdf(mixture)
    components = mixture.shape[1]
    m = model.items
    picked_row = np.empty(0, np.int64)
    picked_item = np.empty(0, np.int64)
    found = np.zeros(n, np.int64)
    active = np.arange(n)
    draws = np.ceil(DRAW_FACTOR * need).astype(np.int64) + 8
    for _ in range(DRAW_ROUNDS):
        counts = draws[active]
        row = np.repeat(active, counts)
        c = _draw_stacked(rng, mix_cdf, row, components)
        item = _draw_stacked(rng, model.cdf, c, m)
        # continue each active row's sequence after the items it already has
        had = np.isin(picked_row, active)
        all_row = np.concatenate([picked_row[had], row])
        all_item = np.concatenate([picked_item[had], item])
        order = np.argsort(all_row, kind="stable")
        rows, items, got = _ragged_first_distinct(all_row[order], all_item[order], need, m)
        picked_row = np.concatenate([picked_row[~had], rows])
        picked_item = np.concatenate([picked_item[~had], items])
        found[active] = got[active]
        active = active[found[active] < need[active]]
        if active.size == 0:
            break
        draws[active] = 2 * (need[active] - found[active]) + 8
    if active.size:  # the rest of a successive sample: the smallest exponential keys E_j / p_j
        batch = max(1, KEY_BATCH // m)
        extra_rows, extra_items = [], []
        for start in range(0, active.size, batch):
            rows = active[start : start + batch]
            log_p = np.log(np.maximum(mixture[rows] @ model.q, np.finfo(float).tiny))
            keys = np.log(rng.standard_exponential((rows.size, m))) - log_p
            mine = np.isin(picked_row, rows)
            local = np.searchsorted(rows, picked_row[mine])
            keys[local, picked_item[mine]] = np.inf
            short = need[rows] - found[rows]
            width = int(short.max())
            best = (
                np.argpartition(keys, width - 1, axis=1)[:, :width]
                if width < m
                else np.tile(np.arange(m), (rows.size, 1))
            )
            best = np.take_along_axis(best, np.argsort(np.take_along_axis(keys, best, axis=1), axis=1), axis=1)
            take = np.arange(width)[None, :] < short[:, None]
            extra_rows.append(np.broadcast_to(rows[:, None], best.shape)[take])
            extra_items.append(best[take])
        picked_row = np.concatenate([picked_row, *extra_rows])
        picked_item = np.concatenate([picked_item, *extra_items])
    order = np.argsort(picked_row, kind="stable")
    return picked_row[order], picked_item[order]


def _ml_users(rng: np.random.Generator, model: _MovieLensModel, n: int) -> dict:
    """n new users: their rows (user index 0..n-1, item index), latent scores and stars."""
    r = ML_RANK
    need = activity((rng.permutation(n) + rng.random(n)) / n, model.items)  # stratified: each u is uniform
    if model.activity_scale != 1.0:  # fewer (or more) ratings per user, the same heavy-tailed shape
        need = np.clip(np.rint(need * model.activity_scale), 1, max(1, int(ACTIVITY_CAP * model.items))).astype(
            np.int64
        )
    user_bias = USER_BIAS_SD * rng.standard_normal(n)
    user_factors = (INTERACTION_SD / math.sqrt(r)) * rng.standard_normal((n, r))
    taste = rng.gamma(TASTE_CONCENTRATION, size=(n, TASTE_CLUSTERS))
    taste /= taste.sum(axis=1, keepdims=True)
    mixture = np.hstack([np.full((n, 1), 1 - TASTE_SHARE), TASTE_SHARE * taste])
    row, item = _ml_select(rng, model, mixture, need)
    latent_mean = model.bias[item]
    latent = (
        latent_mean
        + user_bias[row]
        + np.einsum("nr,nr->n", user_factors[row], model.factors[item])
        + NOISE_SD_ML * rng.standard_normal(row.size)
    )
    stars = 1.0 + (latent[:, None] > model.thresholds[None, :]).sum(axis=1)
    return {"row": row, "item": item, "latent_mean": latent_mean, "stars": stars}


def _ml_batches(model: _MovieLensModel, seed: int, progress):
    for index, start in enumerate(range(0, model.users, ML_CHUNK_USERS)):
        n = min(ML_CHUNK_USERS, model.users - start)
        rng = _rng(seed, _ML_CHUNK, index)
        users = _ml_users(rng, model, n)
        row, item = users["row"], users["item"]
        stamps = rng.integers(FIRST_ML_TIME, END_ML_TIME, row.size, dtype=np.int64)
        order = np.lexsort((stamps, row))  # each user's ratings in time order
        yield pa.RecordBatch.from_arrays(
            [
                pa.array(row[order] + start + 1),
                pa.array(item[order] + 1),
                pa.array(users["stars"][order]),
                pa.array(stamps[order]),
            ],
            schema=INTERACTIONS,
        )
        progress.update(n)
