"""The item encoder a run trains: built from the run's settings and the public item features, and
rescaled to a fixed item scale after each update.

Privacy: only public features and released values reach the encoder here.
"""

from __future__ import annotations

import numpy as np
import pyarrow as pa

from pipelines.training.settings import TrainConfig


def build_encoder(config: TrainConfig, items: pa.Table):
    """(feature space, item encoder) of the run, freshly initialised (deterministic in model_seed)."""
    import tensorflow as tf

    from trainer import encoder as encoders
    from trainer.features import FeatureSpace

    tf.keras.utils.set_random_seed(config.model_seed)
    space = FeatureSpace.from_items(items, use_item_id=config.item_id_feature or config.encoder == "id")
    return space, encoders.ItemEncoder(space, config.dim, config.encoder, seed=config.model_seed)


def normalise_embeddings(model) -> float:
    """Rescale the encoder so that its item embeddings have root-mean-square norm 1 over the
    catalog (public post-processing: predictions u^T v are unchanged once the users are solved
    again). The user ridge and the user clip are then stated against a fixed item scale. Returns
    the factor applied."""
    vectors = model.embed_all()
    rms = float(np.sqrt(np.mean(np.sum(vectors**2, axis=1)))) if vectors.size else 0.0
    if not rms > 0:
        return 1.0
    model.rescale(1.0 / rms)
    return 1.0 / rms
