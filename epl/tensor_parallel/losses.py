"""Softmax cross-entropy and argmax over class-sharded logits.

Shard i holds logits columns ``[o_i, o_i + c_i)``.  Only ``[batch]``-sized
vectors leave a shard: the row maximum (for stability; no gradient flows
through it), the normaliser ``sum(exp(logits - max))`` and the label's logit,
each combined once across shards.  So the loss is
``log(sum_i s_i) + max - sum_i t_i``, exactly the unsplit softmax
cross-entropy, and autodiff gives every shard its own ``softmax_i - onehot_i``.
"""
import tensorflow as tf

from epl import ir
from epl.tensor_parallel import sharding


def sparse_softmax_cross_entropy(sharded, labels, name=None):
    """Per-example loss (shape of ``labels``) from class-sharded logits."""
    with sharding.raw(), tf.name_scope(name or "EplShardedSoftmaxCrossEntropy"):
        labels = tf.convert_to_tensor(labels)
        if not labels.dtype.is_integer:
            raise ValueError("sparse softmax cross-entropy needs integer labels, got %s"
                             % labels.dtype)
        maxes = []
        for i, logits in enumerate(sharded.shards):
            with sharding.on_shard(i):
                maxes.append(tf.reduce_max(logits, axis=-1))
        row_max = tf.stop_gradient(tf.reduce_max(tf.stack(maxes, axis=0), axis=0))
        norms, picked = [], []
        for i, logits in enumerate(sharded.shards):
            # (the labels' one-hot is computed on the shard too)
            with sharding.on_shard(i, ir.Graph.get(logits.graph).taskgraph_of(logits.op)):
                shifted = logits - tf.expand_dims(tf.cast(row_max, logits.dtype), -1)
                norms.append(tf.reduce_sum(tf.exp(shifted), axis=-1))
                # one_hot of a label outside this shard is an all-zero row.
                local = tf.cast(labels, tf.int64) - sharded.offsets[i]
                onehot = tf.one_hot(local, sharded.sizes[i], dtype=logits.dtype)
                picked.append(tf.reduce_sum(shifted * onehot, axis=-1))
        return tf.math.log(tf.add_n(norms)) - tf.add_n(picked)


def argmax(sharded, output_type=tf.int64, name=None):
    """Index of the largest logit over all shards (the first one on ties, like tf.argmax)."""
    with sharding.raw(), tf.name_scope(name or "EplShardedArgMax"):
        best, where = [], []
        for i, logits in enumerate(sharded.shards):
            with sharding.on_shard(i):
                best.append(tf.reduce_max(logits, axis=-1))
                where.append(tf.argmax(logits, axis=-1, output_type=tf.int64)
                             + sharded.offsets[i])
        winner = tf.argmax(tf.stack(best, axis=-1), axis=-1, output_type=tf.int32)
        picked = tf.reduce_sum(tf.stack(where, axis=-1)
                               * tf.one_hot(winner, len(where), dtype=tf.int64), axis=-1)
        return tf.cast(picked, output_type)
