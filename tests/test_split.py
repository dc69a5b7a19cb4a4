"""Tensor model parallelism (epl.split): every mode equals the local model.

Oracles: the same model code built without EPL on one device (same initial
values, same batches).  Losses are compared before every update (the first is
the pure forward pass, the later ones check gradients and updates) plus after
the last, rel. 1e-5; argmax accuracy must match exactly; final weights are read
back through a checkpoint, which also checks that sharded variables save under
the local model's names.
"""
import os

import numpy as np
import pytest
import tensorflow.compat.v1 as tf

import epl
from epl.core.layout import LayoutError
from tests import split_models as sm

STEPS, BATCH = 3, 12


def _feeds(px, py, x, y):
    return lambda i: {px: x[i * BATCH:(i + 1) * BATCH], py: y[i * BATCH:(i + 1) * BATCH]}


def _placeholders():
    return tf.placeholder(tf.float32, [None, sm.IN]), tf.placeholder(tf.int64, [None])


def _checkpoint_values(sess, tmpdir, name):
    path = tf.train.Saver().save(sess, os.path.join(str(tmpdir), name))
    reader = tf.train.load_checkpoint(path)
    return {k: reader.get_tensor(k) for k in reader.get_variable_to_shape_map()}


def _train(build, tmpdir, name, optimizer):
    """Losses/accuracy per step and the checkpointed weights of the model ``build``s."""
    x, y = sm.data(BATCH * (STEPS + 1))
    px, py = _placeholders()
    loss, correct = build(px, py)
    op = sm.train_op(loss, optimizer)
    feeds = _feeds(px, py, x, y)
    losses, accs = [], []
    with tf.Session() as sess:
        sess.run(tf.global_variables_initializer())
        for i in range(STEPS):
            l, c, _ = sess.run([loss, correct, op], feeds(i))
            losses.append(l)
            accs.append(c)
        losses.append(sess.run(loss, feeds(STEPS)))
        weights = _checkpoint_values(sess, tmpdir, name)
    return np.array(losses), np.array(accs), weights


def _local(build, tmpdir, optimizer):
    with tf.Graph().as_default():
        return _train(build, tmpdir, "local", optimizer)


def _assert_same(got, want):
    np.testing.assert_allclose(got[0], want[0], rtol=1e-5, err_msg="losses")
    np.testing.assert_array_equal(got[1], want[1], err_msg="argmax accuracy")
    assert sorted(got[2]) == sorted(want[2])      # same checkpoint names, slots included
    for k in sorted(want[2]):
        np.testing.assert_allclose(got[2][k], want[2][k], rtol=1e-5, atol=1e-6, err_msg=k)


def _whole(values, keras=False):
    def build(px, py):
        _, loss, correct = sm.mlp(px, py, values, keras)
        return loss, correct
    return build


@pytest.mark.parametrize("n", [2, 3, 4])
def test_whole_model_split_matches_local(n, tmpdir):
    values = sm.init_values()
    want = _local(_whole(values), tmpdir, "momentum")
    epl.init(epl.Config({"cluster.devices_per_worker": n}))

    def build(px, py):
        with epl.split(n):
            return _whole(values)(px, py)
    got = _train(build, tmpdir, "split", "momentum")
    _assert_same(got, want)
    # Shard i of every layer really runs on device i.
    g = tf.get_default_graph()
    devices = set(op.device for op in g.get_operations() if op.type == "MatMul")
    assert len(devices) == n


def test_keras_dense_and_tf_nn_loss_split_with_adam(tmpdir):
    values = sm.init_values()
    want = _local(_whole(values, keras=True), tmpdir, "adam")
    epl.init(epl.Config({"cluster.devices_per_worker": 3}))

    def build(px, py):
        with epl.split(3):
            return _whole(values, keras=True)(px, py)
    _assert_same(_train(build, tmpdir, "split", "adam"), want)


def _head_values(classes=sm.CLASSES):
    rng = np.random.RandomState(5)
    values = sm.init_values(classes=classes)
    values["dense_1/kernel"] = (rng.randn(sm.H1, classes) * 0.3).astype(np.float32)
    values["dense_1/bias"] = (rng.randn(classes) * 0.3).astype(np.float32)
    return values


def _hybrid(values, n=None, rdc=None):
    """A replicated backbone and a classifier head (split when ``n`` is given)."""
    def c(k):
        return tf.constant_initializer(values[k])

    def build(px, py):
        def backbone():
            return tf.layers.dense(px, sm.H1, activation=tf.nn.tanh,
                                   kernel_initializer=c("dense/kernel"),
                                   bias_initializer=c("dense/bias"))

        def head(h):
            return tf.layers.dense(h, int(values["dense_1/bias"].shape[0]),
                                   kernel_initializer=c("dense_1/kernel"),
                                   bias_initializer=c("dense_1/bias"))
        if n is None:
            logits = head(backbone())
        else:
            with epl.replicate(rdc):
                h = backbone()
            with epl.split(n):
                logits = head(h)
        loss = tf.losses.sparse_softmax_cross_entropy(labels=py, logits=logits)
        return loss, tf.equal(tf.argmax(logits, -1), py)
    return build


@pytest.mark.parametrize("n,colocate,rdc", [(2, True, 1), (3, True, 1), (4, True, 1),
                                            (2, False, 1), (4, True, 2), (2, True, 2)])
def test_hybrid_replicate_and_split_match_local(n, colocate, rdc, tmpdir):
    values = _head_values()
    want = _local(_hybrid(values), tmpdir, "momentum")
    devices = n if colocate else n + 2
    epl.init(epl.Config({"cluster.devices_per_worker": devices,
                         "cluster.colocate_split_and_replicate": colocate}))
    got = _train(_hybrid(values, n, rdc), tmpdir, "hybrid", "momentum")
    _assert_same(got, want)
    g = tf.get_default_graph()
    head = set(op.device for op in g.get_operations()
               if op.type == "MatMul" and op.name.startswith("dense_1/"))
    backbone = set(op.device for op in g.get_operations()
                   if op.type == "MatMul" and op.name.endswith("dense/MatMul"))
    assert len(head) == n and len(backbone) == devices - (0 if colocate else n)
    assert bool(head & backbone) == colocate
    # The loss is built outside the split scope; each shard's one-hot labels are still
    # made on that shard's device (not every shard's on the first device).
    onehot = set(op.device for op in g.get_operations() if op.type == "OneHot")
    assert onehot == head, (onehot, head)


@pytest.mark.parametrize("copies", ["per_worker", "per_device"])
def test_hybrid_with_dataset_input_matches_local_big_batch(copies, tmpdir):
    """Each replica pulls its own batch (DP semantics); the split head sees all of them:
    the local model at n-times the batch.  MonitoredTrainingSession, Adam."""
    n, per = 2, 6
    values = _head_values()
    x, y = sm.data(per * n * (STEPS + 1))

    def run(batch, build, name):
        ds = tf.data.Dataset.from_tensor_slices((x, y)).batch(batch)
        bx, by = tf.data.make_one_shot_iterator(ds).get_next()
        loss, _ = build(bx, by)
        op = sm.train_op(loss, "adam")
        ckpt = os.path.join(str(tmpdir), name)
        with tf.train.MonitoredTrainingSession(checkpoint_dir=ckpt) as sess:
            losses = [sess.run([loss, op])[0] for _ in range(STEPS)]
        reader = tf.train.load_checkpoint(ckpt)   # written at the end by the session
        return losses, {k: reader.get_tensor(k) for k in reader.get_variable_to_shape_map()}

    with tf.Graph().as_default():
        want = run(per * n, _hybrid(values), "local")
    epl.init(epl.Config({"cluster.devices_per_worker": n, "cluster.variable_copies": copies,
                         "cluster.colocate_split_and_replicate": True}))
    got = run(per, _hybrid(values, n, 1), "hybrid")
    np.testing.assert_allclose(got[0], want[0], rtol=1e-5)
    assert sorted(got[1]) == sorted(want[1])
    for k in want[1]:
        np.testing.assert_allclose(got[1][k], want[1][k], rtol=1e-5, atol=1e-6, err_msg=k)


VOCAB, EMB, LEN = 11, 6, 3


def _embedding_model(where, n=None):
    """An embedding table (tf.get_variable) and a classifier.  ``where``: "local", or
    "split" (everything under split), or "hybrid" (the table under split, looked up
    and used by the replicas)."""
    rng = np.random.RandomState(7)
    table = (rng.randn(VOCAB, EMB) * 0.5).astype(np.float32)
    kernel = (rng.randn(EMB, sm.CLASSES) * 0.5).astype(np.float32)

    def build(ids, labels):
        def make_table():
            return tf.get_variable("table", [VOCAB, EMB],
                                   initializer=tf.constant_initializer(table))

        def head(e):
            h = tf.reduce_mean(e, axis=1)
            return tf.layers.dense(h, sm.CLASSES, kernel_initializer=tf.constant_initializer(
                kernel))
        if where == "local":
            logits = head(tf.nn.embedding_lookup(make_table(), ids))
        elif where == "split":
            with epl.split(n):
                t = make_table()
                logits = head(tf.nn.embedding_lookup(t, ids) + 0.0 * tf.reduce_sum(t))
        else:
            with epl.split(n):
                t = make_table()
            with epl.replicate(1):
                logits = head(tf.nn.embedding_lookup(t, ids))
        if where == "local":
            logits += 0.0 * tf.reduce_sum(tf.get_variable("table"))  # same graph shape
        loss = tf.losses.sparse_softmax_cross_entropy(labels, logits)
        return loss, tf.equal(tf.argmax(logits, -1), labels)
    return build


def _train_ids(build, tmpdir, steps=STEPS):
    rng = np.random.RandomState(3)
    ids = rng.randint(0, VOCAB, (BATCH * (steps + 1), LEN)).astype(np.int64)
    y = rng.randint(0, sm.CLASSES, BATCH * (steps + 1)).astype(np.int64)
    pi, py = tf.placeholder(tf.int64, [None, LEN]), tf.placeholder(tf.int64, [None])
    loss, _ = build(pi, py)
    op = sm.train_op(loss, "adam")
    feeds = _feeds(pi, py, ids, y)
    with tf.Session() as sess:
        sess.run(tf.global_variables_initializer())
        out = [sess.run([loss, op], feeds(i))[0] for i in range(steps)]
        out.append(sess.run(loss, feeds(steps)))
        return np.array(out), _checkpoint_values(sess, tmpdir, "emb")


@pytest.mark.parametrize("where,n", [("split", 2), ("split", 3), ("hybrid", 2), ("hybrid", 4)])
def test_get_variable_under_split_is_sharded_and_matches_local(where, n, tmpdir):
    """Weights after 3 Adam steps (read from the checkpoint: the table saves whole); the
    losses too where the fetched loss covers the whole batch (not hybrid: there it is
    replica 0's)."""
    with tf.Graph().as_default(), tf.variable_scope("", reuse=tf.AUTO_REUSE):
        want = _train_ids(_embedding_model("local"), tmpdir)
    epl.init(epl.Config({"cluster.devices_per_worker": n,
                         "cluster.colocate_split_and_replicate": True}))
    got = _train_ids(_embedding_model(where, n), tmpdir)
    if where == "split":
        np.testing.assert_allclose(got[0], want[0], rtol=1e-5)
    assert sorted(got[1]) == sorted(want[1])
    for k in want[1]:
        np.testing.assert_allclose(got[1][k], want[1][k], rtol=1e-5, atol=1e-6, err_msg=k)
    parts = [v for v in tf.trainable_variables() if v.op.name.startswith("table/part_")]
    assert [int(p.shape[0]) for p in parts] == [len(a) for a in
                                                np.array_split(np.arange(VOCAB), n)]
    assert len(set(p.op.device for p in parts)) == n


def test_sharded_checkpoint_restores_into_local_and_other_split(tmpdir):
    """split(2) trains and saves; the local model and split(3) restore it and agree."""
    values = sm.init_values()
    x, y = sm.data(BATCH)
    epl.init(epl.Config({"cluster.devices_per_worker": 2}))
    px, py = _placeholders()
    with epl.split(2):
        _, loss, _ = sm.mlp(px, py, values)
    op = sm.train_op(loss, "adam")
    with tf.Session() as sess:
        sess.run(tf.global_variables_initializer())
        for _ in range(2):
            sess.run(op, {px: x, py: y})
        trained = sess.run(loss, {px: x, py: y})
        path = tf.train.Saver().save(sess, os.path.join(str(tmpdir), "split2"))
    zeros = {k: np.zeros_like(v) for k, v in values.items()}

    def restored_loss(graph_builder):
        with tf.Session() as sess:
            sess.run(tf.global_variables_initializer())
            tf.train.Saver().restore(sess, path)
            return graph_builder(sess)

    with tf.Graph().as_default():      # the local model (no annotation)
        px, py = _placeholders()
        _, loss, _ = sm.mlp(px, py, zeros)
        sm.train_op(loss, "adam")
        local = restored_loss(lambda s: s.run(loss, {px: x, py: y}))
    epl.init(epl.Config({"cluster.devices_per_worker": 3}))
    tf.reset_default_graph()
    px, py = _placeholders()
    with epl.split(3):
        _, loss, _ = sm.mlp(px, py, zeros)
    op = sm.train_op(loss, "adam")
    other = restored_loss(lambda s: s.run(loss, {px: x, py: y}))
    np.testing.assert_allclose([local, other], [trained, trained], rtol=1e-5)


# -- mixture of experts --------------------------------------------------------

T, D, H = 24, 6, 8


def _moe_values(experts, seed=0):
    rng = np.random.RandomState(seed)
    return {"x": rng.randn(T, D).astype(np.float32),
            "target": rng.randn(T, D).astype(np.float32),
            "moe/gate": rng.randn(D, experts).astype(np.float32),
            "moe/experts_w1": (rng.randn(experts, D, H) * 0.4).astype(np.float32),
            "moe/experts_w2": (rng.randn(experts, H, D) * 0.4).astype(np.float32)}


def _moe_reference(v, top_k, groups, capacity_factor=1.0):
    """The MoE layer written plainly in numpy: token by token, expert by expert."""
    experts = v["moe/gate"].shape[1]
    per = T // groups
    capacity = max(1, int(np.ceil(top_k * per * capacity_factor / experts)))
    out = np.zeros((T, v["moe/experts_w2"].shape[2]), np.float64)
    for g in range(groups):
        xs = v["x"][g * per:(g + 1) * per].astype(np.float64)
        logits = xs.dot(v["moe/gate"])
        probs = np.exp(logits - logits.max(-1, keepdims=True))
        probs /= probs.sum(-1, keepdims=True)
        first = probs.argmax(-1)
        masked = probs.copy()
        masked[np.arange(per), first] = 0
        second = masked.argmax(-1)
        fill = np.zeros(experts, int)
        choices = [[(first[s], probs[s, first[s]])] for s in range(per)]
        if top_k == 2:
            for s in range(per):
                choices[s].append((second[s], probs[s, second[s]]))
        # Queue positions: all first choices in token order, then all second choices.
        accepted = [[] for _ in range(per)]
        for k in range(top_k):
            for s in range(per):
                e, p = choices[s][k]
                if fill[e] < capacity:
                    accepted[s].append((e, p))
                fill[e] += 1
        for s in range(per):
            norm = sum(p for _, p in choices[s]) if top_k == 2 else 1.0
            for e, p in accepted[s]:
                h = np.maximum(xs[s].dot(v["moe/experts_w1"][e]), 0)
                out[g * per + s] += p / norm * h.dot(v["moe/experts_w2"][e])
    return out


def _moe_run(v, experts, top_k, groups, n=None, steps=3, backbone=None):
    """Outputs and losses of moe_layer trained ``steps`` SGD steps (split over n or local).
    ``backbone``: None, "local" (a dense layer before the MoE), or "replicated" (that
    layer under epl.replicate(1), the MoE under split: the seed's MoE recipe)."""
    # A fed global batch (unknown first dimension: EPL splits it over the replicas).
    px = tf.placeholder(tf.float32, [None if backbone else T, D])

    def layer(x):
        return epl.moe_layer(x, experts, H, top_k=top_k, num_groups=groups,
                             gate_initializer=tf.constant_initializer(v["moe/gate"]))

    def dense(x):
        return tf.layers.dense(x, D, activation=tf.nn.tanh, name="backbone",
                               kernel_initializer=tf.constant_initializer(v["backbone"]))
    x = px
    if backbone == "replicated":
        with epl.replicate(1):
            x = dense(px)
    elif backbone == "local":
        x = dense(px)
    if n:
        with epl.split(n):
            y, aux = layer(x)
    else:
        y, aux = layer(x)
    loss = tf.reduce_mean((y - v["target"]) ** 2) + 0.01 * aux
    opt = tf.train.GradientDescentOptimizer(0.5)
    gvs = opt.compute_gradients(loss)
    with tf.control_dependencies([g for g, _ in gvs]):
        op = opt.apply_gradients(gvs)
    assigns = []
    for var in tf.global_variables():
        if var.op.name.startswith("backbone"):
            continue
        full = v[var.op.name.rsplit("/part_", 1)[0]]
        info = var._save_slice_info  # pylint: disable=protected-access
        if info is not None:
            full = full[info.var_offset[0]:info.var_offset[0] + info.var_shape[0]]
        assigns.append(tf.assign(var, full))
    outs = []
    with tf.Session() as sess:
        sess.run(tf.global_variables_initializer())
        sess.run(assigns)
        for _ in range(steps):
            l, out, _ = sess.run([loss, y, op], {px: v["x"]})
            outs.append((l, out))
    return outs


@pytest.mark.parametrize("n", [2, 4])
def test_moe_under_split_after_replicated_backbone_matches_local(n):
    """Seed 001 §5.3.2 shape: replicated layers, then the MoE under split.  The split sees
    every replica's tokens (capacity follows the run-time group size)."""
    v = _moe_values(4)
    v["backbone"] = (np.random.RandomState(9).randn(D, D) * 0.5).astype(np.float32)
    with tf.Graph().as_default():
        want = _moe_run(v, 4, 2, groups=n, backbone="local")
    epl.init(epl.Config({"cluster.devices_per_worker": n,
                         "cluster.colocate_split_and_replicate": True}))
    got = _moe_run(v, 4, 2, groups=n, n=n, backbone="replicated")
    for (lw, ow), (lg, og) in zip(want, got):
        np.testing.assert_allclose(lg, lw, rtol=1e-5)
        np.testing.assert_allclose(og, ow, rtol=1e-5, atol=1e-6)


def test_seed_moe_recipe_variables_under_split_calculation_replicated(tmpdir):
    """Seed 001 §5.3.2 literally: default replicate(n), expert variables defined under
    split(n), the calculation outside it.  Experts are stored sharded; the result (read
    back through the checkpoint) equals the local model."""
    n, experts = 2, 4
    v = _moe_values(experts)

    def build(annotate):
        px = tf.placeholder(tf.float32, [None, D])
        if annotate:
            epl.set_default_strategy(epl.replicate(n))
            with epl.split(n):
                w1 = tf.get_variable("experts_w1", initializer=v["moe/experts_w1"])
        else:
            w1 = tf.get_variable("experts_w1", initializer=v["moe/experts_w1"])
        h = tf.nn.relu(tf.einsum("td,edh->teh", px, w1))
        loss = tf.reduce_mean((tf.reduce_sum(h, axis=1)[:, :D] - v["target"][:1]) ** 2)
        op = sm.train_op(loss, "adam")
        with tf.Session() as sess:
            sess.run(tf.global_variables_initializer())
            for _ in range(3):
                sess.run(op, {px: v["x"]})
            return _checkpoint_values(sess, tmpdir, "seed_moe")["experts_w1"]
    with tf.Graph().as_default():
        want = build(False)
    epl.init(epl.Config({"cluster.devices_per_worker": n,
                         "cluster.colocate_split_and_replicate": True}))
    got = build(True)
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6)
    parts = [p for p in tf.trainable_variables() if p.op.name.startswith("experts_w1/part_")]
    assert len(parts) == n and len(set(p.op.device for p in parts)) == n


@pytest.mark.parametrize("top_k", [1, 2])
def test_moe_local_layer_equals_numpy_reference(top_k):
    v = _moe_values(4)
    out = _moe_run(v, 4, top_k, groups=2, steps=1)[0][1]
    np.testing.assert_allclose(out, _moe_reference(v, top_k, groups=2), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("n,experts,top_k", [(2, 4, 1), (2, 4, 2), (3, 5, 2), (4, 4, 1)])
def test_moe_split_equals_local_experts(n, experts, top_k):
    """Experts sharded over n devices (uneven too) with all-to-all == all experts on one."""
    v = _moe_values(experts)
    with tf.Graph().as_default():
        want = _moe_run(v, experts, top_k, groups=n)
    epl.init(epl.Config({"cluster.devices_per_worker": n}))
    got = _moe_run(v, experts, top_k, groups=n, n=n)
    for (lw, ow), (lg, og) in zip(want, got):
        np.testing.assert_allclose(lg, lw, rtol=1e-5)
        np.testing.assert_allclose(og, ow, rtol=1e-5, atol=1e-6)
    types = [op.type for op in tf.get_default_graph().get_operations()]
    from epl.communicators import op_library
    if op_library.available():
        assert types.count("EplAllToAll") >= 2 * n   # dispatch + combine, and their gradients
    shards = [var for var in tf.global_variables() if "experts_w1" in var.op.name]
    assert [int(s.shape[0]) for s in shards] == [len(a) for a in
                                                 np.array_split(np.arange(experts), n)]
    assert len(set(s.op.device for s in shards)) == n


# -- errors ----------------------------------------------------------------------

def test_split_with_more_devices_than_a_worker_has():
    epl.init(epl.Config({"cluster.devices_per_worker": 2}))
    px, _ = _placeholders()
    with pytest.raises(ValueError, match=r"split\(device_count=4\).*needs 4 devices.*has 2"):
        with epl.split(4):
            tf.layers.dense(px, 8)


def test_split_leaving_devices_idle_is_refused():
    """split(2) alone on 4 devices is 2 data-parallel groups (tests/test_split_hybrids.py);
    on 3 devices one would sit idle: refused, naming the fix."""
    epl.init(epl.Config({"cluster.devices_per_worker": 3}))
    px, py = _placeholders()
    with epl.split(2):
        _, loss, _ = sm.mlp(px, py, sm.init_values())
    sm.train_op(loss)
    with pytest.raises(LayoutError, match=r"3 devices cannot be divided into split groups of "
                                          r"2 .*epl.split\(3\)"):
        tf.Session().run(tf.global_variables_initializer())


def test_nested_split_in_replicate_is_refused():
    epl.init(epl.Config({"cluster.devices_per_worker": 2}))
    with pytest.raises(RuntimeError, match="Nested strategy annotations"):
        with epl.replicate(1):
            with epl.split(2):
                pass


def test_split_layer_called_twice_is_refused():
    epl.init(epl.Config({"cluster.devices_per_worker": 2}))
    px, _ = _placeholders()
    with epl.split(2):
        layer = tf.layers.Dense(8)
        layer(px)
        with pytest.raises(NotImplementedError, match="called a second time"):
            layer(px)


def test_too_few_units_to_shard():
    epl.init(epl.Config({"cluster.devices_per_worker": 4}))
    px, _ = _placeholders()
    with epl.split(4):
        with pytest.raises(ValueError, match=r"cannot shard .* 3 units.* over 4 devices"):
            tf.layers.dense(px, 3)


def test_replicated_scalar_read_by_split_is_refused():
    epl.init(epl.Config({"cluster.devices_per_worker": 2,
                         "cluster.colocate_split_and_replicate": True}))
    px, py = _placeholders()
    with epl.replicate(1):
        h = tf.layers.dense(px, 8)
        scale = tf.reduce_mean(h)
    with epl.split(2):
        logits = tf.layers.dense(h * scale, 4)
    loss = tf.losses.sparse_softmax_cross_entropy(py, logits)
    sm.train_op(loss)
    with pytest.raises(NotImplementedError, match="only batch-major tensors"):
        tf.Session().run(tf.global_variables_initializer())


def test_moe_argument_errors():
    epl.init(epl.Config({"cluster.devices_per_worker": 4}))
    px = tf.placeholder(tf.float32, [T, D])
    with epl.split(4):
        with pytest.raises(ValueError, match="3 experts cannot be sharded over epl.split\\(4\\)"):
            epl.moe_layer(px, 3, H)
        with pytest.raises(ValueError, match="num_groups=6 must be a multiple"):
            epl.moe_layer(px, 4, H, num_groups=6)
        with pytest.raises(ValueError, match="top_k must be 1 or 2"):
            epl.moe_layer(px, 4, H, top_k=3)
