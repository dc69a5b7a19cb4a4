# Seed 001 §5.3.1: large-scale classification.  A replicated (data-parallel)
# backbone and a classification head with many classes split over the devices
# (tensor model parallelism), both on the same devices.
#
#   python train.py                       # 4 virtual CPU devices, 100k classes
#   python train.py --devices 2 --classes 20000 --steps 5
#   epl-launch --num_workers 1 --gpu_per_worker 4 run.sh
import argparse
import os

import numpy as np
import tensorflow.compat.v1 as tf

tf.disable_v2_behavior()  # TF 2.x: TF1 graph semantics (1.15: its defaults)

import epl

tf.logging.set_verbosity(tf.logging.ERROR)
parser = argparse.ArgumentParser()
parser.add_argument("--devices", type=int,
                    default=int(os.environ.get("EPL_CLUSTER_DEVICES_PER_WORKER", "4")))
parser.add_argument("--classes", type=int, default=100000)
parser.add_argument("--batch", type=int, default=32, help="per replica")
parser.add_argument("--steps", type=int, default=10)
args = parser.parse_args()

config = epl.Config({"cluster.colocate_split_and_replicate": True,
                     "cluster.devices_per_worker": args.devices})
epl.init(config)
n = epl.Env.get().cluster.total_gpu_num

# Synthetic "images": 8x8x3, labels over args.classes classes.
rng = np.random.RandomState(0)
images = rng.rand(args.batch * n * args.steps, 8, 8, 3).astype(np.float32)
labels = rng.randint(0, args.classes, len(images)).astype(np.int64)
dataset = tf.data.Dataset.from_tensor_slices((images, labels)).batch(args.batch).repeat()
x, y = tf.data.make_one_shot_iterator(dataset).get_next()

with epl.replicate(device_count=1):          # the backbone: data parallel
    h = tf.layers.conv2d(x, 16, 3, activation=tf.nn.relu)
    h = tf.layers.max_pooling2d(h, 2, 2)
    h = tf.layers.flatten(h)
    features = tf.layers.dense(h, 64, activation=tf.nn.relu)

with epl.split(device_count=n):              # the head: classes split over n devices
    logits = tf.layers.dense(features, args.classes)
    loss = tf.losses.sparse_softmax_cross_entropy(labels=y, logits=logits)
    accuracy = tf.reduce_mean(tf.cast(tf.equal(tf.argmax(logits, -1), y), tf.float32))

step = tf.train.get_or_create_global_step()
train_op = tf.train.AdamOptimizer(0.001).minimize(loss, global_step=step)

head = [v for v in tf.global_variables() if v.op.name.startswith("dense_1/")]
print("EPL: %d devices; head of %d classes in %d shards: %s parameters each"
      % (n, args.classes, n, sorted(set(int(np.prod(v.shape)) for v in head
                                        if "kernel" in v.op.name))))
with tf.train.MonitoredTrainingSession() as sess:
    for _ in range(args.steps):
        l, a, s, _ = sess.run([loss, accuracy, step, train_op])
        print("step %d loss %.4f accuracy %.3f" % (s, l, a))
print("Train Finished.")
