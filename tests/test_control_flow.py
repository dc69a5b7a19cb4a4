"""TF1 control flow in every strategy (issue 11).

Each program of ``tests/corpus/control_flow.py`` (dynamic_rnn, a bidirectional RNN,
tf.scan / tf.map_fn, tf.cond with dropout and batch norm, a nested tf.while_loop,
an ExponentialMovingAverage) trains under EPL and without it; the oracle is the
program without EPL on one device with the global batch, compared at 1e-5.
"""
import os

import numpy as np
import pytest
import tensorflow as tf

import epl
from tests import models
from tests.corpus import control_flow as cf

STEPS, B = 3, 4

LAYOUTS = {
    # name: (devices, global batch factor, config, annotate)
    "dp2": (2, 2, {}, "default"),
    "dp4": (4, 4, {}, "default"),
    "ga2": (1, 2, {"pipeline.num_micro_batch": 2}, "default"),
    "pipeline2": (2, 2, {"pipeline.num_micro_batch": 2}, "stages"),
    "split_head": (2, 2, {"cluster.colocate_split_and_replicate": True}, "split"),
}


def _batches(rows, total=None):
    x, y = cf.data(total or STEPS * rows)
    ds = tf.data.Dataset.from_tensor_slices((x, y)).batch(rows, drop_remainder=True)
    return tf.compat.v1.data.make_one_shot_iterator(ds).get_next()


def _run(name, layout, tmpdir):
    """Train ``name`` for STEPS steps; its variables (from a checkpoint)."""
    models.reset()
    stage = split = None
    if layout is None:
        rows = B
    else:
        devices, _, cfg, annotate = LAYOUTS[layout]
        conf = {"cluster.devices_per_worker": devices}
        conf.update(cfg)
        epl.init(epl.Config(conf))
        rows = B
        if annotate == "stages":
            scopes = [epl.replicate(1, name="stage_0"), epl.replicate(1, name="stage_1")]
            stage = scopes.__getitem__
        else:
            epl.set_default_strategy(epl.replicate(1))
        split = 2 if annotate == "split" else None
    factor = LAYOUTS[_run.layout][1]
    x, y = _batches(rows * (factor if layout is None else 1), STEPS * B * factor)
    loss = cf.model(name, x, y, stage, split)
    op = cf.train_op(name, loss)
    with tf.compat.v1.Session() as sess:
        sess.run(tf.compat.v1.global_variables_initializer())
        for _ in range(STEPS):
            sess.run(op)
        path = tf.compat.v1.train.Saver().save(sess, os.path.join(str(tmpdir), layout or "local"))
    reader = tf.compat.v1.train.load_checkpoint(path)
    return {k: reader.get_tensor(k) for k in reader.get_variable_to_shape_map()}


@pytest.mark.parametrize("layout", sorted(LAYOUTS))
@pytest.mark.parametrize("name", cf.MODELS)
def test_control_flow_program(name, layout, tmpdir):
    _run.layout = layout
    want = _run(name, None, tmpdir)
    got = _run(name, layout, tmpdir)
    keys = sorted(k for k in want if "Momentum" not in k)   # split: slots are per shard
    assert any("ExponentialMovingAverage" in k for k in keys) == (name == "ema")
    for k in keys:
        np.testing.assert_allclose(got[k], want[k], rtol=1e-5, atol=1e-6, err_msg=k)
    moved = [k for k in keys if k.startswith("proj/kernel")]
    assert moved and not np.allclose(got[moved[0]], cf_initial(name)[moved[0]], atol=1e-4)


def cf_initial(name):
    """The program's variables before training (to check that training moved them)."""
    models.reset()
    x, y = _batches(B)
    cf.model(name, x, y)
    with tf.compat.v1.Session() as sess:
        sess.run(tf.compat.v1.global_variables_initializer())
        return {v.op.name: sess.run(v) for v in tf.compat.v1.global_variables()}
