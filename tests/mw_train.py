"""A worker of the multi-worker tests (started by epl-launch from test_multi_worker.py).

Each worker feeds its share of every global batch; the job must equal the local model
trained on the whole global batch.  Saves three checkpoints (only the chief writes).
"""
import os
import sys

import numpy as np
import tensorflow.compat.v1 as tf

tf.disable_v2_behavior()  # TF 2.x: TF1 graph semantics (1.15: its defaults)

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import epl  # noqa: E402
from tests import models  # noqa: E402

STEPS, BATCH = 6, 4


def worker_rows(x, y, worker, workers, per_worker_batch):
    """Rows of `worker` for every step: its slice of each global batch."""
    g = per_worker_batch * workers
    idx = np.concatenate([np.arange(s * g + worker * per_worker_batch,
                                    s * g + (worker + 1) * per_worker_batch)
                          for s in range(len(x) // g)])
    return x[idx], y[idx]


def start_worker():
    """epl.init for this worker; returns (cluster, this worker's rows)."""
    tf.logging.set_verbosity(tf.logging.ERROR)
    epl.init()
    epl.set_default_strategy(epl.replicate(1))
    cluster = epl.Env.get().cluster
    nw, dev = cluster.worker_num, cluster.gpu_num_per_worker
    x, y = models.data(STEPS * BATCH * dev * nw)
    return cluster, worker_rows(x, y, cluster.worker_index, nw, BATCH * dev)


def main():
    out_dir = sys.argv[1]
    cluster, (wx, wy) = start_worker()
    w = cluster.worker_index
    bx, by = models.input_batch(wx, wy, BATCH)
    _, loss = models.forward(bx, by)
    step = tf.train.get_or_create_global_step()
    op = models.train_op(loss, "adam", step)
    saver = tf.train.Saver()
    steps_seen = []
    with tf.Session() as sess:
        sess.run(tf.global_variables_initializer())
        for i in range(STEPS):
            sess.run(op)
            if i % 2 == 1:   # three saves in a row
                saver.save(sess, os.path.join(out_dir, "ckpt", "model"), global_step=step)
                steps_seen.append(sess.run(step))
        print("worker %d trained %d steps" % (w, STEPS))
        np.savez(os.path.join(out_dir, "worker_%d.npz" % w), steps=np.array(steps_seen),
                 **models.weights(sess))


if __name__ == "__main__":
    main()
