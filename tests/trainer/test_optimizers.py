"""The trainers' optimizers: an update compiled by XLA is Keras' own update, on the sparse gradients
of embedding lookups (repeated rows included) and on dense ones."""

import numpy as np
import pytest
import tensorflow as tf

from trainer import optimizers


@pytest.mark.parametrize("name", ["adam", "sgd"])
def test_the_compiled_update_is_keras_update(name):
    rng = np.random.default_rng(0)
    start = rng.standard_normal((50, 4)).astype(np.float32)
    steps = [
        (rng.integers(0, 50, 12), rng.standard_normal((12, 4)).astype(np.float32), rng.standard_normal(4))
        for _ in range(6)
    ]
    ends = []
    for optimizer in (optimizers.compiled(name, 0.05), optimizers.OPTIMIZERS[name](0.05)):
        table, dense = tf.Variable(start), tf.Variable(start[0])
        optimizer.build([table, dense])
        for rows, values, gradient in steps:
            sparse = tf.IndexedSlices(tf.constant(values), tf.constant(rows), tf.constant(table.shape))
            optimizer.apply_gradients([(sparse, table), (tf.constant(gradient, tf.float32), dense)])
        ends.append((optimizer.jit_compile, table.numpy(), dense.numpy()))
    (compiled, table, dense), (plain, keras_table, keras_dense) = ends
    assert compiled and not plain  # two different paths: XLA's and Keras' own on this CPU
    assert not np.allclose(table, start)  # the steps moved the rows they touched
    np.testing.assert_allclose(table, keras_table, rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(dense, keras_dense, rtol=1e-5, atol=1e-6)
