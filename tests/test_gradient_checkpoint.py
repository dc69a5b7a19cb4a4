"""Gradient checkpointing recomputes activations without changing a number.

Oracle: the same program without ``gradient_checkpoint.type`` (and, on one device,
without EPL): losses and weights over 5 steps to 1e-5, with dropout before and
after a checkpoint (masks must be reused, not redrawn), Momentum and Adam, data
parallel, gradient accumulation, a 2-stage pipeline and an LSTM.
"""
import contextlib

import numpy as np
import pytest
import tensorflow.compat.v1 as tf

import epl
from epl.features import gradient_checkpoint
from tests import models

STEPS, WIDTH, DEPTH = 5, 16, 6


def _weights(depth):
    rng = np.random.RandomState(3)
    shapes = [(models.IN, WIDTH)] + [(WIDTH, WIDTH)] * (depth - 2) + [(WIDTH, models.CLASSES)]
    return [(rng.randn(*s) * (1.0 / np.sqrt(s[0]))).astype(np.float32) for s in shapes]


def deep_forward(x, labels, depth=DEPTH, dropout=True, stages=1):
    """An MLP of ``depth`` dense layers; keras Dropout(0.5) after layers 1 and 3, the
    outputs of layers 2 and 4 in the "checkpoints" collection."""
    ws = _weights(depth)
    scopes = [epl.replicate(1, name="stage_%d" % s) for s in range(stages)] \
        if stages > 1 else [contextlib.nullcontext()]
    h = x
    for i, w in enumerate(ws):
        with scopes[0 if i < depth // 2 else -1]:
            last = i == depth - 1
            h = tf.layers.dense(h, w.shape[1], activation=None if last else tf.nn.tanh,
                                kernel_initializer=tf.constant_initializer(w),
                                name="layer_%d" % i)
            if dropout and i in (1, 3):
                h = tf.keras.layers.Dropout(0.5, seed=10 + i)(h, training=True)
            if i in (2, 4):
                tf.add_to_collection(gradient_checkpoint.COLLECTION, h)
            if last:
                loss = tf.losses.sparse_softmax_cross_entropy(labels=labels, logits=h)
    return loss


def _train(loss, optimizer, steps, feeds=None):
    """Train ``steps`` steps (feeding ``feeds(i)`` at step i); (losses, weights)."""
    step = tf.train.get_or_create_global_step()
    op = models.train_op(loss, optimizer, step)
    with tf.Session() as sess:
        sess.run(tf.global_variables_initializer())
        losses = [sess.run([loss, op], feed_dict=feeds(i) if feeds else None)[0]
                  for i in range(steps)]
        names = sorted(v.op.name for v in tf.trainable_variables())
        weights = dict(zip(names, sess.run([models.value_tensor(sess.graph, n)
                                            for n in names])))
    return losses, weights


def program(config, batch, optimizer="momentum", stages=1, default=True, **kw):
    """Train ``deep_forward`` for STEPS steps of ``batch`` rows; ``config`` None:
    without EPL.  The batch is fed: EPL slices a fed global batch in a fixed order,
    so each replica's dropout stream meets the same rows in both programs (replicas
    pulling from one iterator take their batches in whatever order they run)."""
    models.reset()
    if config is not None:
        epl.init(epl.Config(config))
        if default and stages == 1:
            epl.set_default_strategy(epl.replicate(1))
    x, y = models.data(STEPS * batch)
    px = tf.placeholder(tf.float32, [None, models.IN])
    py = tf.placeholder(tf.int64, [None])
    loss = deep_forward(px, py, stages=stages, **kw)
    rows = lambda i: slice(i * batch, (i + 1) * batch)  # noqa: E731
    out = _train(loss, optimizer, STEPS, lambda i: {px: x[rows(i)], py: y[rows(i)]})
    return out + (tf.get_default_graph(),)


def assert_same(got, want):
    np.testing.assert_allclose(got[0], want[0], rtol=1e-5, atol=1e-6)
    assert sorted(got[1]) == sorted(want[1])
    for name in want[1]:
        np.testing.assert_allclose(got[1][name], want[1][name], rtol=1e-5, atol=1e-6,
                                   err_msg=name)


def recomputed(graph):
    """The recomputed forward ops of the user's graph (not the replicas' copies)."""
    ir = epl.Graph.get(graph)
    return [op for op in graph.get_operations()
            if op.name.endswith("_recompute") and ir.phase_of(op) == "backward"]


@pytest.mark.parametrize("optimizer", ["momentum", "adam"])
@pytest.mark.parametrize("kind", ["collection", "auto"])
def test_one_device_equals_plain_program(kind, optimizer):
    want = program(None, 16, optimizer)
    got = program({"gradient_checkpoint.type": kind}, 16, optimizer, default=False)
    assert_same(got, want)
    copies = recomputed(got[2])
    assert copies, "nothing was recomputed"
    # Dropout masks are reused: no random op runs twice.
    assert not [op for op in copies if "Random" in op.type]
    # The backward pass reads the copies.
    readers = [c for op in copies for t in op.outputs for c in t.consumers()]
    assert any(not c.name.endswith("_recompute") for c in readers)


@pytest.mark.parametrize("kind, config", [
    ("auto", {"cluster.devices_per_worker": 2}),
    ("collection", {"cluster.devices_per_worker": 2}),
    ("collection", {"pipeline.num_micro_batch": 4}),
    ("auto", {"cluster.devices_per_worker": 2, "pipeline.num_micro_batch": 2}),
])
def test_data_parallel_and_accumulation(kind, config):
    want = program(dict(config), 32)
    got = program(dict(config, **{"gradient_checkpoint.type": kind}), 32)
    assert_same(got, want)
    assert recomputed(got[2])


@pytest.mark.parametrize("strategy", ["PreferForward", "PreferBackward"])
@pytest.mark.parametrize("kind", ["collection", "auto"])
def test_two_stage_pipeline(kind, strategy):
    config = {"cluster.devices_per_worker": 2, "pipeline.num_micro_batch": 2,
              "pipeline.strategy": strategy}
    want = program(dict(config), 16, "adam", stages=2)
    got = program(dict(config, **{"gradient_checkpoint.type": kind}), 16, "adam", stages=2)
    assert_same(got, want)
    ir = epl.Graph.get(got[2])
    stages = set(ir.taskgraph_of(op).index for op in recomputed(got[2]))
    assert stages == {0, 1}, stages


def test_end_taskgraph_limits_the_stages():
    config = {"cluster.devices_per_worker": 2, "pipeline.num_micro_batch": 2,
              "gradient_checkpoint.type": "collection", "gradient_checkpoint.end_taskgraph": 0}
    want = program({"cluster.devices_per_worker": 2, "pipeline.num_micro_batch": 2}, 16,
                   stages=2)
    got = program(config, 16, stages=2)
    assert_same(got, want)
    ir = epl.Graph.get(got[2])
    assert set(ir.taskgraph_of(op).index for op in recomputed(got[2])) == {0}


def test_auto_picks_about_sqrt_n_checkpoints():
    models.reset()
    epl.init(epl.Config({"gradient_checkpoint.type": "auto"}))
    x, y = models.data(8)
    loss = deep_forward(tf.constant(x), tf.constant(y), depth=16, dropout=False)
    tf.train.GradientDescentOptimizer(0.1).minimize(loss)
    ops = [op for op in tf.get_default_graph().get_operations()
           if epl.Graph.get().phase_of(op) == "forward"]
    # The checkpoints among the layers' outputs: a choice of about sqrt(16).
    copies = recomputed(tf.get_default_graph())
    tanh = [op for op in copies if op.type == "Tanh"]
    assert 6 <= len(tanh) <= 14, [op.name for op in tanh]
    assert ops


def test_recomputation_waits_for_the_backward_pass():
    """Each recomputed segment starts after gradients reach it (else it would run
    during the forward pass and save nothing)."""
    models.reset()
    epl.init(epl.Config({"gradient_checkpoint.type": "collection"}))
    x, y = models.data(8)
    loss = deep_forward(tf.constant(x), tf.constant(y), dropout=False)
    tf.train.GradientDescentOptimizer(0.1).minimize(loss)
    copies = recomputed(tf.get_default_graph())
    made = set(copies)
    heads = [op for op in copies if not any(t.op in made for t in op.inputs)]
    assert heads
    ir = epl.Graph.get()
    for h in heads:
        assert h.control_inputs, h.name
        assert all(ir.phase_of(c) == "backward" and c not in made for c in h.control_inputs)


def _lstm_program(config):
    models.reset()
    if config is not None:
        epl.init(epl.Config(config))
        epl.set_default_strategy(epl.replicate(1))
    rng = np.random.RandomState(0)
    x = tf.constant(rng.randn(4, 5, 3).astype(np.float32))
    y = tf.constant(rng.randint(0, 2, 4).astype(np.int64))
    init = tf.constant_initializer(0.3)
    h = tf.layers.dense(x, 8, activation=tf.nn.tanh, kernel_initializer=init)
    h = tf.layers.dense(h, 8, activation=tf.nn.tanh, kernel_initializer=init)
    cell = tf.nn.rnn_cell.LSTMCell(8, initializer=init)
    out, _ = tf.nn.dynamic_rnn(cell, h, dtype=tf.float32)
    z = tf.layers.dense(out[:, -1], 8, activation=tf.nn.tanh, kernel_initializer=init)
    z = tf.layers.dense(z, 8, activation=tf.nn.tanh, kernel_initializer=init)
    logits = tf.layers.dense(z, 2, kernel_initializer=init)
    loss = tf.losses.sparse_softmax_cross_entropy(labels=y, logits=logits)
    out = _train(loss, "adam", STEPS)
    return out + (tf.get_default_graph(),)


@pytest.mark.parametrize("kind", ["auto"])
def test_lstm(kind):
    want = _lstm_program(None)
    got = _lstm_program({"gradient_checkpoint.type": kind})
    assert_same(got, want)
    copies = recomputed(got[2])
    assert copies
    assert all(op._control_flow_context is None for op in copies)  # pylint: disable=protected-access


@pytest.mark.parametrize("config", [{}, {"cluster.devices_per_worker": 2}])
def test_check_gradients_logs_the_difference_once(config, caplog):
    """Fed inputs, no random op: check_gradients computes the plain gradients in a run
    of its own before the first training run of each session (not before the
    initializer) and logs their largest difference; training is unchanged."""
    import logging
    want = program(dict(config), 32, dropout=False)
    caplog.set_level(logging.INFO, logger="epl")
    got = program(dict(config, **{"gradient_checkpoint.type": "auto",
                                  "gradient_checkpoint.check_gradients": True}), 32,
                  dropout=False)
    assert_same(got, want)
    lines = [r.getMessage() for r in caplog.records if "check: recomputed vs plain" in r.message]
    assert len(lines) == 1, lines
    diff = float(lines[0].split("max difference ")[1].split(" ")[0])
    assert diff <= 1e-6, lines


@pytest.mark.parametrize("resource", [True, False])
def test_check_gradients_with_an_input_pipeline(resource, caplog):
    """Input from an iterator: the check is fetched with the first step (a run of its
    own would take a batch) when the weights are resource variables, skipped with a
    warning for ref variables (their in-place updates would race the plain
    gradients); the numbers equal the local model's either way."""
    import logging
    x, y = models.data(48)
    want, _ = models.train_local(x, y, 16, 3, "momentum", use_resource=resource)
    caplog.set_level(logging.INFO, logger="epl")
    epl.init(epl.Config({"gradient_checkpoint.type": "auto",
                         "gradient_checkpoint.check_gradients": True}))
    bx, by = models.input_batch(x, y, 16)
    h = bx
    with tf.variable_scope("", use_resource=resource):
        for i in range(3):   # a few layers before the model's, so there is a checkpoint
            h = tf.identity(tf.nn.relu(h) - tf.nn.relu(-h), name="pre_%d" % i)
        _, loss = models.forward(h, by, use_resource=resource)
    op = models.train_op(loss, "momentum", tf.train.get_or_create_global_step())
    got = models.run_steps(op, 3, {n: models.value_tensor(tf.get_default_graph(), n)
                                   for n in models.initial_weights()})
    models.assert_weights_close(got, want)
    checked = [r for r in caplog.records if "check: recomputed vs plain" in r.message]
    skipped = [r for r in caplog.records if "check skipped" in r.message]
    assert (len(checked), len(skipped)) == ((1, 0) if resource else (0, 1))


@pytest.mark.parametrize("fed", [True, False])
def test_check_gradients_with_session_hooks(fed, caplog):
    """MonitoredTrainingSession fetches a dict keyed by its hooks (StopAtStepHook...):
    the check finds the gradients among any fetch structure and still logs its
    difference once; training equals the local model's (issue 24, item 2)."""
    import logging
    steps = 3
    x, y = models.data(16 * steps)
    want, _ = models.train_local(x, y, 16, steps, "momentum", use_resource=True)
    caplog.set_level(logging.INFO, logger="epl")
    epl.init(epl.Config({"gradient_checkpoint.type": "auto",
                         "gradient_checkpoint.check_gradients": True}))
    if fed:   # the check runs on its own before the first step ("before")
        bx = tf.placeholder(tf.float32, [None, models.IN])
        by = tf.placeholder(tf.int64, [None])
    else:     # the check is fetched with the first step ("with")
        bx, by = models.input_batch(x, y, 16)
    h = bx
    for i in range(3):   # a few layers before the model's, so there is a checkpoint
        h = tf.identity(tf.nn.relu(h) - tf.nn.relu(-h), name="pre_%d" % i)
    _, loss = models.forward(h, by, use_resource=True)
    step = tf.train.get_or_create_global_step()
    op = models.train_op(loss, "momentum", step)
    graph = tf.get_default_graph()
    weights = {n: models.value_tensor(graph, n) for n in models.initial_weights()}
    final = tf.train.FinalOpsHook(weights)
    hooks = [tf.train.StopAtStepHook(last_step=steps), final]
    with tf.train.MonitoredTrainingSession(hooks=hooks, checkpoint_dir=None,
                                                     log_step_count_steps=None) as sess:
        i = 0
        while not sess.should_stop():
            rows = slice(16 * i, 16 * (i + 1))
            sess.run(op, feed_dict={bx: x[rows], by: y[rows]} if fed else None)
            i += 1
    assert i == steps
    models.assert_weights_close(final.final_ops_values, want)
    lines = [r.getMessage() for r in caplog.records if "check: recomputed vs plain" in r.message]
    assert len(lines) == 1, lines
    diff = float(lines[0].split("max difference ")[1].split(" ")[0])
    assert diff <= 1e-6, lines
