"""Gradients are reduced however the update is written (issue 10, item 1).

Every program is a plain TF1 training step; the oracle is the same program
without EPL on one device with the N-times batch (data parallelism), or with
its micro-batches accumulated (pipelines), to 1e-5.
"""
import numpy as np
import pytest
import tensorflow.compat.v1 as tf

import epl
from tests import models

STEPS, BATCH = 3, 4
IN, OUT = 6, 3


def _data(rows):
    rng = np.random.RandomState(0)
    return (rng.randn(rows, IN).astype(np.float32),
            rng.randn(rows, OUT).astype(np.float32))


def _layer(x, name, units, use_resource=False):
    rng = np.random.RandomState(len(name) + units)
    w = tf.get_variable(name + "/w", initializer=tf.constant(
        (rng.randn(int(x.shape[-1]), units) * 0.4).astype(np.float32)), use_resource=use_resource)
    b = tf.get_variable(name + "/b", initializer=tf.constant(
        (rng.randn(units) * 0.1).astype(np.float32)), use_resource=use_resource)
    return tf.matmul(x, w) + b, [w, b]


def _mlp(x, y, use_resource=False):
    h, v1 = _layer(x, "l1", 8, use_resource)
    out, v2 = _layer(tf.tanh(h), "l2", OUT, use_resource)
    return tf.reduce_mean(tf.square(out - y)), v1 + v2


# --- the ways of writing an update ---------------------------------------------------
# Each waits for every gradient before it writes (ref variables: otherwise the local
# program itself races, see PLATFORM_NOTES), as careful TF1 code does.

def _gradients(loss, tvars):
    grads = tf.gradients(loss, tvars)
    with tf.control_dependencies(grads):
        return [tf.identity(g) for g in grads]


def sgd_assign_sub(loss, tvars, use_resource=False):
    grads = _gradients(loss, tvars)
    return tf.group(*[tf.assign_sub(v, 0.1 * g) for g, v in zip(grads, tvars)])


def raw_apply_op(loss, tvars, use_resource=False):
    grads = _gradients(loss, tvars)
    if use_resource:
        ops = [tf.raw_ops.ResourceApplyGradientDescent(var=v.handle, alpha=0.1, delta=g)
               for g, v in zip(grads, tvars)]
    else:
        ops = [tf.raw_ops.ApplyGradientDescent(var=v, alpha=0.1, delta=g)
               for g, v in zip(grads, tvars)]
    return tf.group(*ops)


class MomentumByHand(tf.train.Optimizer):
    """An optimizer that overrides apply_gradients with its own slots and assigns
    (the shape of BERT's AdamWeightDecayOptimizer and of LAMB implementations)."""

    def __init__(self, lr=0.1, momentum=0.9):
        super(MomentumByHand, self).__init__(False, "MomentumByHand")
        self.lr, self.momentum = lr, momentum

    def apply_gradients(self, grads_and_vars, global_step=None, name=None):
        updates = []
        for g, v in grads_and_vars:
            m = tf.get_variable(v.op.name + "/mom", shape=v.shape,
                                          initializer=tf.zeros_initializer(), trainable=False)
            m_new = self.momentum * m + g
            updates += [m.assign(m_new), v.assign(v - self.lr * m_new)]
        if global_step is not None:
            updates.append(global_step.assign_add(1))
        return tf.group(*updates, name=name)


def custom_optimizer(loss, tvars, use_resource=False):
    grads = _gradients(loss, tvars)
    return MomentumByHand().apply_gradients(zip(grads, tvars))


WAYS = {"assign_sub": sgd_assign_sub, "raw_apply": raw_apply_op, "override": custom_optimizer}


def _run(build, x, y, batch, n=None, cfg=None, steps=STEPS):
    """Train ``build(bx, by) -> (train_op, fetches)`` for ``steps``; with ``n`` under EPL
    data parallelism on n devices.  Returns the fetched values."""
    models.reset()
    if n is not None:
        conf = {"cluster.devices_per_worker": n}
        conf.update(cfg or {})
        epl.init(epl.Config(conf))
        epl.set_default_strategy(epl.replicate(1))
    bx, by = models.input_batch(x, y, batch)
    op, fetches = build(bx, by)
    return models.run_steps(op, steps, fetches)


def _assert_close(got, want, rtol=1e-5, atol=1e-6):
    for i, (a, b) in enumerate(zip(got, want)):
        np.testing.assert_allclose(a, b, rtol=rtol, atol=atol, err_msg="fetch %d" % i)


@pytest.mark.parametrize("copies", ["per_device", "per_worker"])
@pytest.mark.parametrize("use_resource", [False, True])
@pytest.mark.parametrize("way", sorted(WAYS))
def test_update_written_any_way_equals_big_batch(way, use_resource, copies):
    n = 2
    x, y = _data(STEPS * n * BATCH)

    def build(bx, by):
        loss, tvars = _mlp(bx, by, use_resource)
        return WAYS[way](loss, tvars, use_resource), tvars

    want = _run(build, x, y, n * BATCH)
    got = _run(build, x, y, BATCH, n, {"cluster.variable_copies": copies})
    _assert_close(got, want)


@pytest.mark.parametrize("n", [2, 4])
def test_override_on_more_devices(n):
    x, y = _data(STEPS * n * BATCH)

    def build(bx, by):
        loss, tvars = _mlp(bx, by)
        return custom_optimizer(loss, tvars), tvars

    _assert_close(_run(build, x, y, BATCH, n), _run(build, x, y, n * BATCH))


def test_gradient_tape_with_keras_optimizer():
    n = 2
    x, y = _data(STEPS * n * BATCH)

    def build(bx, by):
        holder = {}

        def loss_fn():
            loss, tvars = _mlp(bx, by, use_resource=True)
            holder["tvars"] = tvars
            return loss
        with tf.GradientTape() as tape:
            loss = loss_fn()
        tvars = holder["tvars"]
        grads = tape.gradient(loss, tvars)
        return tf.keras.optimizers.SGD(0.1).apply_gradients(zip(grads, tvars)), tvars

    _assert_close(_run(build, x, y, BATCH, n), _run(build, x, y, n * BATCH))


def test_two_gradient_calls_in_one_step():
    """Two losses, two tf.gradients calls, two hand-written updates: two reductions."""
    n = 2
    x, y = _data(STEPS * n * BATCH)

    def build(bx, by):
        h, v1 = _layer(bx, "a", OUT)
        out, v2 = _layer(by, "b", OUT)
        loss1 = tf.reduce_mean(tf.square(h - by))
        loss2 = tf.reduce_mean(tf.abs(out - tf.reduce_mean(bx, axis=1, keepdims=True)))
        g1 = _gradients(loss1, v1)
        g2 = _gradients(loss2, v2)
        ops = [tf.assign_sub(v, 0.1 * g) for g, v in zip(g1 + g2, v1 + v2)]
        return tf.group(*ops), v1 + v2

    want = _run(build, x, y, n * BATCH)
    _assert_close(_run(build, x, y, BATCH, n), want)
    sites = set(o.get_attr("group").decode().split("/")[0] for o in
                tf.get_default_graph().get_operations() if o.type == "EplAllReduceN")
    assert sites == {"EPL_GRADIENTS_0", "EPL_GRADIENTS_1"}   # one reduction per gradient call


def _clipped(bx, by, clip_norm=0.05):
    loss, tvars = _mlp(bx, by)
    grads = _gradients(loss, tvars)
    clipped, _ = tf.clip_by_global_norm(grads, clip_norm)
    return MomentumByHand().apply_gradients(zip(clipped, tvars)), tvars


def _towers_clip_then_mean(x, y, n, clip_norm=0.05):
    """Oracle for clip_after_allreduce=False without EPL: n towers on one device, each
    clips its own gradients, the clipped gradients are averaged, then applied."""
    models.reset()
    bx, by = models.input_batch(x, y, n * BATCH)
    xs, ys = tf.split(bx, n), tf.split(by, n)
    per_tower = []
    tvars = None
    for i in range(n):
        with tf.variable_scope("", reuse=i > 0):
            loss, tvars = _mlp(xs[i], ys[i])
        grads = _gradients(loss, tvars)
        per_tower.append(tf.clip_by_global_norm(grads, clip_norm)[0])
    mean = [tf.add_n(list(gs)) / n for gs in zip(*per_tower)]
    op = MomentumByHand().apply_gradients(zip(mean, tvars))
    with tf.Session() as sess:
        sess.run(tf.global_variables_initializer())
        for _ in range(STEPS):
            sess.run(op)
        return sess.run(tvars)


def test_clip_after_allreduce_true_equals_big_batch_clipping():
    n = 2
    x, y = _data(STEPS * n * BATCH)
    want = _run(_clipped, x, y, n * BATCH)
    got = _run(_clipped, x, y, BATCH, n, {"communication.clip_after_allreduce": True})
    _assert_close(got, want)


def test_clip_after_allreduce_false_clips_each_replica_then_averages():
    n = 2
    x, y = _data(STEPS * n * BATCH)
    want = _towers_clip_then_mean(x, y, n)
    got = _run(_clipped, x, y, BATCH, n, {"communication.clip_after_allreduce": False})
    _assert_close(got, want)
    # ... which is a different algorithm from clipping the big batch's gradient.
    big = _run(_clipped, x, y, n * BATCH)
    assert max(np.abs(a - b).max() for a, b in zip(got, big)) > 1e-4


def test_gradient_accumulation_hand_written_update_applies_once():
    m = 2
    x, y = _data(STEPS * m * BATCH)

    def build(bx, by):
        loss, tvars = _mlp(bx, by)
        return sgd_assign_sub(loss, tvars), tvars

    want = _run(build, x, y, m * BATCH)
    got = _run(build, x, y, BATCH, 1, {"pipeline.num_micro_batch": m})
    _assert_close(got, want)


@pytest.mark.parametrize("way", ["assign_sub", "override"])
def test_two_stage_pipeline_hand_written_update(way):
    m = 2
    x, y = _data(STEPS * m * BATCH)

    def build(bx, by, stages=False):
        if stages:
            with epl.replicate(1, name="stage_0"):
                h, v1 = _layer(bx, "l1", 8)
            with epl.replicate(1, name="stage_1"):
                out, v2 = _layer(tf.tanh(h), "l2", OUT)
                loss = tf.reduce_mean(tf.square(out - by))
        else:
            h, v1 = _layer(bx, "l1", 8)
            out, v2 = _layer(tf.tanh(h), "l2", OUT)
            loss = tf.reduce_mean(tf.square(out - by))
        tvars = v1 + v2
        return WAYS[way](loss, tvars), tvars

    want = _run(build, x, y, m * BATCH)
    models.reset()
    epl.init(epl.Config({"cluster.devices_per_worker": 2, "pipeline.num_micro_batch": m}))
    bx, by = models.input_batch(x, y, BATCH)
    op, tvars = build(bx, by, stages=True)
    with tf.Session() as sess:
        sess.run(tf.global_variables_initializer())
        for _ in range(STEPS):
            sess.run(op)
        got = sess.run(tvars)
        devices = set(o.device for o in tf.get_default_graph().get_operations()
                      if o.type == "MatMul")
    _assert_close(got, want)
    assert len(devices) == 2   # the stages really run on two devices


def test_trainable_variable_written_from_the_batch_is_refused():
    epl.init(epl.Config({"cluster.devices_per_worker": 2}))
    epl.set_default_strategy(epl.replicate(1))
    x, _ = models.input_batch(*_data(16), BATCH)
    w = tf.get_variable("w", initializer=tf.zeros([IN]))
    op = tf.assign(w, tf.reduce_mean(x, axis=0))
    with pytest.raises(NotImplementedError, match=r"writes the trainable variable 'w'.*diverge"):
        with tf.Session() as sess:
            sess.run(op)


@pytest.mark.parametrize("copies", ["per_device", "per_worker"])
def test_per_replica_state_each_replica_keeps_its_own(copies):
    """A non-trainable variable updated from the batch (batch-norm statistics, metric
    totals) is per-replica state: every replica keeps its own copy; the user's
    variable (what checkpoints save) is replica 0's."""
    n = 2
    x, y = _data(STEPS * n * BATCH)
    epl.init(epl.Config({"cluster.devices_per_worker": n, "cluster.variable_copies": copies}))
    epl.set_default_strategy(epl.replicate(1))
    bx, by = models.input_batch(x, y, BATCH)
    loss, tvars = _mlp(bx, by)
    total = tf.get_variable("seen", initializer=tf.zeros([IN]), trainable=False)
    count = tf.assign_add(total, tf.reduce_sum(bx, axis=0))
    with tf.control_dependencies([count]):
        op = sgd_assign_sub(loss, tvars)
    with tf.Session() as sess:
        sess.run(tf.global_variables_initializer())
        for _ in range(STEPS):
            sess.run(op)
        g = tf.get_default_graph()
        mine = sess.run(total)
        other = sess.run(models.value_tensor(g, "EPL_REPLICA_1/seen"))
    # Every batch went to exactly one replica's copy (which one is the order in which the
    # replicas pull from the shared iterator), and the copies differ.
    np.testing.assert_allclose(mine + other, x.sum(axis=0), rtol=1e-5, atol=1e-5)
    assert np.abs(mine - other).max() > 1e-3


class MomentumByHandNameFirst(MomentumByHand):
    """A tf.compat.v1 override whose parameters come in another order than the base
    class's (grads_and_vars, global_step=None, name=None)."""

    def apply_gradients(self, grads_and_vars, name=None, global_step=None):
        return super(MomentumByHandNameFirst, self).apply_gradients(grads_and_vars,
                                                                    global_step, name)


class MomentumByHandForwarding(MomentumByHand):
    """An override that forwards whatever it gets (a wrapper's usual signature)."""

    def apply_gradients(self, *args, **kwargs):
        return super(MomentumByHandForwarding, self).apply_gradients(*args, **kwargs)


class KerasSGDByHand(tf.keras.optimizers.SGD):
    """A tf.keras OptimizerV2 override: (grads_and_vars, name=None), its own step
    counter (``iterations``) advanced by the base method."""

    def apply_gradients(self, grads_and_vars, name=None):
        pairs = [(g * 1.0, v) for g, v in grads_and_vars]
        return super(KerasSGDByHand, self).apply_gradients(pairs, name)


@pytest.mark.parametrize("kind, call", [
    ("v1", "positional"), ("v1", "keyword"), ("v1_name_first", "positional"),
    ("v1_name_first", "keyword"), ("v1_forwarding", "keyword"),
    ("v1_forwarding", "all_keywords"), ("keras", "positional"), ("keras", "keyword")])
def test_override_arguments_bound_by_its_signature(kind, call):
    """The capture reads ``global_step`` by the signature of the override actually
    called (issue 24, item 6): a keras override's positional ``name`` is not taken as
    the step; training equals plain TF on the big batch and the step counts it."""
    n = 2
    x, y = _data(STEPS * n * BATCH)

    def build(bx, by):
        loss, tvars = _mlp(bx, by, use_resource=True)
        grads = _gradients(loss, tvars)
        step = tf.train.get_or_create_global_step()
        if kind == "keras":
            opt = KerasSGDByHand(0.1)
            op = opt.apply_gradients(zip(grads, tvars), "train") if call == "positional" \
                else opt.apply_gradients(zip(grads, tvars), name="train")
            counter = opt.iterations
        else:
            opt = {"v1": MomentumByHand, "v1_name_first": MomentumByHandNameFirst,
                   "v1_forwarding": MomentumByHandForwarding}[kind]()
            args = (step, "train") if kind == "v1" else ("train", step)
            if call == "positional":
                op = opt.apply_gradients(zip(grads, tvars), *args)
            elif call == "keyword":
                op = opt.apply_gradients(zip(grads, tvars), name="train", global_step=step)
            else:
                op = opt.apply_gradients(grads_and_vars=zip(grads, tvars), name="train",
                                         global_step=step)
            counter = step
        if epl.Env.initialized():
            record = epl.Graph.get().apply_records[-1]
            assert record.global_step is (None if kind == "keras" else step), \
                record.global_step
        assert "train" in op.name.split("/")     # the name reached the override
        return op, tvars + [counter]

    want = _run(build, x, y, n * BATCH)
    got = _run(build, x, y, BATCH, n)
    _assert_close(got, want)
    assert got[-1] == want[-1] == STEPS
