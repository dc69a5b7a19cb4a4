"""The Communicator interface: every op on every in-process backend against numpy, the
backend chosen from the devices, and clear errors for an op a backend lacks."""
import numpy as np
import pytest
import tensorflow.compat.v1 as tf

from epl import communicators
from epl.communicators import op_library
from epl.communicators.hierarchical import HierarchicalCommunicator
from epl.communicators.in_graph import InGraphCommunicator
from epl.communicators.native import NativeCommunicator

N = 3
DEVICES = ["/device:CPU:%d" % i for i in range(N)]


def _make(backend, name):
    if backend == "inprocess":
        return NativeCommunicator(DEVICES, name, timeout_seconds=60)
    return InGraphCommunicator(DEVICES, name)


def _run(build):
    with tf.Graph().as_default():
        fetches = build()
        cfg = tf.ConfigProto(device_count={"CPU": N})
        with tf.Session(config=cfg) as sess:
            return sess.run(fetches)


def _inputs(shape, seed):
    rng = np.random.RandomState(seed)
    return [rng.randn(*shape).astype(np.float32) for _ in range(N)]


@pytest.mark.parametrize("backend", ["inprocess", "in_graph"])
def test_every_op_against_numpy(backend):
    xs = _inputs((7, 4), 0)                      # 7 rows: uneven over 3 ranks
    gs = [np.full((r + 1, 2), r, np.float32) for r in range(N)]   # uneven gather rows
    splits = [[1, 2, 3], [0, 0, 6], [2, 2, 2]]   # explicit all-to-all split sizes (6 rows)
    ts = _inputs((6, 2), 1)
    wide = np.stack(xs).astype(np.float64)

    def build():
        c = _make(backend, "c_" + backend)
        x = [tf.constant(v) for v in xs]
        return {
            "sum": c.all_reduce(x, "sum"),
            "mean": c.all_reduce(x, "mean"),
            "max": c.all_reduce(x, "max"),
            "n": c.all_reduce_n([[v, v[:2]] for v in x], "sum"),
            "gather": c.all_gather([tf.constant(g) for g in gs]),
            "rs": c.reduce_scatter(x, "sum"),
            "bcast": c.broadcast(x, root=1),
            "reduce": c.reduce(x, root=2, reduce_op="sum"),
            "a2a": c.all_to_all([tf.constant(t) for t in ts]),
            "a2a_split": c.all_to_all([tf.constant(t) for t in ts], splits),
        }
    got = _run(build)
    parts = np.array_split(wide.sum(0), N)
    for r in range(N):
        np.testing.assert_allclose(got["sum"][r], wide.sum(0), rtol=1e-5, atol=1e-5)
        np.testing.assert_allclose(got["mean"][r], wide.mean(0), rtol=1e-5, atol=1e-5)
        np.testing.assert_array_equal(got["max"][r], np.max(xs, 0))
        np.testing.assert_allclose(got["n"][r][0], wide.sum(0), rtol=1e-5, atol=1e-5)
        np.testing.assert_allclose(got["n"][r][1], wide.sum(0)[:2], rtol=1e-5, atol=1e-5)
        np.testing.assert_array_equal(got["gather"][r], np.concatenate(gs))
        np.testing.assert_allclose(got["rs"][r], parts[r], rtol=1e-5, atol=1e-5)
        np.testing.assert_array_equal(got["bcast"][r], xs[1])
        if r == 2:
            np.testing.assert_allclose(got["reduce"][r], wide.sum(0), rtol=1e-5, atol=1e-5)
        else:
            assert not got["reduce"][r].any()
        np.testing.assert_array_equal(
            got["a2a"][r], np.concatenate([np.split(ts[s], N)[r] for s in range(N)]))
        np.testing.assert_array_equal(
            got["a2a_split"][r],
            np.concatenate([np.split(ts[s], np.cumsum(splits[s])[:-1])[r] for s in range(N)]))


def test_backend_follows_the_devices():
    assert communicators.create(DEVICES, "cpu").backend == "inprocess"
    gpus = ["/job:worker/replica:0/task:0/device:GPU:%d" % i for i in range(2)]
    assert communicators.create(gpus, "gpu").backend == "nccl"

    class Cluster(object):
        worker_num, worker_index, job_id = 2, 0, "job"

        def cross_worker_transport(self):
            return "tcp"
    assert communicators.create(DEVICES, "x", cluster=Cluster()).backend == "hierarchical(tcp)"


@pytest.mark.parametrize("op, args", [("reduce_scatter", ()), ("reduce", ()),
                                      ("all_to_all", ())])
def test_op_a_backend_lacks_names_both(op, args):
    comm = HierarchicalCommunicator(DEVICES[:1], "h", 60, 0, 2, "job", "shm")
    with pytest.raises(NotImplementedError) as e:
        getattr(comm, op)([tf.constant([1.0])], *args)
    assert "hierarchical(shm)" in str(e.value) and op in str(e.value)


def test_without_the_library_falls_back_and_says_why(monkeypatch):
    warnings = []
    monkeypatch.setattr(op_library, "available", lambda: False)
    monkeypatch.setattr(op_library, "missing_reason", lambda: "no g++ (test)")
    monkeypatch.setattr(communicators, "_warned", [])
    monkeypatch.setattr(tf.logging, "warning",
                        lambda msg, *a: warnings.append(msg % a))
    first = communicators.create(DEVICES, "a")
    communicators.create(DEVICES, "b")
    assert first.backend == "in_graph"
    assert len(warnings) == 1 and "no g++ (test)" in warnings[0]
