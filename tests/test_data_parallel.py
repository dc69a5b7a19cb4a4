"""Data parallelism on N virtual devices equals one device with an N-times batch."""
import numpy as np
import pytest
import tensorflow.compat.v1 as tf

import epl
from tests import models

STEPS, BATCH = 5, 4


def _replica_weights(sess, n):
    """Every replica's copy of every weight (replica 0 under the user's names)."""
    return [models.weights(sess, "" if c == 0 else "EPL_REPLICA_%d/" % c) for c in range(n)]


def run_dp_session(n, optimizer, use_resource=False, runner="session", copies="per_device"):
    x, y = models.data(STEPS * n * BATCH)
    models.init_data_parallel(n, **{"cluster.variable_copies": copies})
    bx, by = models.input_batch(x, y, BATCH)
    _, loss = models.forward(bx, by, use_resource)
    step = tf.train.get_or_create_global_step()
    op = models.train_op(loss, optimizer, step)
    if runner == "session":
        sess = tf.Session()
        sess.run(tf.global_variables_initializer())
    else:
        sess = tf.train.MonitoredTrainingSession()
    with sess:
        for _ in range(STEPS):
            sess.run(op)
        raw = sess if runner == "session" else sess._tf_sess()  # pylint: disable=protected-access
        per_replica = _replica_weights(raw, n if copies == "per_device" else 1)
        final_step = raw.run(step)
    return per_replica, final_step


@pytest.mark.parametrize("copies", ["per_device", "per_worker"])
@pytest.mark.parametrize("runner", ["session", "monitored"])
@pytest.mark.parametrize("optimizer", ["momentum", "adam"])
@pytest.mark.parametrize("n", [2, 4])
def test_dp_matches_big_batch(n, optimizer, runner, copies):
    x, y = models.data(STEPS * n * BATCH)
    want, _ = models.train_local(x, y, n * BATCH, STEPS, optimizer)
    per_replica, final_step = run_dp_session(n, optimizer, runner=runner, copies=copies)
    for got in per_replica:
        models.assert_weights_close(got, want)
    assert final_step == STEPS


@pytest.mark.parametrize("copies", ["per_device", "per_worker"])
def test_dp_resource_variables(copies):
    n = 2
    x, y = models.data(STEPS * n * BATCH)
    want, _ = models.train_local(x, y, n * BATCH, STEPS, "momentum", use_resource=True)
    per_replica, _ = run_dp_session(n, "momentum", use_resource=True, copies=copies)
    for got in per_replica:
        models.assert_weights_close(got, want)


def _random_init_program():
    """Two variables with random initializers (a ref and a resource variable, explicit op
    seeds), a loss that reads both, and an update after every gradient."""
    v = tf.get_variable("v", [50], initializer=tf.random_normal_initializer(seed=5))
    r = tf.get_variable("r", [50], initializer=tf.random_uniform_initializer(seed=6),
                                  use_resource=True)
    loss = tf.reduce_sum(v * r)
    opt = tf.train.GradientDescentOptimizer(0.1)
    grads = opt.compute_gradients(loss)
    with tf.control_dependencies([g for g, _ in grads]):
        return v, r, opt.apply_gradients(grads)


def test_replicas_start_from_replica_zero_random_init():
    """Random initializers are broadcast: every copy starts from replica 0's value, which
    is the value of the program without EPL (same seeds), and after two steps every copy
    equals that program's variables."""
    v, r, op = _random_init_program()
    with tf.Session() as sess:
        sess.run(tf.global_variables_initializer())
        want_init = sess.run([v, r])
        sess.run(op)
        sess.run(op)
        want_trained = sess.run([v, r])
    models.reset()
    models.init_data_parallel(3, **{"cluster.variable_copies": "per_device"})
    v, r, op = _random_init_program()
    with tf.Session() as sess:
        sess.run(tf.global_variables_initializer())
        g = tf.get_default_graph()
        copies = [(v, r)] + [(models.value_tensor(g, "EPL_REPLICA_%d/v" % c),
                              models.value_tensor(g, "EPL_REPLICA_%d/r" % c))
                             for c in (1, 2)]
        for pair in copies:
            for got, want in zip(sess.run(pair), want_init):
                np.testing.assert_array_equal(got, want)
        sess.run(op)
        sess.run(op)
        for pair in copies:
            for got, want in zip(sess.run(pair), want_trained):
                np.testing.assert_allclose(got, want, rtol=1e-6)
        assert not np.allclose(want_trained[0], want_init[0])


@pytest.mark.estimator
def test_dp_estimator(tmp_path):
    n, optimizer = 2, "momentum"
    x, y = models.data(STEPS * n * BATCH)
    want, _ = models.train_local(x, y, n * BATCH, STEPS, optimizer)
    models.init_data_parallel(n)

    def input_fn():
        return tf.data.Dataset.from_tensor_slices((x, y)).batch(BATCH)

    def model_fn(features, labels, mode):
        _, loss = models.forward(features, labels)
        op = models.train_op(loss, optimizer, tf.train.get_global_step())
        return tf.estimator.EstimatorSpec(mode, loss=loss, train_op=op)

    est = tf.estimator.Estimator(model_fn, model_dir=str(tmp_path))
    est.train(input_fn, steps=STEPS)
    got = {name: est.get_variable_value(name) for name in models.initial_weights()}
    models.assert_weights_close(got, want)
    assert est.get_variable_value("global_step") == STEPS


def test_gradients_reduce_sum():
    """'sum' reduction equals the big batch with an N-times learning rate (SGD)."""
    n = 2
    x, y = models.data(STEPS * n * BATCH)
    with tf.Graph().as_default():
        bx, by = models.input_batch(x, y, n * BATCH)
        _, loss = models.forward(bx, by)
        opt = tf.train.GradientDescentOptimizer(0.1 * n)
        gvs = opt.compute_gradients(loss)
        with tf.control_dependencies([g for g, _ in gvs]):
            op = opt.apply_gradients(gvs)
        with tf.Session() as sess:
            sess.run(tf.global_variables_initializer())
            for _ in range(STEPS):
                sess.run(op)
            want = models.weights(sess)
    models.init_data_parallel(n, **{"communication.gradients_reduce_method": "sum"})
    bx, by = models.input_batch(x, y, BATCH)
    _, loss = models.forward(bx, by)
    op = models.train_op(loss, "sgd")
    with tf.Session() as sess:
        sess.run(tf.global_variables_initializer())
        for _ in range(STEPS):
            sess.run(op)
        models.assert_weights_close(models.weights(sess), want)


def test_fetch_returns_replica_zero_and_merged_collections():
    n = 2
    models.init_data_parallel(n)
    x = tf.placeholder(tf.float32, [None, 3])
    w = tf.get_variable("w", initializer=tf.ones([3, 1]))
    y = tf.matmul(x, w)
    total = tf.reduce_sum(y)
    mean_t = tf.identity(total)
    sum_t = tf.identity(total)
    epl.add_to_collection(mean_t, epl.GraphKeys.GLOBAL_MEAN_OBJECTS)
    epl.add_to_collection(sum_t, epl.GraphKeys.LOCAL_SUM_OBJECTS)
    epl.add_to_collection(y, epl.GraphKeys.GLOBAL_CONCAT_OBJECTS)
    feed = np.arange(12, dtype=np.float32).reshape(4, 3)
    with tf.Session() as sess:
        sess.run(tf.global_variables_initializer())
        t, m, s, cat = sess.run([total, mean_t, sum_t, y], {x: feed})
    rows = feed.sum(axis=1)
    assert t == pytest.approx(rows[:2].sum())          # replica 0's shard
    assert m == pytest.approx(rows.sum() / 2)           # mean over replicas
    assert s == pytest.approx(rows.sum())               # sum over replicas
    np.testing.assert_allclose(cat[:, 0], rows)         # concat of both shards


def test_fed_batch_not_divisible_names_placeholder():
    models.init_data_parallel(2)
    x = tf.placeholder(tf.float32, [None, 3], name="features")
    w = tf.get_variable("w", initializer=tf.ones([3, 1]))
    loss = tf.reduce_sum(tf.matmul(x, w))
    op = tf.train.GradientDescentOptimizer(0.1).minimize(loss)
    with tf.Session() as sess:
        sess.run(tf.global_variables_initializer())
        with pytest.raises(tf.errors.InvalidArgumentError, match="features"):
            sess.run(op, {x: np.ones([3, 3], np.float32)})


def test_global_step_advances_once_without_explicit_global_step():
    models.init_data_parallel(4)
    x, y = models.data(64)
    bx, by = models.input_batch(x, y, 4)
    _, loss = models.forward(bx, by)
    step = tf.train.get_or_create_global_step()
    op = tf.train.MomentumOptimizer(0.1, 0.9).minimize(loss, global_step=step)
    with tf.train.MonitoredTrainingSession() as sess:
        for i in range(3):
            sess.run(op)
        assert sess.run(step) == 3


def test_loss_outside_the_scope_is_replicated():
    """Only the model is annotated; the loss built after the scope joins its TaskGraph."""
    n = 2
    x, y = models.data(STEPS * n * BATCH)
    want, _ = models.train_local(x, y, n * BATCH, STEPS, "momentum")
    epl.init(epl.Config({"cluster.devices_per_worker": n}))
    bx, by = models.input_batch(x, y, BATCH)
    w = models.initial_weights()
    with epl.replicate(1):
        h = tf.layers.dense(bx, models.HIDDEN, activation=tf.nn.tanh,
                            kernel_initializer=tf.constant_initializer(w["dense/kernel"]),
                            bias_initializer=tf.constant_initializer(w["dense/bias"]))
        logits = tf.layers.dense(h, models.CLASSES,
                                 kernel_initializer=tf.constant_initializer(w["dense_1/kernel"]),
                                 bias_initializer=tf.constant_initializer(w["dense_1/bias"]))
    loss = tf.losses.sparse_softmax_cross_entropy(labels=by, logits=logits)
    op = models.train_op(loss, "momentum", tf.train.get_or_create_global_step())
    with tf.Session() as sess:
        sess.run(tf.global_variables_initializer())
        for _ in range(STEPS):
            sess.run(op)
        models.assert_weights_close(models.weights(sess), want)


@pytest.mark.parametrize("copies", ["per_device", "per_worker"])
def test_dp_with_keras_optimizer(copies):
    """tf.keras optimizers (OptimizerV2) are captured like tf.train ones."""
    n = 2
    x, y = models.data(STEPS * n * BATCH)

    def build(batch):
        bx, by = models.input_batch(x, y, batch)
        _, loss = models.forward(bx, by, use_resource=True)
        opt = tf.keras.optimizers.SGD(0.1, momentum=0.9)
        variables = tf.trainable_variables()
        grads = tf.gradients(loss, variables)
        with tf.control_dependencies(grads):
            return opt.apply_gradients(zip(grads, variables))

    with tf.Graph().as_default():
        op = build(n * BATCH)
        with tf.Session() as sess:
            sess.run(tf.global_variables_initializer())
            for _ in range(STEPS):
                sess.run(op)
            want = models.weights(sess)
    models.init_data_parallel(n, **{"cluster.variable_copies": copies})
    op = build(BATCH)
    with tf.Session() as sess:
        sess.run(tf.global_variables_initializer())
        for _ in range(STEPS):
            sess.run(op)
        models.assert_weights_close(models.weights(sess), want)


@pytest.mark.parametrize("graph_seed", [None, 3])
def test_dropout_with_seed_zero_draws_a_mask_per_replica(graph_seed):
    """tf.nn.dropout(..., seed=0) has a fixed stream (seed 87654321 or the graph's, seed2
    0): each replica's copy must draw its own mask, as each tower of a hand-written
    program would; replica 0 draws the program's own."""
    def masks(layout):
        models.reset()
        if layout:
            models.init_data_parallel(2)
        if graph_seed is not None:
            tf.set_random_seed(graph_seed)
        out = tf.nn.dropout(tf.ones([4, 64]), rate=0.5, seed=0)
        fetch = [out]
        if layout:
            with tf.Session() as sess:
                sess.run(tf.reduce_sum(out))      # (the rewrite)
            fetch.append(tf.get_default_graph().get_tensor_by_name("EPL_REPLICA_1/" + out.name))
        with tf.Session() as sess:            # (both streams' first draw)
            return sess.run(fetch)
    want, = masks(None)
    got0, got1 = masks("dp2")
    np.testing.assert_array_equal(got0, want)
    assert set(np.unique(got1)) <= {0.0, 2.0} and 0 < np.mean(got1 == 0) < 1
    assert not np.array_equal(got0, got1)
