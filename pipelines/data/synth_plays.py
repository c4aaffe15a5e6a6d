"""The play-log synthetic generator: `ssp synth --like plays`, `generate(like="plays")`.

Why: implicit feedback from a music service (repeated plays of the same track, a long tail of
tracks, public track features) at any number of users, for ranking studies that should look like
a real play log rather than like star ratings.

What this module owns: the catalog (artist, genre, duration, tags), the latent taste model and
the play batches of `like="plays"`. It reuses the sampling helpers of
`pipelines.data.synth_movielens` (successive sampling from per-user mixtures);
`pipelines.data.synth` owns the dispatch and the command line.

Every constant below is a published figure of the Echo Nest Taste Profile subset of the Million
Song Dataset (TP_*: users, songs, (user, song, play count) triplets), of its companion data sets
(the Last.fm tags, the top-MAGD genre labels), a choice, or was tuned (generate, measure with
`summary`, adjust) to the figure its comment names. docs/synthetic-data.md has the model, the
figures with their sources, and the known gaps. A (user, track) pair played n times is n rows with
label 1 (implicit feedback, as `ssp ingest` writes it without a label column): the count is the
confidence `ssp train --protocol recall` weighs the pair by. Interactions are produced chunk by
chunk (`PLAYS_CHUNK_USERS` users) with a random stream per chunk: the same parameters and seed
give identical tables.

Privacy: the generated plays stand in for private data and are treated as such downstream; the
items table (artist, genre, duration, tags) is public by declaration, like a real catalog. No real
play is read: the only inputs are published aggregate figures built into the constants below.
"""

from __future__ import annotations

import math
from statistics import NormalDist

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from pipelines.data.synth_movielens import _draw, _ml_select, _offsets, _rng, _stacked_cdf
from schemas.tables import INTERACTIONS, MULTIVALENT, NUMERIC, UNIVALENT, items_schema

# Random streams: SeedSequence(seed, spawn_key=(stream, ...)); 0..7 are the other generators'.
_PL_CATALOG, _PL_MODEL, _PL_CHUNK = 8, 9, 10

PLAYS_GENERATOR_VERSION = 1  # bump when the plays output for given parameters changes

# --- The Taste Profile subset (labrosa.ee.columbia.edu/millionsong/tasteprofile) and its analyses
TP_USERS, TP_SONGS, TP_TRIPLETS = 1_019_318, 384_546, 48_373_586  # published
TP_PLAYS = 138_680_243  # the sum of train_triplets.txt's play counts
TP_TRACKS_PER_USER = TP_TRIPLETS / TP_USERS  # 47.46
TP_MEAN_PLAYS = TP_PLAYS / TP_TRIPLETS  # 2.867 plays per (user, song) pair

PLAYS_USERS = 3500  # default number of users (a choice: about 480,000 plays, a few seconds)
PLAYS_CATALOG_GROWTH = 0.6  # catalog = TP_SONGS * (users / TP_USERS) ** growth (a choice, as for movielens)
MIN_TRACKS = 100
PLAYS_CHUNK_USERS = 4000  # users per chunk (about 550,000 plays)

# Tracks per user: (quantile, tracks) knots, log-linear between them, a Pareto tail above the last.
TRACK_KNOTS = ((0.0, 10), (0.25, 15), (0.5, 25), (0.75, 49))  # floor 10: a choice; quartiles published
TRACK_TAIL = 1.595  # Pareto exponent above the third quartile: tuned to the mean, TP_TRACKS_PER_USER
TRACK_MAX = 4316  # the tail's end: the published most songs of one user
TRACK_CAP = 0.5  # at most this share of the catalog (binds for tiny catalogs only)

# Popularity: selection weight along the popularity rank fraction (rank / catalog), log-log
# interpolated between (fraction, weight) knots. The 0.078 and 0.25 knots are tuned (3,500 users,
# seeds 0-5) to the play shares of the top 1.56% and 7.8% of songs; the head is a choice: a slope of
# 0.45 up to the top 0.01%, flat above, the same curve at every catalog size; below 0.25 the knots
# keep the published listener quartiles' and minimum's proportions 51 : 12 : 4 : 1.
POPULARITY_KNOTS = (
    (1e-4, 136.0),
    (0.0156, 14.0),
    (0.078, 0.42),
    (0.25, 0.235),
    (0.5, 0.235 * 12 / 51),
    (0.75, 0.235 * 4 / 51),
    (1.0, 0.235 / 51),
)

# Catalog: artists, genres, durations, tags
TRACKS_PER_ARTIST = 1_000_000 / 44_745  # the Million Song Dataset: a million tracks by 44,745 artists
ARTIST_SIZE_SD = 1.2  # sd of an artist's log catalog weight (a choice: a few prolific artists)
ARTIST_POPULARITY_SHARE = 0.5  # share of a track's log-popularity variance its artist explains (a choice)
GENRES = (  # the top-MAGD genre labels of the Million Song Dataset (Schindler et al. 2012), tracks per genre
    ("Pop_Rock", 238_786),
    ("Electronic", 41_075),
    ("Rap", 20_939),
    ("Jazz", 17_836),
    ("Latin", 17_590),
    ("RnB", 14_335),
    ("International", 14_242),
    ("Country", 11_772),
    ("Reggae", 6_946),
    ("Blues", 6_836),
    ("Vocal", 6_195),
    ("Folk", 5_865),
    ("New_Age", 4_010),
)
GENRE_LOG_DURATION = (0.0, 0.15, 0.02, 0.2, 0.0, 0.0, 0.0, -0.1, 0.0, 0.02, -0.1, -0.05, 0.25)  # a choice
MEDIAN_DURATION = 230.0  # seconds; the log-duration sds below are choices
ARTIST_DURATION_SD, TRACK_DURATION_SD = 0.12, 0.3
MIN_DURATION, MAX_DURATION = 30.0, 1800.0
LASTFM_TRACKS, LASTFM_TAGGED, LASTFM_TAGS, LASTFM_PAIRS = 943_347, 505_216, 522_366, 8_598_630  # published
MAX_TAGS = 100  # tags per track at most (a choice: Last.fm's top tags are a list of 100)
TAG_COUNT_SD = 1.0  # sd of a tagged track's log number of tag draws (a choice)
TAG_DRAWS = 21.0  # mean tag draws per tagged track: tuned to LASTFM_PAIRS / LASTFM_TAGGED = 17.0 after repeats
TAG_TASTE_SHARE = 0.5  # share of a track's tags drawn from its taste clusters' tags (a choice)

# Taste: clusters (scenes) inside genres; artists and tracks belong to a few of their genre's.
TASTE_CLUSTERS = 40  # about; every genre gets round(share * 40) clusters, at least one
ARTIST_CONCENTRATION = 0.1  # Dirichlet over the genre's clusters: an artist's scenes
ARTIST_SHARE = 0.5  # share of a track's membership that is its artist's (the rest its own)
TRACK_CONCENTRATION = 0.1  # Dirichlet over the genre's clusters: a track's own scenes
TASTE_CONCENTRATION = 0.03  # users' Dirichlet over the clusters, times the clusters' mass
TASTE_SHARE = 1.0  # share of a user's draws from their taste (the rest from popularity alone)

# Repeats: a pair's play count is floor(exp(L)), at least 1, at most MAX_PLAYS, with
# L = PLAY_LOG_MEAN + user - REPEAT_ACTIVITY * log(tracks / 25) + track + TASTE_REPEAT * affinity
# + N(0, PLAY_NOISE_SD^2).
PLAY_LOG_MEAN = 0.03  # tuned (3,500 users, seeds 0-5, as the next two): mean play count TP_MEAN_PLAYS
PLAY_NOISE_SD = 0.8  # a user's own spread of counts over their tracks (a choice)
USER_REPEAT_SD = 0.57  # tuned: share of pairs played once SHARE_ONCE
REPEAT_ACTIVITY = 0.13  # users of many tracks replay each less, per e-fold; tuned: top 10% users' share of plays
TRACK_REPEAT_SD = 0.2  # a track's replay value (a choice)
REPEAT_POPULARITY = 0.15  # popular tracks are replayed more, per normal score of the rank (a choice)
TASTE_REPEAT = 0.3  # a user replays tracks of their scenes more (a choice)
MAX_PLAYS = 5000  # plays of one pair at most (a choice: bounds a user's rows)
SHARE_ONCE = 0.58  # pairs played once; see docs/synthetic-data.md for its source
FIRST_PLAY_TIME, END_PLAY_TIME = 1_262_304_000, 1_293_840_000  # 2010 (a choice), UTC seconds

PLAYS_FEATURES = {"artist": UNIVALENT, "genre": UNIVALENT, "duration": NUMERIC, "tags": MULTIVALENT}
_STRING_FAMILIES = {"artist": pa.string(), "genre": pa.string()}


def catalog_size(users: int) -> int:
    """Tracks in the catalog for `users` users: TP_SONGS at TP_USERS, growing as users^PLAYS_CATALOG_GROWTH."""
    return max(MIN_TRACKS, int(round(TP_SONGS * (users / TP_USERS) ** PLAYS_CATALOG_GROWTH)))


def popularity_curve(items: int) -> np.ndarray:
    """Relative selection weight of the tracks in popularity order (most popular first)."""
    fraction = np.arange(1, items + 1, dtype=float) / items
    knots_u = np.log([u for u, _ in POPULARITY_KNOTS])
    knots_w = np.log([w for _, w in POPULARITY_KNOTS])
    return np.exp(np.interp(np.log(fraction), knots_u, knots_w))


def tracks_per_user(u: np.ndarray, items: int) -> np.ndarray:
    """Distinct tracks per user from uniforms u: log-linear between the TRACK_KNOTS quantiles, a
    Pareto tail (exponent TRACK_TAIL) truncated at TRACK_MAX above the last; at most TRACK_CAP of
    the catalog."""
    q = np.array([k for k, _ in TRACK_KNOTS])
    n = np.array([v for _, v in TRACK_KNOTS], float)
    body = np.exp(np.interp(u, q, np.log(n)))
    v = np.clip((u - q[-1]) / (1 - q[-1]), 0.0, 1.0)
    tail = n[-1] * (1 - v * (1 - (n[-1] / TRACK_MAX) ** TRACK_TAIL)) ** (-1.0 / TRACK_TAIL)
    out = np.rint(np.where(u <= q[-1], body, tail))
    return np.minimum(out, max(1, int(TRACK_CAP * items))).astype(np.int64)


def _genre_clusters() -> np.ndarray:
    """The genre of every taste cluster: round(share * TASTE_CLUSTERS) clusters per genre, at least one."""
    counts = np.array([c for _, c in GENRES], float)
    per_genre = np.maximum(1, np.rint(TASTE_CLUSTERS * counts / counts.sum())).astype(np.int64)
    return np.repeat(np.arange(len(GENRES)), per_genre)


def _dirichlet_within(rng: np.random.Generator, concentration: float, allowed: np.ndarray) -> np.ndarray:
    """Rows of Dirichlet(concentration) weights over the True entries of each row of `allowed`."""
    g = np.where(allowed, rng.gamma(concentration, size=allowed.shape), 0.0)
    return g / g.sum(axis=1, keepdims=True)


class _PlaysModel:
    """The catalog, the track parameters and the selection mixture of the play-log generator."""

    def __init__(self, users: int, seed: int):
        self.users = users
        self.items = m = catalog_size(users)
        rng = _rng(seed, _PL_CATALOG)
        # Artists: every artist has a track, the rest go by heavy-tailed catalog weights; ids shuffled.
        self.artists = a = max(1, int(round(m / TRACKS_PER_ARTIST)))
        size = np.exp(ARTIST_SIZE_SD * rng.standard_normal(a))
        self.artist = rng.permutation(np.concatenate([np.arange(a), _draw(rng, np.cumsum(size / size.sum()), m - a)]))
        shares = np.array([c for _, c in GENRES], float)
        artist_genre = _draw(rng, np.cumsum(shares / shares.sum()), a)
        self.genre = artist_genre[self.artist]
        # Duration: a genre's and an artist's offset on a log-normal around MEDIAN_DURATION.
        log_duration = (
            math.log(MEDIAN_DURATION)
            + np.asarray(GENRE_LOG_DURATION)[self.genre]
            + ARTIST_DURATION_SD * rng.standard_normal(a)[self.artist]
            + TRACK_DURATION_SD * rng.standard_normal(m)
        )
        self.duration = np.rint(np.clip(np.exp(log_duration), MIN_DURATION, MAX_DURATION))

        model = _rng(seed, _PL_MODEL)
        # Popularity: the calibrated curve along ranks; a track's rank follows its artist's and its own draw.
        latent = math.sqrt(ARTIST_POPULARITY_SHARE) * model.standard_normal(a)[self.artist] + math.sqrt(
            1 - ARTIST_POPULARITY_SHARE
        ) * model.standard_normal(m)
        self.rank = np.empty(m, np.int64)
        self.rank[np.argsort(-latent, kind="stable")] = np.arange(m)
        self.weight = popularity_curve(m)[self.rank]
        # Taste: an artist's scenes within its genre, a track's membership half its artist's, half its own.
        cluster_genre = _genre_clusters()
        in_genre = cluster_genre[None, :] == np.arange(len(GENRES))[:, None]
        artist_membership = _dirichlet_within(model, ARTIST_CONCENTRATION, in_genre[artist_genre])
        own = _dirichlet_within(model, TRACK_CONCENTRATION, in_genre[self.genre])
        self.membership = ARTIST_SHARE * artist_membership[self.artist] + (1 - ARTIST_SHARE) * own
        self.mass = self.weight @ self.membership  # each cluster's share of the selection weight
        q = np.vstack([self.weight[None, :], (self.weight[:, None] * self.membership).T])
        q[1:][self.mass == 0] = self.weight  # a scene of a genre the catalog lacks: no user's taste, never drawn
        self.q = q / q.sum(axis=1, keepdims=True)  # (1 + clusters) x items, rows sum to 1
        self.cdf = _stacked_cdf(self.q)
        # Replay value: a track's own draw, plus more for popular tracks (the normal score of the rank fraction).
        scores = np.array([NormalDist().inv_cdf(1 - (k + 0.5) / m) for k in range(m)])
        self.replay = REPEAT_POPULARITY * scores[self.rank] + TRACK_REPEAT_SD * model.standard_normal(m)
        self._tags(model, cluster_genre.size)

    def _tags(self, rng: np.random.Generator, clusters: int) -> None:
        """Tags: a popular track is more often tagged; a tagged track's tags are drawn half from the
        Zipf frequencies of the whole vocabulary, half from the tags of its scenes; repeats dropped."""
        m = self.items
        self.tag_vocabulary = v = max(50, int(round(m * LASTFM_TAGS / LASTFM_TRACKS)))
        exponent = LASTFM_TAGGED / (LASTFM_TRACKS - LASTFM_TAGGED)  # E[1 - u^b] = b / (b + 1) = the tagged share
        fraction = (self.rank + 0.5) / m
        tagged = rng.random(m) < 1 - fraction**exponent
        draws = np.where(
            tagged,
            np.minimum(
                MAX_TAGS, np.ceil(TAG_DRAWS * np.exp(TAG_COUNT_SD * rng.standard_normal(m) - TAG_COUNT_SD**2 / 2))
            ),
            0,
        ).astype(np.int64)
        track = np.repeat(np.arange(m), draws)
        frequency = 1.0 / np.arange(1, v + 1)
        home = rng.integers(0, clusters, v)  # every tag belongs to one scene
        by_scene = np.zeros((clusters, v))
        by_scene[home, np.arange(v)] = frequency[np.arange(v)]
        empty = by_scene.sum(axis=1) == 0
        by_scene[empty] = frequency  # a scene without tags of its own draws from all
        scene = _draw_rows(rng, _stacked_cdf(self.membership), track, clusters)
        from_scene = _draw_rows(rng, _stacked_cdf(by_scene), scene, v)
        anywhere = _draw(rng, np.cumsum(frequency / frequency.sum()), track.size)
        tag = np.where(rng.random(track.size) < TAG_TASTE_SHARE, from_scene, anywhere)
        pairs = np.unique(track * v + tag)  # one of each tag per track, in track then tag order
        self.tag_offsets = _offsets(np.bincount(pairs // v, minlength=m))
        self.tag_values = pairs % v

    def table(self) -> pa.Table:
        ids = pa.array(np.arange(1, self.items + 1, dtype=np.int64))
        titles = pc.binary_join_element_wise("Synthetic track", ids.cast(pa.string()), " ")
        width = max(4, len(str(self.artists - 1)))
        artists = pa.array([f"artist-{k:0{width}d}" for k in range(self.artists)], pa.string()).take(self.artist)
        genres = pa.array([name for name, _ in GENRES], pa.string()).take(self.genre)
        width = max(4, len(str(self.tag_vocabulary - 1)))
        names = pa.array([f"tag-{t:0{width}d}" for t in range(self.tag_vocabulary)], pa.string())
        tags = pa.ListArray.from_arrays(pa.array(self.tag_offsets, pa.int32()), names.take(self.tag_values))
        return pa.Table.from_arrays(
            [ids, titles, artists, genres, pa.array(self.duration), tags],
            schema=items_schema(PLAYS_FEATURES, _STRING_FAMILIES),
        )


def _draw_rows(rng: np.random.Generator, cdf: np.ndarray, rows: np.ndarray, width: int) -> np.ndarray:
    """One draw from each given row of a stacked cdf (indices 0..width-1)."""
    flat = np.searchsorted(cdf, rows + rng.random(rows.size), side="right")
    return np.clip(flat - rows * width, 0, width - 1)


def _pairs(rng: np.random.Generator, model: _PlaysModel, n: int) -> dict:
    """n new users: their distinct tracks (user index 0..n-1, track index) and each pair's play count."""
    need = tracks_per_user((rng.permutation(n) + rng.random(n)) / n, model.items)  # stratified: each u uniform
    base = TASTE_CONCENTRATION * model.mass.size * model.mass / model.mass.sum()
    taste = rng.gamma(base, size=(n, model.mass.size))
    taste /= taste.sum(axis=1, keepdims=True)
    mixture = np.hstack([np.full((n, 1), 1 - TASTE_SHARE), TASTE_SHARE * taste])
    row, item = _ml_select(rng, model, mixture, need)
    affinity = np.log(np.maximum(np.einsum("nk,nk->n", taste[row], model.membership[item]), 1e-9) * model.mass.size)
    log_plays = (
        PLAY_LOG_MEAN
        + (USER_REPEAT_SD * rng.standard_normal(n) - REPEAT_ACTIVITY * np.log(need / TRACK_KNOTS[2][1]))[row]
        + model.replay[item]
        + TASTE_REPEAT * np.clip(affinity, -3.0, 3.0)
        + PLAY_NOISE_SD * rng.standard_normal(row.size)
    )
    plays = np.clip(np.floor(np.exp(np.minimum(log_plays, math.log(MAX_PLAYS)))), 1, MAX_PLAYS).astype(np.int64)
    return {"row": row, "item": item, "plays": plays}


def _plays_batches(model: _PlaysModel, seed: int, progress):
    for index, start in enumerate(range(0, model.users, PLAYS_CHUNK_USERS)):
        n = min(PLAYS_CHUNK_USERS, model.users - start)
        rng = _rng(seed, _PL_CHUNK, index)
        pairs = _pairs(rng, model, n)
        row = np.repeat(pairs["row"], pairs["plays"])
        item = np.repeat(pairs["item"], pairs["plays"])
        stamps = rng.integers(FIRST_PLAY_TIME, END_PLAY_TIME, row.size, dtype=np.int64)
        order = np.lexsort((item, stamps, row))  # each user's plays in time order
        yield pa.RecordBatch.from_arrays(
            [
                pa.array(row[order] + start + 1),
                pa.array(item[order] + 1),
                pa.array(np.ones(row.size)),
                pa.array(stamps[order]),
            ],
            schema=INTERACTIONS,
        )
        progress.update(n)


def summary(user: np.ndarray, item: np.ndarray, items: int) -> dict:
    """The calibration figures of a play log (one row per play; dense user and track indices)."""
    pair, plays = np.unique(user.astype(np.int64) * items + item, return_counts=True)
    pair_user, pair_item = pair // items, pair % items
    tracks = np.bincount(pair_user)
    tracks = tracks[tracks > 0]
    per_user = np.bincount(user)
    per_user = np.sort(per_user[per_user > 0])[::-1]
    track_plays = np.sort(np.bincount(item, minlength=items))[::-1]
    listeners = np.bincount(pair_item, minlength=items)
    rated = listeners[listeners > 0]

    def head(share: float) -> float:
        return float(track_plays[: max(1, int(round(share * items)))].sum() / track_plays.sum())

    return {
        "users": int(tracks.size),
        "pairs": int(pair.size),
        "plays": int(user.size),
        "mean_plays": float(plays.mean()),
        "share_once": float(np.mean(plays == 1)),
        "median_plays": float(np.median(plays)),
        "tracks_q1": float(np.quantile(tracks, 0.25)),
        "tracks_median": float(np.median(tracks)),
        "tracks_q3": float(np.quantile(tracks, 0.75)),
        "tracks_mean": float(tracks.mean()),
        "user_plays_q1": float(np.quantile(per_user, 0.25)),
        "user_plays_median": float(np.median(per_user)),
        "user_plays_q3": float(np.quantile(per_user, 0.75)),
        "top10_users_share": float(per_user[: max(1, int(round(0.1 * per_user.size)))].sum() / per_user.sum()),
        "top1_tracks_share": head(0.01),
        "top1.56_tracks_share": head(6000 / TP_SONGS),
        "top7.8_tracks_share": head(30000 / TP_SONGS),
        "rated_share": float(rated.size / items),
        "listeners_q1_to_mean": float(np.quantile(listeners, 0.25) / listeners.mean()),
        "listeners_median_to_mean": float(np.median(listeners) / listeners.mean()),
        "listeners_q3_to_mean": float(np.quantile(listeners, 0.75) / listeners.mean()),
        "top_track_listeners": float(listeners.max() / tracks.size),
    }
