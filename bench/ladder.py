"""Non-private reference ladder of a rating data set: `python -m bench.ladder --data DIR`.

What this module owns: the non-private baselines that tell how much signal a data set holds, and
the summary statistics that say what it looks like, computed with numpy alone so that they are the
same everywhere (no engine, no TensorFlow). The benchmarks use them as reference lines, and the
calibration of `ssp synth --like movielens` (pipelines.data.synth_movielens) is checked against the
published MovieLens-1M figures below (`MOVIELENS_1M`, `LADDER_1M`).

Regression ladder (test RMSE on a random 80/10/10 train/valid/test split of the ratings; every
hyper-parameter is picked on valid and the test RMSE of that pick is reported):

- `global_mean`: the training mean.
- `item_mean`: mean + sum(y - mean) / (n_j + k) per item, the prior strength k picked from `ITEM_PRIORS`.
- `features`: the genres+year linear encoder. Item embedding e_j = W x_j (d = `FEATURE_DIM`), x_j =
  [1, multi-hot genres, one-hot 5-year bucket of the year]; prediction mean + u_k . e_j, where u_k is a
  per-user ridge fit (lambda * n_k) and W the ridge fit of all ratings given the u_k, alternated
  `FEATURE_ITERATIONS` times; lambda picked from `FEATURE_LAMBDAS`. It knows each item only through its
  public features.
- `mf`: biased matrix factorisation by ALS, mean + b_k + b_j + u_k . v_j (d = `MF_DIM`), weighted
  ridge lambda * n (ALS-WR) on both sides, `MF_ITERATIONS` sweeps, lambda picked from `MF_LAMBDAS`.

Ranking ladder (Liang et al. 2018, simplified): positives are ratings > 3.5; the items are the top
10% of rated items by number of positives; users with at least 5 positives on them are training,
validation or test users with probability 0.8 / 0.1 / 0.1; a held-out user's positives are fold-in
history or targets with probability 0.8 / 0.2 (users left without history or targets are dropped).
Metrics: trainer.metrics' ranking metrics over the items not in the user's history (Recall@20 =
hits / min(20, |targets|) averaged over users, the ladder's figure; Recall@50, NDCG@100 and the
coverage of the top 20 under "ranking").

- `popularity`: items ranked by their number of positives among training users.
- `ials`: implicit ALS (Hu, Koren, Volinsky 2008) on the training users' positives: confidence
  1 + alpha on positives, 1 on every other item, preference 1 / 0, ridge lambda, d = `IALS_DIM`;
  held-out users are folded in by the same user solve on their history; (alpha, lambda) picked from
  `IALS_GRID` on validation users.
- `ease` (a reference of the bench's ranking study, not a ladder step): EASE (Steck 2019), the
  closed-form item-item model B = I - P diag(1 / diag P), P = (X^T X + lambda I)^-1 over the
  training users' positives X, a held-out user scored by its history row times B; lambda picked
  from `EASE_LAMBDAS` on validation users.

Everything is seeded (`--seed`), so a data set has one ladder.

Privacy: none; these are non-private reference numbers computed on private data, for the operator.
"""

from __future__ import annotations

import argparse
import math
import sys
import time
from dataclasses import dataclass

import numpy as np

from schemas.errors import UserError
from trainer.metrics import RANKING, ranking_metrics
from trainer.solve import batched_solve

try:  # BLAS threads only slow down thousands of tiny solves, badly so on a shared machine
    from threadpoolctl import threadpool_limits
except ImportError:  # pragma: no cover - an optional helper; without it BLAS keeps its own setting
    threadpool_limits = None

# Published figures of MovieLens-1M (ratings.dat, movies.dat) and of the non-private ladder on it.
MOVIELENS_1M = {
    "users": 6040,
    "items": 3883,
    "rated_items": 3706,
    "ratings": 1_000_209,
    "stars": (0.056, 0.108, 0.261, 0.349, 0.226),
    "mean": 3.58,
    "sd": 1.117,
    "user_min": 20,
    "user_q1": 44,
    "user_median": 96,
    "user_q3": 208,
    "user_p90": 400,
    "user_max": 2314,
    "item_q1": 33,
    "item_median": 124,
    "item_q3": 350,
    "item_p90": 730,
    "item_max": 3428,
    "items_under_5": 0.078,
    "top10_share": 0.44,
    "sd_user_means": 0.43,
    "sd_item_means": 0.67,
    "genres_per_item": 1.65,
}
LADDER_1M = {
    "global_mean": 1.117,
    "item_mean": 0.982,
    "features": 0.987,
    "mf": 0.851,
    "popularity": 0.176,
    "ials": 0.32,
}

ITEM_PRIORS = (1.0, 3.0, 10.0, 30.0)
FEATURE_DIM = 16
FEATURE_ITERATIONS = 5
FEATURE_LAMBDAS = (0.05, 0.1, 0.2)
YEAR_BUCKET = 5
MF_DIM = 32
MF_ITERATIONS = 10
MF_LAMBDAS = (0.04, 0.07, 0.12)
IALS_DIM = 32
EASE_LAMBDAS = (10.0, 30.0, 100.0, 300.0, 1000.0, 3000.0)
IALS_ITERATIONS = 8
IALS_GRID = tuple((alpha, lam) for alpha in (1.0, 4.0, 16.0) for lam in (5.0, 30.0, 150.0))  # (alpha, lambda)
TOP_ITEMS = 0.1
POSITIVE = 3.5
MIN_POSITIVES = 5

_MAX_CELLS = 1 << 20  # padded rows per block in segment sums


# ---------------------------------------------------------------------------------------------
# Data


@dataclass
class Ratings:
    """A data set as dense indices: rows (user, item, label), and the catalog's feature matrix."""

    user: np.ndarray  # int64, 0..users-1
    item: np.ndarray  # int64, 0..items-1 (catalog rows)
    label: np.ndarray  # float64
    users: int
    items: int
    features: np.ndarray  # items x p: [1, multi-hot genres, one-hot year bucket]; empty if no features
    genres_per_item: float


def _feature_matrix(items_table) -> tuple[np.ndarray, float]:
    n = items_table.num_rows
    blocks = [np.ones((n, 1))]
    genres_per_item = math.nan
    names = items_table.column_names
    if "genres" in names:
        genres = items_table["genres"].to_pylist()
        vocabulary = {g: i for i, g in enumerate(sorted({g for gs in genres if gs for g in gs}))}
        x = np.zeros((n, len(vocabulary)))
        for row, gs in enumerate(genres):
            for g in gs or ():
                x[row, vocabulary[g]] = 1.0
        blocks.append(x)
        genres_per_item = float(x.sum() / n)
    if "year" in names:
        years = items_table["year"].to_numpy(zero_copy_only=False)
        years = np.where(np.isfinite(years.astype(float)), years, -1).astype(np.int64)
        buckets = np.where(years >= 0, years // YEAR_BUCKET, -1)
        values, codes = np.unique(buckets, return_inverse=True)
        blocks.append(np.eye(values.size)[codes])
    return np.hstack(blocks), genres_per_item


def load(data: str) -> Ratings:
    """A data set folder (or MovieLens folder, ingested into a temporary folder) as dense indices."""
    import tempfile

    from pipelines.data.datasets import is_dataset, open_dataset
    from schemas.storage import read_table

    if is_dataset(data):
        dataset = open_dataset(data)
        return _from_tables(read_table(dataset.interactions), read_table(dataset.items))
    from pipelines.data.ingest import ingest

    with tempfile.TemporaryDirectory(prefix="ladder-") as scratch:
        dataset = ingest(data, scratch)
        return _from_tables(read_table(dataset.interactions), read_table(dataset.items))


def _from_tables(interactions, items_table) -> Ratings:
    item_ids = items_table["item_id"].to_numpy()
    order = np.argsort(item_ids)
    rated = interactions["item_id"].to_numpy()
    item = order[np.searchsorted(item_ids[order], rated)]
    user_ids, user = np.unique(interactions["user_id"].to_numpy(), return_inverse=True)
    features, genres_per_item = _feature_matrix(items_table)
    return Ratings(
        user.astype(np.int64),
        item.astype(np.int64),
        interactions["label"].to_numpy().astype(np.float64),
        int(user_ids.size),
        int(item_ids.size),
        features,
        genres_per_item,
    )


# ---------------------------------------------------------------------------------------------
# Summary statistics


def summary(r: Ratings) -> dict:
    """The figures `MOVIELENS_1M` lists, measured on `r` (item figures over rated items)."""
    per_user = np.bincount(r.user, minlength=r.users)
    per_item_all = np.bincount(r.item, minlength=r.items)
    rated = per_item_all > 0
    per_item = per_item_all[rated]
    stars = np.round(r.label).astype(int)
    user_means = np.bincount(r.user, r.label, r.users) / np.maximum(per_user, 1)
    item_means = (np.bincount(r.item, r.label, r.items) / np.maximum(per_item_all, 1))[rated]
    uq = np.quantile(per_user, [0.25, 0.5, 0.75, 0.9])
    iq = np.quantile(per_item, [0.25, 0.5, 0.75, 0.9])
    top = np.sort(per_item)[::-1][: max(1, int(round(TOP_ITEMS * per_item.size)))]
    return {
        "users": r.users,
        "items": r.items,
        "rated_items": int(rated.sum()),
        "ratings": int(r.label.size),
        "stars": tuple(float(np.mean(stars == s)) for s in range(1, 6)),
        "mean": float(r.label.mean()),
        "sd": float(r.label.std()),
        "user_min": int(per_user[per_user > 0].min()),
        "user_q1": float(uq[0]),
        "user_median": float(uq[1]),
        "user_q3": float(uq[2]),
        "user_p90": float(uq[3]),
        "user_max": int(per_user.max()),
        "item_q1": float(iq[0]),
        "item_median": float(iq[1]),
        "item_q3": float(iq[2]),
        "item_p90": float(iq[3]),
        "item_max": int(per_item.max()),
        "items_under_5": float(np.mean(per_item < 5)),
        "top10_share": float(top.sum() / per_item.sum()),
        "sd_user_means": float(user_means[per_user > 0].std()),
        "sd_item_means": float(item_means.std()),
        "genres_per_item": r.genres_per_item,
    }


# ---------------------------------------------------------------------------------------------
# Linear algebra helpers


class _Segments:
    """Rows grouped by one side (users or items): row positions sorted by segment."""

    def __init__(self, key: np.ndarray, size: int):
        self.order = np.argsort(key, kind="stable")
        self.counts = np.bincount(key, minlength=size)
        self.starts = np.concatenate([[0], np.cumsum(self.counts)[:-1]])
        self.size = size
        # blocks of segments of similar length, padded to the block's longest
        by_length = np.argsort(self.counts, kind="stable")
        lengths = self.counts[by_length]
        level = np.ceil(np.log(np.maximum(lengths, 1)) / math.log(1.25))
        self.blocks = []
        start = int(np.searchsorted(lengths, 1))  # segments without rows get nothing
        while start < size:
            end = int(np.searchsorted(level, level[start], side="right"))
            width = int(lengths[end - 1])
            end = min(end, start + max(1, _MAX_CELLS // width))
            self.blocks.append((by_length[start:end], width))
            start = end

    def sums(self, other: np.ndarray, columns: np.ndarray, targets: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """Per segment s: A_s = sum x x^T and b_s = sum y x over its rows, x = other[columns[row]]."""
        d = other.shape[1]
        a = np.zeros((self.size, d, d))
        b = np.zeros((self.size, d))
        for segments, a_block, b_block in self._block_sums(other, columns, targets):
            a[segments], b[segments] = a_block, b_block
        return a, b

    def solve(self, other: np.ndarray, columns: np.ndarray, targets: np.ndarray, ridge: np.ndarray) -> np.ndarray:
        """Per segment s: (A_s + ridge_s I)^-1 b_s (0 for a segment without rows), one block at a
        time: all A_s at once would not fit at scale (10^6 users at d 33: 8.7 GB, twice)."""
        d = other.shape[1]
        solved = np.zeros((self.size, d))
        for segments, a_block, b_block in self._block_sums(other, columns, targets):
            solved[segments] = _solve(a_block, b_block, ridge[segments])
        return solved

    def _block_sums(self, other: np.ndarray, columns: np.ndarray, targets: np.ndarray):
        """(segments, their A_s, their b_s) block by block."""
        cols = columns[self.order]
        ys = targets[self.order]
        for segments, width in self.blocks:
            offsets = np.arange(width)
            mask = offsets[None, :] < self.counts[segments][:, None]
            rows = np.where(mask, self.starts[segments][:, None] + offsets[None, :], 0)
            x = other[cols[rows]] * mask[..., None]
            yield segments, np.matmul(x.transpose(0, 2, 1), x), np.einsum("sl,sld->sd", ys[rows] * mask, x)


def _solve(a: np.ndarray, b: np.ndarray, ridge: np.ndarray) -> np.ndarray:
    """Batched (a_s + ridge_s I)^-1 b_s."""
    d = a.shape[-1]
    return batched_solve(a + ridge[:, None, None] * np.eye(d), b)


def _rmse(prediction: np.ndarray, truth: np.ndarray) -> float:
    return float(np.sqrt(np.mean((prediction - truth) ** 2)))


# ---------------------------------------------------------------------------------------------
# Regression ladder


def split_ratings(r: Ratings, seed: int) -> np.ndarray:
    """Part of every rating: 0 train, 1 valid, 2 test, with probabilities 0.8 / 0.1 / 0.1."""
    u = np.random.default_rng(seed).random(r.label.size)
    return (u >= 0.8).astype(np.int8) + (u >= 0.9)


def item_mean(r: Ratings, part: np.ndarray) -> dict:
    train = part == 0
    mean = r.label[train].mean()
    n = np.bincount(r.item[train], minlength=r.items)
    s = np.bincount(r.item[train], r.label[train] - mean, r.items)
    best = None
    for k in ITEM_PRIORS:
        prediction = mean + s / (n + k)
        valid = _rmse(prediction[r.item[part == 1]], r.label[part == 1])
        if best is None or valid < best[0]:
            best = (valid, k, _rmse(prediction[r.item[part == 2]], r.label[part == 2]))
    return {"valid": best[0], "test": best[2], "prior": best[1]}


def _feature_fit(r, train, x, *, mean, lam, by_user, by_item, seed):
    rng = np.random.default_rng(seed)
    p = x.shape[1]
    w = rng.normal(0.0, 0.1, (FEATURE_DIM, p))
    w[0, 0] = 1.0
    y = r.label[train] - mean
    users, items = r.user[train], r.item[train]
    n_user = by_user.counts.astype(float)
    xx = np.einsum("ip,iq->ipq", x, x).reshape(r.items, p * p)
    weighted_xx = (by_item.counts @ xx).reshape(p, p) + 1e-6 * np.eye(p)
    u = None
    for _ in range(FEATURE_ITERATIONS):
        e = x @ w.T
        u = by_user.solve(e, items, y, lam * np.maximum(n_user, 1.0))
        a, b = by_item.sums(u, users, y)
        k = (a.reshape(r.items, -1).T @ xx).reshape(FEATURE_DIM, FEATURE_DIM, p, p).transpose(0, 2, 1, 3)
        k = k.reshape(FEATURE_DIM * p, FEATURE_DIM * p)
        rhs = (b.T @ x).reshape(-1)
        # ridge lambda * sum_j n_j |e_j|^2 on the item side too (ALS-WR), so W cannot grow to weaken u's
        k += lam * np.kron(np.eye(FEATURE_DIM), weighted_xx)
        w = np.linalg.solve(k, rhs).reshape(FEATURE_DIM, p)
    e = x @ w.T
    u = by_user.solve(e, items, y, lam * np.maximum(n_user, 1.0))
    return u, e


def features(r: Ratings, part: np.ndarray, seed: int = 0) -> dict:
    train = part == 0
    mean = r.label[train].mean()
    by_user = _Segments(r.user[train], r.users)
    by_item = _Segments(r.item[train], r.items)
    best = None
    for lam in FEATURE_LAMBDAS:
        u, e = _feature_fit(r, train, r.features, mean=mean, lam=lam, by_user=by_user, by_item=by_item, seed=seed)

        def predict(rows, u=u, e=e):
            return mean + np.einsum("nd,nd->n", u[r.user[rows]], e[r.item[rows]])

        valid = _rmse(predict(part == 1), r.label[part == 1])
        if best is None or valid < best[0]:
            best = (valid, lam, _rmse(predict(part == 2), r.label[part == 2]))
    return {"valid": best[0], "test": best[2], "lambda": best[1]}


def _mf_fit(r, train, *, mean, lam, by_user, by_item, seed):
    rng = np.random.default_rng(seed)
    users, items, y = r.user[train], r.item[train], r.label[train] - mean
    u = np.zeros((r.users, MF_DIM + 1))
    v = np.hstack([rng.normal(0.0, 0.1, (r.items, MF_DIM)), np.zeros((r.items, 1))])  # [v_j, b_j]
    n_user = np.maximum(by_user.counts, 1).astype(float)
    n_item = np.maximum(by_item.counts, 1).astype(float)
    for _ in range(MF_ITERATIONS):
        # users: [u_k, b_k] against [v_j, 1], target y - b_j
        fixed = np.hstack([v[:, :MF_DIM], np.ones((r.items, 1))])
        u = by_user.solve(fixed, items, y - v[items, MF_DIM], lam * n_user)
        fixed = np.hstack([u[:, :MF_DIM], np.ones((r.users, 1))])
        v = by_item.solve(fixed, users, y - u[users, MF_DIM], lam * n_item)
    return u, v


def mf(r: Ratings, part: np.ndarray, seed: int = 0) -> dict:
    train = part == 0
    mean = r.label[train].mean()
    by_user = _Segments(r.user[train], r.users)
    by_item = _Segments(r.item[train], r.items)
    best = None
    for lam in MF_LAMBDAS:
        u, v = _mf_fit(r, train, mean=mean, lam=lam, by_user=by_user, by_item=by_item, seed=seed)

        def predict(rows, u=u, v=v):
            uu, vv = u[r.user[rows]], v[r.item[rows]]
            return mean + uu[:, MF_DIM] + vv[:, MF_DIM] + np.einsum("nd,nd->n", uu[:, :MF_DIM], vv[:, :MF_DIM])

        valid = _rmse(predict(part == 1), r.label[part == 1])
        if best is None or valid < best[0]:
            best = (valid, lam, _rmse(predict(part == 2), r.label[part == 2]))
    return {"valid": best[0], "test": best[2], "lambda": best[1]}


# ---------------------------------------------------------------------------------------------
# Ranking ladder


@dataclass
class RankingSplit:
    items: int  # the top items, re-indexed 0..items-1
    train_user: np.ndarray  # positives of the training users (dense user index, item)
    train_item: np.ndarray
    train_users: int
    held: dict  # "valid"/"test": (history_user, history_item, target_user, target_item, users)


def split_ranking(r: Ratings, seed: int) -> RankingSplit:
    rng = np.random.default_rng(seed)
    positive = r.label > POSITIVE
    pos_user, pos_item = r.user[positive], r.item[positive]
    counts = np.bincount(pos_item, minlength=r.items)
    rated = int(np.count_nonzero(np.bincount(r.item, minlength=r.items)))
    top = np.argsort(-counts, kind="stable")[: max(1, int(round(TOP_ITEMS * rated)))]
    index = np.full(r.items, -1)
    index[top] = np.arange(top.size)
    keep = index[pos_item] >= 0
    pos_user, pos_item = pos_user[keep], index[pos_item[keep]]
    per_user = np.bincount(pos_user, minlength=r.users)
    eligible = np.flatnonzero(per_user >= MIN_POSITIVES)
    role = np.full(r.users, -1)
    draw = rng.random(eligible.size)
    role[eligible] = (draw >= 0.8).astype(int) + (draw >= 0.9)
    row_role = role[pos_user]
    train_users = np.flatnonzero(role == 0)
    dense = np.full(r.users, -1)
    dense[train_users] = np.arange(train_users.size)
    held = {}
    for name, code in (("valid", 1), ("test", 2)):
        rows = row_role == code
        users, items = pos_user[rows], pos_item[rows]
        target = rng.random(users.size) >= 0.8
        has_history = np.bincount(users[~target], minlength=r.users) > 0
        has_target = np.bincount(users[target], minlength=r.users) > 0
        ok = (has_history & has_target)[users]
        members = np.flatnonzero(has_history & has_target)
        local = np.full(r.users, -1)
        local[members] = np.arange(members.size)
        held[name] = (
            local[users[ok & ~target]],
            items[ok & ~target],
            local[users[ok & target]],
            items[ok & target],
            members.size,
        )
    train = row_role == 0
    return RankingSplit(top.size, dense[pos_user[train]], pos_item[train], train_users.size, held)


def ranking_at(scores: np.ndarray, history: tuple, targets: tuple) -> dict:
    """trainer.metrics' ranking metrics (RANKING's keys) of the held-out users' `scores`, their history
    (user, item) excluded, against their targets (user, item); NaN each without users."""
    if scores.shape[0] == 0:
        return dict.fromkeys(RANKING, math.nan)
    seen = np.zeros(scores.shape, bool)
    seen[history] = True
    aimed = np.zeros(scores.shape, bool)
    aimed[targets] = True
    report = ranking_metrics([(scores, seen, aimed)])
    return {key: report[key] for key in RANKING}


def _held_scores(split, name, score_fn) -> dict:
    h_user, h_item, t_user, t_item, users = split.held[name]
    scores = score_fn(h_user, h_item, users)
    return ranking_at(scores, (h_user, h_item), (t_user, t_item))


def _ranked(held: dict) -> dict:
    """A ranking step's result: valid and test Recall@20, and every ranking metric under "ranking"."""
    return {"valid": held["valid"]["recall_at_20"], "test": held["test"]["recall_at_20"], "ranking": held}


def popularity(split: RankingSplit) -> dict:
    counts = np.bincount(split.train_item, minlength=split.items).astype(float)

    def score(h_user, h_item, users):
        return np.broadcast_to(counts, (users, split.items))

    return _ranked({name: _held_scores(split, name, score) for name in ("valid", "test")})


def _ials_users(y, seg, item_of_row, alpha, lam):
    """Solve every user's factor against item factors y, from the user's positives."""
    ones = np.ones(item_of_row.size)
    a, b = seg.sums(y, item_of_row, ones)
    a = (y.T @ y)[None] + alpha * a
    return _solve(a, (1.0 + alpha) * b, np.full(seg.size, lam))


def ials(split: RankingSplit, seed: int = 0) -> dict:
    rng = np.random.default_rng(seed)
    by_user = _Segments(split.train_user, split.train_users)
    by_item = _Segments(split.train_item, split.items)
    folds = {name: _Segments(split.held[name][0], split.held[name][4]) for name in ("valid", "test")}
    best = None
    for alpha, lam in IALS_GRID:
        y = rng.normal(0.0, 0.1, (split.items, IALS_DIM))
        for _ in range(IALS_ITERATIONS):
            x = _ials_users(y, by_user, split.train_item, alpha, lam)
            y = _ials_users(x, by_item, split.train_user, alpha, lam)
        held = {}
        for name in ("valid", "test"):

            def score(h_user, h_item, users, *, name=name, y=y, alpha=alpha, lam=lam):
                return _ials_users(y, folds[name], h_item, alpha, lam) @ y.T

            held[name] = _held_scores(split, name, score)
        if best is None or held["valid"]["recall_at_20"] > best[0]["valid"]:
            best = (_ranked(held), alpha, lam)
    return {**best[0], "alpha": best[1], "lambda": best[2]}


def ease(split: RankingSplit) -> dict:
    """EASE (Steck 2019) of the training positives, lambda picked on validation users. Solved over
    the items with a training positive only (an item without one has a zero column, so zero
    weights to and from it: the same scores), the users x items matrix kept sparse."""
    from scipy import sparse

    trained = np.unique(split.train_item)
    x = sparse.csr_matrix(
        (np.ones(split.train_item.size), (split.train_user, np.searchsorted(trained, split.train_item))),
        shape=(split.train_users, trained.size),
    )
    gram = (x.T @ x).toarray()
    best = None
    for lam in EASE_LAMBDAS:
        p = np.linalg.inv(gram + lam * np.eye(trained.size))
        weights = -p / np.diag(p)[None, :]
        np.fill_diagonal(weights, 0.0)

        def score(h_user, h_item, users, *, weights=weights):
            kept = np.isin(h_item, trained)
            history = np.zeros((users, trained.size))
            history[h_user[kept], np.searchsorted(trained, h_item[kept])] = 1.0
            scores = np.zeros((users, split.items))
            scores[:, trained] = history @ weights
            return scores

        held = {name: _held_scores(split, name, score) for name in ("valid", "test")}
        if best is None or held["valid"]["recall_at_20"] > best[0]["valid"]:
            best = (_ranked(held), lam)
    return {**best[0], "lambda": best[1]}


# ---------------------------------------------------------------------------------------------
# The ladder


def ladder(r: Ratings, seed: int = 0, steps: tuple[str, ...] | None = None) -> dict:
    """Every step of the ladder (or `steps`): {name: {"test": ..., "valid": ..., picked settings, "seconds"}}.

    BLAS runs on one thread here (when threadpoolctl is installed): the work is thousands of
    tiny solves and products, which threads only slow down."""
    if threadpool_limits is None:
        return _ladder(r, seed, steps)
    with threadpool_limits(limits=1, user_api="blas"):
        return _ladder(r, seed, steps)


def _ladder(r: Ratings, seed: int, steps: tuple[str, ...] | None) -> dict:
    part = split_ratings(r, seed)
    ranking = None
    out = {}
    for name in steps or tuple(LADDER_1M):
        started = time.perf_counter()
        if name == "global_mean":
            mean = r.label[part == 0].mean()
            result = {"valid": _rmse(mean, r.label[part == 1]), "test": _rmse(mean, r.label[part == 2])}
        elif name == "item_mean":
            result = item_mean(r, part)
        elif name == "features":
            result = features(r, part, seed)
        elif name == "mf":
            result = mf(r, part, seed)
        elif name in ("popularity", "ials"):
            ranking = ranking or split_ranking(r, seed)
            result = popularity(ranking) if name == "popularity" else ials(ranking, seed)
        else:
            raise UserError(f"unknown ladder step {name!r}; known: {', '.join(LADDER_1M)}")
        out[name] = {**result, "seconds": time.perf_counter() - started}
    return out


_LABELS = {
    "global_mean": ("global mean", "RMSE"),
    "item_mean": ("per-item mean (shrunk)", "RMSE"),
    "features": ("genres+year encoder, per-user ridge", "RMSE"),
    "mf": ("biased ALS MF", "RMSE"),
    "popularity": ("popularity", "Recall@20"),
    "ials": ("implicit ALS", "Recall@20"),
}


def describe(results: dict, stats: dict | None = None) -> str:
    """The ladder (and summary) as text tables next to the MovieLens-1M figures."""
    lines = []
    if stats is not None:
        lines.append(f"{'statistic':<18}{'measured':>12}{'ML-1M':>12}")
        for key, target in MOVIELENS_1M.items():
            value = stats.get(key)
            if key == "stars":
                lines.append(
                    f"{'stars 1..5 (%)':<18}"
                    + " ".join(f"{100 * s:.1f}" for s in value)
                    + "   |   "
                    + " ".join(f"{100 * s:.1f}" for s in target)
                )
            else:
                lines.append(f"{key:<18}{value:>12.4g}{target:>12.4g}")
        lines.append("")
    lines.append(f"{'ladder step':<38}{'metric':<11}{'test':>8}{'valid':>8}{'ML-1M':>8}{'s':>7}  setting")
    for name, result in results.items():
        label, metric = _LABELS[name]
        setting = ", ".join(f"{k}={v:g}" for k, v in result.items() if k not in ("test", "valid", "seconds", "ranking"))
        lines.append(
            f"{label:<38}{metric:<11}{result['test']:>8.4f}{result['valid']:>8.4f}"
            f"{LADDER_1M[name]:>8.3f}{result['seconds']:>7.1f}  {setting}"
        )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.ladder", description=__doc__.split("\n\n")[0])
    parser.add_argument("--data", required=True, help="data set folder (ssp ingest / ssp synth) or MovieLens folder")
    parser.add_argument(
        "--seed", type=int, default=0, help="seed of the splits and initialisations (default %(default)s)"
    )
    parser.add_argument("--steps", help=f"comma-separated subset of: {','.join(LADDER_1M)} (default: all)")
    parser.add_argument("--no-summary", action="store_true", help="skip the summary statistics")
    args = parser.parse_args(argv)
    r = load(args.data)
    steps = tuple(s for s in args.steps.split(",") if s) if args.steps else None
    results = ladder(r, args.seed, steps)
    print(describe(results, None if args.no_summary else summary(r)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
