"""A worker of the multi-worker public-API tests (started by epl-launch).

``merge``: epl.GraphKeys GLOBAL_* merges combine every worker's replicas (LOCAL_*
this worker's); each worker saves what it fetched.  ``train_and_evaluate``: the
unchanged Estimator call; only the chief evaluates the checkpoints it writes.
"""
import os
import sys

import numpy as np
import tensorflow.compat.v1 as tf

tf.disable_v2_behavior()  # TF 2.x: TF1 graph semantics (1.15: its defaults)

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import epl  # noqa: E402
from tests import models  # noqa: E402
from tests.mw_train import BATCH, STEPS, start_worker  # noqa: E402


def merge(out_dir, cluster, wx, wy):
    bx, by = models.input_batch(wx, wy, BATCH)
    logits, loss = models.forward(bx, by)
    labels = tf.identity(by)
    fetched = {"global_mean": loss, "global_concat": labels, "global_sum": tf.identity(loss),
               "local_concat": tf.identity(by), "local_mean": tf.identity(loss)}
    epl.add_to_collection(fetched["global_mean"], epl.GraphKeys.GLOBAL_MEAN_OBJECTS)
    epl.add_to_collection(fetched["global_concat"], epl.GraphKeys.GLOBAL_CONCAT_OBJECTS)
    epl.add_to_collection(fetched["global_sum"], epl.GraphKeys.GLOBAL_SUM_OBJECTS)
    epl.add_to_collection(fetched["local_concat"], epl.GraphKeys.LOCAL_CONCAT_OBJECTS)
    epl.add_to_collection(fetched["local_mean"], epl.GraphKeys.LOCAL_MEAN_OBJECTS)
    with tf.Session() as sess:
        sess.run(tf.global_variables_initializer())
        got = sess.run(fetched)
    np.savez(os.path.join(out_dir, "merge_%d.npz" % cluster.worker_index), **got)


def train_and_evaluate(out_dir, cluster, wx, wy):
    def input_fn():
        return tf.data.Dataset.from_tensor_slices((wx, wy)).batch(BATCH)

    def model_fn(features, labels, mode):
        logits, loss = models.forward(features, labels)
        if mode == tf.estimator.ModeKeys.EVAL:
            acc = tf.metrics.accuracy(labels, tf.argmax(logits, 1))
            return tf.estimator.EstimatorSpec(mode, loss=loss, eval_metric_ops={"acc": acc})
        op = models.train_op(loss, "adam", tf.train.get_global_step())
        return tf.estimator.EstimatorSpec(mode, loss=loss, train_op=op)

    est = tf.estimator.Estimator(model_fn, model_dir=os.path.join(out_dir, "est"))
    metrics, _ = tf.estimator.train_and_evaluate(
        est, tf.estimator.TrainSpec(input_fn, max_steps=STEPS),
        tf.estimator.EvalSpec(input_fn, steps=2, throttle_secs=0))
    if cluster.is_chief:
        np.savez(os.path.join(out_dir, "chief.npz"), loss=np.array([metrics["loss"]]),
                 acc=np.array([metrics["acc"]]), step=np.array([metrics["global_step"]]),
                 **{n: est.get_variable_value(n) for n in models.initial_weights()})
    print("worker %d done (evaluated: %s)" % (cluster.worker_index, metrics is not None))


def estimator_twice(out_dir, cluster, wx, wy):
    """An unchanged Estimator script that calls train() twice: each call makes a new
    graph and session in every worker."""
    def input_fn():
        return tf.data.Dataset.from_tensor_slices((wx, wy)).batch(BATCH)

    def model_fn(features, labels, mode):
        _, loss = models.forward(features, labels)
        op = models.train_op(loss, "momentum", tf.train.get_global_step())
        return tf.estimator.EstimatorSpec(mode, loss=loss, train_op=op)

    est = tf.estimator.Estimator(model_fn, model_dir=os.path.join(out_dir, "est"))
    est.train(input_fn, steps=3)
    est.train(input_fn, steps=3)
    if cluster.is_chief:
        np.savez(os.path.join(out_dir, "chief.npz"),
                 steps=np.array([est.get_variable_value("global_step")]),
                 **{n: est.get_variable_value(n) for n in models.initial_weights()})
    print("worker %d trained twice" % cluster.worker_index)


def two_losses(bx, by):
    """Two losses, two tf.gradients calls, hand-written updates (two reductions a step)."""
    from tests import test_update_paths as tup
    h, v1 = tup._layer(bx, "a", 3)
    o, v2 = tup._layer(tf.one_hot(by, models.CLASSES), "b", 3)
    loss1 = tf.reduce_mean(tf.square(h - 1.0))
    loss2 = tf.reduce_mean(tf.abs(o - tf.reduce_mean(bx, axis=1, keepdims=True)))
    grads = tup._gradients(loss1, v1) + tup._gradients(loss2, v2)
    return tf.group(*[tf.assign_sub(v, 0.1 * g) for g, v in zip(grads, v1 + v2)]), \
        v1 + v2


def two_gradients(out_dir, cluster, wx, wy):
    bx, by = models.input_batch(wx, wy, BATCH)
    op, tvars = two_losses(bx, by)
    values = models.run_steps(op, STEPS, tvars)
    np.savez(os.path.join(out_dir, "two_%d.npz" % cluster.worker_index),
             **{v.op.name: val for v, val in zip(tvars, values)})


def main():
    mode, out_dir = sys.argv[1], sys.argv[2]
    cluster, (wx, wy) = start_worker()
    {"merge": merge, "train_and_evaluate": train_and_evaluate,
     "estimator_twice": estimator_twice, "two_gradients": two_gradients}[mode](
         out_dir, cluster, wx, wy)


if __name__ == "__main__":
    main()
