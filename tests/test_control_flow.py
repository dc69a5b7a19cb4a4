"""TF1 control flow in every strategy (issue 11), in both control-flow modes.

Each program of ``tests/corpus/control_flow.py`` (dynamic_rnn, a bidirectional RNN,
tf.scan / tf.map_fn, tf.cond with dropout and batch norm, a nested tf.while_loop,
an ExponentialMovingAverage) trains under EPL and without it; the oracle is the
program without EPL on one device with the global batch, compared at 1e-5.

Every test runs in control flow v1 (``Enter`` / ``Switch`` / ``Merge`` ... and ref
variables: ``disable_v2_behavior``, the suite's default) and v2 (one ``While`` / ``If``
op per loop or condition, bodies in the graph's function library, resource variables:
what TF 2.x's ``disable_eager_execution()`` alone gives; TF 1.15 has the same switch).
"""
import os

import numpy as np
import pytest
import tensorflow.compat.v1 as tf

import epl
from epl.tf_adapter.version import IS_TF2
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
    # every device its own variable copies (the GPU default): the loops capture them
    "dp2_per_device": (2, 2, {"cluster.variable_copies": "per_device"}, "default"),
    # 1F1B over 4 micro-batches: stage 0 runs forwards ahead of backwards
    "pipeline2_1f1b": (2, 4, {"pipeline.num_micro_batch": 4,
                              "pipeline.strategy": "PreferBackward"}, "stages"),
}


@pytest.fixture(params=["v1", "v2"])
def cf_mode(request):
    """The control-flow mode of the test: v1 (``disable_v2_behavior``: Switch/Merge/
    Enter/Exit, ref variables; the suite's default) or v2 (what ``disable_eager_execution``
    alone gives on TF 2.x: functional While/If whose bodies are in the graph's function
    library, resource variables).  Switched on for the test and back.  TF 1.15 has the
    same two switches (``tf.compat.v1.enable_control_flow_v2``), and runs both modes."""
    if request.param == "v2":
        tf.enable_control_flow_v2()
        tf.enable_resource_variables()
    try:
        yield request.param
    finally:
        if request.param == "v2":
            tf.disable_control_flow_v2()
            tf.disable_resource_variables()


def _batches(rows, total=None):
    x, y = cf.data(total or STEPS * rows)
    ds = tf.data.Dataset.from_tensor_slices((x, y)).batch(rows, drop_remainder=True)
    return tf.data.make_one_shot_iterator(ds).get_next()


V1_OPS = frozenset(["Enter", "Exit", "Switch", "Merge", "NextIteration", "LoopCond"])
V2_OPS = frozenset(["While", "StatelessWhile", "If", "StatelessIf"])


def _mode_of(graph):
    """Which control flow ``graph`` was built with ('v1', 'v2'), from its op types."""
    types = set(op.type for op in graph.get_operations())
    assert not (types & V1_OPS and types & V2_OPS), sorted(types & (V1_OPS | V2_OPS))
    return "v2" if types & V2_OPS else "v1" if types & V1_OPS else None


def _run(name, layout, tmpdir):
    """Train ``name`` for STEPS steps; its variables (from a checkpoint).  The control
    flow the graph was built with is left in ``_run.mode``."""
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
    _run.mode = _mode_of(tf.get_default_graph())
    reader = tf.train.load_checkpoint(path)
    return {k: reader.get_tensor(k) for k in reader.get_variable_to_shape_map()}


@pytest.mark.parametrize("layout", sorted(LAYOUTS))
@pytest.mark.parametrize("name", cf.MODELS)
def test_control_flow_program(name, layout, tmpdir, cf_mode):
    _run.layout = layout
    want = _run(name, None, tmpdir)
    got = _run(name, layout, tmpdir)
    assert _run.mode == cf_mode
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


def test_fed_flag_reaches_every_replica(tmpdir, cf_mode):
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


def test_stage_boundary_inside_a_loop_is_refused(cf_mode):
    """The program is valid TensorFlow (without EPL it trains), but a loop cannot cross a
    stage boundary: EPL refuses it with the loop's and the stages' names, and keeps
    refusing it (the half-rewritten graph never runs).  (v2: the loop is one op, which
    would run its whole body on one stage, silently ignoring the boundary.)"""
    before, after = _train_loop_program(_loop_across_stages(True, pipeline=False))
    assert not np.allclose(before["w"], after["w"], atol=1e-4)
    op = _loop_across_stages(boundary_inside=True)
    refusal = r"tf.while_loop 'mixed_loop' spans pipeline stages .*stage_0.*stage_1"
    with tf.Session() as sess:
        with pytest.raises(ValueError, match=refusal):
            sess.run(tf.global_variables_initializer())
        with pytest.raises(ValueError, match=refusal):
            sess.run(op)


def test_loop_inside_one_stage_trains_like_the_program_without_epl(cf_mode):
    """A loop inside stage 0 of a 2-stage pipeline with 2 micro-batches equals the same
    program without EPL on one device with the global batch."""
    before, want = _train_loop_program(_loop_across_stages(False, pipeline=False))
    _, got = _train_loop_program(_loop_across_stages(False))
    assert sorted(got) == sorted(want) == ["dense/bias", "dense/kernel", "w"]
    for k in want:
        np.testing.assert_allclose(got[k], want[k], rtol=1e-5, atol=1e-6, err_msg=k)
    assert not np.allclose(want["w"], before["w"], atol=1e-4)


def _calls(graph):
    """{op name: [function names]} of the v2 loops and conditions of ``graph``."""
    out = {}
    for op in graph.get_operations():
        if op.type in V2_OPS:
            attrs = ("cond", "body") if op.type.endswith("While") else ("then_branch",
                                                                      "else_branch")
            out[op.name] = [op.get_attr(a).name for a in attrs]
    return out


@pytest.mark.parametrize("name", ["lstm", "cond"])
def test_rewritten_graph_exports_and_reimports(tmpdir, cf_mode, name):
    """export_meta_graph of a rewritten graph with loops and conditions re-imports, and
    the imported graph trains like the original.  v1: every clone's contexts are in the
    collections; v2: every clone's loops and conditions are in the graph, with the
    functions they call in its library."""
    models.reset()
    models.init_data_parallel(2)
    px = tf.placeholder(tf.float32, [None, cf.T, cf.F], name="px")
    py = tf.placeholder(tf.int64, [None], name="py")
    loss = cf.model(name, px, py)
    op = cf.train_op(name, loss)
    x, y = cf.data(2 * B)
    with tf.Session() as sess:
        sess.run(tf.global_variables_initializer())
        sess.run(op, {px: x, py: y})      # rewrites
        g = tf.get_default_graph()
        assert _mode_of(g) == cf_mode
        keys = (tf.GraphKeys.WHILE_CONTEXT, tf.GraphKeys.COND_CONTEXT)
        contexts = sorted(c.name for k in keys for c in g.get_collection(k))
        if cf_mode == "v1":
            originals = [c for c in contexts if not c.startswith("EPL_REPLICA_")]
            assert originals and contexts == sorted(
                originals + ["EPL_REPLICA_1/" + c for c in originals])
            if name == "lstm":
                frames = set(o.get_attr("frame_name") for o in g.get_operations()
                             if o.type == "Enter")
                assert b"EPL_REPLICA_1/rnn/while/while_context" in frames
        else:
            assert contexts == []
            calls = _calls(g)
            originals = [c for c in calls if not c.startswith("EPL_REPLICA_")]
            assert originals and sorted(calls) == sorted(
                originals + ["EPL_REPLICA_1/" + c for c in originals])
            library = set(f.signature.name for f in g.as_graph_def().library.function)
            assert set(f for fs in calls.values() for f in fs) <= library
        path = os.path.join(str(tmpdir), "model")
        tf.train.Saver().save(sess, path)
        meta = tf.train.export_meta_graph(os.path.join(str(tmpdir), "rewritten.meta"))
        want_loss = sess.run(loss, {px: x, py: y})
        sess.run(op, {px: x, py: y})
        want_after = sess.run(loss, {px: x, py: y})
    models.reset()    # a plain graph, EPL not initialized: the imported graph runs as is
    with tf.Graph().as_default() as g2:
        saver = tf.train.import_meta_graph(meta)
        assert len([c for k in keys for c in g2.get_collection(k)]) == len(contexts)
        if cf_mode == "v2":
            assert sorted(_calls(g2)) == sorted(calls)
        cfg = tf.ConfigProto(device_count={"CPU": 2})
        with tf.Session(config=cfg) as sess:
            # (per-replica state -- batch norm's moving statistics, which the condition
            # writes from each replica's batch -- is not in the checkpoint, which holds
            # replica 0's: the initializers start every replica's copy, then the restore)
            sess.run(tf.global_variables_initializer())
            saver.restore(sess, path)
            feed = {"px:0": x, "py:0": y}
            np.testing.assert_allclose(sess.run(loss.name, feed), want_loss, rtol=1e-6)
            sess.run(op.name, feed)
            np.testing.assert_allclose(sess.run(loss.name, feed), want_after, rtol=1e-5)


def _seeded_dropout(layout):
    """tf.cond(flag) around a dropout with a fixed seed (and a graph seed) on a batch
    of ones; the masks of replica 0 and, under EPL, of replica 1 after one step."""
    models.reset()
    if layout:
        models.init_data_parallel(2)
    tf.set_random_seed(5)
    x, _ = _batches(B, 2 * B)
    flag = cf.is_training()
    ones = tf.ones_like(tf.reshape(x, [-1, cf.T * cf.F]))
    out = tf.cond(flag, lambda: tf.nn.dropout(ones, rate=0.5, seed=7), lambda: ones)
    total = tf.reduce_sum(out)
    with tf.Session() as sess:
        sess.run(total)     # (EPL: rewrites; both: the second draw is compared)
        fetch = [out]
        if layout:
            fetch.append(tf.get_default_graph().get_tensor_by_name("EPL_REPLICA_1/" + out.name))
        return sess.run(fetch)


def test_seeded_random_op_in_a_condition_gets_each_replica_its_own_stream(cf_mode):
    """A dropout with a fixed seed inside tf.cond: replica 0 draws the program's mask,
    replica 1 a mask of its own (v2: its copy of the branch has the clone's seed; with
    the same seeds both replicas would drop the same units)."""
    want, = _seeded_dropout(None)
    got0, got1 = _seeded_dropout("dp2")
    np.testing.assert_array_equal(got0, want)
    assert set(np.unique(got1)) <= {0.0, 2.0} and 0 < np.mean(got1 == 0) < 1
    assert not np.array_equal(got0, got1)


def test_loop_writing_a_trainable_variable_from_the_batch_is_refused(cf_mode):
    """A loop body that adds the batch to a trainable variable (not through a gradient)
    would make the replicas' weights diverge: refused before the first step, naming the
    loop's write (v2: the While op, whose body writes the variable it captured)."""
    models.reset()
    models.init_data_parallel(2)
    x, y = _batches(B, 2 * B)
    loss = cf.model("nested", x, y)
    w = [v for v in tf.trainable_variables() if v.op.name == "nested_w"][0]

    def body(t):
        with tf.control_dependencies([tf.assign_add(w, tf.fill([cf.H, cf.H],
                                                               tf.reduce_mean(x)))]):
            return t + 1
    done = tf.while_loop(lambda t: t < 2, body, [0], name="hand_loop")
    op = tf.group(cf.train_op("nested", loss), done)
    with tf.Session() as sess:
        with pytest.raises(NotImplementedError,
                           match=r"'hand_loop.*writes the trainable variable 'nested_w'"):
            sess.run(tf.global_variables_initializer())
        with pytest.raises(NotImplementedError, match="nested_w"):
            sess.run(op)


@pytest.mark.parametrize("cf_mode", ["v2"], indirect=True)
def test_v2_clones_call_their_own_bodies_and_loop_accumulators(cf_mode, tmpdir):
    """Control flow v2 under a 2-stage pipeline of 2 micro-batches and DP x2: a clone's
    condition calls copies of its branches whose colocation groups name the clone (one
    group string for two replicas' inlined branches would tie them to one device);
    a loop's gradient accumulators (the lists its forward While takes as extra inputs)
    are copied per clone and placed on the loop's stage, not shared unplaced; a clone's
    loop that captures a variable all clones share (one copy per worker on CPU) runs
    on the clone's device, not the variable's (TF 2.x; TF 1.15 requires the
    variable's)."""
    for layout, name in (("dp2", "cond"), ("pipeline2", "lstm"), ("dp2", "scan")):
        _run.layout = layout
        _run(name, layout, tmpdir)
        g = tf.get_default_graph()
        ops = {op.name: op for op in g.get_operations()}
        if name == "cond":
            user = ops["bn/cond_2"]
            clone = ops["EPL_REPLICA_1/bn/cond_2"]
            branch = clone.get_attr("then_branch").name
            assert branch != user.get_attr("then_branch").name
            fdef = [f for f in g.as_graph_def().library.function
                    if f.signature.name == branch][0]
            groups = [s for n in fdef.node_def if "_class" in n.attr
                      for s in n.attr["_class"].list.s]
            assert groups and all(s.startswith(b"loc:@EPL_REPLICA_1/") for s in groups)
        elif name == "scan":
            shared = ops["scan_w"]
            copy = ops["EPL_REPLICA_1/scan/while"]
            assert "EPL_REPLICA_1/scan_w" not in ops
            assert any(t.op is shared for t in copy.inputs)
            assert shared.device.endswith("CPU:0")
            # (TF 1.15 lowers the loop into nodes that must stay with the variable)
            assert copy.device.endswith("CPU:1" if IS_TF2 else "CPU:0")
        else:
            loop = ops["rnn/while"]
            lists = [t.op for t in loop.inputs if t.op.type == "EmptyTensorList"]
            assert lists
            stage1 = loop.device
            assert stage1 and all(op.device == stage1 for op in lists)
            copy = ops["EPL_REPLICA_1/rnn/while"]
            copied = [t.op for t in copy.inputs if t.op.type == "EmptyTensorList"]
            assert len(copied) == len(lists)
            assert all(op.name.startswith("EPL_REPLICA_1/") and op.device == stage1
                       for op in copied)


def _train_on_cpu0(name, layout):
    """``name`` built inside ``tf.device('/device:CPU:0')`` (a user's pin, which v2
    writes into the bodies' nodes), trained STEPS steps; (trainable variables, graph)."""
    models.reset()
    if layout:
        models.init_data_parallel(2)
    x, y = _batches(B * (1 if layout else 2), STEPS * 2 * B)
    with tf.device("/device:CPU:0"):
        loss = cf.model(name, x, y)
    op = cf.train_op(name, loss)
    with tf.Session() as sess:
        sess.run(tf.global_variables_initializer())
        for _ in range(STEPS):
            sess.run(op)
        return {v.op.name: sess.run(v) for v in tf.trainable_variables()}, sess.graph


@pytest.mark.parametrize("cf_mode", ["v2"], indirect=True)
def test_devices_inside_v2_bodies_follow_the_call_op(cf_mode):
    """A loop built under the user's ``tf.device`` has that device on every node of its
    bodies, which would pin every replica's inlined body to it: each clone (the user's
    op too) calls bodies without devices, which run on its own device; the numbers
    are the program's."""
    want, plain = _train_on_cpu0("nested", None)
    bodies = [f for f in plain.as_graph_def().library.function
              if any(n.device for n in f.node_def)]
    assert bodies     # (the pin reached the bodies)
    got, g = _train_on_cpu0("nested", "dp2")
    for k in want:
        np.testing.assert_allclose(got[k], want[k], rtol=1e-5, atol=1e-6, err_msg=k)
    library = {f.signature.name: f for f in g.as_graph_def().library.function}
    called, stack = set(), [f for fs in _calls(g).values() for f in fs]
    while stack:
        name = stack.pop()
        if name in called:
            continue
        called.add(name)
        for n in library[name].node_def:
            assert not n.device, (name, n.name, n.device)
            stack.extend(v.func.name for v in n.attr.values() if v.HasField("func"))
    assert any(n.startswith("EPL_REPLICA_1/") for n in _calls(g))


def test_gradient_of_a_loop_built_after_the_first_run_is_refused(cf_mode):
    """The loop ran (and was copied) before its gradient was built: the gradient changes
    the loop (v2: TensorFlow adds outputs to the forward While; v1: ops inside its
    frame), which the clones' copies would lack.  Refused by name before the step."""
    models.reset()
    models.init_data_parallel(2)
    x, y = _batches(B, 10 * B)
    loss = cf.model("nested", x, y)
    with tf.Session() as sess:
        sess.run(tf.global_variables_initializer())
        sess.run(loss)
        op = tf.train.GradientDescentOptimizer(0.1).minimize(loss)
        with pytest.raises(RuntimeError, match="while.* after the graph was rewritten for 2 "
                                               "clones"):
            sess.run(op)


def _penalized(layout):
    """``nested`` plus a penalty linear in the gradient of its loss (through the loop's
    gradient: a second-order While), inside a tf.cond; trainable variables after
    STEPS steps.  Linear in the gradient, so DP's mean of the replicas' penalties is
    the global batch's."""
    models.reset()
    if layout:
        models.init_data_parallel(2)
    x, y = _batches(B * (1 if layout else 2), STEPS * 2 * B)
    loss = cf.model("nested", x, y)
    kernel = [v for v in tf.trainable_variables() if v.op.name == "proj/kernel"][0]
    g, = tf.gradients(loss, [kernel])
    penalty = tf.cond(cf.is_training(), lambda: tf.reduce_sum(g * tf.sin(kernel)),
                      lambda: tf.constant(0.0))
    opt = tf.train.GradientDescentOptimizer(0.1)
    grads = opt.compute_gradients(loss + 0.1 * penalty)
    with tf.control_dependencies([d for d, _ in grads]):
        op = opt.apply_gradients(grads)
    _, after = _train_loop_program(op)
    return after


@pytest.mark.parametrize("cf_mode", ["v2"], indirect=True)
def test_gradient_penalty_through_a_v2_loop(cf_mode):
    """A gradient of a loop's gradient (TF's v2 loops have one; v1 refuses second-order
    loop gradients) in a condition, under DP x2: equals the program without EPL."""
    if not IS_TF2:
        pytest.skip("TF 1.15 has no second derivative of "
                    "sparse_softmax_cross_entropy_with_logits")
    want, got = _penalized(None), _penalized("dp2")
    for k in want:
        np.testing.assert_allclose(got[k], want[k], rtol=1e-5, atol=1e-6, err_msg=k)
