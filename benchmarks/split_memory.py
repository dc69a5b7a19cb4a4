"""Large-scale classification: a data-parallel backbone with a big softmax head,
the head replicated (plain DP) vs split over the devices (EPL hybrid,
seed 001 §5.3.1).  Reports, side by side in one run:

* per-device bytes of parameters and of optimizer state (Adam slots), read from
  where the rewritten graph places every variable (DP with one copy per device,
  as on GPUs: ``cluster.variable_copies = per_device``).  Goal for the head:
  1/n of the replicated one;
* step time of DP vs hybrid (median of timed steps; each mode in its own
  process so nothing is shared).

    python benchmarks/split_memory.py [--devices 4] [--classes 50000] [--json FILE]
"""
import argparse
import json
import os
import sys

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

from common import median, print_table, time_calls, write_json  # noqa: E402
import watchdog  # noqa: E402

FEATURES, IN = 256, 64


def run_mode(mode, devices, classes, batch, steps):
    import tensorflow.compat.v1 as tf
    import epl
    tf.logging.set_verbosity(tf.logging.ERROR)
    epl.init(epl.Config({"cluster.devices_per_worker": devices,
                         "cluster.colocate_split_and_replicate": True,
                         "cluster.variable_copies": "per_device"}))
    rng = np.random.RandomState(0)
    x = rng.randn(batch * 8, IN).astype(np.float32)
    y = rng.randint(0, classes, batch * 8).astype(np.int64)
    ds = tf.data.Dataset.from_tensor_slices((x, y)).repeat().batch(batch).prefetch(8)
    bx, by = tf.data.make_one_shot_iterator(ds).get_next()
    with epl.replicate(1):
        feats = tf.layers.dense(bx, FEATURES, activation=tf.nn.relu, name="backbone")
    head_scope = epl.split(devices) if mode == "hybrid" else epl.replicate(1)
    if mode == "dp":
        # One TaskGraph: the head is part of the replica.
        head_scope = None
    if head_scope is None:
        with epl.replicate(1):
            logits = tf.layers.dense(feats, classes, name="head")
    else:
        with head_scope:
            logits = tf.layers.dense(feats, classes, name="head")
    loss = tf.losses.sparse_softmax_cross_entropy(by, logits)
    op = tf.train.AdamOptimizer(1e-3).minimize(loss)
    with tf.Session() as sess:
        sess.run(tf.global_variables_initializer())
        times = time_calls(lambda: sess.run(op), steps, warmup=3)
        per_device = {}
        for v in tf.global_variables():
            dev = v.op.device or "?"
            kind = "optimizer" if ("/Adam" in v.op.name or "_power" in v.op.name) else "params"
            key = (dev.rsplit(":", 1)[-1], kind)
            per_device[key] = per_device.get(key, 0) + int(np.prod(v.shape)) * 4
    params = [b for (d, k), b in per_device.items() if k == "params"]
    opt = [b for (d, k), b in per_device.items() if k == "optimizer"]
    return {"mode": mode, "devices": devices, "classes": classes, "batch_per_replica": batch,
            "step_ms": 1000 * median(times), "max_param_bytes_per_device": max(params),
            "max_optimizer_bytes_per_device": max(opt),
            "head_param_bytes_local": (FEATURES * classes + classes) * 4}


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--devices", type=int, default=4)
    p.add_argument("--classes", type=int, default=50000)
    p.add_argument("--batch", type=int, default=32)
    p.add_argument("--steps", type=int, default=10)
    p.add_argument("--mode", help=argparse.SUPPRESS)
    p.add_argument("--json")
    a = p.parse_args()
    if a.mode:
        print("RESULT " + json.dumps(run_mode(a.mode, a.devices, a.classes, a.batch, a.steps)))
        return
    rows = []
    for mode in ("dp", "hybrid"):
        out = watchdog.run_one([sys.executable, os.path.abspath(__file__), "--mode", mode,
                                "--devices", str(a.devices), "--classes", str(a.classes),
                                "--batch", str(a.batch), "--steps", str(a.steps)], timeout=900,
                               has_result=watchdog.prefixed_result("RESULT "))
        rows.append(json.loads([l for l in out.splitlines() if l.startswith("RESULT ")][0][7:]))
    dp, hy = rows
    for r in rows:
        r["param_ratio_vs_dp"] = r["max_param_bytes_per_device"] / dp["max_param_bytes_per_device"]
        r["optimizer_ratio_vs_dp"] = (r["max_optimizer_bytes_per_device"]
                                      / dp["max_optimizer_bytes_per_device"])
        r["step_time_ratio_vs_dp"] = r["step_ms"] / dp["step_ms"]
    print_table(rows, ["mode", "devices", "classes", "step_ms", "max_param_bytes_per_device",
                       "max_optimizer_bytes_per_device", "param_ratio_vs_dp",
                       "optimizer_ratio_vs_dp", "step_time_ratio_vs_dp"],
                title="Split classifier head vs replicated (backbone %dx%d, head %dx%d, "
                      "goal: head bytes 1/%d)" % (IN, FEATURES, FEATURES, a.classes, a.devices))
    write_json("split_memory", rows, a.json)


if __name__ == "__main__":
    main()
