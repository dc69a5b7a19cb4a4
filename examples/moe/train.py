# Seed 001 §5.3.2: a (tiny) MoE transformer block under epl.split.  The expert
# FFN is tensor-parallel: experts sharded along the expert dimension, each
# device gates its own token groups, and all-to-all sends tokens to their
# experts and back.  The embedding, q/k/v projections (column-parallel dense
# layers) and the rest run on the split's devices as EPL lays them out.
#
#   python train.py                 # 4 virtual CPU devices
#   python train.py --devices 2 --experts 4 --top_k 1
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
parser.add_argument("--experts", type=int, default=8)
parser.add_argument("--top_k", type=int, default=2)
parser.add_argument("--steps", type=int, default=10)
args = parser.parse_args()

SEQ, MODEL, VOCAB, BATCH = 16, 32, 100, 8
epl.init(epl.Config({"cluster.colocate_split_and_replicate": True,
                     "cluster.devices_per_worker": args.devices}))
n = epl.Env.get().cluster.total_gpu_num
rng = np.random.RandomState(0)
tokens = tf.constant(rng.randint(0, VOCAB, (BATCH, SEQ)), tf.int64)
targets = tf.roll(tokens, shift=-1, axis=1)        # predict the next token

with epl.split(n):
    emb = tf.get_variable("embedding", [VOCAB, MODEL])
    x = tf.nn.embedding_lookup(emb, tokens)           # [batch, seq, model]
    # Self-attention (single head, causal).
    q, k, v = [tf.layers.dense(x, MODEL, use_bias=False, name=nm) for nm in "qkv"]
    scores = tf.matmul(q, k, transpose_b=True) / np.sqrt(MODEL)
    mask = tf.linalg.band_part(tf.ones([SEQ, SEQ]), -1, 0)
    scores = scores * mask - 1e9 * (1 - mask)
    x = x + tf.matmul(tf.nn.softmax(scores), v)
    # The MoE feed-forward: one token per row, grouped per device.
    flat = tf.reshape(x, [BATCH * SEQ, MODEL])
    moe_out, aux_loss = epl.moe_layer(flat, args.experts, 4 * MODEL, top_k=args.top_k,
                                      capacity_factor=1.25)
    x = x + tf.reshape(moe_out, [BATCH, SEQ, MODEL])
    logits = tf.einsum("bsm,vm->bsv", x, emb)
    loss = tf.reduce_mean(tf.nn.sparse_softmax_cross_entropy_with_logits(
        labels=targets, logits=logits)) + 0.01 * aux_loss

step = tf.train.get_or_create_global_step()
train_op = tf.train.AdamOptimizer(0.01).minimize(loss, global_step=step)
experts = [v for v in tf.trainable_variables() if "experts_w1" in v.op.name]
print("EPL: %d devices; %d experts as %s (one shard per device)"
      % (n, args.experts, [v.shape.as_list() for v in experts]))
with tf.train.MonitoredTrainingSession() as sess:
    for _ in range(args.steps):
        l, s, _ = sess.run([loss, step, train_op])
        print("step %d loss %.4f" % (s, l))
print("Train Finished.")
