"""BERT's warm start with ``global_step`` in the checkpoint (issue 24, item 1).

Every BERT checkpoint holds ``global_step``; ``tf.train.init_from_checkpoint(ckpt,
{"/": "/"})`` then replaces the step's initializer by a restore.  The initializer
runs before anything can read the step, so it must never be ordered after the
step's readers (the global-step pass orders only the step's advances).  Oracle: the
same program without EPL on one device with the global batch, through
MonitoredTrainingSession as BERT's run_classifier trains; the step continues from
the checkpoint's value.
"""
import os

import numpy as np
import pytest
import tensorflow.compat.v1 as tf

import epl
from tests import models
from tests.corpus import bert

STEPS, B, START = 3, 4, 6

LAYOUTS = {
    # name: (devices, micro-batches, annotate, global batch / B)
    "replicate1": (1, 1, "default", 1),
    "dp2": (2, 1, "default", 2),
    "ga2": (1, 2, "default", 2),
    "ga2_unannotated": (1, 2, None, 2),
    "pipeline2": (2, 2, "stages", 2),
}


def _pretrained(tmpdir):
    """A checkpoint of every variable the fine-tuning program has when it warm-starts
    (its model and ``global_step`` = START), with other values than its initializers."""
    path = os.path.join(str(tmpdir), "pretrained")
    if os.path.exists(path + ".index"):
        return path
    with tf.Graph().as_default():
        bert.model([tf.constant(a) for a in bert.data(2, seed=9)], seed=900)
        step = tf.train.get_or_create_global_step()
        with tf.Session() as sess:
            sess.run(tf.global_variables_initializer())
            sess.run(step.assign(START))
            return tf.train.Saver().save(sess, path)


def _fine_tune(tmpdir, layout=None, factor=1):
    """Warm-start from the checkpoint and train: every variable's value afterwards."""
    pretrained = _pretrained(tmpdir)
    models.reset()
    stages, runs, batch = None, STEPS, B * factor
    if layout is not None:
        devices, micro, annotate, _ = LAYOUTS[layout]
        epl.init(epl.Config({"cluster.devices_per_worker": devices,
                             "pipeline.num_micro_batch": micro,
                             "communication.clip_after_allreduce": True}))
        batch = B
        if annotate == "stages":
            scopes = [epl.replicate(1, name="stage_0"), epl.replicate(1, name="stage_1")]
            stages = scopes.__getitem__
        elif annotate == "default":
            epl.set_default_strategy(epl.replicate(1))
        else:   # accumulation across runs: one micro-batch per run
            runs = STEPS * micro
    loss = bert.model(bert.batches(bert.data(STEPS * 4 * B), batch), stages=stages)
    tf.train.get_or_create_global_step()
    tf.train.init_from_checkpoint(pretrained, {"/": "/"})
    # Under EPL the step is incremented as BERT does (racing with the schedule's read);
    # EPL orders the increment after the reads, as the careful local program does.
    op = bert.train_op(loss, careful=layout is None)
    variables = {v.op.name: v for v in tf.global_variables()
                 if not v.op.name.startswith("EPL_")}
    with tf.train.MonitoredTrainingSession(checkpoint_dir=None,
                                                     log_step_count_steps=None) as sess:
        for _ in range(runs):
            sess.run(op)
        return sess.run(variables)


@pytest.mark.parametrize("layout", sorted(LAYOUTS))
def test_bert_warm_start_with_global_step(layout, tmpdir):
    want = _fine_tune(tmpdir, factor=LAYOUTS[layout][3])
    got = _fine_tune(tmpdir, layout)
    assert want["global_step"] == START + STEPS
    assert sorted(got) == sorted(want)
    for k in sorted(want):
        np.testing.assert_allclose(got[k], want[k], rtol=1e-5, atol=1e-6, err_msg=k)
    # The encoder started from the checkpoint, not from the program's initializers.
    reader = tf.train.load_checkpoint(_pretrained(tmpdir))
    moved = np.abs(got["bert/embeddings/word"] - reader.get_tensor("bert/embeddings/word"))
    assert 0 < moved.max() < 0.05
