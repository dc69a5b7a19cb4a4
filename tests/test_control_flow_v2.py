"""Control flow v2 with the features that change a program's graph (issue 33 item 6).

TF 2.x after ``tf.compat.v1.disable_eager_execution()`` alone (no
``disable_v2_behavior()``) builds loops and conditions as one ``While`` /
``StatelessWhile`` / ``If`` op whose bodies are functions of the graph's library,
makes resource variables, and has v2 shapes and tensor equality (a tensor of a
function body cannot be a dict key).  TF 1.15 gets the same loops from
``enable_control_flow_v2()`` with resource variables.  The ``v2`` fixture switches
the line's mode on for the test and back (the suite runs ``disable_v2_behavior``).

Each case equals the program without EPL (losses per step and the weights after the
last, 1e-5), or is refused by name before the first step:

* a ``split`` scope (tensor model parallelism) inside a loop body, and one wrapping a
  loop;
* gradient checkpointing (``collection`` and ``auto``) around a loop, under data
  parallelism, gradient accumulation and a 2-stage pipeline;
* AMP O1 with a loop: the oracle is the same mixed-precision program written by hand
  (products outside the loop in float16, the loop's own in float32, like a v1 loop's);
* 2 worker processes (data parallel) training a loop (``mw_control_flow_v2.py``).

The batches come from a ``tf.data`` iterator: each replica pulls its own, and the
mean of the replicas' gradients is the global batch's whatever order they pull in.
"""
import contextlib
import os
import warnings

import numpy as np
import pytest
import tensorflow.compat.v1 as tf

import epl
from epl.tf_adapter.version import IS_TF2
from tests import models
from tests import mw_control_flow_v2 as mw
from tests.test_multi_worker import HERE, launch   # (imports mw_train: TF1 switches, as
#                                                     conftest; before any test runs)

F, H, C, T, STEPS, B = 4, 6, 3, 3, 3, 4
LOOP_OPS = frozenset(["While", "StatelessWhile"])
W0 = (np.random.RandomState(7).randn(H, H) * 0.4).astype(np.float32)


# What TF 2.x's ``disable_eager_execution()`` alone leaves on, switched one by one (in a
# process that ran ``disable_v2_behavior``, ``enable_v2_behavior`` would push an eager
# context that a later ``disable_eager_execution`` does not pop: variables made inside a
# loop body would then be made eagerly).  TF 1.15: the loops and the variables.
_V2_SWITCHES = (("control_flow_v2", "enable_control_flow_v2", "disable_control_flow_v2"),
                ("resource_variables", "enable_resource_variables",
                 "disable_resource_variables"))
if IS_TF2:
    _V2_SWITCHES += (("tensorshape", "enable_v2_tensorshape", "disable_v2_tensorshape"),
                     ("tensor_equality", "enable_tensor_equality",
                      "disable_tensor_equality"))


@pytest.fixture
def v2():
    """This line's control flow v2 mode, for the test and back (see the module doc)."""
    for _, on, _ in _V2_SWITCHES:
        getattr(tf, on)()
    try:
        yield
    finally:
        for _, _, off in _V2_SWITCHES:
            getattr(tf, off)()


def data(rows, seed=0):
    rng = np.random.RandomState(seed)
    x = rng.randn(rows, F).astype(np.float32)
    y = (np.abs(x[:, 0] * 3).astype(np.int64)) % C
    return x, y


def _batches(rows, total):
    x, y = data(total)
    ds = tf.data.Dataset.from_tensor_slices((x, y)).batch(rows, drop_remainder=True)
    return tf.data.make_one_shot_iterator(ds).get_next()


def _init(seed):
    return tf.glorot_uniform_initializer(seed=seed)


def dense(x, units, name, seed, activation=None):
    return tf.keras.layers.Dense(units, activation=activation, name=name,
                                 kernel_initializer=_init(seed))(x)


def body_dense(s):
    """A dense layer made inside a loop's body: ``tf.layers.dense`` (a keras layer
    called inside a v2 body of TF 2.x's graph mode makes its variables eagerly, which
    the graph cannot capture: plain TensorFlow fails)."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")     # (tf.layers is deprecated on TF 2.x)
        return tf.layers.dense(s, H, name="sd", kernel_initializer=_init(6))


def loop(h, body_layer=None, stateless=False, name="loop"):
    """T steps of ``s <- tanh(s w)`` (plus ``body_layer(s)`` when given: a dense layer
    made inside the body).  ``stateless``: the body reads ``w``'s value captured from
    outside (a ``StatelessWhile`` on TF 2.x), else the variable itself."""
    # (a constant initial value: under a split scope ``w`` is sharded, and each shard
    # starts as its rows of it)
    w = tf.get_variable("w", initializer=W0)
    value = tf.identity(w) if stateless else None

    def body(i, s):
        out = tf.matmul(s, value if stateless else w)
        if body_layer is not None:
            out = out + body_layer(s)
        return i + 1, tf.tanh(out)
    _, s = tf.while_loop(lambda i, s: i < T, body, [tf.constant(0), h], name=name)
    return s


def model(x, y, checkpoints=False, **loop_args):
    """Two layers, the loop, two layers, the head; ``checkpoints``: the tensors before
    and after the loop's segment go to the "checkpoints" collection."""
    h = dense(x, H, "in", 1, tf.tanh)
    a = dense(h, H, "pre", 2, tf.tanh)
    if checkpoints:
        tf.add_to_collection("checkpoints", a)
    s = loop(a, **loop_args)
    b = dense(s, H, "post", 3, tf.tanh)
    c = dense(b, H, "post2", 4, tf.tanh)
    if checkpoints:
        tf.add_to_collection("checkpoints", c)
    logits = dense(c, C, "head", 5)
    return tf.reduce_mean(tf.nn.sparse_softmax_cross_entropy_with_logits(labels=y,
                                                                         logits=logits))


def train_op(loss):
    """Momentum; every update waits for every gradient (deterministic)."""
    opt = tf.train.MomentumOptimizer(0.1, 0.9)
    grads = [(g, v) for g, v in opt.compute_gradients(loss) if g is not None]
    with tf.control_dependencies([g for g, _ in grads]):
        return opt.apply_gradients(grads)


def train(loss, op, tmpdir, name):
    """(losses of every step, the weights after the last, from a checkpoint: a split
    scope's shards save under the program's names)."""
    with tf.Session() as sess:
        sess.run(tf.global_variables_initializer())
        losses = [sess.run([loss, op])[0] for _ in range(STEPS)]
        path = tf.train.Saver().save(sess, os.path.join(str(tmpdir), name))
    reader = tf.train.load_checkpoint(path)
    weights = {k: reader.get_tensor(k) for k in reader.get_variable_to_shape_map()
               if "Momentum" not in k}    # (a split scope's slots are per shard)
    return np.array(losses), weights


def program(config, tmpdir, build=model, devices_per_batch=2, default=True):
    """Train ``build(x, y)`` STEPS steps; ``config`` None: without EPL, on the global
    batch (B x ``devices_per_batch`` rows).  Under EPL each replica pulls B rows, and the
    fetched loss is the replicas' mean."""
    models.reset()
    if config is not None:
        epl.init(epl.Config(config))
        if default:
            epl.set_default_strategy(epl.replicate(1))
    rows = B if config is not None else B * devices_per_batch
    x, y = _batches(rows, STEPS * B * devices_per_batch)
    loss = build(x, y)
    if config is not None:
        epl.add_to_collection(loss, epl.GraphKeys.GLOBAL_MEAN_OBJECTS)
    op = train_op(loss)
    types = set(o.type for o in tf.get_default_graph().get_operations())
    assert types & LOOP_OPS and not types & {"Enter", "Exit"}, sorted(types & LOOP_OPS)
    out = train(loss, op, tmpdir, "epl" if config is not None else "plain")
    return out + (tf.get_default_graph(),)


def assert_same(got, want):
    np.testing.assert_allclose(got[0], want[0], rtol=1e-5, atol=1e-6, err_msg="losses")
    assert sorted(got[1]) == sorted(want[1])
    for k in sorted(want[1]):
        np.testing.assert_allclose(got[1][k], want[1][k], rtol=1e-5, atol=1e-6, err_msg=k)
    assert not np.allclose(want[0][0], want[0][-1], atol=1e-4)     # it trained


# -- gradient checkpointing ------------------------------------------------------------

GC_LAYOUTS = {
    # name: (config, devices per global batch, annotate with the default strategy)
    "dp2": ({"cluster.devices_per_worker": 2}, 2, True),
    "ga2": ({"cluster.devices_per_worker": 1, "pipeline.num_micro_batch": 2}, 2, True),
    "one_device": ({"cluster.devices_per_worker": 1}, 1, True),
}


def _recomputed(graph):
    ir_graph = epl.Graph.get(graph)
    return [op for op in graph.get_operations()
            if op.name.endswith("_recompute") and ir_graph.phase_of(op) == "backward"]


@pytest.mark.parametrize("stateless", [False, True], ids=["reads_variable", "stateless"])
@pytest.mark.parametrize("layout", sorted(GC_LAYOUTS))
@pytest.mark.parametrize("kind", ["collection", "auto"])
def test_gradient_checkpointing_around_a_loop(v2, tmpdir, kind, layout, stateless):
    """The loop sits inside a recomputed segment (between the two checkpoints of
    ``collection``): the numbers are the program's."""
    config, per_batch, _ = GC_LAYOUTS[layout]
    config = dict(config, **{"gradient_checkpoint.type": kind})

    def build(x, y):
        return model(x, y, checkpoints=True, stateless=stateless)
    want = program(None, tmpdir, build, per_batch)
    got = program(config, tmpdir, build, per_batch)
    assert_same(got, want)
    if kind == "collection":
        assert _recomputed(got[2])      # (gradient checkpointing did recompute)


def _stages_build(checkpoints, stateless=False):
    def build(x, y):
        with epl.replicate(1, name="stage_0"):
            h = dense(x, H, "in", 1, tf.tanh)
            a = dense(h, H, "pre", 2, tf.tanh)
            if checkpoints:
                tf.add_to_collection("checkpoints", a)
            s = loop(a, stateless=stateless)
        with epl.replicate(1, name="stage_1"):
            b = dense(s, H, "post", 3, tf.tanh)
            c = dense(b, H, "post2", 4, tf.tanh)
            if checkpoints:
                tf.add_to_collection("checkpoints", c)
            logits = dense(c, C, "head", 5)
            return tf.reduce_mean(tf.nn.sparse_softmax_cross_entropy_with_logits(
                labels=y, logits=logits))
    return build


def _plain_build(checkpoints, stateless=False):
    def build(x, y):
        return model(x, y, checkpoints=checkpoints, stateless=stateless)
    return build


@pytest.mark.parametrize("stateless", [False, True], ids=["reads_variable", "stateless"])
@pytest.mark.parametrize("kind", ["collection", "auto"])
def test_gradient_checkpointing_with_a_loop_in_a_pipeline_stage(v2, tmpdir, kind, stateless):
    """2 stages x 2 micro-batches, the loop in stage 0.  (``collection``, stateless:
    the recomputed segment copies the loop itself, and the copy reads the loop's
    accumulators too: they are still the forward loop's, per clone, on its stage.)"""
    want = program(None, tmpdir, _plain_build(True, stateless), 2)
    got = program({"cluster.devices_per_worker": 2, "pipeline.num_micro_batch": 2,
                   "gradient_checkpoint.type": kind}, tmpdir, _stages_build(True, stateless),
                  2, default=False)
    assert_same(got, want)
    graph = got[2]
    ir_graph = epl.Graph.get(graph)
    loop_op = graph.get_operation_by_name("loop")
    lists = [t.op for t in loop_op.inputs if "TensorList" in t.op.type]
    assert lists and all(ir_graph.phase_of(op) == "forward" and op.device == loop_op.device
                         for op in lists)
    copy = graph.get_operation_by_name("EPL_REPLICA_1/loop")
    assert all(t.op.name.startswith("EPL_REPLICA_1/") for t in copy.inputs
               if "TensorList" in t.op.type)


# -- AMP -------------------------------------------------------------------------------

def _by_hand_amp(x, y):
    """``model`` in mixed precision written by hand: every dense product outside the loop
    in float16 between casts (the weights cast where they are read), the loop's product
    in float32 (AMP converts no op inside a loop or condition, v1 or v2), the backward
    pass from a loss scale of 128 and the gradients divided by it."""
    half = tf.float16

    def layer(h, units, name, seed, activation=None):
        with tf.variable_scope(name):
            kernel = tf.get_variable("kernel", [h.shape[-1], units], initializer=_init(seed))
            bias = tf.get_variable("bias", [units], initializer=tf.zeros_initializer())
        out = tf.nn.bias_add(tf.cast(tf.matmul(tf.cast(h, half), tf.cast(kernel, half)),
                                     tf.float32), bias)
        return activation(out) if activation else out
    h = layer(x, H, "in", 1, tf.tanh)
    a = layer(h, H, "pre", 2, tf.tanh)
    s = loop(a)
    b = layer(s, H, "post", 3, tf.tanh)
    c = layer(b, H, "post2", 4, tf.tanh)
    logits = layer(c, C, "head", 5)
    return tf.reduce_mean(tf.nn.sparse_softmax_cross_entropy_with_logits(labels=y,
                                                                         logits=logits))


def _by_hand_amp_program(devices, tmpdir):
    """``_by_hand_amp`` trained without EPL on the global batch of ``devices`` x B rows,
    as ``devices`` towers of B rows whose scaled float16 gradients are averaged (what
    data parallelism computes: float16 rounding depends on the rows a product sums)."""
    models.reset()
    x, y = _batches(devices * B, STEPS * devices * B)
    losses, tower_grads = [], []
    with tf.variable_scope(tf.get_variable_scope(), reuse=tf.AUTO_REUSE):
        for k in range(devices):
            rows = slice(k * B, (k + 1) * B)
            losses.append(_by_hand_amp(x[rows], y[rows]))
            var_list = tf.trainable_variables()
            grads = tf.gradients(losses[-1], var_list, grad_ys=[tf.constant(128.0)])
            tower_grads.append([g / 128.0 for g in grads])
    loss = tf.add_n(losses) / float(devices)
    grads = [(tf.add_n(list(gs)) / float(devices), v)
             for gs, v in zip(zip(*tower_grads), var_list)]
    opt = tf.train.MomentumOptimizer(0.1, 0.9)
    with tf.control_dependencies([g for g, _ in grads]):
        op = opt.apply_gradients(grads)
    return train(loss, op, tmpdir, "plain")


@pytest.mark.parametrize("devices", [1, 2])
def test_amp_o1_with_a_loop_equals_the_mixed_precision_program(v2, tmpdir, devices):
    """amp.level O1 (fixed loss scale 128) on 1 device and under data parallelism x2
    with a v2 loop: the program written in mixed precision by hand
    (``_by_hand_amp``), trained without EPL."""
    want = _by_hand_amp_program(devices, tmpdir)
    got = program({"cluster.devices_per_worker": devices, "amp.level": "O1",
                   "amp.loss_scale": 128}, tmpdir, devices_per_batch=devices)
    assert_same(got[:2], want)
    graph = got[2]
    half = [op.name for op in graph.get_operations() if op.type == "MatMul"
            and op.get_attr("T") == tf.float16 and not op.name.startswith("EPL_REPLICA")]
    assert len([n for n in half if "gradients" not in n]) == 5, half


# -- split scopes and loops -------------------------------------------------------------

def _split_in_body(split):
    def build(x, y):
        layers = []

        def body_layer(s):
            with split():
                layers.append(body_dense(s))
            return layers[-1]
        return model(x, y, body_layer=body_layer)
    return build


def _split_wraps_loop(split, relax=False):
    """The loop built inside ``split()``; ``relax``: its input gets an unknown batch
    dimension first (the fix the refusal of a fixed batch names)."""
    def build(x, y):
        h = dense(x, H, "in", 1, tf.tanh)
        with split():
            if relax:
                h = tf.placeholder_with_default(h, [None, H])
            s = loop(h, body_layer=body_dense, name="split_loop")
        logits = dense(s, C, "head", 5)
        return tf.reduce_mean(tf.nn.sparse_softmax_cross_entropy_with_logits(
            labels=y, logits=logits))
    return build


def _split_config():
    return {"cluster.devices_per_worker": 2, "cluster.colocate_split_and_replicate": True}


def test_split_scope_wrapping_a_loop(v2, tmpdir):
    """A loop built inside an ``epl.split(2)`` scope, whose body makes a dense layer
    (sharded over 2 devices), beside data parallelism x2 on the same devices: the
    whole loop is the split's and computes on every replica's rows, the program's
    numbers.  Built from a fixed-batch tensor, the loop's bodies were traced for one
    replica's rows: refused before the first step, and with the fix the refusal names
    (an unknown batch dimension) the program's numbers.  TF 1.15 runs a v2 loop on the
    device of every variable it captures, and the shards live on 2 devices: refused
    before the first step, naming the loop."""
    want = program(None, tmpdir, _split_wraps_loop(contextlib.nullcontext))
    if not IS_TF2:
        with pytest.raises(NotImplementedError,
                           match=r"tf.while_loop 'split_loop' of the epl.split\(device_count=2\) "
                                 r"scope reads variables of several shards inside its body"
                                 r".*Build the split layer outside the loop"):
            program(_split_config(), tmpdir, _split_wraps_loop(lambda: epl.split(2), True))
        return
    with pytest.raises(ValueError, match=r"tf.while_loop 'split_loop' of the "
                       r"epl.split\(device_count=2\) scope reads 'in/Tanh:0', whose batch "
                       r"dimension is fixed \(4 rows\).*placeholder_with_default"):
        program(_split_config(), tmpdir, _split_wraps_loop(lambda: epl.split(2)))
    got = program(_split_config(), tmpdir, _split_wraps_loop(lambda: epl.split(2), True))
    assert_same(got, want)


def test_split_layer_inside_the_body_of_a_replicated_loop_is_refused(v2, tmpdir):
    """A dense layer of an ``epl.split(2)`` scope made inside the body of a loop of the
    replicas (built outside the split scope): each replica's loop runs its own body,
    which cannot give the split layer every replica's rows (unrefused, the loop's
    accumulators met twice the rows they were made for, at run time).  Plain
    TensorFlow trains it; EPL refuses it before the first step, naming the loop, the
    scopes and the fix, and keeps refusing it."""
    program(None, tmpdir, _split_in_body(contextlib.nullcontext))
    models.reset()
    epl.init(epl.Config(_split_config()))
    epl.set_default_strategy(epl.replicate(1))
    x, y = _batches(B, STEPS * 2 * B)
    op = train_op(_split_in_body(lambda: epl.split(2))(x, y))
    refusal = (r"tf.while_loop 'loop' runs '.*' of the epl.split\(device_count=2\) scope "
               r"inside its body, but the loop itself was built in "
               r"epl.replicate\(device_count=1\).*Build the whole loop inside the split scope")
    with tf.Session() as sess:
        with pytest.raises(ValueError, match=refusal):
            sess.run(tf.global_variables_initializer())
        with pytest.raises(ValueError, match=refusal):
            sess.run(op)


# -- multi-worker ----------------------------------------------------------------------

@pytest.mark.alone   # (2 worker processes: conftest.py)
@pytest.mark.parametrize("name", ["nested", "lstm"])
def test_two_workers_data_parallel(v2, tmp_path, name):
    """2 worker processes (``epl-launch --num_workers 2``), data parallel, training a
    nested tf.while_loop / a dynamic_rnn in control flow v2 (``mw_control_flow_v2.py``
    switches TensorFlow as its users do): every worker ends with the weights, and
    reports the losses, of the program trained on the global batch without EPL."""
    models.reset()
    x, y = mw.batches(2 * mw.BATCH, mw.STEPS * 2 * mw.BATCH)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")     # (the corpus's tf.layers, LSTMCell on TF 2.x)
        want_losses, want = mw.train(name, x, y)
    code, out = launch(["--num_workers", "2", "--gpu_per_worker", "1",
                        os.path.join(HERE, "mw_control_flow_v2.py"), name, str(tmp_path)])
    assert code == 0, out[-5000:]
    for w in range(2):
        got = dict(np.load(str(tmp_path / ("worker_%d.npz" % w))))
        np.testing.assert_allclose(got.pop("losses"), want_losses, rtol=1e-5, atol=1e-6)
        assert sorted(got) == sorted("w/" + k for k in want)
        for k in want:
            np.testing.assert_allclose(got["w/" + k], want[k], rtol=1e-5, atol=1e-6,
                                       err_msg=k)
    assert not np.allclose(want_losses[0], want_losses[-1], atol=1e-4)
