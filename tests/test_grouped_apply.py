"""optimizer.num_apply_group: the updates run in groups, one after another, and no
number changes (oracle: the same program without EPL / with one group)."""
import pytest
import tensorflow.compat.v1 as tf

import epl
from tests import models
from tests.test_gradient_checkpoint import assert_same, program


def _reaches(src, dst):
    """``dst`` runs after ``src`` (a path of data or control edges)."""
    seen, stack = set(), [src]
    while stack:
        op = stack.pop()
        if op is dst:
            return True
        if op in seen:
            continue
        seen.add(op)
        stack.extend(c for t in op.outputs for c in t.consumers())
        stack.extend(op._control_outputs)  # pylint: disable=protected-access
    return False


@pytest.mark.parametrize("optimizer", ["momentum", "adam", "adamw"])
@pytest.mark.parametrize("groups", [2, 3, 5])
def test_groups_equal_plain_program(groups, optimizer):
    want = program(None, 16, optimizer, dropout=False)
    got = program({"optimizer.num_apply_group": groups}, 16, optimizer, dropout=False)
    assert_same(got, want)


def test_data_parallel_groups():
    config = {"cluster.devices_per_worker": 2}
    want = program(dict(config), 32, "adam", dropout=False)
    got = program(dict(config, **{"optimizer.num_apply_group": 3}), 32, "adam", dropout=False)
    assert_same(got, want)


@pytest.mark.parametrize("groups", [1, 2, 3, 5, 40])
def test_updates_run_group_after_group(groups):
    """The momentum updates (12 variables) form ``groups`` groups in sequence: the last
    layers' (whose gradients come first) before the first layers'."""
    models.reset()
    epl.init(epl.Config({"optimizer.num_apply_group": groups}))
    px = tf.placeholder(tf.float32, [None, models.IN])
    py = tf.placeholder(tf.int64, [None])
    from tests.test_gradient_checkpoint import deep_forward
    loss = deep_forward(px, py, dropout=False)
    tf.train.MomentumOptimizer(0.1, 0.9).minimize(loss)
    graph = tf.get_default_graph()
    updates = [op for op in graph.get_operations()
               if op.type in ("ApplyMomentum", "ResourceApplyMomentum")]
    assert len(updates) == 12
    var = {op: op.inputs[0].op.name for op in updates}
    order = sorted(updates, key=lambda op: -[v.op.name for v in tf.trainable_variables()]
                   .index(var[op]))
    chained = [_reaches(a, b) for a, b in zip(order, order[1:])]
    assert sum(chained) == min(groups, 12) - 1, [var[op] for op in order]
    assert not any(_reaches(b, a) for a, b in zip(order, order[1:]))


def test_feeders_join_their_group_but_reads_stay_free():
    """A hand-written AdamW's ``beta * m`` temporaries run with their group (else they
    would all be held at once); reading a weight or a slot still runs no update."""
    if not models.REF_VARIABLES:
        pytest.skip("reads the ref-variable graph (slot/read identities, Assign ops); the "
                    "oracles of grouped apply run in this mode")
    models.reset()
    epl.init(epl.Config({"optimizer.num_apply_group": 2}))
    x, y = models.data(8)
    from tests.test_gradient_checkpoint import deep_forward
    loss = deep_forward(tf.constant(x), tf.constant(y), dropout=False)
    variables = tf.trainable_variables()
    grads = tf.gradients(loss, variables)
    models.make_optimizer("adamw").apply_gradients(list(zip(grads, variables)))
    graph = tf.get_default_graph()
    first, last = variables[-1].op.name, variables[0].op.name   # groups: last layers first
    decay = graph.get_operation_by_name(first + "/adam_m/read").outputs[0].consumers()
    scaled = [op for op in decay if op.type == "Mul"]
    assert scaled
    late = graph.get_operation_by_name(last + "/adam_m/read").outputs[0].consumers()
    late = [op for op in late if op.type == "Mul"]
    assert any(_reaches(w, late[0]) for w in graph.get_operations()
               if w.type == "Assign" and w.inputs[0].op.name == first)
    with tf.Session() as sess:
        sess.run(tf.global_variables_initializer())
        before = sess.run(variables)
        sess.run([graph.get_tensor_by_name(v.op.name + "/adam_m/read:0") for v in variables])
        after = sess.run(variables)
    for a, b in zip(before, after):
        assert (a == b).all()
