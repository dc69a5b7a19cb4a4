"""Pipeline bubble: stages of known, equal cost per micro-batch (an op that sleeps,
burning no CPU), p in {2, 4} stages, m in {1, 4, 8, 16} micro-batches, both schedules.
Measured makespan and bubble fraction vs theory (p-1)/(m+p-1), and the peak number of
micro-batches alive per stage, read from TF's step stats (RunMetadata).

    python benchmarks/pipeline_bubble.py [--forward-ms 100] [--json FILE]
"""
import argparse
import os
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
sys.path.insert(0, os.path.dirname(HERE))
os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import numpy as np  # noqa: E402
import tensorflow.compat.v1 as tf  # noqa: E402

tf.disable_v2_behavior()  # TF 2.x: TF1 graph semantics (1.15: its defaults)

import epl  # noqa: E402
from common import print_table, write_json  # noqa: E402

tf.logging.set_verbosity(tf.logging.ERROR)


SLEPT = []   # seconds each sleep really took (a loaded machine oversleeps)


def _sleeper(seconds, tag):
    """y = x * w after sleeping `seconds`; its gradient sleeps `seconds` too."""
    def fwd(x, *after):
        t = time.perf_counter()
        time.sleep(seconds)
        SLEPT.append(time.perf_counter() - t)
        return x

    @tf.custom_gradient
    def op(x):
        y = tf.py_func(fwd, [x], tf.float32, stateful=True, name="sleep_f_" + tag)
        y.set_shape(x.shape)

        def grad(dy):
            # Backward needs the forward's output, as a real layer's does.
            g = tf.py_func(fwd, [dy, y], tf.float32, stateful=True, name="sleep_b_" + tag)
            g.set_shape(dy.shape)
            return g
        return y, grad
    return op


def build(p, m, strategy, seconds):
    epl.init(epl.Config({"cluster.devices_per_worker": p, "pipeline.num_micro_batch": m,
                         "pipeline.strategy": strategy}))
    x = np.ones([64 * m, 4], np.float32)
    ds = tf.data.Dataset.from_tensor_slices(x).repeat().batch(1)
    h = tf.data.make_one_shot_iterator(ds).get_next()
    for s in range(p):
        with epl.replicate(1, name="stage_%d" % s):
            w = tf.get_variable("w%d" % s, initializer=tf.ones([4]))
            h = _sleeper(seconds, str(s))(h * w)   # dL/dw needs this stage's backward
    loss = tf.reduce_sum(h)
    opt = tf.train.GradientDescentOptimizer(0.0)
    return opt.minimize(loss)


def measure(p, m, strategy, seconds):
    with tf.Graph().as_default():
        op = build(p, m, strategy, seconds)
        cfg = tf.ConfigProto(inter_op_parallelism_threads=4 * p)
        with tf.Session(config=cfg) as sess:
            sess.run(tf.global_variables_initializer())
            sess.run(op)
            meta = tf.RunMetadata()
            del SLEPT[:]
            t0 = time.perf_counter()
            sess.run(op, options=tf.RunOptions(trace_level=tf.RunOptions.FULL_TRACE),
                     run_metadata=meta)
            wall = time.perf_counter() - t0
    spans = {}   # (stage, kind, micro) -> (start, end) of the sleep op, as TF recorded it
    for dev in meta.step_stats.dev_stats:
        for node in dev.node_stats:
            name = node.node_name.split(":")[0]
            if "sleep_" not in name:
                continue
            kind = "F" if "sleep_f_" in name else "B"
            stage = int(name.split("sleep_%s_" % kind.lower())[1].split("/")[0].split("_")[0])
            micro = int(name.split("EPL_REPLICA_")[1].split("/")[0]) if name.startswith(
                "EPL_REPLICA_") else 0
            start = node.all_start_micros
            end = start + node.all_end_rel_micros
            old = spans.get((stage, kind, micro), (start, end))
            spans[(stage, kind, micro)] = (min(old[0], start), max(old[1], end))
    if os.environ.get("EPL_BUBBLE_DEBUG"):
        first = min(a for a, _ in spans.values())
        for k, (a, b) in sorted(spans.items(), key=lambda kv: kv[1]):
            print("  %s %.1f-%.1f ms" % (k, (a - first) / 1e3, (b - first) / 1e3))
        print("  slept %.1f ms, the ops ran %.1f ms" % (
            sum(SLEPT) * 1e3, sum(b - a for a, b in spans.values()) / 1e3))
    t_begin = min(s for s, _ in spans.values())
    t_end = max(e for _, e in spans.values())
    makespan = (t_end - t_begin) / 1e6
    # Per stage: its m forwards and m backwards, as long as the ops ran (a loaded
    # machine oversleeps, and wakes the op's thread late: the stage is busy meanwhile).
    busy = []
    for s in range(p):
        ran = sorted(v for k, v in spans.items() if k[0] == s)
        total, reach = 0, None
        for a, b in ran:
            a = a if reach is None else max(a, reach)
            total += max(b - a, 0)
            reach = b if reach is None else max(reach, b)
        busy.append(total / 1e6)
    bubble = 1 - (sum(busy) / p) / makespan
    theory = (p - 1.0) / (m + p - 1.0)
    peak = []
    for s in range(p):
        events = []
        for (st, kind, micro), (a, b) in spans.items():
            if st == s:
                events.append((a, 1 if kind == "F" else 0, kind))
        live = best = 0
        for _, _, kind in sorted(events):
            live += 1 if kind == "F" else -1
            best = max(best, live)
        peak.append(best)
    return dict(stages=p, micro_batches=m, schedule=strategy, makespan_s=makespan,
                wall_s=wall, bubble=bubble, bubble_theory=theory,
                rel_error=abs(bubble - theory) / theory if theory else 0.0,
                peak_in_flight=max(peak))


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--forward-ms", type=float, default=100.0)
    ap.add_argument("--stages", default="2,4")
    ap.add_argument("--micro", default="1,4,8,16")
    ap.add_argument("--json")
    a = ap.parse_args()
    rows = []
    for p in [int(v) for v in a.stages.split(",")]:
        for m in [int(v) for v in a.micro.split(",")]:
            for strategy in ("PreferForward", "PreferBackward"):
                rows.append(measure(p, m, strategy, a.forward_ms / 1e3))
                print("p=%d m=%d %s done" % (p, m, strategy), flush=True)
    print_table(rows, ["stages", "micro_batches", "schedule", "makespan_s", "bubble",
                       "bubble_theory", "rel_error", "peak_in_flight"],
                "Pipeline bubble (stage cost %.0f ms forward + %.0f ms backward)"
                % (a.forward_ms, a.forward_ms))
    write_json("pipeline_bubble", rows, a.json)


if __name__ == "__main__":
    main()
