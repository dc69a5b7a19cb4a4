"""auto.auto_parallel with pipeline.num_stages: an unannotated model is cut into
contiguous stages balanced by cost, and trains like hand-annotated stages
(oracle: the local model on the global batch, 1e-5)."""
import itertools

import numpy as np
import pytest
import tensorflow.compat.v1 as tf

import epl
from tests import models

STEPS, MB = 4, 4


def mlp(x, labels, widths):
    """Dense layers of the given output widths (the last one: the classes)."""
    rng = np.random.RandomState(7)
    h, fan_in = x, models.IN
    for i, w in enumerate(widths):
        k = (rng.randn(fan_in, w) / np.sqrt(fan_in)).astype(np.float32)
        last = i == len(widths) - 1
        h = tf.layers.dense(h, w, activation=None if last else tf.nn.tanh, name="layer_%d" % i,
                            kernel_initializer=tf.constant_initializer(k))
        fan_in = w
    return tf.losses.sparse_softmax_cross_entropy(labels=labels, logits=h)


WIDTHS = [16] * 7 + [models.CLASSES]


def _train(config, batch, widths=WIDTHS):
    models.reset()
    if config is not None:
        epl.init(epl.Config(config))
    x, y = models.data(STEPS * 64)     # (the same rows whatever the batch)
    bx, by = models.input_batch(x, y, batch)
    loss = mlp(bx, by, widths)
    step = tf.train.get_or_create_global_step()
    op = models.train_op(loss, "adam", step)
    names = sorted(v.op.name for v in tf.trainable_variables())
    graph = tf.get_default_graph()
    with tf.Session() as sess:
        sess.run(tf.global_variables_initializer())
        for _ in range(STEPS):
            sess.run(op)
        values = sess.run([models.value_tensor(graph, n) for n in names])
        assert sess.run(step) == STEPS
    return dict(zip(names, values)), graph


def _layers_per_stage(graph):
    ir = epl.Graph.get(graph)
    out = []
    for tg in ir.taskgraphs:
        layers = sorted(set(int(op.name.split("/")[0].split("_")[1]) for op in tg.ops
                            if op.name.startswith("layer_") and op.type == "MatMul"))
        out.append(layers)
    return out


@pytest.mark.parametrize("stages, want_layers", [
    (2, [[0, 1, 2, 3], [4, 5, 6, 7]]),
    (4, [[0, 1], [2, 3], [4, 5], [6, 7]]),
])
def test_uniform_mlp_is_cut_evenly_and_equals_local(stages, want_layers):
    micro = 2
    want, _ = _train(None, micro * MB)
    got, graph = _train({"auto.auto_parallel": True, "pipeline.num_stages": stages,
                         "pipeline.num_micro_batch": micro,
                         "cluster.devices_per_worker": stages}, MB)
    models.assert_weights_close(got, want)
    # (the last layer is narrower: the cut may move by one toward it, never across)
    got_layers = _layers_per_stage(graph)
    assert [l[0] for l in got_layers] == [l[0] for l in want_layers] or \
        got_layers == want_layers, got_layers
    assert sorted(sum(got_layers, [])) == list(range(8))


def test_data_parallel_over_auto_stages():
    want, _ = _train(None, 2 * 2 * MB)
    got, graph = _train({"auto.auto_parallel": True, "pipeline.num_stages": 2,
                         "pipeline.num_micro_batch": 2, "cluster.devices_per_worker": 4}, MB)
    models.assert_weights_close(got, want)


def test_uneven_widths_are_balanced_by_cost():
    """Layer costs 2 x in x out: the chosen cut's most expensive stage is within 10% of
    the best contiguous partition (brute force)."""
    widths = [64, 8, 96, 16, 16, 128, 8, models.CLASSES]
    models.reset()
    epl.init(epl.Config({"auto.auto_parallel": True, "pipeline.num_stages": 3,
                         "cluster.devices_per_worker": 3}))
    x, y = models.data(8)
    loss = mlp(tf.constant(x), tf.constant(y), widths)
    tf.train.GradientDescentOptimizer(0.1).minimize(loss)
    ins = [models.IN] + widths[:-1]
    cost = [2 * a * b for a, b in zip(ins, widths)]
    best = min(max(sum(cost[a:b]) for a, b in zip((0,) + cut, cut + (len(cost),)))
               for cut in itertools.combinations(range(1, len(cost)), 2))
    got = _layers_per_stage(tf.get_default_graph())
    assert sorted(sum(got, [])) == list(range(len(widths)))
    assert max(sum(cost[i] for i in stage) for stage in got) <= 1.1 * best, (got, cost)


@pytest.mark.parametrize("config, error, match", [
    ({"pipeline.num_stages": 2}, ValueError, "only used by 'auto.auto_parallel' = True"),
    ({"auto.auto_parallel": True}, NotImplementedError, "strategy search"),
    ({"auto.auto_parallel": True, "pipeline.num_stages": 0}, ValueError, "must be an integer"),
])
def test_config_errors(config, error, match):
    with pytest.raises(error, match=match):
        epl.init(epl.Config(config))


def test_more_stages_than_devices_is_refused():
    with pytest.raises(ValueError, match="3 pipeline stages need at least 3 devices"):
        _train({"auto.auto_parallel": True, "pipeline.num_stages": 3,
                "cluster.devices_per_worker": 2}, MB)


def test_annotated_model_is_refused():
    epl.init(epl.Config({"auto.auto_parallel": True, "pipeline.num_stages": 2,
                         "cluster.devices_per_worker": 2}))
    with epl.replicate(1):
        loss = mlp(tf.ones([4, models.IN]), tf.zeros([4], tf.int64), WIDTHS)
    with pytest.raises(ValueError, match="has epl.replicate / epl.split annotations"):
        tf.train.GradientDescentOptimizer(0.1).minimize(loss)
