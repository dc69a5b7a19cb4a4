"""The memory features under tf.keras's own training loop (model.fit on 2 devices):
with GC or grouped apply, fit trains exactly as the same program without EPL on one
device (the global batch of 16 split over the replicas); AMP follows it within 3e-2; and
EPL's own variables (the loss scale) are initialized by keras like the model's."""
import numpy as np
import pytest
import tensorflow.compat.v1 as tf

import epl
from tests import models


def _model():
    init = [tf.keras.initializers.glorot_uniform(seed=s) for s in range(4)]
    return tf.keras.Sequential(
        [tf.keras.layers.Dense(32, activation="tanh", input_shape=(8,), kernel_initializer=init[0])]
        + [tf.keras.layers.Dense(32, activation="tanh", kernel_initializer=k) for k in init[1:3]]
        + [tf.keras.layers.Dense(1, kernel_initializer=init[3])])


def _fit(config):
    """Weights after 3 epochs of fit (batch 16), and the loss history; ``config`` None:
    the program without EPL on one device."""
    models.reset()
    tf.keras.backend.clear_session()
    if config is not None:
        epl.init(epl.Config(dict(config, **{"cluster.devices_per_worker": 2})))
        epl.set_default_strategy(epl.replicate(1))
    model = _model()
    model.compile(tf.keras.optimizers.SGD(0.05), "mse")
    x = np.random.RandomState(0).randn(64, 8).astype(np.float32)
    y = np.tanh(x.sum(1, keepdims=True))
    history = model.fit(x, y, batch_size=16, epochs=3, verbose=0, shuffle=False)
    return model.get_weights(), history.history["loss"]


def _assert_weights(got, want, rtol, atol):
    assert len(got) == len(want) == 8
    for i, (g, w) in enumerate(zip(got, want)):
        np.testing.assert_allclose(g, w, rtol=rtol, atol=atol, err_msg="weight %d" % i)


@pytest.mark.parametrize("config", [{"gradient_checkpoint.type": "auto"},
                                    {"optimizer.num_apply_group": 3}])
def test_unchanged_numbers(config):
    want, losses = _fit(None)
    got, _ = _fit(config)
    _assert_weights(got, want, 1e-5, 1e-6)
    models.reset()
    tf.keras.backend.clear_session()
    assert not np.allclose(want[0], _model().get_weights()[0], atol=1e-4)   # (it trained)
    assert losses[-1] < losses[0]


def test_amp_follows_float32():
    want, _ = _fit(None)
    got, _ = _fit({"amp.level": "O1"})
    _assert_weights(got, want, 3e-2, 3e-3)
    assert any(not np.array_equal(g, w) for g, w in zip(got, want))   # (float16 products)
