"""One rank of the cross-process collective test (run by test_collectives_xproc.py).

Builds every case of CASES with transport=TRANSPORT and saves the results to an .npz.
"""
import sys

import numpy as np
import tensorflow.compat.v1 as tf

tf.disable_v2_behavior()  # TF 2.x: TF1 graph semantics (1.15: its defaults)

from epl.communicators import native_ops as C

TRANSPORT = sys.argv[5] if len(sys.argv) > 5 else "shm"
DTYPES = ["float16", "float32", "float64", "int32", "int64"]
SHAPES = [(0,), (1,), (7, 3), ((2 << 20) + 5,)]     # the last spans several 4 MiB chunks


def _pattern(n, rank, seed):
    return (np.arange(n, dtype=np.int64) * (7 + 3 * rank) + seed) % 101 - 50


def inputs(rank, shape, dtype, seed):
    """Small integers: exact in every dtype, and cheap to build in TF (no big constants)."""
    return _pattern(int(np.prod(shape)), rank, seed).reshape(shape).astype(dtype)


def tf_inputs(rank, shape, dtype, seed):
    n = int(np.prod(shape))
    x = (tf.range(n, dtype=tf.int64) * (7 + 3 * rank) + seed) % 101 - 50
    return tf.cast(tf.reshape(x, shape), dtype)


def cases(size):
    for i, (dtype, shape) in enumerate((d, s) for d in DTYPES for s in SHAPES):
        yield "all_reduce_sum_%d" % i, "all_reduce", dtype, shape, i
        yield "all_reduce_max_%d" % i, "all_reduce_max", dtype, shape, i
        yield "all_reduce_mean_%d" % i, "all_reduce_mean", dtype, shape, 50 + i
    for i, dtype in enumerate(DTYPES):
        yield "all_reduce_n_%d" % i, "all_reduce_n", dtype, ((1 << 20) + 3,), 700 + i
        yield "all_gather_%d" % i, "all_gather", dtype, None, 100 + i
        yield "reduce_scatter_%d" % i, "reduce_scatter", dtype, (7, 2), 200 + i
        yield "broadcast_%d" % i, "broadcast", dtype, (5,), 300 + i
        yield "reduce_%d" % i, "reduce", dtype, (5,), 400 + i
        yield "all_to_all_%d" % i, "all_to_all", dtype, (2 * size, 3), 500 + i
        yield "all_to_all_split_%d" % i, "all_to_all_split", dtype, (5, 3), 600 + i
    # Several rounds of the transports' buffers, uneven blocks, 2-byte elements.
    for i, dtype in enumerate(["float16", "float32"]):
        yield "reduce_scatter_big_%d" % i, "reduce_scatter", dtype, (100001, 3), 800 + i
        yield "broadcast_big_%d" % i, "broadcast", dtype, ((1 << 18) + 3,), 810 + i
        yield "all_gather_big_%d" % i, "all_gather", dtype, None, 820 + i
        yield "all_to_all_big_%d" % i, "all_to_all", dtype, (size * 30001, 3), 830 + i
        yield "all_to_all_split_big_%d" % i, "all_to_all_split", dtype, (BIG_SPLIT, 3), 840 + i


BIG_SPLIT = 200003


def build(kind, x, group, rank, size):
    if kind == "all_reduce":
        return C.all_reduce(x, group, rank, size, "sum", transport=TRANSPORT)
    if kind == "all_reduce_mean":
        return C.all_reduce(x, group, rank, size, "mean", transport=TRANSPORT)
    if kind == "all_reduce_max":
        return C.all_reduce(x, group, rank, size, "max", transport=TRANSPORT)
    if kind == "all_reduce_n":   # the tensor, split in three uneven parts, fused
        parts = [x[:5], x[5:5], x[5:]]
        return tf.concat(C.all_reduce_n(parts, group, rank, size, "sum", transport=TRANSPORT), 0)
    if kind == "all_gather":
        return C.all_gather(x, group, rank, size, transport=TRANSPORT)
    if kind == "reduce_scatter":
        return C.reduce_scatter(x, group, rank, size, "sum", transport=TRANSPORT)
    if kind == "broadcast":
        return C.broadcast(x, group, rank, size, root=size - 1, transport=TRANSPORT)
    if kind == "reduce":
        return C.reduce(x, group, rank, size, root=0, transport=TRANSPORT)
    if kind == "all_to_all":
        return C.all_to_all(x, group, rank, size, transport=TRANSPORT)[0]
    splits = split_sizes(rank, size, int(x.shape[0]))
    return C.all_to_all(x, group, rank, size, splits, transport=TRANSPORT)[0]


def split_sizes(rank, size, rows=5):
    return np.random.RandomState(rank).multinomial(rows, [1.0 / size] * size)


def gather_rows(rank, name=""):
    if "_big_" in name:
        return 40000 * (rank + 1) + rank
    return 2 * rank + (rank % 2)


def main():
    rank, size, job, out = int(sys.argv[1]), int(sys.argv[2]), sys.argv[3], sys.argv[4]
    names, fetches = [], []
    for name, kind, dtype, shape, seed in cases(size):
        if kind == "all_gather":
            shape = (gather_rows(rank, name), 3)
        x = tf_inputs(rank, shape, dtype, seed)
        names.append(name)
        fetches.append(build(kind, x, "%s/%s" % (job, name), rank, size))
    with tf.Session() as sess:
        results = sess.run(fetches)
    np.savez(out, **dict(zip(names, results)))


if __name__ == "__main__":
    main()
