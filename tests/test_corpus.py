"""The corpus: real TF1 programs, trained with EPL and without (issue 10).

Each program (in ``tests/corpus/``) runs unchanged apart from the annotations;
the oracle is the same program without EPL on one device with the global batch
(data parallelism: N replicas x B; gradient accumulation and pipelines: the
micro-batches together), compared at 1e-5 after a few steps.
"""
import os

import numpy as np
import pytest
import tensorflow.compat.v1 as tf

import epl
from tests import models
from tests.corpus import bert

STEPS, B = 3, 4


def _checkpoint(sess, tmpdir, name):
    path = tf.train.Saver().save(sess, os.path.join(str(tmpdir), name))
    reader = tf.train.load_checkpoint(path)
    return {k: reader.get_tensor(k) for k in reader.get_variable_to_shape_map()}


def _assert_same(got, want, keys=None):
    keys = sorted(want) if keys is None else keys
    for k in keys:
        np.testing.assert_allclose(got[k], want[k], rtol=1e-5, atol=1e-6, err_msg=k)


# -- (a) mini-BERT ---------------------------------------------------------------------

BERT_LAYOUTS = {
    # name: (devices, global batch factor, config, annotate)
    "dp2": (2, 2, {}, "default"),
    "dp4": (4, 4, {}, "default"),
    "dp4d": (4, 4, {"cluster.variable_copies": "per_device"}, "default"),
    "ga2": (1, 2, {"pipeline.num_micro_batch": 2}, "default"),
    "pipeline2": (2, 2, {"pipeline.num_micro_batch": 2}, "stages"),
    "hybrid2": (2, 2, {"cluster.colocate_split_and_replicate": True}, "split"),
}


def _bert_run(tmpdir, layout=None):
    pretrained = os.path.join(str(tmpdir), "pretrained")
    if not os.path.exists(pretrained + ".index"):
        bert.pretrained_checkpoint(pretrained)
    models.reset()
    if layout is None:
        batch, stages, split = B * _bert_factor(), None, None
    else:
        devices, _, cfg, annotate = BERT_LAYOUTS[layout]
        conf = {"cluster.devices_per_worker": devices,
                "communication.clip_after_allreduce": True}
        conf.update(cfg)
        epl.init(epl.Config(conf))
        batch, stages, split = B, None, None
        if annotate == "stages":
            scopes = [epl.replicate(1, name="stage_0"), epl.replicate(1, name="stage_1")]
            stages = scopes.__getitem__
        else:
            epl.set_default_strategy(epl.replicate(1))
        if annotate == "split":
            split = 2
    features = bert.batches(bert.data(STEPS * 4 * B), batch)
    loss = bert.model(features, stages=stages, split_head=split)
    bert.warm_start(pretrained)
    # The program under EPL increments global_step as BERT does (racing with the
    # learning-rate schedule); EPL orders it, so it equals the careful local program.
    op = bert.train_op(loss, careful=layout is None)
    with tf.Session() as sess:
        sess.run(tf.global_variables_initializer())
        for _ in range(STEPS):
            sess.run(op)
        return _checkpoint(sess, tmpdir, layout or "local")


def _bert_factor():
    return _bert_factor.value


@pytest.mark.parametrize("layout", sorted(BERT_LAYOUTS))
def test_mini_bert(layout, tmpdir):
    _bert_factor.value = BERT_LAYOUTS[layout][1]
    want = _bert_run(tmpdir)
    got = _bert_run(tmpdir, layout)
    # The warm start reached every replica: the encoder moved away from the checkpoint
    # values by the same updates as the local model's.
    keys = sorted(k for k in want if "adam_" not in k or layout != "hybrid2")
    if layout == "hybrid2":   # the head's optimizer slots are kept per shard
        keys = [k for k in keys if not k.startswith("classifier/")] + \
            ["classifier/kernel", "classifier/bias"]
    _assert_same(got, want, keys)
    assert got["global_step"] == STEPS


# -- (b) a conv net with batch normalization ---------------------------------------------

def _values(sess, names, prefix=""):
    g = tf.get_default_graph()
    return dict(zip(names, sess.run([models.value_tensor(g, prefix + n) for n in names])))


def _convnet_towers(x, y, n, stats_from, steps, global_batch):
    from tests.corpus import convnet
    models.reset()
    px = tf.placeholder(tf.float32, [None] + list(x.shape[1:]))
    py = tf.placeholder(tf.int64, [None])
    loss, updates = convnet.towers(px, py, n, stats_from)
    op = convnet.train_op(loss, updates)
    with tf.Session() as sess:
        sess.run(tf.global_variables_initializer())
        for s in range(steps):
            rows = slice(s * global_batch, (s + 1) * global_batch)
            sess.run(op, {px: x[rows], py: y[rows]})
        return _values(sess, convnet.WEIGHTS + convnet.STATS)


def _convnet_under_epl(x, **config):
    """The conv net under EPL data parallelism: (images, labels placeholders, train op)."""
    from tests.corpus import convnet
    models.reset()
    epl.init(epl.Config(config))
    epl.set_default_strategy(epl.replicate(1))
    px = tf.placeholder(tf.float32, [None] + list(x.shape[1:]))
    py = tf.placeholder(tf.int64, [None])
    return px, py, convnet.train_op(convnet.model(px, py))


@pytest.mark.parametrize("copies", ["per_worker", "per_device"])
@pytest.mark.parametrize("n", [2, 4])
def test_convnet_with_batch_norm(n, copies, tmpdir):
    """Data parallelism with batch norm (no sync BN): every replica normalizes with its
    own batch's statistics, and keeps its own moving statistics, updated from its own
    batches; the weights stay the same on every replica; the user's variables (what a
    checkpoint saves) hold replica 0's statistics.  The fed batch is split over the
    replicas in order, so replica r's batches are known: tower r of the oracle."""
    from tests.corpus import convnet
    x, y = convnet.data(STEPS * n * B)
    want = [_convnet_towers(x, y, n, r, STEPS, n * B) for r in (0, n - 1)]
    px, py, op = _convnet_under_epl(x, **{"cluster.devices_per_worker": n,
                                          "cluster.variable_copies": copies})
    with tf.Session() as sess:
        sess.run(tf.global_variables_initializer())
        for s in range(STEPS):
            rows = slice(s * n * B, (s + 1) * n * B)
            sess.run(op, {px: x[rows], py: y[rows]})
        mine = _values(sess, convnet.WEIGHTS + convnet.STATS)
        last = _values(sess, convnet.STATS, "EPL_REPLICA_%d/" % (n - 1))
        saved = _checkpoint(sess, tmpdir, "convnet")
    _assert_same(mine, want[0])                       # weights, and replica 0's statistics
    _assert_same(last, want[1], convnet.STATS)        # the last replica's own statistics
    _assert_same(saved, want[0], convnet.STATS)       # the checkpoint: replica 0's
    assert max(np.abs(last[k] - mine[k]).max() for k in convnet.STATS) > 1e-4


def test_convnet_gradient_accumulation():
    """Micro-batches like towers; each micro-batch updates the replica's moving
    statistics in turn (the weights are deterministic, the order of the micro-batches'
    updates of a statistic is not: after one step each statistic equals one of the two
    orders)."""
    from tests.corpus import convnet
    m = 2
    x, y = convnet.data(m * B)
    orders = []
    for order in ((0, 1), (1, 0)):
        models.reset()
        px = tf.placeholder(tf.float32, [None] + list(x.shape[1:]))
        py = tf.placeholder(tf.int64, [None])
        loss, _ = convnet.towers(px, py, m)
        updates = tf.get_collection(tf.GraphKeys.UPDATE_OPS)
        per_tower = len(updates) // m
        op = convnet.train_op(loss, [])
        with tf.Session() as sess:
            sess.run(tf.global_variables_initializer())
            for t in order:   # (training-mode batch norm does not read the statistics)
                sess.run(updates[t * per_tower:(t + 1) * per_tower], {px: x, py: y})
            sess.run(op, {px: x, py: y})
            orders.append(_values(sess, convnet.WEIGHTS + convnet.STATS))
    px, py, op = _convnet_under_epl(x, **{"cluster.devices_per_worker": 1,
                                          "pipeline.num_micro_batch": m})
    with tf.Session() as sess:
        sess.run(tf.global_variables_initializer())
        sess.run(op, {px: x, py: y})
        got = _values(sess, convnet.WEIGHTS + convnet.STATS)
    _assert_same(got, orders[0], convnet.WEIGHTS)
    assert not all(np.allclose(orders[0][k], orders[1][k]) for k in convnet.STATS)
    for k in convnet.STATS:   # (each statistic is updated by both micro-batches in turn)
        assert any(np.allclose(got[k], o[k], rtol=1e-5, atol=1e-6) for o in orders), \
            "%s follows neither order of the micro-batches" % k


# -- (c) an Estimator with the mini-BERT's optimizer --------------------------------------

def _estimator(tmpdir, name, batch, steps):
    pretrained = os.path.join(str(tmpdir), "pretrained")
    if not os.path.exists(pretrained + ".index"):
        bert.pretrained_checkpoint(pretrained)
    arrays = bert.data(steps * 4 * B)

    def input_fn():
        ids, types, mask, labels = arrays
        ds = tf.data.Dataset.from_tensor_slices(({"ids": ids, "types": types, "mask": mask},
                                                 labels))
        return ds.batch(batch, drop_remainder=True)

    def model_fn(features, labels, mode, params):
        loss = bert.model((features["ids"], features["types"], features["mask"], labels))
        bert.warm_start(params["pretrained"])   # as BERT's run_classifier does
        op = bert.train_op(loss, careful=params["careful"])
        return tf.estimator.EstimatorSpec(mode, loss=loss, train_op=op)

    est = tf.estimator.Estimator(model_fn, model_dir=os.path.join(str(tmpdir), name),
                                 params={"pretrained": pretrained, "careful": name == "local"})
    est.train(input_fn, steps=steps)
    return {k: est.get_variable_value(k) for k in est.get_variable_names()}


@pytest.mark.estimator
@pytest.mark.parametrize("devices, micro", [(2, 1), (4, 1), (1, 2)])
def test_estimator_with_bert_optimizer(devices, micro, tmpdir):
    factor = devices * micro
    models.reset()
    want = _estimator(tmpdir, "local", factor * B, STEPS)
    models.reset()
    epl.init(epl.Config({"cluster.devices_per_worker": devices,
                         "pipeline.num_micro_batch": micro,
                         "communication.clip_after_allreduce": True}))
    epl.set_default_strategy(epl.replicate(1))
    got = _estimator(tmpdir, "epl", B, STEPS)
    assert sorted(got) == sorted(want)
    _assert_same(got, want)
    assert got["global_step"] == STEPS


# -- (d) a tf.keras functional model: compile + fit, and a custom training loop -----------

def _keras_model():
    from tests.corpus import keras_model
    return keras_model.build()


def _keras_fit(batch, x, y, steps):
    from tests.corpus import keras_model
    model = keras_model.build()
    model.compile(tf.keras.optimizers.Adam(0.01), "sparse_categorical_crossentropy")
    ds = tf.data.Dataset.from_tensor_slices((x, y)).batch(batch).repeat()
    model.fit(ds, steps_per_epoch=steps, epochs=1, verbose=0)
    sess = tf.keras.backend.get_session()
    return dict(zip([w.name for w in model.weights], sess.run(model.weights)))


def _keras_loop(batch, x, y, steps):
    from tests.corpus import keras_model
    model = keras_model.build()
    ds = tf.data.Dataset.from_tensor_slices((x, y)).batch(batch)
    bx, by = tf.data.make_one_shot_iterator(ds).get_next()
    opt = tf.keras.optimizers.Adam(0.01)
    with tf.GradientTape() as tape:
        loss = tf.reduce_mean(tf.keras.losses.sparse_categorical_crossentropy(by, model(bx)))
    grads = tape.gradient(loss, model.trainable_variables)
    op = opt.apply_gradients(zip(grads, model.trainable_variables))
    with tf.Session() as sess:
        sess.run(tf.global_variables_initializer())
        for _ in range(steps):
            sess.run(op)
        return dict(zip([w.name for w in model.weights], sess.run(model.weights)))


@pytest.mark.parametrize("devices, micro", [(2, 1), (4, 1), (1, 2)])
@pytest.mark.parametrize("how", ["fit", "loop"])
def test_keras_functional_model(how, devices, micro):
    """fit: Keras feeds each step's batch into the model's Input, the global batch (split
    over the replicas); the custom loop pulls from a dataset: every replica (and
    micro-batch) its own batch.  Oracle: the same program without EPL."""
    from tests.corpus import keras_model
    factor = devices * micro
    x, y = keras_model.data(STEPS * factor * B)
    run = _keras_fit if how == "fit" else _keras_loop
    batch = factor * B
    models.reset()
    tf.keras.backend.clear_session()
    want = run(batch, x, y, STEPS)
    models.reset()
    tf.keras.backend.clear_session()
    epl.init(epl.Config({"cluster.devices_per_worker": devices,
                         "pipeline.num_micro_batch": micro}))
    epl.set_default_strategy(epl.replicate(1))
    got = run(batch if how == "fit" else B, x, y, STEPS)
    tf.keras.backend.clear_session()
    assert sorted(got) == sorted(want)
    _assert_same(got, want)
