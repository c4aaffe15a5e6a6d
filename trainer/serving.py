"""The user side of a publication as one TensorFlow SavedModel, for TensorFlow Serving: a client
sends a user's history and gets the top k, with no Python of this project at serving time.

Signatures (`export`):
- `recommend(item_ids: int64[n, L], k: int32[]) -> {"item_ids": int64[n, k], "scores": float64[n, k]}`
  (a ratings model also takes `labels: float32[n, L]`, the user's ratings on the model's scale):
  each row of `item_ids` is one user's history, padded with -1 (ids outside the catalog are
  ignored). The user is folded in exactly as `ssp recommend` and the evaluation fold them in
  (trainer.solve.ridge_solve), the history is left out, and the best k items come back, ties by
  catalog position: a ratings model's predicted rating (clipped to its scale), a ranking model's
  relative score. A user with no catalog item gets the DP popularity ranking (score: the DP
  count). Where fewer than k items remain, the rest are id -1, score NaN.
- `recommend_with_counts(item_ids, counts: float32[n, L], k)` (implicit feedback): each history
  item once with its count, weighed as `ssp recommend` weighs repeated rows.
- `similar_items(item_ids: int64[n], k: int32[]) -> {"item_ids": int64[n, k], "scores": float64[n, k]}`:
  each item's k nearest catalog items by the cosine of their embeddings (the trained directions,
  not the bias pair or the popularity column), itself left out; an id outside the catalog gets a
  row of id -1, score NaN (the other rows are answered).

A text catalog's ids are served as they are: strings in and out, "" in place of -1.

Privacy: built from the publication alone (DP releases and public features); the history stays
with the client.
"""

from __future__ import annotations

import numpy as np
import tensorflow as tf

from schemas import storage
from schemas.errors import UserError
from trainer.solve import free_coordinates, user_bias_ridge

SERVING_FOLDER = "recommender"


def embedding_width(settings: dict) -> int:
    """The trained directions' width in the published item vectors (before the bias pair)."""
    return settings["dim"] - (2 if settings.get("biases", False) else 0)


class Recommender(tf.Module):
    """The publication's item vectors (with the popularity column, as trainer.recommend loads them)
    and its fold-in, as TensorFlow functions over batches of users."""

    def __init__(
        self,
        item_ids: np.ndarray,
        vectors: np.ndarray,
        settings: dict,
        popularity: np.ndarray | None,
        keys: np.ndarray | None = None,
    ):
        super().__init__()
        if settings.get("loss") == "logistic":
            raise UserError(
                "a logistic-loss model folds users in by Newton's method over the whole catalog: no serving "
                "signature (use ssp recommend)"
            )
        vectors = np.asarray(vectors, np.float64)
        bias_ridge = user_bias_ridge(settings["protocol"], settings.get("biases", False), settings.get("lambda_bias"))
        free = free_coordinates(vectors.shape[1], bias_ridge)
        gravity = (
            settings["gravity"] * (vectors.T @ vectors)
            if settings.get("gravity", 0) > 0
            else np.zeros((vectors.shape[1],) * 2)
        )
        self.ratings = settings["protocol"] == "rmse"
        alpha = None if self.ratings else settings.get("confidence_alpha")  # implicit feedback: a count's confidence
        self.counted = alpha is not None
        self.alpha = float(alpha or 0.0)
        self.biased = bias_ridge is not None
        self.fixed_bias = bias_ridge is not None and np.isinf(bias_ridge)
        ridge_kind = np.zeros(free.size)
        if self.biased and not self.fixed_bias:
            ridge_kind[-1] = 1.0  # the user's bias: its own fixed ridge
        ids = (
            np.asarray(item_ids, np.int64) if keys is None else np.asarray(keys, object).astype(str)
        )  # a catalog with text ids is served in them
        self.missing = tf.constant(-1, tf.int64) if keys is None else tf.constant("", tf.string)
        self.lookup = tf.lookup.StaticHashTable(
            tf.lookup.KeyValueTensorInitializer(tf.constant(ids), tf.range(item_ids.size, dtype=tf.int64)),
            default_value=-1,
        )

        def constant(array):  # variables: no 2 GB graph limit
            return tf.Variable(np.asarray(array, np.float64), trainable=False)

        self.item_ids = tf.Variable(tf.constant(ids), trainable=False)
        self.vectors = constant(vectors)
        self.free_vectors = constant(vectors[:, free])
        self.item_bias = constant(vectors[:, -2] if self.biased else np.zeros(item_ids.size))
        self.gravity = constant(gravity[np.ix_(free, free)])
        self.gravity_rhs = constant(-gravity[free, -2] if self.biased else np.zeros(free.size))
        self.ridge_kind = constant(ridge_kind)
        self.bias_ridge = float(bias_ridge) if self.biased and not self.fixed_bias else 0.0
        self.lam, self.prior = float(settings["lambda_u"]), float(settings.get("user_prior") or 0.0)
        self.dp_mean = float(settings["dp_mean"]) if self.ratings else 0.0
        self.low, self.high = (float(x) for x in settings["rating_range"]) if self.ratings else (-np.inf, np.inf)
        self.popularity = constant(popularity if popularity is not None else np.zeros(item_ids.size))
        width = embedding_width(settings)
        unit = vectors[:, :width] / np.maximum(np.linalg.norm(vectors[:, :width], axis=1, keepdims=True), 1e-12)
        self.unit_embeddings = constant(unit)

    def fold_in(self, positions: tf.Tensor, labels: tf.Tensor) -> tuple[tf.Tensor, tf.Tensor]:
        """(user vectors [n, D] as the item vectors' layout expects, whether the user had a catalog item [n]);
        a ranking model's `labels` are the items' counts (1: once), each row weighing its confidence."""
        known = positions >= 0
        mask = tf.cast(known, tf.float64)
        if self.ratings or not self.counted:
            weight = tf.ones_like(labels)
        else:  # trainer.solve.confidence: (1 + alpha log(1 + count)) / (1 + alpha log 2)
            weight = (1.0 + self.alpha * tf.math.log1p(labels)) / (1.0 + self.alpha * np.log(2.0))
        mask_rows = mask * tf.sqrt(weight)
        rows = tf.gather(self.free_vectors, tf.maximum(positions, 0)) * mask_rows[..., None]
        targets = (labels - self.dp_mean if self.ratings else tf.ones_like(labels)) - tf.gather(
            self.item_bias, tf.maximum(positions, 0)
        )
        count = tf.reduce_sum(mask, axis=1)
        strength = self.prior + self.lam * count
        ridge = (1.0 - self.ridge_kind) * strength[:, None] + self.ridge_kind * self.bias_ridge
        gram = tf.einsum("bli,blj->bij", rows, rows) + tf.linalg.diag(ridge) + self.gravity
        rhs = tf.einsum("bli,bl->bi", rows, targets * mask_rows) + self.gravity_rhs
        solved = tf.linalg.solve(gram, rhs[..., None])[..., 0]
        ones = tf.ones_like(solved[:, :1])
        if self.fixed_bias:  # [u, 1, 0]: every user's bias held at 0
            solved = tf.concat([solved, ones, tf.zeros_like(ones)], axis=1)
        elif self.biased:  # [u, 1, b_u]
            solved = tf.concat([solved[:, :-1], ones, solved[:, -1:]], axis=1)
        return solved, count > 0

    def top_k(self, item_ids: tf.Tensor, labels: tf.Tensor, k: tf.Tensor) -> dict:
        positions = self.lookup.lookup(item_ids)
        if not self.ratings:  # counts: at least 1 each
            given = tf.boolean_mask(labels, positions >= 0)
            check = tf.debugging.Assert(
                tf.reduce_all(given >= 1.0), ["a count below 1:", tf.boolean_mask(given, given < 1.0)], summarize=10
            )
            with tf.control_dependencies([check]):
                labels = tf.identity(labels)
        if self.ratings:
            given = tf.boolean_mask(labels, positions >= 0)
            check = tf.debugging.Assert(
                tf.reduce_all((given >= self.low) & (given <= self.high)),
                [
                    f"labels outside the rating scale {self.low:g}..{self.high:g} of this model:",
                    tf.boolean_mask(given, (given < self.low) | (given > self.high)),
                ],
                summarize=10,
            )
            with tf.control_dependencies([check]):
                labels = tf.identity(labels)
        users, found = self.fold_in(positions, labels)
        scores = tf.matmul(users, self.vectors, transpose_b=True)
        shown = tf.clip_by_value(scores + self.dp_mean, self.low, self.high) if self.ratings else scores
        cold = tf.logical_not(found)[
            :, None
        ]  # nothing to fold in: the DP popularity ranking (0 everywhere without the counts)
        scores = tf.where(cold, self.popularity[None, :], scores)
        shown = tf.where(cold, self.popularity[None, :], shown)
        n_items = tf.shape(self.vectors)[0]
        batch = tf.shape(positions)[0]
        where = tf.where(positions >= 0)  # (user, slot) of every catalog item in the history
        seen = (
            tf.scatter_nd(
                tf.stack([where[:, 0], tf.gather_nd(positions, where)], axis=1),
                tf.ones(tf.shape(where)[0], tf.int32),
                tf.cast(tf.stack([batch, n_items]), tf.int64),
            )
            > 0
        )
        scores = tf.where(seen, tf.constant(-np.inf, tf.float64), scores)
        best, at = tf.math.top_k(scores, tf.minimum(k, n_items))  # ties: the lower catalog position first
        valid = best > -np.inf
        return {
            "item_ids": tf.where(valid, tf.gather(self.item_ids, at), self.missing),
            "scores": tf.where(valid, tf.gather(shown, at, batch_dims=1), tf.constant(np.nan, tf.float64)),
        }

    def similar(self, item_ids: tf.Tensor, k: tf.Tensor) -> dict:
        """Each item's k nearest items by cosine; an id outside the catalog gets a row of -1 (scores
        NaN), the others their answer."""
        positions = self.lookup.lookup(item_ids)
        known = positions >= 0
        positions = tf.maximum(positions, 0)
        cosine = tf.matmul(tf.gather(self.unit_embeddings, positions), self.unit_embeddings, transpose_b=True)
        n_items = tf.shape(self.unit_embeddings)[0]
        cosine = tf.where(
            tf.one_hot(positions, n_items, on_value=True, off_value=False), tf.constant(-np.inf, tf.float64), cosine
        )
        best, at = tf.math.top_k(cosine, tf.minimum(k, n_items - 1))
        return {
            "item_ids": tf.where(known[:, None], tf.gather(self.item_ids, at), self.missing),
            "scores": tf.where(known[:, None], best, tf.constant(np.nan, tf.float64)),
        }


def export(
    item_ids: np.ndarray,
    vectors: np.ndarray,
    settings: dict,
    popularity: np.ndarray | None,
    path: str,
    keys: np.ndarray | None = None,
) -> None:
    """Write the serving SavedModel (see the module docstring) at `path`, local or gs://, atomically;
    with `keys` (each item's text id, in `item_ids`' order) the signatures take and return them."""
    module = Recommender(item_ids, vectors, settings, popularity, keys)
    id_type = tf.int64 if keys is None else tf.string
    history = tf.TensorSpec([None, None], id_type, name="item_ids")
    k = tf.TensorSpec([], tf.int32, name="k")
    signatures = {}
    if module.ratings:

        @tf.function(input_signature=[history, tf.TensorSpec([None, None], tf.float32, name="labels"), k])
        def recommend(item_ids, labels, k):
            return module.top_k(item_ids, tf.cast(labels, tf.float64), k)
    else:

        @tf.function(input_signature=[history, k])
        def recommend(item_ids, k):
            return module.top_k(item_ids, tf.ones(tf.shape(item_ids), tf.float64), k)

        if module.counted:  # implicit feedback: an item's count weighs its confidence

            @tf.function(input_signature=[history, tf.TensorSpec([None, None], tf.float32, name="counts"), k])
            def recommend_with_counts(item_ids, counts, k):
                return module.top_k(item_ids, tf.cast(counts, tf.float64), k)

            signatures["recommend_with_counts"] = recommend_with_counts

    @tf.function(input_signature=[tf.TensorSpec([None], id_type, name="item_ids"), k])
    def similar_items(item_ids, k):
        return module.similar(item_ids, k)

    module.recommend, module.similar_items = recommend, similar_items
    with storage.write_folder(path) as local:
        tf.saved_model.save(
            module,
            local,
            signatures={
                "recommend": recommend,
                "similar_items": similar_items,
                "serving_default": recommend,
                **signatures,
            },
        )
