"""Trace a data-parallel MLP (docs/profiling.md).

    epl-launch --num_workers 2 --gpu_per_worker 2 train.py --profile_dir /tmp/trace
    python -m epl.profile /tmp/trace

profile.steps '10-11' traces training steps 10 and 11 of every worker (global_step 10
and 11: the same steps on every worker; MonitoredTrainingSession's initialization runs
and the chief's checkpoint saves are not counted -- profile.runs traces runs by number).
"""
import argparse

import numpy as np
import tensorflow.compat.v1 as tf

tf.disable_v2_behavior()
import epl  # noqa: E402

WIDTH, DEPTH, IN, CLASSES, BATCH = 1024, 4, 512, 10, 256


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--profile_dir", default="trace")
    ap.add_argument("--steps", type=int, default=12)
    a = ap.parse_args()
    tf.logging.set_verbosity(tf.logging.ERROR)
    epl.init(epl.Config({"profile.dir": a.profile_dir, "profile.steps": "10-11"}))
    epl.set_default_strategy(epl.replicate(1))
    rng = np.random.RandomState(0)
    x = rng.randn(BATCH * 4, IN).astype(np.float32)
    y = rng.randint(0, CLASSES, BATCH * 4).astype(np.int64)
    ds = tf.data.Dataset.from_tensor_slices((x, y)).repeat().batch(BATCH)
    bx, by = tf.data.make_one_shot_iterator(ds).get_next()
    h = bx
    for i in range(DEPTH):
        h = tf.layers.dense(h, WIDTH, activation=tf.nn.relu, name="layer%d" % i)
    loss = tf.losses.sparse_softmax_cross_entropy(by, tf.layers.dense(h, CLASSES))
    step = tf.train.get_or_create_global_step()
    train = tf.train.MomentumOptimizer(0.01, 0.9).minimize(loss, global_step=step)
    with tf.train.MonitoredTrainingSession() as sess:
        for i in range(a.steps):
            _, value = sess.run([train, loss])
            print("worker %d step %d loss %.4f"
                  % (epl.Env.get().cluster.worker_index, i + 1, value))


if __name__ == "__main__":
    main()
