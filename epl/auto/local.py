"""``epl.auto.Cluster.local(devices)``: this machine as EPL uses it, measured.

EPL runs here on N virtual CPU devices of one process; they share the machine's cores,
so N devices do not compute N times as fast: each device gets the measured total
FLOP/s (and memory bandwidth) / N (``cluster_dict``).  The figures come from a short
calibration run (a few seconds), cached in ``~/.cache/epl/local-<host>-tf<version>.json``
(``EPL_CACHE_DIR`` moves the folder; ``recalibrate=True`` or ``EPL_RECALIBRATE=1``
measures again):

* ``matmul_flops``: fp32 ``MatMul`` FLOP/s at 256, 512 and 1024 (the best is the peak;
  the smaller sizes' fractions of it are kept, not used);
* ``memory_bandwidth``: bytes/s an element-wise op reads and writes (16 MiB tensors);
* ``op_overhead_s``: seconds TensorFlow's executor spends per op (a chain of tiny ops),
  and ``run_overhead_s``: a ``Session.run`` of one op: the floor of a CPU step that
  FLOPs and bytes do not see;
* ``allreduce``: bandwidth and latency of EPL's all-reduce between 2 virtual devices
  (``epl.communicators.create``: the in-process shared-memory kernel), from 64 KiB and
  8 MiB tensors.
"""
import json
import os
import platform
import socket
import time

from epl import communicators

CACHE_VERSION = 1
_SIZES = (256, 512, 1024)


def cache_path():
    import tensorflow as tf
    folder = os.environ.get("EPL_CACHE_DIR") or os.path.join(
        os.path.expanduser("~"), ".cache", "epl")
    return os.path.join(folder, "local-%s-tf%s.json" % (socket.gethostname(),
                                                        tf.__version__))


def _median(xs):
    xs = sorted(xs)
    return xs[len(xs) // 2]


def _timed(sess, fetch, repeats):
    sess.run(fetch)                      # warm-up
    out = []
    for _ in range(repeats):
        start = time.perf_counter()
        sess.run(fetch)
        out.append(time.perf_counter() - start)
    return _median(out)


def _session(tf, graph, devices):
    cfg = tf.compat.v1.ConfigProto(device_count={"CPU": devices})
    return tf.compat.v1.Session(graph=graph, config=cfg)


def measure(repeats=5, quick=False):
    """The calibration run: a dict of the figures above (seconds of work: ~5-15 s on
    2 busy cores; ``quick``: tiny sizes, for tests)."""
    import numpy as np
    import tensorflow as tf
    v1 = tf.compat.v1
    sizes = (64, 128) if quick else _SIZES
    out = {"cores": os.cpu_count() or 1, "tf": tf.__version__,
           "host": socket.gethostname(), "python": platform.python_version(),
           "version": CACHE_VERSION, "measured_at": time.time()}
    graph = tf.Graph()
    with graph.as_default():
        chain = 10
        mats = {}
        for n in sizes:
            x = v1.Variable(np.random.RandomState(0).rand(n, n).astype(np.float32) / n)
            y = x
            for _ in range(chain):
                y = v1.matmul(y, x)
            mats[n] = v1.reduce_sum(y)
        half = sizes[-2] if len(sizes) > 1 else sizes[0]
        halves = {}
        for name, dtype in (("fp16", tf.float16), ("bf16", tf.bfloat16)):
            x = v1.cast(v1.Variable(np.random.RandomState(0).rand(half, half).astype(
                np.float32) / half), dtype)
            y = x
            for _ in range(chain):
                y = v1.matmul(y, x)
            halves[name] = v1.reduce_sum(v1.cast(y, tf.float32))
        elems = (16 << 20) // 4 if not quick else (1 << 18)
        big = v1.Variable(np.ones(elems, np.float32))
        scaled = v1.reduce_sum(big * 1.0001 + 0.5)    # two element-wise passes + a read
        tiny = v1.Variable(np.ones((16, 16), np.float32)).read_value()
        z = tiny
        ops = 200
        for _ in range(ops):
            z = v1.nn.relu(z)      # (a chain grappler cannot fold)
        with _session(tf, graph, 1) as sess:
            sess.run(v1.global_variables_initializer())
            flops = {}
            for n in sizes:
                sec = _timed(sess, mats[n], repeats)
                flops[n] = 2.0 * n ** 3 * chain / sec
            out["matmul_flops_by_size"] = {str(k): v for k, v in flops.items()}
            for name, fetch in halves.items():      # AMP's products: CPU kernels differ
                out["matmul_flops_" + name] = 2.0 * half ** 3 * chain / _timed(
                    sess, fetch, repeats)
            out["matmul_flops"] = max(flops.values())
            # big * c writes n, + c reads n and writes n, reduce reads n: 5 passes of
            # 4 bytes (reading the variable is a copy-free view)
            sec = _timed(sess, scaled, repeats)
            out["memory_bandwidth"] = 5.0 * elems * 4 / sec
            base = _timed(sess, tiny, repeats * 4)
            sec = _timed(sess, z, repeats * 4)
            out["op_overhead_s"] = max(0.0, (sec - base) / ops)
            out["run_overhead_s"] = base
    out.update(_allreduce(tf, repeats, quick))
    return out


def _allreduce(tf, repeats, quick):
    """EPL's all-reduce between 2 virtual devices of one process: a latency and a
    bandwidth from a small and a large tensor (bus bytes 2(n-1)/n x size)."""
    import numpy as np
    v1 = tf.compat.v1
    sizes = (1 << 14, 1 << 20) if quick else (1 << 16, 8 << 20)
    times = {}
    graph = tf.Graph()
    with graph.as_default():
        devices = ["/device:CPU:0", "/device:CPU:1"]
        comm = communicators.create(devices, name="epl_calibrate")
        fetches = {}
        for size in sizes:
            ins = []
            for d in devices:
                with v1.device(d):
                    ins.append(v1.Variable(np.ones(size // 4, np.float32)) * 1.0)
            outs = comm.all_reduce(ins)
            fetches[size] = [v1.reduce_sum(o) for o in outs]
        with _session(tf, graph, 2) as sess:
            sess.run(v1.global_variables_initializer())
            for size in sizes:
                times[size] = _timed(sess, fetches[size], repeats)
    small, large = sizes
    bus = lambda s: 2.0 * (2 - 1) / 2 * s    # noqa: E731
    bandwidth = (bus(large) - bus(small)) / max(times[large] - times[small], 1e-9)
    latency = max(times[small] - bus(small) / bandwidth, 0.0) / (2 * (2 - 1))
    return {"allreduce_bandwidth": bandwidth, "allreduce_latency_s": latency,
            "allreduce_seconds": {str(k): v for k, v in times.items()}}


def calibration(recalibrate=False, path=None, quick=False):
    """The cached figures of this machine (measured on the first call, or when asked
    again: ``recalibrate`` / ``EPL_RECALIBRATE=1``)."""
    path = path or cache_path()
    if not recalibrate and os.environ.get("EPL_RECALIBRATE", "") not in ("1", "true"):
        try:
            with open(path) as f:
                got = json.load(f)
            if got.get("version") == CACHE_VERSION:
                return got
        except (IOError, OSError, ValueError):
            pass
    got = measure(quick=quick)
    folder = os.path.dirname(path)
    if folder and not os.path.isdir(folder):
        os.makedirs(folder)
    tmp = path + ".%d.tmp" % os.getpid()
    with open(tmp, "w") as f:
        json.dump(got, f, indent=1, sort_keys=True)
    os.replace(tmp, path)
    return got


def cluster_dict(figures, devices, memory_bytes=None):
    """The ``Cluster.from_dict`` form of ``devices`` virtual devices from calibration
    figures.  The devices share the cores (TensorFlow's one intra-op pool): with all N
    busy at once (data parallelism, a full pipeline) each gets the total / N of FLOP/s
    and memory bandwidth, whether N is below the cores (each has cores / N of them) or
    above (they take turns); a device's memory is the host's / N."""
    share = float(max(1, devices))
    peak = dict.fromkeys(("fp32", "tf32"), figures["matmul_flops"] / share)
    for dtype in ("fp16", "bf16"):
        peak[dtype] = figures.get("matmul_flops_" + dtype, figures["matmul_flops"]) / share
    if memory_bytes is None:
        memory_bytes = _host_memory() // max(1, devices)
    link = dict(bandwidth=figures["allreduce_bandwidth"],
                latency=figures["allreduce_latency_s"])
    device = dict(name="local-cpu", peak=peak, memory=int(memory_bytes),
                  memory_bandwidth=figures["memory_bandwidth"] / share,
                  host_bandwidth=figures["memory_bandwidth"] / share,
                  efficiency=dict.fromkeys(peak, 1.0),
                  op_overhead=float(figures.get("op_overhead_s", 0.0)),
                  run_overhead=float(figures.get("run_overhead_s", 0.0)))
    return dict(name="local x %d virtual CPU devices" % devices, nodes=1,
                devices_per_node=int(devices), device=device,
                intra=dict(link, kind="shm-inprocess"),
                inter=dict(link, kind="tcp-loopback", nics_per_node=1),
                accumulate_in_place=False, fusion_buffer=False, stage_cut="epl",
                shared_cores=True)


def _host_memory():
    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError, AttributeError):
        return 16 << 30
