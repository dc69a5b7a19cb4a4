"""The rewrite's analyses alone (issue 25): each returns a value and edits nothing.

The layout (``plan.plan``), the selection and its update plan (``selection.select``),
the placement of a worker's clones (``placement.place``) and the ZeRO owners
(``zero.plan_owners``) are functions of the graph, the cluster and the config;
``rewrite.prepare_state`` makes the passes' state from their values.  Small graphs,
no session: the numbers are tested by the passes' tests and the oracles.
"""
import numpy as np
import pytest
import tensorflow.compat.v1 as tf

import epl
from epl import ir
from epl.core import layout as planner
from epl.core.cluster import Cluster
from epl.core.process_state import Env
from epl.rewrite import placement, prepare_state, selection, zero
from epl.tf_adapter import graph as tfg


def _init(devices=2, **extra):
    cfg = {"cluster.devices_per_worker": devices}
    cfg.update(extra)
    epl.init(epl.Config(cfg))


def _worker(index, workers=2, devices=2, **extra):
    """This process as worker ``index`` of ``workers`` (each with ``devices`` devices)."""
    cfg = {"cluster.devices_per_worker": devices}
    cfg.update(extra)
    config = epl.Config(cfg)
    hosts = ["localhost:%d" % (2222 + i) for i in range(workers)]
    return config, Cluster(config, visible_gpus=0, tf_config={
        "cluster": {"worker": hosts}, "task": {"type": "worker", "index": index}})


def _two_stage_model():
    x = tf.placeholder(tf.float32, [None, 3], name="x")
    y = tf.placeholder(tf.float32, [None, 1], name="y")
    with epl.replicate(1, name="s0"):
        w0 = tf.get_variable("w0", initializer=np.eye(3, dtype=np.float32))
        h = tf.matmul(x, w0, name="h")
    with epl.replicate(1, name="s1"):
        w1 = tf.get_variable("w1", initializer=np.ones((3, 1), np.float32))
        loss = tf.reduce_mean(tf.square(tf.matmul(h, w1, name="out") - y), name="loss")
    train = tf.train.AdamOptimizer(0.1).minimize(loss)
    return x, y, w0, w1, loss, train


def _linear():
    x = tf.placeholder(tf.float32, [None, 3], name="x")
    y = tf.placeholder(tf.float32, [None, 1], name="y")
    epl.set_default_strategy(epl.replicate(1))
    w = tf.get_variable("w", initializer=np.ones((3, 1), np.float32))
    pred = tf.matmul(x, w, name="pred")
    loss = tf.reduce_mean(tf.square(pred - y), name="loss")
    train = tf.train.GradientDescentOptimizer(0.1).minimize(loss)
    return x, y, w, pred, loss, train


def _graph_size():
    g = tf.get_default_graph()
    return tfg.last_op_id(g), [(op.name, op.device, list(op.control_inputs))
                               for op in g.get_operations()]


# -------------------------------------------------------------------------- placement

def test_place_data_parallel_one_worker():
    _init(devices=2)
    env = Env.get()
    x, y, w, pred, loss, train = _linear()
    layout = planner.plan(env.cluster, ir.Graph.get().taskgraphs, env.config)
    where = placement.place(layout, env.cluster, env.config)
    assert not where.in_graph
    assert where.clones == [(0, 0, 0), (1, 0, 1)]
    assert where.devices == [env.cluster.local_device(0), env.cluster.local_device(1)]
    assert where.stage_devices == [[d] for d in where.devices]
    assert where.reps == [0, 1] and where.pull_groups == [[0], [1]]


def test_place_pipeline_stages_and_micro_batches():
    """2 stages x 2 micro-batches on 2 devices: each clone (micro-batch) runs stage s on
    device s; micro-batch 1 uses micro-batch 0's variables."""
    _init(devices=2, **{"pipeline.num_micro_batch": 2})
    env = Env.get()
    _two_stage_model()
    layout = planner.plan(env.cluster, ir.Graph.get().taskgraphs, env.config)
    where = placement.place(layout, env.cluster, env.config)
    d0, d1 = env.cluster.local_device(0), env.cluster.local_device(1)
    assert where.stage_devices == [[d0, d1], [d0, d1]]
    assert where.reps == [0, 0]


def test_place_keeps_this_workers_clones_between_graphs():
    """Worker 1 of 2 (2 devices each) builds its own 2 clones, on its local devices."""
    _init(devices=2)
    _linear()
    config, cluster = _worker(1)
    layout = planner.plan(cluster, ir.Graph.get().taskgraphs, config)
    where = placement.place(layout, cluster, config)
    assert [cl[2] for cl in where.clones] == [2, 3]
    assert where.devices == [cluster.local_device(0), cluster.local_device(1)]
    assert not where.in_graph


def test_place_refuses_io_slicing_in_graph():
    _init(devices=2)
    _two_stage_model()
    config, cluster = _worker(0, devices=1, **{"io.slicing": True})
    layout = planner.plan(cluster, ir.Graph.get().taskgraphs, config)
    assert planner.in_graph(layout, cluster, config)   # a pipeline over 2 workers
    with pytest.raises(ValueError, match="'io.slicing' = True, but this job runs in-graph"):
        placement.place(layout, cluster, config)


# -------------------------------------------------------------------------- selection

def test_select_returns_the_replica_and_edits_nothing():
    _init(devices=2)
    x, y, w, pred, loss, train = _linear()
    before = _graph_size()
    sel = selection.select(ir.Graph.get(), ir.Graph.get().taskgraphs, share_variables=False)
    assert _graph_size() == before
    assert pred.op in sel and loss.op in sel and train in sel
    assert x.op not in sel and y.op not in sel          # fed: sliced, not copied
    assert sel.placeholders == [x.op, y.op]
    assert sel.variables == [w.op] and sel.shared == []
    # The update plan: the one gradient reduced before the update reads it.
    assert sel.updates is not None and len(ir.Graph.get().gradient_records) == 1


def test_select_shares_variables_and_their_update():
    _init(devices=2)
    x, y, w, pred, loss, train = _linear()
    sel = selection.select(ir.Graph.get(), ir.Graph.get().taskgraphs, share_variables=True)
    assert w.op in sel.shared and w.op not in sel
    assert train in sel.shared          # the update runs once per worker
    assert pred.op in sel and pred.op not in sel.shared


# -------------------------------------------------------------------------- ZeRO owners

def test_zero_owners_balance_bytes_and_keep_slots_with_their_variable():
    """Variables of 400, 300, 200 and 100 bytes over 2 devices: largest first onto the
    least loaded (400 | 300 + 200 ... ), each Adam slot with its variable; nothing
    edited."""
    _init(devices=2, **{"zero.level": "v1"})
    env = Env.get()
    epl.set_default_strategy(epl.replicate(1))
    x = tf.placeholder(tf.float32, [None, 100])
    sizes = {"a": 100, "b": 75, "c": 50, "d": 25}
    ws = {n: tf.get_variable(n, initializer=np.ones((100, k), np.float32) / 100)
          for n, k in sizes.items()}
    loss = tf.add_n([tf.reduce_sum(tf.matmul(x, w)) for w in ws.values()])
    tf.train.AdamOptimizer(0.1).minimize(loss)
    layout = planner.plan(env.cluster, ir.Graph.get().taskgraphs, env.config)
    where = placement.place(layout, env.cluster, env.config)
    sel = selection.select(ir.Graph.get(), ir.Graph.get().taskgraphs, share_variables=True)
    before = _graph_size()
    owners = zero.plan_owners(sel.shared, lambda op: 0, where)
    assert _graph_size() == before
    d0, d1 = where.devices
    by_name = {op.name: dev for op, dev in owners.items()}
    assert by_name["a"] == d0 and by_name["b"] == d1 and by_name["c"] == d1 \
        and by_name["d"] == d0
    for n in sizes:    # Adam's two slots live with their variable
        assert by_name["%s/Adam" % n] == by_name[n] == by_name["%s/Adam_1" % n]


# -------------------------------------------------------------------------- prepare_state

def test_prepare_state_is_made_of_the_analyses_values_and_runs_no_pass():
    _init(devices=2, **{"zero.level": "v1"})
    env = Env.get()
    x, y, w, pred, loss, train = _linear()
    state = prepare_state(ir.Graph.get(), env.config, env.cluster)
    g = tf.get_default_graph()
    assert not any(op.name.startswith("EPL_REPLICA_") for op in g.get_operations())
    layout = planner.plan(env.cluster, ir.Graph.get().taskgraphs, env.config)
    where = placement.place(layout, env.cluster, env.config)
    assert state.devices == where.devices and state.reps == where.reps
    assert state.num_clones == 2 and state.selection.variables == []
    assert w.op in state.selection.shared
    assert state.zero_owners == zero.plan_owners(state.selection.shared, lambda op: 0, where)
    assert state.zero_owners[w.op] == where.devices[0]
