"""pipeline.num_micro_batch = m > 1 on a model without annotation: each session run
accumulates one micro-batch's gradients, every m-th run applies them.

Oracle: 4m runs on micro-batches of 8 rows = 4 steps of the local model (no EPL)
on batches of 8m rows, global_step included."""
import numpy as np
import pytest
import tensorflow.compat.v1 as tf

import epl
from epl.ir import internal_state
from tests import models

M, MB, STEPS = 4, 8, 4


def _accumulating(config, optimizer, runs):
    """The unannotated model trained ``runs`` runs of MB rows with ``config``."""
    x, y = models.data(M * MB * STEPS)
    epl.init(epl.Config(dict({"pipeline.num_micro_batch": M}, **config)))
    bx, by = models.input_batch(x, y, MB)
    _, loss = models.forward(bx, by)
    step = tf.train.get_or_create_global_step()
    op = models.train_op(loss, optimizer, step)
    seen = []
    with tf.Session() as sess:
        sess.run(tf.global_variables_initializer())
        start = models.weights(sess)
        for i in range(runs):
            sess.run(op)
            seen.append(sess.run(step))
            if i == M - 2:   # before the first m-th run nothing moved
                for name, value in models.weights(sess).items():
                    np.testing.assert_array_equal(value, start[name], err_msg=name)
        return models.weights(sess), seen


@pytest.mark.parametrize("optimizer", ["momentum", "adam"])
def test_runs_equal_big_batch_steps(optimizer):
    x, y = models.data(M * MB * STEPS)
    want, _ = models.train_local(x, y, M * MB, STEPS, optimizer)
    got, steps = _accumulating({}, optimizer, M * STEPS)
    models.assert_weights_close(got, want)
    assert steps == [(i + 1) // M for i in range(M * STEPS)]


def test_devices_without_annotation_train_on_one():
    """Devices but no set_default_strategy: EPL does not replicate an unannotated
    model; it trains on the first device and accumulates across runs."""
    x, y = models.data(M * MB * STEPS)
    want, _ = models.train_local(x, y, M * MB, STEPS, "momentum")
    got, _ = _accumulating({"cluster.devices_per_worker": 2}, "momentum", M * STEPS)
    models.assert_weights_close(got, want)


def test_sum_of_micro_batches():
    """gradients_reduce_method = sum: plain SGD then moves m times as far."""
    x, y = models.data(M * MB * STEPS)
    with tf.Graph().as_default():
        bx, by = models.input_batch(x, y, M * MB)
        _, loss = models.forward(bx, by)
        op = tf.train.GradientDescentOptimizer(0.1 * M).minimize(loss)
        want = models.run_steps(op, STEPS, {n: models.value_tensor(tf.get_default_graph(), n)
                                            for n in models.initial_weights()})
    got, _ = _accumulating({"communication.gradients_reduce_method": "sum"}, "sgd", M * STEPS)
    models.assert_weights_close(got, want)


def test_graph_does_not_grow_with_m():
    sizes = []
    for m in (2, 64):
        models.reset()
        epl.init(epl.Config({"pipeline.num_micro_batch": m}))
        x, y = models.data(8)
        _, loss = models.forward(tf.constant(x), tf.constant(y))
        tf.train.AdamOptimizer(0.1).minimize(loss)
        sizes.append(len(tf.get_default_graph().get_operations()))
    assert sizes[0] == sizes[1]


def test_monitored_session_stops_at_step(tmp_path):
    """A StopAtStepHook counts applied steps: 4 steps are 4m runs; the checkpoint it
    leaves has no accumulator and restores into the plain program."""
    x, y = models.data(M * MB * STEPS)
    want, _ = models.train_local(x, y, M * MB, STEPS, "momentum")
    epl.init(epl.Config({"pipeline.num_micro_batch": M}))
    bx, by = models.input_batch(x, y, MB)
    _, loss = models.forward(bx, by)
    step = tf.train.get_or_create_global_step()
    op = models.train_op(loss, "momentum", step)
    runs = 0
    with tf.train.MonitoredTrainingSession(
            checkpoint_dir=str(tmp_path), save_summaries_steps=None,
            hooks=[tf.train.StopAtStepHook(last_step=STEPS)]) as sess:
        while not sess.should_stop():
            sess.run(op)
            runs += 1
    assert runs == M * STEPS
    names = [n for n, _ in tf.train.list_variables(str(tmp_path))]
    assert not [n for n in names if "EPL_ACCUMULATE" in n], names
    models.reset()
    with tf.Graph().as_default():
        _, loss = models.forward(tf.constant(x[:8]), tf.constant(y[:8]))
        models.train_op(loss, "momentum", tf.train.get_or_create_global_step())
        with tf.Session() as sess:
            tf.train.Saver().restore(sess, tf.train.latest_checkpoint(str(tmp_path)))
            models.assert_weights_close(models.weights(sess), want)
            assert sess.run(tf.train.get_global_step()) == STEPS


def test_accumulators_are_initialized_but_not_saved():
    epl.init(epl.Config({"pipeline.num_micro_batch": M}))
    x, y = models.data(8)
    _, loss = models.forward(tf.constant(x), tf.constant(y))
    tf.train.MomentumOptimizer(0.1, 0.9).minimize(loss)
    mine = tf.get_collection(internal_state.COLLECTION)
    assert len(mine) == 5      # 4 accumulators and the run counter
    assert all(v in tf.global_variables() for v in mine)
    saver = tf.train.Saver()
    saved = set(saver._var_list)  # pylint: disable=protected-access
    assert not [v for v in mine if v in saved]


def test_optimizer_before_the_annotation_is_refused():
    epl.init(epl.Config({"pipeline.num_micro_batch": M}))
    x, y = models.data(8)
    _, loss = models.forward(tf.constant(x), tf.constant(y))
    op = tf.train.GradientDescentOptimizer(0.1).minimize(loss)
    with epl.replicate(1):
        tf.identity(loss)
    with pytest.raises(RuntimeError, match="before the first EPL annotation"):
        with tf.Session() as sess:
            sess.run(op)
