"""Models for the tensor-parallel oracles: the same code runs locally and under
``epl.split`` (only the annotation differs)."""
import numpy as np
import tensorflow.compat.v1 as tf

IN, H1, H2, CLASSES = 12, 16, 10, 7


def data(rows, seed=0, classes=CLASSES, width=IN):
    rng = np.random.RandomState(seed)
    return (rng.randn(rows, width).astype(np.float32),
            rng.randint(0, classes, rows).astype(np.int64))


def init_values(seed=3, classes=CLASSES, width=IN):
    rng = np.random.RandomState(seed)
    shapes = {"dense/kernel": (width, H1), "dense/bias": (H1,),
              "dense_1/kernel": (H1, H2), "dense_1/bias": (H2,),
              "dense_2/kernel": (H2, classes), "dense_2/bias": (classes,)}
    return {k: (rng.randn(*s) * 0.3).astype(np.float32) for k, s in sorted(shapes.items())}


def _const(values, name):
    return tf.constant_initializer(values[name])


def mlp(x, labels, values, keras=False):
    """3 dense layers (column-, row-, column-parallel under split), softmax CE, accuracy."""
    if keras:
        h = tf.keras.layers.Dense(H1, activation=tf.nn.tanh, name="dense",
                                  kernel_initializer=_const(values, "dense/kernel"),
                                  bias_initializer=_const(values, "dense/bias"))(x)
        h = tf.keras.layers.Dense(H2, activation=tf.nn.relu, name="dense_1",
                                  kernel_initializer=_const(values, "dense_1/kernel"),
                                  bias_initializer=_const(values, "dense_1/bias"))(h)
        logits = tf.keras.layers.Dense(int(values["dense_2/bias"].shape[0]), name="dense_2",
                                       kernel_initializer=_const(values, "dense_2/kernel"),
                                       bias_initializer=_const(values, "dense_2/bias"))(h)
        loss = tf.reduce_mean(tf.nn.sparse_softmax_cross_entropy_with_logits(
            labels=labels, logits=logits))
    else:
        h = tf.layers.dense(x, H1, activation=tf.nn.tanh,
                            kernel_initializer=_const(values, "dense/kernel"),
                            bias_initializer=_const(values, "dense/bias"))
        h = tf.layers.dense(h, H2, activation=tf.nn.relu,
                            kernel_initializer=_const(values, "dense_1/kernel"),
                            bias_initializer=_const(values, "dense_1/bias"))
        logits = tf.layers.dense(h, int(values["dense_2/bias"].shape[0]),
                                 kernel_initializer=_const(values, "dense_2/kernel"),
                                 bias_initializer=_const(values, "dense_2/bias"))
        loss = tf.losses.sparse_softmax_cross_entropy(labels=labels, logits=logits)
    correct = tf.equal(tf.argmax(logits, axis=-1), labels)
    return logits, loss, correct


def train_op(loss, optimizer="momentum"):
    opt = (tf.train.MomentumOptimizer(0.1, momentum=0.9) if optimizer == "momentum"
           else tf.train.AdamOptimizer(0.01))
    gvs = opt.compute_gradients(loss)
    with tf.control_dependencies([g for g, _ in gvs]):
        return opt.apply_gradients(gvs, global_step=tf.train.get_or_create_global_step())
