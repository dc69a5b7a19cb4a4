"""A model's step under TensorFlow's thread settings, beside the planner's prediction.

The planner's replay (``epl.auto.dataflow``) prices an executor-bound step (thousands of
ops of a few microseconds: the corpus mini-BERT) from its kernels' chains, the
executor's cost per op and the wake-up of Eigen's intra-op threads.  Where it misses,
this benchmark shows which part of TensorFlow's threading the step pays: each layout is
run in a fresh process (the intra-op pool is made once a process) under

* ``inter 1 / intra 1``: every op after the one before, no intra-op pool: the step's
  ops one after another, the replay's serial sum stands for this;
* ``inter 1 / intra N``: one executor thread, kernels spread over the cores: what the
  intra-op pool's hand-offs cost a serial step;
* ``inter N / intra 1``: the executor's threads, no intra-op pool;
* ``default``: what a user's session gets (both pools as wide as the machine).

It prints one table (median step per setting, and the planner's prediction of the
default) and writes JSON.  Measured in stop 68 (the Xeon with AMX, 2 vCPU, TF 1.15): the
mini-BERT's one-device step took 2.78 / 4.15 / 2.97 / 3.30 ms, its DP 2 step
- / 7.56 / 3.28 / 4.03 ms and its PP 2 x m4 1F1B step 9.19 / 14.54 / 6.62 / 8.78 ms, and
the replay said 2.52 / 3.74 / 6.54 ms: the replay reads like the run without the
intra-op pool (docs/plan.md, stop 68).

    python benchmarks/executor_threads.py [--models bert] [--layouts "1 device,DP 2"]
"""
import argparse
import json
import os
import subprocess
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
sys.path.insert(0, os.path.dirname(HERE))
import common  # noqa: E402

STEPS = 300          # timed steps a setting (after WARMUP)
WARMUP = 30
BOUND_S = 600        # one setting's process at most


def settings(cores):
    """(label, inter-op threads, intra-op threads); 0: TensorFlow's default."""
    return [("inter 1 / intra 1", 1, 1), ("inter 1 / intra %d" % cores, 1, cores),
            ("inter %d / intra 1" % cores, cores, 1), ("default", 0, 0)]


def measure_one(model, label, inter, intra, steps):
    """{"median_s": the step's median, "cpu_per_wall": cores busy on average} of the
    layout ``label`` of ``model`` (plan_accuracy's) under the thread setting."""
    import resource
    import tensorflow as tf
    import plan_accuracy as pa
    from epl.auto import search
    v1 = tf.compat.v1
    common.tf1_graph_mode()   # TF 2.x: EPL rewrites TF1 graphs (refuses eager)
    strategy, devices = [(s, d) for l, d, s in pa.LAYOUTS if l == label][0]
    fns = pa.MODELS[model]
    _, train_op, _, _ = search.build(fns[0], fns[1], fns[2], strategy, devices)
    config = v1.ConfigProto(inter_op_parallelism_threads=inter,
                            intra_op_parallelism_threads=intra)
    with v1.Session(config=config) as sess:
        sess.run(v1.global_variables_initializer())
        for _ in range(WARMUP):
            sess.run(train_op)
        times = []
        r0, w0 = resource.getrusage(resource.RUSAGE_SELF), time.time()
        for _ in range(steps):
            began = time.perf_counter()
            sess.run(train_op)
            times.append(time.perf_counter() - began)
        r1, w1 = resource.getrusage(resource.RUSAGE_SELF), time.time()
    cpu = r1.ru_utime - r0.ru_utime + r1.ru_stime - r0.ru_stime
    return {"median_s": common.median(times), "cpu_per_wall": cpu / max(w1 - w0, 1e-9)}


def predicted(model, label, profiles):
    """The planner's step for the layout on ``Cluster.local`` (the default threads);
    ``profiles``: {model: its profile}, filled here once a model."""
    import plan_accuracy as pa
    from epl.auto import Cluster, graph_profile, search
    from epl.auto.predictor import price
    strategy, devices = [(s, d) for l, d, s in pa.LAYOUTS if l == label][0]
    if model not in profiles:
        profiles[model] = graph_profile.profile(*pa.MODELS[model])
    profile = profiles[model]
    calib = Cluster.local(1).calibration
    return price(profile, search.layout_of(strategy, devices),
                 pa.local_cluster(calib, devices)).step_time_s


def _child(args):
    return [sys.executable, os.path.abspath(__file__), "--one"] + args


def run_one(model, label, inter, intra, steps):
    """``measure_one`` in a fresh process, or {"error": why}."""
    try:
        out = subprocess.run(
            _child([model, label, str(inter), str(intra), str(steps)]),
            stdout=subprocess.PIPE, stderr=subprocess.PIPE, timeout=BOUND_S, check=False)
    except subprocess.TimeoutExpired:
        return {"error": "no result in %d s" % BOUND_S}
    lines = [l for l in out.stdout.decode().splitlines() if l.startswith("{")]
    if out.returncode or not lines:
        return {"error": (out.stderr.decode().strip().splitlines() or ["rc %d" % out.returncode])[-1]}
    return json.loads(lines[-1])


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--models", default="bert")
    ap.add_argument("--layouts", default="1 device,DP 2,PP 2 x m4 1f1b")
    ap.add_argument("--steps", type=int, default=STEPS)
    ap.add_argument("--json", default=None)
    ap.add_argument("--one", nargs=5, help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.one:
        model, label, inter, intra, steps = args.one
        print(json.dumps(measure_one(model, label, int(inter), int(intra), int(steps))))
        return
    cores = os.cpu_count() or 1
    rows, profiles = [], {}
    for model in args.models.split(","):
        for label in args.layouts.split(","):
            row = {"model": model, "layout": label}
            for name, inter, intra in settings(cores):
                got = run_one(model, label, inter, intra, args.steps)
                row[name] = got.get("median_s", got.get("error"))
                row[name + " cpu/wall"] = got.get("cpu_per_wall")
            row["predicted"] = predicted(model, label, profiles)
            rows.append(row)
            print(json.dumps(row), flush=True)
    columns = ["model", "layout"] + [n for n, _, _ in settings(cores)] + ["predicted"]
    shown = [dict((k, ("%.2f ms" % (v * 1e3)) if isinstance(v, float) and k in columns
                   else ("failed" if isinstance(v, str) and k in columns[2:] else v))
                  for k, v in r.items()) for r in rows]
    common.print_table(shown, columns, "step median per thread setting (fresh process each)")
    common.write_json("executor_threads", {"cores": cores, "rows": rows}, args.json)


if __name__ == "__main__":
    main()
