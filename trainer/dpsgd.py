"""DP-SGD training of the item encoder (the AM-DPSGD baseline), with TF-Privacy's fast clipping.

At one alternating-minimization step, given the users' (private) embeddings u_i and their rows, this
fits the encoder V to the clipped squared loss (or, with `loss="logistic"`, implicit feedback's
logistic loss on positives and sampled negatives, `logistic_rows`) with DP-SGD: each step
Poisson-samples units with probability q = batch_size / units, clips each unit's gradient to L2 norm
`l2_norm_clip` (C), adds N(0, (z C)^2) to the sum and divides by the expected batch size. A unit is
one user with all its rows (`unit="user"`, at most `max_rows_per_user`) or one row
(`unit="example"`). Per-unit norms come from TF-Privacy's ghost norms (fast clipping; the ghost norm
of the dense layer costs O(rows^2) per user), `fast_clipping=False` uses the classic per-unit
Jacobian. docs/models.md ("AM-DPSGD") has the loss and how the clipped sum shares the forward pass.

Privacy (stated as Opacus states its optimizer's): each unit's gradient is clipped to C before the
noise, so the returned `event` (Poisson-sampled Gaussian with multiplier z, `steps` times) bounds
what the trained encoder reveals about any one unit (a user with all its rows, or one row). The
user embeddings u_i are fixed inputs of their user's rows (they come from the private user update
and are never released, as in the paper's alternating minimization). It assumes the sampling and
noise randomness stays secret (default: OS entropy; a fixed `seed` is for tests) and, as
TF-Privacy does, that the number of units is public. Nothing computed from the rows is returned
but the encoder. `noise_multiplier=0` is a non-private run (clipped unless `l2_norm_clip=inf`).

Privacy: reads private rows; each step's per-user gradients are clipped and noised by TF-Privacy,
and the steps are accounted in the run's ledger as one release.
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass

import numpy as np
import tensorflow as tf
from tensorflow_privacy.privacy.fast_gradient_clipping import clip_grads, layer_registry
from tensorflow_privacy.privacy.fast_gradient_clipping.registry_functions.embedding import embedding_layer_computation
from tensorflow_privacy.privacy.optimizers.clip_and_aggregate_gradients import clip_and_aggregate_gradients

from privacy.accounting import dpsgd_event, dpsgd_schedule
from privacy.clipping import check_bound, clip_labels, clip_rows
from schemas.errors import UserError
from schemas.progress import bar as progress_bar
from trainer import optimizers
from trainer.encoder import ItemEncoder

UNITS = ("user", "example")


@dataclass(frozen=True)
class DPSGDConfig:
    """DP-SGD settings of the item update (`batch_size` is the expected number of units per step)."""

    epochs: float = 10
    batch_size: int = 256
    learning_rate: float = 0.01
    l2_norm_clip: float = 1.0  # C; inf = no clipping (non-private runs only)
    max_rows_per_user: int = 256
    unit: str = "user"
    ridge: float = 0.0  # ridge/2 ||theta||^2, on the scale of the summed loss
    optimizer: str = "adam"
    seed: int | None = None  # None: sampling and noise from OS entropy; fixed seeds are for tests
    fast_clipping: bool = True
    loss: str = (
        "square"  # or "logistic": implicit feedback, labels 1 (positives) and 0 (sampled negatives, `logistic_rows`)
    )

    def __post_init__(self):
        if self.unit not in UNITS:
            raise UserError(f"unit must be one of {UNITS}, got {self.unit!r}")
        if self.optimizer not in optimizers.OPTIMIZERS:
            raise UserError(f"optimizer must be one of {tuple(optimizers.OPTIMIZERS)}, got {self.optimizer!r}")
        for name in ("batch_size", "max_rows_per_user"):
            value = getattr(self, name)
            if not isinstance(value, int) or value < 1:
                raise UserError(f"{name} must be a positive integer, got {value}")
        for name in ("epochs", "learning_rate"):
            if not math.isfinite(getattr(self, name)) or getattr(self, name) <= 0:
                raise UserError(f"{name} must be a finite number > 0, got {getattr(self, name)}")
        if not math.isfinite(self.ridge) or self.ridge < 0:
            raise UserError(f"ridge must be a finite number >= 0, got {self.ridge}")
        check_bound("l2_norm_clip", self.l2_norm_clip, allow_inf=True)
        if self.loss not in ("square", "logistic"):
            raise UserError(f"loss must be square or logistic, got {self.loss!r}")


def logistic_rows(
    user_ids: np.ndarray, positions: np.ndarray, items: int, rng: np.random.Generator
) -> tuple[np.ndarray, ...]:
    """Implicit feedback's logistic rows for DP-SGD: each user's positives (label 1, weight w_p) and
    as many negatives (label 0) drawn uniformly without replacement from the catalog items it did not
    rate, each weighted w_n * items / drawn so that they estimate SSP-convex's every-item negative
    term without bias (w_p, w_n: privacy.quadratic.logistic_weights, wbar 1). Returns (user ids,
    positions, labels, weights). A user-local randomised function of the user's own rows."""
    from privacy.quadratic import logistic_weights

    user_ids, positions = np.asarray(user_ids), np.asarray(positions)
    order = np.argsort(user_ids, kind="stable")
    users, first, sizes = np.unique(user_ids[order], return_index=True, return_counts=True)
    w_p, w_n = logistic_weights(sizes, items, 1.0)
    out = [[user_ids[order]], [positions[order]], [np.ones(user_ids.size)], [np.repeat(w_p, sizes)]]
    for user, start, size, weight in zip(users, first, sizes, w_n, strict=True):
        rated = np.unique(positions[order][start : start + size])
        unrated = np.setdiff1d(np.arange(items), rated, assume_unique=True)
        drawn = (
            rng.choice(unrated, size=min(size, unrated.size), replace=False) if unrated.size else np.zeros(0, np.int64)
        )
        for part, values in zip(
            out,
            (
                np.full(drawn.size, user),
                drawn,
                np.zeros(drawn.size),
                np.full(drawn.size, weight * items / max(drawn.size, 1)),
            ),
            strict=True,
        ):
            part.append(values)
    return tuple(np.concatenate(part) for part in out)


def count_units(user_ids: np.ndarray, config: DPSGDConfig) -> int:
    """The number of privacy units in the rows: distinct users, or rows at example level."""
    user_ids = np.asarray(user_ids)
    return int(np.unique(user_ids).size if config.unit == "user" else user_ids.size)


def schedule(units: int, config: DPSGDConfig) -> tuple[float, int]:
    """(sampling probability, steps) of a run, known before training (to calibrate the noise)."""
    return dpsgd_schedule(units, config.batch_size, config.epochs)


def train(
    model: ItemEncoder,
    rows: tuple,
    user_vectors: tuple,
    config: DPSGDConfig,
    *,
    noise_multiplier: float,
    clip_u: float,
    clip_y: float,
    progress: bool = True,
    units: int | None = None,
) -> dict:
    """Fit `model` in place with DP-SGD; returns the run's schedule, timing and privacy event.

    rows: (user_ids int64[n], catalog positions int64[n], labels float[n], weights float[n]);
    user_vectors: (sorted user ids int64[m], embeddings float[m, d]). `units`: the number of privacy
    units the sampling was planned over (default: those in the rows; `ssp train` gives a DP estimate,
    never the exact number). Every unit of the rows is sampled with probability q = batch / units,
    whether `units` is above the rows' number (the units beyond them contribute nothing) or below it.
    """
    if not math.isfinite(noise_multiplier) or noise_multiplier < 0:
        raise UserError(f"noise multiplier must be a finite number >= 0, got {noise_multiplier}")
    if noise_multiplier > 0 and config.l2_norm_clip == math.inf:
        raise UserError("a private run (noise multiplier > 0) needs a finite l2_norm_clip")
    cap_rng, sample_rng, noise = _randomness(config.seed)
    data = _Units(model, rows, user_vectors, config, clip_u=clip_u, clip_y=clip_y, rng=cap_rng)
    count = data.count if units is None else units
    slots = max(count, data.count)  # one Poisson draw per unit of the rows (and per planned unit beyond them)
    q, steps = schedule(count, config)
    step = _make_step(model, config, noise_multiplier, count, noise)
    start = time.perf_counter()
    for _ in progress_bar(range(steps), desc="dpsgd", unit="step", enabled=progress, mininterval=2.0):
        sampled = np.flatnonzero(sample_rng.random(slots) < q)
        step(*data.batch(sampled[sampled < data.count]))
    event = dpsgd_event(noise_multiplier, q, steps)
    return {
        "steps": steps,
        "sampling_probability": q,
        "noise_multiplier": float(noise_multiplier),
        "units": count,
        "seconds": time.perf_counter() - start,
        "event": event,
    }


def _randomness(seed: int | None) -> tuple[np.random.Generator, np.random.Generator, tf.random.Generator]:
    """Independent streams for the row cap, the Poisson sampling and the noise (Philox), from
    `seed` or, when it is None, from OS entropy."""
    cap, sampling, noise = np.random.SeedSequence(seed).spawn(3)
    state = noise.generate_state(3, np.uint64).view(np.int64)
    return np.random.default_rng(cap), np.random.default_rng(sampling), tf.random.Generator.from_state(state, "philox")


class _Units:
    """The rows grouped by privacy unit (clipped, capped, float32), cut into padded batches."""

    def __init__(
        self,
        model: ItemEncoder,
        rows: tuple,
        user_vectors: tuple,
        config: DPSGDConfig,
        *,
        clip_u: float,
        clip_y: float,
        rng: np.random.Generator,
    ):
        user_ids, positions, labels, weights = (np.asarray(a) for a in rows)
        n = user_ids.size
        if not n or any(a.shape != (n,) for a in (positions, labels, weights)):
            raise UserError(
                "rows must be four non-empty 1-D arrays of one length (user ids, positions, labels, weights)"
            )
        if positions.min() < 0 or positions.max() >= model.space.size:
            raise UserError(f"item positions must be in [0, {model.space.size}) (the encoder's catalog)")
        if not np.all(np.isfinite(labels)) or not np.all(np.isfinite(weights)) or weights.min() < 0:
            raise UserError("labels must be finite and weights finite and >= 0")
        known, matrix = np.asarray(user_vectors[0]), np.asarray(user_vectors[1], dtype=np.float64)
        if matrix.shape != (known.size, model.dim) or np.any(np.diff(known) <= 0):
            raise UserError(f"user vectors must be sorted unique ids and a ({known.size}, {model.dim}) matrix")
        which = np.minimum(np.searchsorted(known, user_ids), known.size - 1)
        if not np.all(known[which] == user_ids):
            raise UserError(f"user {user_ids[known[which] != user_ids][0]} has rows but no embedding")
        vectors = clip_rows(matrix, clip_u).astype(np.float32)
        labels = labels if config.loss == "logistic" else clip_labels(labels, clip_y)  # logistic labels are 0 and 1
        if config.unit == "user":  # shuffle, group by user, keep each user's first max_rows_per_user rows
            order = rng.permutation(n)
            order = order[np.argsort(user_ids[order], kind="stable")]
            _, first, sizes = np.unique(user_ids[order], return_index=True, return_counts=True)
            rank = np.arange(n) - np.repeat(first, sizes)
            order = order[rank < config.max_rows_per_user]
            self.sizes = np.minimum(sizes, config.max_rows_per_user)
        else:
            order, self.sizes = np.arange(n), np.ones(n, dtype=np.int64)
        self.count = self.sizes.size
        self.starts = np.r_[0, np.cumsum(self.sizes)[:-1]]
        self.positions, self.labels = positions[order].astype(np.int64), labels[order].astype(np.float32)
        self.weights = weights[order].astype(np.float32)
        self.vectors = vectors[which[order][self.starts]]

    def batch(self, units: np.ndarray) -> tuple[tf.Tensor, ...]:
        """(positions [B, L], labels [B, L], weights [B, L], user vectors [B, d]); padding has weight 0.
        L, the padded width, is a power of two (or the longest unit): one traced step per width. An
        empty sample still takes a (noise only) step: one zero-weight unit stands in for it."""
        if not units.size:
            return tf.zeros([1, 1], tf.int64), tf.zeros([1, 1]), tf.zeros([1, 1]), tf.zeros([1, self.vectors.shape[1]])
        longest = int(self.sizes[units].max())
        width = min(1 << (longest - 1).bit_length(), int(self.sizes.max()))
        column = np.arange(width)
        valid = column < self.sizes[units][:, None]
        index = np.where(valid, self.starts[units][:, None] + column, 0)
        return (
            tf.constant(np.where(valid, self.positions[index], 0)),
            tf.constant(np.where(valid, self.labels[index], 0)),
            tf.constant(np.where(valid, self.weights[index], 0)),
            tf.constant(self.vectors[units]),
        )


class _TableLookup(tf.keras.layers.Layer):
    """An embedding lookup into one of the encoder's tables (shared, not copied)."""

    def __init__(self, table: tf.Variable, **kwargs):
        super().__init__(**kwargs)
        self.table = table

    def call(self, ids):
        return tf.nn.embedding_lookup(self.table, ids)


def _registry() -> layer_registry.LayerRegistry:
    registry = layer_registry.make_default_layer_registry()
    registry.insert(_TableLookup, embedding_layer_computation)
    return registry


def _norm_model(model: ItemEncoder) -> tuple[tf.keras.Model, list]:
    """The encoder as a functional model of registered layers over per-unit blocks:
    (ids [B, L, K], bag weights [B, L, K] per family, u [B, d]) -> predictions [B, L];
    and per family, the padded catalog bags (ids, 1/bag size) that feed it."""
    inputs, parts, bags = [], [], []
    for name, ragged, table in model._families:
        ids = tf.keras.Input((None, None), dtype=tf.int32, name=f"{name}_ids")
        share = tf.keras.Input((None, None), name=f"{name}_bag_weights")
        inputs += [ids, share]
        parts.append(tf.reduce_sum(_TableLookup(table, name=f"{name}_lookup")(ids) * share[..., None], axis=2))
        sizes = tf.cast(ragged.row_lengths(), tf.float32)
        bags.append(
            (
                tf.cast(ragged.to_tensor(), tf.int32),
                tf.ones_like(ragged, tf.float32).to_tensor() / tf.maximum(sizes, 1.0)[:, None],
            )
        )
    hidden = tf.concat(parts, axis=-1) if len(parts) > 1 else parts[0]
    v = model._dense(hidden) if model._dense is not None else hidden
    if model.has_residual:  # the per-item residual: a bag of one (the item's own row) added to the output
        ids = tf.keras.Input((None, None), dtype=tf.int32, name="item_residual_ids")
        share = tf.keras.Input((None, None), name="item_residual_bag_weights")
        inputs += [ids, share]
        v = v + tf.reduce_sum(
            _TableLookup(model._residual, name="item_residual_lookup")(ids) * share[..., None], axis=2
        )
        rows = tf.range(1, model.space.size + 1, dtype=tf.int32)[:, None]
        bags.append((rows, tf.ones_like(rows, tf.float32)))
    user = tf.keras.Input((model.dim,), name="user")
    norm_model = tf.keras.Model(inputs + [user], tf.reduce_sum(v * user[:, None, :], axis=-1))
    if {w.ref() for w in norm_model.trainable_variables} != {w.ref() for w in model.trainable_variables}:
        raise RuntimeError("the norm model does not cover exactly the encoder's variables")
    return norm_model, bags


def _unit_losses(pred, labels, weights, loss: str = "square"):
    """Each unit's weighted loss: sum over its rows of w (pred - y)^2 / 2, or of w (log(1 + e^pred) - y pred)."""
    if loss == "logistic":
        return tf.reduce_sum(weights * (tf.math.softplus(pred) - labels * pred), axis=1)
    return 0.5 * tf.reduce_sum(weights * tf.square(pred - labels), axis=1)


def _make_step(
    model: ItemEncoder, config: DPSGDConfig, noise_multiplier: float, units: int, noise: tf.random.Generator
):
    """One DP-SGD step on a padded batch (a tf.function)."""
    model(tf.zeros([1], tf.int64))  # build every variable
    variables = model.trainable_variables
    clip = config.l2_norm_clip
    optimizer = optimizers.compiled(config.optimizer, config.learning_rate)
    optimizer.build(variables)
    fast = clip != math.inf and config.fast_clipping
    classic = clip != math.inf and not config.fast_clipping
    if fast:
        norm_model, bags = _norm_model(model)
        registry = _registry()

    def per_unit_losses(positions, labels, weights, users):
        """The forward pass once per distinct item of the batch, gathered per row."""
        distinct, inverse = tf.unique(tf.reshape(positions, [-1]))
        v = tf.gather(model(distinct), tf.reshape(inverse, tf.shape(positions)))
        return _unit_losses(tf.einsum("bld,bd->bl", v, users), labels, weights, config.loss)

    def step(positions, labels, weights, users):
        scale = tf.ones_like(labels[:, 0])
        if fast:
            block = [t for ids, share in bags for t in (tf.gather(ids, positions), tf.gather(share, positions))]
            norms = clip_grads.compute_gradient_norms(
                norm_model,
                registry,
                block + [users],
                tf.stack([labels, weights], axis=-1),
                per_example_loss_fn=lambda y, pred, _: _unit_losses(pred, y[..., 0], y[..., 1], config.loss),
                trainable_vars=variables,
            )
            scale = clip_grads.compute_clip_weights(clip, norms)
        with tf.GradientTape(persistent=classic) as tape:
            losses = per_unit_losses(positions, labels, weights, users) * scale
            total = tf.reduce_sum(losses)
        if classic:
            grads = clip_and_aggregate_gradients(
                tape, losses, variables, tf.UnconnectedGradients.ZERO, l2_norm_clip=clip, aggregate_method="sum"
            )
        else:
            grads = tape.gradient(total, variables)
        if noise_multiplier > 0:
            grads = [
                tf.convert_to_tensor(g) + noise.normal(w.shape, stddev=noise_multiplier * clip)
                for g, w in zip(grads, variables, strict=True)
            ]
        grads = [_scaled(g, 1.0 / config.batch_size) for g in grads]
        if config.ridge:
            grads = [
                tf.convert_to_tensor(g) + (config.ridge / units) * w for g, w in zip(grads, variables, strict=True)
            ]
        optimizer.apply_gradients(zip(grads, variables, strict=True))

    traced = {}

    def run(positions, labels, weights, users):
        """TF-Privacy's ghost norms need static shapes past the batch axis: one trace per width."""
        width = int(positions.shape[1])
        if width not in traced:
            block = tf.TensorSpec([None, width], tf.float32)
            traced[width] = tf.function(
                step,
                autograph=False,
                input_signature=[
                    tf.TensorSpec([None, width], tf.int64),
                    block,
                    block,
                    tf.TensorSpec([None, model.dim], tf.float32),
                ],
            )
        traced[width](positions, labels, weights, users)

    return run


def _scaled(gradient, factor: float):
    """A dense or sparse (IndexedSlices) gradient times a number."""
    if isinstance(gradient, tf.IndexedSlices):
        return tf.IndexedSlices(gradient.values * factor, gradient.indices, gradient.dense_shape)
    return gradient * factor
