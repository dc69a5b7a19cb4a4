"""A worker of the multi-worker warm-start test (test_multi_worker.py): BERT's warm start,
``init_from_checkpoint(ckpt, {"/": "/"})`` from a checkpoint holding ``global_step``,
then data-parallel training over the workers (issue 24, item 1)."""
import os
import sys

import numpy as np
import tensorflow.compat.v1 as tf

tf.disable_v2_behavior()  # TF 2.x: TF1 graph semantics (1.15: its defaults)

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from tests import models  # noqa: E402
from tests.mw_train import BATCH, STEPS, start_worker  # noqa: E402


def train(bx, by, checkpoint):
    """The program (with or without EPL): warm start, then the train op."""
    _, loss = models.forward(bx, by)
    step = tf.train.get_or_create_global_step()
    tf.train.init_from_checkpoint(checkpoint, {"/": "/"})
    return models.train_op(loss, "adam", step), step


def main():
    checkpoint, out_dir = sys.argv[1], sys.argv[2]
    cluster, (wx, wy) = start_worker()
    bx, by = models.input_batch(wx, wy, BATCH)
    op, step = train(bx, by, checkpoint)
    with tf.train.MonitoredTrainingSession(checkpoint_dir=None,
                                                     log_step_count_steps=None) as sess:
        for _ in range(STEPS):
            sess.run(op)
        got = sess.run([models.value_tensor(tf.get_default_graph(), n)
                        for n in sorted(models.initial_weights())])
        np.savez(os.path.join(out_dir, "worker_%d.npz" % cluster.worker_index),
                 step=sess.run(step), **dict(zip(sorted(models.initial_weights()), got)))


if __name__ == "__main__":
    main()
