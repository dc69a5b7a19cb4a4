"""The original project's hand-written MoE layer (issue 24, item 3): a
``tf.layers.Layer`` whose ``build`` makes ``add_weight`` experts
``[E, m, h]`` and whose ``call`` runs two ``tf.einsum`` over them, both under
``epl.split()``, fed straight from the input pipeline (the batch's first dimension
is the expert dimension), its reshaped output read by a replicated
``tf.layers.dense``, then ``tf.gradients``, global- or per-tensor norm
clipping and ``apply_gradients``.

Oracle: the same program without EPL (same data, same initial values): one device
(a split over one device, the original's own setting) to 1e-5 over several steps,
for both clippings, with and without ``communication.clip_after_allreduce``; two
devices (experts sharded, each einsum computed shard by shard, each replica reading
its rows of the split's output) to 1e-5; AMP O1 with test_amp's loss-curve
tolerance against float32, and, with plain SGD (Adam's normalized steps hide a constant
factor on a gradient), each variable's update over two devices against float32's.
"""
import contextlib
import os

import numpy as np
import pytest
import tensorflow.compat.v1 as tf

import epl
from epl.tf_adapter import op_types
from tests import models

E, G, C, M, H, UNITS = 4, 2, 3, 8, 6, 5
STEPS, CLIP = 4, 0.5
_annotated = [False]


def _split():
    return epl.split() if _annotated[0] else contextlib.suppress()


def _values(seed=0):
    rng = np.random.RandomState(seed)
    return {"in": (rng.randn(E, M, H) * 0.3).astype(np.float32),
            "out": (rng.randn(E, H, M) * 0.3).astype(np.float32),
            "dense": (rng.randn(G * C * M, UNITS) * 0.2).astype(np.float32),
            "x": rng.randn(E * 10, G, C, M).astype(np.float32),
            "y": rng.randn(E * 10, UNITS).astype(np.float32)}


def _rows_of(value):
    """The initial ``value`` (a partition's rows of it, for the oracle's partitioned
    experts; tf.constant_initializer ignores partitions)."""
    def init(shape, dtype=None, partition_info=None):  # pylint: disable=unused-argument
        if partition_info is None:
            return tf.constant(value, dtype)
        return tf.slice(tf.constant(value, dtype), partition_info.var_offset, shape)
    return init


class FFN(tf.layers.Layer):
    """The expert FFN as the original project's test writes it."""

    def __init__(self, values, partitions=None, **kwargs):
        super(FFN, self).__init__(**kwargs)
        self.values = values
        self.partitioner = (tf.fixed_size_partitioner(partitions)
                            if partitions else None)

    def build(self, input_shape):
        with _split():
            self.in_weights = self.add_weight(
                "in_weights", [E, M, H], initializer=_rows_of(self.values["in"]),
                partitioner=self.partitioner)
            self.out_weights = self.add_weight(
                "out_weights", [E, H, M], initializer=_rows_of(self.values["out"]),
                partitioner=self.partitioner)
        super(FFN, self).build(input_shape)

    def call(self, inputs):
        with _split():
            inter = tf.einsum("EGCM,EMH->EGCH", inputs, self.in_weights, name="inter_outputs")
            out = tf.einsum("EGCH,EHM->EGCM", tf.nn.relu(inter), self.out_weights,
                            name="outputs")
            return tf.reshape(out, [-1, G * C * M])


def _logits(v, labels=False, partitions=None):
    """The model on the input pipeline's batch: (logits, targets).  Without ``labels``
    (the original's test) only the split reads the pipeline, and the targets are one
    vector for every row.  ``partitions``: the experts as TF's own partitioned variables
    (plain TF; what a split over that many devices stores)."""
    if labels:
        dataset = tf.data.Dataset.from_tensor_slices((v["x"], v["y"]))
    else:
        dataset = tf.data.Dataset.from_tensor_slices(v["x"])
    batch = tf.data.make_one_shot_iterator(dataset.batch(E).repeat()).get_next()
    x, y = batch if labels else (batch, tf.constant(v["y"][0]))
    out = FFN(v, partitions, name="ffn")(x)
    return tf.layers.dense(
        out, UNITS, kernel_initializer=tf.constant_initializer(v["dense"])), y


def _program(v, clip, labels=False, partitions=None, lr=0.01, optimizer=None):
    """(loss, train op) of the user's program (``clip`` None: no clipping; ``optimizer``
    a tf.train optimizer class, Adam by default)."""
    logits, y = _logits(v, labels, partitions)
    loss = tf.reduce_mean(tf.square(logits - y))
    optimizer = (optimizer or tf.train.AdamOptimizer)(lr)
    tvars = tf.trainable_variables()
    grads = tf.gradients(loss, tvars)
    if clip == "global":
        grads, _ = tf.clip_by_global_norm(grads, CLIP)
    elif clip is not None:
        grads = [tf.clip_by_norm(g, CLIP) for g in grads]
    with tf.control_dependencies(grads):
        return loss, optimizer.apply_gradients(list(zip(grads, tvars)))


def _train(v, clip, n=None, steps=None, tmpdir=None, labels=False, partitions=None,
           optimizer=None, lr=0.01, **config):
    """Losses per step and the checkpointed weights (local names) of the program, plain
    TF (``n`` None) or under EPL on ``n`` devices."""
    models.reset()
    steps = steps or STEPS
    _annotated[0] = n is not None
    if n is not None:
        cfg = {"cluster.devices_per_worker": n, "cluster.colocate_split_and_replicate": True}
        cfg.update(config)
        epl.init(epl.Config(cfg))
        epl.set_default_strategy(epl.replicate(1))
    loss, op = _program(v, clip, labels, partitions, lr=lr, optimizer=optimizer)
    if n is not None:
        epl.add_to_collection(loss, epl.GraphKeys.GLOBAL_MEAN_OBJECTS)
    with tf.Session() as sess:
        sess.run(tf.global_variables_initializer())
        losses = [sess.run([loss, op])[0] for _ in range(steps)]
        losses.append(sess.run(loss))
        path = tf.train.Saver().save(
            sess, os.path.join(str(tmpdir), "epl" if n else "local"))
    reader = tf.train.load_checkpoint(path)
    return np.array(losses), {k: reader.get_tensor(k)
                              for k in reader.get_variable_to_shape_map()}


def _assert_same(got, want):
    np.testing.assert_allclose(got[0], want[0], rtol=1e-5, err_msg="losses")
    assert sorted(got[1]) == sorted(want[1])
    for k in sorted(want[1]):
        np.testing.assert_allclose(got[1][k], want[1][k], rtol=1e-5, atol=1e-6, err_msg=k)


def test_clipping_bites():
    """The clip threshold is below the gradients' norms: the clipping variants differ."""
    models.reset()
    v = _values()
    loss, _ = _program(v, "global")
    grads = tf.gradients(loss, tf.trainable_variables())
    with tf.Session() as sess:
        sess.run(tf.global_variables_initializer())
        norms = sess.run([tf.norm(g) for g in grads])
    assert min(norms) > CLIP, norms


@pytest.mark.parametrize("clip,after,labels", [
    ("global", False, False), ("global", True, False), ("local", False, False),
    ("local", True, False), ("global", False, True)])
def test_split_over_one_device_equals_plain_tf(clip, after, labels, tmpdir):
    v = _values()
    want = _train(v, clip, tmpdir=tmpdir, labels=labels)
    got = _train(v, clip, n=1, tmpdir=tmpdir, labels=labels,
                 **{"communication.clip_after_allreduce": after})
    _assert_same(got, want)


@pytest.mark.parametrize("clip", ["global", "local"])
def test_split_over_two_devices_equals_plain_tf(clip, tmpdir):
    """Experts sharded over 2 devices, each einsum computed where its experts live; the
    split reads the input pipeline once (the global batch) and each replica reads its
    rows of the split's output; gradients reduced before clipping.  Per-tensor clipping
    sees each shard of a split variable as a variable of its own (as with TF's
    partitioned variables: docs/split.md), so its oracle stores the experts that way."""
    v = _values()
    want = _train(v, clip, tmpdir=tmpdir, partitions=2 if clip == "local" else None)
    got = _train(v, clip, n=2, tmpdir=tmpdir, **{"communication.clip_after_allreduce": True})
    _assert_same(got, want)
    graph = tf.get_default_graph()
    parts = [var for var in tf.trainable_variables()
             if var.op.name.startswith("ffn/in_weights/part_")]
    assert [int(p.shape[0]) for p in parts] == [2, 2]
    assert len(set(p.op.device for p in parts)) == 2
    products = [op for op in graph.get_operations()   # (TF 2.x: Einsum; 1.15: BatchMatMulV2)
                if op.type in op_types.einsum_products() and op.name.startswith("ffn/")]
    assert len(products) == 4 and all(int(op.inputs[0].shape[0]) == 2 for op in products)
    assert len(set(op.device for op in products)) == 2


@pytest.mark.parametrize("clip", ["global", "local"])
def test_split_over_two_devices_clipping_before_the_reduction(clip, tmpdir):
    """clip_after_allreduce False: each replica clips its own gradients (those of its
    rows, and the split's gradients, which are the same in every replica), then the
    clipped gradients are averaged.  Oracle: that computed in plain TF (experts stored as
    two partitions, as the split stores them: per-tensor clipping sees the shards)."""
    v = _values()
    models.reset()
    _annotated[0] = False
    logits, y = _logits(v, partitions=2)
    rows = tf.split(tf.square(logits - y), 2)
    per_replica = [tf.reduce_mean(r) for r in rows]
    loss = tf.add_n(per_replica) / 2.0
    tvars = tf.trainable_variables()
    experts = [t for t in tvars if t.op.name.startswith("ffn/")]
    dense = [t for t in tvars if t not in experts]
    split_grads = tf.gradients(loss, experts)
    clipped = []
    for part in per_replica:
        grads = tf.gradients(part, dense) + split_grads
        if clip == "global":
            grads, _ = tf.clip_by_global_norm(grads, CLIP)
        else:
            grads = [tf.clip_by_norm(g, CLIP) for g in grads]
        clipped.append(grads)
    mean = [(a + b) / 2.0 for a, b in zip(*clipped)]
    optimizer = tf.train.AdamOptimizer(0.01)
    with tf.control_dependencies(mean):
        op = optimizer.apply_gradients(list(zip(mean, dense + experts)))
    with tf.Session() as sess:
        sess.run(tf.global_variables_initializer())
        losses = [sess.run([loss, op])[0] for _ in range(STEPS)]
        losses.append(sess.run(loss))
        path = tf.train.Saver().save(sess, os.path.join(str(tmpdir), "oracle"))
    reader = tf.train.load_checkpoint(path)
    want_weights = {k: reader.get_tensor(k) for k in reader.get_variable_to_shape_map()}
    got = _train(v, clip, n=2, tmpdir=tmpdir, **{"communication.clip_after_allreduce": False})
    np.testing.assert_allclose(got[0], losses, rtol=1e-5)
    for k, w in want_weights.items():
        np.testing.assert_allclose(got[1][k], w, rtol=1e-5, atol=1e-6, err_msg=k)


@pytest.mark.parametrize("n", [1, 2])
@pytest.mark.parametrize("clip", ["global", "local"])
def test_amp_o1_follows_float32(clip, n, tmpdir):
    """AMP O1 (loss scale 128): the replicated dense product in float16, the loss curve
    within test_amp's tolerance of the float32 program without EPL (over 2 devices with
    per-tensor clipping, the program whose experts are stored as 2 partitions, as in
    test_split_over_two_devices_equals_plain_tf: without AMP the two already differ by
    2.9%)."""
    v = _values()
    want = _train(v, clip, steps=12, tmpdir=tmpdir,
                  partitions=n if clip == "local" and n > 1 else None)
    got = _train(v, clip, n=n, steps=12, tmpdir=tmpdir,
                 **{"amp.level": "O1", "amp.loss_scale": 128,
                    "communication.clip_after_allreduce": True})
    np.testing.assert_allclose(got[0], want[0], rtol=3e-2)
    assert want[0][-1] < want[0][0] * 0.9, want[0]     # the model learns: the check can fail
    half = [op.name for op in tf.get_default_graph().get_operations()
            if op.type == "MatMul" and op.get_attr("T") == tf.float16]
    assert "dense/MatMul_fp16" in half, half


@pytest.mark.parametrize("loss_scale", [128, "dynamic"])
def test_amp_o1_split_gradients_over_two_devices_are_the_mean(loss_scale, tmpdir):
    """AMP divides every gradient by the loss scale in the loss's scope, so each replica
    reads the split's gradient (the sum of both replicas' parts) through a division of
    its own: the split's gradients must still be divided by the number of replicas like
    the replicated ones.  Plain SGD without clipping (Adam's normalized step and the
    clipping would hide a factor of 2 on the experts' gradients): after each step the
    weights follow the float32 program without EPL to float16 precision, and each
    variable's change matches the oracle's (a doubled gradient doubles it)."""
    v = _values()
    sgd = tf.train.GradientDescentOptimizer
    want = _train(v, None, steps=3, tmpdir=tmpdir, lr=0.1, optimizer=sgd)
    got = _train(v, None, n=2, steps=3, tmpdir=tmpdir, lr=0.1, optimizer=sgd,
                 **{"amp.level": "O1", "amp.loss_scale": loss_scale})
    np.testing.assert_allclose(got[0], want[0], rtol=2e-3)
    initial = {"ffn/in_weights": v["in"], "ffn/out_weights": v["out"],
               "dense/kernel": v["dense"], "dense/bias": np.zeros(UNITS, np.float32)}
    for k, w0 in initial.items():
        moved, want_moved = (got[1][k] - w0).ravel(), (want[1][k] - w0).ravel()
        assert np.linalg.norm(want_moved) > 1e-3, k
        np.testing.assert_allclose(moved.dot(want_moved) / want_moved.dot(want_moved), 1.0,
                                   rtol=2e-3, err_msg=k)
        np.testing.assert_allclose(got[1][k], want[1][k], rtol=2e-3, atol=2e-4, err_msg=k)


def test_two_devices_with_replicas_pulling_the_experts_batch_is_refused(tmpdir):
    """The replicated loss reads the targets from the same pipeline: every replica pulls
    its own [E, G, C, M] batch, which the split would receive concatenated along the
    expert dimension.  Refused while the graph is rewritten, naming what crosses where
    and how to write it."""
    v = _values()
    with pytest.raises(NotImplementedError) as err:
        _train(v, "global", n=2, tmpdir=tmpdir, labels=True)
    message = str(err.value)
    for part in ("'EGCM,EMH->EGCH'", "IteratorGetNext:0", "'E'", "ffn/in_weights",
                 "4 experts over 2 devices", "2 replicas", "epl.moe_layer"):
        assert part in message, (part, message)
