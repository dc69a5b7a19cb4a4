"""Communication per transformer block under epl.split(n) (issue 35): read from the
rewritten graph of a training step of the GPT-style decoder (tests/transformer_models).

Megatron-LM's block has one all-reduce after the attention and one after the MLP in
the forward pass and their mirror images in the backward pass.  EPL's layout (docs/
split.md, "Communication per block") does the same reductions as sums on the split's
first device: forward, the n partial products of the attention's output projection
and of the MLP's second layer; backward, the partial gradients of the column-parallel
layers' input (Q/K/V's are first added on each device, where they read one copy of
their input; then the MLP's first layer).  Each sum's result is then read by the other
devices once.  So per block and pass, exactly two tensors of the activation's size
travel into device 0 from each other device for the sums, and two travel out.
"""
import numpy as np
import pytest
import tensorflow.compat.v1 as tf

import epl
from epl import ir
from tests import transformer_models as tm

BATCH = 4


def _step_ops(op):
    """The ops a run of ``op`` executes (its data and control inputs, transitively)."""
    return ir.upstream([op])


def _block(o, depth=2):
    """The block index an op of the step belongs to (by its name or its inputs', up
    to ``depth`` ops back: a gradient sum's inputs may be sums themselves)."""
    for b in range(tm.LAYERS):
        if "block_%d/" % b in o.name:
            return b
    for t in o.inputs if depth else ():
        b = _block(t.op, depth - 1)
        if b is not None:
            return b
    return None


def _train_step(n, width=16, heads=4):
    epl.init(epl.Config({"cluster.devices_per_worker": n}))
    model = tm.Decoder(width=width, heads=heads)
    pi = tf.placeholder(tf.int64, [BATCH, tm.SEQ])
    pl = tf.placeholder(tf.int64, [BATCH, tm.SEQ])
    with epl.split(n):
        loss = model.build(pi, pl)
    op = tf.train.AdamOptimizer(0.01).minimize(loss)
    ids, labels = tm.data(BATCH)
    with tf.Session() as sess:
        sess.run(tf.global_variables_initializer())
        sess.run(op, {pi: ids, pl: labels})   # (the rewrite happens before this step)
    return _step_ops(op)


@pytest.mark.parametrize("n", [2, 4])
def test_two_sums_per_block_forward_and_backward(n):
    width = 16
    ops = _train_step(n, width)
    activation = [BATCH, tm.SEQ, width]
    sums = {}
    for o in ops:
        devices = set(t.op.device for t in o.inputs)
        if o.type != "AddN" or len(devices) < 2:
            continue
        b = _block(o)
        if b is None:
            continue   # (the LM head's input gradient, the sharded loss's [batch] sums)
        # Every partial is a whole activation, one per device (Q/K/V's input gradients
        # are summed on their device first).
        assert all(t.shape.as_list() == activation for t in o.inputs), o.name
        assert len(devices) == n and len(o.inputs) == n, (o.name, devices)
        key = (b, "backward" if o.name.startswith("gradients") else "forward")
        sums.setdefault(key, []).append(o)
    for b in range(tm.LAYERS):
        fwd = sorted(o.name.split("/")[1] for o in sums[(b, "forward")])
        assert fwd == ["fc_out", "proj"], fwd
        bwd = sums[(b, "backward")]
        assert len(bwd) == 2, [o.name for o in bwd]
        # All sums on the split's first device.
        assert len(set(o.device for o in sums[(b, "forward")] + bwd)) == 1


def test_activations_cross_devices_only_at_the_sums_and_their_results():
    """Per block, the activation-sized tensors a step moves between devices: forward,
    (n-1) partials into each of the 2 sums and the 2 LayerNorm outputs out to the n-1
    other devices; backward, the same in mirror image (the gradient of each sum's
    result out to the shards, the partial input gradients in).  Without the per-device
    copy of the attention's input, Q/K/V would send their input gradients separately
    (3 (n-1) instead of n-1)."""
    n, width = 2, 16
    ops = _train_step(n, width)
    size = BATCH * tm.SEQ * width
    moved = {}
    for o in ops:
        b = _block(o)
        for t in o.inputs:
            if t.op.device == o.device or not t.shape.is_fully_defined():
                continue
            if int(np.prod(t.shape.as_list())) < size:
                continue
            if b is None:
                b = _block(t.op)
            if b is None:
                continue
            pass_ = "backward" if o.name.startswith("gradients") else "forward"
            moved.setdefault((b, pass_), set()).add((t.name, o.device))
    for b in range(tm.LAYERS):
        assert len(moved[(b, "forward")]) == 4 * (n - 1), sorted(moved[(b, "forward")])
        assert len(moved[(b, "backward")]) == 4 * (n - 1), \
            sorted(moved[(b, "backward")])
