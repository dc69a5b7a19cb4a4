"""A worker of the kill -9 test: data-parallel training that reports its pid and every
step (started by epl-launch from test_faults.py)."""
import os
import sys

import tensorflow as tf

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import epl  # noqa: E402
from tests import models  # noqa: E402


def main():
    tf.compat.v1.logging.set_verbosity(tf.compat.v1.logging.ERROR)
    epl.init()
    epl.set_default_strategy(epl.replicate(1))
    x, y = models.data(64)
    ds = tf.data.Dataset.from_tensor_slices((x, y)).batch(4).repeat()
    bx, by = tf.compat.v1.data.make_one_shot_iterator(ds).get_next()
    _, loss = models.forward(bx, by)
    op = models.train_op(loss, "sgd")
    print("PID %d" % os.getpid(), flush=True)
    with tf.compat.v1.Session() as sess:
        sess.run(tf.compat.v1.global_variables_initializer())
        for step in range(100000):
            sess.run(op)
            print("step %d" % step, flush=True)


if __name__ == "__main__":
    main()
