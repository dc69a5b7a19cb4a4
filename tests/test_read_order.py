"""Every read of a variable in a step is ordered before that variable's update (trust III,
item 1): a graph analysis over the rewritten graph, and the pipeline oracle repeated beside
a busy process, where TensorFlow is freest to pick another op order."""
import json
import os
import subprocess
import sys

import numpy as np
import pytest
import tensorflow.compat.v1 as tf

import epl
from epl.rewrite import read_order
from tests import pipeline_race

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def test_the_analysis_finds_the_race_of_an_ungated_update():
    """tf.gradients + apply_gradients without EPL: each layer's dX (which feeds the layer
    below) is unordered with that layer's update -- the analysis must see it (it can
    fail), and ``minimize``'s per-op gate orders them."""
    x, y = pipeline_race.data(8)
    loss = pipeline_race.model(tf.constant(x), tf.constant(y), 2)
    op = pipeline_race.train_op(loss, "gradients")
    pairs = read_order.unordered_reads(tf.get_default_graph(), [op])
    kinds = set((w.type, r.type) for w, r in pairs)
    assert ("ApplyGradientDescent", "Conv2DBackpropInput") in kinds, kinds
    # Every kernel but conv1's (the images need no gradient: no dX), and the logits'.
    updated = set(w.name for w, _ in pairs)
    assert len(updated) == 2 * pipeline_race.LAYERS_PER_STAGE - 1 + 1, sorted(updated)


def test_gated_updates_have_no_unordered_read():
    x, y = pipeline_race.data(8)
    loss = pipeline_race.model(tf.constant(x), tf.constant(y), 2)
    op = pipeline_race.train_op(loss, "minimize")
    assert read_order.unordered_reads(tf.get_default_graph(), [op]) == []


def test_readers_of_ref_and_resource_variables():
    with tf.variable_scope("ref"):
        a = tf.get_variable("a", [2, 2], use_resource=False)
    with tf.variable_scope("res"):
        b = tf.get_variable("b", [2, 2], use_resource=True)
    x = tf.ones([3, 2])
    ya, yb = tf.matmul(x, a), tf.matmul(x, b)
    assign = a.assign_add(tf.ones([2, 2]))
    readers_a = read_order.variable_readers(a.op)
    assert ya.op in readers_a and a.value().op in readers_a   # through the ref's Identity
    assert assign.op not in readers_a                       # a write, not a read
    readers_b = read_order.variable_readers(b.op)
    # A resource read takes the value when ReadVariableOp runs (an update copies first).
    assert yb.op not in readers_b
    assert yb.op.inputs[1].op in readers_b and yb.op.inputs[1].op.type == "ReadVariableOp"


@pytest.mark.parametrize("how", ["minimize", "gradients"])
@pytest.mark.parametrize("stages, micro, schedule", [
    (2, 1, "PreferForward"), (2, 4, "PreferBackward"), (4, 4, "PreferForward"),
    (4, 4, "PreferBackward")])
def test_rewritten_pipelines_read_before_they_update(stages, micro, schedule, how):
    """The rewritten graph of a conv-net pipeline (GPipe and 1F1B, 2/4 stages, with and
    without micro-batches, gated or ungated updates) orders every read of a weight --
    every micro-batch's forward and backward -- before its update."""
    op = pipeline_race.build_epl(stages, micro, 2, schedule, how)
    with tf.Session() as sess:
        sess.run(tf.global_variables_initializer())
        sess.run(op)        # (the rewrite runs before the first step)
    graph = tf.get_default_graph()
    pairs = read_order.unordered_reads(graph, [op])
    assert pairs == [], [(w.name, r.name) for w, r in pairs[:5]]
    # Every micro-batch's copy of a stage's reads is in the step the analysis walked.
    copies = [o for o in graph.get_operations()
              if o.type == "Conv2DBackpropInput" and o.name.startswith("EPL_REPLICA_")]
    assert len(copies) >= (micro - 1) * (stages * pipeline_race.LAYERS_PER_STAGE - 1)


def test_data_parallel_reads_before_updates():
    epl.init(epl.Config({"cluster.devices_per_worker": 2,
                         "communication.max_splits": 4}))
    epl.set_default_strategy(epl.replicate(1))
    x, y = pipeline_race.data(8)
    ds = tf.data.Dataset.from_tensor_slices((x, y)).batch(2).repeat()
    bx, by = tf.data.make_one_shot_iterator(ds).get_next()
    op = pipeline_race.train_op(pipeline_race.model(bx, by, 2), "gradients")
    with tf.Session() as sess:
        sess.run(tf.global_variables_initializer())
        sess.run(op)
    assert read_order.unordered_reads(tf.get_default_graph(), [op]) == []


@pytest.fixture
def busy_cpu():
    """A process that keeps one core busy, as on a shared machine."""
    proc = subprocess.Popen([sys.executable, "-c", "while True: pass"])
    yield proc
    proc.kill()
    proc.wait()


@pytest.mark.alone   # (it loads the cores on purpose: conftest.py)
@pytest.mark.timeout(600)
@pytest.mark.parametrize("stages, micro, schedule, runs", [
    (4, 4, "PreferForward", 8), (4, 4, "PreferBackward", 3), (2, 2, "PreferBackward", 2)])
def test_pipeline_equals_local_model_under_load(busy_cpu, stages, micro, schedule, runs):
    """The conv-net pipeline trained ``runs`` times beside a busy process (each run a new
    graph and session, in one worker process) equals the same model without EPL every
    time: an op order TensorFlow may pick only under load must not change a number."""
    cmd = [sys.executable, os.path.join(ROOT, "tests", "pipeline_race.py"),
           "--stages", str(stages), "--micro", str(micro), "--schedule", schedule,
           "--runs", str(runs)]
    out = subprocess.run(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, timeout=560,
                         env=dict(os.environ, TF_CPP_MIN_LOG_LEVEL="2"))
    assert out.returncode == 0, out.stderr.decode()[-3000:]
    results = [json.loads(line) for line in out.stdout.decode().splitlines()
               if line.startswith("{")]
    assert len(results) == runs, out.stdout.decode()
    for k, r in enumerate(results):
        assert r["off"] == [], "run %d of %d: %s" % (k + 1, runs, r)
        assert r["worst"] < 1e-5
    assert np.isfinite([r["worst"] for r in results]).all()
