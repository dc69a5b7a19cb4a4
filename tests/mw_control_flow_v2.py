"""A worker of test_control_flow_v2's multi-worker test (started by epl-launch): a
program of ``tests/corpus/control_flow.py`` in control flow v2, data parallel over the
workers.

The program switches TensorFlow as its users do: on TF 2.x
``tf.compat.v1.disable_eager_execution()`` alone (v2 loops and conditions, resource
variables, v2 shapes); TF 1.15 gets the same loops from ``enable_control_flow_v2()``
with resource variables.  Each worker pulls its own rows of every global batch; the
losses (merged over the workers) and the weights after the last step must equal the
program trained on the whole global batch without EPL.
"""
import os
import sys

import numpy as np
import tensorflow.compat.v1 as tf

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import epl  # noqa: E402
from tests.corpus import control_flow as cf  # noqa: E402

STEPS, BATCH = 3, 4


def batches(rows, total, worker=0, workers=1):
    """``worker``'s ``rows`` of every global batch of ``rows`` x ``workers`` rows."""
    x, y = cf.data(total)
    g = rows * workers
    idx = np.concatenate([np.arange(s * g + worker * rows, s * g + (worker + 1) * rows)
                          for s in range(total // g)])
    ds = tf.data.Dataset.from_tensor_slices((x[idx], y[idx])).batch(rows, drop_remainder=True)
    return tf.data.make_one_shot_iterator(ds).get_next()


def train(name, x, y, merged=False):
    """(losses per step, trainable variables after STEPS steps) of ``name``."""
    loss = cf.model(name, x, y)
    if merged:
        epl.add_to_collection(loss, epl.GraphKeys.GLOBAL_MEAN_OBJECTS)
    op = cf.train_op(name, loss)
    types = set(o.type for o in tf.get_default_graph().get_operations())
    assert types & {"While", "StatelessWhile", "If", "StatelessIf"}, "not control flow v2"
    with tf.Session() as sess:
        sess.run(tf.global_variables_initializer())
        losses = [sess.run([loss, op])[0] for _ in range(STEPS)]
        return np.array(losses), {v.op.name: sess.run(v) for v in tf.trainable_variables()}


def switch_to_v2():
    """What the user's program does first (here, not at import: the test imports this
    module in a process that must keep its mode)."""
    if tf.__version__.startswith("2."):
        tf.disable_eager_execution()
    else:
        tf.enable_control_flow_v2()
        tf.enable_resource_variables()


def main():
    switch_to_v2()
    name, out_dir = sys.argv[1], sys.argv[2]
    tf.logging.set_verbosity(tf.logging.ERROR)
    epl.init()
    epl.set_default_strategy(epl.replicate(1))
    cluster = epl.Env.get().cluster
    workers, w = cluster.worker_num, cluster.worker_index
    x, y = batches(BATCH, STEPS * BATCH * workers, w, workers)
    losses, weights = train(name, x, y, merged=True)
    print("worker %d trained %d steps" % (w, STEPS))
    np.savez(os.path.join(out_dir, "worker_%d.npz" % w), losses=losses,
             **{"w/" + k: v for k, v in weights.items()})


if __name__ == "__main__":
    main()
