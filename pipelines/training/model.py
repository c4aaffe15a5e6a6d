"""The item encoder a run trains: built from the run's settings and the public item features, and
rescaled to a fixed item scale after each update.

Privacy: only public features and released values reach the encoder here.
"""

from __future__ import annotations

import numpy as np
import pyarrow as pa

from pipelines.training.settings import TrainConfig


def build_encoder(config: TrainConfig, items: pa.Table):
    """(feature space, item encoder) of the run, freshly initialised (deterministic in model_seed).
    With biases the encoder has one more output, the item's bias in units of the bias coordinate."""
    import tensorflow as tf

    from trainer import encoder as encoders
    from trainer.features import FeatureSpace

    tf.keras.utils.set_random_seed(config.model_seed)
    space = FeatureSpace.from_items(items, use_item_id=config.item_id_feature or config.encoder == "id")
    return space, encoders.ItemEncoder(space, config.encoder_dim, config.encoder, seed=config.model_seed)


def normalise_embeddings(model, config: TrainConfig) -> float:
    """Rescale the encoder so that its item embeddings have root-mean-square norm 1 over the
    catalog (public post-processing: predictions u^T v are unchanged once the users are solved
    again). The user ridge and the user clip are then stated against a fixed item scale. The bias
    output is left as it is: the users' biases are solved again, but the items' are not. Returns
    the factor applied."""
    vectors = model.embed_all()[:, : config.embedding_dim]
    rms = float(np.sqrt(np.mean(np.sum(vectors**2, axis=1)))) if vectors.size else 0.0
    if (
        not rms > 0 or abs(rms - 1.0) < 1e-6
    ):  # nothing to scale, or already at unit scale (a rescale would only add rounding)
        return 1.0
    factors = np.ones(config.encoder_dim)
    factors[: config.embedding_dim] = 1.0 / rms
    model.rescale(factors)
    return 1.0 / rms


def item_vectors(config: TrainConfig, outputs: np.ndarray) -> np.ndarray:
    """The item embeddings a run writes from the encoder's outputs (trainer.encoder.as_written)."""
    from trainer import encoder as encoders

    return np.asarray(encoders.as_written(outputs, config.settings().bias_scale if config.biases else None))


def item_embeddings_table(model, config: TrainConfig) -> pa.Table:
    """The run's item embeddings table (ITEM_EMBEDDINGS) of every catalog item."""
    from trainer import ssp

    return ssp.item_embeddings_table(model, item_vectors(config, model.embed_all()))


def zero_item_biases(model, config: TrainConfig) -> None:
    """Start every item's bias at 0 (the DP mean): the starting point says nothing of an item's
    bias until the statistics do."""
    if config.biases:
        model.rescale(np.r_[np.ones(config.embedding_dim), 0.0])
