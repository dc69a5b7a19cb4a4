"""offload.level = v0: every variable (and optimizer slot) lives in host memory and
nothing else changes (oracle: the same program without offload / without EPL).

On CPU the host is one more virtual device after the training devices."""
import numpy as np
import pytest
import tensorflow.compat.v1 as tf

import epl
from epl.rewrite.updates import VARIABLE_OPS
from tests import models
from tests.test_gradient_checkpoint import assert_same, program

OFFLOAD = {"offload.level": "v0"}


def _variables(graph):
    return [op for op in graph.get_operations() if op.type in VARIABLE_OPS]


def _traced_devices(config, graph_fn):
    """{op name: device it ran on} for one traced step of ``graph_fn()``'s op."""
    models.reset()
    epl.init(epl.Config(config))
    op = graph_fn()
    with tf.Session() as sess:
        sess.run(tf.global_variables_initializer())
        md = tf.RunMetadata()
        sess.run(op, options=tf.RunOptions(
            trace_level=tf.RunOptions.FULL_TRACE), run_metadata=md)
    # ("/host:CPU" entries are the tracer's own records of the same kernels.)
    return {n.node_name: d.device for d in md.step_stats.dev_stats for n in d.node_stats
            if not d.device.startswith("/host:")}


@pytest.mark.parametrize("optimizer", ["momentum", "adam"])
def test_one_device_equals_plain_program(optimizer):
    want = program(None, 16, optimizer, dropout=False)
    got = program(dict(OFFLOAD), 16, optimizer, dropout=False, default=False)
    assert_same(got, want)
    variables = _variables(got[2])
    assert variables and all(op.device.endswith("CPU:1") for op in variables), \
        [(op.name, op.device) for op in variables if not op.device.endswith("CPU:1")]


@pytest.mark.parametrize("copies", ["per_worker", "per_device"])
@pytest.mark.parametrize("devices", [2, 4])
def test_data_parallel(devices, copies):
    config = {"cluster.devices_per_worker": devices, "cluster.variable_copies": copies}
    want = program(dict(config), 8 * devices, "adam", dropout=False)
    got = program(dict(config, **OFFLOAD), 8 * devices, "adam", dropout=False)
    assert_same(got, want)
    host = "CPU:%d" % devices
    variables = _variables(got[2])
    slots = [op for op in variables if "Adam" in op.name]
    assert slots and all(op.device.endswith(host) for op in variables), \
        [(op.name, op.device) for op in variables if not op.device.endswith(host)]
    if copies == "per_device":    # every replica's copy, on the host too
        last = [op for op in slots if op.name.startswith("EPL_REPLICA_%d/" % (devices - 1))]
        assert len(last) * devices == len(slots)


def test_pipeline():
    config = {"cluster.devices_per_worker": 2, "pipeline.num_micro_batch": 2}
    want = program(dict(config), 16, "momentum", stages=2, dropout=False)
    got = program(dict(config, **OFFLOAD), 16, "momentum", stages=2, dropout=False)
    assert_same(got, want)
    assert all(op.device.endswith("CPU:2") for op in _variables(got[2]))


def test_compute_stays_on_the_devices():
    """The updates run beside the variables (host); the layers and their gradients on
    the devices, each replica on its own."""
    def build():
        epl.set_default_strategy(epl.replicate(1))
        x, y = models.input_batch(*models.data(16), batch=8)
        _, loss = models.forward(x, y)
        return tf.train.MomentumOptimizer(0.1, 0.9).minimize(loss)
    ran = _traced_devices({"cluster.devices_per_worker": 2, "offload.level": "v0"}, build)
    host = "CPU:2"
    layers = [(n, d) for n, d in ran.items() if "dense" in n and "Momentum" not in n
              and not n.endswith(("/read", "/kernel", "/bias"))]
    updates = [d for n, d in ran.items() if "ApplyMomentum" in n]
    assert len(updates) == 4 and all(d.endswith(host) for d in updates), updates
    assert layers and not [(n, d) for n, d in layers if d.endswith(host)]
    assert set(d[-5:] for _, d in layers) == {"CPU:0", "CPU:1"}


@pytest.mark.parametrize("first, second", [(OFFLOAD, {}), ({}, OFFLOAD)])
def test_checkpoints_interchange(tmp_path, first, second):
    """Written with offload, restored without it (and the other way): the restored
    run continues exactly where the first stopped (oracle: 4 steps in one go)."""
    got, want = models.checkpoint_handover(tmp_path, first, second, "momentum")
    models.assert_weights_close(got, want)


def test_split_is_refused():
    models.reset()
    epl.init(epl.Config({"cluster.devices_per_worker": 2, "offload.level": "v0"}))
    with epl.split(2):
        h = tf.layers.dense(tf.ones([4, 8]), 8)
        loss = tf.reduce_sum(h)
    op = tf.train.GradientDescentOptimizer(0.1).minimize(loss)
    with pytest.raises(NotImplementedError, match="'offload.level' = 'v0' with an epl.split"):
        with tf.Session() as sess:
            sess.run(op)



def test_memory_features_together():
    """Auto GC, offload and 3 apply groups at once, on 2 devices with 2 micro-batches:
    the numbers of the same program without them."""
    config = {"cluster.devices_per_worker": 2, "pipeline.num_micro_batch": 2}
    want = program(dict(config), 32, "adam")
    got = program(dict(config, **{"offload.level": "v0", "gradient_checkpoint.type": "auto",
                                  "optimizer.num_apply_group": 3}), 32, "adam")
    assert_same(got, want)


def test_accumulation_across_runs_with_gc_and_offload():
    """No annotation, 4 micro-batches across runs, with GC and offload: the big-batch
    steps of the local model."""
    steps, m, mb = 3, 4, 8
    x, y = models.data(steps * m * mb)
    want, _ = models.train_local(x, y, m * mb, steps, "adam")
    models.reset()
    epl.init(epl.Config({"pipeline.num_micro_batch": m, "offload.level": "v0",
                         "gradient_checkpoint.type": "auto"}))
    bx, by = models.input_batch(x, y, mb)
    _, loss = models.forward(bx, by)
    op = models.train_op(loss, "adam", tf.train.get_or_create_global_step())
    got = models.run_steps(op, steps * m, {n: models.value_tensor(
        tf.get_default_graph(), n) for n in models.initial_weights()})
    models.assert_weights_close(got, want)
    assert all(op.device.endswith("CPU:1") for op in _variables(tf.get_default_graph()))
