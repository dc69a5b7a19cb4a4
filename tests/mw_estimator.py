"""A worker of the multi-worker Estimator test: an unchanged Estimator script under epl-launch."""
import os
import sys

import numpy as np
import tensorflow.compat.v1 as tf

tf.disable_v2_behavior()  # TF 2.x: TF1 graph semantics (1.15: its defaults)

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from tests import models  # noqa: E402
from tests.mw_train import BATCH, STEPS, start_worker  # noqa: E402


def main():
    out_dir = sys.argv[1]
    cluster, (wx, wy) = start_worker()

    def input_fn():
        return tf.data.Dataset.from_tensor_slices((wx, wy)).batch(BATCH)

    def model_fn(features, labels, mode):
        _, loss = models.forward(features, labels)
        op = models.train_op(loss, "adam", tf.train.get_global_step())
        return tf.estimator.EstimatorSpec(mode, loss=loss, train_op=op)

    est = tf.estimator.Estimator(model_fn, model_dir=os.path.join(out_dir, "est"))
    est.train(input_fn, steps=STEPS)
    if cluster.is_chief:
        np.savez(os.path.join(out_dir, "chief.npz"),
                 steps=np.array([est.get_variable_value("global_step")]),
                 **{n: est.get_variable_value(n) for n in models.initial_weights()})
    print("worker %d trained" % cluster.worker_index)


if __name__ == "__main__":
    main()
