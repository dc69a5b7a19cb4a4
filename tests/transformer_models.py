"""A GPT-style decoder written as plain TF1 code, for the tensor-parallel oracles: the
same code runs locally and under ``epl.split`` (only the annotation differs).

Token and position embeddings (``tf.get_variable``), then blocks of pre-LayerNorm
causal self-attention (Q/K/V ``tf.layers.dense``, reshape to heads, transpose,
``tf.matmul``, scale, causal mask, ``tf.nn.softmax``, ``tf.matmul`` with V, transpose
and reshape back, output projection) and a GELU MLP, with residuals; a final
LayerNorm and an LM head with the softmax cross-entropy over the vocabulary.
``kv_heads`` < ``heads`` makes grouped-query attention (queries reshaped to
``[batch, seq, kv_heads, group, head_dim]``, K/V broadcast over the group).
"""
import contextlib
import math

import numpy as np
import tensorflow.compat.v1 as tf

VOCAB, SEQ, LAYERS = 23, 6, 2


def _init(values, name, shape, rng):
    if name not in values:
        values[name] = (rng.randn(*shape) * 0.3).astype(np.float32)
    return tf.constant_initializer(values[name])


def gelu(x):
    return 0.5 * x * (1.0 + tf.tanh(math.sqrt(2.0 / math.pi) * (x + 0.044715 * x * x * x)))


def layer_norm(x, name, width):
    with tf.variable_scope(name):
        gamma = tf.get_variable("gamma", [width], initializer=tf.ones_initializer())
        beta = tf.get_variable("beta", [width], initializer=tf.zeros_initializer())
    mean, var = tf.nn.moments(x, [-1], keep_dims=True)
    return (x - mean) * tf.rsqrt(var + 1e-5) * gamma + beta


class Decoder(object):
    """``build(ids, labels)`` -> loss.  ``scope(i)``: the context block ``i`` (and the
    embeddings, i = -1, and the head, i = LAYERS) is built in."""

    def __init__(self, width=16, heads=4, kv_heads=None, layers=LAYERS, dropout=0.0,
                 scope=None, seed=11):
        self.width, self.heads = width, heads
        self.kv_heads = kv_heads or heads
        self.layers, self.dropout = layers, dropout
        self.scope = scope or (lambda i: contextlib.contextmanager(lambda: (yield))())
        self.values = {}
        self.seed = seed
        self.tensors = {}   # name -> tensor, for the placement tests

    def dense(self, x, units, name, activation=None, use_bias=True):
        scope = tf.get_variable_scope().name
        full = "%s/%s" % (scope, name) if scope else name
        return tf.layers.dense(
            x, units, activation=activation, name=name, use_bias=use_bias,
            kernel_initializer=_init(self.values, full + "/kernel", [int(x.shape[-1]), units],
                                     self.rng),
            bias_initializer=_init(self.values, full + "/bias", [units], self.rng))

    def attention(self, x):
        d, h, kv = self.width, self.heads, self.kv_heads
        hd, group = d // h, h // kv
        q = self.dense(x, d, "query")
        # (no key bias: it adds the same q.b to every score of a query, which the softmax
        # ignores; its gradient is 0 up to float noise, which Adam scales to full steps)
        k = self.dense(x, kv * hd, "key", use_bias=False)
        v = self.dense(x, kv * hd, "value")
        bias = (1.0 - tf.linalg.band_part(tf.ones([SEQ, SEQ]), -1, 0)) * -1e9   # causal
        if group == 1:
            q = tf.transpose(tf.reshape(q, [-1, SEQ, h, hd]), [0, 2, 1, 3])
            k = tf.transpose(tf.reshape(k, [-1, SEQ, h, hd]), [0, 2, 1, 3])
            v = tf.transpose(tf.reshape(v, [-1, SEQ, h, hd]), [0, 2, 1, 3])
        else:   # [b, kv, group, s, hd] queries against [b, kv, 1, s, hd] keys/values
            q = tf.transpose(tf.reshape(q, [-1, SEQ, kv, group, hd]), [0, 2, 3, 1, 4])
            k = tf.expand_dims(tf.transpose(tf.reshape(k, [-1, SEQ, kv, hd]), [0, 2, 1, 3]), 2)
            v = tf.expand_dims(tf.transpose(tf.reshape(v, [-1, SEQ, kv, hd]), [0, 2, 1, 3]), 2)
        scores = tf.matmul(q, k, transpose_b=True) * (1.0 / math.sqrt(hd))
        probs = tf.nn.softmax(scores + bias)
        if self.dropout:
            probs = tf.nn.dropout(probs, rate=self.dropout)
        self.tensors.setdefault("probs", probs)
        out = tf.matmul(probs, v)
        if group == 1:
            out = tf.transpose(out, [0, 2, 1, 3])
        else:
            out = tf.transpose(out, [0, 3, 1, 2, 4])
        merged = tf.reshape(out, [-1, SEQ, d])
        self.tensors.setdefault("heads_merged", merged)
        return self.dense(merged, d, "proj")

    def block(self, x, i):
        with tf.variable_scope("block_%d" % i):
            x = x + self.attention(layer_norm(x, "ln_1", self.width))
            m = self.dense(layer_norm(x, "ln_2", self.width), 4 * self.width, "fc",
                           activation=gelu)
            return x + self.dense(m, self.width, "fc_out")

    def build(self, ids, labels):
        self.rng = np.random.RandomState(self.seed)
        with self.scope(-1):
            tok = tf.get_variable("tok_emb", [VOCAB, self.width],
                                  initializer=_init(self.values, "tok_emb",
                                                    [VOCAB, self.width], self.rng))
            pos = tf.get_variable("pos_emb", [SEQ, self.width],
                                  initializer=_init(self.values, "pos_emb",
                                                    [SEQ, self.width], self.rng))
            x = tf.nn.embedding_lookup(tok, ids) + pos
        for i in range(self.layers):
            with self.scope(i):
                x = self.block(x, i)
        with self.scope(self.layers):
            logits = self.dense(layer_norm(x, "ln_f", self.width), VOCAB, "lm_head")
            loss = tf.losses.sparse_softmax_cross_entropy(labels=labels, logits=logits)
        return loss


def data(rows, seed=0):
    rng = np.random.RandomState(seed)
    ids = rng.randint(0, VOCAB, (rows, SEQ + 1)).astype(np.int64)
    return ids[:, :-1], ids[:, 1:]
