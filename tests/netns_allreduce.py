"""A rank of test_netns's partition-mid-transfer test: EPL's TCP all-reduce of a large
tensor, round after round, printing each round's check (started by tests/test_netns.py in
its host's namespace, without epl-launch).

    python tests/netns_allreduce.py RANK SIZE MIB JOB TIMEOUT_SECONDS
"""
import os
import sys

import tensorflow.compat.v1 as tf

tf.disable_v2_behavior()  # TF 2.x: TF1 graph semantics (1.15: its defaults)

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from epl.communicators import native_ops as C  # noqa: E402


def main():
    rank, size, mib, job, timeout = (int(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3]),
                                     sys.argv[4], int(sys.argv[5]))
    tf.logging.set_verbosity(tf.logging.ERROR)
    x = tf.Variable(tf.fill([mib << 18], float(rank + 1)), trainable=False)
    y = C.all_reduce(x, "%s/big" % job, rank, size, "sum", timeout_seconds=timeout,
                     transport="tcp")
    check = [tf.reduce_min(y), tf.reduce_max(y)]
    with tf.Session() as sess:
        sess.run(x.initializer)
        for k in range(1000000):
            lo, hi = sess.run(check)
            print("round %d %g %g" % (k, lo, hi), flush=True)


if __name__ == "__main__":
    main()
