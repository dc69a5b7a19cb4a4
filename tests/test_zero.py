"""zero.level = v1: each variable's optimizer state lives on one device of its stage
(balanced by bytes), its update runs there; the numbers are plain data
parallelism's (oracle: the same program without ZeRO, 1e-5)."""
import numpy as np
import pytest
import tensorflow.compat.v1 as tf

import epl
from epl.rewrite.updates import VARIABLE_OPS
from tests import models
from tests.test_gradient_checkpoint import assert_same, program

ZERO = {"zero.level": "v1"}


def _bytes(op):
    return int(np.prod(tf.TensorShape(op.get_attr("shape")).as_list())) * 4


def _slot_bytes_per_device(graph):
    out = {}
    for op in graph.get_operations():
        if op.type in VARIABLE_OPS and ("Adam" in op.name or "Momentum" in op.name):
            out[op.device] = out.get(op.device, 0) + _bytes(op)
    return out


@pytest.mark.parametrize("optimizer", ["momentum", "adam"])
@pytest.mark.parametrize("devices", [2, 4])
def test_equals_plain_data_parallel(devices, optimizer):
    config = {"cluster.devices_per_worker": devices}
    want = program(dict(config, **{"cluster.variable_copies": "per_device"}), 8 * devices,
                   optimizer, dropout=False)
    got = program(dict(config, **ZERO), 8 * devices, optimizer, dropout=False)
    assert_same(got, want)
    per_device = _slot_bytes_per_device(got[2])
    assert len(per_device) == devices, per_device
    slots = [op for op in got[2].get_operations() if op.type in VARIABLE_OPS
             and ("Adam" in op.name or "Momentum" in op.name) and op.get_attr("shape")]
    total = sum(_bytes(op) for op in slots)
    largest = max(_bytes(op) for op in slots)
    assert max(per_device.values()) <= (total / devices + largest) * 1.01, per_device


# Ref variables (disable_v2_behavior) and resource variables (disable_eager_execution).
MOMENTUM_UPDATES = ("ApplyMomentum", "ResourceApplyMomentum")


def test_updates_run_beside_their_state():
    """Each update on its owner device, beside its slots, reading its gradient reduced
    to that device."""
    got = program(dict({"cluster.devices_per_worker": 2}, **ZERO), 16, "momentum",
                  dropout=False)
    graph = got[2]
    for op in graph.get_operations():
        if op.type in MOMENTUM_UPDATES:
            assert op.device == op.inputs[0].op.device == op.inputs[1].op.device, op.name
            # its gradient is reduced to this device only (not all-reduced)
            grad = op.inputs[3].op
            assert grad.type == "EplReduce" and grad.device == op.device, (op.name, grad)
    assert not [op for op in graph.get_operations() if op.type.startswith("EplAllReduce")]
    assert len(set(op.device for op in graph.get_operations()
                   if op.type in MOMENTUM_UPDATES)) == 2


def test_with_micro_batches():
    config = {"cluster.devices_per_worker": 2, "pipeline.num_micro_batch": 2}
    want = program(dict(config), 32, "adam", dropout=False)
    got = program(dict(config, **ZERO), 32, "adam", dropout=False)
    assert_same(got, want)


def test_two_stage_pipeline_two_replicas():
    """Per stage, over that stage's replicas: stage 0's state on devices 0 and 2."""
    config = {"cluster.devices_per_worker": 4, "pipeline.num_micro_batch": 2}
    want = program(dict(config), 32, "adam", stages=2, dropout=False)
    got = program(dict(config, **ZERO), 32, "adam", stages=2, dropout=False)
    assert_same(got, want)
    ir = epl.Graph.get(got[2])
    per_stage = {}
    for op in got[2].get_operations():
        if op.type in VARIABLE_OPS and "Adam" in op.name and ir.taskgraph_of(op) is not None:
            per_stage.setdefault(ir.taskgraph_of(op).index, set()).add(op.device[-5:])
    assert all(len(devs) == 2 for devs in per_stage.values()), per_stage
    assert not per_stage[0] & per_stage[1], per_stage


def test_checkpoint_restores_into_plain_program(tmp_path):
    got, want = models.checkpoint_handover(tmp_path, ZERO, {}, "adam")
    models.assert_weights_close(got, want)


def test_with_offload_refused():
    models.reset()
    epl.init(epl.Config({"cluster.devices_per_worker": 2, "zero.level": "v1",
                         "offload.level": "v0"}))
    epl.set_default_strategy(epl.replicate(1))
    x, y = models.data(8)
    _, loss = models.forward(tf.constant(x), tf.constant(y))
    op = tf.train.GradientDescentOptimizer(0.1).minimize(loss)
    with pytest.raises(NotImplementedError, match="'zero.level' = 'v1' with 'offload.level'"):
        with tf.Session() as sess:
            sess.run(op)
