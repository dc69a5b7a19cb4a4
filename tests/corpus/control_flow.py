"""TF1 programs built on control flow (issue 11): tf.while_loop through
``dynamic_rnn`` / ``bidirectional_dynamic_rnn`` / ``tf.scan`` / ``tf.map_fn`` and a
hand-written nested loop, tf.cond on an ``is_training`` placeholder driving dropout
and batch norm, and an ExponentialMovingAverage of the weights.

Every model is ``model(name, x, y, stage, split_head)``: ``stage(i)`` is the scope
of pipeline stage i (stage 0: the input projection; stage 1: the loop or
condition and the head), ``split_head``: the number of devices of an
``epl.split`` classifier.  Weights start from fixed seeds, so every build of a
program starts from the same values.

The programs build in either control-flow mode: v1 (``Enter`` / ``Switch`` / ``Merge``,
ref variables) or v2 (one ``While`` / ``If`` op per loop or condition with its bodies in
the graph's function library, resource variables; the loops' gradients read the
forward values from TensorList accumulators), as the caller has switched TensorFlow.
"""
import contextlib

import numpy as np
import tensorflow.compat.v1 as tf

T, F, H, CLASSES = 5, 4, 6, 3
MODELS = ("lstm", "birnn", "scan", "cond", "nested", "ema")


def data(rows, seed=0):
    rng = np.random.RandomState(seed)
    x = rng.randn(rows, T, F).astype(np.float32)
    y = (np.abs(x[:, 0, 0] * 3).astype(np.int64)) % CLASSES
    return x, y


def _init(seed):
    return tf.glorot_uniform_initializer(seed=seed)


def _no_scope(_):
    return contextlib.contextmanager(lambda: (yield))()


def _dense(x, units, name, seed, activation=None):
    return tf.layers.dense(x, units, activation=activation, name=name,
                                     kernel_initializer=_init(seed))


def _lstm(h):
    cell = tf.nn.rnn_cell.LSTMCell(H, initializer=_init(11))
    out, _ = tf.nn.dynamic_rnn(cell, h, dtype=tf.float32, scope="rnn")
    return out[:, -1, :]


def _birnn(h):
    fw = tf.nn.rnn_cell.GRUCell(H, kernel_initializer=_init(12))
    bw = tf.nn.rnn_cell.GRUCell(H, kernel_initializer=_init(13))
    _, (sf, sb) = tf.nn.bidirectional_dynamic_rnn(fw, bw, h, dtype=tf.float32,
                                                            scope="birnn")
    return tf.concat([sf, sb], axis=1)


def _scan(h):
    w = tf.get_variable("scan_w", [H, H], initializer=_init(14))
    u = tf.get_variable("scan_u", [H], initializer=_init(15))
    steps = tf.transpose(h, [1, 0, 2])                        # [T, batch, H]
    rows = tf.shape(h)[0]
    states = tf.scan(lambda acc, xt: tf.tanh(tf.matmul(acc, w) + xt), steps,
                     initializer=tf.zeros([rows, H]))
    last = states[-1]                                         # [batch, H]
    gate = tf.map_fn(lambda row: tf.reduce_sum(row * u), last)  # one value per row
    return last * tf.sigmoid(gate)[:, None]


def _nested(h):
    """An outer loop over time; per step an inner loop of 2 refinements."""
    w = tf.get_variable("nested_w", [H, H], initializer=_init(16))
    steps = tf.transpose(h, [1, 0, 2])

    def outer_body(t, state):
        xt = steps[t]

        def inner_body(k, s):
            return k + 1, tf.tanh(tf.matmul(s, w) + xt)
        _, state = tf.while_loop(lambda k, s: k < 2, inner_body, [0, state])
        return t + 1, state
    _, state = tf.while_loop(lambda t, s: t < T, outer_body,
                             [0, tf.zeros_like(steps[0])])
    return state


def is_training():
    return tf.placeholder_with_default(True, [], name="is_training")


def _cond(h):
    """tf.cond on ``is_training``; dropout driven by it (at rate 0 while the oracle
    compares: deterministic, the condition and its random ops still run); batch norm
    driven by its own flag (fed False in training: per-replica batch statistics would
    differ from the global batch's, which no oracle matches)."""
    training = is_training()
    bn_training = tf.placeholder_with_default(False, [], name="bn_training")
    rate = tf.placeholder_with_default(0.0, [], name="dropout_rate")
    flat = tf.reduce_mean(h, axis=1)
    flat = tf.cond(training, lambda: flat * 1.5 + 0.1, lambda: flat)
    flat = tf.layers.dropout(flat, rate=rate, training=training)
    return tf.layers.batch_normalization(flat, training=bn_training, name="bn")


_BODIES = {"lstm": _lstm, "birnn": _birnn, "scan": _scan, "nested": _nested,
           "cond": _cond, "ema": _lstm}


def model(name, x, y, stage=None, split_head=None):
    """The loss of ``name`` on the batch (x, y)."""
    stage = stage or _no_scope
    with stage(0):
        h = _dense(tf.reshape(x, [-1, F]), H, "proj", 1, activation=tf.tanh)
        h = tf.reshape(h, [-1, T, H])
    with stage(1):
        feat = _BODIES[name](h)
    if split_head:
        import epl
        with epl.split(split_head):
            logits = _dense(feat, CLASSES, "head", 2)
    else:
        with stage(1):
            logits = _dense(feat, CLASSES, "head", 2)
    return tf.reduce_mean(
        tf.nn.sparse_softmax_cross_entropy_with_logits(labels=y, logits=logits))


def train_op(name, loss):
    """SGD with momentum; the batch-norm updates; for ``ema``, an exponential moving
    average of the weights after every update."""
    opt = tf.train.MomentumOptimizer(0.1, 0.9)
    step = tf.train.get_or_create_global_step()
    updates = tf.get_collection(tf.GraphKeys.UPDATE_OPS)
    with tf.control_dependencies(updates):
        op = opt.minimize(loss, global_step=step)
    if name == "ema":
        ema = tf.train.ExponentialMovingAverage(0.9)
        with tf.control_dependencies([op]):
            op = ema.apply(tf.trainable_variables())
    return op
