# Seed 001 §3.1: a local TF1 training script plus three EPL lines.
# Run it on 2 (virtual) devices:  EPL_CLUSTER_DEVICES_PER_WORKER=2 python local_model.py
# (or `make demo` from the repository root).
import numpy as np
import tensorflow.compat.v1 as tf

tf.disable_v2_behavior()  # TF 2.x: TF1 graph semantics (1.15: its defaults)
import epl

tf.logging.set_verbosity(tf.logging.ERROR)
epl.init()
epl.set_default_strategy(epl.replicate(1))

# Define model
num_x = np.random.randint(0, 10, (500, 20)).astype(dtype=np.float32)
num_y = np.random.randint(0, 10, 500).astype(dtype=np.int64)
dataset = tf.data.Dataset.from_tensor_slices((num_x, num_y)).batch(10).repeat(1)
iterator = tf.data.make_initializable_iterator(dataset)
tf.add_to_collection(tf.GraphKeys.TABLE_INITIALIZERS, iterator.initializer)
x, labels = iterator.get_next()
logits = tf.layers.dense(x, 2)
logits = tf.layers.dense(logits, 10)
loss = tf.losses.sparse_softmax_cross_entropy(labels=labels, logits=logits)
global_step = tf.train.get_or_create_global_step()
optimizer = tf.train.MomentumOptimizer(learning_rate=0.001, momentum=0.9)
train_op = optimizer.minimize(loss, global_step=global_step)

print("EPL: %r" % epl.Env.get().cluster)
# Training session
with tf.train.MonitoredTrainingSession() as sess:
    for i in range(10):
        train_loss, _, step = sess.run([loss, train_op, global_step])
        print("Iteration %s , Loss: %s ." % (step, train_loss))
print("Train Finished.")
