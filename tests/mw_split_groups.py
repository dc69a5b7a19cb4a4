"""A worker of the 2-worker split-groups test (tests/test_split_hybrids.py): the GPT
decoder with every scope under split(2), on 2 workers x 2 devices.  Each worker is one
split group over its own 2 devices (between-graph) and feeds its half of every global
batch; the groups' gradients are averaged across the workers.  Each worker writes its
losses; the chief also its weights (a checkpoint of the unsplit variables)."""
import os
import sys

import numpy as np
import tensorflow.compat.v1 as tf

tf.disable_v2_behavior()  # TF 2.x: TF1 graph semantics (1.15: its defaults)

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import epl  # noqa: E402
from tests import test_split_hybrids as sh  # noqa: E402
from tests import transformer_models as tm  # noqa: E402


def main():
    out_dir = sys.argv[1]
    tf.logging.set_verbosity(tf.logging.ERROR)
    epl.init(epl.Config({}))
    cluster = epl.Env.get().cluster
    w, half = cluster.worker_index, sh.BATCH // 2
    ids, labels = tm.data(sh.BATCH * sh.STEPS)
    pi = tf.placeholder(tf.int64, [None, tm.SEQ])
    pl = tf.placeholder(tf.int64, [None, tm.SEQ])
    loss = tm.Decoder(scope=lambda i: epl.split(2)).build(pi, pl)
    op = sh._adam(loss)  # pylint: disable=protected-access
    losses = []
    with tf.Session() as sess:
        sess.run(tf.global_variables_initializer())
        for i in range(sh.STEPS):
            rows = slice(i * sh.BATCH + w * half, i * sh.BATCH + (w + 1) * half)
            losses.append(sess.run([loss, op], {pi: ids[rows], pl: labels[rows]})[0])
        heads = sorted(sh._devices(tf.get_default_graph(), "block_0/",  # pylint: disable=protected-access
                                   ["BatchMatMulV2", "BatchMatMul"]))
        np.savez(os.path.join(out_dir, "worker_%d.npz" % w), losses=np.array(losses),
                 heads=np.array(heads))
        if w == 0:
            tf.train.Saver().save(sess, os.path.join(out_dir, "groups"))
    print("worker %d finished split groups" % w)


if __name__ == "__main__":
    main()
