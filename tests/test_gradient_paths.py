"""Fusion, fp16, sparse and clip-after-allreduce paths equal the plain local model."""
import numpy as np
import pytest
import tensorflow.compat.v1 as tf

import epl
from epl.rewrite.fusion import plan_buckets
from tests import models

N, BATCH, STEPS = 2, 4, 4


def _init(**cfg):
    base = {"cluster.devices_per_worker": N}
    base.update(cfg)
    epl.init(epl.Config(base))
    epl.set_default_strategy(epl.replicate(1))


def _dp_weights(**cfg):
    x, y = models.data(STEPS * N * BATCH)
    _init(**cfg)
    bx, by = models.input_batch(x, y, BATCH)
    _, loss = models.forward(bx, by)
    op = models.train_op(loss, "momentum", tf.train.get_or_create_global_step())
    with tf.Session() as sess:
        sess.run(tf.global_variables_initializer())
        for _ in range(STEPS):
            sess.run(op)
        return models.weights(sess), [o.type for o in tf.get_default_graph().get_operations()]


def _local():
    x, y = models.data(STEPS * N * BATCH)
    return models.train_local(x, y, N * BATCH, STEPS, "momentum")[0]


@pytest.mark.parametrize("splits, comms", [(1, 1), (2, 2), (5, 2), (100, 3)])
@pytest.mark.parametrize("copies", ["per_device", "per_worker"])
def test_fusion_splits_and_communicators(splits, comms, copies):
    want = _local()
    got, types = _dp_weights(**{"communication.max_splits": splits,
                                "communication.num_communicators": comms,
                                "cluster.variable_copies": copies})
    models.assert_weights_close(got, want)
    n_collectives = types.count("EplAllReduceN") // N
    assert 1 <= n_collectives <= min(splits, 4)   # 4 gradients, one dtype
    if splits in (1, 100):
        assert n_collectives == min(splits, 4)


def test_in_graph_communicator_fallback(monkeypatch):
    from epl.communicators import op_library
    monkeypatch.setattr(op_library, "available", lambda: False)
    want = _local()
    got, types = _dp_weights()
    assert "EplAllReduceN" not in types
    models.assert_weights_close(got, want)


def test_fp16_allreduce_close_to_fp32():
    want = _local()
    got, types = _dp_weights(**{"communication.fp16": True})
    assert "EplAllReduceN" in types and "Cast" in types
    models.assert_weights_close(got, want, rtol=2e-3, atol=2e-4)


def _embedding_model(ids, labels):
    table = tf.get_variable("emb", initializer=tf.constant(
        np.random.RandomState(2).randn(20, 6).astype(np.float32)))
    h = tf.reduce_mean(tf.nn.embedding_lookup(table, ids), axis=1)
    w = tf.get_variable("w", initializer=tf.constant(
        np.random.RandomState(3).randn(6, 3).astype(np.float32)))
    loss = tf.losses.sparse_softmax_cross_entropy(labels, tf.matmul(h, w))
    opt = tf.train.GradientDescentOptimizer(0.5)
    gvs = opt.compute_gradients(loss)
    assert isinstance(gvs[0][0], tf.IndexedSlices)
    with tf.control_dependencies([g.values if isinstance(g, tf.IndexedSlices) else g
                                  for g, _ in gvs]):
        return opt.apply_gradients(gvs), table, w


@pytest.mark.parametrize("as_dense", [False, True])
@pytest.mark.parametrize("copies", ["per_device", "per_worker"])
def test_sparse_gradients(as_dense, copies):
    rng = np.random.RandomState(0)
    ids = rng.randint(0, 20, (STEPS * N * BATCH, 3)).astype(np.int64)
    labels = rng.randint(0, 3, STEPS * N * BATCH).astype(np.int64)
    with tf.Graph().as_default():
        bi, bl = models.input_batch(ids, labels, N * BATCH)
        op, table, w = _embedding_model(bi, bl)
        want = models.run_steps(op, STEPS, [table, w])
    _init(**{"communication.sparse_as_dense": as_dense, "cluster.variable_copies": copies})
    bi, bl = models.input_batch(ids, labels, BATCH)
    op, table, w = _embedding_model(bi, bl)
    got = models.run_steps(op, STEPS, [table, w])
    types = [o.type for o in tf.get_default_graph().get_operations()]
    assert ("EplAllGather" in types) != as_dense
    for a, b in zip(got, want):
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6)


def _clipped_model(bx, by, step=None):
    _, loss = models.forward(bx, by)
    opt = tf.train.GradientDescentOptimizer(0.5)
    gvs = opt.compute_gradients(loss)
    grads, _ = tf.clip_by_global_norm([g for g, _ in gvs], 0.05)
    with tf.control_dependencies(grads):
        return opt.apply_gradients(list(zip(grads, [v for _, v in gvs])), global_step=step)


def test_clip_after_allreduce():
    x, y = models.data(STEPS * N * BATCH)
    with tf.Graph().as_default():
        bx, by = models.input_batch(x, y, N * BATCH)
        op = _clipped_model(bx, by)
        with tf.Session() as sess:
            sess.run(tf.global_variables_initializer())
            for _ in range(STEPS):
                sess.run(op)
            want = models.weights(sess)
    results = {}
    for after in (True, False):
        tf.reset_default_graph()
        _init(**{"communication.clip_after_allreduce": after})
        bx, by = models.input_batch(x, y, BATCH)
        op = _clipped_model(bx, by)
        with tf.Session() as sess:
            sess.run(tf.global_variables_initializer())
            for _ in range(STEPS):
                sess.run(op)
            results[after] = models.weights(sess)
    models.assert_weights_close(results[True], want)
    diff = max(np.abs(results[False][k] - want[k]).max() for k in want)
    assert diff > 1e-4   # clipping each replica's gradient is a different algorithm


def test_plan_buckets():
    items = [("a", "f32", 100), ("b", "f32", 100), ("c", "f16", 10), ("d", "f32", 100),
             ("e", "f32", 100)]
    assert plan_buckets(items, 1) == [("f32", ["a", "b", "d", "e"]), ("f16", ["c"])]
    assert plan_buckets(items, 2) == [("f32", ["a", "b"]), ("f32", ["d", "e"]), ("f16", ["c"])]
    assert len(plan_buckets(items, 10)) == 5
    with pytest.raises(ValueError, match="max_splits"):
        plan_buckets(items, 0)


def _scaled_forward(bx, by):
    """The local model whose logits are scaled by a constant that one op reads and
    another waits for (a tensor input and a control input of the same op, like the
    zeros of TF 2.x's SelectV2 gradient that gradient checkpointing waits for)."""
    logits, _ = models.forward(bx, by)
    scale = tf.constant(0.5, name="scale")
    with tf.control_dependencies([scale.op]):
        logits = tf.identity(logits)
    logits = logits * scale
    return tf.losses.sparse_softmax_cross_entropy(labels=by, logits=logits)


@pytest.mark.parametrize("devices, micro", [(1, 2), (2, 2)])
def test_constant_read_and_waited_for_in_micro_batches(devices, micro):
    x, y = models.data(STEPS * devices * micro * BATCH)
    with tf.Graph().as_default():
        bx, by = models.input_batch(x, y, devices * micro * BATCH)
        op = models.train_op(_scaled_forward(bx, by), "momentum")
        with tf.Session() as sess:
            sess.run(tf.global_variables_initializer())
            for _ in range(STEPS):
                sess.run(op)
            want = models.weights(sess)
    models.reset()
    epl.init(epl.Config({"cluster.devices_per_worker": devices,
                         "pipeline.num_micro_batch": micro}))
    epl.set_default_strategy(epl.replicate(1))
    bx, by = models.input_batch(x, y, BATCH)
    op = models.train_op(_scaled_forward(bx, by), "momentum")
    with tf.Session() as sess:
        sess.run(tf.global_variables_initializer())
        for _ in range(STEPS):
            sess.run(op)
        models.assert_weights_close(models.weights(sess), want)
