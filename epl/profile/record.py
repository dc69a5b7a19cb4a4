"""Tracing the training steps ``profile.steps`` names (and the runs ``profile.runs``
names) into ``profile.dir`` (Chrome trace JSON).

``start`` is asked before every ``Session.run`` of a graph (``epl.runtime.integration``), and
every call of a callable made from options (tf.keras, ``watch_callable``).  It counts the
graph's runs (from 1, initialization runs included) and its *training steps*, as the
progress line does (``epl.runtime.progress``: a run whose fetches reach the gradients of the
program's loss; initializers, evaluations, checkpoint saves are not steps).  Step ``n``
is the run that takes ``global_step`` to ``n`` (the variable is read, one extra run of it,
at the first two training runs and around the steps asked for), or, without a
global_step that advances, the graph's ``n``-th training run.  So every worker's step 10
is the same step, whatever other runs (the chief's ``Saver.save``) it made.  For a run to
trace it returns the run options with a full trace (the user's own options and
RunMetadata kept: the user's RunMetadata is filled as usual) and turns on the C++
collectives' records.  ``finish`` writes ``worker<k>_step<n>.trace.json`` (a run
``profile.runs`` names that is not a named step: ``worker<k>_run<n>.trace.json``): a
process per device TensorFlow ran ops on, with three lanes:

* ``ops``: every node TensorFlow executed (name = op type, args.name = node);
* ``EPL collectives``: each collective run (op, group, bytes, peers, transport), split
  into ``wait`` (this rank waiting for its peers, and for earlier runs of its group) and
  ``move`` (the bytes moving), as measured inside the C++ op;
* ``EPL stages``: each pipeline stage's micro-batch forward / backward (``S1 F3``), or
  each replica's forward / backward, from the rewrite's own record of which op belongs
  to which clone, stage and phase (not from names).

The rewrite's passes go once per worker into ``worker<k>_rewrite.trace.json``.  Runs and
steps are counted per graph; the traces of the second graph a process traces into a
folder are ``worker<k>_graph2_step<n>...`` (an Estimator builds a graph per ``train``
call).  Times are microseconds of the wall clock (TensorFlow's step-stats clock): the
workers of one host share it; ``epl.profile.analysis`` estimates the offsets of workers
on other hosts from the collectives they ran together.

When the process exits, steps (or runs) that were asked for and never came are named in
a warning, next to the training steps that did run.

With ``profile.dir`` unset, ``start`` costs one config lookup per run.
"""
import atexit
import json
import logging
import os
import re
import socket
import time
import weakref

from epl import ir, rewrite
from epl.runtime import progress
from epl.core.config import parse_steps
from epl.core.process_state import Env
from epl.profile import collectives
from epl.tf_adapter import patching
from epl.tf_adapter import trace as tftrace

log = logging.getLogger("epl")
FORMAT = "epl-trace-1"
_runs = weakref.WeakKeyDictionary()      # tf.Graph -> its _GraphRuns
_every_count = []                         # every _GraphRuns of the process (for the end)
_asked = {}                               # key -> (value, numbers) asked for (for the end)
_tasks = weakref.WeakKeyDictionary()     # tf.Graph -> (last op id, {node: task})
_graph_ids = weakref.WeakKeyDictionary()  # tf.Graph -> (profile.dir, its number there)
_graphs_in = {}                           # profile.dir -> graphs traced into it


def _steps(text, cache={}):   # pylint: disable=dangerous-default-value
    """profile.steps / profile.runs as a set (parsed once per value: a run asks every
    time); '' is the empty set."""
    steps = cache.get(text)
    if steps is None:
        steps = cache[text] = frozenset(parse_steps(text) if text.strip() else ())
    return steps


def _read(session, tensor):
    """The value of ``tensor`` (global_step) now, or None (not initialized yet, a closed
    session): one run of it, outside EPL's hooks (not a run of the program)."""
    if session is None or tensor is None:
        return None
    try:
        return int(patching.original("session.run")(session, tensor))
    except Exception:   # pylint: disable=broad-except
        return None


class _GraphRuns(object):
    """A graph's runs and training steps so far, and how global_step moves with them."""

    def __init__(self):
        self.runs = 0             # every run
        self.training_runs = 0    # the runs that train (epl.runtime.progress's definition)
        self.anchor = None        # (training runs before a read, global_step it read)
        self.rate = None          # global_step per training run (0: it does not advance)
        self.first = None         # the first and last training step seen
        self.last = None
        self.traced = set()       # the steps traced (a step is traced once)
        self.traced_runs = set()
        self.broken = False       # telling training runs failed once: not tried again

    def next_step(self, session, global_step, wanted):
        """The number of the training step about to run (the value global_step will
        have after it; the count of training runs where there is no global_step that
        advances).  global_step is read at the first two training runs (where it is and
        how it moves) and again where the step predicted is next to one ``wanted``."""
        self.training_runs += 1
        done = self.training_runs - 1
        if global_step is None or session is None or self.rate == 0:
            return self.training_runs
        if self.anchor is None or self.rate is None:
            g = _read(session, global_step)
            if g is None:
                return self.training_runs
            if self.anchor is not None and done > self.anchor[0]:
                self.rate = (g - self.anchor[1]) / float(done - self.anchor[0])
                if self.rate == 0:
                    return self.training_runs
            self.anchor = (done, g)
            return int(round(g + (self.rate or 1)))
        r0, g0 = self.anchor
        predicted = int(round(g0 + self.rate * (done - r0 + 1)))
        if any(n in wanted for n in (predicted - 1, predicted, predicted + 1)):
            g = _read(session, global_step)    # (confirm: a restore, a user's assign)
            if g is not None:
                self.anchor = (done, g)
                predicted = int(round(g + self.rate))
        return predicted

    def saw(self, step):
        self.first = step if self.first is None else min(self.first, step)
        self.last = step if self.last is None else max(self.last, step)


class Traced(object):
    """One run being traced."""

    def __init__(self, graph, step, options, metadata, run=None, training_run=None,
                 session=None, global_step=None):
        self.graph = graph
        self.step = step                  # the training step, or None (a run profile.runs names)
        self.run = run                    # the graph's run number
        self.training_run = training_run  # the graph's training runs with this one, or None
        self.session = session
        self.global_step = global_step    # the graph's global_step tensor, or None
        self.options = options
        self.metadata = metadata
        self.start = time.time()


def _classify(graph, fetches):
    """(is a training run, the graph's global_step tensor or None) of a run fetching
    ``fetches`` (epl.runtime.progress's definition of a training step)."""
    facts = progress.tracker().graph_facts(graph)
    if facts is None:
        return False, None
    return facts.kind(fetches)[0], facts.global_step


def start(graph, options, run_metadata, session=None, fetches=None):
    """A ``Traced`` when this run of ``graph`` (by ``session``, fetching ``fetches``) is
    one to trace, else None."""
    if not Env.initialized():
        return None
    config = Env.get().config
    if not config.get("profile.dir"):
        return None
    counts = _runs.get(graph)
    if counts is None:
        counts = _runs[graph] = _GraphRuns()
        _every_count.append(counts)
        if len(_every_count) == 1:
            atexit.register(report_untraced)
    steps_text, runs_text = config.get("profile.steps"), config.get("profile.runs")
    steps, runs = _steps(steps_text), _steps(runs_text)
    _asked["profile.steps"] = (steps_text, steps)
    _asked["profile.runs"] = (runs_text, runs)
    counts.runs += 1
    step = training_run = global_step = None
    if fetches is not None and not counts.broken:
        try:
            training, global_step = _classify(graph, fetches)
            if training:
                step = counts.next_step(session, global_step, steps)
                training_run = counts.training_runs
                counts.saw(step)
        except Exception as e:   # pylint: disable=broad-except
            # (the profiler must never fail the program's run)
            counts.broken = True
            log.warning("EPL: profile could not tell whether a run of this graph trains "
                        "(%s: %s): its training steps are not traced (profile.runs still "
                        "applies).", type(e).__name__, e)
            step = None
    if step is not None and step in steps and step not in counts.traced:
        counts.traced.add(step)
    elif counts.runs in runs:
        counts.traced_runs.add(counts.runs)
        step = None
    else:
        return None
    metadata = run_metadata if run_metadata is not None else tftrace.new_run_metadata()
    collectives.take()   # (records of an earlier, failed traced run)
    collectives.enable(True)
    return Traced(graph, step, tftrace.full_trace_options(options), metadata,
                  run=counts.runs, training_run=training_run, session=session,
                  global_step=global_step if step is not None else None)


def _ranges(numbers):
    """'1-3, 7' of a sorted list of numbers."""
    out, numbers = [], sorted(numbers)
    for n in numbers:
        if out and n == out[-1][1] + 1:
            out[-1][1] = n
        else:
            out.append([n, n])
    return ", ".join("%d" % a if a == b else "%d-%d" % (a, b) for a, b in out)


def untraced():
    """[(key, its value, what never came, what ran)] for the steps and runs asked for that
    no graph of this process traced."""
    out = []
    if "profile.steps" in _asked:
        text, steps = _asked["profile.steps"]
        done = set().union(*[c.traced for c in _every_count])
        missing = sorted(set(steps) - done)
        if missing:
            ran = [(c.first, c.last) for c in _every_count if c.first is not None]
            out.append(("profile.steps", text, missing,
                        ", ".join("%d-%d" % r if r[0] != r[1] else "%d" % r[0] for r in ran)
                        or "none"))
    if "profile.runs" in _asked:
        text, runs = _asked["profile.runs"]
        done = set().union(*[c.traced_runs for c in _every_count])
        missing = sorted(set(runs) - done)
        if missing:
            out.append(("profile.runs", text, missing,
                        ", ".join("1-%d" % c.runs for c in _every_count if c.runs) or "none"))
    return out


def report_untraced():
    """At exit: a warning for the steps (runs) asked for that never came."""
    for key, text, missing, ran in untraced():
        what = "training steps" if key == "profile.steps" else "runs"
        log.warning(
            "EPL: %s = %r: %s %s never came, so nothing was traced for them (%s that "
            "ran: %s%s). Name %s this job reaches%s; see docs/profiling.md.",
            key, text, what, _ranges(missing), what, ran,
            " per graph" if len(_every_count) > 1 else "", what,
            " (runs that do not train, such as initialization: profile.runs)"
            if key == "profile.steps" else "")


def watch_callable(graph, callable_options, make, session=None):
    """A callable of ``callable_options`` (how tf.keras runs its train, test and predict
    functions; ``make(options)`` makes one) whose calls count as runs of ``graph``: the
    calls profile.steps (profile.runs) names run through a second callable made with a
    full trace.  Without profile.dir when it is made, the plain callable itself."""
    fn = make(callable_options)
    if not Env.initialized() or not Env.get().config.get("profile.dir"):
        return fn
    traced_fn = []
    names = list(callable_options.fetch) + list(callable_options.target)

    def call(*args, **kwargs):
        traced = start(graph, callable_options.run_options, kwargs.get("run_metadata"),
                       session, names)
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
    if traced.global_step is not None:   # (what the run took global_step to)
        doc["otherData"]["global_step"] = _read(traced.session, traced.global_step)
    if traced.step is not None:
        name = "%s_step%d.trace.json" % (prefix, traced.step)
    else:
        name = "%s_run%d.trace.json" % (prefix, traced.run)
    path = os.path.join(folder, name)
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
    tasks = task_map(traced.graph)
    for n in nodes:
        where.setdefault(n.name, n.device)
        args = dict(name=n.name, op=n.op)
        task = tasks.get(n.name)
        if task is not None:   # the op's pipeline task: what a stage's busy time is made of
            args.update(zip(("replica", "stage", "micro_batch", "phase"), task))
        events.append(dict(ph="X", cat="op", name=n.op, pid=pid[n.device], tid=1,
                           ts=n.start_us, dur=max(n.end_us - n.start_us, 0), args=args))
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
    meta = dict(format=FORMAT, worker=worker, step=traced.step, run=traced.run,
                training=traced.training_run is not None, training_run=traced.training_run,
                global_step=None, host=socket.gethostname(),
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
