"""Tracing the runs ``profile.steps`` names into ``profile.dir`` (Chrome trace JSON).

``start`` is asked before every ``Session.run`` of a graph (``epl.integration``), and
every call of a callable made from options (tf.keras, ``watch_callable``); it
counts the graph's runs (from 1, initialization runs included) and, for a run to trace,
returns the run options with a full trace (the user's own options and RunMetadata kept:
the user's RunMetadata is filled as usual) and turns on the C++ collectives' records.
``finish`` writes ``worker<k>_step<n>.trace.json``: a process per device TensorFlow ran
ops on, with three lanes:

* ``ops``: every node TensorFlow executed (name = op type, args.name = node);
* ``EPL collectives``: each collective run (op, group, bytes, peers, transport), split
  into ``wait`` (this rank waiting for its peers, and for earlier runs of its group) and
  ``move`` (the bytes moving), as measured inside the C++ op;
* ``EPL stages``: each pipeline stage's micro-batch forward / backward (``S1 F3``), or
  each replica's forward / backward, from the rewrite's own record of which op belongs
  to which clone, stage and phase (not from names).

The rewrite's passes go once per worker into ``worker<k>_rewrite.trace.json``.  Runs
are counted per graph; the traces of the second graph a process traces into a folder are
``worker<k>_graph2_step<n>...`` (an Estimator builds a graph per ``train`` call).  Times are
microseconds of the wall clock (TensorFlow's step-stats clock): the workers of one host
share it; ``epl.profile.analysis`` estimates the offsets of workers on other hosts from
the collectives they ran together.

With ``profile.dir`` unset, ``start`` costs one config lookup per run.
"""
import json
import os
import re
import socket
import time
import weakref

from epl import ir, rewrite
from epl.config import parse_steps
from epl.env import Env
from epl.profile import collectives
from epl.tf_adapter import trace as tftrace

FORMAT = "epl-trace-1"
_runs = weakref.WeakKeyDictionary()      # tf.Graph -> its runs so far
_tasks = weakref.WeakKeyDictionary()     # tf.Graph -> (last op id, {node: task})
_graph_ids = weakref.WeakKeyDictionary()  # tf.Graph -> (profile.dir, its number there)
_graphs_in = {}                           # profile.dir -> graphs traced into it


def _steps(text, cache={}):   # pylint: disable=dangerous-default-value
    """profile.steps as a set (parsed once per value: a run asks every time)."""
    steps = cache.get(text)
    if steps is None:
        steps = cache[text] = frozenset(parse_steps(text))
    return steps


class Traced(object):
    """One run being traced."""

    def __init__(self, graph, step, options, metadata):
        self.graph = graph
        self.step = step
        self.options = options
        self.metadata = metadata
        self.start = time.time()


def start(graph, options, run_metadata):
    """A ``Traced`` when this run of ``graph`` is one to trace, else None."""
    if not Env.initialized():
        return None
    config = Env.get().config
    if not config.get("profile.dir"):
        return None
    n = _runs.get(graph, 0) + 1
    _runs[graph] = n
    if n not in _steps(config.get("profile.steps")):
        return None
    metadata = run_metadata if run_metadata is not None else tftrace.new_run_metadata()
    collectives.take()   # (records of an earlier, failed traced run)
    collectives.enable(True)
    return Traced(graph, n, tftrace.full_trace_options(options), metadata)


def watch_callable(graph, callable_options, make):
    """A callable of ``callable_options`` (how tf.keras runs its train, test and predict
    functions; ``make(options)`` makes one) whose calls count as runs of ``graph``: the
    calls profile.steps names run through a second callable made with a full trace.
    Without profile.dir when it is made, the plain callable itself."""
    fn = make(callable_options)
    if not Env.initialized() or not Env.get().config.get("profile.dir"):
        return fn
    traced_fn = []

    def call(*args, **kwargs):
        traced = start(graph, callable_options.run_options, kwargs.get("run_metadata"))
        if traced is None:
            return fn(*args, **kwargs)
        if not traced_fn:
            options = type(callable_options)()
            options.CopyFrom(callable_options)
            options.run_options.CopyFrom(traced.options)
            traced_fn.append(make(options))
        ok = False
        try:
            kwargs["run_metadata"] = traced.metadata
            out = traced_fn[0](*args, **kwargs)
            ok = True
            return out
        finally:
            finish(traced, ok)
    return call


def finish(traced, ok=True):
    """Stop recording; write the run's trace when it succeeded.  Returns the path."""
    if traced is None:
        return None
    collectives.enable(False)
    records = collectives.take()
    if not ok:
        return None
    env = Env.get()
    folder = env.config.get("profile.dir")
    os.makedirs(folder, exist_ok=True)
    worker = max(env.cluster.worker_index, 0)
    known = _graph_ids.get(traced.graph)
    first = known is None or known[0] != folder
    if first:
        _graphs_in[folder] = _graphs_in.get(folder, 0) + 1
        _graph_ids[traced.graph] = (folder, _graphs_in[folder])
    graph = _graph_ids[traced.graph][1]
    # The first graph this process traced into the folder: worker<k>_...; a later one (an
    # Estimator builds a graph per train call, counted from 1 again): worker<k>_graph<g>_...
    prefix = "worker%d" % worker + ("_graph%d" % graph if graph > 1 else "")
    doc = trace_document(traced, records, worker)
    doc["otherData"]["graph"] = graph
    path = os.path.join(folder, "%s_step%d.trace.json" % (prefix, traced.step))
    _write(path, doc)
    if first:
        _write(os.path.join(folder, "%s_rewrite.trace.json" % prefix), rewrite_document(worker))
    return path


def _write(path, doc):
    tmp = path + ".tmp"
    with open(tmp, "w") as f:
        json.dump(doc, f, separators=(",", ":"))
    os.replace(tmp, path)


def _layout(graph):
    result = ir.Graph.get(graph).rewrite_result
    state = result.state if result is not None else None
    return state


def task_map(graph):
    """{node name: (replica, stage, micro-batch, phase)} of the rewritten graph's forward
    and backward ops, every clone's copy included (kept until ops are added)."""
    state = _layout(graph)
    if state is None:
        return {}
    cached = _tasks.get(graph)
    if cached is not None and cached[0] == state.last_id:
        return cached[1]
    out = {}
    phases = (ir.FORWARD, ir.BACKWARD)
    for op in state.selection.ops:
        phase = state.ir_graph.phase_of(op)
        if phase not in phases:
            continue
        stage = state.stage_of(op)
        for c, (replica, micro, _) in enumerate(state.clones):
            name = state.op_name(c, op)
            if c != 0 and name == op.name:
                continue   # shared with clone 0, not copied
            out.setdefault(name, (replica, stage, micro, phase))
    _tasks[graph] = (state.last_id, out)
    return out


def task_spans(graph, nodes):
    """[((device, replica, stage, micro-batch, phase), (start, end))]: when each task
    (a stage's forward or backward of one micro-batch) ran on its device.  A task's ops
    do not all run together (its shape and constant ops run as soon as they can, often
    at the step's start), so a task is the union of its ops' times with gaps shorter than
    1% of the run closed, one span per piece, not the envelope from its first op to its
    last."""
    tasks = task_map(graph)
    by_task = {}
    for n in nodes:
        task = tasks.get(n.name)
        if task is not None:
            by_task.setdefault((n.device,) + task, []).append((n.start_us, n.end_us))
    if not nodes:
        return []
    gap = max(50, (max(n.end_us for n in nodes) - min(n.start_us for n in nodes)) // 100)
    out = []
    for key, spans in sorted(by_task.items()):
        pieces = []
        for a, b in sorted(spans):
            if pieces and a <= pieces[-1][1] + gap:
                pieces[-1][1] = max(pieces[-1][1], b)
            else:
                pieces.append([a, b])
        # A piece of zero-time ops alone (a shape read at the step's start) is no work.
        out.extend((key, (a, b)) for a, b in pieces if b > a)
    return out


def _short(device):
    """'/job:localhost/replica:0/task:0/device:CPU:1' -> 'device:CPU:1'; in-graph jobs
    (devices of several workers in one trace) keep their task."""
    if "/device:" not in device:
        return device
    task = re.search(r"/job:worker/replica:\d+/task:(\d+)", device)
    short = "device:" + device.split("/device:")[-1]
    return ("task:%s/%s" % (task.group(1), short)) if task else short


def trace_document(traced, records, worker):
    """The Chrome trace of one run (a dict for json.dump)."""
    state = _layout(traced.graph)
    op_types = {}
    nodes = tftrace.executed_nodes(traced.metadata)
    missing = set(n.name for n in nodes if n.op == n.name)
    if missing:
        for name in missing:
            try:
                op_types[name] = traced.graph.get_operation_by_name(name).type
            except (KeyError, ValueError):
                pass
        nodes = tftrace.executed_nodes(traced.metadata, op_types)
    devices = sorted(set(n.device for n in nodes))
    pid = {d: i + 1 for i, d in enumerate(devices)}
    events = []
    for d in devices:
        events.append(dict(ph="M", name="process_name", pid=pid[d],
                           args=dict(name="worker %d %s" % (worker, _short(d)))))
        events.append(dict(ph="M", name="process_sort_index", pid=pid[d],
                           args=dict(sort_index=pid[d])))
        for tid, lane in ((1, "ops"), (2, "EPL collectives"), (3, "EPL stages")):
            events.append(dict(ph="M", name="thread_name", pid=pid[d], tid=tid,
                               args=dict(name=lane)))
    where = {}
    for n in nodes:
        where.setdefault(n.name, n.device)
        events.append(dict(ph="X", cat="op", name=n.op, pid=pid[n.device], tid=1,
                           ts=n.start_us, dur=max(n.end_us - n.start_us, 0),
                           args=dict(name=n.name, op=n.op)))
    for r in records:
        device = where.get(r.node)
        if device is None:
            continue   # (a collective of another graph or session)
        common = dict(pid=pid[device], tid=2, cat="epl.collective")
        args = dict(node=r.node, op=r.what, group=r.group, transport=r.transport,
                    rank=r.rank, peers=r.size, bytes=r.bytes,
                    wait_us=r.ready_us - r.start_us, move_us=r.end_us - r.ready_us)
        events.append(dict(common, ph="X", name=r.what.split("(")[0], ts=r.start_us,
                           dur=r.end_us - r.start_us, args=args))
        events.append(dict(common, ph="X", name="wait", ts=r.start_us,
                           dur=r.ready_us - r.start_us, args=dict(node=r.node)))
        events.append(dict(common, ph="X", name="move", ts=r.ready_us,
                           dur=r.end_us - r.ready_us, args=dict(node=r.node, bytes=r.bytes)))
    stages = state.layout.num_stages if state is not None else 1
    micro = state.layout.num_micro_batch if state is not None else 1
    for (device, replica, stage, m, phase), (lo, hi) in task_spans(traced.graph, nodes):
        kind = "F" if phase == ir.FORWARD else "B"
        if stages > 1 or micro > 1:
            name = "S%d %s%d" % (stage, kind, m)
        else:
            name = "replica %d %s" % (replica, "forward" if kind == "F" else "backward")
        events.append(dict(ph="X", cat="epl.stage", name=name, pid=pid[device], tid=3,
                           ts=lo, dur=hi - lo,
                           args=dict(replica=replica, stage=stage, micro_batch=m,
                                     phase=phase)))
    meta = dict(format=FORMAT, worker=worker, step=traced.step, host=socket.gethostname(),
                process=os.getpid(), num_stages=stages, num_micro_batch=micro,
                run_start_us=int(traced.start * 1e6), run_end_us=int(time.time() * 1e6),
                devices=devices)
    return dict(traceEvents=events, displayTimeUnit="ms", otherData=meta)


def rewrite_document(worker):
    """The rewrite's passes (the graph's first rewrite) as a Chrome trace."""
    events = [dict(ph="M", name="process_name", pid=0,
                   args=dict(name="worker %d EPL rewrite" % worker))]
    for name, begin, end in getattr(rewrite.PASSES, "first_spans", ()):
        events.append(dict(ph="X", cat="epl.rewrite", name=name, pid=0, tid=1,
                           ts=int(begin * 1e6), dur=int((end - begin) * 1e6), args={}))
    return dict(traceEvents=events, displayTimeUnit="ms",
                otherData=dict(format=FORMAT, worker=worker, host=socket.gethostname(),
                               rewrite=True))
