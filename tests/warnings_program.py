"""Runs EPL through its main modes with TensorFlow's warnings on (test_warnings.py
checks that none of them points into EPL's own modules)."""
import os
import sys
import tempfile

import numpy as np
import tensorflow.compat.v1 as tf
from tensorflow.python.util import deprecation

tf.disable_v2_behavior()  # TF 2.x: TF1 graph semantics (1.15: its defaults)

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import epl  # noqa: E402
from epl.auto.gpt import GPT  # noqa: E402
from tests import models  # noqa: E402


def fresh(devices, **cfg):
    # TensorFlow warns once per deprecated function: forget which it warned about, so a
    # use of EPL's after the program's own is seen
    deprecation._PRINTED_WARNING.clear()
    models.reset()
    conf = {"cluster.devices_per_worker": devices}
    conf.update(cfg)
    epl.init(epl.Config(conf))


def train(op, steps=2):
    with tf.train.MonitoredTrainingSession() as sess:
        for _ in range(steps):
            sess.run(op)


def main():
    x, y = models.data(64)

    def batches(n, **kwargs):
        ds = tf.data.Dataset.from_tensor_slices((x, y)).batch(n, **kwargs).repeat()
        return tf.data.make_one_shot_iterator(ds).get_next()
    # data parallelism (the seed's quick start), fixed-shape input, replicate(k > 1)
    for batch_kwargs, count in (({}, 1), ({"drop_remainder": True}, 2)):
        fresh(2)
        bx, by = batches(8, **batch_kwargs)
        with epl.replicate(count):
            _, loss = models.forward(bx, by)
        step = tf.train.get_or_create_global_step()
        train(tf.train.MomentumOptimizer(0.01, 0.9).minimize(loss, step))
    # a pipeline, hybrid split, MoE
    fresh(2, **{"pipeline.num_micro_batch": 2})
    bx, by = batches(4)
    with epl.replicate(1, name="s0"):
        h = tf.layers.dense(bx, 8)
    with epl.replicate(1, name="s1"):
        loss = tf.losses.sparse_softmax_cross_entropy(by, tf.layers.dense(h, 5))
    train(tf.train.AdamOptimizer(0.01).minimize(loss))
    fresh(2, **{"cluster.colocate_split_and_replicate": True})
    bx, by = batches(4)
    with epl.replicate(1):
        h = tf.layers.dense(bx, 8)
    with epl.split(2):
        logits = tf.layers.dense(h, 6)
        moe = epl.moe_layer(h, num_experts=2, hidden_size=4)
    loss = tf.losses.sparse_softmax_cross_entropy(by, logits) + tf.reduce_mean(moe[0])
    train(tf.train.AdamOptimizer(0.01).minimize(loss))
    # a custom optimizer written with tf.gradients and assigns; tf.keras fit
    fresh(2)
    epl.set_default_strategy(epl.replicate(1))
    bx, by = batches(4)
    _, loss = models.forward(bx, by)
    tvars = tf.trainable_variables()
    grads, _ = tf.clip_by_global_norm(tf.gradients(loss, tvars), 1.0)
    train(tf.group(*[tf.assign_sub(v, 0.1 * g) for g, v in zip(grads, tvars)]))
    fresh(2)
    epl.set_default_strategy(epl.replicate(1))
    inp = tf.keras.Input((models.IN,))
    model = tf.keras.Model(inp, tf.keras.layers.Dense(5, activation="softmax")(inp))
    model.compile(tf.keras.optimizers.SGD(0.1), "sparse_categorical_crossentropy")
    model.fit(tf.data.Dataset.from_tensor_slices((x, y)).batch(8).repeat(), steps_per_epoch=2,
              epochs=1, verbose=0)
    # memory-efficient AMP (its loss scale's update), the planner's GPT built and priced
    fresh(2, **{"amp.level": "O1", "amp.loss_scale": "dynamic"})
    epl.set_default_strategy(epl.replicate(1))
    bx, by = batches(4)
    _, loss = models.forward(bx, by)
    deprecation._PRINTED_WARNING.clear()        # (the loss called tf.where: again)
    train(tf.train.AdamOptimizer(0.01).minimize(loss))
    fresh(1)
    gpt = GPT(1, 64, 4, seq=16, vocab=64)
    epl.auto.predict(gpt.model_fn, gpt.dataset_fn, gpt.optimizer_fn,
                     [["data_parallel", {"degree": 8}]], epl.auto.Cluster.preset("a100-80gb"),
                     global_batch=8)
    if hasattr(tf, "estimator"):  # TF 1.15 and 2.15 (removed in 2.16)
        estimator(x, y)
    print("EPL warnings program done")


def estimator(x, y):
    """An Estimator trained and evaluated with a metric, under data parallelism."""
    fresh(2)

    def input_fn():
        return tf.data.Dataset.from_tensor_slices((x, y)).batch(4).repeat()

    def model_fn(features, labels, mode):
        logits, loss = models.forward(features, labels)
        if mode == tf.estimator.ModeKeys.EVAL:
            acc = tf.metrics.accuracy(labels, tf.argmax(logits, 1))
            return tf.estimator.EstimatorSpec(mode, loss=loss, eval_metric_ops={"acc": acc})
        op = tf.train.GradientDescentOptimizer(0.1).minimize(
            loss, tf.train.get_global_step())
        return tf.estimator.EstimatorSpec(mode, loss=loss, train_op=op)
    with tempfile.TemporaryDirectory() as model_dir:
        est = tf.estimator.Estimator(model_fn, model_dir=model_dir)
        est.train(input_fn, steps=2)
        est.evaluate(input_fn, steps=2)


if __name__ == "__main__":
    main()
