"""Head-parallel attention under epl.split: a GPT-style decoder written as plain TF1
code equals the local model, and its attention products run on every split device.

Oracle: the same model code built without EPL (same initial values, same batches);
losses before each of 6 Adam updates and after the last, and every weight and Adam
slot after them (read through a checkpoint, which also checks the local names), rel.
1e-5 (absolute 1e-5 for weights near zero).  Placement is read from the rewritten graph: the ops a training step runs
(everything the train op needs), not the gathers EPL keeps for unsharded readers.
"""
import os

import numpy as np
import pytest
import tensorflow.compat.v1 as tf

import epl
from epl import ir
from tests import transformer_models as tm

STEPS, BATCH = 6, 4


def _checkpoint_values(sess, tmpdir, name):
    path = tf.train.Saver().save(sess, os.path.join(str(tmpdir), name))
    reader = tf.train.load_checkpoint(path)
    return {k: reader.get_tensor(k) for k in reader.get_variable_to_shape_map()}


def _train(model, tmpdir, name, n=None, steps=STEPS):
    ids, labels = tm.data(BATCH * (steps + 1))
    pi = tf.placeholder(tf.int64, [None, tm.SEQ])
    pl = tf.placeholder(tf.int64, [None, tm.SEQ])
    if n is None:
        loss = model.build(pi, pl)
    else:
        with epl.split(n):
            loss = model.build(pi, pl)
    op = _adam(loss)

    def feed(i):
        return {pi: ids[i * BATCH:(i + 1) * BATCH], pl: labels[i * BATCH:(i + 1) * BATCH]}
    losses = []
    with tf.Session() as sess:
        sess.run(tf.global_variables_initializer())
        for i in range(steps):
            losses.append(sess.run([loss, op], feed(i))[0])
        losses.append(sess.run(loss, feed(steps)))
        weights = _checkpoint_values(sess, tmpdir, name)
    return np.array(losses), weights, op


def _adam(loss):
    """Adam with epsilon 1e-4: a weight whose gradient is by chance ~1e-8 would otherwise
    move by +-lr on float noise (m / sqrt(v) is its sign), and the comparison would test
    the noise."""
    return tf.train.AdamOptimizer(0.01, epsilon=1e-4).minimize(
        loss, global_step=tf.train.get_or_create_global_step())


def _local(make, tmpdir):
    with tf.Graph().as_default():
        return _train(make(), tmpdir, "local")[:2]


def _assert_same(got, want):
    np.testing.assert_allclose(got[0], want[0], rtol=1e-5, err_msg="losses")
    assert sorted(got[1]) == sorted(want[1])
    for k in sorted(want[1]):
        np.testing.assert_allclose(got[1][k], want[1][k], rtol=1e-5, atol=1e-5, err_msg=k)


def _step_ops(op):
    """The ops a run of ``op`` executes (its data and control inputs, transitively)."""
    return ir.upstream([op])


def _forward(ops, prefix):
    return [o for o in ops if o.name.startswith(prefix) and "gradients" not in o.name
            and "Adam" not in o.name]


def _split_model(make, n, tmpdir):
    epl.init(epl.Config({"cluster.devices_per_worker": n}))
    model = make()
    got = _train(model, tmpdir, "split", n)
    return model, got


@pytest.mark.parametrize("n,heads,kv_heads", [(2, 4, None), (4, 4, None), (2, 3, None),
                                              (4, 6, None), (2, 4, 2), (4, 8, 4)])
def test_decoder_split_matches_local_and_runs_heads_on_every_device(n, heads, kv_heads,
                                                                    tmpdir):
    width = 4 * heads

    def make():
        return tm.Decoder(width=width, heads=heads, kv_heads=kv_heads)
    want = _local(make, tmpdir)
    model, got = _split_model(make, n, tmpdir)
    _assert_same(got[:2], want)
    step = _step_ops(got[2])
    for b in range(tm.LAYERS):
        fwd = _forward(step, "block_%d/" % b)
        products = [o for o in fwd if o.type.startswith("BatchMatMul")]
        per_device = {}
        for o in products:
            per_device.setdefault(o.device, []).append(o.name)
        # Q.K^T and P.V on each device, one shard each: nothing gathered onto device 0.
        assert len(per_device) == n, per_device
        assert all(len(v) == 2 for v in per_device.values()), per_device
        assert not [o.name for o in fwd if o.name.endswith("/gather")
                    or o.name.endswith("_sharded_output")]
        # Megatron's communication: the partial products meet twice per block in the
        # forward pass (after the attention projection and after the MLP).
        sums = [o for o in fwd if o.type == "AddN"
                and len(set(t.op.device for t in o.inputs)) == n]
        assert sorted(o.name.split("/")[1] for o in sums) == ["fc_out", "proj"], \
            [o.name for o in sums]


def test_traced_step_runs_attention_products_on_every_device(tmpdir):
    n = 2
    epl.init(epl.Config({"cluster.devices_per_worker": n}))
    model = tm.Decoder(width=16, heads=4)
    ids, labels = tm.data(BATCH)
    pi = tf.placeholder(tf.int64, [None, tm.SEQ])
    pl = tf.placeholder(tf.int64, [None, tm.SEQ])
    with epl.split(n):
        loss = model.build(pi, pl)
    op = _adam(loss)
    with tf.Session() as sess:
        sess.run(tf.global_variables_initializer())
        sess.run(op, {pi: ids, pl: labels})
        devices = traced_products(sess, op, {pi: ids, pl: labels})
    assert len(devices) == n, devices


def traced_products(sess, fetch, feed):
    """{device: names of the block_0 attention products (forward, every clone's) it ran}
    in one traced step (``FULL_TRACE``)."""
    meta = tf.RunMetadata()
    sess.run(fetch, feed, options=tf.RunOptions(trace_level=tf.RunOptions.FULL_TRACE),
             run_metadata=meta)
    ran = {}
    for dev in meta.step_stats.dev_stats:
        if "/device:" not in dev.device:
            continue   # (the tracer's host-side entries)
        for node in dev.node_stats:
            if "block_0/" in node.node_name and "gradients" not in node.node_name \
                    and "MatMul" in node.node_name and "/shard_" in node.node_name:
                ran.setdefault(dev.device.split("device:")[-1], set()).add(node.node_name)
    return ran


def test_dropout_on_sharded_probabilities_stays_sharded():
    """tf.nn.dropout of the attention probabilities: one random op per shard (its own
    seed), every kept value the undropped one / keep probability."""
    n = 2
    epl.init(epl.Config({"cluster.devices_per_worker": n}))
    tf.set_random_seed(5)
    x = tf.placeholder(tf.float32, [None, tm.SEQ, 16])
    with epl.split(n):
        q = tf.layers.dense(x, 16)
        q = tf.transpose(tf.reshape(q, [-1, tm.SEQ, 4, 4]), [0, 2, 1, 3])
        p = tf.nn.softmax(tf.matmul(q, q, transpose_b=True))
        d = tf.nn.dropout(p, rate=0.5)
        total = tf.reduce_sum(tf.layers.dense(tf.reshape(tf.transpose(
            tf.matmul(d, q), [0, 2, 1, 3]), [-1, tm.SEQ, 16]), 3))
    with tf.Session() as sess:
        sess.run(tf.global_variables_initializer())
        feed = {x: np.random.RandomState(0).randn(8, tm.SEQ, 16).astype(np.float32)}
        pv, dv, _ = sess.run([p, d, total], feed)
    kept = dv != 0
    np.testing.assert_allclose(dv[kept], pv[kept] / 0.5, rtol=1e-6)
    assert 0.35 < kept.mean() < 0.65
    # The two shards' masks differ (not one stream repeated).
    assert (kept[:, :2] != kept[:, 2:]).any()
    randoms = [o for o in _step_ops(total.op) if o.type == "RandomUniform"]
    assert len(set(o.device for o in randoms)) == n and len(randoms) == n


def test_reshape_merging_heads_into_batch_is_refused():
    epl.init(epl.Config({"cluster.devices_per_worker": 2}))
    x = tf.placeholder(tf.float32, [None, tm.SEQ, 16])
    with epl.split(2):
        q = tf.layers.dense(x, 16)
        q = tf.transpose(tf.reshape(q, [-1, tm.SEQ, 4, 4]), [0, 2, 1, 3])
        with pytest.raises(NotImplementedError, match="merges that axis with an outer one"):
            tf.reshape(q, [-1, tm.SEQ, 4])   # [batch * heads, seq, head_dim]


def test_more_devices_than_heads_is_an_error_naming_the_reshape():
    epl.init(epl.Config({"cluster.devices_per_worker": 4}))
    x = tf.placeholder(tf.float32, [None, tm.SEQ, 16])
    with epl.split(4):
        q = tf.layers.dense(x, 16)
        with pytest.raises(ValueError, match="Reshape op .* axis 2 \\(heads\\) of 2 over 4"):
            tf.reshape(q, [-1, tm.SEQ, 2, 8])


def test_softmax_over_the_sharded_axis_reads_the_gather():
    """Patterns that cannot stay sharded read the concatenation of the shards (correct,
    on the split's first device): a classifier's probabilities."""
    epl.init(epl.Config({"cluster.devices_per_worker": 2}))
    x = tf.placeholder(tf.float32, [None, 8])
    with epl.split(2):
        logits = tf.layers.dense(x, 5, kernel_initializer=tf.ones_initializer())
        probs = tf.nn.softmax(logits * 2.0)
    with tf.Session() as sess:
        sess.run(tf.global_variables_initializer())
        got = sess.run(probs, {x: np.ones([3, 8], np.float32)})
    np.testing.assert_allclose(got, np.full([3, 5], 0.2), rtol=1e-6)


def _bert_layer(tmpdir, name, n=None):
    """The test corpus' mini-BERT encoder layer (attention over [batch * seq, hidden]
    rows, reshaped with a dynamic batch) and a regression loss, 6 Adam steps."""
    from tests.corpus import bert
    rng = np.random.RandomState(4)
    rows = BATCH * (STEPS + 1)
    x = rng.randn(rows * bert.SEQ, bert.HIDDEN).astype(np.float32)
    mask = (rng.rand(rows, bert.SEQ) > 0.2).astype(np.int64)
    target = rng.randn(rows * bert.SEQ, bert.HIDDEN).astype(np.float32)
    px = tf.placeholder(tf.float32, [None, bert.HIDDEN])
    pm = tf.placeholder(tf.int64, [None, bert.SEQ])
    pt = tf.placeholder(tf.float32, [None, bert.HIDDEN])

    def build():
        out = bert.encoder_layer(px, pm, bert._Init(7), 0)   # pylint: disable=protected-access
        return tf.reduce_mean(tf.square(out - pt))
    if n is None:
        loss = build()
    else:
        with epl.split(n):
            loss = build()
    op = _adam(loss)
    losses = []

    def feed(i):
        r, t = slice(i * BATCH, (i + 1) * BATCH), slice(i * BATCH * bert.SEQ,
                                                         (i + 1) * BATCH * bert.SEQ)
        return {px: x[t], pm: mask[r], pt: target[t]}
    with tf.Session() as sess:
        sess.run(tf.global_variables_initializer())
        for i in range(STEPS):
            losses.append(sess.run([loss, op], feed(i))[0])
        losses.append(sess.run(loss, feed(STEPS)))
        weights = _checkpoint_values(sess, tmpdir, name)
    return np.array(losses), weights, op


def test_corpus_bert_encoder_layer_split_matches_local(tmpdir):
    """BERT's attention as its fine-tuning code writes it (reshape with the batch taken
    from tf.shape, [batch * seq, hidden] rows) stays head-parallel under split(2) (it
    has 2 heads: split(4) is refused, a shard would hold no head)."""
    with tf.Graph().as_default():
        want = _bert_layer(tmpdir, "local")
    epl.init(epl.Config({"cluster.devices_per_worker": 2}))
    got = _bert_layer(tmpdir, "split", 2)
    _assert_same(got[:2], want[:2])
    products = [o for o in _forward(_step_ops(got[2]), "layer_0/")
                if o.type.startswith("BatchMatMul")]
    assert len(set(o.device for o in products)) == 2 and len(products) == 4, \
        [(o.name, o.device) for o in products]
