"""The graph's life around the rewrite (issue 10, item 4).

EPL rewrites the graph before the first run that computes the model (or when
the graph is finalized): runs that only initialize or restore variables, or
initialize an iterator, do not trigger it, so a train op built after them is
replicated.  Later updates are refused by name; a failed rewrite keeps failing.
"""
import numpy as np
import pytest
import tensorflow.compat.v1 as tf

import epl
from epl.core.layout import LayoutError
from tests import models

STEPS, BATCH = 3, 4


@pytest.mark.parametrize("copies", ["per_device", "per_worker"])
def test_train_op_built_after_the_first_run_is_replicated(copies):
    n = 2
    x, y = models.data(STEPS * n * BATCH)
    want, _ = models.train_local(x, y, n * BATCH, STEPS, "momentum")
    models.init_data_parallel(n, **{"cluster.variable_copies": copies})
    bx, by = models.input_batch(x, y, BATCH)
    _, loss = models.forward(bx, by)
    with tf.Session() as sess:
        sess.run(tf.global_variables_initializer())   # not the model yet
        op = models.train_op(loss, "momentum", tf.train.get_or_create_global_step())
        sess.run(tf.variables_initializer([tf.train.get_global_step()] + [
            v for v in tf.global_variables() if "Momentum" in v.op.name]))
        for _ in range(STEPS):
            sess.run(op)
        for c in range(n if copies == "per_device" else 1):
            got = models.weights(sess, "" if c == 0 else "EPL_REPLICA_%d/" % c)
            models.assert_weights_close(got, want)


def _keras_model():
    w = models.initial_weights()
    inp = tf.keras.Input((models.IN,))
    h = tf.keras.layers.Dense(models.HIDDEN, activation="tanh", name="dense",
                              kernel_initializer=tf.constant_initializer(
                                  w["dense/kernel"]),
                              bias_initializer=tf.constant_initializer(
                                  w["dense/bias"]))(inp)
    out = tf.keras.layers.Dense(models.CLASSES, name="dense_1", activation="softmax",
                                kernel_initializer=tf.constant_initializer(
                                    w["dense_1/kernel"]),
                                bias_initializer=tf.constant_initializer(
                                    w["dense_1/bias"]))(h)
    return tf.keras.Model(inp, out)


def _keras_fit(x, y, batch, epochs_steps):
    model = _keras_model()
    model.compile(tf.keras.optimizers.SGD(0.1, momentum=0.9),
                  "sparse_categorical_crossentropy")
    ds = tf.data.Dataset.from_tensor_slices((x, y)).batch(batch).repeat()
    for steps in epochs_steps:   # fit twice: the second call makes a new iterator
        model.fit(ds, steps_per_epoch=steps, epochs=1, verbose=0)
    return {v.name.split(":")[0]: v for v in model.weights}, \
        tf.keras.backend.get_session()


@pytest.mark.parametrize("n", [2, 4])
def test_keras_compile_and_fit(n):
    """Keras feeds each step's batch into the model's Input placeholder: that batch is
    the global batch, split over the replicas (as MirroredStrategy does with Keras).
    Oracle: the same program without EPL."""
    batch = 4 * n
    x, y = models.data(5 * batch)
    models.reset()
    tf.keras.backend.clear_session()
    weights, sess = _keras_fit(x, y, batch, [3, 2])
    want = {k: sess.run(v) for k, v in weights.items()}
    models.reset()
    tf.keras.backend.clear_session()
    models.init_data_parallel(n)
    weights, sess = _keras_fit(x, y, batch, [3, 2])
    got = {k: sess.run(v) for k, v in weights.items()}
    assert sorted(got) == sorted(want)
    for k in want:
        np.testing.assert_allclose(got[k], want[k], rtol=1e-5, atol=1e-6, err_msg=k)
    types = [o.type for o in tf.get_default_graph().get_operations()]
    assert "EplAllReduceN" in types or n == 1
    tf.keras.backend.clear_session()


def test_failed_rewrite_keeps_failing():
    epl.init(epl.Config({"cluster.devices_per_worker": 3}))
    with epl.replicate(2):
        w = tf.get_variable("w", initializer=tf.ones([2]))
        x = tf.placeholder(tf.float32, [None, 2])
        loss = tf.reduce_sum(w * x)
    with tf.Session() as sess:
        for _ in range(2):   # never the plain single-device graph
            with pytest.raises(LayoutError, match="3 devices cannot be divided"):
                sess.run(loss, {x: np.ones((4, 2))})


def test_second_train_op_after_training_started():
    """A train op built after the model already trained is rewritten before it runs."""
    n = 2
    x, y = models.data(2 * STEPS * n * BATCH)
    models.init_data_parallel(n)
    bx, by = models.input_batch(x, y, BATCH)
    _, loss = models.forward(bx, by)
    first = models.train_op(loss, "sgd")
    with tf.Session() as sess:
        sess.run(tf.global_variables_initializer())
        for _ in range(STEPS):
            sess.run(first)
        second = models.train_op(loss, "momentum")
        sess.run(tf.variables_initializer(
            [v for v in tf.global_variables() if "Momentum" in v.op.name]))
        for _ in range(STEPS):
            sess.run(second)
        got = models.weights(sess)
    models.reset()
    with tf.Graph().as_default():
        bx, by = models.input_batch(x, y, n * BATCH)
        _, loss = models.forward(bx, by)
        first = models.train_op(loss, "sgd")
        second = models.train_op(loss, "momentum")
        with tf.Session() as sess:
            sess.run(tf.global_variables_initializer())
            for op in [first] * STEPS + [second] * STEPS:
                sess.run(op)
            want = models.weights(sess)
    models.assert_weights_close(got, want)


def test_ops_added_to_a_pipeline_after_its_rewrite_are_refused_by_name():
    epl.init(epl.Config({"cluster.devices_per_worker": 2, "pipeline.num_micro_batch": 2}))
    bx, by = models.input_batch(*models.data(64), BATCH)
    with epl.replicate(1, name="stage_0"):
        h = tf.layers.dense(bx, 8, name="first")
    with epl.replicate(1, name="stage_1"):
        loss = tf.reduce_mean(tf.layers.dense(h, 2, name="second"))
    op = tf.train.GradientDescentOptimizer(0.1).minimize(loss)
    with tf.Session() as sess:
        sess.run(tf.global_variables_initializer())
        sess.run(op)
        late = tf.train.GradientDescentOptimizer(0.2).minimize(loss)
        with pytest.raises(RuntimeError, match=r"added afterwards \('gradients_1/.*pipeline"):
            sess.run(late)


def test_reading_the_model_after_the_rewrite_is_fine():
    """New ops that only read the model (an accuracy built after training) compute on
    replica 0's tensors, like a fetch."""
    models.init_data_parallel(2)
    x, y = models.data(64)
    bx, by = models.input_batch(x, y, BATCH)
    logits, loss = models.forward(bx, by)
    op = tf.train.GradientDescentOptimizer(0.1).minimize(loss)
    with tf.Session() as sess:
        sess.run(tf.global_variables_initializer())
        sess.run(op)
        correct = tf.reduce_sum(tf.cast(tf.equal(tf.argmax(logits, 1), by), tf.int32))
        assert 0 <= sess.run(correct) <= BATCH


def test_init_twice_starts_a_new_graph():
    """A second epl.init() starts over, as the original does: a new default graph (the
    old graph's annotations belong to the old cluster), the new config applies."""
    models.init_data_parallel(2)
    old = tf.get_default_graph()
    tf.constant(1.0, name="old_op")
    n = 4
    x, y = models.data(STEPS * n * BATCH)
    models.init_data_parallel(n)
    assert tf.get_default_graph() is not old
    bx, by = models.input_batch(x, y, BATCH)
    _, loss = models.forward(bx, by)
    op = models.train_op(loss, "momentum")
    names = sorted(models.initial_weights())
    g = tf.get_default_graph()
    got = dict(zip(names, models.run_steps(op, STEPS, [models.value_tensor(g, k)
                                                      for k in names])))
    models.reset()
    want, _ = models.train_local(x, y, n * BATCH, STEPS, "momentum")
    models.assert_weights_close(got, want)


def test_init_twice_inside_a_graph_context_drops_that_graphs_annotations():
    g = tf.Graph()
    with g.as_default():
        models.init_data_parallel(2)
        with epl.replicate(1):
            tf.constant(1.0)
        assert epl.Graph.get().taskgraphs
        models.init_data_parallel(2)
        assert tf.get_default_graph() is g
        assert not epl.Graph.get().taskgraphs
