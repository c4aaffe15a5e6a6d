"""Evaluation metrics of the two benchmark protocols: RMSE (regression) and the ranking metrics.

NumPy only (no TensorFlow): the metrics run wherever the predictions are.

The ranking metrics follow Liang et al. 2018 (VAE-CF). Each user's fold-in history is excluded from
the ranking (its scores become -inf), and ties are broken deterministically in favour of the lower
item index (Liang's code leaves them to argpartition), so every cut-off reads one ranking: the top
k are the first k of the top 100. For a user with at least one target:

- Recall@k: the targets among the top k, divided by min(k, number of targets);
- NDCG@k: DCG = sum of 1 / log2(rank + 2) over the targets at ranks 0..k-1 (binary relevance),
  divided by the IDCG, the same sum over the first min(k, number of targets) ranks;

each averaged over those users. Catalog coverage of the top k: the share of the catalog's items
that are in the top k of at least one such user (history items that fill a short list excluded).
Precision@k: the targets among the top k, divided by k; AP@k: the sum of Precision@r at the rank r
of each target in the top k, divided by min(k, number of targets) (MAP@k its mean).
`ranking_metrics` computes the protocol's four (Recall@20, Recall@50, NDCG@100, coverage of the
top 20), Recall@20 per popularity bucket and, at any list of k (`ssp evaluate --metrics-at`), Recall,
Precision, NDCG, MAP and coverage in one pass over blocks of users: the one definition that `ssp
train`, `ssp evaluate` and the benchmarks share.

Privacy: computed on held-out rows on the trusted side; not a release.
"""

from __future__ import annotations

from collections.abc import Iterable

import numpy as np

from schemas.errors import UserError

_ROW_BLOCK = 1024  # users ranked at a time, to bound the temporaries of large score matrices

# The ranking protocol's metrics (key -> name), in report order; "recall_at_20" is the primary one.
RANKING = {
    "recall_at_20": "Recall@20",
    "recall_at_50": "Recall@50",
    "ndcg_at_100": "NDCG@100",
    "coverage_at_20": "coverage@20",
}
_DEPTH = 100  # the deepest cut-off of RANKING: one ranking of this many items per user serves all


def _mask(name: str, mask, shape: tuple[int, ...]) -> np.ndarray:
    mask = np.asarray(mask)
    if mask.shape != shape:
        raise UserError(f"{name} must have the shape of scores {shape}, got {mask.shape}")
    if mask.dtype != bool:
        if not np.all((mask == 0) | (mask == 1)):
            raise UserError(f"{name} must be a boolean (or 0/1) mask")
        mask = mask.astype(bool)
    return mask


def _k(k) -> int:
    if isinstance(k, bool) or not isinstance(k, (int, np.integer)) or k < 1:
        raise UserError(f"k must be a positive integer, got {k!r}")
    return int(k)


def checked(scores, history, targets) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(scores as float64, history, targets as booleans) after the checks every ranking metric makes:
    a 2-D (users x items) score matrix without NaN, and two disjoint masks of its shape (a target in
    the history could never be recommended)."""
    scores = np.asarray(scores, dtype=np.float64)
    if scores.ndim != 2:
        raise UserError(f"scores must be a 2-D (users x items) array, got shape {scores.shape}")
    history = _mask("history", history, scores.shape)
    targets = _mask("targets", targets, scores.shape)
    if np.isnan(scores).any():
        raise UserError("scores hold NaN")
    if (history & targets).any():
        user = int(np.flatnonzero((history & targets).any(axis=1))[0])
        raise UserError(f"history and targets overlap (user row {user}); they must be disjoint")
    return scores, history, targets


def top_k_mask(scores: np.ndarray, history: np.ndarray, k: int) -> np.ndarray:
    """Boolean mask of each user's top-k items among the items outside their history.

    History items get score -inf; among equal scores the lower item index wins. If a user has fewer
    than k items outside the history, history items fill the remaining places (they can never be
    targets, so they do not count as hits).
    """
    n_users, n_items = scores.shape
    k = min(k, n_items)
    masked = np.where(history, -np.inf, scores)
    if k == 0:
        return np.zeros(scores.shape, dtype=bool)
    # The k-th largest score per user; everything strictly above it is in, equal ones fill up by index.
    kth = -np.partition(-masked, k - 1, axis=1)[:, k - 1 : k]
    above = masked > kth
    equal = masked == kth
    room = k - above.sum(axis=1, keepdims=True)
    return above | (equal & (np.cumsum(equal, axis=1) <= room))


def ranked_top_k(scores: np.ndarray, history: np.ndarray, k: int) -> np.ndarray:
    """(users x min(k, items)) item indices of each user's top k, best first: the items of
    `top_k_mask` ordered by score, ties by the lower index (so the first j are the top j)."""
    n_users, n_items = scores.shape
    k = min(k, n_items)
    ranked = np.empty((n_users, k), dtype=np.int64)
    for start in range(0, n_users, _ROW_BLOCK):
        rows = slice(start, start + _ROW_BLOCK)
        block, seen = scores[rows], history[rows]
        items = np.nonzero(top_k_mask(block, seen, k))[1].reshape(block.shape[0], k)  # k per user, by index
        masked = np.where(np.take_along_axis(seen, items, axis=1), -np.inf, np.take_along_axis(block, items, axis=1))
        ranked[rows] = np.take_along_axis(items, np.argsort(-masked, axis=1, kind="stable"), axis=1)
    return ranked


def _hits(ranked: np.ndarray, targets: np.ndarray, k: int) -> np.ndarray:
    return np.take_along_axis(targets, ranked[:, :k], axis=1)


def recall_of_ranking(ranked: np.ndarray, targets: np.ndarray, k: int) -> np.ndarray:
    """Per-user Recall@k of a `ranked_top_k` ranking (at least k deep, or the whole catalog): hits /
    min(k, |targets|); NaN for users without targets."""
    n_targets = targets.sum(axis=1)
    recall = np.full(targets.shape[0], np.nan)
    has = n_targets > 0
    recall[has] = _hits(ranked, targets, k)[has].sum(axis=1) / np.minimum(k, n_targets[has])
    return recall


def ndcg_of_ranking(ranked: np.ndarray, targets: np.ndarray, k: int) -> np.ndarray:
    """Per-user NDCG@k (binary relevance) of a `ranked_top_k` ranking; NaN for users without targets."""
    discount = 1.0 / np.log2(np.arange(2, k + 2))
    ideal = np.concatenate([[0.0], np.cumsum(discount)])  # ideal[n]: the IDCG of n targets
    hits = _hits(ranked, targets, k)
    n_targets = targets.sum(axis=1)
    ndcg = np.full(targets.shape[0], np.nan)
    has = n_targets > 0
    ndcg[has] = (hits[has] * discount[: hits.shape[1]]).sum(axis=1) / ideal[np.minimum(k, n_targets[has])]
    return ndcg


def precision_of_ranking(ranked: np.ndarray, targets: np.ndarray, k: int) -> np.ndarray:
    """Per-user Precision@k of a `ranked_top_k` ranking: hits / k; NaN for users without targets."""
    precision = _hits(ranked, targets, k).sum(axis=1) / k
    return np.where(targets.any(axis=1), precision, np.nan)


def average_precision_of_ranking(ranked: np.ndarray, targets: np.ndarray, k: int) -> np.ndarray:
    """Per-user AP@k of a `ranked_top_k` ranking: the sum of Precision@r at each hit's rank r <= k,
    over min(k, |targets|) (MAP@k is its mean); NaN for users without targets."""
    hits = _hits(ranked, targets, k)
    at_hits = hits * np.cumsum(hits, axis=1) / np.arange(1, hits.shape[1] + 1)
    n_targets = targets.sum(axis=1)
    average = np.full(targets.shape[0], np.nan)
    has = n_targets > 0
    average[has] = at_hits[has].sum(axis=1) / np.minimum(k, n_targets[has])
    return average


def covered_by_ranking(ranked: np.ndarray, history: np.ndarray, targets: np.ndarray, k: int) -> np.ndarray:
    """Boolean per item: in the top k of a `ranked_top_k` ranking of some user with a target (a history
    item that fills a short list is not recommended, so not covered)."""
    evaluated = targets.any(axis=1)
    top = ranked[evaluated, :k]
    recommended = ~np.take_along_axis(history[evaluated], top, axis=1)
    covered = np.zeros(targets.shape[1], dtype=bool)
    covered[top[recommended]] = True
    return covered


def recall_at_k_per_user(scores: np.ndarray, history: np.ndarray, targets: np.ndarray, k: int = 20) -> np.ndarray:
    """Per-user Recall@k: hits / min(k, |targets|); NaN for users without targets.

    scores: (users x items) float array; history and targets: boolean masks of the same shape,
    disjoint (a target in the history could never be recommended).
    """
    k = _k(k)
    scores, history, targets = checked(scores, history, targets)
    return recall_of_ranking(ranked_top_k(scores, history, k), targets, k)


def ndcg_at_k_per_user(scores: np.ndarray, history: np.ndarray, targets: np.ndarray, k: int = 100) -> np.ndarray:
    """Per-user NDCG@k (binary relevance, Liang et al. 2018); NaN for users without targets. Arguments
    as `recall_at_k_per_user`."""
    k = _k(k)
    scores, history, targets = checked(scores, history, targets)
    return ndcg_of_ranking(ranked_top_k(scores, history, k), targets, k)


def _mean_over_evaluated(per_user: np.ndarray, name: str) -> float:
    evaluated = per_user[~np.isnan(per_user)]
    if evaluated.size == 0:
        raise UserError(f"no user has a target: {name} is undefined")
    return float(evaluated.mean())


def recall_at_k(scores: np.ndarray, history: np.ndarray, targets: np.ndarray, k: int = 20) -> float:
    """Mean Recall@k over the users that have at least one target (see `recall_at_k_per_user`)."""
    return _mean_over_evaluated(recall_at_k_per_user(scores, history, targets, k), "Recall@k")


def ndcg_at_k(scores: np.ndarray, history: np.ndarray, targets: np.ndarray, k: int = 100) -> float:
    """Mean NDCG@k over the users that have at least one target (see `ndcg_at_k_per_user`)."""
    return _mean_over_evaluated(ndcg_at_k_per_user(scores, history, targets, k), "NDCG@k")


def catalog_coverage(scores: np.ndarray, history: np.ndarray, targets: np.ndarray, k: int = 20) -> float:
    """Share of the catalog's items in the top k of at least one user with a target."""
    k = _k(k)
    scores, history, targets = checked(scores, history, targets)
    if not targets.any():
        raise UserError("no user has a target: catalog coverage is undefined")
    return float(covered_by_ranking(ranked_top_k(scores, history, k), history, targets, k).mean())


AT_K = {  # `ranking_metrics(at=...)`'s metrics at each cut-off k (key prefix -> per-user metric)
    "recall": recall_of_ranking,
    "precision": precision_of_ranking,
    "ndcg": ndcg_of_ranking,
    "map": average_precision_of_ranking,
}


def at_k_keys(at: Iterable[int]) -> list[str]:
    """The keys `ranking_metrics(at=at)` adds: each AT_K metric and the coverage at each k."""
    return [f"{name}_at_{k}" for k in at for name in (*AT_K, "coverage")]


def ranking_metrics(
    blocks: Iterable[tuple], item_buckets: np.ndarray | None = None, buckets: int = 0, at: Iterable[int] = ()
) -> dict:
    """The ranking protocol's metrics (RANKING's keys) over `blocks` of users, (scores, history,
    targets) each as `recall_at_k_per_user` takes them, from one ranking per block: the means over
    every block's users with a target, coverage over the union of their top 20s; "users": how many
    were evaluated; "sliced": Recall@20 restricted to the targets of each of `buckets` item buckets
    (`item_buckets`, a bucket per item), over the users with a target there (None for a bucket
    without any); with `at`, every AT_K metric and the coverage at each of those k too."""
    at = sorted({_k(k) for k in at})
    per_user = {"recall_at_20": [], "recall_at_50": [], "ndcg_at_100": []}
    per_user.update({f"{name}_at_{k}": [] for k in at for name in AT_K})
    sliced = [[] for _ in range(buckets)]
    covered = dict.fromkeys(sorted({20, *at}), False)
    for block in blocks:
        scores, history, targets = checked(*block)
        ranked = ranked_top_k(scores, history, max([_DEPTH, *at]))
        per_user["recall_at_20"].append(recall_of_ranking(ranked, targets, 20))
        per_user["recall_at_50"].append(recall_of_ranking(ranked, targets, 50))
        per_user["ndcg_at_100"].append(ndcg_of_ranking(ranked, targets, 100))
        for k in at:
            for name, metric in AT_K.items():
                per_user[f"{name}_at_{k}"].append(metric(ranked, targets, k))
        for k in covered:
            covered[k] = covered[k] | covered_by_ranking(ranked, history, targets, k)
        for b in range(buckets):
            sliced[b].append(recall_of_ranking(ranked, targets & (item_buckets == b)[None, :], 20))
    recall = np.concatenate(per_user["recall_at_20"]) if per_user["recall_at_20"] else np.array([np.nan])
    if np.isnan(recall).all():
        raise UserError("no user has a target: the ranking metrics are undefined")
    means = {key: float(np.nanmean(np.concatenate(parts))) for key, parts in per_user.items()}
    bucketed = [np.concatenate(parts) for parts in sliced]
    return {
        **means,
        **{f"coverage_at_{k}": float(np.mean(items)) for k, items in covered.items()},
        "sliced": [float(np.nanmean(b)) if (~np.isnan(b)).any() else None for b in bucketed],
        "users": int(np.sum(~np.isnan(recall))),
    }
