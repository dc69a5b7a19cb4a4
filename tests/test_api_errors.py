"""Annotation rules and early, clear errors."""
import subprocess
import sys

import pytest
import tensorflow.compat.v1 as tf

import epl
from epl.core.layout import LayoutError


def test_nested_scopes_rejected():
    epl.init()
    with epl.replicate(1):
        with pytest.raises(RuntimeError, match="Nested strategy annotations are not allowed"):
            with epl.split(2):
                pass


def test_default_strategy_inside_scope_rejected():
    epl.init()
    with epl.replicate(1):
        with pytest.raises(RuntimeError, match="outside any"):
            epl.set_default_strategy(epl.replicate(1))


def test_scope_overrides_default_and_each_annotation_is_a_taskgraph():
    epl.init()
    epl.set_default_strategy(epl.replicate(1))
    a = tf.constant(1.0, name="a")
    with epl.replicate(1, name="second"):
        b = tf.identity(a, name="b")
    c = tf.identity(b, name="c")
    g = epl.Graph.get()
    assert len(g.taskgraphs) == 2
    assert g.taskgraph_of(a.op) is g.taskgraph_of(c.op) is g.taskgraphs[0]
    assert g.taskgraph_of(b.op) is g.taskgraphs[1]


def test_backward_and_apply_follow_forward_taskgraph():
    epl.init()
    with epl.replicate(1):
        w = tf.get_variable("w", initializer=tf.ones([2]))
        loss = tf.reduce_sum(w * w)
    opt = tf.train.GradientDescentOptimizer(0.1)
    grads = opt.compute_gradients(loss)
    train = opt.apply_gradients(grads)
    g = epl.Graph.get()
    tg = g.taskgraphs[0]
    assert g.taskgraph_of(grads[0][0].op) is tg and g.phase_of(grads[0][0].op) == "backward"
    assert g.taskgraph_of(train) is tg and g.phase_of(train) == "apply"


def test_bad_device_count():
    epl.init()
    with pytest.raises(ValueError, match="device_count must be a positive integer"):
        epl.replicate(0)


def test_use_before_init():
    from epl.core.process_state import Env
    saved, Env._instance = Env._instance, None
    try:
        with pytest.raises(RuntimeError, match="before epl.init"):
            with epl.replicate(1):
                pass
    finally:
        Env._instance = saved


def test_impossible_layout_raises_at_rewrite():
    epl.init(epl.Config({"cluster.devices_per_worker": 3}))
    with epl.replicate(2):
        w = tf.get_variable("w", initializer=tf.ones([2]))
        loss = tf.reduce_sum(w)
    with pytest.raises(LayoutError, match=r"3 devices cannot be divided"):
        with tf.Session() as sess:
            sess.run(loss)


def test_unimplemented_feature_is_loud():
    with pytest.raises(NotImplementedError, match="'auto.auto_parallel' = True"):
        epl.init(epl.Config({"auto.auto_parallel": True}))
    epl.init(epl.Config({"auto.auto_parallel": False}))   # (the default)


@pytest.mark.parametrize("value", [0, -2])
def test_apply_groups_must_be_positive(value):
    with pytest.raises(ValueError, match="'optimizer.num_apply_group' = %d" % value):
        epl.init(epl.Config({"optimizer.num_apply_group": value}))


def test_micro_batches_without_annotation_need_an_optimizer():
    """num_micro_batch > 1 without annotation accumulates what an optimizer applies; a
    gradient step written by hand would update every run: refused, naming the op."""
    epl.init(epl.Config({"pipeline.num_micro_batch": 4}))
    w = tf.get_variable("w", [3, 1])
    loss = tf.reduce_sum(tf.matmul(tf.ones([8, 3]), w))
    step = tf.assign_sub(w, 0.1 * tf.gradients(loss, [w])[0], name="by_hand")
    with tf.Session() as sess:
        with pytest.raises(NotImplementedError, match=r"'pipeline.num_micro_batch' = 4 .*"
                                                      r"'by_hand' \(AssignSub\) writes"):
            sess.run(tf.global_variables_initializer())
            sess.run(step)
    # A graph that does not train (no gradients) is not affected.
    with tf.Graph().as_default():
        total = tf.reduce_sum(tf.ones([4]))
        with tf.Session() as sess:
            assert sess.run(total) == 4.0


@pytest.mark.parametrize("program", [
    # TF 1.x's switch (tf.compat.v1 has it on both lines)
    "import tensorflow.compat.v1 as tf; tf.enable_eager_execution(); import epl",
    # a TF 2.x program that forgot the switch to graph mode (1.15: eager is off)
    "import tensorflow as tf; import epl",
])
def test_eager_mode_rejected(program):
    import tensorflow as tf_root
    if not tf_root.__version__.startswith("2") and "enable_eager" not in program:
        pytest.skip("TF 1.15 runs graphs by default: no eager program to refuse")
    code = (program + "\ntry:\n    epl.init()\nexcept RuntimeError as e:\n"
            "    print('ERR', e)\n")
    out = subprocess.run([sys.executable, "-c", code], stdout=subprocess.PIPE,
                         stderr=subprocess.DEVNULL, timeout=120).stdout.decode()
    assert "ERR epl.init(): eager execution is enabled" in out
    assert "tf.disable_v2_behavior()" in out  # (the fix, named)


def test_non_chief_monitored_session_fails_fast():
    epl.init(epl.Config({"cluster.devices_per_worker": 2}))
    epl.set_default_strategy(epl.replicate(1))
    w = tf.get_variable("w", initializer=tf.ones([2]))
    tf.train.GradientDescentOptimizer(0.1).minimize(tf.reduce_sum(w * w))
    with pytest.raises(RuntimeError, match="is_chief=True on every worker"):
        tf.train.MonitoredTrainingSession(is_chief=False)
