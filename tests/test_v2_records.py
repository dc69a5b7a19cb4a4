"""What capture records of control flow v2, and the rewrite's correction of it, on
both TensorFlow lines (issue 25).

* Ops of a v2 body (a ``FuncGraph``) that TensorFlow makes while a gradient of the
  graph is built are not the graph's: they never join its TaskGraphs (``ir.Graph.record``,
  at capture), so no pass can copy them.
* The accumulators a v2 loop's gradient adds to the forward loop are the forward loop's,
  from the end of the gradient call that made them (capture:
  ``ir.Graph.adopt_loop_inputs``): also for a loop and gradient built after the graph's
  first rewrite, checked against the program at 1e-5.
"""
import numpy as np
import pytest
import tensorflow.compat.v1 as tf

import epl
from epl import ir

X = (np.arange(12, dtype=np.float32).reshape(4, 3) - 5.0) / 8.0
Y = np.array([[1.0], [-2.0], [0.5], [3.0]], np.float32)


@pytest.fixture
def v2():
    tf.enable_control_flow_v2()
    tf.enable_resource_variables()
    try:
        yield
    finally:
        tf.disable_control_flow_v2()
        tf.disable_resource_variables()


def _loop(x, w, steps, name):
    def body(i, h):
        return i + 1, tf.tanh(tf.matmul(h, w))
    _, h = tf.while_loop(lambda i, h: i < steps, body, [tf.constant(0), x], name=name)
    return h


def test_body_ops_never_join_the_graphs_taskgraphs(v2):
    epl.init(epl.Config({"cluster.devices_per_worker": 2}))
    epl.set_default_strategy(epl.replicate(1))
    x = tf.placeholder(tf.float32, [None, 3])
    w = tf.get_variable("w", initializer=np.eye(3, dtype=np.float32) * 0.5)
    loss = tf.reduce_sum(_loop(x, w, 3, "loop"))
    tf.gradients(loss, [w])
    graph = tf.get_default_graph()
    tg = ir.Graph.get().taskgraphs[0]
    assert tg.graph is graph
    assert [op for op in tg.ops if op.graph is not graph] == []
    assert any(op.type in ("While", "StatelessWhile") for op in tg.ops)
    # The body ops are still recorded, in their own graph's IR.
    bodies = [g for g in _body_graphs(graph)]
    assert bodies and all(ir.Graph.existing(b) is None or all(
        op.graph is b for t in ir.Graph.existing(b).taskgraphs for op in t.ops)
        for b in bodies)


def test_loop_accumulators_join_the_loops_taskgraph_at_capture(v2):
    """The lists a v2 loop's gradient adds to the forward loop are forward ops of the
    loop's TaskGraph as soon as the gradient call returns (capture,
    ``ir.Graph.adopt_loop_inputs``), before any rewrite: not backward ops, nor ops of
    the body graph's TaskGraph that no TaskGraph of the graph holds."""
    epl.init(epl.Config({"cluster.devices_per_worker": 2}))
    epl.set_default_strategy(epl.replicate(1))
    x = tf.placeholder(tf.float32, [None, 3])
    w = tf.get_variable("w", initializer=np.eye(3, dtype=np.float32) * 0.5)
    loss = tf.reduce_sum(_loop(x, w, 3, "loop"))
    tf.gradients(loss, [w])
    graph = tf.get_default_graph()
    ir_graph = ir.Graph.get()
    tg, = ir_graph.taskgraphs
    loop = graph.get_operation_by_name("loop")
    lists = [t.op for t in loop.inputs if "TensorList" in t.op.type]
    assert lists
    for op in lists:
        assert (ir_graph.phase_of(op), ir_graph.taskgraph_of(op)) == ("forward", tg), op.name
        assert op in tg.ops
    assert [t.name for t in ir_graph.gradient_records[-1].ys] == [loss.name]
    assert not ir_graph.rewritten


def _body_graphs(graph):
    from epl.tf_adapter import functions
    out = []
    for op in graph.get_operations():
        for _, value in functions.function_attrs(op):
            for name in functions.attr_function_names(value):
                out.extend(functions.source_graphs(graph, name))
    return out


def _train_twice(with_epl):
    """Step 1 trains through loop 1; loop 2, its gradient and step 2 are built after
    that run (with EPL: after the first rewrite).  Returns w after each step."""
    tf.reset_default_graph()
    if with_epl:
        epl.init(epl.Config({"cluster.devices_per_worker": 2}))
        epl.set_default_strategy(epl.replicate(1))
    x = tf.placeholder(tf.float32, [None, 3], name="x")
    y = tf.placeholder(tf.float32, [None, 1], name="y")
    w = tf.get_variable("w", initializer=np.eye(3, dtype=np.float32) * 0.5)
    v = tf.get_variable("v", initializer=np.ones((3, 1), np.float32))
    loss1 = tf.reduce_mean(tf.square(tf.matmul(_loop(x, w, 2, "first"), v) - y))
    step1 = tf.train.GradientDescentOptimizer(0.5).minimize(loss1)
    out = []
    with tf.Session() as sess:
        sess.run(tf.global_variables_initializer())
        sess.run(step1, {x: X, y: Y})
        out.append(sess.run(w))
        loss2 = tf.reduce_mean(tf.square(tf.matmul(_loop(x, w, 3, "second"), v) - y))
        step2 = tf.train.GradientDescentOptimizer(0.5).minimize(loss2)
        sess.run(step2, {x: X, y: Y})
        out.append(sess.run(w))
    return out


def test_a_v2_loop_built_after_the_first_rewrite_trains_as_the_program(v2):
    want = _train_twice(False)
    got = _train_twice(True)
    assert not np.allclose(want[1], want[0], atol=1e-4)     # step 2 moved w
    for g, w in zip(got, want):
        np.testing.assert_allclose(g, w, rtol=1e-5, atol=1e-6)
    # Step 2's loop is copied per clone, with its accumulators.
    names = [op.name for op in tf.get_default_graph().get_operations()]
    assert any(n.startswith("EPL_REPLICA_1/") and "second" in n for n in names)
