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
* ``thin_products``: {16, 64, 256: the share of that peak a product gets whose
  smallest dimension is that size (the others 1024; the mean of the three places it
  can be)}: a model's products are thin (a batch of 64 rows, a 64-row weight
  gradient), measured 0.4-0.8 of the peak here;
* ``op_overhead_s``: seconds TensorFlow's executor spends per op (a chain of tiny ops),
  and ``run_overhead_s``: a ``Session.run`` of one op: the floor of a CPU step that
  FLOPs and bytes do not see;
* ``cache_bytes``: the last-level cache's bytes (``cold_reads.cache_bytes``; None where
  Linux does not show it): the kind of machine, which decides how the replay prices a
  kernel's wake-up (``Cluster.from_local``, ``machines.wake_up_for``);
* ``allreduce``: bandwidth and latency of EPL's all-reduce between 2 virtual devices
  (``epl.communicators.create``: the in-process shared-memory kernel), from 64 KiB and
  8 MiB tensors, each a timed ``Session.run`` (``Cluster.from_local`` takes the run's
  overhead off: ``inprocess_link``).

Measured when first asked for (``cross_process``; ``Cluster.local(devices, processes=P)``),
and kept in the same cache under keys of their own (``xproc_shm``, ``xproc_tcp``), so a
cache without them still loads:

* ``xproc_shm``: EPL's all-reduce between 2 worker processes of this machine, the path a
  multi-worker job's gradients take here (``HierarchicalCommunicator``'s cross-worker
  step: the C++ ``EplAllReduce`` over the ``shm`` transport), bandwidth and latency from
  64 KiB and 8 MiB tensors, each rank in a process of its own; and ``beside``: the
  bandwidth of the same all-reduce run beside a product chain in every rank (the
  transport's work takes the cores from the compute:
  ``epl.auto.cross_process_rank.beside_compute``);
* ``xproc_tcp``: the same over EPL's TCP ring (``tcp`` transport, between 127.0.0.2 and
  127.0.0.3): the path between hosts (here, network-namespace hosts).

A cache whose cross-process figures lack ``beside`` measures them again when asked.
"""
import json
import os
import platform
import socket
import subprocess
import sys
import tempfile
import time
import uuid

from epl import communicators
from epl.auto import cold_reads
from epl.core import host_heap

CACHE_VERSION = 2          # 2: thin_products
_SIZES = (256, 512, 1024)
_THIN = (16, 64, 256)
TRANSPORTS = ("shm", "tcp")
# EPL's cross-process all-reduce (csrc/crossproc.cc) first exchanges each rank's element
# count around the ring (size - 1 steps), then reduce-scatters and all-gathers (2 (size - 1)
# steps): 3 (size - 1) one-way trips against the 2 (size - 1) ring steps the predictor
# prices, so an added one-way latency L costs 1.5 L per priced ring step.
LATENCY_TRIPS_PER_RING_STEP = 1.5


def cache_path():
    import tensorflow as tf
    folder = os.environ.get("EPL_CACHE_DIR") or os.path.join(
        os.path.expanduser("~"), ".cache", "epl")
    return os.path.join(folder, "local-%s-tf%s.json" % (socket.gethostname(),
                                                        tf.__version__))


def timed_runs(sess, fetch, repeats):
    """The seconds of ``repeats`` runs of ``fetch`` after a warm-up, sorted."""
    sess.run(fetch)                      # warm-up
    out = []
    for _ in range(repeats):
        start = time.perf_counter()
        sess.run(fetch)
        out.append(time.perf_counter() - start)
    return sorted(out)


def fastest_run(sess, fetch, repeats):
    """The fastest of ``repeats`` runs after a warm-up: other work on shared cores only
    ever slows a run down, so the fastest is the machine's own figure (a median moved
    2-3x between calibrations here)."""
    return timed_runs(sess, fetch, repeats)[0]


def cpu_session(tf, graph, devices):
    cfg = tf.compat.v1.ConfigProto(device_count={"CPU": devices})
    return tf.compat.v1.Session(graph=graph, config=cfg)


def measure(repeats=5, quick=False):
    """The calibration run: a dict of the figures above (seconds of work: ~5-15 s on
    2 busy cores; ``quick``: tiny sizes, for tests)."""
    host_heap.keep_freed_memory()       # as epl.init leaves the heap
    import numpy as np
    import tensorflow as tf
    v1 = tf.compat.v1
    sizes = (64, 128) if quick else _SIZES
    out = {"cores": os.cpu_count() or 1, "tf": tf.__version__,
           "host": socket.gethostname(), "python": platform.python_version(),
           "version": CACHE_VERSION, "measured_at": time.time(),
           "cache_bytes": cold_reads.cache_bytes()}
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
        # thin products: one dimension small (a batch of rows, a narrow layer), the
        # others the largest size, in each of the three places
        big_n = sizes[-1]
        thin = {}
        for small in ((16,) if quick else _THIN):
            fetches = []
            for shape in ((small, big_n, big_n), (big_n, small, big_n),
                          (big_n, big_n, small)):
                m, k, n = shape
                a = v1.Variable(np.random.RandomState(1).rand(m, k).astype(np.float32))
                b = v1.Variable(np.random.RandomState(2).rand(k, n).astype(np.float32))
                fetches.append(v1.reduce_sum(v1.matmul(a, b)))
            thin[small] = fetches
        elems = (16 << 20) // 4 if not quick else (1 << 18)
        big = v1.Variable(np.ones(elems, np.float32))
        scaled = v1.reduce_sum(big * 1.0001 + 0.5)    # two element-wise passes + a read
        tiny = v1.Variable(np.ones((16, 16), np.float32)).read_value()
        z = tiny
        ops = 200
        for _ in range(ops):
            z = v1.nn.relu(z)      # (a chain grappler cannot fold)
        # kernels the executor hands to its thread pool (products, convolutions, most
        # of a model's ops) cost more per op than the inlined cheap ones above
        w = v1.Variable(np.eye(16, dtype=np.float32))
        pooled = tiny
        for _ in range(ops):
            pooled = v1.matmul(pooled, w)
        with cpu_session(tf, graph, 1) as sess:
            sess.run(v1.global_variables_initializer())
            flops = {}
            for n in sizes:
                sec = fastest_run(sess, mats[n], repeats)
                flops[n] = 2.0 * n ** 3 * chain / sec
            out["matmul_flops_by_size"] = {str(k): v for k, v in flops.items()}
            for name, fetch in halves.items():      # AMP's products: CPU kernels differ
                out["matmul_flops_" + name] = 2.0 * half ** 3 * chain / fastest_run(
                    sess, fetch, repeats)
            out["matmul_flops"] = max(flops.values())
            shares = {}
            for small, fetches in thin.items():
                rates = [2.0 * small * big_n * big_n / fastest_run(sess, f, repeats)
                         for f in fetches]
                shares[str(small)] = min(1.0, sum(rates) / len(rates) / out["matmul_flops"])
            out["thin_products"] = shares
            # big * c writes n, + c reads n and writes n, reduce reads n: 5 passes of
            # 4 bytes (reading the variable is a copy-free view)
            sec = fastest_run(sess, scaled, repeats)
            out["memory_bandwidth"] = 5.0 * elems * 4 / sec
            base = fastest_run(sess, tiny, repeats * 4)
            sec = fastest_run(sess, z, repeats * 4)
            out["op_overhead_s"] = max(0.0, (sec - base) / ops)
            sec = fastest_run(sess, pooled, repeats * 4)
            out["pooled_op_overhead_s"] = max(0.0, (sec - base) / ops)
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
        with cpu_session(tf, graph, 2) as sess:
            sess.run(v1.global_variables_initializer())
            for size in sizes:
                times[size] = fastest_run(sess, fetches[size], repeats)
    bandwidth, latency = _fit(times, 2)
    return {"allreduce_bandwidth": bandwidth, "allreduce_latency_s": latency,
            "allreduce_seconds": {str(k): v for k, v in times.items()}}


def inprocess_link(figures):
    """{bandwidth, latency per ring step} of EPL's all-reduce between the virtual devices
    of one process, from the calibration's timed runs less ``run_overhead_s``: each
    timed run paid a ``Session.run``, which a collective inside a step does not (the
    step pays it once: ``Device.run_overhead``).  Measured: 113 us for 64 KiB, of which
    55 us was the run; counting it in the latency priced the mini-BERT's DP 4 all-reduce
    at 0.96 ms, and its DP rows 12-18 % slow."""
    seconds = figures.get("allreduce_seconds")
    if not seconds or len(seconds) < 2:
        return dict(bandwidth=figures["allreduce_bandwidth"],
                    latency=figures["allreduce_latency_s"])
    run = float(figures.get("run_overhead_s", 0.0))
    bandwidth, latency = _fit(dict((int(k), max(0.0, v - run))
                                   for k, v in seconds.items()), 2)
    return dict(bandwidth=bandwidth, latency=latency)


def _fit(times, ranks):
    """(bandwidth, latency per ring step) of a ring all-reduce from the seconds of a
    small and a large tensor ({bytes: seconds}; bus bytes 2(n-1)/n x size)."""
    small, large = sorted(times)
    bus = lambda s: 2.0 * (ranks - 1) / ranks * s    # noqa: E731
    bandwidth = (bus(large) - bus(small)) / max(times[large] - times[small], 1e-9)
    latency = max(times[small] - bus(small) / bandwidth, 0.0) / (2 * (ranks - 1))
    return bandwidth, latency


def crowded_ranks(processes, cores):
    """How many ranks the cross-process figures of ``processes`` worker processes of
    this machine are measured with: 2 (a link between two, which a ring of more takes
    step by step), unless the processes outnumber the ``cores``: then a rank waits on
    peers the OS has not scheduled, which two ranks on two cores never do (measured on
    2 cores, shm: 3 ranks 1.5-1.7 GB/s alone and 1.2-1.3 beside compute, 2 ranks 11-17
    and 2.4; the MLP's DP over 3 worker processes spent 22 ms a step in its all-reduce,
    priced at 5-9 from the 2-rank figures), so they are measured with that many."""
    processes = int(processes or 1)
    return processes if processes > max(1, int(cores or 1)) else 2


def xproc_key(transport, ranks=2):
    """The calibration's key of the cross-process figures of ``transport`` measured
    with ``ranks`` ranks (``crowded_ranks``): ``xproc_shm``, ``xproc_tcp`` for 2."""
    return "xproc_%s%s" % (transport, "" if int(ranks) == 2 else "_ranks%d" % int(ranks))


def measure_cross_process(transport="shm", repeats=5, quick=False, timeout=180, ranks=2):
    """EPL's all-reduce between ``ranks`` processes of this machine over ``transport``
    ("shm": worker processes of one host; "tcp": EPL's TCP ring, as between hosts):
    {"bandwidth", "latency_s" (per ring step), "seconds" by bytes, "ranks", "beside"}.
    Fresh processes, a few seconds."""
    if transport not in TRANSPORTS:
        raise ValueError("epl.auto.local: transport %r; use one of %s" % (transport, TRANSPORTS))
    ranks = int(ranks)
    if ranks < 2:
        raise ValueError("epl.auto.local: a cross-process all-reduce needs >= 2 ranks, got %d"
                         % ranks)
    sizes = (1 << 14, 1 << 20) if quick else (1 << 16, 8 << 20)
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    job = uuid.uuid4().hex[:12]
    env = dict(os.environ, TF_CPP_MIN_LOG_LEVEL="2", EPL_RUN_ID=job,
               EPL_JOB_SECRET=uuid.uuid4().hex,
               PYTHONPATH=os.pathsep.join([root] + [p for p in os.environ.get(
                   "PYTHONPATH", "").split(os.pathsep) if p]))
    for key in ("EPL_JOB_ID", "EPL_COMM_TRANSPORT"):
        env.pop(key, None)
    if transport == "tcp":     # two "hosts" of the loopback range
        from epl.launch.ports import free_ports  # (only for the tcp transport)
        env["EPL_COMM_ADDRESSES"] = ",".join(
            "127.0.0.%d:%d" % (2 + r, p) for r, p in enumerate(free_ports(ranks)))
    folder = tempfile.mkdtemp(prefix="epl_xproc_")
    out = os.path.join(folder, "times.json")
    procs = []
    try:
        for r in range(ranks):
            log = open(os.path.join(folder, "rank%d.log" % r), "w+")
            procs.append((subprocess.Popen(
                [sys.executable, "-m", "epl.auto.cross_process_rank", "--rank", str(r),
                 "--ranks", str(ranks), "--transport", transport, "--job", job,
                 "--sizes", ",".join(map(str, sizes)), "--repeats", str(repeats),
                 "--out", out] + (["--quick"] if quick else []),
                stdout=log, stderr=subprocess.STDOUT, env=env), log))
        deadline = time.time() + timeout
        while any(p.poll() is None for p, _ in procs) and time.time() < deadline:
            if any(p.poll() not in (None, 0) for p, _ in procs):
                break
            time.sleep(0.05)
        codes = [p.poll() for p, _ in procs]
        if codes != [0] * ranks or not os.path.exists(out):
            logs = []
            for r, (_, log) in enumerate(procs):
                log.seek(0)
                logs.append("---- rank %d ----\n%s" % (r, log.read()[-2000:]))
            raise RuntimeError("epl.auto.local: the cross-process (%s) calibration failed "
                               "(exit codes %s, timeout %d s):\n%s"
                               % (transport, codes, timeout, "\n".join(logs)))
        with open(out) as f:
            got = json.load(f)
        times = {int(k): v for k, v in got["times"].items()}
    finally:
        for p, log in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
            log.close()
    bandwidth, latency = _fit(times, ranks)
    return {"bandwidth": bandwidth, "latency_s": latency, "ranks": ranks,
            "seconds": {str(k): v for k, v in times.items()}, "beside": got["beside"],
            "measured_at": time.time()}


def cross_process(figures, transport="shm", quick=False, ranks=2):
    """``figures`` with the cross-process figures of ``transport`` at ``ranks`` ranks
    (``xproc_key``; measured now if it lacks them): a new dict."""
    key = xproc_key(transport, ranks)
    out = dict(figures)
    if key not in out:
        out[key] = measure_cross_process(transport, quick=quick, ranks=ranks)
    return out


def calibration(recalibrate=False, path=None, quick=False, transports=(), processes=2):
    """The cached figures of this machine (measured on the first call, or when asked
    again: ``recalibrate`` / ``EPL_RECALIBRATE=1``).  ``transports``: also the
    cross-process figures of these for ``processes`` worker processes (``xproc_shm``,
    ``xproc_tcp``; ``xproc_key`` at ``crowded_ranks``), measured when the cache lacks
    them and added to it."""
    path = path or cache_path()
    got = None
    if not recalibrate and os.environ.get("EPL_RECALIBRATE", "") not in ("1", "true"):
        try:
            with open(path) as f:
                got = json.load(f)
            if got.get("version") != CACHE_VERSION:
                got = None
        except (IOError, OSError, ValueError):
            got = None
    changed = got is None
    if got is None:
        got = measure(quick=quick)
    ranks = crowded_ranks(processes, got.get("cores"))
    for transport in transports:
        key = xproc_key(transport, ranks)
        if "beside" not in got.get(key, {}):
            got = cross_process(dict((k, v) for k, v in got.items() if k != key), transport,
                                quick=quick, ranks=ranks)
            changed = True
    if changed:
        save_cache(got, path)
    return got


def save_cache(got, path):
    """Write a cache file whole (a temporary file renamed: readers never see half)."""
    folder = os.path.dirname(path)
    if folder and not os.path.isdir(folder):
        os.makedirs(folder)
    tmp = path + ".%d.tmp" % os.getpid()
    with open(tmp, "w") as f:
        json.dump(got, f, indent=1, sort_keys=True)
    os.replace(tmp, path)


def cluster_dict(figures, devices, memory_bytes=None, processes=1, latency_s=None,
                 transport=None):
    """The ``Cluster.from_dict`` form of ``devices`` virtual devices from calibration
    figures.  The devices share the cores (TensorFlow's one intra-op pool): with all N
    busy at once (data parallelism, a full pipeline) each gets the total / N of FLOP/s
    and memory bandwidth, whether N is below the cores (each has cores / N of them) or
    above (they take turns); a device's memory is the host's / N.

    ``processes`` P > 1: P worker processes of this machine with ``devices`` each (a
    multi-worker job here, or P network-namespace hosts): P nodes of ``devices``, all
    P x devices sharing the cores (N = P x devices above); the ``inter`` link is EPL's
    cross-process all-reduce as calibrated (``figures[xproc_key(transport, ranks)]``,
    ranks: ``crowded_ranks``; see ``cross_process``): ``transport`` "shm" (default;
    worker processes of one host) or
    "tcp" (default when ``latency_s`` is given: hosts).  ``latency_s``: a one-way latency
    added between the processes (namespace hosts with a delay), priced as
    ``LATENCY_TRIPS_PER_RING_STEP`` trips per ring step."""
    processes = int(processes or 1)
    if processes < 1:
        raise ValueError("epl.auto.local: processes must be >= 1, got %r" % processes)
    total = max(1, devices) * processes
    share = float(total)
    peak = dict.fromkeys(("fp32", "tf32"), figures["matmul_flops"] / share)
    for dtype in ("fp16", "bf16"):
        peak[dtype] = figures.get("matmul_flops_" + dtype, figures["matmul_flops"]) / share
    if memory_bytes is None:
        memory_bytes = _host_memory() // total
    link = inprocess_link(figures)
    inter = dict(link, kind="tcp-loopback", nics_per_node=1)
    if processes > 1 or latency_s:
        transport = transport or ("tcp" if latency_s else "shm")
        ranks = crowded_ranks(processes, figures.get("cores"))
        key = xproc_key(transport, ranks)
        if key not in figures:
            raise ValueError(
                "epl.auto.local: the calibration figures lack %r (EPL's all-reduce between "
                "%s processes over %s): get them with epl.auto.local.cross_process(figures, "
                "%r, ranks=%d) or Cluster.local(devices, processes=%d)"
                % (key, ranks, transport, transport, ranks, processes))
        xp = figures[key]
        inter = dict(bandwidth=xp["bandwidth"], nics_per_node=1,
                     latency=xp["latency_s"] + LATENCY_TRIPS_PER_RING_STEP * float(
                         latency_s or 0.0),
                     kind="epl-%s-crossprocess" % transport)
        if (xp.get("beside") or {}).get("bandwidth"):   # (older caches lack it)
            inter["beside_bandwidth"] = xp["beside"]["bandwidth"]
    device = dict(name="local-cpu", peak=peak, memory=int(memory_bytes),
                  memory_bandwidth=figures["memory_bandwidth"] / share,
                  host_bandwidth=figures["memory_bandwidth"] / share,
                  efficiency=dict.fromkeys(peak, 1.0),
                  op_overhead=float(figures.get("op_overhead_s", 0.0)),
                  run_overhead=float(figures.get("run_overhead_s", 0.0)),
                  thin_products=figures.get("thin_products"))
    if processes > 1:
        name = "local x %d processes x %d virtual CPU devices%s" % (
            processes, devices, " (+%g ms one way)" % (1e3 * latency_s) if latency_s else "")
    else:
        name = "local x %d virtual CPU devices" % devices
    return dict(name=name, nodes=processes,
                devices_per_node=int(devices), device=device,
                intra=dict(link, kind="shm-inprocess", algorithm="rendezvous"), inter=inter,
                accumulate_in_place=False, fusion_buffer=False, stage_cut="epl",
                shared_cores=True, shared_variables=True)


def _host_memory():
    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError, AttributeError):
        return 16 << 30


if __name__ == "__main__":
    print(json.dumps(calibration(transports=TRANSPORTS), indent=1, sort_keys=True))
