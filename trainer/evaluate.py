"""Evaluation of a trained model on the benchmark protocols, overall and by item popularity.

RMSE (regression protocol): prediction = u_k . v_j + mean, clipped to the rating range; users
without training rows get the mean. Ranking protocol: held-out users are folded in with the user
update (trainer.solve) on their history, every item but the history is scored, and Recall@20,
Recall@50, NDCG@100 and the catalog coverage of the top 20 are computed (trainer.metrics); by
default the fold-in also gets the items' DP counts as one more column (`with_popularity`).

Both are sliced into 5 equal-size buckets of items ordered by training popularity (bucket 0 the
least popular; the paper's long-tail figure): RMSE over the test rows of each bucket's items, and
Recall@20 restricted to each bucket's targets (users with targets there). Popularity is counted on
the training rows; evaluation runs on the trusted side and its numbers are not DP releases.

Privacy: held-out private rows on the trusted side: metrics are not a release and are never
published.
"""

from __future__ import annotations

import numpy as np

from schemas.compiled import kernel
from schemas.errors import UserError
from schemas.ids import IdIndex
from trainer import metrics
from trainer.solve import logistic_solve, ridge_solve

BUCKETS = 5


def item_counts(catalog: np.ndarray, item_batches) -> np.ndarray:
    """Rows per catalog item (catalog order) over an iterable of item-id arrays, streamed; ids outside
    the catalog are not counted."""
    catalog = np.asarray(catalog)
    index = IdIndex(catalog)
    counts = np.zeros(catalog.size, np.int64)
    for items in item_batches:
        at, found = index.lookup(items)
        counts += np.bincount(at[found], minlength=catalog.size)
    return counts


def popularity_buckets(catalog: np.ndarray, train_items: np.ndarray, buckets: int = BUCKETS) -> np.ndarray:
    """Bucket (0 = least popular) of every catalog item: equal-size groups by training count."""
    return buckets_by_count(catalog, item_counts(catalog, [train_items]), buckets)


def buckets_by_count(catalog: np.ndarray, counts: np.ndarray, buckets: int = BUCKETS) -> np.ndarray:
    """`popularity_buckets` from the training count of every catalog item (catalog order)."""
    catalog = np.asarray(catalog)
    order = np.lexsort((catalog, counts))  # ascending popularity, ties by id
    bucket = np.empty(catalog.size, np.int64)
    bucket[order] = np.arange(catalog.size) * buckets // max(catalog.size, 1)
    return bucket


def squared_errors(
    predictions: np.ndarray, labels: np.ndarray, item_buckets: np.ndarray, buckets: int = BUCKETS
) -> np.ndarray:
    """(buckets, 2): each popularity bucket's sum of squared errors and number of rows, to be summed
    over a table's batches and read by `rmse_report`."""
    predictions = np.asarray(predictions, dtype=np.float64)
    labels = np.asarray(labels, dtype=np.float64)
    if predictions.ndim != 1 or predictions.shape != labels.shape:
        raise UserError(
            f"predictions and labels must be 1-D arrays of one length, got shapes {predictions.shape} and "
            f"{labels.shape}"
        )
    if not (np.all(np.isfinite(predictions)) and np.all(np.isfinite(labels))):
        raise UserError("predictions and labels must be finite")
    errors = (predictions - labels) ** 2
    return np.stack(
        [np.bincount(item_buckets, weights=errors, minlength=buckets), np.bincount(item_buckets, minlength=buckets)],
        axis=1,
    ).astype(np.float64)


def rmse_report(sums: np.ndarray) -> dict:
    """Overall RMSE and RMSE per popularity bucket (None for a bucket without rows) from
    `squared_errors` summed over the rows."""
    total, rows = sums.sum(axis=0)
    if rows == 0:
        raise UserError("rmse of no predictions is undefined")
    return {
        "rmse": float(np.sqrt(total / rows)),
        "sliced": [float(np.sqrt(error / n)) if n else None for error, n in sums],
    }


def predict_ratings(
    user_ids, positions, user_table: tuple[IdIndex, np.ndarray], item_vectors: np.ndarray, mean: float, rating_range
) -> np.ndarray:
    """u_k . v_j + mean for each (user, catalog position), the mean alone for unknown users;
    `user_table` is (an index of the known users' ids, their vectors in that order)."""
    known_users, user_vectors = user_table
    index, known = known_users.lookup(user_ids)
    positions = np.asarray(positions, dtype=np.int64)
    if user_vectors.shape[1] != item_vectors.shape[1] or (
        positions.size and not 0 <= positions.min() <= positions.max() < len(item_vectors)
    ):
        raise UserError(
            f"predictions need user and item vectors of one width ({user_vectors.shape[1]}, {item_vectors.shape[1]}) "
            f"and catalog positions below {len(item_vectors)}"
        )
    scores = np.empty(len(user_ids), dtype=np.float64)
    low, high = rating_range
    _scores_kernel(
        np.where(known, index, -1),
        positions,
        np.ascontiguousarray(user_vectors, dtype=np.float64),
        np.ascontiguousarray(item_vectors, dtype=np.float64),
        float(mean),
        float(low),
        float(high),
        scores,
    )
    return scores


def _scores(users, positions, user_vectors, item_vectors, mean, low, high, out):
    """out[n] <- u . v + mean clipped to [low, high] for row n's user (its row of `user_vectors`; -1:
    none, the mean alone) and item: one pass, no gathered copies of the rows' vectors
    (docs/results.md, "Adam's update compiled on the CPU too")."""
    for n in range(out.size):
        score = mean
        if users[n] >= 0:
            dot = 0.0
            for k in range(user_vectors.shape[1]):
                dot += user_vectors[users[n], k] * item_vectors[positions[n], k]
            score += dot
        out[n] = min(max(score, low), high) if score == score else score  # NaN stays NaN, as np.clip keeps it


_scores_kernel = kernel(_scores)


def with_popularity(item_vectors: np.ndarray, counts: np.ndarray, biases: bool = False) -> np.ndarray:
    """The ranking fold-in's item vectors: the trained ones plus one fixed column, the items' DP
    counts (a public release: post-processing, no privacy cost) scaled to the RMS norm of the
    trained columns. Each folded-in user gets a coefficient on it, how much popularity explains
    their history, shrunk by the same ridge as the other coordinates. Where the noise leaves the
    trained directions little signal the users fall back on popularity instead of ranking on noise
    (measured: docs/results.md#the-fold-ins-popularity-column). With
    `biases` the vectors are [v, b_j, 1] and the column goes after v, so that the bias pair stays
    last (ridge_solve)."""
    counts = np.maximum(np.asarray(counts, dtype=np.float64), 1.0)  # the counts release floors them at 1 already
    if counts.shape != (item_vectors.shape[0],):
        raise UserError(f"{counts.size} DP counts for {item_vectors.shape[0]} item vectors")
    at = popularity_position(item_vectors.shape[1], biases)
    trained = item_vectors[:, :at]
    rms = np.linalg.norm(trained) / np.sqrt(max(trained.shape[1], 1))
    return np.insert(item_vectors, at, counts / np.linalg.norm(counts) * (rms if rms > 0 else 1.0), axis=1)


def popularity_position(width: int, biases: bool) -> int:
    """Where the popularity column goes in item vectors of `width` columns: after the embedding
    (before the bias pair [b_j, 1] of a model with biases)."""
    return width - 2 if biases else width


def ranking_report(
    history: tuple[np.ndarray, np.ndarray, np.ndarray],
    targets: tuple[np.ndarray, np.ndarray],
    item_vectors: np.ndarray,
    lambda_u: float,
    *,
    item_buckets: np.ndarray,
    buckets: int = BUCKETS,
    gravity: float = 0.0,
    loss: str = "square",
    bias_ridge: float | None = None,
    confidence: bool = False,
    at: tuple[int, ...] = (),
) -> dict:
    """The ranking metrics of held-out users (trainer.metrics.ranking_metrics: Recall@20, Recall@50,
    NDCG@100, coverage of the top 20, Recall@20 per popularity bucket): (users, positions, labels)
    of the fold-in history, (users, positions) of the targets; item_vectors in catalog order. Users
    are folded in as the model was trained: a ridge solve (with `gravity`, and `bias_ridge` for a
    model with biases: ridge_solve's), or for the logistic loss its solve with every catalog item a
    negative (trainer.solve.logistic_solve). `confidence`: the history's labels are the rows'
    confidences (ridge_solve's); `at`: the metrics at those cut-offs too (ranking_metrics')."""
    h_users, h_positions, _ = history
    t_users, t_positions = targets
    users, solved = fold_in(
        history, item_vectors, lambda_u, gravity=gravity, loss=loss, bias_ridge=bias_ridge, confidence=confidence
    )
    evaluated = np.intersect1d(users, np.unique(t_users))
    if evaluated.size == 0:
        raise UserError("no held-out user has both a history and targets")

    def blocks():
        for start in range(0, evaluated.size, 1024):
            chunk = evaluated[start : start + 1024]
            yield (
                solved[np.searchsorted(users, chunk)] @ item_vectors.T,
                user_item_mask(chunk, h_users, h_positions, item_vectors.shape[0]),
                user_item_mask(chunk, t_users, t_positions, item_vectors.shape[0]),
            )

    return metrics.ranking_metrics(blocks(), item_buckets, buckets, at)


def fold_in(
    history: tuple[np.ndarray, np.ndarray, np.ndarray],
    item_vectors: np.ndarray,
    lambda_u: float,
    *,
    gravity: float = 0.0,
    loss: str = "square",
    bias_ridge: float | None = None,
    confidence: bool = False,
) -> tuple[np.ndarray, np.ndarray]:
    """(users, their vectors) of held-out users folded in on their history (users, positions, labels),
    as `ranking_report` folds them in."""
    h_users, h_positions, h_labels = history
    if loss == "logistic":
        return logistic_solve(h_users, item_vectors[h_positions], item_vectors, lambda_u)
    return ridge_solve(
        h_users,
        item_vectors[h_positions],
        h_labels,
        lambda_u,
        scale_by_rows=True,
        gravity=gravity * (item_vectors.T @ item_vectors) if gravity > 0 else None,
        bias_ridge=bias_ridge,
        confidence=confidence,
    )


def popularity_ranking_report(
    history: tuple[np.ndarray, np.ndarray],
    targets: tuple[np.ndarray, np.ndarray],
    counts: np.ndarray,
    item_buckets: np.ndarray,
    at: tuple[int, ...] = (),
) -> dict:
    """`ranking_report` of DP popularity: every catalog item ranked by its DP count (`counts`, catalog
    order, floored at 1 by the release), the history's items left out. It is ranking_report itself
    with each item's count as its one-dimensional embedding: a user's fold-in is then one positive
    number, so the scores are the counts times a positive constant, the same ranking (ties: the lower
    catalog position first) through the same metric code as every model."""
    vectors = np.asarray(counts, dtype=np.float64)[:, None]
    if not np.all(vectors > 0):
        raise UserError("every catalog item needs a positive DP count (the counts release floors them at 1)")
    (users, positions), (t_users, t_positions) = history, targets
    return ranking_report(
        (users, positions, np.ones(users.size)), (t_users, t_positions), vectors, 1.0, item_buckets=item_buckets, at=at
    )


def user_item_mask(chunk_users: np.ndarray, users: np.ndarray, positions: np.ndarray, m: int) -> np.ndarray:
    """(chunk users x m) booleans: True where a row (users, positions) puts a chunk user on a catalog position."""
    mask = np.zeros((chunk_users.size, m), dtype=bool)
    rows = np.isin(users, chunk_users)
    mask[np.searchsorted(chunk_users, users[rows]), positions[rows]] = True
    return mask
