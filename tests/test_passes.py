"""Every rewrite pass alone, on a small graph over 2 virtual devices (issue 25).

Each test builds a few ops under ``epl.init``, prepares the state as
``epl.rewrite._rewrite`` does before its passes (``rewrite.prepare_state``), then runs only the
passes of ``rewrite.PASSES`` that the pass under test requires, found from the
contracts (``_needed``: the pass and, transitively, the earlier passes providing
the facts it requires), and checks what the pass promises on the graph itself:
its structure and, where a session run is cheap, a number.  The whole rewrite is
tested by the numerical oracles of the rest of the suite; these tests say which
pass broke.
"""
import collections
import contextlib
import uuid

import numpy as np
import pytest
import tensorflow.compat.v1 as tf

import epl
from epl import ir
from epl.core.process_state import Env
from epl.rewrite import PASSES, RewriteResult, function_bodies, prepare_state
from epl.rewrite.pipeline import PassContext, PassPipeline
from epl.tf_adapter import functions
from epl.tf_adapter import graph as tfg
from tests.test_control_flow_v2 import v2  # noqa: F401  (the fixture)

X = (np.arange(12, dtype=np.float32).reshape(4, 3) - 5.0) / 4.0    # 4 rows: 2 per clone
Y = np.array([[1.0], [-2.0], [0.5], [3.0]], np.float32)
W = np.array([[0.5], [-1.0], [2.0]], np.float32)


# ---------------------------------------------------------------------------- helpers

def _prepare(cluster=None):
    """The graph's ``Rewrite`` (the plan, no product yet), made as ``rewrite._rewrite``
    makes it (``rewrite.prepare_state``: the analyses, split placement) before it runs
    ``PASSES``.
    ``cluster`` replaces the cluster of ``epl.init`` (a worker of a multi-worker job)."""
    env = Env.get()
    return prepare_state(ir.Graph.get(), env.config, cluster or env.cluster)


def _needed(target):
    """``target`` and the passes before it in the default order that provide what it
    requires, transitively (nothing else)."""
    passes = PASSES.passes
    i = [p.name for p in passes].index(target)
    chosen, want = [passes[i]], set(passes[i].requires)
    for p in reversed(passes[:i]):
        if p.provides & want:
            chosen.insert(0, p)
            want |= p.requires
    return chosen


def _run(state, target, since=-1, first=True, sel=None, done=()):
    """Run ``target`` after only what it requires (as ``rewrite._passes`` runs them),
    except the passes ``done`` already ran; returns the names of the passes that ran."""
    ran = [p for p in PASSES.passes if p.name in done]
    pipe = PassPipeline([p for p in _needed(target) if p.name not in done],
                        given=set().union(*[p.provides for p in ran]))
    # (the pipeline refuses an order missing a requirement)
    pipe.run(PassContext(state, sel if sel is not None else state.selection, since, first),
             dump_dir="")
    state.last_id = tfg.last_op_id(state.graph)
    return pipe.names()


def _later(state, target):
    """A later rewrite of the ops made since the last one (as ``rewrite._extend``)."""
    from epl.rewrite import selection
    since = state.last_id
    sel = selection.select(state.ir_graph, state.taskgraphs, state.share_variables,
                           state.config.get("communication.clip_after_allreduce"),
                           known=state.selection, since_id=since)
    state.selection.merge(sel)
    return _run(state, target, since=since, first=False, sel=sel)


def _session(state):
    """A session on the graph as the passes left it: the graph is marked rewritten, so its
    first run does not rewrite it whole (fetches of epl.GraphKeys tensors are mapped to
    ``state.merged`` as after a real rewrite)."""
    life = state.ir_graph.lifecycle
    life.rewritten, life.pending, life.result = True, False, RewriteResult(state)
    return tf.Session(graph=state.graph)


def _init(devices=2, **extra):
    cfg = {"cluster.devices_per_worker": devices}
    cfg.update(extra)
    epl.init(epl.Config(cfg))


Model = collections.namedtuple("Model", "x y w pred loss train")


def _linear(scope=None):
    """pred = x @ w, loss = mean((pred - y)^2), one SGD step; in ``scope`` (default: the
    default strategy replicate(1)).  The fed x and y are made before: no scope's."""
    x = tf.placeholder(tf.float32, [None, 3], name="x")
    y = tf.placeholder(tf.float32, [None, 1], name="y")
    if scope is None:
        epl.set_default_strategy(epl.replicate(1))
        scope = contextlib.nullcontext()
    with scope:
        w = tf.get_variable("w", initializer=W)
        pred = tf.matmul(x, w, name="pred")
        loss = tf.reduce_mean(tf.square(pred - y), name="loss")
        train = tf.train.GradientDescentOptimizer(0.1).minimize(loss)
    return Model(x, y, w, pred, loss, train)


def _two_stages(x, y):
    """Stage s0: h = x w0; stage s1: loss = mean((h w1 - y)^2); one SGD step."""
    with epl.replicate(1, name="s0"):
        w0 = tf.get_variable("w0", initializer=np.eye(3, dtype=np.float32))
        h = tf.matmul(x, w0, name="h")
    with epl.replicate(1, name="s1"):
        w1 = tf.get_variable("w1", initializer=W)
        loss = tf.reduce_mean(tf.square(tf.matmul(h, w1, name="out") - y))
    return tf.train.GradientDescentOptimizer(0.1).minimize(loss)


def _grad_w(x, y, w):
    """d mean((x w - y)^2) / dw."""
    return 2.0 * x.T.dot(x.dot(w) - y) / len(x)


def _nodes():
    """{name: NodeDef} of the default graph (the copies' nodes may have no Python op yet:
    ``tf_adapter.deferred``)."""
    return dict((n.name, n) for n in tf.get_default_graph().as_graph_def().node)


def _controls(node):
    return [i[1:] for i in node.input if i.startswith("^")]


def _clone_ops():
    return [n for n in _nodes().values() if n.name.startswith("EPL_REPLICA_")]


# ------------------------------------------------------------------------- the passes

def test_place_originals_puts_each_stage_of_replica_0_on_its_device():
    """Two pipeline stages on 2 devices: stage 0's ops (forward and backward) on device 0,
    stage 1's on device 1; nothing is copied yet."""
    _init(2)
    _two_stages(tf.placeholder(tf.float32, [None, 3], name="x"),
                tf.placeholder(tf.float32, [None, 1], name="y"))
    state = _prepare()
    sel = list(state.selection.ops)
    assert not any(op.device for op in sel)
    assert _run(state, "place_originals") == ["place_originals"]
    s0, s1 = ir.Graph.get().taskgraphs
    for tg, dev in ((s0, "CPU:0"), (s1, "CPU:1")):
        ops = [op for op in tg.ops if op in state.selection]
        assert ops and all(op.device.endswith(dev) for op in ops), \
            [(op.name, op.device) for op in ops if not op.device.endswith(dev)]
        assert any(ir.Graph.get().phase_of(op) == ir.BACKWARD for op in ops)
    g = tf.get_default_graph()
    assert g.get_operation_by_name("h").device.endswith("CPU:0")
    assert g.get_operation_by_name("out").device.endswith("CPU:1")
    assert not _clone_ops()


def test_reinstall_gives_ops_made_after_a_rewrite_the_replaced_tensor():
    """After the first rewrite clone 0 reads its shard of the fed x; a replica op made
    afterwards reads that shard too once reinstall runs, an op outside the replica (a
    fetch) keeps the whole batch."""
    _init(2)
    m = _linear()
    state = _prepare()
    _run(state, "clone_replicas")
    shard0 = m.pred.op.inputs[0]
    assert shard0 is not m.x and shard0.op.type == "Split"
    late = tf.reduce_sum(m.x, axis=0, name="late")       # a replica op, after the rewrite
    epl.set_default_strategy(None)
    outside = tf.identity(m.x, name="outside")     # no scope's (x is no scope's either)
    assert late.op.inputs[0] is m.x
    assert _later(state, "reinstall") == ["place_originals", "reinstall"]
    assert late.op.inputs[0] is shard0
    assert outside.op.inputs[0] is m.x
    with _session(state) as sess:
        got_late, got_outside = sess.run([late, outside], {m.x: X})
    np.testing.assert_allclose(got_late, X[:2].sum(axis=0), rtol=1e-6)
    np.testing.assert_allclose(got_outside, X)


def test_shard_inputs_gives_each_clone_its_slice_of_a_fed_batch_and_its_own_pull():
    _init(2)
    epl.set_default_strategy(epl.replicate(1))
    x = tf.placeholder(tf.float32, [None, 3], name="x")
    ds = tf.data.Dataset.from_tensor_slices(np.arange(8, dtype=np.float32)).batch(2)
    batch = tf.data.make_one_shot_iterator(ds).get_next()
    doubled = tf.multiply(x, 2.0, name="doubled")
    pulled = tf.identity(batch, name="pulled")
    state = _prepare()
    assert _run(state, "shard_inputs") == ["place_originals", "reinstall", "shard_inputs"]
    # Clone 0 (the user's op) reads shard 0; clone 1 will read shard 1.
    shard0 = doubled.op.inputs[0]
    shards = state.copies(shard0)
    assert shard0.op.type == "Split" and shard0.op.name.startswith("EPL_SHARD/x")
    assert shards[1] is shard0.op.outputs[1] and shards[1] is not shard0
    # The iterator's dequeue: clone 1 pulls its own batch from the shared iterator.
    pulls = state.copies(pulled.op.inputs[0])
    assert pulls[0] is batch and pulls[1].op.name == "EPL_REPLICA_1/" + batch.op.name
    assert pulls[1].op.inputs[0] is batch.op.inputs[0]       # the same iterator
    assert [n.op for n in _clone_ops()] == ["IteratorGetNext"]   # nothing else copied
    with _session(state) as sess:
        got = sess.run(shards, {x: X})
        first, second = sess.run(pulls)
    np.testing.assert_allclose(got[0], X[:2])
    np.testing.assert_allclose(got[1], X[2:])
    assert sorted(first.tolist() + second.tolist()) == [0.0, 1.0, 2.0, 3.0]


def test_clone_replicas_copies_the_replica_per_device_and_reduces_its_gradient():
    """Shared variables (one copy per worker, the CPU default): clone 1's copies are named
    EPL_REPLICA_1/... on device 1, the update reads the all-reduced gradient, which is
    the gradient of the whole batch."""
    _init(2)
    m = _linear()
    state = _prepare()
    assert _run(state, "clone_replicas") == ["place_originals", "reinstall", "shard_inputs",
                                             "clone_replicas"]
    assert len(state.selection.ops) > 10       # forward and backward
    for op in state.selection.ops:
        copy = state.op(1, op)
        assert copy.name == "EPL_REPLICA_1/" + op.name, (op.name, copy.name)
        assert copy.device.endswith("CPU:1"), (copy.name, copy.device)
        assert op.device.endswith("CPU:0"), (op.name, op.device)
    assert state.op(1, m.pred.op).inputs[0] is m.pred.op.inputs[0].op.outputs[1]
    update = [op for op in tf.get_default_graph().get_operations()
              if op.type == "ApplyGradientDescent"]
    assert len(update) == 1                        # shared variable: one update
    reduced = update[0].inputs[2]
    grad = ir.Graph.get().apply_records[0].grads_and_vars[0][0]
    # One collective per rank: rank 0 reads clone 0's gradient on device 0, rank 1 the
    # copy's on device 1; the update reads rank 0's result.
    ranks = sorted((op for op in tf.get_default_graph().get_operations()
                    if op.type.startswith("EplAllReduce")), key=lambda op: op.device)
    assert [op.inputs[0] for op in ranks] == state.copies(grad)
    assert [op.device[-5:] for op in ranks] == ["CPU:0", "CPU:1"]
    assert reduced.op is ranks[0]
    ready = [ci for ci in update[0].control_inputs if ci.name.startswith("EPL_GRADIENTS_")]
    assert ready
    with _session(state) as sess:
        sess.run(tf.global_variables_initializer())
        got = sess.run([reduced] + ready, {m.x: X, m.y: Y})[0]
    np.testing.assert_allclose(got, _grad_w(X, Y, W), rtol=1e-5)


def _looped(device=None):
    """out = tanh(tanh(x w)) by a tf.while_loop of two steps (its body's tanh placed on
    ``device``), in the default strategy replicate(1); (x, w, out, the loop's op)."""
    epl.set_default_strategy(epl.replicate(1))
    x = tf.placeholder(tf.float32, [None, 3], name="x")
    w = tf.get_variable("w", initializer=W)

    def body(i, h):
        with tf.device(device) if device else contextlib.nullcontext():
            return i + 1, tf.tanh(h)
    _, out = tf.while_loop(lambda i, h: i < 2, body, [tf.constant(0), tf.matmul(x, w)],
                           name="loop")
    loop = [op for op in tf.get_default_graph().get_operations()
            if op.type in ("While", "StatelessWhile", "Exit")]
    return x, w, out, loop[0]


def _body_devices(graph, names):
    """The devices set on the nodes of the functions ``names`` and those they call."""
    library = {f.signature.name: f for f in graph.as_graph_def().library.function}
    found, stack, seen = [], list(names), set()
    while stack:
        name = stack.pop()
        if name in seen:
            continue
        seen.add(name)
        for n in library[name].node_def:
            found += [n.device] if n.device else []
            stack.extend(v.func.name for v in n.attr.values() if v.HasField("func"))
    return found


def test_place_original_bodies_gives_the_users_loop_bodies_without_devices(v2):  # noqa: F811
    """A v2 loop whose body sets a device (the user's tf.device inside it) has it on the
    body's nodes; after the pass the user's While calls copies without devices (its
    bodies run on the op's own device) and computes what it computed."""
    _init(2)
    x, _, out, loop = _looped("/device:CPU:0")
    assert loop.type in ("While", "StatelessWhile")
    g = tf.get_default_graph()
    called = [n for _, v in functions.function_attrs(loop)
              for n in functions.attr_function_names(v)]
    assert _body_devices(g, called)          # (the pin reached the bodies)
    state = _prepare()
    assert _run(state, "place_original_bodies") == ["place_originals", "place_original_bodies"]
    now = [n for _, v in functions.function_attrs(loop) for n in functions.attr_function_names(v)]
    assert now == [n + "_EPL_CLONE_0" if _body_devices(g, [n]) else n for n in called]
    assert not _body_devices(g, now)
    assert _body_devices(g, called)          # (the user's functions are as they were)
    assert not _clone_ops()
    with _session(state) as sess:
        sess.run(tf.global_variables_initializer())
        got = sess.run(out, {x: X})
    np.testing.assert_allclose(got, np.tanh(np.tanh(X.dot(W))), rtol=1e-5)


def test_copy_loop_contexts_gives_each_clones_loop_a_context_of_its_own():
    """A v1 loop copied for clone 1: after the pass its copy's ops belong to a context of
    their own (named EPL_REPLICA_1/...), in the WHILE_CONTEXT collection like the
    user's; the copy computes the loop on clone 1's rows."""
    _init(2)
    x, _, out, exit_op = _looped()
    assert exit_op.type == "Exit"
    g = tf.get_default_graph()
    users = g.get_collection(tf.GraphKeys.WHILE_CONTEXT)
    state = _prepare()
    before = _run(state, "clone_replicas")
    copy = state.op(1, exit_op)
    assert tfg.control_flow_context(copy) is None
    assert _run(state, "copy_loop_contexts", done=before) == ["copy_loop_contexts"]
    contexts = g.get_collection(tf.GraphKeys.WHILE_CONTEXT)
    assert contexts[:len(users)] == users and len(contexts) == 2 * len(users)
    mine = tfg.control_flow_context(copy)
    assert mine in contexts[len(users):] and mine.name.startswith("EPL_REPLICA_1/")
    assert tfg.control_flow_context(exit_op) in users
    with _session(state) as sess:
        sess.run(tf.global_variables_initializer())
        got = sess.run(state.copies(out)[1], {x: X})
    np.testing.assert_allclose(got, np.tanh(np.tanh(X[2:].dot(W))), rtol=1e-5)


def test_note_copied_calls_lets_a_later_rewrite_refuse_a_loop_changed_since(v2):  # noqa: F811
    """The pass remembers each v2 loop as the clones copied it: a gradient built
    afterwards extends the forward While (its accumulators), which the check of a later
    rewrite refuses by name."""
    _init(2)
    _, w, out, loop = _looped()
    state = _prepare()
    before = _run(state, "clone_replicas")
    assert _run(state, "note_copied_calls", done=before) == ["note_copied_calls"]
    function_bodies.check_calls_unchanged(state)        # (as copied)
    tf.gradients(tf.reduce_sum(out), [w])
    with pytest.raises(RuntimeError, match="the tf.while_loop '%s' changed after the graph "
                                           "was rewritten for 2 clones" % loop.name):
        function_bodies.check_calls_unchanged(state)


W0 = np.array([[1.0, 0.5, -0.5, 0.0], [0.0, 1.0, 0.5, -1.0], [0.5, 0.0, 1.0, 0.5]], np.float32)
W1 = (np.arange(16, dtype=np.float32).reshape(4, 4) - 7.5) / 8.0
W2 = np.array([[1.0], [-0.5], [0.25], [2.0]], np.float32)


def _split_model():
    """replicate -> split -> replicate, all linear: h = x W0 (replicated), g = h W1 (a
    dense layer split over 2 devices: W1's columns in 2 shards), loss = mean((g W2 - y)^2)
    per replica.  2 devices shared by the replicas and the split."""
    _init(2, **{"cluster.colocate_split_and_replicate": True})
    x = tf.placeholder(tf.float32, [None, 3], name="x")
    y = tf.placeholder(tf.float32, [None, 1], name="y")
    epl.set_default_strategy(epl.replicate(1))
    h = tf.layers.dense(x, 4, use_bias=False, name="h",
                        kernel_initializer=tf.constant_initializer(W0))
    with epl.split(2):
        g = tf.layers.dense(h, 4, use_bias=False, name="g",
                            kernel_initializer=tf.constant_initializer(W1))
    out = tf.matmul(g, tf.get_variable("w2", initializer=W2), name="out")
    loss = tf.reduce_mean(tf.square(out - y), name="loss")
    train = tf.train.GradientDescentOptimizer(0.1).minimize(loss)
    return x, y, h, g, out, train


def test_bridge_split_gives_the_split_every_clones_rows_and_each_clone_its_rows_back():
    x, y, h, g, out, _ = _split_model()
    state = _prepare()
    assert state.num_clones == 2
    split_ops = set(op for tg in ir.Graph.get().taskgraphs if tg.kind == "split"
                    for op in tg.ops)
    readers = [op for op in split_ops if h in op.inputs]
    assert readers
    names = _run(state, "bridge_split")
    assert names == ["place_originals", "reinstall", "shard_inputs", "clone_replicas",
                     "bridge_split"]
    # Replica -> split: the split's forward reads the concatenation of both clones' h.
    for op in readers:
        assert h not in op.inputs
    gathered = [t for op in readers for t in op.inputs if t.op.type == "ConcatV2"]
    assert gathered and all(list(t.op.inputs)[:2] == state.copies(h) for t in gathered)
    # Split -> replica: clone c's `out` reads its rows of the split's output.
    outs = state.copies(out)
    scattered = [o.op.inputs[0] for o in outs]
    assert all(t.op.type == "SplitV" and t.value_index == c for c, t in enumerate(scattered))
    whole = X.dot(W0).dot(W1)
    with _session(state) as sess:
        sess.run(tf.global_variables_initializer())
        got_whole, got0, got1 = sess.run([gathered[0].op.outputs[0]] + outs, {x: X})
    np.testing.assert_allclose(got_whole, X.dot(W0), rtol=1e-5)
    np.testing.assert_allclose(got0, whole[:2].dot(W2), rtol=1e-5)
    np.testing.assert_allclose(got1, whole[2:].dot(W2), rtol=1e-5)


def test_scale_split_gradients_divides_the_split_gradients_by_the_replicas():
    """The split's backward sums both replicas' loss gradients; scaled by 1/2 the split
    variables' gradients are those of the mean loss over the whole batch, as the
    replicated variables' averaged gradients are."""
    x, y, h, g, out, _ = _split_model()
    state = _prepare()
    rec = ir.Graph.get().gradient_records[0]
    split_grads = [(gr, v) for gr, v in zip(rec.grads, rec.xs) if "g/kernel" in v.op.name]
    assert len(split_grads) == 2                   # W1's two column shards
    assert _run(state, "scale_split_gradients")[-2:] == ["bridge_split",
                                                          "scale_split_gradients"]
    updates = dict((op.inputs[0].op, op) for op in tf.get_default_graph().get_operations()
                   if op.type == "ApplyGradientDescent")
    for gr, v in split_grads:
        applied = updates[v.op].inputs[2]
        assert applied is not gr and applied.op.type == "Mul" and gr in applied.op.inputs
    # (the full-batch gradient of mean((x W0 W1 W2 - y)^2) with respect to W1)
    hx = X.dot(W0)
    want = 2.0 * hx.T.dot((hx.dot(W1).dot(W2) - Y).dot(W2.T)) / len(X)
    parts = sorted(split_grads, key=lambda p: p[1].op.name)    # part_0, part_1
    with _session(state) as sess:
        sess.run(tf.global_variables_initializer())
        feed = {x: X, y: Y}
        got = sess.run([updates[v.op].inputs[2] for _, v in parts], feed)
        raw = sess.run([gr for gr, _ in parts], feed)
    np.testing.assert_allclose(np.concatenate(got, axis=1), want, rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(np.concatenate(raw, axis=1), 2 * want, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("strategy, orders", [
    ("PreferForward", {0: ["F0", "F1", "B0", "B1"], 1: ["F0", "F1", "B0", "B1"]}),
    ("PreferBackward", {0: ["F0", "F1", "B0", "B1"], 1: ["F0", "B0", "F1", "B1"]}),
])
def test_schedule_pipeline_chains_each_stages_micro_batches_in_order(strategy, orders):
    """2 stages x 2 micro-batches: on each stage, the end of one task (F(m): its forward
    ops of micro-batch m, B(m) backward) is a NoOp that the next task's ops wait for;
    following those edges gives GPipe's or 1F1B's order."""
    from epl.rewrite import schedule
    _init(2, **{"pipeline.num_micro_batch": 2, "pipeline.strategy": strategy})
    x = tf.placeholder(tf.float32, [None, 3], name="x")
    y = tf.placeholder(tf.float32, [None, 1], name="y")
    _two_stages(x, y)
    state = _prepare()
    assert [m for _, m, _ in state.clones] == [0, 1]      # one replica, 2 micro-batches
    assert _run(state, "schedule_pipeline")[-2:] == ["clone_replicas", "schedule_pipeline"]
    path = schedule._training_path(state)
    nodes = _nodes()
    for s in (0, 1):
        tasks = dict(("%s%d" % (k, m), set(op.name for op in schedule.task_ops(
            state, m, s, ir.FORWARD if k == "F" else ir.BACKWARD, path)))
            for k in "FB" for m in (0, 1))
        assert all(tasks.values()) and not set.intersection(*tasks.values())
        ends = [n for n in nodes if n.startswith("EPL_SCHEDULE/r0_s%d_" % s)]
        assert len(ends) == 4
        follows = {}    # task -> the task whose ops wait for its end
        for end in ends:
            waited = set(_controls(nodes[end]))
            done = [t for t, ops in tasks.items() if waited and waited <= ops]
            assert len(done) == 1, (end, waited)
            waiting = set(n for n, node in nodes.items() if end in _controls(node))
            if waiting:
                nxt = [t for t, ops in tasks.items() if waiting <= ops]
                assert len(nxt) == 1, (end, waiting)
                follows[done[0]] = nxt[0]
        chain = [t for t in tasks if t not in follows.values()]
        assert len(chain) == 1
        while chain[-1] in follows:
            chain.append(follows[chain[-1]])
        assert chain == orders[s]


def test_join_clones_makes_the_train_op_run_every_clones_update():
    """Per-device variable copies: the user's update waits for clone 1's; one run of the
    user's train op moves both copies by the averaged (whole-batch) gradient."""
    _init(2, **{"cluster.variable_copies": "per_device"})
    m = _linear()
    state = _prepare()
    update = m.train.control_inputs[0]
    assert update.type == "ApplyGradientDescent"
    before = _run(state, "clone_replicas")
    copy_name = state.op_name(1, update)
    assert copy_name.startswith("EPL_REPLICA_1/") and copy_name not in _controls(
        _nodes()[update.name])
    assert _run(state, "join_clones", done=before) == ["join_clones"]
    assert copy_name in _controls(_nodes()[update.name])
    w1 = state.tensor(1, m.w.op.outputs[0])
    assert w1.op.name == "EPL_REPLICA_1/w"
    init_copy = tf.assign(w1, W)     # (mirror_writes' twin of the initializer, by hand)
    with _session(state) as sess:
        sess.run([tf.global_variables_initializer(), init_copy])
        sess.run(m.train, {m.x: X, m.y: Y})
        got0, got1 = sess.run([m.w.op.outputs[0], w1])
    want = W - 0.1 * _grad_w(X, Y, W)
    np.testing.assert_allclose(got0, want, rtol=1e-5)
    np.testing.assert_allclose(got1, want, rtol=1e-5)


@pytest.mark.parametrize("copies", ["per_device", "per_worker"])
def test_join_metric_updates_runs_every_clones_addition_before_the_users(copies):
    """A streaming mean's state is one copy; the user's additions wait for clone 1's, so
    one run of the update op counts both clones' rows and returns the whole batch's mean."""
    _init(2, **{"cluster.variable_copies": copies})
    m = _linear()
    with tf.variable_scope("", reuse=tf.AUTO_REUSE):
        value, update = tf.metrics.mean(tf.square(m.pred - m.y))
    state = _prepare()
    adds = [op for op in state.selection.updates.summed_writes]
    assert sorted(op.type for op in adds) == ["AssignAdd", "AssignAdd"]
    assert all(op.inputs[0].op in state.selection.shared for op in adds)   # one copy
    before = _run(state, "clone_replicas")
    assert _run(state, "join_metric_updates", done=before) == ["join_metric_updates"]
    for op in adds:
        assert state.op_name(1, op) in _controls(_nodes()[op.name])
    w1 = state.tensor(1, m.w.op.outputs[0])
    init_copy = tf.assign(w1, W) if copies == "per_device" else tf.no_op()
    with _session(state) as sess:
        sess.run([tf.global_variables_initializer(), tf.local_variables_initializer()])
        sess.run(init_copy)    # (mirror_writes' twin of the initializer, by hand)
        got = sess.run(update, {m.x: X, m.y: Y})
        got_value = sess.run(value)
    want = np.mean((X.dot(W) - Y) ** 2)
    np.testing.assert_allclose([got, got_value], [want, want], rtol=1e-5)


def test_order_micro_batch_state_updates_a_replicas_state_one_micro_batch_after_the_other():
    """A moving mean (a resource variable each replica keeps, written from the batch by a
    read-modify-write): micro-batch 1's read waits for micro-batch 0's write, so one run
    applies both micro-batches' updates in turn (unordered, both read the old value and
    one update is lost)."""
    _init(1, **{"pipeline.num_micro_batch": 2})
    x = tf.placeholder(tf.float32, [None, 3], name="x")
    y = tf.placeholder(tf.float32, [None, 1], name="y")
    epl.set_default_strategy(epl.replicate(1))
    w = tf.get_variable("w", initializer=W)
    pred = tf.matmul(x, w, name="pred")
    mean = tf.get_variable("stats/mean", initializer=np.zeros([1], np.float32),
                           trainable=False, use_resource=True)
    value = mean.read_value()
    read = value.op if value.op.type == "ReadVariableOp" else value.op.inputs[0].op
    assert read.type == "ReadVariableOp"
    update = mean.assign_sub((value - tf.reduce_mean(pred, axis=0)) * 0.5)
    with tf.control_dependencies([update]):     # (as batch norm's UPDATE_OPS)
        train = tf.train.GradientDescentOptimizer(0.1).minimize(
            tf.reduce_mean(tf.square(pred - y)))
    state = _prepare()
    assert mean.op in state.selection.updates.local_variables
    before = _run(state, "clone_replicas")
    assert _run(state, "order_micro_batch_state", done=before) == ["order_micro_batch_state"]
    _run(state, "join_clones", done=before)      # (the user's update runs micro-batch 1's)
    read1 = _nodes()[state.op_name(1, read)]
    assert read1.name.startswith("EPL_REPLICA_1/") and update.op.name in _controls(read1)
    with _session(state) as sess:
        sess.run(tf.global_variables_initializer())
        sess.run(train, {x: X, y: Y})
        got = sess.run(mean.read_value())
    want = np.zeros([1], np.float32)
    for rows in (slice(0, 2), slice(2, 4)):      # micro-batch 0, then micro-batch 1
        want = want - (want - X[rows].dot(W).mean(axis=0)) * 0.5
    np.testing.assert_allclose(got, want, rtol=1e-5)


def test_order_global_step_makes_the_advance_wait_for_its_readers_not_a_savers_save():
    """BERT's hand-written step: tf.group(update, global_step.assign_add(1)) with a
    learning rate read from the step.  The advance waits for the rate's read of the step,
    not for the Saver's read (a resource step: the Saver reads its value; a ref one it
    saves the variable itself), and a write that sets the step without reading it waits
    for nothing."""
    _init(2)
    x = tf.placeholder(tf.float32, [None, 3], name="x")
    y = tf.placeholder(tf.float32, [None, 1], name="y")
    epl.set_default_strategy(epl.replicate(1))
    with tf.variable_scope("", use_resource=True):
        step = tf.train.get_or_create_global_step()
    lr = tf.math.truediv(0.1, 1.0 + tf.cast(step, tf.float32), name="lr")
    w = tf.get_variable("w", initializer=W)
    loss = tf.reduce_mean(tf.square(tf.matmul(x, w) - y))
    advance = tf.assign_add(step, 1, name="advance").op
    train = tf.group(tf.train.GradientDescentOptimizer(lr).minimize(loss), advance)
    reset = tf.assign(step, 0, name="reset").op
    tf.train.Saver()
    readers = set(c for r in step.handle.consumers() if r.type == "ReadVariableOp"
                  for c in r.outputs[0].consumers())
    cast = [r for r in readers if r.type == "Cast"]
    saver = [r for r in readers if r.name.startswith("save/")]
    assert cast and saver, readers      # (the rate and the Saver read the step's value)
    state = _prepare()
    before = _run(state, "join_clones")
    assert before == ["place_originals", "reinstall", "shard_inputs", "clone_replicas",
                      "join_clones"]
    assert advance.control_inputs == [] and reset.control_inputs == []
    assert _run(state, "order_global_step", done=before) == ["order_global_step"]
    assert advance.control_inputs == cast
    assert reset.control_inputs == []
    with _session(state) as sess:
        sess.run(tf.global_variables_initializer())
        for i in range(3):
            got, _ = sess.run([lr, train], {x: X, y: Y})
            assert got == pytest.approx(0.1 / (1 + i))      # read before the advance
        assert sess.run(step) == 3


def _worker_graph(index, initial, workers=2):
    """Worker ``index`` of a job of ``workers`` workers (2 devices each): its graph
    rewritten up to broadcast_initial_values.  Returns (state, w, the passes that ran)."""
    from epl.core.cluster import Cluster
    hosts = ["localhost:%d" % (2222 + i) for i in range(workers)]
    cluster = Cluster(Env.get().config, visible_gpus=0, tf_config={
        "cluster": {"worker": hosts}, "task": {"type": "worker", "index": index}}
        if workers > 1 else {})
    g = tf.Graph()
    with g.as_default():
        x = tf.placeholder(tf.float32, [None, 3], name="x")
        y = tf.placeholder(tf.float32, [None, 1], name="y")
        w = tf.get_variable("w", initializer=initial)
        loss = tf.reduce_mean(tf.square(tf.matmul(x, w) - y))
        tf.train.GradientDescentOptimizer(0.1).minimize(loss)
        state = _prepare(cluster)
        assert state.num_clones == 2 and not state.in_graph
        names = _run(state, "broadcast_initial_values")
    return state, w, names


def test_broadcast_initial_values_initializes_every_worker_from_worker_0(monkeypatch):
    """Between-graph, 2 workers: each worker's initializer of w writes the value worker
    0's initial value broadcasts (one collective, the same group in both workers' graphs,
    this worker's rank), not its own; a one-worker job keeps its own initial value.

    (Structure only: two ranks of one cross-process collective cannot run in one process,
    their ops queue behind each other; the multi-worker tests run it.)"""
    from epl.communicators import op_library
    if not op_library.available():
        pytest.skip("needs EPL's C++ op library: %s" % op_library.missing_reason())
    monkeypatch.setenv("EPL_JOB_ID", "test_passes_" + uuid.uuid4().hex[:12])
    _init(2)
    epl.set_default_strategy(epl.replicate(1))
    groups = []
    for i in (0, 1):
        _, w, names = _worker_graph(i, W * (1 + 10 * i))
        assert names[-1] == "broadcast_initial_values" and "mirror_writes" not in names
        value = w.initializer.inputs[1]
        assert value.op.type != "Const"
        bcast = value.op
        while bcast.type == "Identity":       # (handed to this worker's device)
            bcast = bcast.inputs[0].op
        assert bcast.type == "EplBroadcast", bcast.type
        assert (bcast.get_attr("rank"), bcast.get_attr("size"), bcast.get_attr("root")) == (
            i, 2, 0)
        own = bcast.inputs[0].op       # this worker's initial value goes in
        assert own.type == "Const" and np.allclose(tf.make_ndarray(own.get_attr("value")),
                                                   W * (1 + 10 * i))
        assert bcast.device.endswith("CPU:0")
        groups.append(bcast.get_attr("group"))
    assert groups[0] == groups[1]
    _, w, _ = _worker_graph(0, W, workers=1)
    assert w.initializer.inputs[1].op.type == "Const"


def test_mirror_writes_gives_the_initializer_and_a_restore_a_twin_for_each_copy(tmp_path):
    """Per-device copies: w's initializer and a Saver's restore of w (writes outside the
    replica) also write clone 1's copy, on device 1."""
    path = str(tmp_path / "ckpt")
    with tf.Graph().as_default():          # a checkpoint holding w = 3 W
        v = tf.get_variable("w", initializer=3.0 * W)
        with tf.Session() as sess:
            sess.run(v.initializer)
            tf.train.Saver([v]).save(sess, path)
    _init(2, **{"cluster.variable_copies": "per_device"})
    m = _linear(epl.replicate(1))
    saver = tf.train.Saver([m.w])
    restore = [op for op in tf.get_default_graph().get_operations()
               if op.type == "Assign" and op.name.startswith("save/")]
    assert len(restore) == 1
    state = _prepare()
    assert restore[0] not in state.selection and m.w.initializer not in state.selection
    before = _run(state, "broadcast_initial_values")
    copy = state.tensor(1, m.w.op.outputs[0])
    assert copy.op.name == "EPL_REPLICA_1/w"
    writes = (m.w.initializer, restore[0])
    assert not any(write.control_inputs for write in writes)
    assert _run(state, "mirror_writes", done=before) == ["mirror_writes"]
    for write in writes:
        twins = [ci for ci in write.control_inputs if ci.type == "Assign"]
        assert len(twins) == 1 and twins[0].name == "EPL_REPLICA_1/" + write.name
        assert twins[0].inputs[0] is copy and twins[0].inputs[1] is write.inputs[1]
        assert twins[0].device.endswith("CPU:1")
    with _session(state) as sess:
        sess.run(tf.global_variables_initializer())
        np.testing.assert_allclose(sess.run(copy), W)
        saver.restore(sess, path)
        np.testing.assert_allclose(sess.run(copy), 3.0 * W)


def test_merge_outputs_merges_the_clones_values_of_graphkeys_tensors():
    """Fetching a tensor of epl.GraphKeys returns its merge over both clones: the
    per-row predictions concatenated, the loss averaged, a count summed."""
    _init(2)
    m = _linear()
    rows = tf.reduce_sum(tf.ones_like(m.pred), name="rows")
    epl.add_to_collection(m.pred, epl.GraphKeys.LOCAL_CONCAT_OBJECTS)
    epl.add_to_collection(m.loss, epl.GraphKeys.LOCAL_MEAN_OBJECTS)
    epl.add_to_collection(rows, epl.GraphKeys.GLOBAL_SUM_OBJECTS)
    state = _prepare()
    names = _run(state, "merge_outputs")
    assert names[-2:] == ["clone_replicas", "merge_outputs"]
    merged = state.merged
    assert sorted(merged) == sorted(t.name for t in (m.pred, m.loss, rows))
    for t, kind in ((m.pred, "ConcatV2"), (m.loss, "RealDiv"), (rows, "AddN")):
        assert merged[t.name].op.type == kind and merged[t.name].op.name.startswith(
            "EPL_MERGED/")
    assert list(merged[m.pred.name].op.inputs)[:2] == state.copies(m.pred)
    with _session(state) as sess:
        sess.run(tf.global_variables_initializer())
        got_pred, got_loss, got_rows = sess.run([m.pred, m.loss, rows], {m.x: X, m.y: Y})
        alone = sess.run(state.copies(m.loss)[1], {m.x: X, m.y: Y})   # (not merged)
    np.testing.assert_allclose(got_pred, X.dot(W), rtol=1e-5)
    np.testing.assert_allclose(got_loss, np.mean((X.dot(W) - Y) ** 2), rtol=1e-5)
    np.testing.assert_allclose(alone, np.mean((X[2:].dot(W) - Y[2:]) ** 2), rtol=1e-5)
    assert got_rows == 4.0


def test_every_pass_of_the_pipeline_has_its_own_test_here():
    """A pass added to ``rewrite.PASSES`` gets a test in this file named after it
    (``test_<pass name>_...``), run alone on a small graph like the ones above."""
    tested = set(name for name in globals() if name.startswith("test_"))
    missing = [p for p in PASSES.names()
               if not any(t.startswith("test_%s_" % p) for t in tested)]
    assert not missing, "passes without a test of their own in tests/test_passes.py: %s" % missing
    assert len(tested) >= len(PASSES.names()) > 0
