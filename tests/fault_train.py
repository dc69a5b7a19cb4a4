"""A worker of the kill -9 test: data-parallel training that reports its pid and every
step (started by epl-launch from test_faults.py)."""
import os
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
    x, y = models.data(64)
    ds = tf.data.Dataset.from_tensor_slices((x, y)).batch(4).repeat()
    bx, by = tf.data.make_one_shot_iterator(ds).get_next()
    _, loss = models.forward(bx, by)
    op = models.train_op(loss, "sgd")
    print("PID %d" % os.getpid(), flush=True)
    with tf.Session() as sess:
        sess.run(tf.global_variables_initializer())
        for step in range(100000):
            sess.run(op)
            print("step %d" % step, flush=True)


if __name__ == "__main__":
    main()
