"""A mini-BERT classifier written the way TF1 BERT fine-tuning code is: embeddings
(word, token type, position), multi-head self-attention, layer norm, GELU, a pooler
and a classifier; an AdamWeightDecay-style optimizer that overrides
``apply_gradients`` with its own slots and ``assign`` ops, fed by ``tf.gradients``
and global-norm clipping; a warm start from a "pre-trained" checkpoint through
``tf.train.init_from_checkpoint``; ``drop_remainder=True`` input.

``stages`` lets the same code run as a 2-stage pipeline (encoder layer 0 with the
embeddings, then the rest); ``split_head`` puts the classifier under ``epl.split``.
"""
import math

import numpy as np
import tensorflow.compat.v1 as tf

VOCAB, SEQ, HIDDEN, HEADS, LAYERS, FFN, CLASSES = 30, 8, 16, 2, 2, 32, 4


def shape_list(t):
    """Static dimensions where known, dynamic ones otherwise (as BERT's get_shape_list)."""
    static = t.shape.as_list()
    dynamic = tf.shape(t)
    return [d if d is not None else dynamic[i] for i, d in enumerate(static)]


class _Init(object):
    """Truncated-normal initializers with a fixed seed per variable, so every build of
    the program starts from the same values (op seeds, not graph positions)."""

    def __init__(self, base):
        self.seed = base

    def __call__(self, stddev=0.02):
        self.seed += 1
        return tf.truncated_normal_initializer(stddev=stddev, seed=self.seed)


def gelu(x):
    return 0.5 * x * (1.0 + tf.tanh(math.sqrt(2.0 / math.pi) * (x + 0.044715 * tf.pow(x, 3))))


def layer_norm(x, name):
    with tf.variable_scope(name):
        gamma = tf.get_variable("gamma", [x.shape[-1]], initializer=tf.ones_initializer())
        beta = tf.get_variable("beta", [x.shape[-1]], initializer=tf.zeros_initializer())
        mean, var = tf.nn.moments(x, [-1], keep_dims=True)
        return (x - mean) * tf.math.rsqrt(var + 1e-6) * gamma + beta


def dense(x, units, init, name, activation=None):
    return tf.layers.dense(x, units, activation=activation, name=name,
                                     kernel_initializer=init())


def attention(x, mask, init, name):
    """Multi-head self-attention over [batch * seq, hidden] rows."""
    batch = shape_list(mask)[0]
    size = HIDDEN // HEADS
    with tf.variable_scope(name):
        def heads(t):
            t = tf.reshape(t, [batch, SEQ, HEADS, size])
            return tf.transpose(t, [0, 2, 1, 3])
        q = heads(dense(x, HIDDEN, init, "query"))
        k = heads(dense(x, HIDDEN, init, "key"))
        v = heads(dense(x, HIDDEN, init, "value"))
        scores = tf.matmul(q, k, transpose_b=True) / math.sqrt(size)
        adder = (1.0 - tf.cast(mask[:, None, None, :], tf.float32)) * -10000.0
        probs = tf.nn.softmax(scores + adder)
        context = tf.transpose(tf.matmul(probs, v), [0, 2, 1, 3])
        return tf.reshape(context, [batch * SEQ, HIDDEN])


def encoder_layer(x, mask, init, index):
    with tf.variable_scope("layer_%d" % index):
        a = attention(x, mask, init, "attention")
        a = layer_norm(dense(a, HIDDEN, init, "attention_output") + x, "attention_norm")
        h = dense(a, FFN, init, "intermediate", activation=gelu)
        return layer_norm(dense(h, HIDDEN, init, "output") + a, "output_norm")


def embeddings(ids, types, init):
    with tf.variable_scope("embeddings"):
        words = tf.get_variable("word", [VOCAB, HIDDEN], initializer=init())
        token_types = tf.get_variable("token_type", [2, HIDDEN], initializer=init())
        positions = tf.get_variable("position", [SEQ, HIDDEN], initializer=init())
        e = tf.gather(words, ids) + tf.gather(token_types, types) + positions[None, :, :]
        return layer_norm(tf.reshape(e, [-1, HIDDEN]), "norm")


def classifier(x, mask, labels, init, stages=None, split_head=None):
    """The mini-BERT's loss.  ``stages``: a function (index) -> scope for a 2-stage
    pipeline; ``split_head``: the number of devices to split the classifier over."""
    import contextlib
    import epl
    stage = stages or (lambda i: contextlib.contextmanager(lambda: (yield))())
    batch = shape_list(mask)[0]
    with stage(0):
        with tf.variable_scope("bert"):
            h = encoder_layer(x, mask, init, 0)
    with stage(1):
        with tf.variable_scope("bert"):
            for i in range(1, LAYERS):
                h = encoder_layer(h, mask, init, i)
            first = tf.reshape(h, [batch, SEQ, HIDDEN])[:, 0, :]
            pooled = dense(first, HIDDEN, init, "pooler", activation=tf.tanh)
    if split_head:
        with epl.split(split_head):
            logits = dense(pooled, CLASSES, init, "classifier")
    else:
        with stage(1):
            logits = dense(pooled, CLASSES, init, "classifier")
    per_example = tf.nn.sparse_softmax_cross_entropy_with_logits(labels=labels, logits=logits)
    return tf.reduce_mean(per_example)


def model(features, seed=100, stages=None, split_head=None):
    """The loss of a batch ``features`` = (ids, types, mask, labels)."""
    ids, types, mask, labels = features
    init = _Init(seed)
    if stages:
        with stages(0):
            with tf.variable_scope("bert"):
                x = embeddings(ids, types, init)
    else:
        with tf.variable_scope("bert"):
            x = embeddings(ids, types, init)
    return classifier(x, mask, labels, init, stages, split_head)


class AdamWeightDecay(tf.train.Optimizer):
    """Adam with decoupled weight decay, its moments kept in its own variables and the
    update written with assign ops (not through the base class's _apply_dense)."""

    def __init__(self, learning_rate, weight_decay_rate=0.01, beta_1=0.9, beta_2=0.999,
                 epsilon=1e-6, exclude_from_weight_decay=("norm", "bias"),
                 name="AdamWeightDecay"):
        super(AdamWeightDecay, self).__init__(False, name)
        self.learning_rate = learning_rate
        self.weight_decay_rate = weight_decay_rate
        self.beta_1, self.beta_2, self.epsilon = beta_1, beta_2, epsilon
        self.exclude = exclude_from_weight_decay

    def apply_gradients(self, grads_and_vars, global_step=None, name=None):
        assignments = []
        for grad, param in grads_and_vars:
            if grad is None or param is None:
                continue
            pname = param.op.name
            grad = tf.convert_to_tensor(grad)   # an embedding's IndexedSlices, densified
            m = tf.get_variable(pname + "/adam_m", shape=param.shape.as_list(),
                                          dtype=tf.float32, trainable=False,
                                          initializer=tf.zeros_initializer())
            v = tf.get_variable(pname + "/adam_v", shape=param.shape.as_list(),
                                          dtype=tf.float32, trainable=False,
                                          initializer=tf.zeros_initializer())
            next_m = self.beta_1 * m + (1.0 - self.beta_1) * grad
            next_v = self.beta_2 * v + (1.0 - self.beta_2) * tf.square(grad)
            update = next_m / (tf.sqrt(next_v) + self.epsilon)
            if not any(word in pname for word in self.exclude):
                update += self.weight_decay_rate * param
            assignments.extend([param.assign(param - self.learning_rate * update),
                                m.assign(next_m), v.assign(next_v)])
        return tf.group(*assignments, name=name)


def train_op(loss, num_steps=10, init_lr=2e-3, warmup=2, careful=False):
    """The BERT fine-tuning step: a warm-up then linearly decaying learning rate from
    global_step, tf.gradients, global-norm clipping, the custom optimizer, and
    global_step + 1 by hand, grouped with the update as BERT does (which races with
    the schedule's read of global_step; ``careful``: the increment waits for the
    update, as TensorFlow's own optimizers do)."""
    step = tf.train.get_or_create_global_step()
    lr = tf.train.polynomial_decay(init_lr, step, num_steps, end_learning_rate=0.0)
    warm = tf.cast(step, tf.float32) / float(warmup)
    lr = tf.where(step < warmup, init_lr * warm + 1e-4, lr)
    opt = AdamWeightDecay(lr)
    tvars = tf.trainable_variables()
    grads = tf.gradients(loss, tvars)
    grads, _ = tf.clip_by_global_norm(grads, clip_norm=1.0)
    op = opt.apply_gradients(zip(grads, tvars), global_step=step)
    if careful:
        with tf.control_dependencies([op]):
            return tf.group(op, [step.assign(step + 1)])
    return tf.group(op, [step.assign(step + 1)])


def data(rows, seed=0):
    rng = np.random.RandomState(seed)
    ids = rng.randint(0, VOCAB, (rows, SEQ)).astype(np.int32)
    types = (np.arange(SEQ)[None, :] >= rng.randint(2, SEQ, (rows, 1))).astype(np.int32)
    mask = (np.arange(SEQ)[None, :] < rng.randint(3, SEQ + 1, (rows, 1))).astype(np.int32)
    labels = (ids[:, 0] % CLASSES).astype(np.int64)
    return ids, types, mask, labels


def batches(arrays, batch):
    ds = tf.data.Dataset.from_tensor_slices(arrays).batch(batch, drop_remainder=True)
    return tf.data.make_one_shot_iterator(ds).get_next()


def pretrained_checkpoint(path):
    """A "pre-trained" BERT (other initial values than the fine-tuning program's)."""
    with tf.Graph().as_default():
        ids, types, mask, labels = [tf.constant(a) for a in data(2, seed=9)]
        model((ids, types, mask, labels), seed=900)
        bert = [v for v in tf.global_variables() if v.op.name.startswith("bert/")
                and "classifier" not in v.op.name and "pooler" not in v.op.name]
        with tf.Session() as sess:
            sess.run(tf.global_variables_initializer())
            return tf.train.Saver(bert).save(sess, path)


def warm_start(path):
    """Fine-tuning starts the encoder from the pre-trained checkpoint."""
    names = [name for name, _ in tf.train.list_variables(path)]
    tf.train.init_from_checkpoint(path, {n: n for n in names})
