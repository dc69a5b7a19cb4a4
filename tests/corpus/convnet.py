"""A small conv net with batch normalization, trained the TF1 way: the moving
statistics are updated by the ops in ``tf.GraphKeys.UPDATE_OPS``, which the train
op waits for.  ``towers`` builds the program without EPL as hand-written towers
(one per slice of the batch, shared weights) -- the oracle for data parallelism,
since batch norm normalizes each replica's batch with that batch's statistics.
"""
import numpy as np
import tensorflow.compat.v1 as tf

SIZE, CHANNELS, CLASSES = 6, 3, 4


def data(rows, seed=0):
    rng = np.random.RandomState(seed)
    return (rng.randn(rows, SIZE, SIZE, CHANNELS).astype(np.float32),
            rng.randint(0, CLASSES, rows).astype(np.int64))


def _init(seed):
    return tf.glorot_uniform_initializer(seed=seed)


def model(images, labels):
    """The loss of one batch; creates (or reuses) the weights and batch-norm layers."""
    with tf.variable_scope("convnet", reuse=tf.AUTO_REUSE):
        x = tf.layers.conv2d(images, 8, 3, padding="same", use_bias=False,
                                       kernel_initializer=_init(1), name="conv1")
        x = tf.layers.batch_normalization(x, training=True, momentum=0.8,
                                                    name="bn1")
        x = tf.layers.max_pooling2d(tf.nn.relu(x), 2, 2)
        x = tf.layers.conv2d(x, 8, 3, padding="same", use_bias=False,
                                       kernel_initializer=_init(2), name="conv2")
        x = tf.layers.batch_normalization(x, training=True, momentum=0.8,
                                                    name="bn2")
        x = tf.reduce_mean(tf.nn.relu(x), axis=[1, 2])
        logits = tf.layers.dense(x, CLASSES, kernel_initializer=_init(3),
                                           name="logits")
    return tf.losses.sparse_softmax_cross_entropy(labels, logits)


def train_op(loss, update_ops=None):
    update_ops = (tf.get_collection(tf.GraphKeys.UPDATE_OPS)
                  if update_ops is None else update_ops)
    opt = tf.train.MomentumOptimizer(0.1, momentum=0.9)
    gvs = opt.compute_gradients(loss)
    with tf.control_dependencies(update_ops + [g for g, _ in gvs]):
        return opt.apply_gradients(gvs, global_step=tf.train.get_or_create_global_step())


def towers(images, labels, n, stats_from=0):
    """The program as n hand-written towers (no EPL): tower i computes on the i-th
    slice of the batch; the loss is the towers' mean; the moving statistics follow
    tower ``stats_from``'s batches."""
    xs, ys = tf.split(images, n), tf.split(labels, n)
    losses, updates = [], None
    for i in range(n):
        before = len(tf.get_collection(tf.GraphKeys.UPDATE_OPS))
        losses.append(model(xs[i], ys[i]))
        if i == stats_from:
            updates = tf.get_collection(tf.GraphKeys.UPDATE_OPS)[before:]
    return tf.add_n(losses) / n, updates


STATS = ["convnet/bn1/moving_mean", "convnet/bn1/moving_variance",
         "convnet/bn2/moving_mean", "convnet/bn2/moving_variance"]
WEIGHTS = ["convnet/conv1/kernel", "convnet/conv2/kernel", "convnet/bn1/gamma",
           "convnet/bn1/beta", "convnet/bn2/gamma", "convnet/bn2/beta",
           "convnet/logits/kernel", "convnet/logits/bias"]
