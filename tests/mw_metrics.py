"""A worker of test_metrics.test_two_workers (started by epl-launch): trains and updates
streaming metrics (tf.compat.v1.metrics, a hand-made sum; then tf.keras metrics used by
hand) on its share of every global batch, and saves what it read."""
import os
import pickle
import sys

import tensorflow.compat.v1 as tf

tf.disable_v2_behavior()  # TF 2.x: TF1 graph semantics (1.15: its defaults)

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import epl  # noqa: E402
from tests import test_metrics  # noqa: E402
from tests.mw_train import worker_rows  # noqa: E402


def main():
    tf.logging.set_verbosity(tf.logging.ERROR)
    epl.init()
    cluster = epl.Env.get().cluster
    workers, devices, w = cluster.worker_num, cluster.gpu_num_per_worker, cluster.worker_index
    def share(x, y):
        return worker_rows(x, y, w, workers, devices * test_metrics.BATCH)

    got = test_metrics.run_metrics({}, workers * devices, train=True, share=share)
    got_keras = test_metrics.run_keras_metrics({}, workers * devices, share=share, train=True)
    with open(os.path.join(sys.argv[1], "metrics_%d.pkl" % w), "wb") as f:
        pickle.dump((got, got_keras), f)


if __name__ == "__main__":
    main()
