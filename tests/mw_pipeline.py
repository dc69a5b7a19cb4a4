"""A worker of the cross-worker pipeline tests: 2 stages on 2 workers.

With 1 device per worker the pipeline spans both workers; with 2 devices and
``cluster.device_place_prefer_intra_node`` false, two pipeline replicas each span
both workers (data parallel over them).  The chief drives everything in-graph over
TF's runtime and saves the weights; the other worker serves its devices and exits
when the chief is done.
"""
import os
import sys

import numpy as np
import tensorflow.compat.v1 as tf

tf.disable_v2_behavior()  # TF 2.x: TF1 graph semantics (1.15: its defaults)

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import epl  # noqa: E402
from tests import models  # noqa: E402
from tests.test_pipeline import _staged_forward  # noqa: E402

STEPS, MB, MICRO = 4, 3, 2


def main():
    out_dir = sys.argv[1]
    tf.logging.set_verbosity(tf.logging.ERROR)
    epl.init(epl.Config({"pipeline.num_micro_batch": MICRO}))
    replicas = epl.Env.get().cluster.total_gpu_num // 2
    x, y = models.data(STEPS * replicas * MICRO * MB)
    bx, by = models.input_batch(x, y, MB)
    loss = _staged_forward(bx, by, 2)
    step = tf.train.get_or_create_global_step()
    op = models.train_op(loss, "momentum", step)
    with tf.train.MonitoredTrainingSession(checkpoint_dir=os.path.join(out_dir, "ckpt"),
                                           save_checkpoint_steps=2) as sess:
        for _ in range(STEPS):
            sess.run(op)
        raw = sess._tf_sess()  # pylint: disable=protected-access
        weights = models.weights(raw)
        devices = sorted(set(o.device for o in raw.graph.get_operations()
                             if o.type == "MatMul"))
        np.savez(os.path.join(out_dir, "worker_%d.npz" % epl.Env.get().cluster.worker_index),
                 steps=raw.run(step), devices=np.array(devices), **weights)
    print("chief trained %d steps" % STEPS)


if __name__ == "__main__":
    main()
