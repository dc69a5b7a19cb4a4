"""Across hosts on a real (virtual) network: EPL's TCP all-reduce and end-to-end data
parallel step vs TensorFlow's collective ops over the same links, without and with 20 ms
of added latency each way.

    sudo python benchmarks/netns.py [--sizes-mib 1,16] [--steps 10] [--latency-ms 20] [--json F]

Two hosts are network namespaces on a bridge (tests/netns.py: own address and link each;
the latency comes from a TCP relay of our own, since this kernel has no netem; every
port of a host goes through it, EPL's and TensorFlow's alike).  Each measurement runs
in fresh processes, one per host:

* `allreduce`: a float32 all-reduce of each size between the two hosts, median of
  repeated ``Session.run``; EPL's ``epl_all_reduce`` over its TCP ring (EPL_COMM_ADDRESSES
  h0:7001,h1:7001) vs TensorFlow's ``collective_ops.all_reduce`` over gRPC between
  ``tf.train.Server``s at h0:7000, h1:7000 (collective_group_leader in the servers'
  config).  Bus bandwidth = size/time * 2(n-1)/n, n = 2.
* `e2e`: benchmarks/e2e_dp.py's MLP (about 25M parameters, batch 32 per replica), median
  step over --steps steps: EPL under ``epl-launch --machine_list h0:7000,h1:7000
  --machine_rank k`` in each host vs MultiWorkerMirroredStrategy (RING, TF_CONFIG with
  h0:7000, h1:7000).

Prints a table with the ratios side by side (EPL's bandwidth / TF's; TF's step / EPL's)
and writes a JSON list of records {"network", "what", "bytes", "epl", "tf", "unit",
"ratio"} (benchmarks/results/netns.json by default).  Needs root and iproute2: where
namespaces cannot be made it prints why, writes {"skipped": reason} and exits 0.
The relay is Python: with latency it also caps the bandwidth (the same for both).
"""
import argparse
import json
import os
import signal
import subprocess
import sys
import tempfile
import time
import uuid

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
sys.path.insert(0, HERE)
sys.path.insert(0, ROOT)
os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

PORT = 7000            # every host: TensorFlow on 7000, EPL's collectives on 7001
HOSTS = ["h0", "h1"]


def _median(xs):
    xs = sorted(xs)
    return xs[len(xs) // 2]


# ---------------------------------------------------------------- child (one host)


def child_allreduce(impl, rank, sizes_mib, repeats, job, out):
    import tensorflow.compat.v1 as tf
    tf.disable_v2_behavior()
    tf.logging.set_verbosity(tf.logging.ERROR)
    target, cfg, device = "", tf.ConfigProto(), "/device:CPU:0"
    if impl == "tf":
        from tensorflow.python.ops import collective_ops
        cluster = tf.train.ClusterSpec({"worker": ["%s:%d" % (h, PORT) for h in HOSTS]})
        cfg.experimental.collective_group_leader = "/job:worker/replica:0/task:0"
        server = tf.train.Server(cluster, job_name="worker", task_index=rank, config=cfg)
        target = server.target
        device = "/job:worker/replica:0/task:%d/device:CPU:0" % rank
    else:
        from epl.communicators import native_ops as C
    records = []
    for si, mib in enumerate(sizes_mib):
        elems = int(mib * (1 << 20)) // 4
        with tf.Graph().as_default():
            with tf.device(device):
                x = tf.Variable(tf.random.uniform([elems]), trainable=False,
                                name="x_%d_%s" % (si, uuid.uuid4().hex[:6]))
                if impl == "tf":
                    y = collective_ops.all_reduce(x, len(HOSTS), 1, 100 + si, "Add", "Id")
                else:
                    y = C.all_reduce(x, "%s/allreduce_%d" % (job, si), rank, len(HOSTS), "sum",
                                     transport="tcp")
            with tf.Session(target, config=cfg) as sess:
                sess.run(x.initializer)
                for _ in range(2):
                    sess.run(y.op)
                times = []
                for _ in range(repeats):
                    t0 = time.perf_counter()
                    sess.run(y.op)
                    times.append(time.perf_counter() - t0)
        sec = _median(times)
        n = len(HOSTS)
        records.append(dict(bytes=elems * 4, seconds=sec,
                            busbw_gbps=elems * 4 / sec / 1e9 * 2 * (n - 1) / n))
    if rank == 0:
        with open(out, "w") as f:
            json.dump(records, f)


# ---------------------------------------------------------------- driver


def _start(net, rank, cmd, env, cwd=None):
    """cmd on host ``rank``, its output to a temporary file (read when it ends)."""
    log = tempfile.TemporaryFile()
    proc = net.popen(rank, cmd, stdout=log, stderr=subprocess.STDOUT, env=env, cwd=cwd)
    proc.log = log
    return proc


def _output(proc):
    proc.log.seek(0)
    return proc.log.read().decode("utf-8", "replace")


def _wait_all(procs, timeout, what):
    """Waits for every process; when one fails (its peers would wait for it: TF's
    collectives cannot be cancelled) or at the timeout, kills them all and raises."""
    deadline = time.time() + timeout
    while True:
        codes = [p.poll() for p in procs]
        bad = [i for i, c in enumerate(codes) if c not in (None, 0)]
        if bad or time.time() > deadline:
            for p in procs:
                if p.poll() is None:
                    p.kill()
                    p.wait()
            if bad:
                raise RuntimeError("%s: host %d failed:\n%s"
                                   % (what, bad[0], _output(procs[bad[0]])[-3000:]))
            raise RuntimeError("%s: hung past %ds; host 0's output:\n%s"
                               % (what, timeout, _output(procs[0])[-2000:]))
        if all(c == 0 for c in codes):
            return [_output(p) for p in procs]
        time.sleep(0.2)


def _env(secret, **extra):
    """The environment of one measurement's processes (the same secret on every host)."""
    env = dict(os.environ, PYTHONPATH=ROOT, TF_CPP_MIN_LOG_LEVEL="2", GRPC_DNS_RESOLVER="native",
               EPL_JOB_SECRET=secret)
    env.pop("EPL_JOB_ID", None)
    env.pop("EPL_COMM_TRANSPORT", None)
    env.update(extra)
    return env


def allreduce(net, impl, sizes, repeats, timeout):
    out = os.path.join(tempfile.mkdtemp(prefix="netns_bench_"), "ar.json")
    env = _env(uuid.uuid4().hex, EPL_COMM_ADDRESSES=",".join("%s:%d" % (h, PORT + 1) for h in HOSTS))
    job = uuid.uuid4().hex[:12]
    procs = [_start(net, r, [sys.executable, os.path.abspath(__file__), "--child", impl,
                             "--rank", str(r), "--sizes-mib", sizes, "--repeats", str(repeats),
                             "--job", job, "--out", out], env)
             for r in range(len(HOSTS))]
    _wait_all(procs, timeout, "%s all-reduce" % impl)
    with open(out) as f:
        return json.load(f)


def e2e(net, impl, model, steps, timeout, tmp):
    out = os.path.join(tmp, "e2e_%s.json" % impl)
    me = [os.path.join(HERE, "e2e_dp.py"), "--child", "epl_2proc" if impl == "epl" else "mwms",
          "--model", model, "--steps", str(steps), "--out", out]
    procs, secret = [], uuid.uuid4().hex
    for r in range(len(HOSTS)):
        if impl == "epl":
            cmd = [sys.executable, "-m", "epl.launch", "--num_workers", str(len(HOSTS)),
                   "--gpu_per_worker", "1", "--machine_list",
                   ",".join("%s:%d" % (h, PORT) for h in HOSTS), "--machine_rank", str(r),
                   "--log_dir", os.path.join(tmp, "logs_%d" % r), "--timeout", str(timeout)] + me
            env = _env(secret)
        else:
            cmd = [sys.executable] + me
            env = _env(secret, TF_CONFIG=json.dumps({
                "cluster": {"worker": ["%s:%d" % (h, PORT) for h in HOSTS]},
                "task": {"type": "worker", "index": r}}))
        procs.append(_start(net, r, cmd, env, cwd=tmp))
    _wait_all(procs, timeout, "%s end to end" % impl)
    with open(out) as f:
        return json.load(f)


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--child")
    p.add_argument("--rank", type=int, default=0)
    p.add_argument("--job")
    p.add_argument("--out")
    p.add_argument("--sizes-mib", default="1,16")
    p.add_argument("--repeats", type=int, default=10)
    p.add_argument("--steps", type=int, default=10)
    p.add_argument("--model", default="mlp")
    p.add_argument("--latency-ms", type=float, default=20)
    p.add_argument("--timeout", type=int, default=600, help="bound of one measurement")
    p.add_argument("--json")
    a = p.parse_args()
    if a.child:
        child_allreduce(a.child, a.rank, [float(s) for s in a.sizes_mib.split(",")],
                        a.repeats, a.job, a.out)
        return
    from common import print_table, write_json
    from tests import netns
    # SIGTERM (the watchdog, a person) ends the run through the Networks' cleanup.
    signal.signal(signal.SIGTERM, lambda *_: sys.exit("netns: terminated"))
    why = netns.unavailable()
    if why:
        print("netns: skipped: %s" % why)
        write_json("netns", {"skipped": why}, a.json)
        return
    import tensorflow as tf_version_probe   # (only for the record's version)
    version = tf_version_probe.__version__
    rows, failures = [], []
    for latency in (0.0, a.latency_ms / 1000.0):
        network = "direct" if not latency else "+%g ms each way" % (latency * 1000)
        with netns.Network(len(HOSTS), latency=latency, ports=[PORT, PORT + 1]) as net:
            got = {}
            for impl in ("epl", "tf"):
                try:
                    got[impl] = allreduce(net, impl, a.sizes_mib, a.repeats, a.timeout)
                except RuntimeError as e:
                    print("netns: %s" % e, flush=True)
                    failures.append(dict(network=network, what="allreduce", impl=impl,
                                         failure=str(e)[:2000]))
            if "epl" in got and "tf" in got:
                for e, t in zip(got["epl"], got["tf"]):
                    rows.append(dict(network=network, what="allreduce %g MiB"
                                     % (e["bytes"] / float(1 << 20)), bytes=e["bytes"],
                                     epl=e["busbw_gbps"], tf=t["busbw_gbps"], unit="GB/s busbw",
                                     ratio=e["busbw_gbps"] / t["busbw_gbps"],
                                     epl_ms=e["seconds"] * 1e3, tf_ms=t["seconds"] * 1e3,
                                     tf_version=version))
            tmp = tempfile.mkdtemp(prefix="netns_e2e_")
            steps = {}
            for impl in ("epl", "tf"):
                try:
                    steps[impl] = e2e(net, impl, a.model, a.steps, a.timeout, tmp)["step_ms"]
                except (RuntimeError, OSError, ValueError) as e:
                    print("netns: %s" % e, flush=True)
                    failures.append(dict(network=network, what="e2e", impl=impl,
                                         failure=str(e)[:2000]))
            if len(steps) == 2:
                rows.append(dict(network=network, what="e2e step (%s)" % a.model, epl=steps["epl"],
                                 tf=steps["tf"], unit="ms/step (tf: MWMS)",
                                 ratio=steps["tf"] / steps["epl"], tf_version=version))
    print_table(rows, ["network", "what", "epl", "tf", "unit", "ratio", "epl_ms", "tf_ms"],
                "EPL vs TensorFlow collective ops between 2 network namespaces, TensorFlow %s "
                "(ratio: EPL's bandwidth / TF's; for the step TF's time / EPL's: >1 = EPL "
                "faster)" % version)
    for f in failures:
        print("FAILED: %(network)s %(what)s %(impl)s" % f)
    write_json("netns", rows + [dict(f, failed=True) for f in failures], a.json)
    if failures:
        sys.exit(1)


if __name__ == "__main__":
    main()
