"""A task of the cluster-manager fault tests (tests/test_cluster_managers.py): data
parallel training in which worker 1 kills itself (SIGKILL) after a few steps, while
worker 0 waits for it in the gradients' all-reduce; the manager must end the job."""
import os
import signal
import sys

import tensorflow.compat.v1 as tf

tf.disable_v2_behavior()  # TF 2.x: TF1 graph semantics (1.15: its defaults)

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import epl  # noqa: E402
from tests import models  # noqa: E402


def main():
    tf.logging.set_verbosity(tf.logging.ERROR)
    epl.init()
    epl.set_default_strategy(epl.replicate(1))
    worker = epl.Env.get().cluster.worker_index
    x, y = models.data(64)
    ds = tf.data.Dataset.from_tensor_slices((x, y)).batch(4).repeat()
    bx, by = tf.data.make_one_shot_iterator(ds).get_next()
    _, loss = models.forward(bx, by)
    op = models.train_op(loss, "sgd")
    with tf.Session() as sess:
        sess.run(tf.global_variables_initializer())
        for step in range(100000):
            sess.run(op)
            print("worker %d step %d" % (worker, step), flush=True)
            if worker == 1 and step == 2:
                os.kill(os.getpid(), signal.SIGKILL)


if __name__ == "__main__":
    main()
