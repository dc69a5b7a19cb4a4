"""Model, input and optimizer functions for the strategy search tests (module level:
the search runs them in processes of their own)."""
import numpy as np
import tensorflow.compat.v1 as tf

from tests import models

ROWS, BATCH = 256, 16


def dataset():
    x, y = models.data(ROWS)
    return tf.data.Dataset.from_tensor_slices((x, y)).repeat().batch(BATCH,
                                                                    drop_remainder=True)


def model(features):
    x, y = features
    rng = np.random.RandomState(5)
    h = x
    for i in range(4):
        k = (rng.randn(tf.compat.dimension_value(h.shape[-1]), 32) * 0.2).astype(np.float32)
        h = tf.layers.dense(h, 32, activation=tf.nn.tanh, name="layer_%d" % i,
                            kernel_initializer=tf.constant_initializer(k))
    logits = tf.layers.dense(h, models.CLASSES, name="logits",
                             kernel_initializer=tf.constant_initializer(0.1))
    return tf.losses.sparse_softmax_cross_entropy(labels=y, logits=logits)


def optimizer():
    return tf.train.GradientDescentOptimizer(0.1)


def big_head_model(features):
    """A classifier over many classes: its head is the largest layer (the split
    candidate's case)."""
    x, y = features
    rng = np.random.RandomState(6)
    h = tf.layers.dense(x, 64, activation=tf.nn.tanh, name="hidden",
                        kernel_initializer=tf.constant_initializer(
                            (rng.randn(models.IN, 64) * 0.2).astype(np.float32)))
    logits = tf.layers.dense(h, HEAD_CLASSES, name="logits",
                             kernel_initializer=tf.constant_initializer(
                                 (rng.randn(64, HEAD_CLASSES) * 0.05).astype(np.float32)))
    return tf.losses.sparse_softmax_cross_entropy(labels=y * 997 % HEAD_CLASSES, logits=logits)


HEAD_CLASSES = 8000


def install_calibration(figures, tmp_path, monkeypatch):
    """A calibration cache (``epl.auto.local``) holding ``figures`` under ``tmp_path``;
    measuring the machine again is an error: the path."""
    import json
    from epl.auto import local
    monkeypatch.setenv("EPL_CACHE_DIR", str(tmp_path))
    monkeypatch.delenv("EPL_RECALIBRATE", raising=False)
    path = local.cache_path()
    with open(path, "w") as f:
        json.dump(figures, f)

    def no_measure(**_):
        raise AssertionError("the cached calibration should have been used")
    monkeypatch.setattr(local, "measure", no_measure)
    return path


def big_head_split2_model(features):
    """``big_head_model`` with its layers under one ``epl.split(2)`` (its hidden layer
    column-parallel, its head row-parallel: docs/split.md), the planner's split variant
    of it (``predict``'s ``split_variants``), written as a user writes it: no default
    strategy of its own."""
    import epl
    with epl.split(2):
        return big_head_model(features)
