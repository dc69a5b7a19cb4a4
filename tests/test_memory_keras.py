"""The memory features under tf.keras's own training loop (model.fit on 2 devices):
GC and grouped apply change no number, AMP follows float32 within 3e-2, and EPL's
own variables (the loss scale) are initialized by keras like the model's."""
import numpy as np
import pytest
import tensorflow as tf

import epl
from tests import models


def _fit(config):
    models.reset()
    epl.init(epl.Config(dict(config, **{"cluster.devices_per_worker": 2})))
    epl.set_default_strategy(epl.replicate(1))
    init = [tf.keras.initializers.glorot_uniform(seed=s) for s in range(4)]
    model = tf.keras.Sequential(
        [tf.keras.layers.Dense(32, activation="tanh", input_shape=(8,), kernel_initializer=init[0])]
        + [tf.keras.layers.Dense(32, activation="tanh", kernel_initializer=k) for k in init[1:3]]
        + [tf.keras.layers.Dense(1, kernel_initializer=init[3])])
    model.compile(tf.keras.optimizers.SGD(0.05), "mse")
    x = np.random.RandomState(0).randn(64, 8).astype(np.float32)
    y = np.tanh(x.sum(1, keepdims=True))
    return model.fit(x, y, batch_size=16, epochs=3, verbose=0, shuffle=False).history["loss"]


@pytest.mark.parametrize("config", [{"gradient_checkpoint.type": "auto"},
                                    {"optimizer.num_apply_group": 3}])
def test_unchanged_numbers(config):
    np.testing.assert_allclose(_fit(config), _fit({}), rtol=1e-5)


def test_amp_follows_float32():
    want = _fit({})
    np.testing.assert_allclose(_fit({"amp.level": "O1"}), want, rtol=3e-2)
    assert want[-1] < want[0]
