"""End-to-end data parallel training: EPL vs Horovod-Gloo vs MirroredStrategy vs one device.

    python benchmarks/e2e_dp.py [--models mlp,transformer] [--steps 50] [--runs 3] [--json FILE]

Two models, per-replica batch 32, median samples/s over --steps timed steps, each
configuration started --runs times in fresh processes (min / median / max reported):

* `single`      one process, one device: a replica's step alone (no exchange)
* `single_2proc` two `single` processes at once (no exchange): the compute alone of the
                2-process configurations, which share the machine's cores
* `epl_2proc`   EPL, 2 processes x 1 device (epl-launch, shm collectives)
* `horovod`     Horovod-Gloo, 2 processes x 1 device (when `make horovod` built it)
* `epl_1proc`   EPL, 1 process x 2 virtual devices
* `mirrored`    tf.distribute.MirroredStrategy, 1 process x 2 virtual devices

The step breakdown: `exchange_ms` = step time - compute alone (what the gradient exchange
and the rest of data parallelism add after overlap with the backward pass); compute alone
is `single_2proc` for the 2-process configurations and two `single` steps for the
1-process ones (two replicas on the same cores).  `bound` is the best ratio any
implementation could reach against the baseline: the baseline's step / compute alone.
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
            h = tf.contrib.layers.layer_norm(h + dense(ctx, D, name="o"))
            f = dense(dense(h, FF, activation=tf.nn.relu, name="f1"), D, name="f2")
            h = tf.contrib.layers.layer_norm(h + f)
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


def child(impl, model, steps, out):
    import tensorflow.compat.v1 as tf
    tf.logging.set_verbosity(tf.logging.ERROR)
    opt = tf.train.GradientDescentOptimizer(0.001)
    cfg = tf.ConfigProto()
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
            train = strategy.group(strategy.experimental_run_v2(step))
    else:
        raise SystemExit("unknown impl %r" % impl)
    with tf.Session(config=cfg) as sess:
        sess.run(tf.global_variables_initializer())
        if impl == "horovod":
            sess.run(bcast)
        sec = _timed_steps(sess, train, steps)
    if rank == 0:
        rec = dict(impl=impl, model=model, replicas=replicas, step_ms=sec * 1e3,
                   samples_per_s=replicas * BATCH / sec, **extra)
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
        cmd = [sys.executable, "-m", "epl.launcher", "--num_workers", "2", "--gpu_per_worker",
               "1", "--log_dir", logs, "--timeout", str(timeout)] + me
    elif impl == "horovod":
        run = _horovodrun()
        if run is None:
            return None
        cmd = [run, "-np", "2", "-H", "localhost:2", "--gloo",
               os.path.join(os.path.dirname(run), "python")] + me
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
    p.add_argument("--impls", default="single,single_2proc,epl_2proc,horovod,epl_1proc,mirrored")
    p.add_argument("--steps", type=int, default=50)
    p.add_argument("--runs", type=int, default=3)
    p.add_argument("--timeout", type=int, default=900)
    p.add_argument("--json")
    a = p.parse_args()
    if a.child:
        child(a.child, a.model, a.steps, a.out)
        return
    from common import median, print_table, write_json
    rows = []
    for model in a.models.split(","):
        got = {}
        for _ in range(a.runs):      # interleaved: every configuration sees the same noise
            for impl in a.impls.split(","):
                rec = _run(impl, model, a.steps, a.timeout)
                if rec:
                    got.setdefault(impl, []).append(rec)
        def step_of(impl):
            return median([r["step_ms"] for r in got[impl]]) if impl in got else None
        alone = {"epl_2proc": step_of("single_2proc"), "horovod": step_of("single_2proc")}
        if step_of("single"):
            alone.update(epl_1proc=2 * step_of("single"), mirrored=2 * step_of("single"))
        for impl, recs in got.items():
            sps = [r["samples_per_s"] for r in recs]
            row = dict(recs[0], samples_per_s=median(sps), sps_min=min(sps), sps_max=max(sps),
                       step_ms=median([r["step_ms"] for r in recs]), runs=len(recs))
            if alone.get(impl):
                row["exchange_ms"] = row["step_ms"] - alone[impl]
                row["compute_ms"] = alone[impl]
            rows.append(row)
        _ratios(rows, model)
    print_table(rows, ["model", "impl", "replicas", "step_ms", "compute_ms", "exchange_ms",
                       "samples_per_s", "sps_min", "sps_max", "runs", "vs_horovod",
                       "vs_mirrored", "bound"],
                "End-to-end data parallel (per-replica batch %d, median over runs)" % BATCH)
    write_json("e2e_dp", rows, a.json)


def _ratios(rows, model):
    mine = [r for r in rows if r["model"] == model]
    by = {r["impl"]: r for r in mine}
    for r in mine:
        for mine_impl, other, key in (("epl_2proc", "horovod", "vs_horovod"),
                                      ("epl_1proc", "mirrored", "vs_mirrored")):
            if r["impl"] == mine_impl and other in by:
                r[key] = r["samples_per_s"] / by[other]["samples_per_s"]
                if by[other].get("compute_ms"):
                    r["bound"] = by[other]["step_ms"] / by[other]["compute_ms"]


if __name__ == "__main__":
    main()
