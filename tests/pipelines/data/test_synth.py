"""The synthetic data generator: exact shape, catalog, determinism, popularity, ratings and signal."""

from __future__ import annotations

import argparse
import itertools
import math
import os
import pathlib
import re

import numpy as np
import pyarrow as pa
import pytest

from pipelines.data import synth, synth_movielens
from pipelines.data.datasets import open_dataset
from schemas.storage import read_table
from schemas.tables import INTERACTIONS, MULTIVALENT, UNIVALENT, item_features, validate_interactions, validate_items

N, M, K = 2000, 300, 30  # the shared data set: 60,000 ratings


def _read(dataset):
    return read_table(dataset.interactions), read_table(dataset.items)


@pytest.fixture(scope="module")
def small(tmp_path_factory):
    dataset = synth.generate(str(tmp_path_factory.mktemp("synth") / "data"), N, M, K, alpha=1.0, seed=3)
    interactions, items = _read(dataset)
    return dataset, interactions, items


# ---------------------------------------------------------------------------------------------
# Shape of the data set


def test_row_count_users_and_manifest(small):
    dataset, interactions, _ = small
    assert interactions.num_rows == N * K
    users = interactions["user_id"].to_numpy()
    assert np.array_equal(np.unique(users), np.arange(1, N + 1))
    manifest = open_dataset(dataset.path).manifest
    assert manifest["source"] == "synthetic"
    assert manifest["generator"] == {
        "users": N,
        "items": M,
        "ratings_per_user": K,
        "alpha": 1.0,
        "seed": 3,
        "rank": 8,
        "version": synth.GENERATOR_VERSION,
    }
    assert manifest["ratings"] == N * K and manifest["users"] == N and manifest["items"] == M
    assert manifest["public_features"] == {"genres": MULTIVALENT, "tags": MULTIVALENT, "year": UNIVALENT}


def test_every_user_rates_exactly_k_distinct_catalog_items(small):
    _, interactions, items = small
    users = interactions["user_id"].to_numpy()
    rated = interactions["item_id"].to_numpy()
    assert np.array_equal(np.bincount(users, minlength=N + 1)[1:], np.full(N, K))
    pairs = np.unique(users * (M + 1) + rated)
    assert pairs.size == N * K  # no user rates an item twice
    assert np.isin(rated, items["item_id"].to_numpy()).all()
    assert rated.min() >= 1 and rated.max() <= M


def test_rows_are_grouped_by_user_in_time_order(small):
    _, interactions, _ = small
    users = interactions["user_id"].to_numpy()
    stamps = interactions["timestamp"].to_numpy()
    assert (np.diff(users) >= 0).all()
    same_user = np.diff(users) == 0
    assert (np.diff(stamps)[same_user] >= 0).all()
    assert stamps.min() >= synth.FIRST_TIME and stamps.max() < synth.END_TIME
    assert interactions["timestamp"].null_count == 0


def test_tables_validate_after_read_back(small):
    _, interactions, items = small
    assert validate_interactions(interactions).num_rows == N * K
    assert validate_items(items).num_rows == M
    assert interactions.schema.field("label").type == pa.float64()


def test_items_table_has_declared_features(small):
    _, _, items = small
    assert items.num_rows == M
    assert item_features(items.schema) == {"genres": MULTIVALENT, "tags": MULTIVALENT, "year": UNIVALENT}
    assert items["item_id"].to_pylist() == list(range(1, M + 1))
    assert items["title"].to_pylist()[:3] == ["Synthetic item 1", "Synthetic item 2", "Synthetic item 3"]
    assert items.schema.field("year").type == pa.int64()

    genres = items["genres"].to_pylist()
    assert all(1 <= len(g) <= 3 and len(set(g)) == len(g) for g in genres)
    genre_names = {g for gs in genres for g in gs}
    assert all(re.fullmatch(r"genre-\d\d", g) for g in genre_names)
    assert len(genre_names) == synth.GENRES  # 300 items use all 20 genres
    assert {len(g) for g in genres} == {1, 2, 3}

    tags = items["tags"].to_pylist()
    assert all(0 <= len(t) <= 5 for t in tags)
    assert {len(t) for t in tags} == set(range(6))
    vocabulary = max(50, M // 10)
    counts = np.zeros(vocabulary, int)
    for t in tags:
        for name in t:
            assert re.fullmatch(r"tag-\d{4}", name)
            counts[int(name[4:])] += 1
    # Zipf-ish frequencies: the head tag is far more common than the typical one.
    assert counts[0] > 5 * np.median(counts)

    years = items["year"].to_numpy()
    assert years.min() >= 1950 and years.max() <= 2023
    assert np.unique(years // 10).size == 8  # every decade 1950s..2020s occurs


def test_larger_catalogs_get_a_larger_tag_vocabulary(tmp_path):
    items = read_table(synth.generate(str(tmp_path / "d"), 10, 2000, 1, seed=1).items)
    names = {t for ts in items["tags"].to_pylist() for t in ts}
    assert max(int(n[4:]) for n in names) < 200
    assert len(names) > 100  # the vocabulary is 200 wide, not 50


# ---------------------------------------------------------------------------------------------
# Ratings


def test_ratings_are_half_stars_in_range_with_movielens_like_spread(small):
    _, interactions, _ = small
    labels = interactions["label"].to_numpy()
    assert labels.min() >= 0.5 and labels.max() <= 5.0
    assert np.array_equal(labels * 2, np.round(labels * 2))
    assert 3.3 < labels.mean() < 3.7
    assert 0.9 < labels.std() < 1.1
    assert np.unique(labels).size == 10  # the whole grid 0.5, 1.0, ..., 5.0 is used


def _als(users, items, labels, n_users, n_items, rank=8, lam=5.0, iterations=10):
    """Plain alternating least squares on centered ratings (the test's own low-rank fit)."""
    rng = np.random.default_rng(0)
    mean = labels.mean()
    z = labels - mean
    u = rng.normal(0, 0.1, (n_users, rank))
    v = rng.normal(0, 0.1, (n_items, rank))

    def solve(rows, cols, fixed, size):
        a = np.zeros((size, rank, rank))
        b = np.zeros((size, rank))
        np.add.at(a, rows, fixed[cols][:, :, None] * fixed[cols][:, None, :])
        np.add.at(b, rows, fixed[cols] * z[:, None])
        return np.linalg.solve(a + lam * np.eye(rank), b[..., None])[..., 0]

    for _ in range(iterations):
        u = solve(users, items, v, n_users)
        v = solve(items, users, u, n_items)
    return mean, u, v


def _rmse(prediction, truth):
    return float(np.sqrt(np.mean((prediction - truth) ** 2)))


def test_a_low_rank_model_beats_the_mean_on_held_out_ratings(small):
    _, interactions, _ = small
    users = interactions["user_id"].to_numpy() - 1
    rated = interactions["item_id"].to_numpy() - 1
    labels = interactions["label"].to_numpy()
    test = np.arange(labels.size) % K >= K - 5  # each user's 5 latest ratings
    mean, u, v = _als(users[~test], rated[~test], labels[~test], N, M)
    low_rank = _rmse(mean + np.einsum("ij,ij->i", u[users[test]], v[rated[test]]), labels[test])
    baseline = _rmse(labels[~test].mean(), labels[test])
    assert baseline > 0.9
    assert low_rank < 0.8 * baseline  # measured: 0.66 vs 0.95
    assert low_rank > 0.5  # the noise (sd 0.5 plus rounding) cannot be predicted


def _feature_matrix(items: pa.Table) -> np.ndarray:
    """Per item: genre means, tag means (one-hot bags) and a decade one-hot."""
    genres, tags = items["genres"].to_pylist(), items["tags"].to_pylist()
    genre_index = {g: i for i, g in enumerate(sorted({g for gs in genres for g in gs}))}
    tag_index = {t: i for i, t in enumerate(sorted({t for ts in tags for t in ts}))}
    decades = (items["year"].to_numpy() - 1950) // 10
    x = np.zeros((items.num_rows, len(genre_index) + len(tag_index) + 8))
    for row, (gs, ts) in enumerate(zip(genres, tags, strict=True)):
        for g in gs:
            x[row, genre_index[g]] += 1 / len(gs)
        for t in ts:
            x[row, len(genre_index) + tag_index[t]] += 1 / len(ts)
        x[row, len(genre_index) + len(tag_index) + decades[row]] = 1
    return x


def test_public_features_predict_ratings_of_unseen_items(small):
    """Cold start: item factors regressed on the features predict ratings of items never seen."""
    _, interactions, items = small
    users = interactions["user_id"].to_numpy() - 1
    rated = interactions["item_id"].to_numpy() - 1
    labels = interactions["label"].to_numpy()
    unseen = np.random.default_rng(1).permutation(M)[: M // 4]
    test = np.isin(rated, unseen)
    mean, u, v = _als(users[~test], rated[~test], labels[~test], N, M)
    x = _feature_matrix(items)
    seen = np.setdiff1d(np.arange(M), unseen)
    w = np.linalg.solve(x[seen].T @ x[seen] + np.eye(x.shape[1]), x[seen].T @ v[seen])
    from_features = _rmse(mean + np.einsum("ij,ij->i", u[users[test]], (x @ w)[rated[test]]), labels[test])
    baseline = _rmse(labels[~test].mean(), labels[test])
    assert from_features < 0.85 * baseline  # measured: 0.69 vs 0.94


def test_item_factors_are_mostly_explained_by_features():
    """The planted item factors are a linear function of the features plus a small residual."""
    items, rank = 2000, 8
    catalog = synth._Catalog(items, seed=0)
    v = synth.item_factors(catalog, rank=rank, seed=0)
    x = np.zeros((items, synth.GENRES + catalog.tag_vocabulary + 8))
    for j in range(items):
        genres = catalog.genre_values[catalog.genre_offsets[j] : catalog.genre_offsets[j + 1]]
        tags = catalog.tag_values[catalog.tag_offsets[j] : catalog.tag_offsets[j + 1]]
        np.add.at(x[j], genres, 1 / len(genres))
        if len(tags):
            np.add.at(x[j], synth.GENRES + tags, 1 / len(tags))
        x[j, synth.GENRES + catalog.tag_vocabulary + catalog.decades[j]] = 1
    fit, *_ = np.linalg.lstsq(x, v, rcond=None)
    residual = v - x @ fit
    total = v.var(axis=0).mean()
    assert 1.2 < total < 3.5  # per-coordinate variance of the item factors
    # What the features leave unexplained is the item-specific residual (sd 0.3 per coordinate).
    assert residual.var(axis=0).mean() == pytest.approx(synth.RESIDUAL_SD**2, rel=0.2)
    assert 1 - residual.var(axis=0).mean() / total > 0.9


# ---------------------------------------------------------------------------------------------
# Popularity


def _counts(tmp_path, users, items, k, alpha, seed=0):
    dataset = synth.generate(str(tmp_path / f"a{alpha}-s{seed}"), users, items, k, alpha=alpha, seed=seed)
    rated = read_table(dataset.interactions)["item_id"].to_numpy() - 1
    return np.bincount(rated, minlength=items)


@pytest.mark.parametrize("alpha", [1.0, 0.5])
def test_item_counts_follow_the_power_law(tmp_path, alpha):
    users, items, k = 10_000, 1000, 5
    counts = _counts(tmp_path, users, items, k, alpha)
    by_rank = counts[np.argsort(-synth.popularity(items, alpha, 0), kind="stable")]
    ranks = np.arange(1, items + 1)
    middle = (ranks >= 10) & (ranks <= 200)  # away from the saturated head and the sparse tail
    slope = np.polyfit(np.log(ranks[middle]), np.log(np.maximum(by_rank[middle], 0.5)), 1)[0]
    assert slope == pytest.approx(-alpha, abs=0.1)  # measured: -0.99 and -0.50


def test_popularity_is_skewed_for_alpha_one(small):
    _, interactions, _ = small
    counts = np.sort(np.bincount(interactions["item_id"].to_numpy(), minlength=M + 1)[1:])[::-1]
    top, bottom = counts[: M // 10].sum() / counts.sum(), counts[-(M // 10) :].sum() / counts.sum()
    assert top > 0.4  # saturated: a top item is rated by most users, at most once each
    assert bottom < 0.03
    assert top > 15 * bottom


def test_popularity_is_uniform_for_alpha_zero(tmp_path):
    counts = _counts(tmp_path, N, M, K, 0.0)
    expected = N * K / M  # 200 per item
    # Each user takes K of M items uniformly, so a count is Binomial(N, K/M).
    sd = math.sqrt(N * (K / M) * (1 - K / M))
    assert np.abs(counts - expected).max() < 5 * sd
    chi2 = np.sum((counts - expected) ** 2 / (N * (K / M) * (1 - K / M)))
    assert chi2 < (M - 1) + 5 * math.sqrt(2 * (M - 1))
    ordered = np.sort(counts)[::-1]
    assert 0.1 <= ordered[: M // 10].sum() / counts.sum() < 0.12
    assert 0.08 < ordered[-(M // 10) :].sum() / counts.sum() <= 0.1


def test_popularity_ranks_are_a_random_permutation_of_item_ids():
    p = synth.popularity(1000, 1.0, seed=0)
    assert p.sum() == pytest.approx(1.0)
    ordered = np.sort(p)[::-1]
    ranks = np.arange(1, 1001)
    assert np.allclose(ordered / ordered[0], ranks**-1.0)
    popularity_rank = np.argsort(np.argsort(-p))
    assert abs(np.corrcoef(popularity_rank, ranks)[0, 1]) < 0.1  # not item 1 first, item 2 second, ...
    assert not np.array_equal(popularity_rank, synth.popularity(1000, 1.0, seed=1).argsort())
    assert np.allclose(synth.popularity(10, 0.0, 5), 0.1)
    huge = synth.popularity(50, 500.0, 0)  # no overflow or NaN for extreme exponents
    assert np.isfinite(huge).all() and huge.max() == pytest.approx(1.0)


def _successive_inclusion(p: np.ndarray, k: int) -> np.ndarray:
    """Exact probability that each item is among k items drawn successively without replacement."""
    inclusion = np.zeros(p.size)
    for sequence in itertools.permutations(range(p.size), k):
        prob, left = 1.0, 1.0
        for item in sequence:
            prob *= p[item] / left
            left -= p[item]
        inclusion[list(sequence)] += prob
    return inclusion


def test_candidate_sampling_and_its_completion_are_exact_successive_sampling():
    p = synth.popularity(6, 1.5, seed=0)
    exact = _successive_inclusion(p, 3)
    n = 40_000
    tolerance = 5 * np.sqrt(exact * (1 - exact) / n)
    cdf = np.cumsum(p)
    rng = np.random.default_rng(0)

    plenty, found = synth._first_distinct(synth._draw(rng, cdf, (n, 200)), 3, 6)
    assert (found == 3).all()
    # Two draws give at most two distinct items: every row is completed by exponential keys.
    partial, found = synth._first_distinct(synth._draw(rng, cdf, (n, 2)), 3, 6)
    assert (found < 3).all()
    synth._complete(rng, partial, found, np.log(p))
    empty, none = np.full((n, 3), -1), np.zeros(n, int)
    synth._complete(rng, empty, none, np.log(p))
    for picked in (plenty, partial, empty):
        assert (np.sort(picked, axis=1)[:, 1:] != np.sort(picked, axis=1)[:, :-1]).all()
        inclusion = np.bincount(picked.ravel(), minlength=6) / n
        assert np.all(np.abs(inclusion - exact) < tolerance), (inclusion, exact)
        first = np.bincount(picked[:, 0], minlength=6) / n  # the first pick follows p itself
        assert np.all(np.abs(first - p) < 5 * np.sqrt(p * (1 - p) / n))


def test_heavy_skew_and_k_equal_to_m_still_give_k_distinct_items(tmp_path):
    for alpha, items, k in [(3.0, 100, 60), (1.0, 40, 40)]:
        dataset = synth.generate(str(tmp_path / f"{alpha}"), 300, items, k, alpha=alpha, seed=1)
        interactions = read_table(dataset.interactions)
        users, rated = interactions["user_id"].to_numpy(), interactions["item_id"].to_numpy()
        assert interactions.num_rows == 300 * k
        assert np.unique(users * (items + 1) + rated).size == 300 * k
        assert rated.min() >= 1 and rated.max() <= items


# ---------------------------------------------------------------------------------------------
# Determinism and streaming


def _files(folder):
    return {path.name: path.read_bytes() for path in sorted(pathlib.Path(folder).glob("*.parquet"))}


def test_same_seed_same_tables_other_seed_other_tables(tmp_path):
    a = synth.generate(str(tmp_path / "a"), 500, 100, 10, alpha=0.8, seed=11, rank=4)
    b = synth.generate(str(tmp_path / "b"), 500, 100, 10, alpha=0.8, seed=11, rank=4)
    c = synth.generate(str(tmp_path / "c"), 500, 100, 10, alpha=0.8, seed=12, rank=4)
    (ia, ta), (ib, tb), (ic, tc) = _read(a), _read(b), _read(c)
    assert ia.equals(ib, check_metadata=True) and ta.equals(tb, check_metadata=True)
    for table in ("interactions.parquet", "items.parquet"):
        assert _files(os.path.join(a.path, table)) == _files(os.path.join(b.path, table))  # byte-identical
    assert not ia.equals(ic)
    assert not ta.equals(tc)
    assert not np.array_equal(ia["item_id"].to_numpy(), ic["item_id"].to_numpy())
    assert not np.array_equal(ia["label"].to_numpy(), ic["label"].to_numpy())


def test_rank_and_alpha_change_the_output(tmp_path):
    base = _read(synth.generate(str(tmp_path / "a"), 200, 50, 5, seed=0))[0]
    other_rank = _read(synth.generate(str(tmp_path / "b"), 200, 50, 5, seed=0, rank=3))[0]
    other_alpha = _read(synth.generate(str(tmp_path / "c"), 200, 50, 5, seed=0, alpha=0.0))[0]
    assert not np.array_equal(base["label"].to_numpy(), other_rank["label"].to_numpy())
    assert not np.array_equal(base["item_id"].to_numpy(), other_alpha["item_id"].to_numpy())


def _record_batches(monkeypatch, measure) -> list:
    """A list that receives measure(batch) of every record batch synth streams into write_dataset."""
    seen = []
    real = synth.write_dataset

    def spy(out, items, batches, manifest, **options):
        def recorded():
            for batch in batches:
                seen.append(measure(batch))
                yield batch

        return real(out, items, recorded(), manifest, **options)

    monkeypatch.setattr(synth, "write_dataset", spy)
    return seen


def test_interactions_are_streamed_chunk_by_chunk(tmp_path, monkeypatch):
    monkeypatch.setattr(synth, "CHUNK_USERS", 64)
    sizes = _record_batches(monkeypatch, lambda batch: batch.num_rows)
    dataset = synth.generate(str(tmp_path / "d"), 1000, 80, 7, seed=2)
    assert sizes == [64 * 7] * 15 + [40 * 7]
    interactions = read_table(dataset.interactions)
    users, rated = interactions["user_id"].to_numpy(), interactions["item_id"].to_numpy()
    assert np.array_equal(users, np.repeat(np.arange(1, 1001), 7))  # contiguous across chunks
    assert np.unique(users * 81 + rated).size == 7000
    # A chunk's rows are fixed by (seed, chunk index): the first chunk's users get the same ratings
    # whatever the total number of users.
    again = read_table(synth.generate(str(tmp_path / "e"), 64, 80, 7, seed=2).interactions)
    assert again.equals(interactions.slice(0, 64 * 7))


def test_chunks_shrink_when_users_rate_many_items():
    assert synth._chunk_users(30) == synth.CHUNK_USERS
    assert synth._chunk_users(1000) * 1000 <= synth.MAX_CHUNK_ROWS
    assert synth._chunk_users(10**7) == 1


# ---------------------------------------------------------------------------------------------
# Parameters and command line


@pytest.mark.parametrize(
    ("kwargs", "name"),
    [
        ({"users": 0}, "users"),
        ({"users": 2.5}, "users"),
        ({"users": True}, "users"),
        ({"items": -3}, "items"),
        ({"ratings_per_user": 0}, "ratings_per_user"),
        ({"ratings_per_user": 11}, "ratings_per_user"),
        ({"alpha": -0.1}, "alpha"),
        ({"alpha": float("nan")}, "alpha"),
        ({"alpha": float("inf")}, "alpha"),
        ({"alpha": "1"}, "alpha"),
        ({"seed": -1}, "seed"),
        ({"seed": 1.0}, "seed"),
        ({"rank": 0}, "rank"),
        ({"out": ""}, "out"),
    ],
)
def test_bad_parameters_raise_value_error_naming_the_parameter(tmp_path, kwargs, name):
    args = {"out": str(tmp_path / "d"), "users": 5, "items": 10, "ratings_per_user": 3, **kwargs}
    with pytest.raises(ValueError, match=rf"\b{name}\b"):
        synth.generate(**args)
    assert not os.path.exists(tmp_path / "d")


def test_k_above_m_names_both(tmp_path):
    with pytest.raises(ValueError, match=r"ratings_per_user \(11\) cannot exceed items \(10\)"):
        synth.generate(str(tmp_path / "d"), 5, 10, 11)


def _parser():
    parser = argparse.ArgumentParser()
    synth.add_arguments(parser)
    return parser


def test_cli_arguments_defaults_and_run(tmp_path, capsys):
    args = _parser().parse_args(
        ["--users", "40", "--items", "30", "--ratings-per-user", "4", "--out", str(tmp_path / "d")]
    )
    # alpha and rank left out mean 1.0 and 8 (None, so that --like can refuse them when given)
    assert (args.users, args.items, args.ratings_per_user, args.alpha, args.seed, args.rank, args.like) == (
        40,
        30,
        4,
        None,
        0,
        None,
        None,
    )
    assert synth.run(args) == 0
    out = capsys.readouterr().out
    assert "160 ratings" in out and "40 users" in out and "30 items" in out and " s" in out
    assert read_table(str(tmp_path / "d" / "interactions.parquet")).num_rows == 160
    given = _parser().parse_args(
        [
            "--users",
            "1",
            "--items",
            "2",
            "--ratings-per-user",
            "1",
            "--out",
            "x",
            "--alpha",
            "0",
            "--seed",
            "9",
            "--rank",
            "3",
        ]
    )
    assert (given.alpha, given.seed, given.rank) == (0.0, 9, 3)


@pytest.mark.parametrize(
    "argv",
    [
        [],  # out is always required
        ["--users", "0", "--items", "2", "--ratings-per-user", "1", "--out", "x"],
        ["--users", "1", "--items", "2", "--ratings-per-user", "1", "--out", "x", "--alpha", "-1"],
        ["--users", "1", "--items", "2", "--ratings-per-user", "1", "--out", "x", "--seed", "-2"],
        ["--users", "1", "--items", "2", "--ratings-per-user", "1"],
        ["--like", "netflix", "--out", "x"],
    ],
)
def test_cli_rejects_bad_or_missing_options(argv, capsys):
    with pytest.raises(SystemExit) as exit_info:
        _parser().parse_args(argv)
    assert exit_info.value.code == 2
    assert "error" in capsys.readouterr().err


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--out", "x"], "--users, --items, --ratings-per-user required"),
        (["--items", "2", "--ratings-per-user", "1", "--out", "x"], "--users required"),
        (["--users", "5", "--items", "2", "--out", "x"], "--ratings-per-user required"),
        (["--like", "plays", "--items", "10", "--out", "x"], "--items cannot be combined with --like plays"),
        (["--like", "movielens", "--ratings-per-user", "3", "--alpha", "1", "--out", "x"], "--alpha cannot"),
        (["--like", "movielens", "--rank", "4", "--out", "x"], "--rank cannot"),
    ],
)
def test_cli_options_that_go_together(argv, message, tmp_path, capsys):
    """Which sizes are needed depends on --like: checked before anything is written, naming the flags."""
    args = _parser().parse_args(argv)
    with pytest.raises(ValueError, match=re.escape(message)):
        synth.run(args)
    with pytest.raises(SystemExit) as exit_info:  # python -m pipelines.data.synth: an argparse error
        synth.main(argv)
    assert exit_info.value.code == 2 and message in capsys.readouterr().err
    assert not os.path.exists("x")


def test_progress_goes_to_stderr(tmp_path, capsys):
    synth.generate(str(tmp_path / "d"), 30, 10, 2, progress=True)
    captured = capsys.readouterr()
    assert captured.out == ""
    assert "30" in captured.err and "user" in captured.err


# ---------------------------------------------------------------------------------------------
# MovieLens-like data (`like="movielens"`): calibrated to the published MovieLens-1M figures


@pytest.fixture(scope="module")
def movielens(tmp_path_factory):
    """The full-size default: 6,040 users, seed 0 (about 1,000,000 ratings; a few seconds)."""
    from bench import ladder

    dataset = synth.generate(str(tmp_path_factory.mktemp("ml") / "data"), like="movielens")
    return dataset, ladder.load(dataset.path), read_table(dataset.items)


# (figure, tolerance, relative?) around bench.ladder.MOVIELENS_1M; measured values in the comments
SUMMARY_TOLERANCES = {
    "users": (0, False),
    "items": (0, False),
    "rated_items": (0.01, True),
    "ratings": (0.01, True),
    "mean": (0.02, False),
    "sd": (0.01, True),
    "user_min": (0, False),
    "user_q1": (0.02, True),
    "user_median": (0.02, True),
    "user_q3": (0.02, True),
    "user_p90": (0.02, True),
    "user_max": (0.15, True),
    "item_q1": (0.1, True),
    "item_median": (0.05, True),
    "item_q3": (0.03, True),
    "item_p90": (0.03, True),
    "item_max": (0.05, True),
    "items_under_5": (0.01, False),
    "top10_share": (0.01, False),
    "sd_user_means": (0.05, True),
    "sd_item_means": (0.06, True),
    "genres_per_item": (0.03, True),
}


def test_movielens_summary_matches_the_published_figures(movielens):
    from bench import ladder

    stats = ladder.summary(movielens[1])
    assert stats["stars"] == pytest.approx(ladder.MOVIELENS_1M["stars"], abs=0.003)
    for key, (tolerance, relative) in SUMMARY_TOLERANCES.items():
        target = ladder.MOVIELENS_1M[key]
        bound = pytest.approx(target, rel=tolerance) if relative else pytest.approx(target, abs=tolerance)
        assert stats[key] == bound, (key, stats[key], target)
    assert set(SUMMARY_TOLERANCES) | {"stars"} == set(ladder.MOVIELENS_1M)  # every figure is checked


def test_movielens_manifest_and_rows(movielens):
    dataset, r, _ = movielens
    manifest = open_dataset(dataset.path).manifest
    assert manifest["generator"] == {
        "like": "movielens",
        "users": 6040,
        "items": 3883,
        "seed": 0,
        "version": synth_movielens.ML_GENERATOR_VERSION,
    }
    assert manifest["public_features"] == {"genres": MULTIVALENT, "year": UNIVALENT}
    assert manifest["label_range"] == [1.0, 5.0]
    interactions = read_table(dataset.interactions)
    labels = interactions["label"].to_numpy()
    assert np.array_equal(labels, np.round(labels)) and set(np.unique(labels)) == {1.0, 2.0, 3.0, 4.0, 5.0}
    users, stamps = interactions["user_id"].to_numpy(), interactions["timestamp"].to_numpy()
    assert (np.diff(users) >= 0).all() and (np.diff(stamps)[np.diff(users) == 0] >= 0).all()
    assert stamps.min() >= synth_movielens.FIRST_ML_TIME and stamps.max() < synth_movielens.END_ML_TIME
    assert np.unique(r.user * r.items + r.item).size == r.label.size  # nobody rates a movie twice


def test_movielens_items_look_like_ingested_movielens(movielens, tmp_path):
    """Same schema (families, kinds, types) as `ssp ingest` of the bundled MovieLens, and realistic genres."""
    from pipelines.data.ingest import BUNDLED, ingest
    from trainer.features import FeatureSpace

    _, _, items = movielens
    ingested = read_table(ingest(BUNDLED, str(tmp_path / "ingested")).items)
    assert items.schema.equals(ingested.schema, check_metadata=True)
    assert validate_items(items).num_rows == 3883

    genres = items["genres"].to_pylist()
    counts = {g: sum(g in gs for gs in genres) for g in synth_movielens.ML_GENRES}
    assert all(1 <= len(gs) <= 5 and len(set(gs)) == len(gs) for gs in genres)
    assert sorted(counts, key=counts.get)[-2:] == ["Comedy", "Drama"]  # Drama, then Comedy, most common
    assert min(counts.values()) > 0  # all 18 genres occur
    assert set(counts) <= {g for gs in ingested["genres"].to_pylist() for g in gs} | {"Children's"}  # ML names
    years = items["year"].to_numpy()
    assert years.min() >= 1919 and years.max() == 2000 and 0.4 < np.mean(years >= 1990) < 0.7

    space = FeatureSpace.from_items(items, use_item_id=False)  # the features encoder's view of the catalog
    assert [f.name for f in space.families] == ["genres", "year"]
    assert space.families[0].size == 19 and space.families[1].size == np.unique(years).size + 1


def test_movielens_item_effects_are_only_partly_public():
    """What the features explain of an item's effect and factor is a part, not the whole."""
    model = synth_movielens._MovieLensModel(6040, seed=0)
    x = np.zeros((model.items, len(synth_movielens.ML_GENRES) + 20))
    for j in range(model.items):
        x[j, model.genre_values[model.genre_offsets[j] : model.genre_offsets[j + 1]]] = 1
        x[j, len(synth_movielens.ML_GENRES) + (model.years[j] - synth_movielens.FIRST_ML_YEAR) // 5] = 1
    for target in (model.bias, model.factors):
        fit, *_ = np.linalg.lstsq(x, target, rcond=None)
        explained = 1 - np.var(target - x @ fit, axis=0).sum() / np.var(target, axis=0).sum()
        assert 0.2 < explained < 0.7, explained


def test_movielens_catalog_grows_sublinearly_and_activity_keeps_its_shape():
    assert synth_movielens.catalog_size(6040) == 3883
    assert synth_movielens.catalog_size(100_000) == 20_919 and synth_movielens.catalog_size(10**6) == 83_281
    assert synth_movielens.catalog_size(1) == synth_movielens.MIN_ML_ITEMS
    u = (np.arange(100_000) + 0.5) / 100_000
    for items in (3883, 83_281):  # the cap (62% of the catalog) never binds at these sizes
        n = synth_movielens.activity(u, items)
        assert n.min() == 20 and n.max() <= 2314
        assert np.quantile(n, [0.25, 0.5, 0.75, 0.9]) == pytest.approx([44, 96, 208, 400], abs=1)
        assert n.mean() == pytest.approx(165.6, rel=0.01)
    assert synth_movielens.activity(u, 50).max() == 31  # a tiny catalog caps a user at 62% of it
    head = synth_movielens.popularity_curve(83_281)
    assert (np.diff(head) <= 0).all() and head[0] == pytest.approx(synth_movielens.popularity_curve(3883)[0])


def test_movielens_is_streamed_chunk_by_chunk_and_deterministic(tmp_path, monkeypatch):
    monkeypatch.setattr(synth_movielens, "ML_CHUNK_USERS", 128)
    sizes = _record_batches(
        monkeypatch, lambda batch: (batch.num_rows, np.unique(batch.column("user_id").to_numpy()).size)
    )
    a = synth.generate(str(tmp_path / "a"), users=300, like="movielens", seed=5)
    assert [users for _, users in sizes] == [128, 128, 44]
    b = synth.generate(str(tmp_path / "b"), users=300, like="movielens", seed=5)
    c = synth.generate(str(tmp_path / "c"), users=300, like="movielens", seed=6)
    (ia, ta), (ib, tb), (ic, tc) = _read(a), _read(b), _read(c)
    assert ia.equals(ib) and ta.equals(tb, check_metadata=True)
    assert not ia.equals(ic) and not ta.equals(tc)
    users = ia["user_id"].to_numpy()
    assert np.array_equal(np.unique(users), np.arange(1, 301))
    assert np.bincount(users)[1:].min() >= 20  # every user has at least 20 ratings
    assert a.manifest["items"] == synth_movielens.catalog_size(300)


def test_movielens_rejects_the_sizes_it_sets(tmp_path):
    for kwargs, name in [
        ({"items": 0}, "items"),
        ({"ratings_per_user": 0}, "ratings_per_user"),
        ({"alpha": 1.0}, "alpha"),
        ({"rank": 4}, "rank"),
        ({"users": 0}, "users"),
        ({"seed": -1}, "seed"),
    ]:
        with pytest.raises(ValueError, match=rf"\b{name}\b"):
            synth.generate(str(tmp_path / "d"), like="movielens", **kwargs)
    with pytest.raises(ValueError, match="like must be one of movielens"):
        synth.generate(str(tmp_path / "d"), users=10, like="netflix")
    with pytest.raises(ValueError, match="items is required"):
        synth.generate(str(tmp_path / "d"), users=10)
    assert not os.path.exists(tmp_path / "d")


def test_movielens_ratings_per_user_rescales_the_activity_keeping_its_shape(tmp_path):
    """K sets the mean ratings per user (for studies at many users); the tail stays heavy."""
    full = synth.generate(str(tmp_path / "full"), like="movielens", users=2000, seed=4)
    fewer = synth.generate(str(tmp_path / "fewer"), like="movielens", users=2000, seed=4, ratings_per_user=20)

    def per_user(data):
        return np.bincount(read_table(data.interactions, columns=["user_id"])["user_id"].to_numpy())[1:]

    many, few = per_user(full), per_user(fewer)
    assert 150 < many.mean() < 185 and 17 < few.mean() < 23  # MovieLens-1M's 165.6, and about K
    assert (
        few.min() >= 1 and np.percentile(few, 99) / np.median(few) > 5
    )  # heavy-tailed still: ML-1M's p99 / median is about 10
    assert (
        fewer.manifest["generator"]["mean_ratings_per_user"] == 20
        and "mean_ratings_per_user" not in full.manifest["generator"]
    )


def test_movielens_takes_another_data_sets_catalog_size(tmp_path):
    """`items` gives the catalog another shape's size (ML10M's 10,677 movies for 69,878 users, in
    small here): every id within it, the popularity still heavy-tailed; left out, the same tables."""
    given = synth.generate(str(tmp_path / "given"), like="movielens", users=400, items=900, seed=3, ratings_per_user=40)
    items = read_table(given.items)["item_id"].to_numpy()
    rated = read_table(given.interactions, columns=["item_id"])["item_id"].to_numpy()
    assert items.tolist() == list(range(1, 901)) and rated.min() >= 1 and rated.max() <= 900
    assert given.manifest["generator"]["items"] == 900 and given.manifest["generator"]["catalog_given"]
    counts = np.sort(np.bincount(rated, minlength=901)[1:])[::-1]
    assert counts[:90].sum() > 0.4 * counts.sum()  # the top 10% of the catalog takes a large share
    own = synth.generate(str(tmp_path / "own"), like="movielens", users=400, seed=3, ratings_per_user=40)
    again = synth.generate(str(tmp_path / "again"), like="movielens", users=400, seed=3, ratings_per_user=40)
    assert read_table(own.interactions).equals(read_table(again.interactions))
    assert (
        own.manifest["generator"]["items"] == synth_movielens.catalog_size(400)
        and "catalog_given" not in own.manifest["generator"]
    )
    with pytest.raises(ValueError, match=r"\bitems\b is set by like='plays'"):
        synth.generate(str(tmp_path / "plays"), like="plays", users=100, items=50)


def test_cli_like_movielens(tmp_path, capsys):
    args = _parser().parse_args(["--like", "movielens", "--users", "200", "--out", str(tmp_path / "d"), "--seed", "2"])
    assert synth.run(args) == 0
    out = capsys.readouterr().out
    assert "200 users" in out and f"{synth_movielens.catalog_size(200):,} items" in out
    assert open_dataset(str(tmp_path / "d")).manifest["generator"]["like"] == "movielens"
    args = _parser().parse_args(
        ["--like", "movielens", "--users", "200", "--items", "333", "--out", str(tmp_path / "e")]
    )
    assert synth.run(args) == 0 and "333 items" in capsys.readouterr().out


def test_synthetic_interactions_declare_whole_users_in_order(tmp_path):
    # both generators stream users in order: the files say so (a split then needs no shuffle); rows
    # that go back in user_id are written without the declaration
    from pipelines.data.chunks import users_together
    from pipelines.data.datasets import write_dataset

    for data in (
        synth.generate(str(tmp_path / "ideal"), 200, 50, 5),
        synth.generate(str(tmp_path / "ml"), 200, like="movielens"),
    ):
        users = read_table(data.interactions)["user_id"].to_numpy()
        assert users_together(data.interactions) and np.all(users[1:] >= users[:-1])
    items = read_table(data.items)
    backwards = pa.table(
        {"user_id": [2, 1], "item_id": items["item_id"].to_numpy()[:2], "label": [1.0, 2.0], "timestamp": [0, 0]},
        schema=INTERACTIONS,
    )
    assert not users_together(
        write_dataset(str(tmp_path / "back"), items, backwards.to_batches(), {"source": "test"}).interactions
    )
