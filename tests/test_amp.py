"""amp.level = O1: half-precision matrix products with float32 master weights and
loss scaling.  Oracle: the float32 program; the loss curves agree to 3e-2
(relative) over 20 steps; an overflowed step is skipped on every replica."""
import numpy as np
import pytest
import tensorflow as tf

import epl
from tests import models
from tests.corpus import bert
from tests.test_gradient_checkpoint import deep_forward

STEPS = 20


def _mlp_losses(config):
    models.reset()
    if config is not None:
        epl.init(epl.Config(config))
    x, y = models.data(32)     # one batch, every step: the loss falls
    loss = deep_forward(tf.constant(x), tf.constant(y), dropout=False)
    op = models.train_op(loss, "adam", tf.compat.v1.train.get_or_create_global_step())
    with tf.compat.v1.Session() as sess:
        sess.run(tf.compat.v1.global_variables_initializer())
        return [sess.run([loss, op])[0] for _ in range(STEPS)], tf.compat.v1.get_default_graph()


def _bert_losses(config):
    models.reset()
    if config is not None:
        epl.init(epl.Config(config))
    features = bert.batches(bert.data(STEPS * 8), 8)
    loss = bert.model(features)
    op = bert.train_op(loss, num_steps=STEPS, careful=True)
    with tf.compat.v1.Session() as sess:
        sess.run(tf.compat.v1.global_variables_initializer())
        return [sess.run([loss, op])[0] for _ in range(STEPS)], tf.compat.v1.get_default_graph()


@pytest.mark.parametrize("scale", ["dynamic", 128])
@pytest.mark.parametrize("build", [_mlp_losses, _bert_losses], ids=["mlp", "mini_bert"])
def test_loss_curve_follows_float32(build, scale):
    want, _ = build(None)
    got, graph = build({"amp.level": "o1", "amp.loss_scale": scale})
    np.testing.assert_allclose(got, want, rtol=3e-2)
    assert want[-1] < want[0] * 0.98, want     # the model learns: the check can fail
    half = [op for op in graph.get_operations()
            if op.type in ("MatMul", "BatchMatMulV2", "BatchMatMul")
            and op.get_attr("T") == tf.float16]
    # Forward and both backward products of every layer.
    assert len(half) >= 3 * len([op for op in half if "gradients" not in op.name])
    assert [op for op in half if "gradients" not in op.name]
    assert not [v for v in tf.compat.v1.global_variables()
                if v.dtype.base_dtype == tf.float16]
    # The backward pass casts each weight again when it needs it: no half copy of a
    # weight made in the forward pass lives until the backward pass.
    from epl.amp import _weight_cast
    ir = epl.Graph.get(graph)
    late = [(op.name, t.name) for op in graph.get_operations() if ir.phase_of(op) == "backward"
            for t in op.inputs if _weight_cast(t) and ir.phase_of(t.op) == "forward"]
    assert not late, late[:3]
    again = [op for op in graph.get_operations() if op.name.endswith("_again")]
    assert again and all(op.control_inputs for op in again)


@pytest.mark.parametrize("build", [_mlp_losses, _bert_losses], ids=["mlp", "mini_bert"])
def test_bfloat16_loss_curve_follows_float32(build):
    """amp.dtype bfloat16 (EPL's extension): the products in bfloat16, no half variable."""
    want, _ = build(None)
    got, graph = build({"amp.level": "O1", "amp.dtype": "bfloat16", "amp.loss_scale": 1})
    np.testing.assert_allclose(got, want, rtol=3e-2)
    assert want[-1] < want[0] * 0.98, want
    types = {}
    for op in graph.get_operations():
        if op.type in ("MatMul", "BatchMatMulV2", "BatchMatMul"):
            types.setdefault(op.get_attr("T"), []).append(op.name)
    assert tf.float16 not in types and len(types[tf.bfloat16]) >= 3, types
    assert not [v for v in tf.compat.v1.global_variables()
                if v.dtype.base_dtype in (tf.float16, tf.bfloat16)]


def test_amp_dtype_checked():
    with pytest.raises(ValueError, match="amp.dtype"):
        epl.Config({"amp.dtype": "half"})


def _overflow_program(config, stages=1, hand_step=None):
    """Three steps; the second one's batch overflows float16 in the forward pass.
    ``hand_step``: global_step advanced by hand outside apply_gradients ("assign":
    ``step.assign(step + 1)`` like BERT, or "assign_add")."""
    models.reset()
    cfg = {"amp.level": "O1", "cluster.variable_copies": "per_device"}
    cfg.update(config)
    epl.init(epl.Config(cfg))
    if stages == 1:
        epl.set_default_strategy(epl.replicate(1))
    px = tf.compat.v1.placeholder(tf.float32, [None, models.IN])
    py = tf.compat.v1.placeholder(tf.int64, [None])
    loss = deep_forward(px, py, dropout=False, stages=stages)
    step = tf.compat.v1.train.get_or_create_global_step()
    op = models.train_op(loss, "momentum", None if hand_step else step)
    if hand_step == "assign":
        op = tf.group(op, step.assign(step + 1))
    elif hand_step == "assign_add":
        op = tf.group(op, step.assign_add(1))
    x, y = models.data(32)
    graph = tf.compat.v1.get_default_graph()
    scale = models.value_tensor(graph, "EPL_AMP/loss_scale")
    with tf.compat.v1.Session() as sess:
        sess.run(tf.compat.v1.global_variables_initializer())
        sess.run(op, {px: x, py: y})
        # (after the first run: the replicas' copies exist)
        variables = [v for v in graph.get_operations() if v.type == "VariableV2"
                     and "layer_" in v.name and "Momentum" not in v.name]
        before = sess.run([v.outputs[0] for v in variables] + [step, scale])
        big = x.copy()
        big[-1] *= 1e6       # one row: one replica's (or micro-batch's) share overflows
        sess.run(op, {px: big, py: y})
        after = sess.run([v.outputs[0] for v in variables] + [step, scale])
        sess.run(op, {px: x, py: y})
        last = sess.run([v.outputs[0] for v in variables] + [step, scale])
    return variables, before, after, last


@pytest.mark.parametrize("config, stages, hand_step", [
    ({}, 1, None),
    ({"cluster.devices_per_worker": 2}, 1, None),
    ({"cluster.devices_per_worker": 2, "pipeline.num_micro_batch": 2}, 2, None),
    ({}, 1, "assign"),
    ({"cluster.devices_per_worker": 2}, 1, "assign_add"),
])
def test_overflow_skips_the_step_everywhere(config, stages, hand_step):
    variables, before, after, last = _overflow_program(config, stages, hand_step)
    names = [v.name for v in variables]
    if config.get("cluster.devices_per_worker") == 2 and stages == 1:
        assert any(n.startswith("EPL_REPLICA_1/") for n in names)   # every replica's copy
    for name, b, a in zip(names, before[:-2], after[:-2]):
        np.testing.assert_array_equal(a, b, err_msg=name)
    assert after[-2] == before[-2] == 1                # global_step did not advance
    assert after[-1] == before[-1] / 2                 # the scale halved
    assert last[-2] == 2 and last[-1] == after[-1]     # the next clean step applies
    assert all(np.isfinite(w).all() for w in last[:-2])
    assert any((l != a).any() for l, a in zip(last[:-2], after[:-2]))


def test_dynamic_scale_and_update_by_hand_refused():
    """An update written by hand would apply an overflowed (NaN) gradient: refused."""
    models.reset()
    epl.init(epl.Config({"amp.level": "O1"}))
    x, y = models.data(8)
    _, loss = models.forward(tf.constant(x), tf.constant(y))
    w = tf.compat.v1.trainable_variables()[0]
    g = tf.gradients(loss, [w])[0]
    op = w.assign_sub(0.1 * g)
    with tf.compat.v1.Session() as sess:
        with pytest.raises(NotImplementedError, match="writes the trainable variable 'dense/"
                                                      "kernel' from gradients by hand"):
            sess.run(op)


def test_dynamic_scale_and_accumulation_across_runs_refused():
    models.reset()
    epl.init(epl.Config({"amp.level": "O1", "pipeline.num_micro_batch": 2}))
    x, y = models.data(8)
    _, loss = models.forward(tf.constant(x), tf.constant(y))
    with pytest.raises(NotImplementedError, match="'amp.loss_scale' = 'dynamic' with "
                                                  "'pipeline.num_micro_batch' = 2"):
        tf.compat.v1.train.GradientDescentOptimizer(0.1).minimize(loss)
