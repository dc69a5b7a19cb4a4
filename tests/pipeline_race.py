"""A conv net in 4 pipeline stages trained with a plain ``minimize()`` (each variable's
update depends only on its own gradient): the program that raced under load (trust III,
item 1).  Run as a script it trains ``--runs`` times in one process under EPL and prints
one JSON line per run (the weights' hashes and values); the test compares them with the
same model without EPL, which orders every update after all gradients.

python tests/pipeline_race.py --stages 4 --micro 4 --schedule PreferForward --runs 4
"""
import argparse
import json
import os
import sys

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import tensorflow.compat.v1 as tf  # noqa: E402

tf.disable_v2_behavior()
tf.logging.set_verbosity(tf.logging.ERROR)

import epl  # noqa: E402

SIZE, CHANNELS, CLASSES, WIDTH = 8, 3, 5, 12
LAYERS_PER_STAGE = 3
STEPS = 2


def data(rows, seed=0):
    rng = np.random.RandomState(seed)
    return (rng.randn(rows, SIZE, SIZE, CHANNELS).astype(np.float32),
            rng.randint(0, CLASSES, rows).astype(np.int64))


def model(images, labels, stages, scope=None):
    """The loss; ``scope(i)`` opens stage i's annotation (None: no EPL)."""
    x = images
    seed = 0
    for s in range(stages):
        ctx = scope(s) if scope is not None else _Nothing()
        with ctx:
            for _ in range(LAYERS_PER_STAGE):
                seed += 1
                x = tf.layers.conv2d(x, WIDTH, 3, padding="same", activation=tf.nn.relu,
                                     kernel_initializer=tf.glorot_uniform_initializer(seed),
                                     bias_initializer=tf.constant_initializer(0.01 * seed),
                                     name="conv%d" % seed)
            if s == stages - 1:
                x = tf.reduce_mean(x, axis=[1, 2])
                logits = tf.layers.dense(x, CLASSES,
                                         kernel_initializer=tf.glorot_uniform_initializer(99),
                                         name="logits")
                loss = tf.losses.sparse_softmax_cross_entropy(labels, logits)
    return loss


class _Nothing(object):
    def __enter__(self):
        return self

    def __exit__(self, *a):
        return False


def _batch(x, y, rows):
    ds = tf.data.Dataset.from_tensor_slices((x, y)).batch(rows)
    return tf.data.make_one_shot_iterator(ds).get_next()


def _weights(sess):
    vs = sorted(tf.trainable_variables(), key=lambda v: v.op.name)
    return dict(zip([v.op.name for v in vs], sess.run(vs)))


def local(stages, micro, rows_per_micro):
    """The oracle: the same model on one device, every update after every gradient."""
    x, y = data(STEPS * micro * rows_per_micro)
    with tf.Graph().as_default():
        bx, by = _batch(x, y, micro * rows_per_micro)
        loss = model(bx, by, stages)
        opt = tf.train.GradientDescentOptimizer(0.5)
        gvs = opt.compute_gradients(loss)
        with tf.control_dependencies([g for g, _ in gvs]):
            op = opt.apply_gradients(gvs)
        with tf.Session() as sess:
            sess.run(tf.global_variables_initializer())
            for _ in range(STEPS):
                sess.run(op)
            return _weights(sess)


def train_op(loss, how):
    """``minimize`` (gradients gated per op: GATE_OP) or ``gradients``: tf.gradients then
    apply_gradients, as BERT's optimization code does (no gate: an update may run before
    a read of its variable that computes another layer's gradient)."""
    opt = tf.train.GradientDescentOptimizer(0.5)
    if how == "minimize":
        return opt.minimize(loss)
    tvars = tf.trainable_variables()
    return opt.apply_gradients(zip(tf.gradients(loss, tvars), tvars))


def build_epl(stages, micro, rows_per_micro, schedule, how="minimize"):
    """The EPL program: the train op and the graph (not run)."""
    x, y = data(STEPS * micro * rows_per_micro)
    epl.init(epl.Config({"cluster.devices_per_worker": stages,
                         "pipeline.num_micro_batch": micro,
                         "pipeline.strategy": schedule}))
    bx, by = _batch(x, y, rows_per_micro)
    loss = model(bx, by, stages, scope=lambda s: epl.replicate(1, name="stage_%d" % s))
    return train_op(loss, how)


def train_epl(stages, micro, rows_per_micro, schedule, how="minimize"):
    with tf.Graph().as_default():
        op = build_epl(stages, micro, rows_per_micro, schedule, how)
        with tf.Session() as sess:
            sess.run(tf.global_variables_initializer())
            for _ in range(STEPS):
                sess.run(op)
            return _weights(sess)


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--stages", type=int, default=4)
    p.add_argument("--micro", type=int, default=4)
    p.add_argument("--rows", type=int, default=2)
    p.add_argument("--schedule", default="PreferForward")
    p.add_argument("--runs", type=int, default=4)
    a = p.parse_args()
    want = local(a.stages, a.micro, a.rows)
    for _ in range(a.runs):
        got = train_epl(a.stages, a.micro, a.rows, a.schedule)
        worst = max(float(np.max(np.abs(got[k] - want[k]))) for k in want)
        off = sorted(k for k in want if not np.allclose(got[k], want[k], rtol=1e-5, atol=1e-6))
        print(json.dumps({"worst": worst, "off": off, "variables": len(want)}), flush=True)


if __name__ == "__main__":
    main()
