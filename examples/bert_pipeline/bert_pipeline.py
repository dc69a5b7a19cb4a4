"""A tiny BERT-like encoder trained as a 2-stage pipeline (seed manual §8.2.1).

Stage 0: embeddings + the first encoder layer; stage 1: the second encoder layer and a
masked-token prediction head.  Synthetic data, so it runs anywhere:

    bash run.sh                                               # GPUs, or 2 virtual CPU devices
    epl-launch --num_workers 1 --gpu_per_worker 2 run.sh      # 2 (virtual) devices
    EPL_CLUSTER_DEVICES_PER_WORKER=4 python bert_pipeline.py  # 2 stages x 2 pipeline replicas

The 2 stages need 2 devices.  On a machine without GPUs, and when neither the environment
nor epl-launch says how many devices to use, the example asks EPL for 2 virtual CPU devices
(``cluster.devices_per_worker``), so it runs unchanged on a laptop.  ``--steps`` (or
``BERT_STEPS``) sets how many steps it trains.
"""
import argparse
import os

import numpy as np
import tensorflow.compat.v1 as tf

tf.disable_v2_behavior()  # TF 2.x: TF1 graph semantics (1.15: its defaults)
import epl

VOCAB, SEQ, HIDDEN, HEADS, FFN, BATCH = 64, 16, 32, 4, 64, 8

tf.logging.set_verbosity(tf.logging.ERROR)
parser = argparse.ArgumentParser()
parser.add_argument("--steps", type=int, default=int(os.environ.get("BERT_STEPS", "20")))
args = parser.parse_args()

config = {"pipeline.num_micro_batch": 4}
if ("EPL_CLUSTER_DEVICES_PER_WORKER" not in os.environ
        and not tf.config.experimental.list_physical_devices("GPU")):
    config["cluster.devices_per_worker"] = 2   # one virtual CPU device per stage
epl.init(epl.Config(config))


def layer_norm(x, name):
    with tf.variable_scope(name):
        gamma = tf.get_variable("gamma", [HIDDEN], initializer=tf.ones_initializer())
        beta = tf.get_variable("beta", [HIDDEN], initializer=tf.zeros_initializer())
        mean, var = tf.nn.moments(x, axes=[-1], keep_dims=True)
        return (x - mean) * tf.math.rsqrt(var + 1e-6) * gamma + beta


def encoder_layer(x, name):
    with tf.variable_scope(name):
        def heads(t):
            return tf.transpose(tf.reshape(t, [-1, SEQ, HEADS, HIDDEN // HEADS]), [0, 2, 1, 3])
        q = heads(tf.layers.dense(x, HIDDEN, name="query"))
        k = heads(tf.layers.dense(x, HIDDEN, name="key"))
        v = heads(tf.layers.dense(x, HIDDEN, name="value"))
        scores = tf.matmul(q, k, transpose_b=True) / np.sqrt(HIDDEN // HEADS)
        ctx = tf.matmul(tf.nn.softmax(scores), v)
        ctx = tf.reshape(tf.transpose(ctx, [0, 2, 1, 3]), [-1, SEQ, HIDDEN])
        x = layer_norm(x + tf.layers.dense(ctx, HIDDEN, name="attention_output"), "ln_attention")
        ffn = tf.layers.dense(tf.layers.dense(x, FFN, activation=tf.nn.relu, name="intermediate"),
                              HIDDEN, name="output")
        return layer_norm(x + ffn, "ln_output")


def model_stage0(tokens):
    emb = tf.get_variable("word_embeddings", [VOCAB, HIDDEN],
                          initializer=tf.truncated_normal_initializer(stddev=0.02))
    pos = tf.get_variable("position_embeddings", [SEQ, HIDDEN],
                          initializer=tf.truncated_normal_initializer(stddev=0.02))
    x = layer_norm(tf.nn.embedding_lookup(emb, tokens) + pos, "ln_embeddings")
    return encoder_layer(x, "layer_0")


def model_stage1(x, targets):
    x = encoder_layer(x, "layer_1")
    logits = tf.layers.dense(x, VOCAB, name="lm_head")
    return tf.losses.sparse_softmax_cross_entropy(targets, logits)


# Synthetic "masked LM" data: predict each token from its (shifted) neighbours.
rng = np.random.RandomState(0)
data = rng.randint(0, VOCAB, (BATCH * 64, SEQ)).astype(np.int64)
dataset = tf.data.Dataset.from_tensor_slices((data, np.roll(data, 1, axis=1))).repeat()
tokens, targets = tf.data.make_one_shot_iterator(dataset.batch(BATCH)).get_next()

# model annotation (seed §8.2.1)
epl.set_default_strategy(epl.replicate(1))
hidden = model_stage0(tokens)
epl.set_default_strategy(epl.replicate(1))
loss = model_stage1(hidden, targets)

step = tf.train.get_or_create_global_step()
train_op = tf.train.AdamOptimizer(1e-3).minimize(loss, global_step=step)
epl.add_to_collection(loss, epl.GraphKeys.GLOBAL_MEAN_OBJECTS)  # mean over micro-batches

print("EPL: %r, %d micro-batches" % (epl.Env.get().cluster,
                                      epl.Env.get().config.get("pipeline.num_micro_batch")))
with tf.train.MonitoredTrainingSession() as sess:
    for _ in range(args.steps):
        value, _, s = sess.run([loss, train_op, step])
        if s % 5 == 0:
            print("step %d, loss %.4f" % (s, value))
print("Train Finished.")
