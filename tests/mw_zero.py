"""A worker of the cross-worker ZeRO test: zero.level v1 on 2 workers x 2 devices.

The chief drives the job in-graph (every replica reads the chief's input
pipeline, one batch each); each variable and its optimizer state live on one
device of one worker.  The chief saves the weights, the devices of the optimizer
state and checkpoints; the other worker serves its devices.
"""
import os
import sys

import numpy as np
import tensorflow.compat.v1 as tf

tf.disable_v2_behavior()  # TF 2.x: TF1 graph semantics (1.15: its defaults)

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import epl  # noqa: E402
from tests import models  # noqa: E402

STEPS, BATCH = 4, 4


def main():
    optimizer, out_dir = sys.argv[1], sys.argv[2]
    tf.logging.set_verbosity(tf.logging.ERROR)
    epl.init(epl.Config({"zero.level": "v1"}))
    epl.set_default_strategy(epl.replicate(1))
    replicas = epl.Env.get().cluster.total_gpu_num
    x, y = models.data(STEPS * replicas * BATCH)
    bx, by = models.input_batch(x, y, BATCH)
    _, loss = models.forward(bx, by)
    step = tf.train.get_or_create_global_step()
    op = models.train_op(loss, optimizer, step)
    with tf.train.MonitoredTrainingSession(checkpoint_dir=os.path.join(out_dir, "ckpt"),
                                           save_checkpoint_steps=2) as sess:
        for _ in range(STEPS):
            sess.run(op)
        raw = sess._tf_sess()  # pylint: disable=protected-access
        state = [(o.name, o.device, tf.TensorShape(o.get_attr("shape")).num_elements())
                 for o in raw.graph.get_operations()
                 if o.type in ("VariableV2", "VarHandleOp")
                 and ("Adam" in o.name or "Momentum" in o.name)]
        np.savez(os.path.join(out_dir, "chief.npz"), steps=raw.run(step),
                 state=np.array(state, dtype=object), **models.weights(raw))
    print("chief trained %d steps" % STEPS)


if __name__ == "__main__":
    main()
