"""amp.level = O1: half-precision matrix products with float32 master weights and
loss scaling.  Oracle: the float32 program; the loss curves agree to 3e-2
(relative) over 20 steps; an overflowed step is skipped on every replica."""
import numpy as np
import pytest
import tensorflow.compat.v1 as tf

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
    op = models.train_op(loss, "adam", tf.train.get_or_create_global_step())
    with tf.Session() as sess:
        sess.run(tf.global_variables_initializer())
        return [sess.run([loss, op])[0] for _ in range(STEPS)], tf.get_default_graph()


def _bert_losses(config, annotate=False):
    models.reset()
    if config is not None:
        epl.init(epl.Config(config))
        if annotate:   # (EPL places every op: on the CPU device, not TF's XLA_CPU)
            epl.set_default_strategy(epl.replicate(1))
    features = bert.batches(bert.data(STEPS * 8), 8)
    loss = bert.model(features)
    op = bert.train_op(loss, num_steps=STEPS, careful=True)
    with tf.Session() as sess:
        sess.run(tf.global_variables_initializer())
        return [sess.run([loss, op])[0] for _ in range(STEPS)], tf.get_default_graph()


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
    assert not [v for v in tf.global_variables()
                if v.dtype.base_dtype == tf.float16]
    # The backward pass casts each weight again when it needs it: no half copy of a
    # weight made in the forward pass lives until the backward pass.
    from epl.features.amp import _weight_cast
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
    assert not [v for v in tf.global_variables()
                if v.dtype.base_dtype in (tf.float16, tf.bfloat16)]


def test_bfloat16_products_without_a_kernel_stay_float32():
    """A placed model (replicate(1)): a product TensorFlow has no bfloat16 kernel for on
    the device (TF 1.15's CPU: BatchMatMulV2, Conv2D) stays float32 instead of failing
    with "Cannot assign a device" at the first run; the others run in bfloat16."""
    from epl.tf_adapter import op_types
    want, _ = _bert_losses(None)
    got, graph = _bert_losses({"amp.level": "O1", "amp.dtype": "bfloat16",
                               "amp.loss_scale": 1, "cluster.devices_per_worker": 1},
                              annotate=True)
    np.testing.assert_allclose(got, want, rtol=3e-2)
    for op in graph.get_operations():
        if op.type in ("MatMul", "BatchMatMulV2", "BatchMatMul"):
            assert op.device, op.name
            if op.get_attr("T") == tf.bfloat16:
                assert op_types.has_kernel(op.type, tf.bfloat16, "CPU"), op.name
    assert [op for op in graph.get_operations() if op.type == "MatMul"
            and op.get_attr("T") == tf.bfloat16]


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
    px = tf.placeholder(tf.float32, [None, models.IN])
    py = tf.placeholder(tf.int64, [None])
    loss = deep_forward(px, py, dropout=False, stages=stages)
    step = tf.train.get_or_create_global_step()
    op = models.train_op(loss, "momentum", None if hand_step else step)
    if hand_step == "assign":
        op = tf.group(op, step.assign(step + 1))
    elif hand_step == "assign_add":
        op = tf.group(op, step.assign_add(1))
    x, y = models.data(32)
    graph = tf.get_default_graph()
    scale = models.value_tensor(graph, "EPL_AMP/loss_scale")
    with tf.Session() as sess:
        sess.run(tf.global_variables_initializer())
        sess.run(op, {px: x, py: y})
        # (after the first run: the replicas' copies exist)
        variables = [v for v in graph.get_operations() if v.type in ("VariableV2", "VarHandleOp")
                     and "layer_" in v.name and "Momentum" not in v.name]
        values = [models.value_tensor(graph, v.name) for v in variables]
        before = sess.run(values + [step, scale])
        big = x.copy()
        big[-1] *= 1e6       # one row: one replica's (or micro-batch's) share overflows
        sess.run(op, {px: big, py: y})
        after = sess.run(values + [step, scale])
        sess.run(op, {px: x, py: y})
        last = sess.run(values + [step, scale])
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
    w = tf.trainable_variables()[0]
    g = tf.gradients(loss, [w])[0]
    op = w.assign_sub(0.1 * g)
    with tf.Session() as sess:
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
        tf.train.GradientDescentOptimizer(0.1).minimize(loss)


def _tape_losses(config, optimizer="v1"):
    """The MLP as a custom training loop: resource variables, ``tf.GradientTape``,
    ``apply_gradients`` (a tf.compat.v1 or a tf.keras optimizer)."""
    models.reset()
    if config is not None:
        epl.init(epl.Config(config))
    x, y = models.data(32)
    step = tf.train.get_or_create_global_step()
    with tf.variable_scope("", use_resource=True):
        with tf.GradientTape() as tape:
            loss = deep_forward(tf.constant(x), tf.constant(y), dropout=False)
    variables = tf.trainable_variables()
    grads = tape.gradient(loss, variables)
    if optimizer == "v1":
        op = tf.train.AdamOptimizer(0.01).apply_gradients(
            zip(grads, variables), global_step=step)
    else:
        op = tf.group(tf.keras.optimizers.Adam(0.01).apply_gradients(zip(grads, variables)),
                      step.assign_add(1))
    with tf.Session() as sess:
        sess.run(tf.global_variables_initializer())
        return [sess.run([loss, op])[0] for _ in range(STEPS)], tf.get_default_graph()


@pytest.mark.parametrize("optimizer", ["v1", "keras"])
@pytest.mark.parametrize("scale", ["dynamic", 128])
def test_gradient_tape_loss_curve_follows_float32(scale, optimizer):
    """GradientTape.gradient gets the treatment tf.gradients gets (issue 24, item 4):
    float16 products forward and backward, a scaled backward pass."""
    want, _ = _tape_losses(None, optimizer)
    got, graph = _tape_losses({"amp.level": "O1", "amp.loss_scale": scale}, optimizer)
    np.testing.assert_allclose(got, want, rtol=3e-2)
    assert want[-1] < want[0] * 0.98, want
    half = [op for op in graph.get_operations()
            if op.type == "MatMul" and op.get_attr("T") == tf.float16]
    forward = [op for op in half if epl.Graph.get(graph).phase_of(op) == "forward"]
    assert len(forward) == 6, [op.name for op in half]
    assert len(half) >= 3 * len(forward) - 1, [op.name for op in half]
    assert not [op for op in graph.get_operations()
                if op.type == "MatMul" and op.get_attr("T") == tf.float32
                and epl.Graph.get(graph).phase_of(op) == "backward"]
    # The backward pass started from the loss scale.
    scaled = [op for op in graph.get_operations() if op.type == "Fill"
              and any("loss_scale" in t.name for t in ir_upstream(op))]
    assert scaled


def ir_upstream(op):
    from epl import ir
    return [t for o in ir.upstream([op], control=False) for t in o.outputs]


def test_gradient_tape_overflow_skips_the_step():
    """Dynamic scale: an overflowed step of a tape loop is skipped (weights and step
    kept, the scale halved), the next one applies."""
    models.reset()
    epl.init(epl.Config({"amp.level": "O1"}))
    px = tf.placeholder(tf.float32, [None, models.IN])
    py = tf.placeholder(tf.int64, [None])
    step = tf.train.get_or_create_global_step()
    with tf.variable_scope("", use_resource=True):
        with tf.GradientTape() as tape:
            loss = deep_forward(px, py, dropout=False)
    variables = tf.trainable_variables()
    grads = tape.gradient(loss, variables)
    op = tf.train.MomentumOptimizer(0.1, 0.9).apply_gradients(
        zip(grads, variables), global_step=step)
    scale = models.value_tensor(tf.get_default_graph(), "EPL_AMP/loss_scale")
    x, y = models.data(32)
    big = x.copy()
    big[-1] *= 1e6
    with tf.Session() as sess:
        sess.run(tf.global_variables_initializer())
        sess.run(op, {px: x, py: y})
        before = sess.run(variables + [step, scale])
        sess.run(op, {px: big, py: y})
        after = sess.run(variables + [step, scale])
        sess.run(op, {px: x, py: y})
        last = sess.run(variables + [step, scale])
    for b, a in zip(before[:-2], after[:-2]):
        np.testing.assert_array_equal(a, b)
    assert after[-2] == before[-2] == 1 and after[-1] == before[-1] / 2
    assert last[-2] == 2 and all(np.isfinite(w).all() for w in last[:-2])


def _tape_mlp_start(config):
    """A fresh graph -- under EPL with ``config``, plain TensorFlow with None -- with a
    batch of 8 and the three resource weights of a small MLP (seeded: the same in both
    programs), for the tests that write the layers by hand around a tape."""
    models.reset()
    if config is not None:
        epl.init(epl.Config(config))
    x, y = models.data(8)
    rng = np.random.RandomState(0)
    variables = [tf.get_variable(
        "w%d" % i, initializer=(rng.randn(*s) * 0.3).astype(np.float32), use_resource=True)
        for i, s in enumerate([(models.IN, 16), (16, 16), (16, models.CLASSES)])]
    return x, y, variables


@pytest.mark.parametrize("amp", [False, True])
def test_gradient_tape_keeps_its_semantics(amp):
    """Under AMP the tape still answers as a tape: a variable it did not watch gets no
    gradient (zeros with UnconnectedGradients.ZERO), nested sources keep their
    structure, output_gradients weigh the targets, a non-persistent tape answers
    once.  The numbers equal the float32 tape's to the tolerance above."""
    def run(config):
        x, y, variables = _tape_mlp_start(config)
        with tf.GradientTape(watch_accessed_variables=False) as tape:
            tape.watch(variables[:2])
            h = tf.constant(x)
            for w in variables:
                h = tf.tanh(tf.matmul(h, w))
            loss = 2.0 * tf.losses.sparse_softmax_cross_entropy(y, h)
        grads = tape.gradient(loss, {"a": variables[:2], "b": (variables[2],)},
                              output_gradients=tf.constant(0.5),
                              unconnected_gradients=tf.UnconnectedGradients.ZERO)
        with pytest.raises(RuntimeError, match="only be (called once|used to compute one set)"):
            tape.gradient(loss, variables)
        with tf.Session() as sess:
            sess.run(tf.global_variables_initializer())
            return sess.run(grads)
    want = run(None)
    got = run({"amp.level": "O1", "amp.loss_scale": 128} if amp else {})
    assert sorted(got) == ["a", "b"] and len(got["a"]) == 2 and len(got["b"]) == 1
    assert not got["b"][0].any() and not want["b"][0].any()
    for g, w in zip(got["a"], want["a"]):
        assert np.abs(w).max() > 0
        np.testing.assert_allclose(g, w, rtol=3e-2, atol=3e-2 * np.abs(w).max())


@pytest.mark.parametrize("amp", [False, True])
def test_gradients_stop_where_plain_tensorflow_stops(amp):
    """What the tape did not record (a loss built after it, a product inside its
    stop_recording) and tf.gradients' stop_gradients at a product AMP rebuilds in
    float16 stop the gradient as without AMP."""
    def run(config):
        x, y, w = _tape_mlp_start(config)
        with tf.GradientTape(persistent=True) as tape:
            h = tf.tanh(tf.matmul(tf.constant(x), w[0]))
            with tape.stop_recording():
                h = tf.matmul(h, w[1])
            logits = tf.matmul(tf.tanh(h), w[2])
            inside = tf.losses.sparse_softmax_cross_entropy(y, logits)
        outside = 2.0 * inside
        tape_inside = tape.gradient(inside, w)
        tape_outside = tape.gradient(outside, w)
        stopped = tf.gradients(inside, w, stop_gradients=[h])
        assert [g is None for g in tape_inside] == [True, True, False]
        assert tape_outside == [None, None, None]
        assert [g is None for g in stopped] == [True, True, False]
        with tf.Session() as sess:
            sess.run(tf.global_variables_initializer())
            return sess.run([tape_inside[2], stopped[2]]), tf.get_default_graph()
    want, _ = run(None)
    got, graph = run({"amp.level": "O1", "amp.loss_scale": 128} if amp else {})
    for g, v in zip(got, want):
        np.testing.assert_allclose(g, v, rtol=3e-2, atol=3e-2 * np.abs(v).max())
    if amp:
        assert [op for op in graph.get_operations()
                if op.type == "MatMul" and op.get_attr("T") == tf.float16]
