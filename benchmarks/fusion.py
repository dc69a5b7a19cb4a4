"""Tensor fusion: all-reduce 200 small gradients, one collective per tensor vs fused into
`max_splits` buffers by EPL's fused all-reduce op (what the rewriter uses), and by concat +
all-reduce + split graph ops (for comparison); on 4 virtual devices of one process, and
across 2 processes (shared memory), where each collective costs a synchronization.

    python benchmarks/fusion.py [--tensors 200] [--json FILE]
"""
import argparse
import os
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
sys.path.insert(0, os.path.dirname(HERE))
os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import numpy as np  # noqa: E402
import tensorflow.compat.v1 as tf  # noqa: E402

tf.disable_v2_behavior()  # TF 2.x: TF1 graph semantics (1.15: its defaults)

from common import median, print_table, time_calls, write_json  # noqa: E402
from epl.communicators.native import NativeCommunicator  # noqa: E402
from epl.rewrite import fusion  # noqa: E402

tf.logging.set_verbosity(tf.logging.ERROR)


def build(n, shapes, max_splits, mode):
    devices = ["/device:CPU:%d" % r for r in range(n)]
    grads = []
    for r, dev in enumerate(devices):
        with tf.device(dev):
            grads.append([tf.Variable(tf.random.uniform(s), trainable=False) for s in shapes])
    comm = NativeCommunicator(devices, "fusion_bench_%d" % max_splits)
    items = [(i, tf.float32, int(np.prod(s)) * 4) for i, s in enumerate(shapes)]
    outs = []
    for _, keys in fusion.plan_buckets(items, max_splits):
        if mode == "fused":   # EPL's fused all-reduce op: no concat/split in the graph
            for per_rank in comm.all_reduce_n([[grads[r][i] for i in keys] for r in range(n)],
                                              "mean"):
                outs += per_rank
            continue
        flats = []
        for r, dev in enumerate(devices):
            with tf.device(dev):
                flats.append(fusion.pack([grads[r][i] for i in keys]))
        reduced = comm.all_reduce(flats, "mean")
        for r, dev in enumerate(devices):
            with tf.device(dev):
                outs += fusion.unpack(reduced[r], [grads[r][i] for i in keys])
    return tf.group(*[o.op for o in outs])


def measure(n, shapes, max_splits, steps, mode="fused"):
    with tf.Graph().as_default():
        op = build(n, shapes, max_splits, mode)
        with tf.Session(config=tf.ConfigProto(device_count={"CPU": n})) as sess:
            sess.run(tf.global_variables_initializer())
            return median(time_calls(lambda: sess.run(op), steps, warmup=3))


def cross_process_child(rank, shapes, steps, job):
    """One of 2 processes: per-tensor and fused shm all-reduce, same order on both ranks."""
    from epl.communicators import native_ops as C
    import json
    with tf.Graph().as_default():
        xs = [tf.Variable(tf.random.uniform(s), trainable=False) for s in shapes]
        per = [C.all_reduce(x, "%s/t%d" % (job, i), rank, 2, "mean", transport="shm").op
               for i, x in enumerate(xs)]
        items = [(i, tf.float32, int(np.prod(s)) * 4) for i, s in enumerate(shapes)]
        fused = []
        for b, (_, keys) in enumerate(fusion.plan_buckets(items, 5)):
            fused += [t.op for t in C.all_reduce_n([xs[i] for i in keys], "%s/b%d" % (job, b),
                                                    rank, 2, "mean", transport="shm")]
        step_per, step_fused = tf.group(*per), tf.group(*fused)
        with tf.Session() as sess:
            sess.run(tf.global_variables_initializer())
            t_per = median(time_calls(lambda: sess.run(step_per), steps, warmup=3))
            t_fused = median(time_calls(lambda: sess.run(step_fused), steps, warmup=3))
    print(json.dumps([t_per, t_fused]))


def measure_cross_process(shapes, steps):
    import uuid
    import watchdog
    job = uuid.uuid4().hex[:10]
    run = watchdog.run_group([[sys.executable, os.path.abspath(__file__), "--child", str(r),
                               "--job", job, "--steps", str(steps), "--tensors",
                               str(len(shapes))] for r in range(2)], timeout=600,
                             has_result=watchdog.has_json_result, names=["rank 0", "rank 1"],
                             peer_seconds=120)
    if not run.ok:
        raise RuntimeError("cross-process fusion benchmark failed: %s" % run.failure)
    return watchdog.json_result(run.outputs[0])


def _shapes(n):
    rng = np.random.RandomState(0)
    return [tuple(int(d) for d in rng.randint(4, 64, size=rng.randint(1, 3))) for _ in range(n)]


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--child", type=int, default=-1)
    p.add_argument("--job", default="")
    p.add_argument("--tensors", type=int, default=200)
    p.add_argument("--devices", type=int, default=4)
    p.add_argument("--steps", type=int, default=50)
    p.add_argument("--json")
    a = p.parse_args()
    shapes = _shapes(a.tensors)
    if a.child >= 0:
        cross_process_child(a.child, shapes, a.steps, a.job)
        return
    total = sum(int(np.prod(s)) for s in shapes) * 4
    rows = []
    per_tensor = measure(a.devices, shapes, a.tensors, a.steps, "concat")
    for mode, splits in (("per-tensor", a.tensors), ("fused", 5), ("fused", 1),
                         ("concat+split", 5), ("concat+split", 1)):
        sec = per_tensor if mode == "per-tensor" else measure(
            a.devices, shapes, splits, a.steps, "fused" if mode == "fused" else "concat")
        rows.append({"scope": "in_process", "ranks": a.devices, "mode": mode,
                     "max_splits": splits, "tensors": a.tensors, "bytes": total,
                     "step_ms": sec * 1e3, "speedup_vs_per_tensor": per_tensor / sec})
    t_per, t_fused = measure_cross_process(shapes, a.steps)
    for mode, splits, sec in (("per-tensor", a.tensors, t_per), ("fused", 5, t_fused)):
        rows.append({"scope": "cross_process", "ranks": 2, "mode": mode, "max_splits": splits,
                     "tensors": a.tensors, "bytes": total, "step_ms": sec * 1e3,
                     "speedup_vs_per_tensor": t_per / sec})
    print_table(rows, ["scope", "ranks", "mode", "max_splits", "tensors", "bytes", "step_ms",
                       "speedup_vs_per_tensor"], "Fusion: %d small gradients" % a.tensors)
    write_json("fusion", rows, a.json)


if __name__ == "__main__":
    main()
