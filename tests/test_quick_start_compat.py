"""The quick start as written with TensorFlow's migration path (``import
tensorflow.compat.v1 as tf; tf.disable_v2_behavior()``, examples/quick_start/local_model.py)
on 2 virtual devices equals the same program without EPL on the global batch: the losses
of every step and the weights after the last.  On both lines; on TF 2.x also in the second
way to graph mode (``disable_eager_execution`` alone: resource variables, control flow v2).

The model, data, input pipeline (initializable iterator in TABLE_INITIALIZERS), optimizer
and MonitoredTrainingSession are the quick start's; the initial weights are fixed numpy
values and the update waits for every gradient, so the one-device program is deterministic
(PLATFORM_NOTES: the ref-variable trap -- disable_v2_behavior makes ref variables).
"""
import numpy as np
import pytest
import tensorflow.compat.v1 as tf

import epl  # noqa: E402

from epl.tf_adapter.version import IS_TF2  # noqa: E402

DEVICES, BATCH, STEPS = 2, 10, 6
FEATURES, HIDDEN, CLASSES = 20, 2, 10


def _data():
    rng = np.random.RandomState(0)
    x = rng.randint(0, 10, (DEVICES * BATCH * STEPS, FEATURES)).astype(np.float32)
    y = rng.randint(0, 10, DEVICES * BATCH * STEPS).astype(np.int64)
    return x, y


def _initial_weights():
    rng = np.random.RandomState(1)
    return [(rng.randn(FEATURES, HIDDEN) * 0.1).astype(np.float32),
            (rng.randn(HIDDEN) * 0.1).astype(np.float32),
            (rng.randn(HIDDEN, CLASSES) * 0.3).astype(np.float32),
            (rng.randn(CLASSES) * 0.1).astype(np.float32)]


def _quick_start(batch):
    """The quick start's graph; returns (loss, train_op, global_step)."""
    x_all, y_all = _data()
    k1, b1, k2, b2 = _initial_weights()
    dataset = tf.data.Dataset.from_tensor_slices((x_all, y_all)).batch(batch).repeat(1)
    iterator = tf.data.make_initializable_iterator(dataset)
    tf.add_to_collection(tf.GraphKeys.TABLE_INITIALIZERS, iterator.initializer)
    x, labels = iterator.get_next()
    logits = tf.layers.dense(x, HIDDEN, kernel_initializer=tf.constant_initializer(k1),
                             bias_initializer=tf.constant_initializer(b1))
    logits = tf.layers.dense(logits, CLASSES, kernel_initializer=tf.constant_initializer(k2),
                             bias_initializer=tf.constant_initializer(b2))
    loss = tf.losses.sparse_softmax_cross_entropy(labels=labels, logits=logits)
    global_step = tf.train.get_or_create_global_step()
    optimizer = tf.train.MomentumOptimizer(learning_rate=0.001, momentum=0.9)
    grads = optimizer.compute_gradients(loss)
    with tf.control_dependencies([g for g, _ in grads]):
        train_op = optimizer.apply_gradients(grads, global_step=global_step)
    return loss, train_op, global_step


def _weights(sess, prefix=""):
    names = ["dense/kernel", "dense/bias", "dense_1/kernel", "dense_1/bias"]
    graph = sess.graph
    return [sess.run(_value(graph, prefix + n)) for n in names]


def _value(graph, name):
    """The tensor holding variable ``name``'s value (ref or resource variable)."""
    op = graph.get_operation_by_name(name)
    if op.type == "VarHandleOp":
        return graph.get_tensor_by_name(name + "/Read/ReadVariableOp:0")
    return op.outputs[0]


@pytest.fixture(params=["disable_v2_behavior", "disable_eager_execution"])
def graph_mode(request):
    """Both ways users put TF 2.x in graph mode: ``disable_v2_behavior()`` (ref variables,
    v1 control flow; this module's default) or ``disable_eager_execution()`` alone
    (resource variables, control flow v2).  The second is set for the test and undone."""
    if request.param == "disable_eager_execution":
        tf.enable_resource_variables()
        tf.enable_control_flow_v2()
    yield request.param
    tf.disable_resource_variables()
    tf.disable_control_flow_v2()


def _op_names(graph):
    return {op.name for op in graph.get_operations()}


def _local():
    """The oracle: no EPL, one device, the global batch."""
    with tf.Graph().as_default():
        loss, train_op, _ = _quick_start(DEVICES * BATCH)
        with tf.train.MonitoredTrainingSession() as sess:
            losses = [sess.run([loss, train_op])[0] for _ in range(STEPS)]
            return losses, _weights(sess._tf_sess())  # pylint: disable=protected-access


@pytest.mark.parametrize("copies", ["auto", "per_device"])
def test_quick_start_on_two_devices_equals_the_global_batch(graph_mode, copies):
    want_losses, want_weights = _local()
    epl.init(epl.Config({"cluster.devices_per_worker": DEVICES,
                         "cluster.variable_copies": copies}))
    epl.set_default_strategy(epl.replicate(1))
    loss, train_op, global_step = _quick_start(BATCH)
    graph = tf.get_default_graph()
    variable_type = _value(graph, "dense/kernel").op.type
    with tf.train.MonitoredTrainingSession() as sess:
        raw = sess._tf_sess()  # pylint: disable=protected-access
        # (the replicas' losses: each replica's mean over its half of the global batch)
        replica_losses = [loss] + [graph.get_tensor_by_name("EPL_REPLICA_%d/%s" % (r, loss.name))
                                   for r in range(1, DEVICES)]
        got_losses = []
        for _ in range(STEPS):
            values, _ = sess.run([replica_losses, train_op])
            got_losses.append(np.mean(values))
        step = raw.run(global_step)
        # (every replica's copy of the weights, where each device has its own)
        got_weights = [_weights(raw, "" if r == 0 else "EPL_REPLICA_%d/" % r)
                       for r in range(DEVICES)
                       if r == 0 or "EPL_REPLICA_%d/dense/kernel" % r in _op_names(graph)]
    assert step == STEPS
    # (the mode took: resource variables exactly without disable_v2_behavior)
    assert (variable_type == "ReadVariableOp") == (graph_mode == "disable_eager_execution")
    np.testing.assert_allclose(got_losses, want_losses, rtol=1e-5)
    for replica in got_weights:
        for got, want in zip(replica, want_weights):
            np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6)
