"""What live progress (epl.runtime.progress) costs a training step.

The same small data-parallel program (2 virtual devices, fed batches) runs its steps in
two fresh processes: without epl-launch (the hook returns at once) and as an epl-launch
worker (EPL_LAUNCH_DIR set: every step is counted, a sample is written at most every 0.5
s).  Prints the median step time of both and the time spent inside the hook per step
(measured around ``epl.runtime.progress.after_run`` in the worker), and writes
benchmarks/results/progress_overhead.json.

    python benchmarks/progress_overhead.py [--steps 2000]
"""
import argparse
import json
import os
import subprocess
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(HERE))
sys.path.insert(0, HERE)


def child(steps):
    import numpy as np
    import tensorflow.compat.v1 as tf
    tf.disable_v2_behavior()
    tf.logging.set_verbosity(tf.logging.ERROR)
    import epl
    from epl.runtime import progress
    epl.init(epl.Config({"cluster.devices_per_worker": 2}))
    epl.set_default_strategy(epl.replicate(1))
    x = tf.placeholder(tf.float32, [None, 64])
    y = tf.placeholder(tf.int64, [None])
    h = tf.layers.dense(x, 64, activation=tf.nn.relu)
    logits = tf.layers.dense(h, 10)
    loss = tf.losses.sparse_softmax_cross_entropy(labels=y, logits=logits)
    step = tf.train.get_or_create_global_step()
    train = tf.train.GradientDescentOptimizer(0.01).minimize(loss, global_step=step)
    spent = []
    hook = progress.after_run

    def timed(*args):
        t0 = time.perf_counter()
        hook(*args)
        spent.append(time.perf_counter() - t0)
    progress.after_run = timed   # (integration calls progress.after_run by attribute)
    rng = np.random.RandomState(0)
    feed = {x: rng.randn(32, 64).astype(np.float32), y: rng.randint(0, 10, 32)}
    times = []
    with tf.Session() as sess:
        sess.run(tf.global_variables_initializer())
        for _ in range(steps):
            t0 = time.perf_counter()
            sess.run([loss, train], feed)
            times.append(time.perf_counter() - t0)
    spent = sorted(spent[-steps:])
    times = sorted(times[steps // 10:])
    print(json.dumps({"median_step_s": times[len(times) // 2],
                      "hook_median_s": spent[len(spent) // 2],
                      "hook_total_s": sum(spent)}))


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--steps", type=int, default=2000)
    p.add_argument("--child", action="store_true")
    a = p.parse_args()
    if a.child:
        return child(a.steps)
    from common import print_table, write_json
    rows = []
    for mode in ("off", "epl-launch"):
        env = dict(os.environ, TF_CPP_MIN_LOG_LEVEL="2")
        env.pop("EPL_LAUNCH_DIR", None)
        folder = tempfile.mkdtemp(prefix="epl-progress-bench-")
        if mode != "off":
            env.update(EPL_LAUNCH_DIR=folder, EPL_WORKER_INDEX="0")
        out = subprocess.run([sys.executable, __file__, "--child", "--steps", str(a.steps)],
                             env=env, stdout=subprocess.PIPE, check=True).stdout.decode()
        r = json.loads(out.strip().splitlines()[-1])
        samples = os.path.join(folder, "worker_0.progress.jsonl")
        r["samples"] = len(open(samples).readlines()) if os.path.exists(samples) else 0
        r["mode"] = mode
        rows.append(r)
    base = rows[0]["median_step_s"]
    for r in rows:
        r["median_step_us"] = r["median_step_s"] * 1e6
        r["hook_median_us"] = r["hook_median_s"] * 1e6
        r["step_change_pct"] = 100.0 * (r["median_step_s"] - base) / base
    print_table(rows, ["mode", "median_step_us", "hook_median_us", "step_change_pct", "samples"],
                "live progress: cost per step (%d steps, 2 virtual devices)" % a.steps)
    write_json("progress_overhead", rows)


if __name__ == "__main__":
    main()
