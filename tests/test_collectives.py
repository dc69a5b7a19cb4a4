"""C++ collectives (csrc/) against numpy: every op, dtype and awkward size, in one process."""
import itertools

import numpy as np
import pytest
import tensorflow.compat.v1 as tf

from epl.communicators import native_ops as C

DTYPES = [np.float16, np.float32, np.float64, np.int32, np.int64]
_count = itertools.count()


def _group():
    return "test/%d" % next(_count)


def _run(n, build):
    """build(rank, device) -> fetches per rank; runs them on n virtual devices."""
    with tf.Graph().as_default():
        outs = []
        for r in range(n):
            with tf.device("/device:CPU:%d" % r):
                outs.append(build(r))
        with tf.Session(config=tf.ConfigProto(device_count={"CPU": n})) as sess:
            return sess.run(outs)


def _inputs(n, shape, dtype, seed=0):
    rng = np.random.RandomState(seed)
    return [(rng.randn(*shape) * 10).astype(dtype) for _ in range(n)]


def _tol(dtype):
    """Summation order differs from numpy's float64 reference."""
    return {np.float16: dict(rtol=1e-2, atol=1e-1),
            np.float32: dict(rtol=1e-5, atol=1e-4)}.get(dtype, dict(rtol=1e-12, atol=1e-9))


@pytest.mark.parametrize("n", [1, 2, 4])   # 1: a replica alone (its tensor, no copy)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", [(7, 3), (0,), (1,), (1001,)])
@pytest.mark.parametrize("how", ["sum", "mean", "max", "min"])
def test_all_reduce(n, dtype, shape, how):
    xs = _inputs(n, shape, dtype)
    g = _group()
    got = _run(n, lambda r: C.all_reduce(tf.constant(xs[r]), g, r, n, how))
    stack = np.stack([x.astype(np.float64) for x in xs])
    want = {"sum": stack.sum(0), "mean": stack.mean(0), "max": stack.max(0),
            "min": stack.min(0)}[how]
    if how == "mean" and np.issubdtype(dtype, np.integer):
        want = np.trunc(stack.sum(0) / n)   # integer mean truncates toward zero
    for out in got:
        assert out.dtype == dtype and out.shape == shape
        np.testing.assert_allclose(out.astype(np.float64), want, **_tol(dtype))


@pytest.mark.parametrize("n", [2, 4])
@pytest.mark.parametrize("dtype", DTYPES)
def test_all_gather_unequal_sizes(n, dtype):
    xs = [_inputs(1, (r * 2 + (r % 2), 3), dtype, seed=r)[0] for r in range(n)]  # 0 rows on rank 0
    g = _group()
    got = _run(n, lambda r: C.all_gather(tf.constant(xs[r]), g, r, n))
    for out in got:
        np.testing.assert_array_equal(out, np.concatenate(xs))


@pytest.mark.parametrize("n", [2, 4])
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("rows", [0, 1, 7, 8])
def test_reduce_scatter(n, dtype, rows):
    xs = _inputs(n, (rows, 2), dtype)
    g = _group()
    got = _run(n, lambda r: C.reduce_scatter(tf.constant(xs[r]), g, r, n, "sum"))
    total = np.sum([x.astype(np.float64) for x in xs], axis=0)
    for r, part in enumerate(np.array_split(total, n)):
        np.testing.assert_allclose(got[r].astype(np.float64), part, **_tol(dtype))


@pytest.mark.parametrize("n", [2, 4])
@pytest.mark.parametrize("dtype", DTYPES)
def test_broadcast_and_reduce(n, dtype):
    xs = _inputs(n, (5,), dtype)
    g1, g2 = _group(), _group()
    root = n - 1
    got = _run(n, lambda r: [C.broadcast(tf.constant(xs[r]), g1, r, n, root=root),
                             C.reduce(tf.constant(xs[r]), g2, r, n, root=1, reduce_op="sum")])
    total = np.sum([x.astype(np.float64) for x in xs], axis=0)
    for r, (b, red) in enumerate(got):
        np.testing.assert_array_equal(b, xs[root])
        if r == 1:
            np.testing.assert_allclose(red.astype(np.float64), total, **_tol(dtype))
        else:
            assert not red.any()


@pytest.mark.parametrize("n", [2, 4])
@pytest.mark.parametrize("dtype", DTYPES)
def test_all_to_all_equal_and_explicit(n, dtype):
    xs = _inputs(n, (2 * n, 3), dtype)
    rng = np.random.RandomState(3)
    splits = [rng.multinomial(5, [1.0 / n] * n) for _ in range(n)]   # some zeros
    ys = [_inputs(1, (5, 3), dtype, seed=10 + r)[0] for r in range(n)]
    g1, g2 = _group(), _group()
    got = _run(n, lambda r: [C.all_to_all(tf.constant(xs[r]), g1, r, n)[0],
                             C.all_to_all(tf.constant(ys[r]), g2, r, n, splits[r])])
    for r in range(n):
        want = np.concatenate([np.split(xs[s], n)[r] for s in range(n)])
        np.testing.assert_array_equal(got[r][0], want)
        parts = [np.split(ys[s], np.cumsum(splits[s])[:-1])[r] for s in range(n)]
        np.testing.assert_array_equal(got[r][1][0], np.concatenate(parts))
        np.testing.assert_array_equal(got[r][1][1], [splits[s][r] for s in range(n)])


def test_shape_mismatch_is_an_error():
    g = _group()
    with pytest.raises(tf.errors.InvalidArgumentError, match="rank 1 has shape"):
        _run(2, lambda r: C.all_reduce(tf.zeros([3 + r]), g, r, 2))


def test_timeout_names_missing_rank():
    g = _group()
    with tf.Graph().as_default():
        outs = []
        for r in range(3):
            with tf.device("/device:CPU:%d" % r):
                outs.append(C.all_reduce(tf.ones([4]), g, r, 3, timeout_seconds=1))
        with tf.Session(config=tf.ConfigProto(device_count={"CPU": 3})) as sess:
            with pytest.raises(tf.errors.DeadlineExceededError, match=r"rank\(s\) 2 of 3"):
                sess.run(outs[:2])   # rank 2 never runs


@pytest.mark.parametrize("n", [2, 3])
def test_gradients_numerically(n):
    """d/dx of sum(w * collective(x)) checked with tf.test.compute_gradient."""
    rng = np.random.RandomState(0)
    xs = [rng.randn(4, 2) for _ in range(n)]
    with tf.Graph().as_default():
        cfg = tf.ConfigProto(device_count={"CPU": n})
        with tf.Session(config=cfg) as sess:
            for kind in ("all_reduce", "all_gather", "reduce_scatter", "broadcast", "all_to_all"):
                g = _group()
                x_vars = [tf.constant(x) for x in xs]
                losses = []
                for r in range(n):
                    with tf.device("/device:CPU:%d" % r):
                        if kind == "all_reduce":
                            y = C.all_reduce(x_vars[r], g, r, n, "sum")
                        elif kind == "all_gather":
                            y = C.all_gather(x_vars[r][:r + 1], g, r, n)
                        elif kind == "reduce_scatter":
                            y = C.reduce_scatter(x_vars[r], g, r, n, "sum")
                        elif kind == "broadcast":
                            y = C.broadcast(x_vars[r], g, r, n, root=1)
                        else:
                            y = C.all_to_all(tf.tile(x_vars[r], [n, 1]), g, r, n)[0]
                        w = tf.constant(np.random.RandomState(r).randn(1, 2))
                        losses.append(tf.reduce_sum(y * w * (r + 1)))
                total = tf.add_n(losses)
                grads = tf.gradients(total, x_vars)
                analytic = sess.run(grads)
                # numeric: central differences on the whole function
                eps = 1e-4
                for r in range(n):
                    num = np.zeros_like(xs[r])
                    for idx in np.ndindex(*xs[r].shape):
                        for sign in (1, -1):
                            feed = {x_vars[r]: xs[r] + sign * eps * _onehot(xs[r].shape, idx)}
                            num[idx] += sign * sess.run(total, feed) / (2 * eps)
                    np.testing.assert_allclose(analytic[r], num, rtol=1e-5, atol=1e-6,
                                               err_msg="%s rank %d" % (kind, r))


def _onehot(shape, idx):
    z = np.zeros(shape)
    z[idx] = 1
    return z


@pytest.mark.parametrize("n", [1, 2, 4])
@pytest.mark.parametrize("dtype", DTYPES)
def test_all_reduce_n_fused(n, dtype):
    shapes = [(3,), (0,), (2, 5), (1,), (1001,)]
    xs = [[_inputs(1, s, dtype, seed=10 * r + i)[0] for i, s in enumerate(shapes)]
          for r in range(n)]
    g = _group()
    got = _run(n, lambda r: C.all_reduce_n([tf.constant(x) for x in xs[r]], g, r, n, "sum"))
    for i in range(len(shapes)):
        want = np.sum([xs[r][i].astype(np.float64) for r in range(n)], axis=0)
        for r in range(n):
            np.testing.assert_allclose(got[r][i].astype(np.float64), want, **_tol(dtype))


def test_all_reduce_n_gradient():
    n = 2
    g = _group()
    with tf.Graph().as_default():
        xs = [[tf.constant(np.full([2], r + 1.0)), tf.constant(np.full([3], 2.0 * r))]
              for r in range(n)]
        outs = []
        for r in range(n):
            with tf.device("/device:CPU:%d" % r):
                a, b = C.all_reduce_n(xs[r], g, r, n, "sum")
                outs.append(tf.reduce_sum(a) * (r + 1) + tf.reduce_sum(b * b))
        grads = tf.gradients(tf.add_n(outs), [x for pair in xs for x in pair])
        with tf.Session(config=tf.ConfigProto(device_count={"CPU": n})) as sess:
            got = sess.run(grads)
    # d/dx_a = sum_r (r+1) = 3 ; d/dx_b = sum_r 2*(b_total) = 2 * 2 * 2.0
    for r in range(n):
        np.testing.assert_allclose(got[2 * r], np.full([2], 3.0))
        np.testing.assert_allclose(got[2 * r + 1], np.full([3], 8.0))
