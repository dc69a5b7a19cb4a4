"""Fixed batch shapes (``drop_remainder=True`` datasets, static placeholders) in every
layout that changes how many rows a part of the model sees (issue 10, item 2).

Oracles: the same program without EPL on one device.  ``replicate(device_count=k)``
splits each replica's batch into k parts (seed 003): the total equals the local
batch.  A fed placeholder holds the global batch (split over the replicas).  A split
scope after replicated layers sees every replica's rows.
"""
import numpy as np
import pytest
import tensorflow.compat.v1 as tf

import epl
from tests import models
from tests import split_models as sm

STEPS, B = 3, 8
HEAD_CLASSES = 12   # enough to shard the head over 8 devices


def _fixed_batches(x, y, batch):
    ds = tf.data.Dataset.from_tensor_slices((x, y)).batch(batch, drop_remainder=True)
    bx, by = tf.data.make_one_shot_iterator(ds).get_next()
    assert bx.shape[0] == batch
    return bx, by


def _train(loss, steps=STEPS, feeds=None):
    op = models.train_op(loss, "momentum", tf.train.get_or_create_global_step())
    with tf.Session() as sess:
        sess.run(tf.global_variables_initializer())
        for i in range(steps):
            sess.run(op, feeds(i) if feeds else None)
        return models.weights(sess)


def _local_dense(x, y, batch):
    models.reset()
    bx, by = _fixed_batches(x, y, batch)
    return _train(models.forward(bx, by)[1])


@pytest.mark.parametrize("devices,k", [(2, 2), (4, 2), (4, 4)])
def test_replicate_device_count_k_splits_a_fixed_batch(devices, k):
    replicas = devices // k
    x, y = models.data(STEPS * replicas * B)
    want = _local_dense(x, y, replicas * B)
    models.reset()
    epl.init(epl.Config({"cluster.devices_per_worker": devices}))
    bx, by = _fixed_batches(x, y, B)
    with epl.replicate(device_count=k):
        _, loss = models.forward(bx, by)
    models.assert_weights_close(_train(loss), want)
    matmuls = set(o.device for o in tf.get_default_graph().get_operations()
                  if o.type == "MatMul")
    assert len(matmuls) == devices


def test_dp_fixed_batch():
    n = 2
    x, y = models.data(STEPS * n * B)
    want = _local_dense(x, y, n * B)
    models.reset()
    epl.init(epl.Config({"cluster.devices_per_worker": n}))
    epl.set_default_strategy(epl.replicate(1))
    bx, by = _fixed_batches(x, y, B)
    models.assert_weights_close(_train(models.forward(bx, by)[1]), want)


@pytest.mark.parametrize("n", [2, 4])
def test_static_placeholder_holds_the_global_batch(n):
    x, y = models.data(STEPS * B)

    def feeds(px, py):
        return lambda i: {px: x[i * B:(i + 1) * B], py: y[i * B:(i + 1) * B]}

    models.reset()
    px, py = tf.placeholder(tf.float32, [B, models.IN]), \
        tf.placeholder(tf.int64, [B])
    want = _train(models.forward(px, py)[1], feeds=feeds(px, py))
    models.reset()
    epl.init(epl.Config({"cluster.devices_per_worker": n}))
    epl.set_default_strategy(epl.replicate(1))
    px, py = tf.placeholder(tf.float32, [B, models.IN]), \
        tf.placeholder(tf.int64, [B])
    models.assert_weights_close(_train(models.forward(px, py)[1], feeds=feeds(px, py)), want)


def test_fixed_batch_that_does_not_divide_is_named():
    x, y = models.data(4 * 5)
    epl.init(epl.Config({"cluster.devices_per_worker": 2}))
    bx, by = _fixed_batches(x, y, 5)
    with epl.replicate(device_count=2):
        _, loss = models.forward(bx, by)
    with pytest.raises(ValueError, match=r"IteratorGetNext:0.* 5 rows.*2 "):
        _train(loss)


def test_pipeline_fixed_batch():
    m = 2
    x, y = models.data(STEPS * m * B)
    want = _local_dense(x, y, m * B)
    models.reset()
    epl.init(epl.Config({"cluster.devices_per_worker": 2, "pipeline.num_micro_batch": m}))
    bx, by = _fixed_batches(x, y, B)
    w = models.initial_weights()
    with epl.replicate(1, name="stage_0"):
        h = tf.layers.dense(
            bx, models.HIDDEN, activation=tf.nn.tanh,
            kernel_initializer=tf.constant_initializer(w["dense/kernel"]),
            bias_initializer=tf.constant_initializer(w["dense/bias"]))
    with epl.replicate(1, name="stage_1"):
        logits = tf.layers.dense(
            h, models.CLASSES,
            kernel_initializer=tf.constant_initializer(w["dense_1/kernel"]),
            bias_initializer=tf.constant_initializer(w["dense_1/bias"]))
        loss = tf.losses.sparse_softmax_cross_entropy(labels=by, logits=logits)
    models.assert_weights_close(_train(loss), want)


def _head_model(bx, by, values, rdc=None, n=None):
    """A replicated backbone and a split classifier head whose loss reads the labels
    straight from the iterator (the seed's large-scale classification, §5.3.1)."""
    from tests.test_split import _hybrid
    return _hybrid(values, n, rdc)(bx, by)[0]


def _head_values():
    from tests.test_split import _head_values as head_values
    return head_values(classes=HEAD_CLASSES)


def _checkpointed(loss, tmpdir, name):
    import os
    op = sm.train_op(loss)
    with tf.Session() as sess:
        sess.run(tf.global_variables_initializer())
        for _ in range(STEPS):
            sess.run(op)
        path = tf.train.Saver().save(sess, os.path.join(str(tmpdir), name))
    reader = tf.train.load_checkpoint(path)
    return {k: reader.get_tensor(k) for k in reader.get_variable_to_shape_map()}


@pytest.mark.parametrize("devices,rdc,n", [(2, 1, 2), (4, 4, 4), (2, 2, 2), (8, 8, 8)])
def test_hybrid_with_fixed_batches_matches_local(devices, rdc, n, tmpdir):
    """replicate(rdc) backbone + split(n) head, colocated: (2, 1, 2) is two replicas
    whose batches the head concatenates; (8, 8, 8) is the seed's replicate(8)+split(8):
    one replica whose batch is split into 8."""
    values = _head_values()
    replicas = devices // rdc
    x, y = sm.data(STEPS * replicas * B, classes=HEAD_CLASSES)
    models.reset()
    want = _checkpointed(_head_model(*_fixed_batches(x, y, replicas * B), values), tmpdir, "l")
    models.reset()
    epl.init(epl.Config({"cluster.devices_per_worker": devices,
                         "cluster.colocate_split_and_replicate": True}))
    bx, by = _fixed_batches(x, y, B)
    got = _checkpointed(_head_model(bx, by, values, rdc, n), tmpdir, "h")
    assert sorted(got) == sorted(want)
    for k in want:
        np.testing.assert_allclose(got[k], want[k], rtol=1e-5, atol=1e-6, err_msg=k)


def seed_moe_recipe(tmpdir, n=None):
    """Seed §5.3.2 with a drop_remainder dataset: default replicate(n), expert variables
    under split(n), the calculation after it (back in the default replicate).  Without
    ``n``: the same program without EPL.  Returns the trained weights (checkpoint)."""
    import os
    experts, d, hidden, t = 4, 6, 8, 8
    rng = np.random.RandomState(0)
    xs = rng.randn(STEPS * t, d).astype(np.float32)
    ys = rng.randn(STEPS * t, d).astype(np.float32)
    w1v = (rng.randn(experts, d, hidden) * 0.4).astype(np.float32)
    w2v = (rng.randn(d, d) * 0.4).astype(np.float32)
    bx, by = _fixed_batches(xs, ys, t)
    if n:
        epl.set_default_strategy(epl.replicate(n))
    pre = tf.layers.dense(bx, d, kernel_initializer=tf.constant_initializer(w2v), name="attention")
    if n:
        with epl.split(n):
            w1 = tf.get_variable("experts_w1", initializer=w1v)
    else:
        w1 = tf.get_variable("experts_w1", initializer=w1v)
    h = tf.nn.relu(tf.einsum("td,edh->teh", pre, w1))
    loss = tf.reduce_mean((tf.reduce_sum(h, axis=1)[:, :d] - by) ** 2)
    op = sm.train_op(loss, "adam")
    with tf.Session() as sess:
        sess.run(tf.global_variables_initializer())
        for _ in range(STEPS):
            sess.run(op)
        path = tf.train.Saver().save(sess, os.path.join(str(tmpdir), "moe"))
    reader = tf.train.load_checkpoint(path)
    return {k: reader.get_tensor(k) for k in ("experts_w1", "attention/kernel")}


def test_seed_moe_recipe_with_fixed_batches(tmpdir):
    n = 2
    models.reset()
    want = seed_moe_recipe(tmpdir)
    models.reset()
    epl.init(epl.Config({"cluster.devices_per_worker": n,
                         "cluster.colocate_split_and_replicate": True}))
    got = seed_moe_recipe(tmpdir, n)
    for k in want:
        np.testing.assert_allclose(got[k], want[k], rtol=1e-5, atol=1e-6, err_msg=k)
