"""Helpers shared by the benchmarks: timing, tables, JSON output."""
import json
import os
import socket
import time

RESULTS = os.path.join(os.path.dirname(os.path.abspath(__file__)), "results")


def median(xs):
    xs = sorted(xs)
    n = len(xs)
    return xs[n // 2] if n % 2 else 0.5 * (xs[n // 2 - 1] + xs[n // 2])


def time_calls(fn, repeats, warmup=2):
    for _ in range(warmup):
        fn()
    out = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        out.append(time.perf_counter() - t0)
    return out


def print_table(rows, columns, title=None):
    if title:
        print("\n" + title)
    widths = [max(len(c), *(len(_fmt(r.get(c))) for r in rows)) for c in columns]
    print("  ".join(c.ljust(w) for c, w in zip(columns, widths)))
    print("  ".join("-" * w for w in widths))
    for r in rows:
        print("  ".join(_fmt(r.get(c)).ljust(w) for c, w in zip(columns, widths)))


def _fmt(v):
    if isinstance(v, float):
        return "%.4g" % v
    return "" if v is None else str(v)


def write_json(name, records, path=None):
    path = path or os.path.join(RESULTS, name + ".json")
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    with open(path, "w") as f:
        json.dump(records, f, indent=1)
    print("wrote %s" % path)
    return path


def free_ports(k):
    """``k`` TCP ports free on 127.0.0.1 right now (bound together, so distinct)."""
    socks, ports = [], []
    for _ in range(k):
        s = socket.socket()
        s.bind(("127.0.0.1", 0))
        socks.append(s)
        ports.append(s.getsockname()[1])
    for s in socks:
        s.close()
    return ports


def fresh_kernel_timings(cached=False):
    """Point EPL's planner caches (the calibration, the kernels' timings) at a folder of
    this run unless ``cached``: the planner's accuracy benchmarks then time each model's
    kernels under the load of the moment, side by side with its runs, as they measure
    the calibration (a prediction and its measurement from one hour: the machine's
    steps here moved 10-15 % between hours, and kernels timed in a slower hour priced
    stop 47's faster one's rows slow; docs/plan.md, stop 49).  Returns the folder, or
    None where the cache is kept."""
    if cached:
        return None
    import tempfile
    os.environ["EPL_CACHE_DIR"] = tempfile.mkdtemp(prefix="epl-plan-cache-")
    return os.environ["EPL_CACHE_DIR"]


def tf1_graph_mode():
    """On TF 2.x, TF1 graph semantics (1.15's defaults, where the call only prints a
    notice): the dry runs' processes take this process's switches
    (``epl.auto.search.measure``), and EPL refuses eager execution."""
    import tensorflow as tf
    if tf.__version__.startswith("2."):
        tf.compat.v1.disable_v2_behavior()
