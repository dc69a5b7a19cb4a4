"""Collective bandwidth: EPL's C++ collectives vs TensorFlow's collective ops vs a numpy copy
(and Horovod-Gloo when importable), in one process (4 virtual CPU devices) and across 2
local processes.

    python benchmarks/collectives.py --sizes-mib 1,16,64,256 --runs 5 --json FILE

Runs on both TensorFlow lines (TF 2.x with TF_USE_LEGACY_KERAS=1): every child builds
tf.compat.v1 graphs after ``tf.disable_v2_behavior()``; TF's side is the same on both,
``tensorflow.python.ops.collective_ops.all_reduce / all_gather`` (the CollectiveReduce /
CollectiveGather kernels), over gRPC between ``tf.train.Server``s across processes.

Prints a table and writes a JSON list of records
{"impl", "op", "scope", "ranks", "bytes", "seconds", "busbw_gbps", "busbw_min",
"busbw_max", "runs"}.  Bus bandwidth as nccl-tests defines it: all-reduce
size/time * 2(n-1)/n; all-gather, reduce-scatter and all-to-all size/time * (n-1)/n
(size = the full output, resp. input of reduce-scatter); broadcast and copy: size/time.
Every implementation runs in its own fresh processes (benchmarks/watchdog.py: each run
within --timeout, a rank that fails or exits 0 without its records fails the run at once,
no process left behind; a failed run is recorded in the JSON); EPL's are started --runs times
(the figures across processes vary from run to run): busbw_gbps is the median of the
runs, busbw_min / busbw_max the extremes.  The runs are interleaved -- run i measures the
numpy copy, then EPL, then (in its first --baseline-runs runs) TF and Horovod, back to back
-- so the ratios are also given run by run (median, min and max of the per-run ratios).
The goals of issue 13 and of the TF 2.x issue (the same on both lines: cross-process
all-reduce at 16-256 MiB at least half of a memory copy and at least 4x TF's collective
ops) are checked at the end.
"""
import argparse
import json
import os
import sys
import time
import uuid

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
sys.path.insert(0, os.path.dirname(HERE))
os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import watchdog  # noqa: E402
from common import free_ports  # noqa: E402

OPS = ("allreduce", "allgather", "reducescatter", "broadcast", "alltoall")
TF_OPS = ("allreduce", "allgather")   # TensorFlow 1.15's collectives (no all-to-all etc.)


def busbw(op, nbytes, seconds, n):
    algbw = nbytes / seconds / 1e9
    if op == "allreduce":
        return algbw * 2 * (n - 1) / n
    if op in ("allgather", "alltoall", "reducescatter"):
        return algbw * (n - 1) / n
    return algbw


def repeats_for(nbytes):
    return int(max(3, min(20, (512 << 20) // max(nbytes, 1))))


def _median(xs):
    xs = sorted(xs)
    return xs[len(xs) // 2]


# ---------------------------------------------------------------- children


def _timed(sess, op, nbytes):
    for _ in range(2):
        sess.run(op)
    times = []
    for _ in range(repeats_for(nbytes)):
        t0 = time.perf_counter()
        sess.run(op)
        times.append(time.perf_counter() - t0)
    return _median(times)


def _inputs(tf, n_elems, device, name=None):
    # Unique names by default: a tf.train.Server keeps variables of earlier graphs by name.
    # Horovod needs the same name on every rank (it matches collectives by op name).
    with tf.device(device):
        v = tf.Variable(tf.random.uniform([n_elems], dtype=tf.float32), trainable=False,
                        name=name or "x_%s" % uuid.uuid4().hex[:8])
    return v


def _elems(op, per_rank, n):
    """Elements of each rank's input (multiples of n where the op splits rows)."""
    if op == "allgather":
        return per_rank // n
    if op in ("alltoall", "reducescatter"):
        return (per_rank // n) * n
    return per_rank


def _epl_op(C, op, x, group, r, n, transport):
    if op == "allreduce":
        return C.all_reduce(x, group, r, n, "sum", transport=transport)
    if op == "allgather":
        return C.all_gather(x, group, r, n, transport=transport)
    if op == "reducescatter":
        return C.reduce_scatter(x, group, r, n, "sum", transport=transport)
    if op == "broadcast":
        return C.broadcast(x, group, r, n, root=0, transport=transport)
    return C.all_to_all(x, group, r, n, transport=transport)[0]


def _tf():
    """tf.compat.v1 with TF1 graph semantics (a no-op on 1.15, required on TF 2.x)."""
    import tensorflow.compat.v1 as tf
    tf.disable_v2_behavior()
    tf.logging.set_verbosity(tf.logging.ERROR)
    return tf


def child_in_process(impl, sizes, n):
    """4 ranks = 4 virtual devices of this process."""
    tf = _tf()
    from tensorflow.python.ops import collective_ops
    from epl.communicators import native_ops as C
    records = []
    key = [100]
    for size in sizes:
        per_rank = size // 4  # float32 elements per rank
        for op in OPS:
            if impl == "tf_collective" and op not in TF_OPS:
                continue
            with tf.Graph().as_default():
                outs = []
                elems = _elems(op, per_rank, n)
                group = uuid.uuid4().hex
                key[0] += 1   # one instance key per collective, shared by its ranks
                for r in range(n):
                    dev = "/device:CPU:%d" % r
                    x = _inputs(tf, elems, dev)
                    with tf.device(dev):
                        if impl == "epl":
                            y = _epl_op(C, op, x, group, r, n, "inprocess")
                        elif op == "allreduce":
                            y = collective_ops.all_reduce(x, n, 1, key[0], "Add", "Id")
                        else:
                            y = collective_ops.all_gather(x, n, 1, key[0])
                        outs.append(y.op)
                step = tf.group(*outs)
                cfg = tf.ConfigProto(device_count={"CPU": n})
                with tf.Session(config=cfg) as sess:
                    sess.run(tf.global_variables_initializer())
                    nbytes = elems * 4 * (n if op == "allgather" else 1)
                    sec = _timed(sess, step, nbytes)
            records.append(dict(impl=impl, op=op, scope="in_process", ranks=n, bytes=nbytes,
                                seconds=sec, busbw_gbps=busbw(op, nbytes, sec, n),
                                tf_version=tf.__version__))
    return records


def child_cross_process(impl, sizes, rank, n, ports, job, transport="shm"):
    """One rank per process; TF's collectives over gRPC need a server per process.
    transport "tcp": EPL's TCP ring between 127.0.0.2 and 127.0.0.3 (scope "tcp")."""
    tf = _tf()
    from tensorflow.python.ops import collective_ops
    from epl.communicators import native_ops as C
    target = ""
    device = "/device:CPU:0"
    if impl == "tf_collective":
        cluster = tf.train.ClusterSpec({"worker": ["127.0.0.1:%d" % p for p in ports]})
        cfg = tf.ConfigProto()
        cfg.experimental.collective_group_leader = "/job:worker/replica:0/task:0"
        server = tf.train.Server(cluster, job_name="worker", task_index=rank, config=cfg)
        target = server.target
        device = "/job:worker/replica:0/task:%d/device:CPU:0" % rank
    records = []
    key = [100]
    for si, size in enumerate(sizes):
        per_rank = size // 4
        for op in OPS:
            if impl == "tf_collective" and op not in TF_OPS:
                continue
            with tf.Graph().as_default():
                elems = _elems(op, per_rank, n)
                x = _inputs(tf, elems, device)
                with tf.device(device):
                    group = "%s/%s_%d" % (job, op, si)
                    if impl == "epl":
                        y = _epl_op(C, op, x, group, rank, n, transport)
                    else:
                        key[0] += 1
                        if op == "allreduce":
                            y = collective_ops.all_reduce(x, n, 1, key[0], "Add", "Id")
                        else:
                            y = collective_ops.all_gather(x, n, 1, key[0])
                step = y.op
                cfg = tf.ConfigProto()
                if impl == "tf_collective":
                    cfg.experimental.collective_group_leader = "/job:worker/replica:0/task:0"
                with tf.Session(target, config=cfg) as sess:
                    sess.run(x.initializer)
                    nbytes = elems * 4 * (n if op == "allgather" else 1)
                    sec = _timed(sess, step, nbytes)
            records.append(dict(impl=impl, op=op,
                                scope="tcp" if transport == "tcp" else "cross_process",
                                ranks=n, bytes=nbytes, seconds=sec,
                                busbw_gbps=busbw(op, nbytes, sec, n), tf_version=tf.__version__))
    return records


def child_horovod(sizes):
    tf = _tf()
    import horovod.tensorflow as hvd
    hvd.init()
    n = hvd.size()
    records = []
    for size in sizes:
        with tf.Graph().as_default():
            x = _inputs(tf, size // 4, "/device:CPU:0", name="hvd_x_%d" % size)
            y = hvd.allreduce(x, average=False)
            step = y[:1]  # horovod's op is not stateful: fetch a slice so it is not pruned
            with tf.Session() as sess:
                sess.run(x.initializer)
                sec = _timed(sess, step, size)
        records.append(dict(impl="horovod", op="allreduce", scope="cross_process", ranks=n,
                            bytes=size, seconds=sec, busbw_gbps=busbw("allreduce", size, sec, n),
                            tf_version=tf.__version__))
    return records if hvd.rank() == 0 else []


def memcpy_records(sizes):
    import numpy as np
    out = []
    for size in sizes:
        src = np.random.rand(size // 8)
        dst = np.empty_like(src)
        np.copyto(dst, src)
        times = []
        for _ in range(repeats_for(size)):
            t0 = time.perf_counter()
            np.copyto(dst, src)
            times.append(time.perf_counter() - t0)
        sec = _median(times)
        out.append(dict(impl="memcpy", op="copy", scope="in_process", ranks=1, bytes=size,
                        seconds=sec, busbw_gbps=size / sec / 1e9))
    return out


# ---------------------------------------------------------------- driver


def _run_child(args, timeout):
    """One in-process measurement in a fresh process (watchdog: bounded, no leftovers)."""
    out = watchdog.run_one([sys.executable, os.path.abspath(__file__)] + args, timeout,
                           has_result=watchdog.has_json_result, name="collectives child")
    return watchdog.json_result(out)


def _rank_command(impl, rank, n, sizes_arg, ports, job, transport):
    return [sys.executable, os.path.abspath(__file__), "--child", impl, "--scope",
            "cross_process", "--rank", str(rank), "--ranks", str(n), "--sizes-mib", sizes_arg,
            "--ports", ",".join(map(str, ports)), "--job", job, "--transport", transport]


def _run_cross(impl, sizes_arg, n, timeout, transport="shm"):
    """The ranks of one cross-process run, as peers under the watchdog: a rank that fails,
    or exits 0 without its records (its peer would wait forever: TF's collective ops
    cannot be cancelled), fails the run at once; so do the --timeout bound and a rank
    still running PEER_SECONDS after another one finished.  A failed
    run is recorded (FAILURES) and the benchmark goes on; no rank is left running."""
    ports = free_ports(n)
    job = uuid.uuid4().hex[:12]
    env = dict(os.environ)
    if transport == "tcp":   # two "hosts" of the loopback range, TCP between them
        env["EPL_COMM_ADDRESSES"] = ",".join(
            "127.0.0.%d:%d" % (2 + r, p) for r, p in enumerate(free_ports(n)))
    cmds = [_rank_command(impl, r, n, sizes_arg, ports, job, transport) for r in range(n)]
    out = watchdog.run_group(cmds, timeout, env=env, has_result=watchdog.has_json_result,
                             names=["rank %d" % r for r in range(n)],
                             peer_seconds=PEER_SECONDS)
    if not out.ok:
        print("collectives: the cross-process %s run failed: %s; recorded, going on"
              % (impl, out.failure), flush=True)
        FAILURES.append({"scope": "tcp" if transport == "tcp" else "cross_process",
                         "impl": impl, "failure": out.failure})
        return []
    return watchdog.json_result(out.outputs[0])


FAILURES = []      # runs that did not finish (written to the JSON)
PEER_SECONDS = 120   # after one rank has its records, the others' bound


def _horovod(sizes_arg, timeout):
    horovodrun = None
    for cand in (os.path.join(os.path.dirname(sys.executable), "horovodrun"),
                 os.path.join(os.path.dirname(HERE), ".venv-horovod", "bin", "horovodrun")):
        if os.path.exists(cand):
            horovodrun = cand
            break
    if horovodrun is None:
        return []
    py = os.path.join(os.path.dirname(horovodrun), "python")
    run = watchdog.run_group([[horovodrun, "-np", "2", "-H", "localhost:2", "--gloo", py,
                               os.path.abspath(__file__), "--child", "horovod", "--sizes-mib",
                               sizes_arg]], timeout,
                             has_result=lambda out: _horovod_records(out) is not None,
                             names=["horovodrun"])
    if not run.ok:
        print("collectives: the Horovod run failed: %s; recorded, going on" % run.failure,
              flush=True)
        FAILURES.append({"scope": "cross_process", "impl": "horovod", "failure": run.failure})
        return []
    return _horovod_records(run.outputs[0])


def _horovod_records(output):
    # horovodrun prefixes each line with "[rank]<stdout>:"; rank 0 prints the records.
    for ln in reversed(output.splitlines()):
        if "[{" in ln:
            try:
                return json.loads(ln[ln.index("[{"):])
            except ValueError:
                continue
    return None


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--sizes-mib", default="1,16,64,256")
    p.add_argument("--json")
    p.add_argument("--ranks", type=int, default=0)
    p.add_argument("--child")
    p.add_argument("--scope")
    p.add_argument("--rank", type=int, default=0)
    p.add_argument("--ports", default="")
    p.add_argument("--job", default="")
    p.add_argument("--transport", default="shm")
    p.add_argument("--timeout", type=int, default=600,
                   help="bound of each run (its processes are killed past it)")
    p.add_argument("--runs", type=int, default=5,
                   help="fresh runs of EPL's measurements (min / median / max reported)")
    p.add_argument("--baseline-runs", type=int, default=1,
                   help="how many of the runs also measure TF's collective ops and Horovod "
                        "(the slow baselines)")
    p.add_argument("--scopes", default="in_process,cross_process,tcp",
                   help="which scopes to measure (the JSON says which were)")
    a = p.parse_args()
    sizes = [int(float(s) * (1 << 20)) for s in a.sizes_mib.split(",")]
    if a.child == "horovod":
        print(json.dumps(child_horovod(sizes)))
        return
    if a.child:
        if a.scope == "in_process":
            recs = child_in_process(a.child, sizes, a.ranks or 4)
        else:
            recs = child_cross_process(a.child, sizes, a.rank, a.ranks or 2,
                                       [int(x) for x in a.ports.split(",")], a.job,
                                       a.transport)
        print(json.dumps(recs))
        return
    scopes = a.scopes.split(",")
    runs = []   # one list of records per (run, implementation, scope), each tagged "run"
    for i in range(a.runs):   # interleaved: the ratios of one run saw the same machine
        baseline = i < a.baseline_runs
        got = [memcpy_records(sizes)]
        if "in_process" in scopes:
            for impl in ("epl", "tf_collective") if baseline else ("epl",):
                got.append(_run_child(["--child", impl, "--scope", "in_process", "--ranks",
                                       "4", "--sizes-mib", a.sizes_mib], a.timeout))
        if "cross_process" in scopes:
            for impl in ("epl", "tf_collective") if baseline else ("epl",):
                got.append(_run_cross(impl, a.sizes_mib, 2, a.timeout))
        if ("cross_process" in scopes or "tcp" in scopes) and baseline:
            got.append(_horovod(a.sizes_mib, a.timeout))
        if "tcp" in scopes:
            got.append(_run_cross("epl", a.sizes_mib, 2, a.timeout, "tcp"))
        for recs in got:
            for r in recs:
                r["run"] = i
        runs += got
    records = _aggregate(runs)
    _per_run_ratios(records, [r for recs in runs for r in recs])
    from common import print_table, write_json
    rows = sorted(records, key=lambda r: (r["scope"], r["op"], r["bytes"], r["impl"]))
    for r in rows:
        r["MiB"] = r["bytes"] / float(1 << 20)
        r["ms"] = r["seconds"] * 1e3
    version = next((r["tf_version"] for r in records if r.get("tf_version")), "?")
    print_table(rows, ["scope", "op", "ranks", "MiB", "impl", "ms", "busbw_gbps", "busbw_min",
                       "busbw_max", "runs"],
                "Collectives, TensorFlow %s (bus bandwidth, GB/s: median, min and max over "
                "runs)" % version)
    _print_ratios(records)
    _print_goals(records)
    for r in rows:
        r.pop("MiB")
        r.pop("ms")
    for f in FAILURES:   # a baseline that died is a result too
        print("FAILED: %(scope)s %(impl)s: %(failure)s" % f)
    write_json("collectives", records + FAILURES, a.json)


def _aggregate(runs):
    """One record per measurement over several runs: median time, min/max bandwidth."""
    by_key = {}
    for recs in runs:
        for r in recs:
            by_key.setdefault((r["impl"], r["op"], r["scope"], r["ranks"], r["bytes"]),
                              []).append(r)
    out = []
    for group in by_key.values():
        rec = dict(group[0])
        rec.pop("run", None)
        rec["seconds"] = _median([g["seconds"] for g in group])
        rec["busbw_gbps"] = busbw(rec["op"], rec["bytes"], rec["seconds"], rec["ranks"])
        rec["busbw_min"] = min(g["busbw_gbps"] for g in group)
        rec["busbw_max"] = max(g["busbw_gbps"] for g in group)
        rec["busbw_runs"] = [g["busbw_gbps"] for g in group]
        rec["runs"] = len(group)
        out.append(rec)
    return out


def _print_goals(records):
    """Issue 13's goals, on this run's numbers (the minimum over runs where it applies)."""
    def find(impl, scope, op, nbytes):
        for r in records:
            if (r["impl"], r["scope"], r["op"], r["bytes"]) == (impl, scope, op, nbytes):
                return r
        return None
    print("\nGoals of issue 13")
    for r in sorted(records, key=lambda r: (r["scope"], r["bytes"], r["op"])):
        if r["impl"] != "epl":
            continue
        if r["op"] == "allreduce" and r["scope"] == "tcp":
            hvd = find("horovod", "cross_process", "allreduce", r["bytes"])
            if not hvd or r["bytes"] < 16 << 20:
                continue
            ok = r["busbw_min"] >= hvd["busbw_gbps"]
            line = "all-reduce over TCP >= Horovod-Gloo (TCP too): %.2f vs %.2f (min over %d)" \
                % (r["busbw_min"], hvd["busbw_gbps"], r["runs"])
        elif r["op"] == "allreduce" and r["scope"] == "cross_process":
            ok = r["busbw_min"] >= 5.0
            line = "all-reduce across processes >= 5 GB/s (min over %d runs): %.2f" % (
                r["runs"], r["busbw_min"])
            hvd = find("horovod", r["scope"], "allreduce", r["bytes"])
            if hvd and r["bytes"] >= 64 << 20:
                ok = ok and r["busbw_min"] >= 4 * hvd["busbw_gbps"]
                line += ", x%.1f Horovod-Gloo (goal x4)" % (r["busbw_min"] / hvd["busbw_gbps"])
        elif r["op"] != "allreduce" and r["scope"] != "tcp":
            ar = find("epl", r["scope"], "allreduce", r["bytes"])
            if not ar:
                continue
            share = r["busbw_gbps"] / ar["busbw_gbps"]
            ok = share >= 0.5
            line = "%s >= 50%% of all-reduce (%s): %.0f%%" % (r["op"], r["scope"], 100 * share)
        else:
            continue
        print("  %-4s %7.1f MiB  %s" % ("met" if ok else "MISS", r["bytes"] / float(1 << 20),
                                         line))
    print("\nGoals of the TF 2.x issue (the 1.15 line's too): cross-process all-reduce, "
          "16-256 MiB, per-run ratios (median [min..max])")
    for r in sorted(records, key=lambda r: r["bytes"]):
        if ((r["impl"], r["scope"], r["op"]) != ("epl", "cross_process", "allreduce")
                or not 16 << 20 <= r["bytes"] <= 256 << 20):
            continue
        for other, goal, what in (("memcpy", 0.5, ">= 50% of a memory copy"),
                                  ("tf_collective", 4.0, ">= 4x TF's collective ops")):
            q = r.get("ratio_" + other)
            if not q:
                print("  ---- %7.1f MiB  %s: not measured" % (r["bytes"] / float(1 << 20), what))
                continue
            scale, unit = (100, "%") if other == "memcpy" else (1, "x")
            print("  %-4s %7.1f MiB  %s: %.2f%s [%.2f..%.2f]%s" % (
                "met" if q[0] >= goal else "MISS", r["bytes"] / float(1 << 20), what,
                scale * q[0], unit, scale * q[1], scale * q[2],
                "" if q[1] >= goal else " (not in every run)"))


def _per_run_ratios(records, measured):
    """EPL's bus bandwidth over each other implementation's and over the copy's, run by run
    (both measured in the same run, back to back): for each aggregated EPL record
    ``ratio_<other>`` = [median, min, max] over the runs that measured both, and
    ``ratio_<other>_runs`` the ratios themselves."""
    by_run = {}
    for m in measured:
        by_run[(m["impl"], m["scope"], m["op"], m["bytes"], m["run"])] = m["busbw_gbps"]
    for r in records:
        if r["impl"] != "epl":
            continue
        for other in ("tf_collective", "horovod", "memcpy"):
            ratios = []
            for (impl, scope, op, nbytes, run), bw in by_run.items():
                if (impl, scope, op, nbytes) != ("epl", r["scope"], r["op"], r["bytes"]):
                    continue
                key = (("memcpy", "in_process", "copy", nbytes, run) if other == "memcpy"
                       else (other, "cross_process" if other == "horovod" else scope, op,
                             nbytes, run))
                if key in by_run:
                    ratios.append(bw / by_run[key])
            if ratios:
                r["ratio_" + other] = [_median(ratios), min(ratios), max(ratios)]
                r["ratio_%s_runs" % other] = ratios


def _print_ratios(records):
    print("\nRatios (EPL bus bandwidth / other's, per run: median [min..max] over runs)")
    for r in sorted(records, key=lambda r: (r["scope"], r["op"], r["bytes"])):
        if r["impl"] != "epl":
            continue
        parts = []
        for other, label, fmt in (("tf_collective", "tf_collective", "x%.2f [%.2f..%.2f]"),
                                  ("horovod", "horovod", "x%.2f [%.2f..%.2f]"),
                                  ("memcpy", "of memcpy", "%.0f%% [%.0f..%.0f%%]")):
            q = r.get("ratio_" + other)
            if q:
                scale = 100 if other == "memcpy" else 1
                parts.append("%s %s" % (label, fmt % tuple(scale * v for v in q)))
        print("  %-13s %-13s %7.1f MiB: %s" % (r["scope"], r["op"], r["bytes"] / float(1 << 20),
                                               ", ".join(parts)))

if __name__ == "__main__":
    main()
