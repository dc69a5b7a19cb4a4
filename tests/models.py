"""Small deterministic models shared by the numerical-oracle tests.

Weights start from fixed numpy values and updates wait for every gradient
(compute_gradients, then apply_gradients under control dependencies), so the
one-device program is deterministic (PLATFORM_NOTES: ref-variable trap) and
two correct programs can be compared to ~1e-6.
"""
import numpy as np
import tensorflow.compat.v1 as tf

IN, HIDDEN, CLASSES = 12, 16, 5
# The suite's graph mode (tests/conftest.py): ref variables after disable_v2_behavior(),
# resource variables after disable_eager_execution() alone (EPL_TEST_GRAPH_MODE=eager_off).
REF_VARIABLES = not tf.resource_variables_enabled()


def reset():
    """A new default graph and EPL not initialized (so the next program is built without
    EPL, e.g. the oracle, unless it calls epl.init)."""
    from epl.ir import strategies
    from epl.core.process_state import Env
    strategies.reset()
    Env._instance = None  # pylint: disable=protected-access
    tf.reset_default_graph()


def init_data_parallel(n, **extra):
    """epl.init on n devices (plus ``extra`` config) with replicate(1) as the default."""
    import epl
    cfg = {"cluster.devices_per_worker": n}
    cfg.update(extra)
    epl.init(epl.Config(cfg))
    epl.set_default_strategy(epl.replicate(1))


def data(rows, seed=0):
    rng = np.random.RandomState(seed)
    x = rng.randn(rows, IN).astype(np.float32)
    y = rng.randint(0, CLASSES, rows).astype(np.int64)
    return x, y


def initial_weights(seed=1):
    rng = np.random.RandomState(seed)
    return {
        "dense/kernel": (rng.randn(IN, HIDDEN) * 0.3).astype(np.float32),
        "dense/bias": (rng.randn(HIDDEN) * 0.1).astype(np.float32),
        "dense_1/kernel": (rng.randn(HIDDEN, CLASSES) * 0.3).astype(np.float32),
        "dense_1/bias": (rng.randn(CLASSES) * 0.1).astype(np.float32),
    }


def make_optimizer(name):
    if name == "momentum":
        return tf.train.MomentumOptimizer(0.1, momentum=0.9)
    if name == "adam":
        return tf.train.AdamOptimizer(0.01)
    if name == "sgd":
        return tf.train.GradientDescentOptimizer(0.1)
    if name == "adamw":   # a user's optimizer: its own apply_gradients, update by hand
        from tests.corpus.bert import AdamWeightDecay
        return AdamWeightDecay(0.01)
    raise ValueError(name)


def forward(x, labels, use_resource=False):
    w = initial_weights()
    with tf.variable_scope("", use_resource=use_resource):
        h = tf.layers.dense(x, HIDDEN, activation=tf.nn.tanh,
                            kernel_initializer=tf.constant_initializer(w["dense/kernel"]),
                            bias_initializer=tf.constant_initializer(w["dense/bias"]))
        logits = tf.layers.dense(h, CLASSES,
                                 kernel_initializer=tf.constant_initializer(w["dense_1/kernel"]),
                                 bias_initializer=tf.constant_initializer(w["dense_1/bias"]))
    loss = tf.losses.sparse_softmax_cross_entropy(labels=labels, logits=logits)
    return logits, loss


def train_op(loss, optimizer_name, global_step=None):
    opt = make_optimizer(optimizer_name)
    gvs = opt.compute_gradients(loss)
    with tf.control_dependencies([g for g, _ in gvs]):
        return opt.apply_gradients(gvs, global_step=global_step)


def input_batch(x, y, batch):
    ds = tf.data.Dataset.from_tensor_slices((x, y)).batch(batch)
    it = tf.data.make_one_shot_iterator(ds)
    return it.get_next()


def value_tensor(graph, name):
    """The tensor holding variable ``name``'s value (ref or resource variable)."""
    op = graph.get_operation_by_name(name)
    if op.type == "VarHandleOp":
        return graph.get_tensor_by_name(name + "/Read/ReadVariableOp:0")
    return op.outputs[0]


def weights(sess, prefix=""):
    names = sorted(initial_weights())
    g = sess.graph
    vals = sess.run([value_tensor(g, prefix + n) for n in names])
    return dict(zip(names, vals))


def train_local(x, y, batch, steps, optimizer_name, use_resource=False):
    """The oracle: the same model on one device, no EPL strategy."""
    with tf.Graph().as_default():
        bx, by = input_batch(x, y, batch)
        _, loss = forward(bx, by, use_resource)
        step = tf.train.get_or_create_global_step()
        op = train_op(loss, optimizer_name, step)
        with tf.Session() as sess:
            sess.run(tf.global_variables_initializer())
            losses = [sess.run([loss, op])[0] for _ in range(steps)]
            return weights(sess), losses


def run_steps(op, steps, fetches):
    """Initialize, run ``op`` ``steps`` times in a plain Session, then fetch ``fetches``."""
    with tf.Session() as sess:
        sess.run(tf.global_variables_initializer())
        for _ in range(steps):
            sess.run(op)
        return sess.run(fetches)


def assert_weights_close(got, want, rtol=1e-5, atol=1e-6):
    for name in sorted(want):
        np.testing.assert_allclose(got[name], want[name], rtol=rtol, atol=atol, err_msg=name)


def checkpoint_handover(tmp_path, first, second, optimizer, devices=2, rows=16):
    """Train 2 steps under EPL config ``first`` and save; restore under ``second``
    and train 2 more: the weights after that, and the local model's after 4 steps
    (they must be equal: the checkpoint carries everything across configs)."""
    import epl
    x, y = data(4 * rows)
    want, _ = train_local(x, y, rows, 4, optimizer)
    path = str(tmp_path / "ckpt")

    def run(config, restore, start):
        reset()
        epl.init(epl.Config(dict(config, **{"cluster.devices_per_worker": devices})))
        epl.set_default_strategy(epl.replicate(1))
        px = tf.placeholder(tf.float32, [None, IN])
        py = tf.placeholder(tf.int64, [None])
        _, loss = forward(px, py)
        op = train_op(loss, optimizer, tf.train.get_or_create_global_step())
        saver = tf.train.Saver()
        with tf.Session() as sess:
            sess.run(tf.global_variables_initializer())
            if restore:
                saver.restore(sess, path)
            for i in range(start, start + 2):
                sess.run(op, {px: x[rows * i:rows * (i + 1)], py: y[rows * i:rows * (i + 1)]})
            saver.save(sess, path)
            return weights(sess)
    run(first, False, 0)
    return run(second, True, 2), want
