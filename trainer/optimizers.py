"""The trainers' Keras optimizers (Adam, SGD), their updates compiled by XLA on every device.

Keras compiles an optimizer's update with XLA only where it finds a GPU. On a CPU, Adam's update is
then a dozen separate passes over each variable (its two moments, the step), and the features
encoder's per-item residuals make each pass as long as the catalog, at every minibatch: fused by
XLA, the item update's epochs at 10^7 users take less time (docs/results.md, "Adam's update
compiled on the CPU too").

Privacy: optimisation only; what each trainer may read is its own module's concern.
"""

from __future__ import annotations

import tensorflow as tf

OPTIMIZERS = {"adam": tf.keras.optimizers.Adam, "sgd": tf.keras.optimizers.SGD}


def compiled(name: str, learning_rate) -> tf.keras.optimizers.Optimizer:
    """Keras' optimizer `name` (adam or sgd) at `learning_rate` (a number or a schedule), its
    update compiled by XLA on a CPU as Keras compiles it on a GPU."""
    optimizer = OPTIMIZERS[name](learning_rate)
    optimizer.jit_compile = True
    return optimizer
