"""A GPT decoder in plain TF1 (``tf.compat.v1``, static shapes) for planning and tests.

Megatron-LM's GPT (Narayanan et al., SC'21): token and position embeddings, ``layers``
pre-LayerNorm blocks (fused Q/K/V dense, causal softmax attention, output projection;
a 4h GELU MLP), a final LayerNorm and an LM head tied to the token embedding.  Its
parameter count is Eq. 2 of the paper plus the final LayerNorm's 2h.  Every block lives
under the name scope ``layer_<i>``, which is how the planner finds repeated blocks.
No dropout (it adds masks to the activations; docs/plan.md).

``GPT(..., split=t)`` builds the same model with tensor parallelism EPL runs: the
embeddings, every block and the head (final LayerNorm, LM head, loss) each under its own
``epl.split(t)`` (docs/split.md: column/row-parallel dense layers, head-parallel
attention: with ``split`` Q, K and V are three products, the heads EPL splits; the
fused Q/K/V product's slices would run whole on the split's first device; the LM head
tied to the embedding and its loss do: EPL says so when it rewrites).  On ``d * t``
devices with no ``replicate`` scope EPL runs it as ``d`` data-parallel groups of ``t``
devices (Megatron-LM's t x d).  Build it after
``epl.init``; the planner prices the model built without ``split`` (``t`` comes from the
strategy's ``["tensor_parallel", {"degree": t}]``).
"""
import contextlib
import math

import numpy as np
import tensorflow as tf

v1 = tf.compat.v1


def _layer_norm(x, h):
    gamma = v1.get_variable("gamma", [h], initializer=v1.ones_initializer())
    beta = v1.get_variable("beta", [h], initializer=v1.zeros_initializer())
    mean, var = tf.nn.moments(x, axes=[-1], keepdims=True)
    return (x - mean) * tf.math.rsqrt(var + 1e-5) * gamma + beta


def _dense(x, units, name):
    # (the layer class, which ``epl.split`` shards; its ``dense`` function is deprecated)
    return v1.layers.Dense(units, name=name)(x)


class GPT(object):
    """``GPT(layers, hidden, heads)``: ``model_fn``, ``dataset_fn``, ``optimizer_fn``
    (Adam) as ``epl.auto.predict`` / ``plan`` / ``accelerate`` take them."""

    def __init__(self, layers, hidden, heads, seq=2048, vocab=51200, batch=1,
                 learning_rate=1e-4, split=None):
        if hidden % heads:
            raise ValueError("GPT: hidden %d is not a multiple of heads %d" % (hidden, heads))
        if split is not None and int(split) < 1:
            raise ValueError("GPT: split %r: the devices of a split are >= 1" % (split,))
        self.split = int(split) if split is not None else None
        self.layers, self.hidden, self.heads = layers, hidden, heads
        self.seq, self.vocab, self.batch = seq, vocab, batch
        self.learning_rate = learning_rate

    def params(self):
        """Eq. 2 of the paper plus the final LayerNorm (2h)."""
        l, h, s, V = self.layers, self.hidden, self.seq, self.vocab
        return 12 * l * h * h + 13 * l * h + (V + s) * h + 2 * h

    def flops(self, batch, recompute=True):
        """Eq. 3 (matrix products of one step over ``batch`` rows): 96 B s l h^2 (1 +
        s/6h + V/16lh) with recomputation's extra forward, 72 B s l h^2 (1 + s/6h +
        V/12lh) without."""
        l, h, s, V = self.layers, self.hidden, self.seq, self.vocab
        if recompute:
            return 96.0 * batch * s * l * h * h * (1 + s / (6.0 * h) + V / (16.0 * l * h))
        return 72.0 * batch * s * l * h * h * (1 + s / (6.0 * h) + V / (12.0 * l * h))

    def dataset_fn(self):
        tokens = tf.zeros([self.batch, self.seq], tf.int32)
        return tf.data.Dataset.from_tensors((tokens, tokens)).repeat()

    def optimizer_fn(self):
        return v1.train.AdamOptimizer(self.learning_rate)

    def _scope(self):
        """A new ``epl.split(t)`` scope (``split=t``), else a context doing nothing."""
        if self.split is None:
            return contextlib.contextmanager(lambda: (yield))()
        import epl      # (here: epl imports epl.auto, which imports this module)
        return epl.split(self.split)

    def model_fn(self, features):
        tokens, labels = features
        b, s, h, a = self.batch, self.seq, self.hidden, self.heads
        d = h // a
        with v1.variable_scope("gpt", reuse=v1.AUTO_REUSE):
            with self._scope():
                wte = v1.get_variable("wte", [self.vocab, h],
                                      initializer=v1.random_normal_initializer(stddev=0.02))
                wpe = v1.get_variable("wpe", [s, h],
                                      initializer=v1.random_normal_initializer(stddev=0.02))
                x = tf.gather(wte, tokens) + wpe[None, :, :]
                mask = tf.linalg.band_part(tf.ones([s, s]), -1, 0)
            for i in range(self.layers):
                with v1.variable_scope("layer_%d" % i), self._scope():
                    with v1.variable_scope("ln1"):
                        y = _layer_norm(x, h)
                    if self.split is None:      # Megatron's fused Q/K/V product
                        qkv = _dense(y, 3 * h, "qkv")
                        qkv = tf.transpose(tf.reshape(qkv, [b, s, 3, a, d]), [2, 0, 3, 1, 4])
                        q, k, v = qkv[0], qkv[1], qkv[2]
                    else:       # one product each: EPL splits these heads (docs/split.md)
                        q, k, v = [tf.transpose(tf.reshape(_dense(y, h, name), [b, s, a, d]),
                                                [0, 2, 1, 3]) for name in ("q", "k", "v")]
                    scores = tf.matmul(q, k, transpose_b=True) * (1.0 / math.sqrt(d))
                    scores = scores * mask - 1e4 * (1.0 - mask)
                    ctx = tf.matmul(tf.nn.softmax(scores), v)
                    ctx = tf.reshape(tf.transpose(ctx, [0, 2, 1, 3]), [b, s, h])
                    x = x + _dense(ctx, h, "proj")
                    with v1.variable_scope("ln2"):
                        y = _layer_norm(x, h)
                    y = _dense(y, 4 * h, "fc1")
                    y = 0.5 * y * (1.0 + tf.tanh(0.7978845608 * (y + 0.044715 * y * y * y)))
                    x = x + _dense(y, h, "fc2")
            with self._scope():
                with v1.variable_scope("ln_f"):
                    x = _layer_norm(x, h)
                logits = tf.matmul(tf.reshape(x, [b * s, h]), wte, transpose_b=True)
                loss = tf.nn.sparse_softmax_cross_entropy_with_logits(
                    labels=tf.reshape(labels, [b * s]), logits=logits)
                return tf.reduce_mean(loss)


def table1():
    """Megatron-LM Table 1 (arXiv 2104.04473): dicts with params_b, heads, hidden,
    layers, t, p, d, gpus, batch, tflops (achieved TFLOP/s per GPU)."""
    rows = np.array([
        (1.7, 24, 2304, 24, 1, 1, 32, 32, 512, 137),
        (3.6, 32, 3072, 30, 2, 1, 32, 64, 512, 138),
        (7.5, 32, 4096, 36, 4, 1, 32, 128, 512, 142),
        (18.4, 48, 6144, 40, 8, 1, 32, 256, 1024, 135),
        (39.1, 64, 8192, 48, 8, 2, 32, 512, 1536, 138),
        (76.1, 80, 10240, 60, 8, 4, 32, 1024, 1792, 140),
        (145.6, 96, 12288, 80, 8, 8, 24, 1536, 2304, 148),
        (310.1, 128, 16384, 96, 8, 16, 15, 1920, 2160, 155),
        (529.6, 128, 20480, 105, 8, 35, 9, 2520, 2520, 163),
        (1008.0, 160, 25600, 128, 8, 64, 6, 3072, 3072, 163)], dtype=object)
    keys = ("params_b", "heads", "hidden", "layers", "t", "p", "d", "gpus", "batch", "tflops")
    return [dict(zip(keys, r)) for r in rows.tolist()]
