"""One rank of a fault scenario of test_faults.py: rank, size, job id, output file,
scenario, transport.  Prints "RESULT <json>" on success."""
import json
import os
import sys
import time

import numpy as np
import tensorflow as tf

from epl.communicators import native_ops as C

RANK, SIZE, JOB, OUT, SCENARIO = (int(sys.argv[1]), int(sys.argv[2]), sys.argv[3], sys.argv[4],
                                  sys.argv[5])
TRANSPORT = sys.argv[6] if len(sys.argv) > 6 else "shm"
TIMEOUT = int(os.environ.get("EPL_COMMUNICATION_TIMEOUT_SECONDS", "60"))


def all_reduce(value, group, sess_runs=1):
    with tf.Graph().as_default():
        x = tf.constant([float(value)])
        y = C.all_reduce(x, "%s/%s" % (JOB, group), RANK, SIZE, "sum", timeout_seconds=TIMEOUT,
                         transport=TRANSPORT)
        with tf.compat.v1.Session() as sess:
            return [float(sess.run(y)[0]) for _ in range(sess_runs)]


def main():
    result = {}
    if SCENARIO == "sum":            # 10 + 20 (+ 30 ...) under one group name, times SCALE
        scale = float(os.environ.get("SCALE", "1"))
        result["sum"] = all_reduce(10 * (RANK + 1) * scale, "sum")
    elif SCENARIO == "two_sessions":  # the same collective in a second session, twice
        result["first"] = all_reduce(10 * (RANK + 1), "grads", 2)
        result["second"] = all_reduce(100 * (RANK + 1), "grads", 2)
    print("RESULT " + json.dumps(result), flush=True)


if __name__ == "__main__":
    main()
