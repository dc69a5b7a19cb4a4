"""Reading a folder of EPL traces (``profile.dir``): where each device's step time went.

For every traced run (step) the workers' traces are put on one clock, and every device
lane's window (the step, from the first op any device ran to the last one's end) is cut
into:

* compute: the union of the device's ops that are not communication;
* communication: bytes moving (an EPL collective's ``move`` part, TensorFlow's
  send/receive and collective ops), split into the part hidden behind compute on the
  same device and the exposed rest;
* waiting: an EPL collective waiting for its peers, where nothing else runs;
* idle: the rest of the window.

compute + exposed communication + exposed waiting + idle = the window.  A pipeline's
bubble is measured from the ``EPL stages`` spans: for each pipeline replica, 1 - (mean
over its stages of the time the stage runs a micro-batch's forward or backward) / (the
time from the first stage's first forward to the last backward's end), next to the
theory (p-1)/(m+p-1).

Clocks: the workers of one host share the wall clock.  Workers on other hosts are
shifted by an estimate of their offset to worker 0: the median, over the cross-worker
collective runs they share, of the difference of the moments the run found all its
peers (those moments are one message apart on every rank).  It is good to about a
message latency (tens of microseconds on a LAN), not to the microsecond.

Pure Python (no TensorFlow): ``python -m epl.profile DIR`` runs it anywhere.
"""
import collections
import glob
import json
import os
import re

COMM_TYPES = frozenset(["_Send", "_Recv", "_HostSend", "_HostRecv", "CollectiveReduce",
                        "CollectiveReduceV2", "CollectiveGather", "CollectiveGatherV2",
                        "CollectiveBcastSend", "CollectiveBcastRecv", "CollectiveBcastSendV2",
                        "CollectiveBcastRecvV2", "NcclAllReduce", "NcclBroadcast",
                        "NcclReduce"])


# -- intervals (sorted, disjoint lists of (start, end)) --------------------------------

def union(spans):
    out = []
    for a, b in sorted(s for s in spans if s[1] > s[0]):
        if out and a <= out[-1][1]:
            if b > out[-1][1]:
                out[-1] = (out[-1][0], b)
        else:
            out.append((a, b))
    return out


def length(u):
    return sum(b - a for a, b in u)


def intersect(u, v):
    out, i, j = [], 0, 0
    while i < len(u) and j < len(v):
        a, b = max(u[i][0], v[j][0]), min(u[i][1], v[j][1])
        if a < b:
            out.append((a, b))
        if u[i][1] < v[j][1]:
            i += 1
        else:
            j += 1
    return out


def subtract(u, v):
    """u minus v."""
    out = []
    for a, b in u:
        cur = a
        for c, d in v:
            if d <= cur or c >= b:
                continue
            if c > cur:
                out.append((cur, c))
            cur = max(cur, d)
        if cur < b:
            out.append((cur, b))
    return out


# -- loading -------------------------------------------------------------------------

_NAME = re.compile(r"worker(\d+)(_graph\d+)?_step(\d+)\.trace\.json$")


class Trace(object):
    """One worker's trace of one run."""

    def __init__(self, path):
        with open(path) as f:
            doc = json.load(f)
        self.path = path
        self.meta = doc.get("otherData", {})
        self.worker = int(self.meta.get("worker", 0))
        self.step = int(self.meta.get("step", 0))
        self.graph = int(self.meta.get("graph", 1))
        self.host = self.meta.get("host", "")
        names = {}
        for e in doc["traceEvents"]:
            if e.get("ph") == "M" and e.get("name") == "process_name":
                names[e["pid"]] = e["args"]["name"]
        self.lanes = collections.OrderedDict()   # lane name -> {"ops", "collectives", "stages"}
        for pid in sorted(names):
            self.lanes[names[pid]] = dict(ops=[], collectives=[], stages=[])
        for e in doc["traceEvents"]:
            if e.get("ph") != "X" or e.get("pid") not in names:
                continue
            lane = self.lanes[names[e["pid"]]]
            cat = e.get("cat")
            if cat == "op":
                lane["ops"].append(e)
            elif cat == "epl.collective" and "op" in e.get("args", {}):
                lane["collectives"].append(e)
            elif cat == "epl.stage":
                lane["stages"].append(e)

    def shift(self, us):
        for lane in self.lanes.values():
            for kind in lane.values():
                for e in kind:
                    e["ts"] -= us


def load(folder):
    """{(graph, step): [Trace per worker]} of the traces in ``folder``, on one clock
    (graph 1 is the first graph a process traced, see ``record``)."""
    steps = collections.defaultdict(list)
    for path in sorted(glob.glob(os.path.join(folder, "worker*_step*.trace.json"))):
        if _NAME.search(os.path.basename(path)):
            t = Trace(path)
            steps[(t.graph, t.step)].append(t)
    if not steps:
        raise ValueError("no EPL traces (worker<k>_step<n>.trace.json) in %r: set "
                         "profile.dir and profile.steps for the run (docs/profiling.md)"
                         % folder)
    for traces in steps.values():
        traces.sort(key=lambda t: t.worker)
        align(traces)
    return dict(steps)


def clock_offsets(traces):
    """{worker: estimated offset of its clock to the first worker's, in microseconds}
    from the cross-worker collective runs the traces share (0 without any)."""
    ready = collections.defaultdict(dict)   # group -> worker -> ready time
    for t in traces:
        for lane in t.lanes.values():
            for e in lane["collectives"]:
                a = e["args"]
                if a.get("transport") in ("shm", "tcp"):
                    ready[a["group"]][t.worker] = e["ts"] + a["wait_us"]
    base = traces[0].worker
    out = {}
    for t in traces:
        diffs = sorted(r[t.worker] - r[base] for r in ready.values()
                       if t.worker in r and base in r)
        out[t.worker] = diffs[len(diffs) // 2] if diffs else 0
    return out


def align(traces):
    """Shift the traces of workers on other hosts than the first worker's onto its clock
    (workers of one host share the clock: left as they are)."""
    offsets = clock_offsets(traces)
    for t in traces:
        t.offset_us = offsets.get(t.worker, 0)
        if t.host != traces[0].host and t.offset_us:
            t.shift(t.offset_us)
    return offsets


# -- the breakdown -------------------------------------------------------------------

Lane = collections.namedtuple(
    "Lane", "name window_us compute_us comm_us hidden_us exposed_us wait_us idle_us "
            "collective_bytes collectives spans")


def short_device(lane_name):
    """A lane's name: 'worker <k> device:CPU:1' (as the trace names it)."""
    return lane_name


def lane_intervals(lane):
    """(compute, comm, wait) unions of one lane."""
    recorded = {}
    for e in lane["collectives"]:
        recorded[e["args"]["node"]] = e
    compute, comm, wait = [], [], []
    for e in lane["ops"]:
        span = (e["ts"], e["ts"] + e["dur"])
        node = e["args"].get("name", "")
        if node in recorded:
            continue
        if e["name"] in COMM_TYPES or e["name"].startswith("Epl"):
            comm.append(span)
        else:
            compute.append(span)
    for e in recorded.values():
        ready = e["ts"] + e["args"]["wait_us"]
        wait.append((e["ts"], ready))
        comm.append((ready, e["ts"] + e["dur"]))
    return union(compute), union(comm), union(wait)


def step_window(traces):
    lo, hi = None, None
    for t in traces:
        for lane in t.lanes.values():
            for e in lane["ops"]:
                a, b = e["ts"], e["ts"] + e["dur"]
                lo = a if lo is None else min(lo, a)
                hi = b if hi is None else max(hi, b)
    return (lo or 0, hi or 0)


def breakdown(traces):
    """[Lane] of one step (every worker's devices)."""
    window = step_window(traces)
    span = window[1] - window[0]
    out = []
    for t in traces:
        for name, lane in t.lanes.items():
            compute, comm, wait = lane_intervals(lane)
            hidden = intersect(comm, compute)
            exposed = subtract(comm, compute)
            wait_only = subtract(subtract(wait, compute), comm)
            busy = union(compute + comm + wait)
            out.append(Lane(short_device(name), span, length(compute), length(comm),
                            length(hidden), length(exposed), length(wait_only),
                            span - length(busy),
                            sum(e["args"]["bytes"] for e in lane["collectives"]),
                            len(lane["collectives"]), len(lane["stages"])))
    return out


Bubble = collections.namedtuple("Bubble", "worker replica stages micro_batches makespan_us "
                                          "busy_us bubble theory")


def _stage_work(trace):
    """{replica: {stage: [(start, end)]}}: when each pipeline stage's ops ran.  The ops
    themselves, not the stage lane's spans: those close gaps of up to 1% of the run
    between a task's ops for the eye, and a loaded machine's late wake-ups would count
    as work.  An EPL collective counts from when its peers were ready (its wait is the
    stage idle).  Traces written before ops named their task fall back to the spans."""
    per = collections.defaultdict(lambda: collections.defaultdict(list))
    for lane in trace.lanes.values():
        moved = {}
        for e in lane["collectives"]:
            a = e["args"]
            moved[a["node"]] = (e["ts"] + a.get("wait_us", 0), e["ts"] + e["dur"])
        for e in lane["ops"]:
            a = e["args"]
            if "stage" not in a or e["dur"] <= 0:
                continue
            span = moved.get(a.get("name"), (e["ts"], e["ts"] + e["dur"]))
            per[a["replica"]][a["stage"]].append(span)
    if per:
        return per
    for lane in trace.lanes.values():
        for e in lane["stages"]:
            a = e["args"]
            per[a["replica"]][a["stage"]].append((e["ts"], e["ts"] + e["dur"]))
    return per


def bubbles(traces):
    """[Bubble] per pipeline replica of one step (none without a pipeline)."""
    out = []
    for t in traces:
        p = int(t.meta.get("num_stages", 1))
        m = int(t.meta.get("num_micro_batch", 1))
        if p < 2:
            continue
        per = _stage_work(t)
        for replica, stages in sorted(per.items()):
            every = [s for spans in stages.values() for s in spans]
            makespan = max(b for _, b in every) - min(a for a, _ in every)
            busy = [length(union(spans)) for _, spans in sorted(stages.items())]
            mean = float(sum(busy)) / p
            out.append(Bubble(t.worker, replica, p, m, makespan, busy,
                              1.0 - mean / makespan if makespan else 0.0,
                              (p - 1.0) / (m + p - 1.0)))
    return out


def top_ops(traces, n=10):
    """[(op type, count, total us)] of the step's ops, most time first (EPL's
    collectives are not among them: their time is mostly waiting, reported apart)."""
    total = collections.Counter()
    count = collections.Counter()
    for t in traces:
        for lane in t.lanes.values():
            recorded = set(e["args"]["node"] for e in lane["collectives"])
            for e in lane["ops"]:
                if e["args"].get("name") in recorded:
                    continue
                total[e["name"]] += e["dur"]
                count[e["name"]] += 1
    return [(k, count[k], v) for k, v in total.most_common(n)]


def collectives(traces):
    """Every EPL collective run of one step: dicts of the trace's args plus the lane."""
    out = []
    for t in traces:
        for name, lane in t.lanes.items():
            for e in lane["collectives"]:
                out.append(dict(e["args"], lane=short_device(name), worker=t.worker,
                                ts=e["ts"], dur=e["dur"]))
    return out


def label(key):
    """'step 3', or 'graph 2 step 3' for a process's second traced graph."""
    graph, step = key
    return ("graph %d step %d" % key) if graph > 1 else "step %d" % step


# -- the printed report ------------------------------------------------------------------

def _ms(us):
    return "%.2f" % (us / 1000.0)


def _pct(part, whole):
    return "%.0f%%" % (100.0 * part / whole) if whole else "-"


def report(folder):
    """The report's text for every traced step in ``folder``."""
    steps = load(folder)
    lines = []
    for key, traces in sorted(steps.items()):
        lanes = breakdown(traces)
        window = lanes[0].window_us if lanes else 0
        lines.append("%s: %d worker(s), %s ms from the first op to the last"
                     % (label(key), len(traces), _ms(window)))
        offsets = {t.worker: t.offset_us for t in traces if t.host != traces[0].host}
        if offsets:
            lines.append("  clocks of workers on other hosts shifted by (us): %s"
                         % ", ".join("worker %d %+d" % kv for kv in sorted(offsets.items())))
        head = ("device", "compute", "comm", "hidden", "exposed", "wait", "idle",
                "bytes")
        rows = [head]
        for ln in lanes:
            rows.append((ln.name,
                         "%s (%s)" % (_ms(ln.compute_us), _pct(ln.compute_us, window)),
                         _ms(ln.comm_us), _ms(ln.hidden_us),
                         "%s (%s)" % (_ms(ln.exposed_us), _pct(ln.exposed_us, window)),
                         "%s (%s)" % (_ms(ln.wait_us), _pct(ln.wait_us, window)),
                         "%s (%s)" % (_ms(ln.idle_us), _pct(ln.idle_us, window)),
                         str(ln.collective_bytes)))
        lines.append("  times in ms; comm = bytes moving (hidden behind compute + exposed); "
                     "wait = for peers, exposed")
        widths = [max(len(r[i]) for r in rows) for i in range(len(head))]
        for r in rows:
            lines.append("  " + "  ".join(c.ljust(w) for c, w in zip(r, widths)))
        for b in bubbles(traces):
            lines.append("  pipeline replica %d (worker %d): %d stages x %d micro-batches, "
                         "bubble %.1f%% (theory (p-1)/(m+p-1) = %.1f%%), makespan %s ms"
                         % (b.replica, b.worker, b.stages, b.micro_batches, 100 * b.bubble,
                            100 * b.theory, _ms(b.makespan_us)))
        runs = collectives(traces)
        if runs:
            lines.append("  EPL collectives: %d runs, %d bytes, waiting %s ms, moving %s ms "
                         "(all devices)" % (len(runs), sum(r["bytes"] for r in runs),
                                            _ms(sum(r["wait_us"] for r in runs)),
                                            _ms(sum(r["move_us"] for r in runs))))
        lines.append("  top ops (all devices): " + "; ".join(
            "%s x%d %s ms" % (op, c, _ms(us)) for op, c, us in top_ops(traces)))
    return "\n".join(lines)
