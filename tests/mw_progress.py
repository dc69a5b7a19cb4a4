"""A worker of tests/test_progress.py (started by epl-launch): trains a small model for
``STEPS`` steps with MonitoredTrainingSession, fetching the loss, and prints each step's
loss as JSON so the test can compare it with what EPL's progress records hold.

    python mw_progress.py OUT_DIR [summaries]

With ``summaries`` the session has a checkpoint_dir (OUT_DIR/model): the chief writes
summaries there, and EPL adds its epl/ scalars.
"""
import json
import os
import sys
import time

import tensorflow.compat.v1 as tf

tf.disable_v2_behavior()  # TF 2.x: TF1 graph semantics (1.15: its defaults)

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import epl  # noqa: E402
from tests import models  # noqa: E402

STEPS, BATCH = 8, 4
PAUSE = 0.2    # seconds between steps: several progress samples (every 0.5 s) per job


def main():
    out_dir = sys.argv[1]
    summaries = "summaries" in sys.argv[2:]
    tf.logging.set_verbosity(tf.logging.ERROR)
    epl.init()
    epl.set_default_strategy(epl.replicate(1))
    cluster = epl.Env.get().cluster
    x, y = models.data(STEPS * BATCH * cluster.gpu_num_per_worker * 4)
    dataset = tf.data.Dataset.from_tensor_slices((x, y)).batch(BATCH).repeat()
    bx, by = tf.data.make_one_shot_iterator(dataset).get_next()
    _, loss = models.forward(bx, by)
    step = tf.train.get_or_create_global_step()
    train = models.train_op(loss, "sgd", step)
    losses = []
    with tf.train.MonitoredTrainingSession(
            checkpoint_dir=(os.path.join(out_dir, "model_%d" % cluster.worker_index)
                            if summaries else None),
            save_summaries_steps=1 if summaries else None,
            save_checkpoint_secs=None) as sess:
        for _ in range(STEPS):
            value, _, s = sess.run([loss, train, step])
            losses.append((int(s), float(value)))
            time.sleep(PAUSE)
    print("LOSSES " + json.dumps(losses), flush=True)


if __name__ == "__main__":
    main()
