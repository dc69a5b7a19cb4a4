"""The optimizer's updates of a replayed step (``epl.auto.update_timing``): each update
of a variable is keyed by its kernel and its variables' shapes, rebuilt alone on
variables of those shapes, timed in a chain like the other kernels on variables taken
in turn from enough sets to be cold, and added after the step, once per process."""
import json

import numpy as np
import pytest
import tensorflow as tf

from epl.auto import Cluster, dataflow, graph_profile, local, local_step, product_timing
from epl.auto import update_timing
from epl.auto.layout import Layout
from epl.auto.predictor import price
from tests import auto_models

v1 = tf.compat.v1


def _step(optimizer, resource, shape=(16, 4)):
    """A one-layer model's step under ``optimizer``: (its graph, its train op)."""
    graph = tf.Graph()
    with graph.as_default():
        x = tf.constant(np.ones([8, shape[0]], np.float32))
        w = v1.get_variable("w", shape, use_resource=resource)
        loss = tf.reduce_sum(tf.square(tf.matmul(x, w)))
        train = optimizer().minimize(loss, global_step=v1.train.get_or_create_global_step())
    return graph, train


def _updates(graph, train):
    """{op type: signature} of the updates the step runs."""
    from epl import ir
    return dict((op.type, update_timing.signature(op)) for op in ir.upstream([train])
                if update_timing.signature(op))


@pytest.mark.parametrize("resource", [False, True])
def test_adams_updates_are_keyed_by_their_variables(resource):
    """Adam's fused kernel on the weight and its two slots (ref or resource variables),
    the beta powers' assignments; the global step (an integer) is no update to time."""
    graph, train = _step(lambda: v1.train.AdamOptimizer(0.1), resource)
    got = _updates(graph, train)
    apply, assign = ("ResourceApplyAdam", "AssignVariableOp") if resource \
        else ("ApplyAdam", "Assign")
    assert set(got) == {apply, assign}
    _, kind, _, inputs = json.loads(got[apply])
    how = "resource" if resource else "ref"
    assert kind == apply and inputs[:3] == [[how, "float32", [16, 4]]] * 3
    assert inputs[-1] == ["value", "float32", [16, 4]]                  # the gradient
    assert json.loads(got[assign])[3][0] == [how, "float32", []]        # a beta power


@pytest.mark.parametrize("resource", [False, True])
@pytest.mark.parametrize("sets", [1, 3])
def test_an_update_rebuilt_alone_updates_its_variables_in_turn(resource, sets):
    """The chain's copies (CHAIN = 17) update ``sets`` sets of variables in turn, one
    after another: gradient descent from w0 with gradient g at rate 0.5 leaves each
    set at w0 - k x 0.5 x g, k the copies that took it (one set: 17; three: 6, 6, 5)."""
    graph, train = _step(lambda: v1.train.GradientDescentOptimizer(0.1), resource)
    sig = _updates(graph, train)["ResourceApplyGradientDescent" if resource
                                 else "ApplyGradientDescent"]
    n = product_timing.CHAIN
    with tf.Graph().as_default():
        ops = update_timing.chain(sig, np.random.RandomState(0), "/device:CPU:0", n, sets)
        assert len(ops) == n
        assert all(op.control_inputs == [before] for before, op in zip(ops, ops[1:]))
        _, alpha, grad = ops[0].inputs
        reads = [v1.raw_ops.ReadVariableOp(resource=op.inputs[0], dtype=tf.float32)
                 if resource else op.inputs[0] for op in ops[:sets]]
        with v1.Session() as sess:
            sess.run(v1.global_variables_initializer())
            sess.run(v1.get_collection(update_timing.INITS))
            w0, a, g = sess.run([reads[0], alpha, grad])
            assert a == 0.5 and w0.shape == (16, 4) and np.all(g > 0.0)
            sess.run(ops[-1])
            for k, read in enumerate(reads):
                took = len(range(k, n, sets))
                np.testing.assert_allclose(sess.run(read), w0 - took * a * g, rtol=1e-5)


def test_a_chains_variables_are_cold():
    """Enough sets that the chain's state (COLD_BYTES) is out of the caches, at most one
    per copy: Adam's 512 x 8192 weight and slots (48 MiB) take 1 GiB / 48 MiB = 22 > 17
    sets; a small one 17."""
    big = json.dumps(["update", "ApplyAdam", "", [["ref", "float32", [512, 8192]]] * 3
                      + [["value", "float32", [512, 8192]]]])
    assert update_timing.sets_for(big, 17) == 17
    assert update_timing.sets_for(big, 17, cold_bytes=100 << 20) == 3
    small = json.dumps(["update", "Assign", "", [["ref", "float32", []],
                                                 ["value", "float32", []]]])
    assert update_timing.sets_for(small, 17) == 17
    # each variable at its own width: float16 state is half as many bytes a set
    half = json.dumps(["update", "ApplyAdam", "", [["ref", "float16", [512, 8192]]] * 3
                       + [["value", "float16", [512, 8192]]]])
    assert update_timing.sets_for(half, 17, cold_bytes=100 << 20) == 5
    # (a 16 x 4 update times at 0 us where the chain's noise is larger: a 1 MiB one)
    graph, train = _step(lambda: v1.train.GradientDescentOptimizer(0.1), False, (512, 512))
    sig = _updates(graph, train)["ApplyGradientDescent"]
    got = product_timing.measure([sig], 2)[sig]
    assert got["alone"] > 0.0 and got["shared"] > 0.0


def test_a_hand_written_optimizers_assignments_are_updates():
    """A user's own optimizer (``assign_sub`` of a scaled gradient) is timed too."""
    def sgd():
        class Sgd(v1.train.Optimizer):
            def __init__(self):
                super(Sgd, self).__init__(False, "Sgd")

            def _apply_dense(self, grad, var):
                return v1.assign_sub(var, 0.1 * grad)
        return Sgd()
    graph, train = _step(sgd, False)
    assert list(_updates(graph, train)) == ["AssignSub"]


def test_a_sparse_update_is_not_timed():
    with tf.Graph().as_default():
        table = v1.get_variable("t", [10, 4], use_resource=False)
        emb = tf.nn.embedding_lookup(table, tf.constant([1, 2]))
        train = v1.train.AdamOptimizer(0.1).minimize(tf.reduce_sum(emb))
        from epl import ir
        kinds = set(op.type for op in ir.upstream([train]))
        assert "SparseApplyAdam" in kinds or "ScatterAdd" in kinds
        assert not [op for op in ir.upstream([train]) if update_timing.signature(op)
                    and ("Sparse" in op.type or op.type.startswith("Scatter"))]


def test_updates_follow_the_replayed_step_each_device_in_turn():
    """Each device's updates one after another (cold chain times), the devices side by
    side: 2 + 3 ms on one device, 4 ms on another: 5 ms.  Two worker processes on two
    cores update their own copies at once: their shared times.  The replay itself
    prices them as bare ops (the kernel's 1 ms alone)."""
    flow = dict(sigs=["k", "u", "v", "w"], flops=[0.0] * 4, deps=[[], [0], [0], [0]],
                inputs=[], hops=[0] * 4, updates=[(1, "a"), (2, "a"), (3, "b")])
    one = lambda alone, shared: {"alone": alone, "shared": shared}  # noqa: E731
    timings = {"k": one(1e-3, 1e-3), "u": one(2e-3, 3e-3), "v": one(3e-3, 5e-3),
               "w": one(4e-3, 6e-3)}
    assert local_step.update_seconds(flow, timings) == pytest.approx(5e-3)
    assert local_step.update_seconds(flow, timings, 2, 2) == pytest.approx(8e-3)
    assert local_step.update_seconds(flow, timings, 4, 2) == pytest.approx(16e-3)
    assert local_step.update_seconds(flow, dict(timings, w=None)) is None
    assert local_step.update_seconds(dict(flow, updates=[]), timings) is None
    costs = dict(op=0.0, handoff=0.0, hop=0.0)
    assert local_step.replay(flow, timings, costs, 0.0, 2, 1e9, 1) == pytest.approx(1e-3)


def _fixed(updates):
    """``product_timing.timed``: every kernel 1 ms alone and 2 ms shared, the executor's
    own costs nothing, the updates ``updates`` (None: not timed)."""
    def timed(sigs, cores, path=None):
        out = {}
        for s in sigs:
            if s in (product_timing.EXECUTOR, product_timing.HOP, product_timing.HANDOFF):
                out[s] = {"alone": 0.0, "shared": 0.0}
            elif s.startswith('["update"'):
                out[s] = updates
            else:
                out[s] = {"alone": 1e-3, "shared": 2e-3}
        return out
    return timed


def test_a_replayed_step_adds_its_timed_updates(monkeypatch, tmp_path):
    """One stage on Cluster.local, two replicas in one process: with its updates timed
    (1 ms each), they add their sum once (one copy of the variables) after the replay,
    where they are bare ops; with one not timed, the update is priced from the state's
    bytes at the memory bandwidth as before, and the replay is the same."""
    monkeypatch.setenv("EPL_CACHE_DIR", str(tmp_path))
    prof = graph_profile.profile(auto_models.model, auto_models.dataset,
                                 lambda: v1.train.AdamOptimizer(0.1))
    prof.input_seconds = lambda: 0.0
    flow = prof.dataflow()
    updates = set(i for i, _ in flow["updates"])
    assert len(updates) >= 4
    assert all(flow["sigs"][i].startswith('["update"') for i in updates)
    cluster = Cluster.from_local(dict(local.measure(quick=True), cores=2), 2)
    cluster.time_products = True
    got = {}
    for name, timed in (("timed", {"alone": 1e-3, "shared": 1e-3}), ("untimed", None)):
        monkeypatch.setattr(product_timing, "timed", _fixed(timed))
        got[name] = price(prof, Layout(d=2), cluster).breakdown
    jobs = [(2e-3, 2.0) if s is not None and i not in updates else (0.0, 1.0)
            for i, s in enumerate(flow["sigs"])]
    assert got["timed"]["compute_s"] == pytest.approx(
        dataflow.makespan(jobs, flow["deps"], 2, 2))
    assert got["untimed"]["compute_s"] == got["timed"]["compute_s"]
    assert got["timed"]["optimizer_s"] == pytest.approx(len(updates) * 1e-3)
    assert got["untimed"]["optimizer_s"] > 0.0


def test_the_built_steps_updates_are_found(monkeypatch, tmp_path):
    """A pipeline's step as EPL builds it (stages, micro-batch clones) updates each
    variable once, as the model's own step does."""
    monkeypatch.setenv("EPL_CACHE_DIR", str(tmp_path))
    prof = graph_profile.profile(auto_models.model, auto_models.dataset, auto_models.optimizer)
    one = prof.dataflow()
    flow = prof.built_dataflow(Layout(p=2, num_micro_batch=2).to_config(2))
    assert len(flow["updates"]) == len(one["updates"]) > 0
    assert all(json.loads(flow["sigs"][i])[1] in ("ApplyGradientDescent",
                                                  "ResourceApplyGradientDescent")
               for i, _ in flow["updates"])
    # each on its stage's device: both stages update variables
    assert len(set(device for _, device in flow["updates"])) == 2


@pytest.mark.parametrize("wake", dataflow.WAKES)
def test_the_replicas_wake_ups_are_priced_as_the_cluster_says(monkeypatch, tmp_path, wake):
    """A wide kernel's wake-up (its lone run, 1.5 ms, less its chain, 1 ms) reaches the
    replay of two replicas as ``Cluster.wake_up`` says (``dataflow.WAKES``): a wait
    the replicas sit out at once, or core-seconds beside the other's work; the setting
    survives the cluster's JSON."""
    monkeypatch.setenv("EPL_CACHE_DIR", str(tmp_path))
    prof = graph_profile.profile(auto_models.model, auto_models.dataset, auto_models.optimizer)
    prof.input_seconds = lambda: 0.0
    flow = prof.dataflow()
    updates = set(i for i, _ in flow["updates"])
    plain = _fixed(None)

    def timed(sigs, cores, path=None):
        out = plain(sigs, cores, path)
        for s, x in out.items():
            if x and x.get("alone"):
                out[s] = dict(x, first=1.5e-3)
        return out
    monkeypatch.setattr(product_timing, "timed", timed)
    cluster = Cluster.from_local(dict(local.measure(quick=True), cores=2), 2)
    cluster.time_products = True
    cluster.wake_up = wake
    assert Cluster.from_dict(cluster.to_dict()).wake_up == wake
    got = price(prof, Layout(d=2), cluster).breakdown["compute_s"]
    jobs = [(2e-3, 2.0, 5e-4) if s is not None and i not in updates else (0.0, 1.0)
            for i, s in enumerate(flow["sigs"])]
    assert got == pytest.approx(dataflow.makespan(jobs, flow["deps"], 2, 2, wake=wake))
    other = [w for w in dataflow.WAKES if w != wake][0]
    assert got != pytest.approx(dataflow.makespan(jobs, flow["deps"], 2, 2, wake=other))


def test_a_cluster_says_how_wake_ups_are_paid_and_a_mistyped_rule_is_named():
    local = Cluster.from_local(dict(matmul_flops=1e10, memory_bandwidth=1e10,
                                    allreduce_bandwidth=1e9, allreduce_latency_s=1e-4,
                                    cache_bytes=32 << 20), 2)
    assert local.wake_up == "wait"      # (a small last-level cache: machines.wake_up_for)
    d = local.to_dict()
    d.pop("wake_up")                      # a cluster JSON of before: the default
    assert Cluster.from_dict(d).wake_up == "wait"
    with pytest.raises(ValueError, match="wake_up must be one of wait, work, got 'wake'"):
        Cluster.from_dict(dict(d, wake_up="wake"))
