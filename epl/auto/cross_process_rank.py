"""One rank of the cross-process calibration (``epl.auto.local.measure_cross_process``
starts one process per rank: ``python -m epl.auto.cross_process_rank``): EPL's C++
all-reduce between the processes of this machine, timed alone per size and beside
compute (``beside_compute``)."""
import json

from epl.auto.local import TRANSPORTS, cpu_session, fastest_run, timed_runs
from epl.core import host_heap

BESIDE_BUCKETS = 4         # the buckets of the all-reduce timed beside compute (chained)
HIDDEN_SHARE = 0.1         # ... below this share of its time alone added, it is hidden


def main(argv):
    """EPL's C++ all-reduce between processes, timed per size, then beside compute;
    rank 0 writes the JSON."""
    import argparse
    host_heap.keep_freed_memory()
    ap = argparse.ArgumentParser(prog="python -m epl.auto.cross_process_rank")
    ap.add_argument("--rank", type=int, required=True)
    ap.add_argument("--ranks", type=int, required=True)
    ap.add_argument("--transport", required=True, choices=TRANSPORTS)
    ap.add_argument("--job", required=True)
    ap.add_argument("--sizes", required=True)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--out", required=True)
    ap.add_argument("--quick", action="store_true")
    a = ap.parse_args(argv)
    import numpy as np
    import tensorflow as tf
    from epl.communicators import native_ops  # (in the child process: loads the op library)
    v1 = tf.compat.v1
    v1.disable_eager_execution()
    v1.logging.set_verbosity(v1.logging.ERROR)
    times = {}
    for i, size in enumerate(int(x) for x in a.sizes.split(",")):
        graph = tf.Graph()
        with graph.as_default():
            with v1.device("/device:CPU:0"):
                x = v1.Variable(np.ones(size // 4, np.float32), name="x%d" % i)
                y = native_ops.all_reduce(x, "%s/calibrate_%d" % (a.job, i), a.rank, a.ranks,
                                          "sum", timeout_seconds=120, transport=a.transport)
            with cpu_session(tf, graph, 1) as sess:
                sess.run(x.initializer)
                sess.run(y.op)        # the connection (tcp) and the shared segments (shm)
                times[size] = fastest_run(sess, y.op, a.repeats)
    beside = beside_compute(tf, np, native_ops, a, 1 << 16 if a.quick else 2 << 20)
    if a.rank == 0:
        with open(a.out, "w") as f:
            json.dump(dict(times={str(k): v for k, v in times.items()}, beside=beside), f)


def beside_compute(tf, np, native_ops, a, bucket):
    """EPL's cross-process all-reduce beside compute on the same cores: what it adds to
    a product chain that outlasts it, run in every rank at once (a worker's backward pass
    beside its gradients' all-reduce), as the bandwidth that prices it (bus bytes over
    the seconds added).  The CPU transports' work is the cores' own (the copies, the
    reduction, the hand-offs between processes that each wait for a peer's thread to be
    scheduled), so unlike a network's it is not hidden by the compute beside it.
    Measured (AMD EPYC, 2 cores, shm; ``BESIDE_BUCKETS`` chained buckets of 2 MiB): 3.2-4.1
    ms added, 1.2-2.8 ms alone; the MLP's DP over 2 processes lost 7-10 ms a step to an
    all-reduce of 2.5 ms alone.  Medians: the contention is what is measured."""
    v1 = tf.compat.v1
    graph = tf.Graph()
    with graph.as_default(), v1.device("/device:CPU:0"):
        side = 256 if a.quick else 1024
        w = v1.Variable(2.0 * np.random.RandomState(0).rand(side, side).astype(np.float32)
                        / side)    # (its products keep the values near 1)
        x0 = v1.Variable(np.ones((64, side), np.float32))
        vs = [v1.Variable(np.ones(bucket // 4, np.float32)) for _ in range(BESIDE_BUCKETS)]
        tag = [0]

        def sync(tensors):
            """A 4-byte all-reduce of an element of each of ``tensors``: the ranks' runs
            start and end together.  (Data edges: a control edge into a constant did
            not hold, the chain before it did not run.)"""
            tag[0] += 1
            first = tf.add_n([tf.reshape(tf.slice(tf.reshape(t, [-1]), [0], [1]), [1])
                              for t in tensors])
            return native_ops.all_reduce(
                first, "%s/beside_sync_%d" % (a.job, tag[0]), a.rank, a.ranks, "sum",
                timeout_seconds=120, transport=a.transport)

        def buckets(name):
            outs = []
            for i, v in enumerate(vs):
                with v1.control_dependencies([outs[-1].op] if outs else []):
                    outs.append(native_ops.all_reduce_n(
                        [v + 0.0], "%s/beside_%s_%d" % (a.job, name, i), a.rank, a.ranks,
                        "sum", timeout_seconds=120, transport=a.transport)[0])
            return outs

        def chain(n):
            y = x0
            for _ in range(n):
                y = tf.matmul(y, w)
            return y
        product = chain(1)
        reduce_alone = sync(buckets("alone"))
        init = v1.global_variables_initializer()
    with cpu_session(tf, graph, 1) as sess:
        sess.run(init)
        seconds = _median_timed(sess, reduce_alone, a.repeats)
        one = _median_timed(sess, product, a.repeats)
        n = int(min(400, max(4, 3.0 * seconds / max(one, 1e-7))))  # it outlasts them
    with graph.as_default(), v1.device("/device:CPU:0"):
        compute = chain(n)
        compute_alone = sync([compute])
        together = sync([compute] + buckets("together"))
    with cpu_session(tf, graph, 1) as sess:
        sess.run(init)
        sess.run([reduce_alone, together])
        base = _median_timed(sess, compute_alone, a.repeats)
        both = _median_timed(sess, together, a.repeats)
    nbytes = bucket * BESIDE_BUCKETS
    added = both - base
    # (an all-reduce that adds less than a tenth of its time alone is hidden by the
    # compute, as a network's is: no figure; measured so once over tcp here)
    bandwidth = 2.0 * (a.ranks - 1) / a.ranks * nbytes / added \
        if added > HIDDEN_SHARE * seconds else None
    return dict(bandwidth=bandwidth, added_s=added, allreduce_s=seconds, compute_s=base,
                together_s=both, bytes=nbytes, products=n)


def _median_timed(sess, fetch, repeats):
    """The median of ``repeats`` runs (at least 9) after a warm-up."""
    runs = timed_runs(sess, fetch, max(9, repeats))
    return runs[len(runs) // 2]


if __name__ == "__main__":
    import sys
    main(sys.argv[1:])
