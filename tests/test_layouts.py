"""Layouts the seeds allow (issue 10, item 3): replicated computation before *and
after* a split scope, with the default strategy or explicit scopes, colocated or
not.  Oracle: the same model without EPL on one device with the replicas' batches.
"""
import numpy as np
import pytest
import tensorflow.compat.v1 as tf

import epl
from tests import models
from tests import split_models as sm

STEPS, B = 3, 6


def _values():
    return sm.init_values()


def _dense(x, units, values, name, act=None):
    return tf.layers.dense(
        x, units, activation=act, name=name,
        kernel_initializer=tf.constant_initializer(values[name + "/kernel"]),
        bias_initializer=tf.constant_initializer(values[name + "/bias"]))


def _model(bx, by, values, how=None, n=None):
    """replicated dense -> dense under split -> replicated dense + loss.
    ``how``: None (no EPL), "default" (set_default_strategy, the split block in the
    middle), "scopes" (two replicate scopes around the split)."""
    if how == "default":
        epl.set_default_strategy(epl.replicate(1))
    if how == "scopes":
        with epl.replicate(1):
            h = _dense(bx, sm.H1, values, "dense", tf.nn.tanh)
    else:
        h = _dense(bx, sm.H1, values, "dense", tf.nn.tanh)
    if how is None:
        g = _dense(h, sm.H2, values, "dense_1", tf.nn.relu)
    else:
        with epl.split(n):
            g = _dense(h, sm.H2, values, "dense_1", tf.nn.relu)
    if how == "scopes":
        with epl.replicate(1):
            logits = _dense(g, sm.CLASSES, values, "dense_2")
            loss = tf.losses.sparse_softmax_cross_entropy(labels=by, logits=logits)
    else:
        logits = _dense(g, sm.CLASSES, values, "dense_2")
        loss = tf.losses.sparse_softmax_cross_entropy(labels=by, logits=logits)
    return loss


def _train(x, y, batch, build, fixed):
    ds = tf.data.Dataset.from_tensor_slices((x, y)).batch(batch, drop_remainder=fixed)
    bx, by = tf.data.make_one_shot_iterator(ds).get_next()
    loss = build(bx, by)
    op = sm.train_op(loss, "momentum")
    with tf.Session() as sess:
        sess.run(tf.global_variables_initializer())
        for _ in range(STEPS):
            sess.run(op)
        names = sorted(_values())
        g = tf.get_default_graph()
        return dict(zip(names, sess.run([_whole(g, k) for k in names])))


def _whole(graph, name):
    """A variable's value, whole (a split variable is kept in shards)."""
    import re
    part = re.compile(re.escape(name) + r"/part_(\d+)$")
    shards = [v for v in tf.global_variables()
              if v.op.name == name or part.match(v.op.name)]
    if len(shards) == 1:
        return shards[0].value()
    shards.sort(key=lambda v: int(part.match(v.op.name).group(1)))
    axis = 1 if name.endswith("kernel") else 0   # dense layers shard their units
    return tf.concat([s.value() for s in shards], axis=axis)


@pytest.mark.parametrize("fixed", [False, True])
@pytest.mark.parametrize("colocate", [True, False])
@pytest.mark.parametrize("how", ["default", "scopes"])
def test_replicate_split_replicate_equals_local(how, colocate, fixed):
    n = 2
    replicas = 2
    devices = replicas if colocate else replicas + n
    values = _values()
    x, y = sm.data(STEPS * replicas * B)
    models.reset()
    want = _train(x, y, replicas * B, lambda bx, by: _model(bx, by, values), fixed)
    models.reset()
    epl.init(epl.Config({"cluster.devices_per_worker": devices,
                         "cluster.colocate_split_and_replicate": colocate}))
    got = _train(x, y, B, lambda bx, by: _model(bx, by, values, how, n), fixed)
    for k in want:
        np.testing.assert_allclose(got[k], want[k], rtol=1e-5, atol=1e-6, err_msg=k)
    g = tf.get_default_graph()
    split_devices = set(o.device for o in g.get_operations()
                        if o.type == "MatMul" and o.name.startswith("dense_1/"))
    assert len(split_devices) == n


@pytest.mark.parametrize("colocate", [True, False])
def test_split_first_then_replicate_equals_local(colocate):
    """The input goes through a split block first, replicated layers and the loss follow
    (split -> replicate)."""
    n, replicas = 2, 2
    values = _values()
    x, y = sm.data(STEPS * replicas * B)

    def model(bx, by, annotate):
        if annotate:
            with epl.split(n):
                h = _dense(bx, sm.H1, values, "dense", tf.nn.tanh)
            with epl.replicate(1):
                g = _dense(h, sm.H2, values, "dense_1", tf.nn.relu)
                logits = _dense(g, sm.CLASSES, values, "dense_2")
                return tf.losses.sparse_softmax_cross_entropy(labels=by,
                                                                        logits=logits)
        h = _dense(bx, sm.H1, values, "dense", tf.nn.tanh)
        g = _dense(h, sm.H2, values, "dense_1", tf.nn.relu)
        logits = _dense(g, sm.CLASSES, values, "dense_2")
        return tf.losses.sparse_softmax_cross_entropy(labels=by, logits=logits)

    models.reset()
    want = _train(x, y, replicas * B, lambda bx, by: model(bx, by, False), True)
    models.reset()
    epl.init(epl.Config({"cluster.devices_per_worker": replicas if colocate else replicas + n,
                         "cluster.colocate_split_and_replicate": colocate}))
    got = _train(x, y, B, lambda bx, by: model(bx, by, True), True)
    for k in want:
        np.testing.assert_allclose(got[k], want[k], rtol=1e-5, atol=1e-6, err_msg=k)
