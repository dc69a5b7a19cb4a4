"""The planner against runs here (issue 36, local accuracy): for each model and layout,
``epl.auto.predict`` on ``Cluster.local(N)`` vs the layout run by EPL on N virtual CPU
devices, side by side in one run.

Measured (``epl.auto.search.measure``: each case in a process of its own): the median
step time over >= 1 s of steps after a warm-up step, and the fullest device's bytes
during a traced step (the variables it holds + the step's peak there,
``epl.ir.memory_trace``).  Predicted: ``predict`` from the graph (never run) and the
cached calibration of ``Cluster.local`` (measured first if there is none).  The planner's
pick: the layout ``predict`` ranks first by samples/s among a model's layouts, against
the measured fastest (a hit when within 5% of it).

The machine has 2 cores shared with other users: timings are noisy; the step is the
median of its steps, and cases of one model run one after another (interleaved with
nothing else of ours).

    python benchmarks/plan_accuracy.py [--quick] [--models mlp,gpt,convnet]
        [--layouts "DP 2,PP 4 x m8 gpipe"]  (default: mlp and gpt x DEFAULT; all: LAYOUTS)
        [--json benchmarks/results/plan_accuracy.json] [--recalibrate]
"""
import argparse
import json
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import numpy as np  # noqa: E402

ROWS = 64


# ----------------------------------------------------------------- models (module level:
# the dry runs import them in processes of their own)
def mlp_dataset():
    import tensorflow.compat.v1 as tf
    rng = np.random.RandomState(0)
    x = rng.randn(4 * ROWS, 512).astype(np.float32)
    y = rng.randint(0, 16, 4 * ROWS).astype(np.int64)
    return tf.data.Dataset.from_tensor_slices((x, y)).repeat().batch(ROWS, drop_remainder=True)


def mlp_model(features):
    import tensorflow.compat.v1 as tf
    x, y = features
    h = x
    for i in range(4):
        h = tf.layers.dense(h, 1024, activation=tf.nn.relu, name="layer_%d" % i)
    logits = tf.layers.dense(h, 16, name="logits")
    return tf.losses.sparse_softmax_cross_entropy(labels=y, logits=logits)


def conv_dataset():
    import tensorflow.compat.v1 as tf
    rng = np.random.RandomState(1)
    x = rng.randn(2 * 32, 32, 32, 3).astype(np.float32)
    y = rng.randint(0, 10, 2 * 32).astype(np.int64)
    return tf.data.Dataset.from_tensor_slices((x, y)).repeat().batch(32, drop_remainder=True)


def conv_model(features):
    """The corpus conv net's shape (conv, ReLU, pooling, a dense head) at 32 x 32 x 3."""
    import tensorflow.compat.v1 as tf
    x, y = features
    for i, ch in enumerate((32, 64, 64, 128)):
        with tf.variable_scope("layer_%d" % i):
            x = tf.layers.conv2d(x, ch, 3, padding="same", activation=tf.nn.relu)
            if i % 2 == 1:
                x = tf.layers.max_pooling2d(x, 2, 2)
    x = tf.reduce_mean(x, axis=[1, 2])
    logits = tf.layers.dense(x, 10, name="logits")
    return tf.losses.sparse_softmax_cross_entropy(labels=y, logits=logits)


def _gpt():
    from epl.auto.gpt import GPT
    return GPT(4, 256, 4, seq=128, vocab=2000, batch=8)


def gpt_dataset():
    return _gpt().dataset_fn()


def gpt_model(features):
    return _gpt().model_fn(features)


def sgd():
    import tensorflow.compat.v1 as tf
    return tf.train.GradientDescentOptimizer(0.01)


def adam():
    import tensorflow.compat.v1 as tf
    return tf.train.AdamOptimizer(1e-4)


MODELS = {
    "mlp": (mlp_model, mlp_dataset, adam),
    "convnet": (conv_model, conv_dataset, adam),
    "gpt": (gpt_model, gpt_dataset, adam),
}


def pipe(p, m, schedule):
    return ["pipeline", {"num_stages": p, "num_micro_batch": m, "schedule": schedule}]


# (label, devices, strategy list as accelerate reads it)
LAYOUTS = [
    ("1 device", 1, ["data_parallel"]),
    ("DP 2", 2, ["data_parallel"]),
    ("DP 4", 4, ["data_parallel"]),
    ("PP 2 x m4 1f1b", 2, [pipe(2, 4, "1f1b")]),
    ("PP 2 x m4 gpipe", 2, [pipe(2, 4, "gpipe")]),
    ("PP 2 x m8 1f1b", 2, [pipe(2, 8, "1f1b")]),
    ("PP 2 x m8 gpipe", 2, [pipe(2, 8, "gpipe")]),
    ("PP 4 x m4 1f1b", 4, [pipe(4, 4, "1f1b")]),
    ("PP 4 x m8 1f1b", 4, [pipe(4, 8, "1f1b")]),
    ("PP 4 x m8 gpipe", 4, [pipe(4, 8, "gpipe")]),
    ("DP 2 + GC", 2, ["data_parallel", ["gradient_checkpoint", "auto"]]),
    ("DP 2 + ZeRO", 2, ["data_parallel", ["zero", {"level": "v1"}]]),
    ("DP 2 + AMP bf16", 2, ["data_parallel", ["amp", {"dtype": "bfloat16"}]]),
]
DEFAULT = ("1 device", "DP 2", "DP 4", "PP 2 x m4 1f1b", "PP 2 x m4 gpipe", "PP 2 x m8 1f1b",
           "PP 4 x m8 1f1b", "DP 2 + GC", "DP 2 + ZeRO", "DP 2 + AMP bf16")
QUICK = ("1 device", "DP 2", "PP 2 x m4 1f1b")


def predict_case(profile, strategy, devices, rows, cluster):
    from epl.auto.predictor import price
    from epl.auto.search import layout_of
    lay = layout_of(strategy, devices)
    # EPL's replicas and micro-batch clones each pull the dataset's batch (rows): the
    # global batch is rows x micro-batches x replicas (price's default)
    return price(profile, lay, cluster)


def err(pred, got):
    return 100.0 * (pred - got) / got


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--quick", action="store_true", help="a 2-minute subset")
    ap.add_argument("--models", default=None)
    ap.add_argument("--layouts", default=None, help="labels, comma-separated")
    ap.add_argument("--json", default=os.path.join(os.path.dirname(__file__), "results",
                                                   "plan_accuracy.json"))
    ap.add_argument("--recalibrate", action="store_true")
    ap.add_argument("--steps", type=int, default=5)
    ap.add_argument("--no-calibrate-each-model", dest="calibrate_each_model",
                    action="store_false", help="use the cached calibration throughout "
                    "(default: measure it again before each model, under today's load)")
    ap.add_argument("--reprice", default=None, metavar="JSON",
                    help="price the rows measured in an earlier run's JSON again (the "
                    "predictor changed; the measurements are kept)")
    args = ap.parse_args(argv)
    if args.reprice:
        return reprice(args.reprice, args.json)
    from epl.auto import Cluster, graph_profile
    from epl.auto import search
    start = time.time()
    names = (args.models or ("mlp" if args.quick else "mlp,gpt")).split(",")
    wanted = QUICK if args.quick else DEFAULT
    if args.layouts:
        wanted = args.layouts.split(",")
    from epl.auto import local
    calib = Cluster.local(1, recalibrate=args.recalibrate).calibration
    rows_out = []
    for name in names:
        fns = MODELS[name]
        profile = graph_profile.profile(*fns)
        rows = profile.rows
        if args.calibrate_each_model:     # side by side: the load of the cores now
            calib = local.measure()
        for label, devices, strategy in LAYOUTS:
            if label not in wanted:
                continue
            cluster = Cluster.from_local(calib, devices)
            pred = predict_case(profile, strategy, devices, rows, cluster)
            status, got = search.measure(fns, strategy, devices, args.steps, 600)
            row = dict(model=name, layout=label, devices=devices, strategy=strategy,
                       calibration=calib,
                       pred_step_s=pred.step_time_s, pred_peak_bytes=pred.peak_memory_bytes,
                       pred_samples_per_s=pred.samples_per_s, status=status,
                       breakdown={k: v for k, v in pred.breakdown.items() if k != "stages"})
            if status == "ok":
                row.update(step_s=got["step_s"], peak_bytes=got["peak_bytes"],
                           samples_per_s=pred.breakdown["global_batch"] / got["step_s"],
                           time_err=err(pred.step_time_s, got["step_s"]),
                           mem_err=err(pred.peak_memory_bytes, got["peak_bytes"]))
            else:
                row["message"] = got
            rows_out.append(row)
            print(_line(row), flush=True)
            if args.json:
                _write(args.json, calib, rows_out, None)
    summary = summarize(rows_out)
    print()
    print(table(rows_out))
    print()
    for line in summary["lines"]:
        print(line)
    print("(%.0f s; 2 shared cores: timings are noisy, each the median of its steps)"
          % (time.time() - start))
    if args.json:
        _write(args.json, calib, rows_out, summary)
    return rows_out


def reprice(path, out):
    from epl.auto import Cluster, graph_profile
    with open(path) as f:
        old = json.load(f)
    profiles = {}
    for r in old["rows"]:
        if r["model"] not in profiles:
            profiles[r["model"]] = graph_profile.profile(*MODELS[r["model"]])
        prof = profiles[r["model"]]
        pred = predict_case(prof, r["strategy"], r["devices"], prof.rows,
                            Cluster.from_local(r.get("calibration", old["calibration"]),
                                               r["devices"]))
        r.update(pred_step_s=pred.step_time_s, pred_peak_bytes=pred.peak_memory_bytes,
                 pred_samples_per_s=pred.samples_per_s)
        if r["status"] == "ok":
            r.update(time_err=err(pred.step_time_s, r["step_s"]),
                     mem_err=err(pred.peak_memory_bytes, r["peak_bytes"]))
    summary = summarize(old["rows"])
    print(table(old["rows"]))
    print()
    for line in summary["lines"]:
        print(line)
    if out:
        _write(out, old["calibration"], old["rows"], summary)
    return old["rows"]


def _write(path, calib, rows, summary):
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    with open(path, "w") as f:
        json.dump(dict(calibration=calib, rows=rows, summary={
            k: v for k, v in (summary or {}).items() if k != "lines"}),
            f, indent=1, sort_keys=True, default=str)


HEAD = "%-8s %-17s %9s %9s %7s %9s %9s %7s" % (
    "model", "layout", "pred ms", "meas ms", "err%", "pred MiB", "meas MiB", "err%")


def _line(r):
    if r["status"] != "ok":
        return "%-8s %-17s %9.2f %9s %7s %9.1f %9s  %s" % (
            r["model"], r["layout"], 1e3 * r["pred_step_s"], "-", "-",
            r["pred_peak_bytes"] / 2.0 ** 20, "-", r.get("message", r["status"])[:60])
    return "%-8s %-17s %9.2f %9.2f %7.1f %9.1f %9.1f %7.1f" % (
        r["model"], r["layout"], 1e3 * r["pred_step_s"], 1e3 * r["step_s"], r["time_err"],
        r["pred_peak_bytes"] / 2.0 ** 20, r["peak_bytes"] / 2.0 ** 20, r["mem_err"])


def table(rows):
    return "\n".join([HEAD] + [_line(r) for r in rows])


def summarize(rows):
    ok = [r for r in rows if r["status"] == "ok"]
    out = {"lines": []}
    if not ok:
        return out
    te = sorted(abs(r["time_err"]) for r in ok)
    me = sorted(abs(r["mem_err"]) for r in ok)
    under = [r for r in ok if r["mem_err"] < -10]
    out.update(time_median_abs=float(np.median(te)), time_worst_abs=te[-1],
               memory_median_abs=float(np.median(me)), memory_worst_abs=me[-1],
               memory_under_10=[(r["model"], r["layout"], r["mem_err"]) for r in under])
    out["lines"].append("step time: median |error| %.1f%%, worst %.1f%% (targets 10%%, 25%%)"
                        % (out["time_median_abs"], out["time_worst_abs"]))
    out["lines"].append("memory:    median |error| %.1f%%, worst %.1f%%; under-predicted by "
                        "> 10%%: %d of %d" % (out["memory_median_abs"],
                                               out["memory_worst_abs"], len(under), len(ok)))
    picks = {}
    for model in sorted(set(r["model"] for r in ok)):
        mine = [r for r in ok if r["model"] == model]
        chosen = max(mine, key=lambda r: r["pred_samples_per_s"])
        fastest = max(mine, key=lambda r: r["samples_per_s"])
        gap = 100.0 * (1 - chosen["samples_per_s"] / fastest["samples_per_s"])
        picks[model] = dict(predicted_best=chosen["layout"], measured_best=fastest["layout"],
                            gap_pct=gap, hit=gap <= 5.0)
        out["lines"].append("%-8s plan's first: %-17s measured fastest: %-17s (%.1f%% slower"
                            ": %s)" % (model, chosen["layout"], fastest["layout"], gap,
                                       "hit" if gap <= 5.0 else "miss"))
    out["picks"] = picks
    return out


if __name__ == "__main__":
    main()
