"""Gradient accumulation and pipeline stages equal the local model on the global batch."""
import numpy as np
import pytest
import tensorflow.compat.v1 as tf

import epl
from tests import models

STEPS, MB = 4, 2   # steps, rows per micro-batch


def _staged_forward(x, labels, stages):
    """models.forward split into `stages` replicate scopes (1, 2 or 3)."""
    w = models.initial_weights()
    with epl.replicate(1, name="stage_0"):
        h = tf.layers.dense(x, models.HIDDEN, activation=tf.nn.tanh,
                            kernel_initializer=tf.constant_initializer(w["dense/kernel"]),
                            bias_initializer=tf.constant_initializer(w["dense/bias"]))
    if stages == 3:
        with epl.replicate(1, name="stage_1"):
            h = tf.identity(h * 1.0)
    with epl.replicate(1, name="stage_%d" % (stages - 1)):
        logits = tf.layers.dense(h, models.CLASSES,
                                 kernel_initializer=tf.constant_initializer(w["dense_1/kernel"]),
                                 bias_initializer=tf.constant_initializer(w["dense_1/bias"]))
        loss = tf.losses.sparse_softmax_cross_entropy(labels=labels, logits=logits)
    return loss


def run(devices, stages, micro, optimizer="momentum", copies="per_worker", strategy=None):
    replicas = devices // stages
    rows = STEPS * replicas * micro * MB
    x, y = models.data(rows)
    want, _ = models.train_local(x, y, replicas * micro * MB, STEPS, optimizer)
    epl.init(epl.Config({"cluster.devices_per_worker": devices,
                         "pipeline.num_micro_batch": micro,
                         "cluster.variable_copies": copies,
                         "pipeline.strategy": strategy or "PreferBackward"}))
    bx, by = models.input_batch(x, y, MB)
    if stages == 1:
        epl.set_default_strategy(epl.replicate(1))
        _, loss = models.forward(bx, by)
    else:
        loss = _staged_forward(bx, by, stages)
    step = tf.train.get_or_create_global_step()
    op = models.train_op(loss, optimizer, step)
    with tf.Session() as sess:
        sess.run(tf.global_variables_initializer())
        for _ in range(STEPS):
            sess.run(op)
        got = models.weights(sess)
        assert sess.run(step) == STEPS
    models.assert_weights_close(got, want)
    return tf.get_default_graph()


@pytest.mark.parametrize("copies", ["per_device", "per_worker"])
@pytest.mark.parametrize("devices, micro", [(1, 2), (1, 4), (2, 2), (2, 4)])
def test_gradient_accumulation_equals_big_batch(devices, micro, copies):
    run(devices, 1, micro, copies=copies)


@pytest.mark.parametrize("strategy", ["PreferForward", "PreferBackward"])
@pytest.mark.parametrize("micro", [1, 2, 4])
@pytest.mark.parametrize("devices, stages", [(2, 2), (4, 2), (3, 3)])
def test_pipeline_equals_local(devices, stages, micro, strategy):
    g = run(devices, stages, micro, strategy=strategy)
    ir = epl.Graph.get(g)
    sel = ir.rewrite_result.state.selection
    per_stage = [set(op.device for op in tg.ops if op in sel) for tg in ir.taskgraphs]
    assert all(len(d) == 1 for d in per_stage), per_stage
    assert len(set.union(*per_stage)) == stages   # each stage on its own device


def test_pipeline_adam_per_device_copies():
    run(4, 2, 2, optimizer="adam", copies="per_device")


def _build_epl(devices, stages, micro):
    epl.init(epl.Config({"cluster.devices_per_worker": devices,
                         "pipeline.num_micro_batch": micro}))
    x, y = models.data(8)
    bx, by = models.input_batch(x, y, MB)
    loss = _staged_forward(bx, by, stages)
    return models.train_op(loss, "sgd")


@pytest.mark.parametrize("devices, stages, micro, match", [
    (2, 2, 0, "'pipeline.num_micro_batch' = 0 is invalid"),
    (2, 3, 1, "3 pipeline stages need at least 3 devices but the cluster has 2"),
    (3, 2, 1, r"3 devices cannot hold whole pipelines of 2 stages \(3 % 2 = 1\)"),
])
def test_errors(devices, stages, micro, match):
    op = _build_epl(devices, stages, micro)
    with pytest.raises(ValueError, match=match):
        with tf.Session() as sess:
            sess.run(op)


@pytest.mark.parametrize("strategy", ["PreferForward", "PreferBackward"])
def test_executed_order_follows_schedule(strategy):
    """Read the real execution order of every stage's tasks from TF's step stats."""
    from epl.rewrite import schedule
    stages, micro = 2, 4
    epl.init(epl.Config({"cluster.devices_per_worker": stages, "pipeline.num_micro_batch": micro,
                         "pipeline.strategy": strategy}))
    x, y = models.data(64)
    bx, by = models.input_batch(x, y, MB)
    op = models.train_op(_staged_forward(bx, by, stages), "sgd")
    with tf.Session() as sess:
        sess.run(tf.global_variables_initializer())
        meta = tf.RunMetadata()
        sess.run(op, options=tf.RunOptions(trace_level=tf.RunOptions.FULL_TRACE),
                 run_metadata=meta)
    start = {}
    for dev in meta.step_stats.dev_stats:
        for node in dev.node_stats:
            start[node.node_name] = min(start.get(node.node_name, 1 << 62),
                                        node.all_start_micros)
    state = epl.Graph.get().rewrite_result.state
    path = schedule._training_path(state)
    for s in range(stages):
        order = state.schedule[(0, s)]
        assert order == schedule.schedule_order(strategy, s, stages, micro)
        begun = []
        for kind, m in order:
            ops = schedule.task_ops(state, m, s, "forward" if kind == "F" else "backward", path)
            times = [start[o.name] for o in ops if o.name in start]
            assert times, (kind, m)
            begun.append((min(times), (kind, m)))
        assert [t for _, t in sorted(begun)] == order
        if strategy == "PreferBackward":   # at most p micro-batches in flight on a stage
            live = peak = 0
            for kind, _ in order:
                live += 1 if kind == "F" else -1
                peak = max(peak, live)
            assert peak <= stages - s


def _residual_model(x, labels, staged):
    """The stage-1 input is read twice: its gradient is a sum across the stage boundary."""
    w = models.initial_weights()

    def stage0():
        return tf.layers.dense(x, models.HIDDEN, activation=tf.nn.tanh,
                               kernel_initializer=tf.constant_initializer(w["dense/kernel"]),
                               bias_initializer=tf.constant_initializer(w["dense/bias"]))

    def stage1(h):
        r = tf.layers.dense(h, models.HIDDEN, kernel_initializer=tf.constant_initializer(
            np.eye(models.HIDDEN, dtype=np.float32) * 0.5), name="residual")
        logits = tf.layers.dense(h + r, models.CLASSES,
                                 kernel_initializer=tf.constant_initializer(w["dense_1/kernel"]),
                                 bias_initializer=tf.constant_initializer(w["dense_1/bias"]))
        return tf.losses.sparse_softmax_cross_entropy(labels=labels, logits=logits)
    if not staged:
        return stage1(stage0())
    epl.set_default_strategy(epl.replicate(1))
    h = stage0()
    epl.set_default_strategy(epl.replicate(1))
    return stage1(h)


def test_gradient_sum_across_stage_boundary():
    micro, devices = 2, 4
    x, y = models.data(STEPS * 2 * micro * MB)
    with tf.Graph().as_default():
        bx, by = models.input_batch(x, y, 2 * micro * MB)
        op = models.train_op(_residual_model(bx, by, False), "adam")
        want = models.run_steps(op, STEPS, tf.trainable_variables())
    epl.init(epl.Config({"cluster.devices_per_worker": devices, "pipeline.num_micro_batch": micro}))
    bx, by = models.input_batch(x, y, MB)
    op = models.train_op(_residual_model(bx, by, True), "adam")
    got = models.run_steps(op, STEPS, tf.trainable_variables())
    for a, b in zip(got, want):
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6)


def test_stages_in_a_cycle_are_rejected():
    epl.init(epl.Config({"cluster.devices_per_worker": 2, "pipeline.num_micro_batch": 2}))
    a_scope, b_scope = epl.replicate(1, name="A"), epl.replicate(1, name="B")
    x = tf.ones([2, 3])
    with a_scope:
        a1 = tf.identity(x, name="a1")
    with b_scope:
        b1 = tf.identity(a1, name="b1")
    with a_scope:                     # re-entering A: A now also reads B
        a2 = tf.identity(b1, name="a2")
    with b_scope:
        loss = tf.reduce_sum(tf.identity(a2, name="b2") * tf.get_variable("w", [2, 3]))
    op = tf.train.GradientDescentOptimizer(0.1).minimize(loss)
    with pytest.raises(ValueError, match=r"cannot be ordered as pipeline stages.*cycle: "
                                         r"epl.replicate\(device_count=1, name='[AB]'\) reads"):
        with tf.Session() as sess:
            sess.run(op)


def test_stage_order_follows_data_flow():
    """Scopes created in reverse data order still form a pipeline in data order."""
    epl.init(epl.Config({"cluster.devices_per_worker": 2}))
    second, first = epl.replicate(1, name="second"), epl.replicate(1, name="first")
    with second:
        tf.constant(0.0, name="anchor")   # makes "second" TaskGraph 0
    with first:
        h = tf.identity(tf.ones([2]), name="h")
    with second:
        tf.identity(h * 2.0, name="y")
    assert epl.Graph.get().stage_order() == {0: 1, 1: 0}   # TaskGraph 1 ("first") is stage 0
