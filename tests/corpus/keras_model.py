"""A tf.keras functional model: token ids -> embedding -> average -> dense layers.
The embedding makes sparse (IndexedSlices) gradients, which Adam applies sparsely."""
import numpy as np
import tensorflow.compat.v1 as tf

VOCAB, LEN, CLASSES = 20, 5, 3


def data(rows, seed=0):
    rng = np.random.RandomState(seed)
    ids = rng.randint(0, VOCAB, (rows, LEN)).astype(np.int32)
    return ids, (ids.sum(axis=1) % CLASSES).astype(np.int64)


def build():
    init = tf.keras.initializers.glorot_uniform
    ids = tf.keras.Input((LEN,), dtype=tf.int32, name="ids")
    e = tf.keras.layers.Embedding(VOCAB, 8, embeddings_initializer=tf.keras.initializers
                                  .RandomUniform(-0.5, 0.5, seed=1), name="embed")(ids)
    h = tf.keras.layers.GlobalAveragePooling1D()(e)
    h = tf.keras.layers.Dense(16, activation="relu", kernel_initializer=init(seed=2),
                              name="hidden")(h)
    out = tf.keras.layers.Dense(CLASSES, activation="softmax", kernel_initializer=init(seed=3),
                                name="out")(h)
    return tf.keras.Model(ids, out)
