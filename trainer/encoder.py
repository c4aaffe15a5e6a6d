"""The public item encoder (Keras): item features -> item embedding in R^d.

Features encoder (the paper's): one embedding table per feature family; a multivalent family is a
bag of values whose embeddings are averaged (repeated values weigh more), a univalent family is a
single lookup; the family embeddings are concatenated and a dense layer maps them to dimension d.
With the item id (trainer.features), the encoder adds a free per-item residual r_j in R^d to that
output: v_j = dense(features_j) + r_j. The residual starts at zero and has its own penalty in the
item update (trainer.ssp), so an item whose statistics are mostly noise stays at what its public
features say, and an item never trained on is embedded by its features alone. Id-only encoder: one
free embedding per item (matrix factorization's item side), for the ALS-style baselines.

Lookups give sparse gradients (`tf.IndexedSlices`) and run unchanged on a GPU. `export` writes a
SavedModel whose `embed` signature maps item ids to embeddings and whose `embed_features` signature
embeds any item, new ones too, from its public feature values; `write_checkpoint` /
`restore_checkpoint` save and load the encoder's variables between the stages of a run. Both go
through `schemas.storage` folders, never TensorFlow's own gs:// filesystem (docs/models.md, "The
item encoder", says why).

Privacy: the encoder only ever sees public features; what it learns from private data comes
through the noised statistics (trainer.ssp).
"""

from __future__ import annotations

import os

import numpy as np
import scipy.sparse
import scipy.sparse.linalg
import tensorflow as tf

from schemas import storage
from schemas.errors import UserError
from trainer.features import ITEM_ID_FAMILY, FeatureSpace, feature_families, feature_matrix

ENCODERS = ("features", "id")
REFIT_ITEMS = 4096  # refit_shared's items at most (a dense eigendecomposition of this size takes seconds)
CHECKPOINT_PREFIX = "ckpt"  # the checkpoint's file prefix inside its folder


class ItemEncoder(tf.keras.Model):
    """Catalog positions (int) -> embeddings (float32, d)."""

    def __init__(
        self, space: FeatureSpace, dim: int, kind: str = "features", family_dim: int | None = None, seed: int = 0
    ):
        super().__init__(name=f"{kind}_encoder")
        if kind not in ENCODERS:
            raise UserError(f"encoder must be one of {ENCODERS}, got {kind!r}")
        if not isinstance(dim, int) or dim < 1:
            raise UserError(f"encoder dimension must be a positive integer, got {dim}")
        self.kind, self.dim, self.space = kind, dim, space
        ids = [f for f in space.families if f.name == ITEM_ID_FAMILY]
        families = feature_families(space) if kind == "features" else ids
        if kind == "id" and not families:
            raise UserError("the id-only encoder needs a feature space built with the item id family")
        if kind == "features" and not families:
            raise UserError("the features encoder needs at least one public feature family besides the item id")
        family_dim = family_dim or dim
        init = tf.keras.initializers.RandomNormal(stddev=1.0 / np.sqrt(family_dim), seed=seed)
        self._families = []
        for family in families:
            ragged = tf.RaggedTensor.from_row_splits(
                tf.constant(family.values, tf.int64), tf.constant(family.row_splits, tf.int64), validate=False
            )
            table = self.add_weight(
                name=f"{family.name}_embeddings",
                shape=(family.size, family_dim if kind == "features" else dim),
                initializer=init,
            )
            self._families.append((family.name, ragged, table))
        self._dense = (
            tf.keras.layers.Dense(
                dim, name="projection", kernel_initializer=tf.keras.initializers.GlorotUniform(seed=seed)
            )
            if kind == "features"
            else None
        )
        # the per-item residual of the features encoder (row 0: no item), from zero
        self._residual = (
            self.add_weight(name="item_residual", shape=(space.size + 1, dim), initializer="zeros")
            if kind == "features" and ids
            else None
        )

    def get_config(self) -> dict:
        return {"dim": self.dim, "kind": self.kind, "families": [name for name, _, _ in self._families]}

    def call(self, positions):
        out = self.shared(positions)
        return out + self.residual(positions) if self._residual is not None else out

    def shared(self, positions):
        """What the shared encoder says of the items (their public features), without residuals."""
        positions = tf.cast(positions, tf.int64)
        return self.encode_values([tf.gather(ragged, positions) for _, ragged, _ in self._families])

    def encode_values(self, values: list):
        """The shared encoder on value ids: one ragged [n, None] int64 tensor per family, in the
        encoder's family order (id 0: the family's out-of-vocabulary row; an empty row: no value)."""
        parts = [
            tf.nn.safe_embedding_lookup_sparse(table, ids.to_sparse(), combiner="mean")
            for ids, (_, _, table) in zip(values, self._families, strict=True)
        ]
        hidden = tf.concat(parts, axis=-1) if len(parts) > 1 else parts[0]
        return hidden if self._dense is None else self._dense(hidden)

    @property
    def has_residual(self) -> bool:
        return self._residual is not None

    def residual(self, positions):
        """The per-item residuals r_j of catalog positions (features encoder with the item id)."""
        return tf.gather(self._residual, tf.cast(positions, tf.int64) + 1)

    def residual_values(self) -> np.ndarray:
        """Every catalog item's residual r_j (catalog order, float64)."""
        return self._residual.numpy()[1:].astype(np.float64)

    def set_residuals(self, positions: np.ndarray, residuals: np.ndarray) -> None:
        """Set the per-item residuals r_j of catalog positions (e.g. from their closed-form solve)."""
        rows = tf.constant(np.asarray(positions, np.int64)[:, None] + 1)
        self._residual.scatter_nd_update(rows, tf.constant(np.asarray(residuals), self._residual.dtype))

    def rescale(self, factor: float | np.ndarray) -> None:
        """Multiply every embedding by `factor`, a number or one per output coordinate (the output
        layer and the residuals are linear in it): the public post-processing that keeps released
        item embeddings at a fixed scale."""
        factor = np.asarray(factor, dtype=np.float32)
        self(tf.zeros([1], tf.int64))  # builds the layers of a fresh encoder
        if self._dense is None:
            _, _, table = self._families[0]
            table.assign(table * factor)
            return
        self._dense.kernel.assign(self._dense.kernel * factor)
        self._dense.bias.assign(self._dense.bias * factor)
        if self._residual is not None:
            self._residual.assign(self._residual * factor)

    def transform(self, matrix: np.ndarray) -> None:
        """Map every embedding v to v @ `matrix` (dim x dim; a features encoder: its output layer and
        its residuals are linear in v)."""
        self(tf.zeros([1], tf.int64))  # builds the layers of a fresh encoder
        matrix = tf.constant(np.asarray(matrix), self._dense.kernel.dtype)
        self._dense.kernel.assign(self._dense.kernel @ matrix)
        self._dense.bias.assign(tf.linalg.matvec(matrix, self._dense.bias, transpose_a=True))
        if self._residual is not None:
            self._residual.assign(self._residual @ matrix)

    def init_principal(self, weights: np.ndarray) -> int:
        """Set the shared encoder to the top-d principal directions of the catalog's public feature
        vectors x_j (each family's bag of values averaged, `trainer.features.feature_matrix`, and a
        constant 1 for the bias), item j weighted by weights[j] (its DP count: post-processing of a
        release, so free): v_j = V^T x_j with V the top-d eigenvectors of sum_j weights_j x_j x_j^T.

        Why: the users of the first outer step are fitted to these embeddings, and the item update
        starts from them. A random projection of the features mixes the few directions that tell
        popular items apart with every rare value; the principal directions keep them, so that the
        starting point (and every update held near it) is what the public features can say best.
        Dimensions beyond the features' rank keep their random initialisation. Returns the number of
        principal dimensions set (min(d, rank)). The unknown value (id 0) embeds to zero, as
        `feature_matrix` drops it."""
        weights = self._item_weights(weights, "principal initialisation")
        x = public_inputs(self.space)
        values, vectors = _top_eigenvectors(x.T @ scipy.sparse.diags(weights) @ x, self.dim)
        rank = int(np.sum(values > 1e-9 * max(values.max(initial=0.0), 1e-300)))
        linear = self.linear_map()
        if 0 < rank < self.dim:  # keep the random directions, at the principal ones' scale
            linear[:, rank:] *= np.mean(_output_rms(x, vectors[:, :rank])) / np.maximum(
                _output_rms(x, linear[:, rank:]), 1e-300
            )
        linear[:, :rank] = vectors[:, :rank]
        self.set_linear_map(linear)
        return rank

    def refit_shared(self, weights: np.ndarray, most: int = REFIT_ITEMS) -> int:
        """Make the shared encoder the best linear guess, from the public features, of the embeddings
        the private updates gave the catalog, and keep every catalog item's embedding as it is (its
        residual takes the difference): what `embed_features` gives a new item.

        The guess: a ridge regression of the outputs v_j on x_j (`public_inputs`: every feature value,
        not the d principal directions), over the items whose residual is non-zero (those the private
        updates moved), item j weighted by weights[j] (its DP count: an item of many interactions has
        the embedding of least noise; the `most` heaviest of them, which bounds the fit's one dense
        eigendecomposition), the ridge chosen by leave-one-out error (`loo_ridge`). The
        trained shared encoder is often a worse guess: its residuals carry what the statistics say of
        each item, so it keeps little of what sets one artist's items apart. Where it is not (its
        weighted error on those items, their residuals' weighted norm, is at most the refit's
        leave-one-out error: few items, or features that say little of them) it is kept. Returns the
        number of items fitted (0: none moved, or the trained encoder kept)."""
        weights = self._item_weights(weights, "the shared encoder's refit")
        if self._residual is None:
            return 0
        outputs, residuals = self.embed_all(), self.residual_values()
        moved = np.flatnonzero(np.any(residuals != 0, axis=1) & (weights > 0))
        if moved.size == 0:
            return 0
        moved = np.sort(moved[np.argsort(-weights[moved], kind="stable")[:most]])
        linear, loo_error = loo_ridge(public_inputs(self.space)[moved], outputs[moved], weights[moved])
        trained_error = float(weights[moved] @ np.sum(np.square(residuals[moved]), axis=1))
        if loo_error >= trained_error:
            return 0
        self.set_linear_map(linear)
        self.set_residuals(np.arange(self.space.size), outputs - self.embed_all(shared=True))
        return int(moved.size)

    def linear_map(self) -> np.ndarray:
        """The shared encoder as the linear map it is: W (feature values x d, then a row for the
        bias) with shared outputs `public_inputs(space) @ W` (a bag's lookups are averaged, then a dense layer)."""
        self._require_features()
        self(tf.zeros([1], tf.int64))  # builds the dense layer
        kernel, bias = self._dense.kernel.numpy(), self._dense.bias.numpy()
        family_dim = kernel.shape[0] // len(self._families)
        blocks = [
            table.numpy()[1:] @ kernel[k * family_dim : (k + 1) * family_dim]
            for k, (_, _, table) in enumerate(self._families)
        ]
        return np.vstack(blocks + [bias[None, :]]).astype(np.float64)

    def set_linear_map(self, linear: np.ndarray) -> None:
        """Make the shared encoder the linear map `linear` (as `linear_map` gives it): the family tables
        hold its rows (the unknown value, row 0, embeds to zero), the dense layer stacked identities."""
        self._require_features()
        self(tf.zeros([1], tf.int64))  # builds the dense layer
        kernel, bias = self._dense.kernel.numpy(), self._dense.bias.numpy()
        family_dim = kernel.shape[0] // len(self._families)
        if family_dim < self.dim:
            raise UserError(
                f"a linear map of the features needs family embeddings of at least d = {self.dim} dimensions, got "
                f"{family_dim}"
            )
        identity, offset = np.zeros_like(kernel), 0
        for k, (_, _, table) in enumerate(self._families):
            rows = table.shape[0] - 1
            values_of = np.zeros(table.shape, np.float64)
            values_of[1:, : self.dim] = linear[offset : offset + rows]
            table.assign(values_of.astype(table.dtype.as_numpy_dtype))
            identity[k * family_dim : k * family_dim + self.dim] = np.eye(self.dim)
            offset += rows
        self._dense.kernel.assign(identity)
        self._dense.bias.assign(linear[offset].astype(bias.dtype))

    def _require_features(self) -> None:
        if self.kind != "features":
            raise UserError("only the features encoder is a map of public features")

    def _item_weights(self, weights: np.ndarray, use: str) -> np.ndarray:
        """`weights` as float64, refused (naming `use`) unless one finite weight >= 0 per catalog item
        of a features encoder."""
        self._require_features()
        weights = np.asarray(weights, dtype=np.float64)
        if weights.shape != (self.space.size,) or not np.all(np.isfinite(weights)) or np.any(weights < 0):
            raise UserError(
                f"{use} needs one finite weight >= 0 per catalog item ({self.space.size}), got shape {weights.shape}"
            )
        return weights

    def set_item_vectors(self, vectors: np.ndarray) -> None:
        """Id-only encoder: set every catalog item's embedding (catalog order), e.g. from a closed-form solve."""
        if self.kind != "id":
            raise UserError("only the id-only encoder has one free vector per item")
        _, _, table = self._families[0]
        table.assign(np.vstack([np.zeros((1, self.dim)), np.asarray(vectors)]).astype(table.dtype.as_numpy_dtype))

    def embed_all(self, batch_size: int = 8192, shared: bool = False) -> np.ndarray:
        """Embeddings of every catalog item, in catalog order (float64); with `shared`, what the
        shared encoder alone says of them (no residuals)."""
        embed = self.shared if shared else self
        out = [
            embed(tf.range(start, min(start + batch_size, self.space.size))).numpy()
            for start in range(0, self.space.size, batch_size)
        ]
        return np.concatenate(out).astype(np.float64) if out else np.zeros((0, self.dim))


def _top_eigenvectors(gram: scipy.sparse.spmatrix, k: int) -> tuple[np.ndarray, np.ndarray]:
    """(eigenvalues, eigenvectors as columns) of the k largest eigenvalues of a symmetric PSD matrix,
    largest first: dense for a small matrix, Lanczos (ARPACK) for a large vocabulary."""
    size = gram.shape[0]
    if size <= 4096 or k >= size - 1:
        values, vectors = np.linalg.eigh(gram.toarray())
    else:
        values, vectors = scipy.sparse.linalg.eigsh(gram.astype(np.float64), k=k, which="LA")
    order = np.argsort(values)[::-1][:k]
    return values[order], vectors[:, order]


def public_inputs(space: FeatureSpace) -> scipy.sparse.csr_matrix:
    """x_j of every catalog item: its feature values (each family's bag averaged, `feature_matrix`) and a constant 1."""
    return scipy.sparse.hstack([feature_matrix(space), np.ones((space.size, 1))]).tocsr()


RIDGE_GRID = np.logspace(-3, 1, 9)  # loo_ridge's choices, times the mean eigenvalue


def loo_ridge(x, targets: np.ndarray, weights: np.ndarray, grid: np.ndarray = RIDGE_GRID) -> tuple[np.ndarray, float]:
    """W minimising sum_i weights_i ||x_i W - targets_i||^2 + lam ||W||^2, with lam the one of `grid`
    (times the mean eigenvalue of the weighted Gram) whose weighted leave-one-out error is least: each
    row predicted by the fit on the others, in closed form (r_i / (1 - h_ii)), from one thin SVD of
    the weighted rows (the eigendecomposition of the smaller of x^T W x and W^1/2 x x^T W^1/2).
    x: dense or scipy sparse, n rows, not all zero; targets: n x k; weights > 0. Returns W and its
    weighted leave-one-out error."""
    root = np.sqrt(np.asarray(weights, dtype=np.float64))
    xw = scipy.sparse.csr_matrix(x).multiply(root[:, None]).tocsr()
    yw = root[:, None] * np.asarray(targets, dtype=np.float64)
    by_rows = xw.shape[0] <= xw.shape[1]  # rows x rows: the left singular vectors directly
    values, vectors = np.linalg.eigh((xw @ xw.T if by_rows else xw.T @ xw).toarray())
    keep = values > 1e-12 * max(values.max(initial=0.0), 1e-300)
    values, vectors = values[keep], vectors[:, keep]
    left = vectors if by_rows else np.asarray(xw @ vectors) / np.sqrt(values)  # else the right ones: x v / sigma
    rotated = left.T @ yw
    best, best_error = None, np.inf
    for lam in grid * float(np.mean(values)):
        shrink = values / (values + lam)
        fitted = left @ (shrink[:, None] * rotated)
        leverage = np.einsum("ij,j,ij->i", left, shrink, left)
        error = float(np.sum(((yw - fitted) / np.maximum(1.0 - leverage, 1e-12)[:, None]) ** 2))
        if error < best_error:
            best, best_error = lam, error
    if by_rows:  # x^T (x x^T + lam)^-1 y, in the weighted rows
        return np.asarray(xw.T @ (left @ (rotated / (values + best)[:, None]))), best_error
    return vectors @ ((np.sqrt(values) / (values + best))[:, None] * rotated), best_error


def _output_rms(x: scipy.sparse.spmatrix, linear: np.ndarray) -> np.ndarray:
    """Root-mean-square over the items of each output dimension of x @ linear."""
    return np.sqrt(np.mean(np.square(x @ linear), axis=0))


def write_checkpoint(encoder: ItemEncoder, folder: str) -> None:
    """Save the encoder's variables as the checkpoint folder `folder` (local or gs://), atomically."""
    with storage.write_folder(folder) as local:
        tf.train.Checkpoint(model=encoder).write(os.path.join(local, CHECKPOINT_PREFIX))


def restore_checkpoint(encoder: ItemEncoder, folder: str) -> None:
    """Load the variables saved by `write_checkpoint` into `encoder` (built here first, so that every
    variable is restored while the checkpoint is at hand rather than on a later first call)."""
    encoder(tf.zeros([1], tf.int64))
    with storage.read_folder(folder) as local:
        tf.train.Checkpoint(model=encoder).read(
            os.path.join(local, CHECKPOINT_PREFIX)
        ).assert_existing_objects_matched()


def as_written(outputs, bias_scale: float | None = None):
    """The item vectors a run writes from encoder outputs [v, b] (numpy or tensor): the outputs, or
    with a bias scale c (a model with biases) [v, c b, 1], so that c b is the item bias and the
    users' [u, 1, b_u] predict by one dot product. A run's item table and the SavedModel both
    write item vectors through this one function."""
    if bias_scale is None:
        return outputs
    outputs = tf.convert_to_tensor(outputs)
    return tf.concat([outputs[:, :-1], bias_scale * outputs[:, -1:], tf.ones_like(outputs[:, -1:])], axis=-1)


def export(encoder: ItemEncoder, path: str, bias_scale: float | None = None) -> None:
    """Write a SavedModel at `path` (local or gs://), atomically, with the signatures
    - `embed(item_ids: int64[n]) -> {"embedding": float32[n, d]}`: the catalog's items, as trained;
    - `embed_features(<family>: string[n, None] ...) -> {"embedding": float32[n, d]}` (features
      encoder only): any item from its public feature values alone, one string input per family
      ("" pads a bag; a univalent family gives one value or ""; a numeric family its number as text,
      bucketed by the catalog's edges), so a new catalog item is embedded
      without retraining. A value the catalog never had gets the family's out-of-vocabulary row.
      It is the shared encoder, without the per-item residuals of the training catalog.
    With `bias_scale` c (a model with biases) both give [v, c b, 1] for the encoder's outputs [v, b]:
    the item embeddings as the run writes them (`as_written`)."""
    module = tf.Module()
    module.encoder = encoder
    module.lookup = tf.lookup.StaticHashTable(
        tf.lookup.KeyValueTensorInitializer(
            tf.constant(encoder.space.item_ids, tf.int64), tf.range(encoder.space.size, dtype=tf.int64)
        ),
        default_value=-1,
    )

    @tf.function(input_signature=[tf.TensorSpec([None], tf.int64, name="item_ids")])
    def embed(item_ids):
        positions = module.lookup.lookup(item_ids)
        known = tf.debugging.Assert(
            tf.reduce_all(positions >= 0),
            [
                "item ids not in the catalog of this encoder (embed_features embeds a new item):",
                tf.boolean_mask(item_ids, positions < 0),
            ],
            summarize=20,
        )
        with tf.control_dependencies([known]):  # named before any lookup fails on them
            return {"embedding": as_written(module.encoder(tf.identity(positions)), bias_scale)}

    module.embed = embed
    signatures = {"embed": embed}
    if encoder.kind == "features":
        families = feature_families(encoder.space)
        module.vocabularies = [_vocabulary_table(family.vocabulary) for family in families]

        @tf.function(input_signature=[tf.TensorSpec([None, None], tf.string, name=family.name) for family in families])
        def embed_features(*values):
            ids = [
                _value_ids(family, table, strings)
                for family, table, strings in zip(families, module.vocabularies, values, strict=True)
            ]
            return {"embedding": as_written(module.encoder.encode_values(ids), bias_scale)}

        module.embed_features = embed_features
        signatures["embed_features"] = embed_features
    with storage.write_folder(path) as local:
        tf.saved_model.save(module, local, signatures=signatures)


def _value_ids(family, table: tf.lookup.StaticHashTable, strings: tf.Tensor) -> tf.RaggedTensor:
    """A family's value ids of a [n, None] string batch ("" is padding): the vocabulary's, or for a
    numeric family the bucket of each number given as text (as trainer.features buckets the catalog)."""
    given = tf.ragged.boolean_mask(strings, tf.not_equal(strings, ""))
    if family.boundaries is None:
        return tf.ragged.map_flat_values(table.lookup, given)
    edges = tf.constant(family.boundaries, tf.float64)
    numbers = tf.ragged.map_flat_values(
        tf.strings.to_number, given, out_type=tf.float64
    )  # float64: the catalog's edges exactly
    return tf.ragged.map_flat_values(lambda x: tf.searchsorted(edges, x, side="right", out_type=tf.int64) + 1, numbers)


def _vocabulary_table(vocabulary: list[str]) -> tf.lookup.StaticHashTable:
    """Value string -> value id (1, 2, ... in vocabulary order; 0 for a value not in it)."""
    keys = vocabulary or [""]  # an empty family: every value is out of vocabulary ("" is padding, never looked up)
    ids = np.arange(1, len(vocabulary) + 1, dtype=np.int64) if vocabulary else np.zeros(1, np.int64)
    return tf.lookup.StaticHashTable(
        tf.lookup.KeyValueTensorInitializer(tf.constant(keys, tf.string), tf.constant(ids, tf.int64)), default_value=0
    )
