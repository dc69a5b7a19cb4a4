"""A worker of the early-exit tests of test_launcher.py (started by epl-launch).

    mw_early_exit.py after_init OUT    worker 1 leaves (status 0) right after epl.init()
    mw_early_exit.py finish_early OUT  both train; worker 1 leaves at once, worker 0 stays
                                       a few seconds longer (as a chief writing its last
                                       summaries does)

Every worker that trains saves its weights to OUT/worker_<i>.npz.
"""
import os
import sys
import time

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from tests import mw_train  # noqa: E402
from tests import models  # noqa: E402

LINGER_SECONDS = 4


def main():
    mode, out_dir = sys.argv[1], sys.argv[2]
    import tensorflow.compat.v1 as tf
    cluster, (wx, wy) = mw_train.start_worker()
    w = cluster.worker_index
    if mode == "after_init" and w == 1:
        print("worker 1 leaves after epl.init() at %.3f" % time.time(), flush=True)
        return
    bx, by = models.input_batch(wx, wy, mw_train.BATCH)
    _, loss = models.forward(bx, by)
    op = models.train_op(loss, "adam", tf.train.get_or_create_global_step())
    with tf.Session() as sess:
        sess.run(tf.global_variables_initializer())
        for _ in range(mw_train.STEPS):
            sess.run(op)
        np.savez(os.path.join(out_dir, "worker_%d.npz" % w), **models.weights(sess))
    print("worker %d trained %d steps" % (w, mw_train.STEPS), flush=True)
    if w == 0 and mode == "finish_early":
        time.sleep(LINGER_SECONDS)
        print("worker 0 done lingering", flush=True)


if __name__ == "__main__":
    main()
