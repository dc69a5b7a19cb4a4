"""One data-parallel step of a small MLP on 4 virtual CPU devices:
EPL's rewrite vs the same model replicated by hand (the classic TF1 tower pattern:
one copy per device, gradients averaged, one update).  Goal: ratio <= 1.05.

    python benchmarks/dp_overhead.py [--devices 4] [--steps 30] [--json FILE]
"""
import argparse
import os
import sys

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import tensorflow.compat.v1 as tf  # noqa: E402

tf.disable_v2_behavior()  # TF 2.x: TF1 graph semantics (1.15: its defaults)

from common import median, print_table, time_calls, write_json  # noqa: E402

tf.logging.set_verbosity(tf.logging.ERROR)
WIDTH, DEPTH, IN, CLASSES = 512, 4, 256, 10


def _data(batch):
    rng = np.random.RandomState(0)
    x = rng.randn(batch * 8, IN).astype(np.float32)
    y = rng.randint(0, CLASSES, batch * 8).astype(np.int64)
    ds = tf.data.Dataset.from_tensor_slices((x, y)).repeat().batch(batch).prefetch(8)
    return tf.data.make_one_shot_iterator(ds)


def _mlp(x, y):
    h = x
    for i in range(DEPTH):
        h = tf.layers.dense(h, WIDTH, activation=tf.nn.relu, name="l%d" % i)
    logits = tf.layers.dense(h, CLASSES, name="out")
    return tf.losses.sparse_softmax_cross_entropy(y, logits)


def build_towers(n, batch):
    it = _data(batch)
    opt = tf.train.MomentumOptimizer(0.01, 0.9)
    tower_grads = []
    for i in range(n):
        x, y = it.get_next()  # on the iterator's device, as TF's tower examples do
        with tf.device("/cpu:%d" % i), tf.variable_scope("", reuse=tf.AUTO_REUSE):
            tower_grads.append(opt.compute_gradients(_mlp(x, y)))
    avg = []
    with tf.device("/cpu:0"):
        for gvs in zip(*tower_grads):
            avg.append((tf.add_n([g for g, _ in gvs]) / float(n), gvs[0][1]))
        return opt.apply_gradients(avg)


def build_epl(n, batch):
    import epl
    epl.init(epl.Config({"cluster.devices_per_worker": n}))
    epl.set_default_strategy(epl.replicate(1))
    x, y = _data(batch).get_next()
    opt = tf.train.MomentumOptimizer(0.01, 0.9)
    return opt.minimize(_mlp(x, y))


def measure(builder, n, batch, steps):
    with tf.Graph().as_default():
        op = builder(n, batch)
        cfg = tf.ConfigProto(device_count={"CPU": n})
        with tf.Session(config=cfg) as sess:
            sess.run(tf.global_variables_initializer())
            return time_calls(lambda: sess.run(op), steps, warmup=5)


def _measure_in_subprocess(impl, a):
    """Each measurement in a fresh process: EPL's patches never touch the baseline."""
    import watchdog
    out = watchdog.run_one([sys.executable, os.path.abspath(__file__), "--child", impl,
                            "--devices", str(a.devices), "--batch", str(a.batch),
                            "--steps", str(a.steps)], timeout=600,
                           has_result=watchdog.has_json_result)
    return watchdog.json_result(out)


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--child", choices=["towers", "epl"])
    p.add_argument("--devices", type=int, default=4)
    p.add_argument("--batch", type=int, default=64)
    p.add_argument("--steps", type=int, default=30)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--json")
    a = p.parse_args()
    if a.child:
        import json
        builder = build_towers if a.child == "towers" else build_epl
        print(json.dumps(measure(builder, a.devices, a.batch, a.steps)))
        return
    times = {"towers": [], "epl": []}
    for _ in range(a.rounds):  # interleave to share the machine's noise
        for impl in ("towers", "epl"):
            times[impl] += _measure_in_subprocess(impl, a)
    rows = []
    base = median(times["towers"])
    for impl in ("towers", "epl"):
        m = median(times[impl])
        rows.append({"impl": impl, "devices": a.devices, "batch_per_device": a.batch,
                     "step_ms": m * 1e3, "samples_per_s": a.devices * a.batch / m,
                     "ratio_vs_towers": m / base})
    print_table(rows, ["impl", "devices", "batch_per_device", "step_ms", "samples_per_s",
                       "ratio_vs_towers"], "DP step: EPL vs hand-written towers")
    write_json("dp_overhead", rows, a.json)


if __name__ == "__main__":
    main()
