"""Live progress of a worker: its steps, speed, throughput and loss, for epl-launch and
TensorBoard.

After every session run of a rewritten graph EPL calls ``after_run``.  A run is a
*training step* when what it fetches reaches the gradients of a loss the program
minimizes (``tf.gradients`` / ``compute_gradients`` / ``minimize``, recorded at capture
time): an evaluation, a checkpoint save or an initializer is not a step.  Per step the
cost is a few attribute updates and a clock read; the rest happens in a *sample*, at
most every ``INTERVAL`` seconds (and after the first step):

* ``step``: the graph's ``global_step`` (read with one extra run of that variable per
  sample), else the count of training runs of this process;
* ``steps_per_sec`` over the time since the previous sample, ``mean_steps_per_sec``
  since the end of the first step (which holds TensorFlow's warm-up);
* ``samples_per_sec`` = ``steps_per_sec`` x the job's global batch: the rows one pull of
  the input gives (the input's static batch dimension, else the constant ``batch_size``
  of its ``tf.data`` pipeline, else the rows fed to a batch placeholder) x the pulls of a
  step on this worker (replicas x micro-batches) x the workers (between-graph);
* ``loss``: the value of the loss the program fetched in that run (replica 0's, or the
  merged one the program asked for through ``epl.GraphKeys``), when it fetched one;
* ``gradient_bytes_per_step``: the bytes of the gradients each rank reduces in a step
  (from the rewrite's reduction sites; float16 on the wire with
  ``communication.fp16``), and ``comm_bytes_per_step`` = that x 2(n-1)/n, what one rank
  sends in a ring all-reduce over the job's n ranks (0 on one rank).

Under epl-launch (``EPL_LAUNCH_DIR`` set) each sample is appended as a JSON line to
``worker_<i>.progress.jsonl`` in the launch's folder, and a last one (``"final": true``)
when the process exits; ``epl.launch.display`` in the launcher reads them.  On the
chief, when the program writes summaries (the first ``tf.summary.FileWriter`` it adds an
event to: MonitoredTrainingSession's ``checkpoint_dir`` / ``summary_dir``, an
Estimator's ``model_dir``, or the program's own writer), every sample also goes to that
writer as scalars under ``epl/`` at the step's number.  Neither: nothing is done.

Progress never fails a run: an error in its bookkeeping is logged once (a warning with
the error) and turns progress off for that session; the run returns as it would without
EPL's progress.
"""
import atexit
import json
import logging
import os
import threading
import time
import weakref

import numpy as np
import tensorflow as tf

from epl import ir
from epl.core.process_state import Env
from epl.core import worker_files
from epl.rewrite import fusion
from epl.tf_adapter import functions, patching

log = logging.getLogger("epl")

# Seconds between two samples of one worker (plus the first step and the last).
INTERVAL = 0.5
# TensorBoard tags.
TAGS = ("epl/step_time_s", "epl/steps_per_sec", "epl/samples_per_sec",
        "epl/gradient_bytes_per_step", "epl/comm_bytes_per_step")

# Dataset ops whose batch_size input fixes the rows of an element, and that input's index
# (None: after the op's captured function arguments).
_BATCH_DATASETS = {"BatchDataset": 1, "BatchDatasetV2": 1, "PaddedBatchDataset": 1,
                   "PaddedBatchDatasetV2": 1, "ParallelBatchDataset": 1,
                   "MapAndBatchDataset": None, "ExperimentalMapAndBatchDataset": None}
# Dataset ops after a batch that change how many rows an element has.
_REBATCHING = frozenset(["UnbatchDataset", "ExperimentalUnbatchDataset", "RebatchDataset",
                         "RebatchDatasetV2", "WindowDataset", "FlatMapDataset",
                         "InterleaveDataset", "ParallelInterleaveDataset",
                         "ParallelInterleaveDatasetV2", "ParallelInterleaveDatasetV3",
                         "ParallelInterleaveDatasetV4", "LegacyParallelInterleaveDatasetV2",
                         "ExperimentalParallelInterleaveDataset", "GroupByWindowDataset",
                         "ExperimentalGroupByWindowDataset", "GroupByReducerDataset",
                         "ExperimentalGroupByReducerDataset", "DirectedInterleaveDataset"])


class _GraphFacts(object):
    """What one rewrite of a graph tells about its steps (found once per rewrite)."""

    def __init__(self, graph, result):
        self.result = result
        state = result.state
        self.graph = graph
        self.active = state is not None
        self.kinds = {}          # fetch signature -> (is a training step, path to the loss)
        self.fast = {}           # ids of fetched elements -> (kinds' entry, the elements)
        # What tells a training step (also without EPL strategies: the profiler counts
        # the steps of such a graph too).
        epl_graph = ir.Graph.get(graph)
        self.loss_names = set(y.name for rec in epl_graph.gradient_records for y in rec.ys)
        self.step_ops = set()
        for rec in epl_graph.gradient_records:
            for t in rec.tensors():
                self.step_ops.add(t.op.name)
        for rec in epl_graph.apply_records:
            if rec.result is not None:
                self.step_ops.add(rec.result.name)
        self.global_step = tf.compat.v1.train.get_global_step(graph)
        if not self.active:
            return
        cluster = state.cluster
        self.workers = 1 if state.in_graph else max(1, cluster.worker_num)
        self.pulls = max(1, len(state.pull_groups))
        self.rows = None
        for src in state.selection.sources:
            self.rows = source_rows(src)
            if self.rows is not None:
                break
        self.placeholders = [] if state.selection.sources else list(state.selection.placeholders)
        self.gradient_bytes, ranks = gradient_bytes(state)
        self.comm_bytes = (self.gradient_bytes * 2.0 * (ranks - 1) / ranks) if ranks > 1 else 0.0

    def kind(self, fetches):
        """(is a training step, the path to the fetched loss or None) of what a run
        fetches.  The usual fetches, a list of tensors and ops, are known by the ids of
        their elements: the entry keeps them alive, so an id cannot name another object."""
        flat = isinstance(fetches, (list, tuple)) and not hasattr(fetches, "indices")
        fast = (type(fetches), tuple(map(id, fetches))) if flat else id(fetches)
        found = self.fast.get(fast)
        if found is not None:
            return found[0]
        leaves = _leaves(fetches, (), [])
        key = _key(leaves)
        found = self.kinds.get(key)
        if found is None:
            paths = [(p, _name(x)) for p, x in leaves]
            loss = next((p for p, name in paths if name in self.loss_names), None)
            found = (self._reaches_gradients([name for _, name in paths]), loss)
            self.kinds[key] = found
        if len(self.fast) < 1000 and all(
                isinstance(x, _GRAPH_ELEMENTS + (str,)) and len(p) == (1 if flat else 0)
                for p, x in leaves):
            self.fast[fast] = (found, list(fetches) if flat else fetches)
        return found

    def _reaches_gradients(self, names):
        """Some fetch depends on a gradient or an apply_gradients result (searched
        backwards over data and control edges, stopping at the first found)."""
        if not self.step_ops:
            return False
        stack, seen = [], set()
        for name in names:
            try:
                element = self.graph.as_graph_element(name)
            except (KeyError, ValueError, TypeError):
                continue
            stack.append(element if isinstance(element, tf.Operation) else element.op)
        while stack:
            op = stack.pop()
            if op.name in seen:
                continue
            seen.add(op.name)
            if op.name in self.step_ops:
                return True
            stack.extend(t.op for t in op.inputs)
            stack.extend(op.control_inputs)
        return False

    def global_batch(self, feed_dict):
        """Rows of the job's step, or None where they cannot be told."""
        if self.rows is not None:
            return self.rows * self.pulls * self.workers
        if self.placeholders and feed_dict:
            wanted = set(ph.outputs[0].name for ph in self.placeholders)
            for key, value in feed_dict.items():
                name = getattr(key, "name", key)
                if isinstance(name, str) and (name in wanted or name + ":0" in wanted):
                    shape = np.shape(value)
                    if shape:
                        return int(shape[0]) * self.workers
        return None


def source_rows(op):
    """Rows of one pull of a source op (``IteratorGetNext``...): its outputs' static batch
    dimension, else the constant batch size of the ``tf.data`` pipeline behind it."""
    for t in op.outputs:
        if t.shape.ndims and t.shape.dims[0].value is not None:
            return int(t.shape.dims[0].value)
    if not op.inputs or op.type not in ("IteratorGetNext", "IteratorGetNextSync"):
        return None
    iterator = op.inputs[0].op
    if iterator.type == "OneShotIterator":   # the pipeline is a function of the library
        return _factory_rows(iterator)
    made = [c for c in op.inputs[0].consumers() if c.type == "MakeIterator"]
    if not made:
        return None
    ds = made[0].inputs[0].op
    for _ in range(1000):
        if ds.type in _REBATCHING:
            return None
        if ds.type in _BATCH_DATASETS:
            index = _BATCH_DATASETS[ds.type]
            if index is None:
                index = 1 + len(ds.get_attr("Targuments"))
            value = tf.compat.v1.get_static_value(ds.inputs[index])
            return int(value) if value is not None else None
        if not ds.inputs or ds.inputs[0].dtype != tf.variant:
            return None
        ds = ds.inputs[0].op
    return None


def _factory_rows(iterator):
    """``source_rows`` of a one-shot iterator: its ``dataset_factory`` function's
    NodeDefs, from the dataset it returns back to a batch op with a constant size."""
    fdef = functions.function_def(iterator.graph, iterator.get_attr("dataset_factory").name)
    if fdef is None or len(fdef.ret) != 1:
        return None
    nodes = dict((n.name, n) for n in fdef.node_def)
    node = nodes.get(list(fdef.ret.values())[0].split(":")[0])
    for _ in range(1000):
        if node is None or node.op in _REBATCHING:
            return None
        inputs = [i.split(":")[0] for i in node.input if not i.startswith("^")]
        if node.op in _BATCH_DATASETS:
            index = _BATCH_DATASETS[node.op]
            if index is None:
                index = 1 + len(node.attr["Targuments"].list.type)
            size = nodes.get(inputs[index]) if index < len(inputs) else None
            if size is None or size.op != "Const":
                return None
            return int(tf.compat.v1.make_ndarray(size.attr["value"].tensor))
        if not inputs:
            return None
        node = nodes.get(inputs[0])
    return None


def gradient_bytes(state):
    """(bytes of the gradients one rank reduces per step, ranks in the reduction: the
    devices that hold a replica, on every worker; a replica's micro-batches on one device
    are summed there)."""
    updates = state.selection.updates
    ranks = len(set(state.devices)) * (1 if state.in_graph else max(1, state.cluster.worker_num))
    if updates is None or ranks <= 1:
        return 0, ranks
    fp16 = state.config.get("communication.fp16")
    total = 0
    for site in updates.sites:
        for g, _ in site.pairs:
            parts = ir.components(g)
            for t in parts:
                if t.shape.num_elements() is None:
                    continue   # (an IndexedSlices' rows vary per step: not counted)
                size = fusion.nbytes(t)
                if fp16 and len(parts) == 1 and t.dtype == tf.float32:
                    size //= 2   # (dense float32 buffers travel as float16)
                total += size
    return total, ranks


_GRAPH_ELEMENTS = (tf.Tensor, tf.Operation)   # (bound once: tf.X costs a lookup per use)


def _leaves(fetch, path, out):
    """(path, leaf) of every leaf of a fetch structure, in a fixed order."""
    if isinstance(fetch, (list, tuple)) and not hasattr(fetch, "indices"):
        for i, v in enumerate(fetch):
            _leaves(v, path + (i,), out)
    elif isinstance(fetch, dict):
        for k in fetch:
            _leaves(fetch[k], path + (k,), out)
    else:
        out.append((path, fetch))
    return out


def _key(leaves):
    """The signature of a fetch structure.  A graph element lives as long as its graph,
    so its id names it (``Tensor.name`` asks the C API each time)."""
    return tuple((p, id(x) if isinstance(x, _GRAPH_ELEMENTS) else
                  (x if isinstance(x, str) else getattr(x, "name", type(x).__name__)))
                 for p, x in leaves)


def _name(leaf):
    if isinstance(leaf, str):
        return leaf
    return getattr(leaf, "name", type(leaf).__name__)   # (a Variable, a SparseTensor...)


def _number(value):
    """A fetched loss as a float (the mean of a loss per example), or None."""
    if value is None:
        return None
    try:
        return float(np.mean(value))
    except (TypeError, ValueError):
        return None


def _follow(value, path):
    for p in path:
        value = value[p]
    return value


class WorkerProgress(object):
    """This process's steps and samples (one per process: ``tracker()``)."""

    def __init__(self, launch_dir, worker):
        self.path = worker_files.progress_path(launch_dir, worker) if launch_dir else None
        self.worker = int(worker) if worker is not None else None
        self.writer = None        # the summary writer (chief), see note_writer
        self.writer_env = None    # the epl.init it was seen under (a new one forgets it)
        self.facts = {}           # id(graph) -> _GraphFacts
        self.runs = 0             # training steps run by this process
        self.first_end = None     # when the first step ended
        self.last_end = None
        self.last_loss = None
        self.last_sample = None   # (time, runs) of the previous sample
        self.steps_per_sec = None
        self.batch = None
        self.facts_now = None
        self.step_reads = []      # (runs, global_step) read at samples: first and last
        self.lock = threading.Lock()
        self.registered = False

    def graph_facts(self, graph):
        known = self.facts.get(id(graph))
        epl_graph = known[0] if known is not None and known[1].graph is graph \
            else ir.Graph.get(graph)
        result = epl_graph.rewrite_result
        if result is None:
            return None
        if known is None or known[1].result is not result:
            known = (epl_graph, _GraphFacts(graph, result))
            self.facts[id(graph)] = known
        return known[1]

    def after_run(self, session, fetches, feed_dict, results):
        facts = self.graph_facts(session.graph)
        if facts is None or not facts.active:
            return
        is_step, loss_path = facts.kind(fetches)
        if not is_step:
            return
        now = time.time()
        with self.lock:
            self.runs += 1
            self.last_end = now
            if self.first_end is None:
                self.first_end = now
            if loss_path is not None:
                try:
                    self.last_loss = _follow(results, loss_path)   # (made a float in sample)
                except (TypeError, KeyError, IndexError):
                    pass
            self.facts_now = facts
            due = self.last_sample is None or now - self.last_sample[0] >= INTERVAL
        if due:
            self.sample(session, facts, feed_dict, now)

    def sample(self, session, facts, feed_dict, now, final=False):
        """One sample: the record, to the launch's file and the summary writer."""
        with self.lock:
            if self.last_sample is not None and self.runs > self.last_sample[1] \
                    and now > self.last_sample[0]:
                self.steps_per_sec = (self.runs - self.last_sample[1]) / (now - self.last_sample[0])
            self.last_sample = (now, self.runs)
            batch = facts.global_batch(feed_dict) if not final else None
            if batch is not None:
                self.batch = batch
        step = self._step(session, facts, final)
        rate = self.steps_per_sec
        mean = ((self.runs - 1) / (self.last_end - self.first_end)
                if self.runs > 1 and self.last_end > self.first_end else None)
        record = {
            "worker": self.worker, "time": now, "runs": self.runs, "step": step,
            "steps_per_sec": rate, "mean_steps_per_sec": mean,
            "step_time_s": 1.0 / rate if rate else None,
            "global_batch": self.batch,
            "samples_per_sec": rate * self.batch if rate and self.batch else None,
            "loss": _number(self.last_loss),
            "gradient_bytes_per_step": facts.gradient_bytes,
            "comm_bytes_per_step": facts.comm_bytes,
            "final": final,
        }
        if self.path is not None:
            self._append(record)
        if self.writer is not None and not final and self.writer_env is Env.get():
            self._summarize(record)
        return record

    def _step(self, session, facts, final):
        """global_step (read now, or at the end from the last reads), else the runs."""
        if facts.global_step is None:
            return self.runs
        if not final and session is not None:
            try:
                value = int(patching.original("session.run")(session, facts.global_step))
            except Exception:   # (a closed session, an uninitialized step: count runs)
                value = None
            if value is not None:
                self.step_reads = (self.step_reads[:1] + [(self.runs, value)])
                return value
        if not self.step_reads:
            return self.runs
        (r0, s0), (r1, s1) = self.step_reads[0], self.step_reads[-1]
        per_run = (s1 - s0) / float(r1 - r0) if r1 > r0 else 1.0
        return int(round(s1 + (self.runs - r1) * per_run))

    def _append(self, record):
        try:
            with open(self.path, "a") as f:
                f.write(json.dumps(record) + "\n")
        except OSError:
            self.path = None   # (the launcher and its folder are gone)
            return
        if not self.registered:
            self.registered = True
            atexit.register(self.finish)

    def _summarize(self, record):
        values = []
        for tag, key in zip(TAGS, ("step_time_s", "steps_per_sec", "samples_per_sec",
                                   "gradient_bytes_per_step", "comm_bytes_per_step")):
            if record[key] is not None:
                values.append(tf.compat.v1.Summary.Value(tag=tag, simple_value=float(record[key])))
        try:
            self.writer.add_summary(tf.compat.v1.Summary(value=values), record["step"])
        except Exception:   # (the program closed its writer)
            self.writer = None

    def finish(self):
        """The last sample (at exit): the steps since the previous one."""
        if self.path is None or self.facts_now is None:
            return
        try:
            self.sample(None, self.facts_now, None, self.last_end or time.time(), final=True)
        except Exception as e:   # pylint: disable=broad-except
            log.warning("EPL: the last progress sample failed: %s: %s", type(e).__name__, e)


_TRACKER = []
# Sessions whose progress failed once: progress is off for them (see ``after_run``).
_FAILED = weakref.WeakSet()


def tracker():
    """This process's WorkerProgress (made on first use, from the environment)."""
    if not _TRACKER:
        launch_dir = os.environ.get(worker_files.LAUNCH_DIR_ENV)
        worker = os.environ.get(worker_files.WORKER_INDEX_ENV)
        _TRACKER.append(WorkerProgress(launch_dir if worker is not None else None, worker))
    return _TRACKER[0]


def after_run(session, fetches, feed_dict, results):
    """Called by EPL after every ``Session.run`` (``fetches`` as the program gave them)."""
    t = _TRACKER[0] if _TRACKER else tracker()
    if t.path is None and t.writer is None:
        return    # (neither epl-launch nor summaries: nothing to do)
    if not Env.initialized() or (t.path is None and t.writer_env is not Env.get()):
        return
    if _FAILED and session in _FAILED:
        return
    try:
        t.after_run(session, fetches, feed_dict, results)
    except Exception as e:   # pylint: disable=broad-except
        # Progress is a report, not part of the step: its error must never become the
        # user's failed Session.run.  Say it once and stop reporting for this session.
        try:
            _FAILED.add(session)
        except TypeError:    # (an object without weak references: off for the process)
            t.path = t.writer = None
        log.warning("EPL: live progress failed and is off for this session from now on "
                    "(training goes on; epl-launch's progress lines and EPL's TensorBoard "
                    "scalars stop here): %s: %s", type(e).__name__, e)


def watch_callable(session, callable_options, fn):
    """``fn`` (a callable ``Session._make_callable_from_options`` made: how tf.keras runs
    its train, test and predict functions), reporting each call like a run: its fetches
    and targets by name (the program's, before EPL mapped them), its feeds in order."""
    names = list(callable_options.fetch) + list(callable_options.target)
    feeds = list(callable_options.feed)

    def call(*args, **kwargs):
        out = fn(*args, **kwargs)
        t = _TRACKER[0] if _TRACKER else tracker()
        if t.path is not None or t.writer is not None:
            after_run(session, names, dict(zip(feeds, args)), out)
        return out
    return call


def note_writer(writer):
    """Called when a summary writer adds an event on the chief: the first is where EPL's
    scalars go."""
    t = tracker()
    if not Env.initialized() or not Env.get().cluster.is_chief:
        return
    if t.writer is None or t.writer_env is not Env.get():
        t.writer, t.writer_env = writer, Env.get()
