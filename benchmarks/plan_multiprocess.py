"""The planner against runs here, data parallelism across processes (issue 36, local
accuracy): ``epl.auto.predict`` on ``Cluster.local(1, processes=P)`` vs plain data
parallelism run by EPL on P worker processes of this machine (``epl-launch --num_workers
P --gpu_per_worker 1``: gradients all-reduced by EPL's cross-process collectives, shared
memory between the processes), and on P network-namespace hosts with an added one-way
latency (tests/netns.py: one ``epl-launch --machine_list ... --machine_rank k`` per host,
EPL's TCP ring between them through the namespaces' latency relay).

Measured (``measure_multiprocess``): every worker builds the model the way
``epl.auto.search.dry_run`` does (``search.build`` with ``["data_parallel"]`` on its one
device), runs 2 warm-up steps and one traced step, then ``steps`` timed steps (all
workers the same count: their all-reduces pair up step by step); the step is the median
step of the slowest worker, the memory the fullest device's bytes (the variables it
holds + the traced step's peak there, as ``dry_run`` computes it), the rows the sum of
every worker's pull (each worker pulls the dataset's batch per step: rows x P).  Every
case of a model is measured ``--rounds`` times round-robin and keeps its fastest round;
the model's kernels are timed anew before each round and the rows priced at each heavy
kernel's fastest and each light kernel's mean over the rounds
(``plan_accuracy.fastest_kernels``).
Predicted: ``benchmarks.plan_accuracy.predict_case`` (``price`` of ``data_parallel`` on
P devices, the global batch rows x P) on ``Cluster.from_local(figures, 1, processes=P,
latency_s=...)``: P nodes of 1 device sharing the cores, the inter-node link EPL's
cross-process all-reduce as calibrated (``epl.auto.local.measure_cross_process``: shm
for worker processes, tcp for hosts; with as many ranks as processes where they
outnumber the cores, ``local.crowded_ranks``; the step pays it at its bandwidth beside compute,
``beside``, where the transport's work takes the cores from the backward pass: the
"in step" column).  A control row first: "DP 2 in-process", plan_accuracy's
"DP 2" (2 virtual devices of one process, ``epl.auto.search.measure``) measured and
priced the same way under the same load, so that the cross-process rows' errors can be
read against the in-process one's.

The machine has 2 cores shared with other users: timings are noisy.  The latency
relay of the namespace hosts is Python: with latency it also caps the bandwidth, which
the calibration (tcp over loopback, no relay) does not see.

    python benchmarks/plan_multiprocess.py [--models mlp,gpt] [--cases "DP 2 in-process,
        DP 2 proc,DP 3 proc,DP 2 hosts +5ms"] [--steps 10] [--rounds 2]
        [--json benchmarks/results/plan_multiprocess.json]
        [--no-calibrate-each-model]
"""
import argparse
import json
import os
import shutil
import signal
import sys
import tempfile
import time
import uuid

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
sys.path.insert(0, HERE)
sys.path.insert(0, ROOT)
os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import plan_accuracy  # noqa: E402
from plan_accuracy import (MODELS, err, fastest_kernels, predict_case,  # noqa: E402
                           record_round, use_run_kernels)

PORT = 7000         # namespace hosts: TensorFlow on 7000, EPL's collectives on 7001
STRATEGY = ["data_parallel"]

# (label, processes, one-way latency in ms or None for worker processes of this host);
# processes None: the control, DP on 2 virtual devices of ONE process (plan_accuracy's
# "DP 2", epl.auto.search.measure) under the same load, side by side
CASES = [
    ("DP 2 in-process", None, None),
    ("DP 2 proc", 2, None),
    ("DP 3 proc", 3, None),
    ("DP 2 hosts +5ms", 2, 5.0),
]
CONTROL_DEVICES = 2


def _median(xs):
    xs = sorted(xs)
    return xs[len(xs) // 2]


# ---------------------------------------------------------------- one worker


def worker_main(model_key, steps, out_dir):
    """One worker of the job (started by epl-launch): builds and runs the model with
    plain data parallelism on its device; writes worker_<index>.json."""
    import tensorflow as tf
    v1 = tf.compat.v1
    v1.disable_v2_behavior()        # TF 2.x: TF1 graph semantics (1.15: its defaults)
    v1.logging.set_verbosity(v1.logging.ERROR)
    from epl import ir
    from epl.auto import search
    from epl.core.process_state import Env
    from epl.ir.memory_trace import peak_bytes, traced_run
    fns = MODELS[model_key]
    _, train_op, _, _ = search.build(fns[0], fns[1], fns[2], STRATEGY, 1)
    graph = v1.get_default_graph()
    cluster = Env.get().cluster
    with v1.Session() as sess:
        sess.run(v1.global_variables_initializer())
        for _ in range(2):                      # the rewrite, the connections, warm-up
            sess.run(train_op)
        _, md = traced_run(sess, train_op)
        names = [cluster.local_device(i) for i in range(cluster.gpu_num_per_worker)]
        held = search._variable_bytes(graph, names)
        peak = max(held[d] + peak_bytes(md, d) for d in names)
        times = []
        for _ in range(steps):                  # a fixed count: every worker the same
            began = time.perf_counter()
            sess.run(train_op)
            times.append(time.perf_counter() - began)
    state = ir.Graph.get(graph).rewrite_result.state
    pulls = state.num_clones if state is not None else 1
    rows = search.batch_rows(fns[1])
    rec = dict(worker=cluster.worker_index, workers=cluster.worker_num,
               devices=cluster.gpu_num_per_worker, step_s=_median(times), times=times,
               peak_bytes=int(peak), held_bytes=int(max(held.values())),
               rows_per_step=pulls * rows, tf=tf.__version__)
    path = os.path.join(out_dir, "worker_%d.json" % cluster.worker_index)
    with open(path + ".tmp", "w") as f:
        json.dump(rec, f)
    os.replace(path + ".tmp", path)
    print("worker %d: %d steps, median %.2f ms" % (cluster.worker_index, steps,
                                                   1e3 * rec["step_s"]), flush=True)


# ---------------------------------------------------------------- the job


def _worker_cmd(model_key, steps, out_dir):
    return [os.path.abspath(__file__), "--worker", "--model", model_key, "--steps",
            str(steps), "--out", out_dir]


def _env(**extra):
    env = dict(os.environ, PYTHONPATH=ROOT, TF_CPP_MIN_LOG_LEVEL="2")
    for key in ("EPL_JOB_ID", "EPL_COMM_TRANSPORT", "EPL_COMM_ADDRESSES", "TF_CONFIG"):
        env.pop(key, None)
    env.update(extra)
    return env


def _collect(out_dir, processes):
    recs = []
    for w in range(processes):
        with open(os.path.join(out_dir, "worker_%d.json" % w)) as f:
            recs.append(json.load(f))
    return {"step_s": max(r["step_s"] for r in recs),
            "peak_bytes": max(r["peak_bytes"] for r in recs),
            "rows_per_step": sum(r["rows_per_step"] for r in recs),
            "workers": recs}


def _local_job(model_key, processes, steps, timeout, tmp):
    """P workers of this machine under one epl-launch (the benchmarks' watchdog bounds
    it and leaves nothing running)."""
    import watchdog
    cmd = [sys.executable, "-m", "epl.launch", "--num_workers", str(processes),
           "--gpu_per_worker", "1", "--log_dir", os.path.join(tmp, "logs"),
           "--timeout", str(int(timeout))] + _worker_cmd(model_key, steps, tmp)
    done = lambda _: all(os.path.exists(os.path.join(tmp, "worker_%d.json" % w))  # noqa
                         for w in range(processes))
    run = watchdog.run_group([cmd], timeout + 30, env=_env(), cwd=tmp, has_result=done,
                             names=["epl-launch"])
    if not run.ok:
        return "error", "%s:\n%s" % (run.failure, run.outputs[0][-3000:])
    return "ok", _collect(tmp, processes)


def _netns_job(model_key, processes, steps, latency_ms, timeout, tmp):
    """P network-namespace hosts, one epl-launch each (benchmarks/netns.py's way)."""
    from tests import netns
    from epl.launch import workers as launch_workers
    import netns as bench_netns      # benchmarks/netns.py: _start, _wait_all
    why = netns.unavailable()
    if why:
        return "skipped", "network namespaces: %s" % why
    secret = uuid.uuid4().hex
    machines = ["h%d:%d" % (i, PORT) for i in range(processes)]
    with netns.Network(processes, latency=latency_ms / 1000.0, ports=[PORT, PORT + 1]) as net:
        net.add_run(launch_workers.shared_run_id(launch_workers.job_id_of(machines), secret, 0))
        procs = []
        for r in range(processes):
            cmd = [sys.executable, "-m", "epl.launch", "--num_workers", str(processes),
                   "--gpu_per_worker", "1", "--machine_list", ",".join(machines),
                   "--machine_rank", str(r), "--log_dir", os.path.join(tmp, "logs_%d" % r),
                   "--timeout", str(int(timeout))] + _worker_cmd(model_key, steps, tmp)
            procs.append(bench_netns._start(net, r, cmd, _env(
                EPL_JOB_SECRET=secret, GRPC_DNS_RESOLVER="native"), cwd=tmp))
        try:
            bench_netns._wait_all(procs, timeout, "DP across %d hosts" % processes)
        except RuntimeError as e:
            return "error", str(e)[-3000:]
        finally:
            for p in procs:
                p.log.close()
    return "ok", _collect(tmp, processes)


def measure_multiprocess(model_key, processes, steps, latency_ms=None, timeout=600):
    """Plain data parallelism of ``benchmarks.plan_accuracy.MODELS[model_key]`` on
    ``processes`` worker processes of this machine (1 device each), or on as many
    network-namespace hosts with ``latency_ms`` added one way between them: (status,
    {"step_s", "peak_bytes", "rows_per_step", "workers"}) or (status, message); status
    "ok", "error" or "skipped" (namespaces cannot be made here)."""
    if model_key not in MODELS:
        raise ValueError("plan_multiprocess: unknown model %r; the models are %s"
                         % (model_key, ", ".join(sorted(MODELS))))
    if processes < 2:
        raise ValueError("plan_multiprocess: processes must be >= 2, got %d" % processes)
    tmp = tempfile.mkdtemp(prefix="plan_mp_")
    try:
        if latency_ms is None:
            return _local_job(model_key, processes, steps, timeout, tmp)
        return _netns_job(model_key, processes, steps, float(latency_ms), timeout, tmp)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


# ---------------------------------------------------------------- the table


def cluster_of(figures, processes, latency_ms):
    """The cluster a row is priced on, its products timed on this machine (as in
    plan_accuracy)."""
    from epl.auto import Cluster
    if processes is None:
        out = Cluster.from_local(figures, CONTROL_DEVICES)
    else:
        out = Cluster.from_local(figures, 1, processes=processes,
                                 latency_s=None if latency_ms is None else latency_ms / 1e3)
    out.time_products = True
    out.wake_up = plan_accuracy.WAKE_UP or out.wake_up
    return out


def _calibrate(fresh, cases=CASES):
    """The calibration with the cross-process figures ``cases`` price (shm for worker
    processes, tcp for hosts, each at ``local.crowded_ranks`` ranks): measured now when
    ``fresh`` (the load of the cores now), else the cache's, measured where it lacks
    them."""
    from epl.auto import local
    figures = local.measure() if fresh else local.calibration()
    for _, processes, latency_ms in cases:
        if processes is None:
            continue
        transport = "shm" if latency_ms is None else "tcp"
        if fresh:
            figures = local.cross_process(figures, transport, ranks=local.crowded_ranks(
                processes, figures.get("cores")))
        else:
            figures = local.calibration(transports=(transport,), processes=processes)
    return figures


HEAD = "%-8s %-17s %9s %9s %7s %9s %9s %7s %9s %9s" % (
    "model", "case", "pred ms", "meas ms", "err%", "pred MiB", "meas MiB", "err%", "pred AR ms",
    "in step")


def _line(r):
    """A row; the all-reduce alone and what the step pays for it (``dp_exposed_s``:
    beside the compute of worker processes on shared cores, not hidden)."""
    ar = "%9.2f %9.2f" % (1e3 * r["breakdown"]["dp_allreduce_s"],
                          1e3 * r["breakdown"]["dp_exposed_s"])
    if r["status"] != "ok":
        return "%-8s %-17s %9.2f %9s %7s %9.1f %9s %7s %s  %s" % (
            r["model"], r["case"], 1e3 * r["pred_step_s"], "-", "-",
            r["pred_peak_bytes"] / 2.0 ** 20, "-", "-", ar,
            (r.get("message") or r["status"]).strip().splitlines()[-1][:60])
    return "%-8s %-17s %9.2f %9.2f %7.1f %9.1f %9.1f %7.1f %s" % (
        r["model"], r["case"], 1e3 * r["pred_step_s"], 1e3 * r["step_s"], r["time_err"],
        r["pred_peak_bytes"] / 2.0 ** 20, r["peak_bytes"] / 2.0 ** 20, r["mem_err"], ar)


def _price(row, profile):
    """The row's pred_* figures (and errors, where measured) from today's predictor."""
    cluster = cluster_of(row["calibration"], row["processes"], row["latency_ms"])
    pred = predict_case(profile, STRATEGY, row["processes"] or CONTROL_DEVICES,
                        profile.rows, cluster)
    row.update(cluster=cluster.to_dict(), pred_step_s=pred.step_time_s,
               pred_peak_bytes=pred.peak_memory_bytes, pred_samples_per_s=pred.samples_per_s,
               breakdown={k: v for k, v in pred.breakdown.items() if k != "stages"})
    if row.get("status") == "ok":
        row.update(time_err=err(pred.step_time_s, row["step_s"]),
                   mem_err=err(pred.peak_memory_bytes, row["peak_bytes"]))


def _settle(row):
    """A row's step from its rounds (the fastest: noise only adds time) and its status,
    or its last failure where no round measured it."""
    for k in ("time_err", "mem_err", "samples_per_s", "message"):
        row.pop(k, None)
    if row.get("step_s_rounds"):
        row.update(status="ok", step_s=min(row["step_s_rounds"]))
        row["samples_per_s"] = row["rows_per_step"] / row["step_s"]
    else:
        row["status"], row["message"] = row["failures"][-1]


def reprice(path, out):
    """The rows of an earlier run priced again: with the kernels that run timed (each
    row's ``kernels_folder``, while it lasts) unless ``EPL_CACHE_DIR`` names a cache."""
    from epl.auto import graph_profile
    chosen = os.environ.get("EPL_CACHE_DIR")
    with open(path) as f:
        rows = json.load(f)["rows"]
    profiles = {}
    print(HEAD, flush=True)
    for row in rows:
        if row["model"] not in profiles:
            profiles[row["model"]] = graph_profile.profile(*MODELS[row["model"]])
        use_run_kernels(row, chosen)
        _price(row, profiles[row["model"]])
        print(_line(row), flush=True)
    if out:
        _write(out, rows)
    return rows


def _write(path, rows):
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    with open(path, "w") as f:
        json.dump(dict(rows=rows), f, indent=1, sort_keys=True, default=str)


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--out", help=argparse.SUPPRESS)
    ap.add_argument("--model", help=argparse.SUPPRESS)
    ap.add_argument("--models", default="mlp,gpt")
    ap.add_argument("--cases", default=None, help="labels, comma-separated (default: all)")
    ap.add_argument("--steps", type=int, default=10)
    ap.add_argument("--rounds", type=int, default=2,
                    help="measure every case of a model this many times, round-robin; a "
                    "case's step: its fastest round's, its peak: the largest; the "
                    "model's kernels are timed anew in each round and priced at a heavy "
                    "one's fastest and a light one's mean "
                    "(plan_accuracy.fastest_kernels)")
    ap.add_argument("--timeout", type=int, default=600, help="bound of one case")
    ap.add_argument("--json", default=os.path.join(HERE, "results", "plan_multiprocess.json"))
    ap.add_argument("--no-calibrate-each-model", dest="calibrate_each_model",
                    action="store_false", help="use the cached calibration throughout "
                    "(default: measure it again before each model, under today's load)")
    ap.add_argument("--reprice", default=None, metavar="JSON",
                    help="price the rows of an earlier run again (today's predictor, "
                    "their calibration and measurements), write --json")
    ap.add_argument("--cached-kernels", action="store_true",
                    help="price with the kernels' timings cached under ~/.cache/epl "
                    "(default: timed in this run: common.fresh_kernel_timings)")
    from epl.auto import dataflow
    ap.add_argument("--wake-up", choices=dataflow.WAKES, default=None,
                    help="how the replay pays a kernel's wake-up (Cluster.wake_up; "
                    "default: the Cluster's, by the machine's last-level cache: "
                    "machines.wake_up_for)")
    args = ap.parse_args(argv)
    plan_accuracy.WAKE_UP = args.wake_up
    if args.worker:
        return worker_main(args.model, args.steps, args.out)
    if args.reprice:
        return reprice(args.reprice, args.json)
    import common
    common.tf1_graph_mode()         # (the in-process control's dry runs)
    common.fresh_kernel_timings(args.cached_kernels)
    # SIGTERM (a watchdog, a person) ends the run through the Networks' cleanup
    signal.signal(signal.SIGTERM, lambda *_: sys.exit("plan_multiprocess: terminated"))
    from epl.auto import graph_profile, search
    start = time.time()
    wanted = [c.strip() for c in args.cases.split(",")] if args.cases else [c[0] for c in CASES]
    rows = []
    figures = None
    print(HEAD, flush=True)
    for name in args.models.split(","):
        fns = MODELS[name]
        profile = graph_profile.profile(*fns)
        if figures is None or args.calibrate_each_model:
            figures = _calibrate(args.calibrate_each_model,
                                 [c for c in CASES if c[0] in wanted])
        retime = not args.cached_kernels and args.rounds > 1
        if retime:          # this model's kernels, from none
            os.environ["EPL_CACHE_DIR"] = tempfile.mkdtemp(prefix="epl-plan-round1-")
        cases = []
        for label, processes, latency_ms in CASES:
            if label not in wanted:
                continue
            row = dict(model=name, case=label, processes=processes, latency_ms=latency_ms,
                       calibration=figures, step_s_rounds=[], failures=[])
            _price(row, profile)                # (round 1's kernels timed here)
            cases.append(row)
        best, kernel_rounds = {}, {}
        for r in range(args.rounds):
            if retime:      # this round's kernels, timed beside its runs (plan_accuracy)
                fastest_kernels(best, lambda: [_price(row, profile) for row in cases], r,
                                kernel_rounds)
            for row in cases:
                if row["processes"] is None:
                    status, got = search.measure(fns, STRATEGY, CONTROL_DEVICES,
                                                 args.steps, args.timeout)
                else:
                    status, got = measure_multiprocess(name, row["processes"], args.steps,
                                                       row["latency_ms"], args.timeout)
                if status == "ok":
                    row["workers"] = got.get("workers")
                if not record_round(row, status, got, "%s %s" % (name, row["case"]), r,
                                    args.rounds):
                    continue
                _settle(row)
                _price(row, profile)    # at every kernel's fastest round (retime)
                row["kernels_folder"] = os.environ.get("EPL_CACHE_DIR")
                rows.append(row)
                print(_line(row), flush=True)
                if args.json:
                    _write(args.json, rows)
    xp = figures or {}
    for key in sorted(k for k in xp if k.startswith("xproc_")):
        beside = (xp[key].get("beside") or {}).get("bandwidth")
        print("cross-process all-reduce (%s, %d ranks): %.3g GB/s, %.3g ms per ring step; "
              "beside compute: %s" % (key[len("xproc_"):].split("_")[0],
                                      xp[key].get("ranks", 2), xp[key]["bandwidth"] / 1e9,
                                      1e3 * xp[key]["latency_s"],
                                      "%.3g GB/s" % (beside / 1e9) if beside else "hidden"))
    if "allreduce_bandwidth" in xp:
        print("in-process all-reduce:            %.3g GB/s, %.3g ms per ring step"
              % (xp["allreduce_bandwidth"] / 1e9, 1e3 * xp["allreduce_latency_s"]))
    print("(%.0f s; 2 shared cores: timings are noisy, each the fastest of %d rounds)"
          % (time.time() - start, args.rounds))
    return rows


if __name__ == "__main__":
    main()
