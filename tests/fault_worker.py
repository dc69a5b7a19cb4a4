"""One rank of a fault scenario of test_faults.py: rank, size, job id, output file,
scenario, transport.  Prints "RESULT <json>" on success."""
import json
import os
import sys
import time

import numpy as np
import tensorflow.compat.v1 as tf

tf.disable_v2_behavior()  # TF 2.x: TF1 graph semantics (1.15: its defaults)

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
        with tf.Session() as sess:
            return [float(sess.run(y)[0]) for _ in range(sess_runs)]


def timed_error(fn):
    """(error message or None, seconds) of running fn()."""
    start = time.time()
    try:
        fn()
        return None, time.time() - start
    except tf.errors.OpError as e:
        return e.message, time.time() - start


def run(fetches, feed=None):
    with tf.Session() as sess:
        return sess.run(fetches, feed)


def main():
    result = {}
    if SCENARIO == "sum":            # 10 + 20 (+ 30 ...) under one group name, times SCALE
        scale = float(os.environ.get("SCALE", "1"))
        result["sum"] = all_reduce(10 * (RANK + 1) * scale, "sum")
    elif SCENARIO == "two_sessions":  # the same collective in a second session, twice
        result["first"] = all_reduce(10 * (RANK + 1), "grads", 2)
        result["second"] = all_reduce(100 * (RANK + 1), "grads", 2)
    elif SCENARIO == "raise":        # rank 1's collective fails on its own (bad split sizes)
        def go():
            x = tf.ones([4, 2])
            splits = tf.constant([5, 5] if RANK == 1 else [2, 2], tf.int64)
            run(C.all_to_all(x, "%s/a2a" % JOB, RANK, SIZE, splits, timeout_seconds=TIMEOUT,
                             transport=TRANSPORT))
        result["error"], result["seconds"] = timed_error(go)
    elif SCENARIO == "abort_wakes":   # rank 0: a failing collective and another one in one
        # Both ranks join the job first: a rank 0 that failed and exited before rank 1
        # had started would leave rank 1 nothing to read the abort from (epl-launch
        # stops the other workers then; this test is about the abort message).
        result["warm"] = all_reduce(1, "warm")

        def go():                      # step; rank 1 never runs the other: it must not wait
            x = tf.ones([4, 2])
            splits = tf.constant([5, 5] if RANK == 0 else [2, 2], tf.int64)
            a2a = C.all_to_all(x, "%s/a2a" % JOB, RANK, SIZE, splits, timeout_seconds=TIMEOUT,
                               transport=TRANSPORT)
            fetches = [a2a]
            if RANK == 0:
                fetches.append(C.all_reduce(tf.ones([3]), "%s/other" % JOB, RANK, SIZE, "sum",
                                            timeout_seconds=TIMEOUT, transport=TRANSPORT))
            run(fetches)
        result["error"], result["seconds"] = timed_error(go)
    elif SCENARIO == "exit_early":   # rank 1 leaves (status 0) after the first collective
        result["warm"] = all_reduce(1, "warm")
        if RANK == 1:
            print("RESULT " + json.dumps(result), flush=True)
            os._exit(0)
        result["error"], result["seconds"] = timed_error(lambda: all_reduce(2, "after"))
    elif SCENARIO == "broadcast_many":   # one group per value, as the initial broadcast
        n = int(os.environ.get("GROUPS", "1000"))
        xs = [tf.constant([float(i + 1000 * RANK)]) for i in range(n)]
        outs = [C.broadcast(x, "%s/var_%d" % (JOB, i), RANK, SIZE, root=0,
                            timeout_seconds=TIMEOUT, transport=TRANSPORT)
                for i, x in enumerate(xs)]
        start = time.time()
        got = run(outs)
        result["wrong"] = [i for i, v in enumerate(got) if float(v[0]) != float(i)]
        result["seconds"] = time.time() - start
    elif SCENARIO == "stranger_target":  # a first collective, a pause, a second one
        result["first"] = all_reduce(10 * (RANK + 1), "first")
        print("LISTENING", flush=True)
        time.sleep(float(os.environ.get("PAUSE", "4")))
        result["second"] = all_reduce(100 * (RANK + 1), "second")
    elif SCENARIO == "big_fused":    # a fused all-reduce of more than 2 GiB (64-bit offsets)
        elems = int(os.environ.get("ELEMS", str((1 << 29) + 4096)))   # 2 GiB + 16 KiB each
        parts = [tf.fill([elems], float(RANK + 1)), tf.fill([16], float(10 * (RANK + 1)))]
        outs = C.all_reduce_n(parts, "%s/big" % JOB, RANK, SIZE, "sum", timeout_seconds=TIMEOUT,
                              transport=TRANSPORT)
        checks = [tf.reduce_min(outs[0]), tf.reduce_max(outs[0]), tf.reduce_min(outs[1]),
                  tf.reduce_max(outs[1])]
        result["checks"] = [float(v) for v in run(checks)]
    elif SCENARIO == "two_gradients":   # two reductions of one step, different values
        a = C.all_reduce_n([tf.constant([1.0 + RANK])], "%s/EPL_GRADIENTS_0/comm" % JOB, RANK,
                           SIZE, "sum", timeout_seconds=TIMEOUT, transport=TRANSPORT)
        b = C.all_reduce_n([tf.constant([2.0 + 2 * RANK])], "%s/EPL_GRADIENTS_1/comm" % JOB,
                           RANK, SIZE, "sum", timeout_seconds=TIMEOUT, transport=TRANSPORT)
        got = run([a[0], b[0]])
        result["values"] = [float(got[0][0]), float(got[1][0])]
    print("RESULT " + json.dumps(result), flush=True)


if __name__ == "__main__":
    main()
