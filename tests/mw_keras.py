"""A worker of test_keras_metrics.test_two_workers (started by epl-launch): fits the
CTR-like tf.keras model on its half of every global batch and saves what keras reported."""
import os
import pickle
import sys

import tensorflow.compat.v1 as tf

tf.disable_v2_behavior()  # TF 2.x: TF1 graph semantics (1.15: its defaults)

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import epl  # noqa: E402
from tests import test_keras_metrics as tkm  # noqa: E402


def main():
    out_dir = sys.argv[1]
    tf.logging.set_verbosity(tf.logging.ERROR)
    epl.init()
    epl.set_default_strategy(epl.replicate(1))
    cluster = epl.Env.get().cluster
    workers = cluster.worker_num
    got = tkm.train(batch=tkm.BATCH // workers,
                    share=tkm.worker_share(cluster.worker_index, workers))
    with open(os.path.join(out_dir, "keras_%d.pkl" % cluster.worker_index), "wb") as f:
        pickle.dump(got, f)


if __name__ == "__main__":
    main()
