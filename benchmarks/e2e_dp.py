"""End-to-end data parallel training: EPL vs TensorFlow's own strategies
(MultiWorkerMirroredStrategy, MirroredStrategy) vs Horovod-Gloo vs one device.

    python benchmarks/e2e_dp.py [--models mlp,transformer] [--steps 50] [--runs 3] [--json FILE]

Runs on both TensorFlow lines (1.15 and 2.x, where it needs TF_USE_LEGACY_KERAS=1): every
configuration is the same tf.compat.v1 graph program, built after
``tf.disable_v2_behavior()``, trained with a v1 ``GradientDescentOptimizer`` and run by
``Session.run`` -- the closest program each strategy allows (TF's strategies run the same
model function under ``strategy.run`` -- ``experimental_run_v2`` on 1.15 -- inside the
graph, a custom training loop in graph mode; not Keras ``fit``).

Two models, per-replica batch 32, median samples/s over --steps timed steps, each
configuration started --runs times in fresh processes, interleaved (every configuration
sees the same noise; min / median / max reported):

* `single`      one process, one device: a replica's step alone (no exchange)
* `single_2proc` two `single` processes at once (no exchange): the compute alone of the
                2-process configurations, which share the machine's cores
* `epl_2proc`   EPL, 2 processes x 1 device (epl-launch, shm collectives)
* `mwms`        tf.distribute MultiWorkerMirroredStrategy (compat.v1 API, i.e.
                CollectiveAllReduceStrategy), 2 processes x 1 device: TF_CONFIG with two local
                workers, communication RING (TF's collective ops over gRPC, on CPU), a
                tf.train.Server per process -- TF's own collective-ops strategy
* `horovod`     Horovod-Gloo, 2 processes x 1 device (when `make horovod` built it)
* `epl_1proc`   EPL, 1 process x 2 virtual devices
* `mirrored`    tf.distribute.MirroredStrategy, 1 process x 2 virtual devices

The step breakdown: `exchange_ms` = step time - compute alone (what the gradient exchange
and the rest of data parallelism add after overlap with the backward pass); compute alone
is `single_2proc` for the 2-process configurations and two `single` steps for the
1-process ones (two replicas on the same cores).  `vs_mwms`, `vs_horovod`, `vs_mirrored`:
EPL's samples/s over the other's, as the ratio of the medians and (`*_min`, `*_max`) the
extremes of the per-run ratios (configurations of one run ran back to back).  `bound`
is the best ratio any implementation could reach against the baseline: the baseline's
step / compute alone.
"""
import argparse
import json
import os
import sys
import tempfile
import time
import uuid

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
sys.path.insert(0, HERE)
os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import watchdog  # noqa: E402
from common import free_ports  # noqa: E402

BATCH = 32
MLP_IN, MLP_WIDTH, MLP_DEPTH, CLASSES = 1024, 2048, 6, 16          # ~25M parameters
SEQ, D, HEADS, FF, LAYERS, VOCAB = 64, 256, 4, 1024, 2, 2000       # small transformer


# ---------------------------------------------------------------- models (plain TF1)


def _data(tf, model, batch, seed):
    import numpy as np
    rng = np.random.RandomState(seed)
    if model == "mlp":
        x = rng.randn(batch * 4, MLP_IN).astype(np.float32)
        y = rng.randint(0, CLASSES, batch * 4).astype(np.int64)
    else:
        x = rng.randint(0, VOCAB, (batch * 4, SEQ)).astype(np.int64)
        y = rng.randint(0, VOCAB, (batch * 4, SEQ)).astype(np.int64)
    ds = tf.data.Dataset.from_tensor_slices((x, y)).repeat().batch(batch, drop_remainder=True)
    return tf.data.make_one_shot_iterator(ds.prefetch(4)).get_next()


def _mlp(tf, x, y):
    h = x
    for i in range(MLP_DEPTH):
        h = tf.layers.dense(h, MLP_WIDTH, activation=tf.nn.relu, name="l%d" % i)
    logits = tf.layers.dense(h, CLASSES, name="out")
    return tf.reduce_mean(tf.nn.sparse_softmax_cross_entropy_with_logits(labels=y, logits=logits))


def _layer_norm(tf, h, name, eps=1e-6):
    """Layer normalization over the last axis, written with core ops: tf.contrib (whose
    layer_norm the first version used) is gone in TF 2.x, and the benchmark must run the
    same model on both lines."""
    with tf.variable_scope(name):
        d = int(h.shape[-1])
        gamma = tf.get_variable("gamma", [d], initializer=tf.ones_initializer())
        beta = tf.get_variable("beta", [d], initializer=tf.zeros_initializer())
        mean = tf.reduce_mean(h, -1, keepdims=True)
        var = tf.reduce_mean(tf.square(h - mean), -1, keepdims=True)
        return (h - mean) * tf.rsqrt(var + eps) * gamma + beta


def _transformer(tf, x, y):
    dense = tf.layers.dense
    emb = tf.get_variable("emb", [VOCAB, D])
    pos = tf.get_variable("pos", [SEQ, D])
    h = tf.gather(emb, x) + pos
    dh = D // HEADS
    for i in range(LAYERS):
        with tf.variable_scope("layer%d" % i):
            q, k, v = [tf.transpose(tf.reshape(dense(h, D, name=n), [-1, SEQ, HEADS, dh]),
                                    [0, 2, 1, 3]) for n in ("q", "k", "v")]
            att = tf.nn.softmax(tf.matmul(q, k, transpose_b=True) / float(dh) ** 0.5)
            ctx = tf.reshape(tf.transpose(tf.matmul(att, v), [0, 2, 1, 3]), [-1, SEQ, D])
            h = _layer_norm(tf, h + dense(ctx, D, name="o"), "ln1")
            f = dense(dense(h, FF, activation=tf.nn.relu, name="f1"), D, name="f2")
            h = _layer_norm(tf, h + f, "ln2")
    logits = dense(h, VOCAB, name="lm")
    return tf.reduce_mean(tf.nn.sparse_softmax_cross_entropy_with_logits(labels=y, logits=logits))


def _loss(tf, model, x, y):
    return (_mlp if model == "mlp" else _transformer)(tf, x, y)


def _timed_steps(sess, op, steps):
    for _ in range(5):
        sess.run(op)
    times = []
    for _ in range(steps):
        t0 = time.perf_counter()
        sess.run(op)
        times.append(time.perf_counter() - t0)
    times.sort()
    return times[len(times) // 2]


# ---------------------------------------------------------------- children


def _run_replicas(strategy, fn):
    """``strategy.run`` (TF 2.x; also 1.15's later name) or 1.15's ``experimental_run_v2``."""
    run = getattr(strategy, "run", None) or strategy.experimental_run_v2
    return strategy.group(run(fn))


def child(impl, model, steps, out):
    import tensorflow.compat.v1 as tf
    tf.disable_v2_behavior()   # TF 2.x: TF1 graph semantics (1.15: its defaults already)
    tf.logging.set_verbosity(tf.logging.ERROR)
    opt = tf.train.GradientDescentOptimizer(0.001)
    cfg = tf.ConfigProto()
    target = ""
    rank, replicas, extra = 0, 1, {}
    if impl == "single":
        x, y = _data(tf, model, BATCH, 0)
        train = opt.minimize(_loss(tf, model, x, y))
    elif impl in ("epl_2proc", "epl_1proc"):
        import epl
        if impl == "epl_1proc":
            epl.init(epl.Config({"cluster.devices_per_worker": 2}))
            cfg = tf.ConfigProto(device_count={"CPU": 2})
            replicas = 2
        else:
            epl.init()
            rank, replicas = epl.Env.get().cluster.worker_index, 2
        epl.set_default_strategy(epl.replicate(1))
        x, y = _data(tf, model, BATCH, rank)
        train = opt.minimize(_loss(tf, model, x, y))
        params = sum(int(v.shape.num_elements()) for v in tf.trainable_variables())
        extra["gradient_mib"] = params * 4 / float(1 << 20)
    elif impl == "horovod":
        import horovod.tensorflow as hvd
        hvd.init()
        rank, replicas = hvd.rank(), hvd.size()
        x, y = _data(tf, model, BATCH, rank)
        train = hvd.DistributedOptimizer(opt).minimize(_loss(tf, model, x, y))
        bcast = hvd.broadcast_global_variables(0)
    elif impl == "mirrored":
        cfg = tf.ConfigProto(device_count={"CPU": 2})
        strategy = tf.distribute.MirroredStrategy(
            ["/cpu:0", "/cpu:1"],
            cross_device_ops=tf.distribute.ReductionToOneDevice("/cpu:0"))
        replicas = 2
        with strategy.scope():
            def step():
                bx, by = _data(tf, model, BATCH, 0)
                return opt.minimize(_loss(tf, model, bx, by))
            train = _run_replicas(strategy, step)
    elif impl == "mwms":
        # Between-graph replication: each process builds the whole program for its own
        # replica; the strategy reads TF_CONFIG and reduces gradients with TF's collective
        # ops (RING) across the two processes' servers.
        tf_config = json.loads(os.environ["TF_CONFIG"])
        rank, replicas = tf_config["task"]["index"], len(tf_config["cluster"]["worker"])
        comm = tf.distribute.experimental.CollectiveCommunication.RING
        strategy = tf.distribute.experimental.MultiWorkerMirroredStrategy(communication=comm)
        # (the collective group leader must be in the server's config too, or the first
        # collective hangs: PLATFORM_NOTES)
        cfg = strategy.update_config_proto(tf.ConfigProto())
        server = tf.train.Server(tf.train.ClusterSpec(tf_config["cluster"]), job_name="worker",
                                 task_index=rank, config=cfg)
        target = server.target
        with strategy.scope():
            def step():
                bx, by = _data(tf, model, BATCH, rank)
                return opt.minimize(_loss(tf, model, bx, by))
            train = _run_replicas(strategy, step)
    else:
        raise SystemExit("unknown impl %r" % impl)
    with tf.Session(target, config=cfg) as sess:
        sess.run(tf.global_variables_initializer())
        if impl == "horovod":
            sess.run(bcast)
        sec = _timed_steps(sess, train, steps)
    if rank == 0:
        rec = dict(impl=impl, model=model, replicas=replicas, step_ms=sec * 1e3,
                   samples_per_s=replicas * BATCH / sec, tf_version=tf.__version__, **extra)
        with open(out, "w") as f:
            json.dump(rec, f)


# ---------------------------------------------------------------- driver


def _horovodrun():
    for cand in (os.path.join(os.path.dirname(sys.executable), "horovodrun"),
                 os.path.join(ROOT, ".venv-horovod", "bin", "horovodrun")):
        if os.path.exists(cand):
            return cand
    return None


def _run(impl, model, steps, timeout):
    out = os.path.join(tempfile.mkdtemp(prefix="e2e_"), "rec.json")
    me = [os.path.abspath(__file__), "--child", impl, "--model", model, "--steps", str(steps),
          "--out", out]
    env = dict(os.environ, PYTHONPATH=ROOT)
    if impl == "epl_2proc":
        logs = tempfile.mkdtemp(prefix="e2e_logs_")
        cmd = [sys.executable, "-m", "epl.launch", "--num_workers", "2", "--gpu_per_worker",
               "1", "--log_dir", logs, "--timeout", str(timeout)] + me
    elif impl == "horovod":
        run = _horovodrun()
        if run is None:
            return None
        cmd = [run, "-np", "2", "-H", "localhost:2", "--gloo",
               os.path.join(os.path.dirname(run), "python")] + me
    elif impl == "mwms":
        ports = free_ports(2)
        workers = ["127.0.0.1:%d" % q for q in ports]
        # (the ranks of one run_group share one environment: each gets its own TF_CONFIG
        # through env(1))
        cmds = [["env", "TF_CONFIG=" + json.dumps({"cluster": {"worker": workers},
                                                   "task": {"type": "worker", "index": i}}),
                 sys.executable] + me for i in range(2)]
        run = watchdog.run_group(cmds, timeout, env=env,
                                 has_result=lambda i, _: i != 0 or os.path.exists(out),
                                 names=["worker 0", "worker 1"], peer_seconds=120)
        if not run.ok:
            print("e2e_dp: %s/%s failed: %s:\n%s" % (impl, model, run.failure, "\n".join(
                o[-1500:] for o in run.outputs)), flush=True)
            return None
        with open(out) as f:
            return json.load(f)
    elif impl == "single_2proc":
        me[2] = "single"
        run = watchdog.run_group([[sys.executable] + me[:-1] + [out + str(i)]
                                  for i in range(2)], timeout, env=env,
                                 has_result=lambda i, _: os.path.exists(out + str(i)),
                                 names=["process 0", "process 1"])
        if not run.ok:
            print("e2e_dp: %s/%s failed: %s" % (impl, model, run.failure), flush=True)
            return None
        recs = []
        for i in range(2):
            with open(out + str(i)) as f:
                recs.append(json.load(f))
        step = max(r["step_ms"] for r in recs)
        return dict(recs[0], impl=impl, replicas=2, step_ms=step,
                    samples_per_s=2 * BATCH / (step / 1e3))
    else:
        cmd = [sys.executable] + me
    # (epl-launch stops its workers when the watchdog terminates it)
    run = watchdog.run_group([cmd], timeout, env=env, has_result=lambda _: os.path.exists(out),
                             names=[impl])
    if not run.ok:
        print("e2e_dp: %s/%s failed: %s:\n%s" % (impl, model, run.failure,
                                                 run.outputs[0][-1500:]), flush=True)
        return None
    with open(out) as f:
        return json.load(f)


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--child")
    p.add_argument("--model", default="mlp")
    p.add_argument("--out")
    p.add_argument("--models", default="mlp,transformer")
    p.add_argument("--impls",
                   default="single,single_2proc,epl_2proc,mwms,horovod,epl_1proc,mirrored")
    p.add_argument("--steps", type=int, default=50)
    p.add_argument("--runs", type=int, default=3)
    p.add_argument("--timeout", type=int, default=900)
    p.add_argument("--json")
    a = p.parse_args()
    if a.child:
        child(a.child, a.model, a.steps, a.out)
        return
    from common import median, print_table, write_json
    rows, failures = [], []
    for model in a.models.split(","):
        got = {}
        for run_index in range(a.runs):   # interleaved: every configuration sees the same noise
            for impl in a.impls.split(","):
                rec = _run(impl, model, a.steps, a.timeout)
                if rec:
                    rec["run"] = run_index
                    got.setdefault(impl, []).append(rec)
                elif impl != "horovod" or _horovodrun():
                    failures.append(dict(model=model, impl=impl, run=run_index))

        def step_of(impl):
            return median([r["step_ms"] for r in got[impl]]) if impl in got else None
        alone = {"epl_2proc": step_of("single_2proc"), "horovod": step_of("single_2proc"),
                 "mwms": step_of("single_2proc")}
        if step_of("single"):
            alone.update(epl_1proc=2 * step_of("single"), mirrored=2 * step_of("single"))
        for impl, recs in got.items():
            sps = [r["samples_per_s"] for r in recs]
            row = dict(recs[0], samples_per_s=median(sps), sps_min=min(sps), sps_max=max(sps),
                       step_ms=median([r["step_ms"] for r in recs]), runs=len(recs),
                       per_run_sps=sps)
            row.pop("run")
            if alone.get(impl):
                row["exchange_ms"] = row["step_ms"] - alone[impl]
                row["compute_ms"] = alone[impl]
            rows.append(row)
        _ratios(rows, model, got)
    print_table(rows, ["model", "impl", "replicas", "step_ms", "compute_ms", "exchange_ms",
                       "samples_per_s", "sps_min", "sps_max", "runs", "vs_mwms", "vs_horovod",
                       "vs_mirrored", "bound"],
                "End-to-end data parallel, TensorFlow %s (per-replica batch %d, median over "
                "runs)" % (_tf_version(rows), BATCH))
    _print_ratio_ranges(rows)
    _print_goals(rows)
    for f in failures:
        print("FAILED: %(model)s %(impl)s (run %(run)d)" % f)
    write_json("e2e_dp", rows + [dict(f, failed=True) for f in failures], a.json)


def _tf_version(rows):
    return next((r["tf_version"] for r in rows if r.get("tf_version")), "?")


# (EPL's configuration, the other one, the column of the ratio)
COMPARISONS = (("epl_2proc", "mwms", "vs_mwms"), ("epl_2proc", "horovod", "vs_horovod"),
               ("epl_1proc", "mirrored", "vs_mirrored"))


def _ratios(rows, model, got):
    """EPL's samples/s over the other's: the ratio of the medians, and the extremes of the
    per-run ratios (the two ran back to back in each run)."""
    mine = [r for r in rows if r["model"] == model]
    by = {r["impl"]: r for r in mine}
    for r in mine:
        for mine_impl, other, key in COMPARISONS:
            if r["impl"] != mine_impl or other not in by:
                continue
            r[key] = r["samples_per_s"] / by[other]["samples_per_s"]
            theirs = {x["run"]: x["samples_per_s"] for x in got[other]}
            per_run = [x["samples_per_s"] / theirs[x["run"]] for x in got[mine_impl]
                       if x["run"] in theirs]
            if per_run:
                r[key + "_min"], r[key + "_max"] = min(per_run), max(per_run)
            if by[other].get("compute_ms"):
                r["bound_" + other] = by[other]["step_ms"] / by[other]["compute_ms"]
                if other != "horovod" or "mwms" not in by:
                    r["bound"] = r["bound_" + other]


def _print_ratio_ranges(rows):
    print("\nRatios (EPL samples/s over the other's: median of runs, per-run min..max)")
    for r in rows:
        for mine_impl, other, key in COMPARISONS:
            if r["impl"] == mine_impl and key in r:
                print("  %-12s %-9s vs %-8s x%.2f (x%.2f..x%.2f)%s" % (
                    r["model"], mine_impl, other, r[key], r.get(key + "_min", r[key]),
                    r.get(key + "_max", r[key]),
                    ", bound x%.2f" % r["bound_" + other] if "bound_" + other in r else ""))


def _print_goals(rows):
    """The TF 2.x issue's end-to-end goal (the same as the 1.15 line's): EPL across 2
    processes at least 1.3x TF's collective-ops strategy (MultiWorkerMirroredStrategy)."""
    print("\nGoals")
    for r in rows:
        if r["impl"] == "epl_2proc" and "vs_mwms" in r:
            ok = r["vs_mwms"] >= 1.3
            print("  %-4s %-12s EPL 2 processes >= 1.3x MultiWorkerMirroredStrategy: x%.2f "
                  "(per run x%.2f..x%.2f; bound x%s)" % (
                      "met" if ok else "MISS", r["model"], r["vs_mwms"], r["vs_mwms_min"],
                      r["vs_mwms_max"], "%.2f" % r["bound_mwms"] if "bound_mwms" in r else "?"))


if __name__ == "__main__":
    main()
