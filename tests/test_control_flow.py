"""TF1 control flow in every strategy (issue 11).

Each program of ``tests/corpus/control_flow.py`` (dynamic_rnn, a bidirectional RNN,
tf.scan / tf.map_fn, tf.cond with dropout and batch norm, a nested tf.while_loop,
an ExponentialMovingAverage) trains under EPL and without it; the oracle is the
program without EPL on one device with the global batch, compared at 1e-5.
"""
import os

import numpy as np
import pytest
import tensorflow.compat.v1 as tf

import epl
from tests import models
from tests.corpus import control_flow as cf

STEPS, B = 3, 4

LAYOUTS = {
    # name: (devices, global batch factor, config, annotate)
    "dp2": (2, 2, {}, "default"),
    "dp4": (4, 4, {}, "default"),
    "ga2": (1, 2, {"pipeline.num_micro_batch": 2}, "default"),
    "pipeline2": (2, 2, {"pipeline.num_micro_batch": 2}, "stages"),
    "split_head": (2, 2, {"cluster.colocate_split_and_replicate": True}, "split"),
}


def _batches(rows, total=None):
    x, y = cf.data(total or STEPS * rows)
    ds = tf.data.Dataset.from_tensor_slices((x, y)).batch(rows, drop_remainder=True)
    return tf.data.make_one_shot_iterator(ds).get_next()


def _run(name, layout, tmpdir):
    """Train ``name`` for STEPS steps; its variables (from a checkpoint)."""
    models.reset()
    stage = split = None
    if layout is None:
        rows = B
    else:
        devices, _, cfg, annotate = LAYOUTS[layout]
        conf = {"cluster.devices_per_worker": devices}
        conf.update(cfg)
        epl.init(epl.Config(conf))
        rows = B
        if annotate == "stages":
            scopes = [epl.replicate(1, name="stage_0"), epl.replicate(1, name="stage_1")]
            stage = scopes.__getitem__
        else:
            epl.set_default_strategy(epl.replicate(1))
        split = 2 if annotate == "split" else None
    factor = LAYOUTS[_run.layout][1]
    x, y = _batches(rows * (factor if layout is None else 1), STEPS * B * factor)
    loss = cf.model(name, x, y, stage, split)
    op = cf.train_op(name, loss)
    with tf.Session() as sess:
        sess.run(tf.global_variables_initializer())
        for _ in range(STEPS):
            sess.run(op)
        path = tf.train.Saver().save(sess, os.path.join(str(tmpdir), layout or "local"))
    reader = tf.train.load_checkpoint(path)
    return {k: reader.get_tensor(k) for k in reader.get_variable_to_shape_map()}


@pytest.mark.parametrize("layout", sorted(LAYOUTS))
@pytest.mark.parametrize("name", cf.MODELS)
def test_control_flow_program(name, layout, tmpdir):
    _run.layout = layout
    want = _run(name, None, tmpdir)
    got = _run(name, layout, tmpdir)
    keys = sorted(k for k in want if "Momentum" not in k)   # split: slots are per shard
    assert any("ExponentialMovingAverage" in k for k in keys) == (name == "ema")
    for k in keys:
        np.testing.assert_allclose(got[k], want[k], rtol=1e-5, atol=1e-6, err_msg=k)
    moved = [k for k in keys if k.startswith("proj/kernel")]
    assert moved and not np.allclose(got[moved[0]], cf_initial(name)[moved[0]], atol=1e-4)


def cf_initial(name):
    """The program's variables before training (to check that training moved them)."""
    models.reset()
    x, y = _batches(B)
    cf.model(name, x, y)
    with tf.Session() as sess:
        sess.run(tf.global_variables_initializer())
        return {v.op.name: sess.run(v) for v in tf.global_variables()}


def test_fed_flag_reaches_every_replica(tmpdir):
    """A flag fed by the user (``is_training``, a placeholder with a default) is read by
    every replica: feeding False trains every replica with the false branch."""
    def run(layout):
        models.reset()
        if layout:
            models.init_data_parallel(2)
        x, y = _batches(B * (1 if layout else 2), STEPS * 2 * B)
        loss = cf.model("cond", x, y)
        op = cf.train_op("cond", loss)
        flag = tf.get_default_graph().get_tensor_by_name("is_training:0")
        with tf.Session() as sess:
            sess.run(tf.global_variables_initializer())
            for _ in range(STEPS):
                sess.run(op, {flag: False})
            return {v.op.name: sess.run(v) for v in tf.trainable_variables()}
    want, got = run(None), run("dp2")
    for k in want:
        np.testing.assert_allclose(got[k], want[k], rtol=1e-5, atol=1e-6, err_msg=k)


def _loop_across_stages(boundary_inside, pipeline=True):
    """A tf.while_loop built outside the stages' scopes whose body runs its first half
    on stage 0 and its second on stage 1 (``boundary_inside``), or a loop built inside
    stage 0 followed by a stage 1 head.  ``pipeline``: 2 stages x 2 micro-batches of B
    rows under EPL, else the same program without EPL on the global batch (2 B rows).
    Returns the train op (updates after every gradient: deterministic)."""
    models.reset()
    if pipeline:
        epl.init(epl.Config({"cluster.devices_per_worker": 2, "pipeline.num_micro_batch": 2}))
        stages = [epl.replicate(1, name="stage_0"), epl.replicate(1, name="stage_1")]
        stage = stages.__getitem__
    else:
        stage = cf._no_scope  # pylint: disable=protected-access
    x, y = _batches(B if pipeline else 2 * B, STEPS * 2 * B)
    with stage(0):
        h = tf.reshape(x, [-1, cf.T, cf.F])[:, 0, :]
        w = tf.get_variable(
            "w", [cf.F, cf.F], initializer=tf.glorot_uniform_initializer(seed=3))

    def body(t, s):
        if boundary_inside:
            with stage(0):
                a = tf.matmul(s, w)
            with stage(1):
                return t + 1, tf.tanh(a)
        return t + 1, tf.tanh(tf.matmul(s, w))
    if boundary_inside:
        _, s = tf.while_loop(lambda t, s: t < 3, body, [0, h], name="mixed_loop")
    else:
        with stage(0):
            _, s = tf.while_loop(lambda t, s: t < 3, body, [0, h], name="mixed_loop")
    with stage(1):
        logits = tf.layers.dense(
            s, cf.CLASSES, kernel_initializer=tf.glorot_uniform_initializer(seed=4))
        loss = tf.reduce_mean(tf.nn.sparse_softmax_cross_entropy_with_logits(
            labels=y, logits=logits))
    opt = tf.train.GradientDescentOptimizer(0.1)
    grads = opt.compute_gradients(loss)
    with tf.control_dependencies([g for g, _ in grads]):
        return opt.apply_gradients(grads)


def _train_loop_program(op):
    """(variables before, variables after STEPS steps of ``op``)."""
    with tf.Session() as sess:
        sess.run(tf.global_variables_initializer())
        read = lambda: {v.op.name: sess.run(v) for v in tf.trainable_variables()}
        before = read()
        for _ in range(STEPS):
            sess.run(op)
        return before, read()


def test_stage_boundary_inside_a_loop_is_refused():
    """The program is valid TensorFlow (without EPL it trains), but a loop cannot cross a
    stage boundary: EPL refuses it with the loop's and the stages' names, and keeps
    refusing it (the half-rewritten graph never runs)."""
    before, after = _train_loop_program(_loop_across_stages(True, pipeline=False))
    assert not np.allclose(before["w"], after["w"], atol=1e-4)
    op = _loop_across_stages(boundary_inside=True)
    refusal = r"tf.while_loop 'mixed_loop' spans pipeline stages .*stage_0.*stage_1"
    with tf.Session() as sess:
        with pytest.raises(ValueError, match=refusal):
            sess.run(tf.global_variables_initializer())
        with pytest.raises(ValueError, match=refusal):
            sess.run(op)


def test_loop_inside_one_stage_trains_like_the_program_without_epl():
    """A loop inside stage 0 of a 2-stage pipeline with 2 micro-batches equals the same
    program without EPL on one device with the global batch."""
    before, want = _train_loop_program(_loop_across_stages(False, pipeline=False))
    _, got = _train_loop_program(_loop_across_stages(False))
    assert sorted(got) == sorted(want) == ["dense/bias", "dense/kernel", "w"]
    for k in want:
        np.testing.assert_allclose(got[k], want[k], rtol=1e-5, atol=1e-6, err_msg=k)
    assert not np.allclose(want["w"], before["w"], atol=1e-4)


def test_rewritten_graph_exports_and_reimports(tmpdir):
    """export_meta_graph of a rewritten graph with loops (every clone's contexts in the
    collections) re-imports, and the imported graph trains like the original."""
    models.reset()
    models.init_data_parallel(2)
    px = tf.placeholder(tf.float32, [None, cf.T, cf.F], name="px")
    py = tf.placeholder(tf.int64, [None], name="py")
    loss = cf.model("lstm", px, py)
    op = cf.train_op("lstm", loss)
    x, y = cf.data(2 * B)
    with tf.Session() as sess:
        sess.run(tf.global_variables_initializer())
        sess.run(op, {px: x, py: y})      # rewrites
        g = tf.get_default_graph()
        contexts = g.get_collection(tf.GraphKeys.WHILE_CONTEXT)
        assert sorted(c.name for c in contexts) == [
            "EPL_REPLICA_1/rnn/while/while_context", "rnn/while/while_context"]
        frames = set(o.get_attr("frame_name") for o in g.get_operations() if o.type == "Enter")
        assert b"EPL_REPLICA_1/rnn/while/while_context" in frames
        path = os.path.join(str(tmpdir), "model")
        tf.train.Saver().save(sess, path)
        meta = tf.train.export_meta_graph(os.path.join(str(tmpdir), "rewritten.meta"))
        want_loss = sess.run(loss, {px: x, py: y})
        sess.run(op, {px: x, py: y})
        want_after = sess.run(loss, {px: x, py: y})
    models.reset()    # a plain graph, EPL not initialized: the imported graph runs as is
    with tf.Graph().as_default() as g2:
        saver = tf.train.import_meta_graph(meta)
        contexts = g2.get_collection(tf.GraphKeys.WHILE_CONTEXT)
        assert len(contexts) == 2
        cfg = tf.ConfigProto(device_count={"CPU": 2})
        with tf.Session(config=cfg) as sess:
            saver.restore(sess, path)
            feed = {"px:0": x, "py:0": y}
            np.testing.assert_allclose(sess.run(loss.name, feed), want_loss, rtol=1e-6)
            sess.run(op.name, feed)
            np.testing.assert_allclose(sess.run(loss.name, feed), want_after, rtol=1e-5)
