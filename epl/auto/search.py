"""Strategy search: ``epl.auto.accelerate`` (seed 004's ``auto_accelerate``, for TF1
graphs).

A *strategy* is a JSON-serialisable list of optimization methods, each a name or
``[name, config]``::

    ["data_parallel", ["gradient_checkpoint", "auto"], "zero"]
    [["pipeline", {"num_stages": 2, "num_micro_batch": 4}]]

Methods (``METHODS``) and what they set:

* ``data_parallel``: ``epl.set_default_strategy(epl.replicate(1))`` on every device;
* ``accumulation`` ``{"num_micro_batch": m}``: data parallel, m micro-batches per step;
* ``pipeline`` ``{"num_stages": K, "num_micro_batch": m}``: automatic stages
  (``auto.auto_parallel``), data parallel over the pipelines;
* ``split`` ``{"layer": k}``: data parallel, with the model's k-th Dense layer (in
  the order model_fn builds them) and everything after it split over every device
  (``epl.split``, the replicated-backbone / split-head hybrid).  Offered when the
  largest Dense layer (by weights) is the model's last one, its head: a classifier
  over many classes.  ``"split"`` alone picks that layer;
* ``gradient_checkpoint`` (``"auto"`` or ``"collection"``), ``zero``, ``amp``,
  ``offload``: the memory features, on top of one of the above.

Fully automatic mode tries candidates built from the methods not ``excluded``;
each is *dry-run* for a few steps in a process of its own (graphs, sessions and
memory do not leak between candidates), measured for samples/s and for the bytes
of its fullest device during a step (the variables placed there plus the step's
peak there, ``epl.ir.memory_trace``), and is infeasible above
``memory_limit_bytes``; the fastest feasible one wins.  Candidates are tried in a
fixed order until ``time_limit`` seconds have passed.  Semi-automatic mode
(``load_strategy``: the list, its JSON, or a file holding it) skips the search.
Either way the chosen strategy is then built in the calling process.

The user's functions run in the candidates' processes, so they must be importable
(defined at module level, as ``multiprocessing``'s spawn requires).
"""
import collections
import json
import logging
import multiprocessing
import time

import epl
from epl import ir
from epl.auto import graph_profile, head_split
from epl.auto.layout import Layout, read_strategy
from epl.auto.machines import Cluster
from epl.auto.predictor import price
from epl.core.process_state import Env
from epl.ir.memory_trace import peak_bytes, traced_run
from epl.tf_adapter import behavior

log = logging.getLogger("epl")

METHODS = ("data_parallel", "accumulation", "pipeline", "split", "gradient_checkpoint", "zero",
           "amp", "offload")
_BASES = ("data_parallel", "accumulation", "pipeline", "split")
PLANNED = ("tensor_parallel",)     # the planner's entries (epl.auto.layout) beyond METHODS
MIN_TIMED_SECONDS = 1.0

Result = collections.namedtuple("Result", "loss train_op global_step config strategy report")


def normalize(strategy):
    """A strategy as a list of [name, config] (config None when not given).

    The planner's entries (``epl.auto.layout``) are read where EPL runs them here:
    ``["data_parallel", {"degree": d}]``, ``["pipeline", {..., "schedule": "1f1b" |
    "gpipe", "micro_batch_size": b}]``, ``["amp", {"dtype": ...}]``, ``["zero", {"level":
    "v1"}]``, ``["tensor_parallel", {"degree": 1}]``; the others are refused by name
    (``refused``)."""
    strategy = read_strategy(strategy)
    out = []
    for item in strategy:
        name, config = (item, None) if isinstance(item, str) else (item[0], item[1])
        if name not in METHODS and name not in PLANNED:
            raise ValueError("epl.auto: unknown optimization method %r in the strategy; the "
                             "methods are %s." % (name, ", ".join(METHODS + PLANNED)))
        why = refused(name, config)
        if why:
            raise ValueError("epl.auto: %r cannot run here: %s" % ([name, config], why))
        if name == "tensor_parallel":
            continue                    # degree 1: nothing to do
        out.append([name, config])
    bases = [name for name, _ in out if name in _BASES]
    if len(bases) > 1 and not (len(bases) == 2 and "data_parallel" in bases and any(
            name == "data_parallel" and cfg for name, cfg in out)):
        raise ValueError("epl.auto: a strategy has one of %s, got %r." % (", ".join(_BASES), out))
    if len(bases) == 2:                 # the planner's [pipeline, [data_parallel, {degree}]]
        out = [e for e in out if e[0] != "data_parallel"]
    return out


def refused(name, config):
    """Why EPL's search cannot run a strategy entry (None when it can)."""
    cfg = config if isinstance(config, dict) else {}
    if name == "tensor_parallel" and int(cfg.get("degree", 1)) > 1:
        return ("tensor parallelism is the model's own epl.split blocks (docs/split.md); "
                "accelerate does not split a model: build the blocks under epl.split(%d) "
                "(EPL runs it as devices / %d data-parallel groups)"
                % (int(cfg["degree"]), int(cfg["degree"])))
    if name == "pipeline" and cfg.get("schedule", "1f1b") not in ("1f1b", "gpipe"):
        return ("EPL runs the 1f1b and gpipe schedules, not %r (priced by epl.auto.predict "
                "only)" % cfg.get("schedule"))
    if name == "zero" and cfg.get("level", "v1") != "v1":
        return "EPL's ZeRO level is 'v1'"
    if name == "amp" and cfg.get("dtype", "float16") not in ("float16", "bfloat16"):
        return "AMP's dtype is float16 or bfloat16"
    if name == "gradient_checkpoint" and config not in (None, "auto", "collection", "full"):
        return "gradient_checkpoint is 'auto', 'collection' or 'full' (= 'auto')"
    return None


def config_of(strategy, devices, rows=None):
    """(EPL config dict, whether to set replicate(1) as the default strategy).
    ``rows``: the dataset's batch, for a pipeline given by ``micro_batch_size``."""
    cfg = {"cluster.devices_per_worker": devices}
    default = True
    for name, arg in normalize(strategy):
        if name == "data_parallel" and isinstance(arg, dict) and "degree" in arg \
                and int(arg["degree"]) != devices:
            raise ValueError("epl.auto: data_parallel degree %d on %d devices: the search "
                             "runs one worker's devices (use devices=%d)"
                             % (int(arg["degree"]), devices, int(arg["degree"])))
        if name == "accumulation":
            cfg["pipeline.num_micro_batch"] = int((arg or {}).get("num_micro_batch", 2))
        elif name == "pipeline":
            arg = arg or {}
            cfg["auto.auto_parallel"] = True
            cfg["pipeline.num_stages"] = int(arg.get("num_stages", 2))
            m = arg.get("num_micro_batch")
            if m is None and arg.get("micro_batch_size") and rows:
                m = rows // int(arg["micro_batch_size"])
            cfg["pipeline.num_micro_batch"] = int(m or 4)
            if arg.get("schedule") == "gpipe":
                cfg["pipeline.strategy"] = "PreferForward"
            default = False
        elif name == "split":
            cfg["cluster.colocate_split_and_replicate"] = True
        elif name == "gradient_checkpoint":
            cfg["gradient_checkpoint.type"] = "auto" if arg in (None, "full") else arg
        elif name == "zero":
            cfg["zero.level"] = "v1"
        elif name == "amp":
            cfg["amp.level"] = "O1"
            if isinstance(arg, dict) and arg.get("dtype", "float16") != "float16":
                cfg["amp.dtype"] = arg["dtype"]
        elif name == "offload":
            cfg["offload.level"] = "v0"
    return cfg, default


def candidates(devices, excluded=(), head=None):
    """The strategies the fully automatic mode tries, in order (``head``: the index of
    the Dense layer a ``split`` candidate splits, None for no split candidate)."""
    excluded = set(excluded or ())
    bases = []
    if "data_parallel" not in excluded:
        bases.append(["data_parallel"])
    if "accumulation" not in excluded:
        bases.append([["accumulation", {"num_micro_batch": 2}]])
    if "pipeline" not in excluded:
        for k in (2, 4):
            if k <= devices and devices % k == 0:
                bases.append([["pipeline", {"num_stages": k, "num_micro_batch": 2 * k}]])
    if "split" not in excluded and head is not None and devices > 1:
        bases.append([["split", {"layer": head}]])
    out = [list(b) for b in bases]
    extras = [m for m in ("gradient_checkpoint", "zero", "amp", "offload") if m not in excluded]
    for base in bases[:1] or [[]]:
        for extra in extras:
            if extra == "zero" and devices < 2:
                continue
            out.append(list(base) + [extra])
    return [normalize(s) for s in out if s]


def build(model_fn, dataset_fn, optimizer_fn, strategy, devices):
    """epl.init with the strategy, then the user's model, input and optimizer in the
    default graph: (loss, train_op, global_step, config)."""
    import tensorflow as tf
    strategy = normalize(strategy)
    cfg, default = config_of(strategy, devices, batch_rows(dataset_fn))
    split = [arg for name, arg in strategy if name == "split"]
    layer = None
    if split:
        layer = (split[0] or {}).get("layer")
        if layer is None:
            layer = split_head(model_fn, dataset_fn)
            if layer is None:
                raise ValueError("epl.auto: 'split' needs the index of the Dense layer to "
                                 "split (['split', {'layer': k}]): the model's largest Dense "
                                 "layer is not its last one.")
    epl.init(epl.Config(cfg))
    features = tf.compat.v1.data.make_one_shot_iterator(dataset_fn()).get_next()
    if default:
        epl.set_default_strategy(epl.replicate(1))
    if layer is None:
        loss = model_fn(features)
    else:
        loss = head_split.build_loss(model_fn, features, layer, devices)
    step = tf.compat.v1.train.get_or_create_global_step()
    train_op = optimizer_fn().minimize(loss, global_step=step)
    return loss, train_op, step, cfg


def split_head(model_fn, dataset_fn):
    """The build-order index of the model's head worth splitting, else None
    (``head_split.find``)."""
    return head_split.find(model_fn, dataset_fn)


def dry_run(model_fn, dataset_fn, optimizer_fn, strategy, devices, steps):
    """Build and run ``strategy`` for ``steps`` steps: {samples_per_s, peak_bytes, ...}.

    ``peak_bytes``: the fullest training device's bytes during a step: the variables
    it holds (weights, optimizer state) plus the step's own peak there."""
    import tensorflow as tf
    tf.compat.v1.logging.set_verbosity(tf.compat.v1.logging.ERROR)
    loss, train_op, _, _ = build(model_fn, dataset_fn, optimizer_fn, strategy, devices)
    graph = tf.compat.v1.get_default_graph()
    with tf.compat.v1.Session() as sess:
        sess.run(tf.compat.v1.global_variables_initializer())
        sess.run(train_op)                              # the rewrite and warm-up
        _, md = traced_run(sess, train_op)
        cluster = Env.get().cluster
        names = [cluster.local_device(i) for i in range(cluster.gpu_num_per_worker)]
        held = _variable_bytes(graph, names)
        peak = max(held[d] + peak_bytes(md, d) for d in names)
        # At least ``steps`` steps and MIN_TIMED_SECONDS: short steps are noisy.
        start, times = time.time(), []
        while len(times) < steps or time.time() - start < MIN_TIMED_SECONDS:
            began = time.time()
            sess.run(train_op)
            times.append(time.time() - began)
        seconds = sorted(times)[len(times) // 2]       # the median step: noise is one-sided
    state = ir.Graph.get(graph).rewrite_result.state
    pulls = state.num_clones if state is not None else 1
    rows = batch_rows(dataset_fn)
    return {"samples_per_s": pulls * rows / seconds, "step_s": seconds, "peak_bytes": peak,
            "rows_per_step": pulls * rows}


def _variable_bytes(graph, devices):
    """{device: bytes of the variables placed there} (unplaced ones: the first)."""
    import tensorflow as tf
    held = ir.variables_by_device(graph)
    out = dict((d, held[tf.DeviceSpec.from_string(d).to_string()]) for d in devices)
    out[devices[0]] += held[""]
    return out


def batch_rows(dataset_fn):
    """The rows of a batch of ``dataset_fn()``: its static batch dimension."""
    import tensorflow as tf
    shapes = tf.compat.v1.data.get_output_shapes(dataset_fn())
    first = tf.nest.flatten(shapes)[0]
    if first.ndims and first.dims[0].value is not None:
        return first.dims[0].value
    raise ValueError("epl.auto: the dataset's batch dimension must be static (batch with "
                     "drop_remainder=True) so that candidates can be compared by samples/s.")


def _child(conn, fns, strategy, devices, steps, switches):
    try:
        # A spawned interpreter starts with TensorFlow's defaults (TF 2.x: eager):
        # build the candidate the way the searching program builds its graphs.
        behavior.restore(switches)
        conn.send(("ok", dry_run(fns[0], fns[1], fns[2], strategy, devices, steps)))
    except Exception as e:  # pylint: disable=broad-except
        conn.send(("error", "%s: %s" % (type(e).__name__, e)))
    finally:
        conn.close()


def measure(fns, strategy, devices, steps, timeout):
    """``dry_run`` in a process of its own, with this process's TensorFlow behaviour
    switches (graph mode, variable kind, ...); (status, figures or message)."""
    ctx = multiprocessing.get_context("spawn")
    parent, child = ctx.Pipe(duplex=False)
    proc = ctx.Process(target=_child,
                       args=(child, fns, strategy, devices, steps, behavior.current()))
    proc.start()
    child.close()
    try:
        if not parent.poll(timeout):
            return "timeout", "no result within %.0f s" % timeout
        return parent.recv()
    except EOFError:
        return "error", "the dry run's process died (exit code %s)" % proc.exitcode
    finally:
        if proc.is_alive():
            proc.terminate()
        proc.join(10)


def layout_of(strategy, devices):
    """The planner's Layout (``epl.auto.layout``) of a strategy run on ``devices``
    devices of this worker (``split``: the head split over them).  ``tensor_parallel``
    ``{"degree": t}``: the model's own ``epl.split(t)`` scopes, ``devices / t`` groups."""
    items = read_strategy(strategy)     # (normalize refuses a degree > 1: read it here)
    tp = [i[1] or {} for i in items if not isinstance(i, str) and i[0] == "tensor_parallel"]
    t = int(tp[-1].get("degree", 1)) if tp else 1
    rest = [i for i in items if isinstance(i, str) or i[0] != "tensor_parallel"]
    if t < 1 or devices % t:
        raise ValueError("epl.auto: tensor_parallel degree %d on %d devices: the degree "
                         "must divide the devices" % (t, devices))
    kw = {"t": t, "d": devices // t}
    for name, arg in normalize(rest):
        arg = arg if isinstance(arg, dict) else {}
        if name == "split":
            kw["split_head"] = True
        elif name == "accumulation":
            kw["num_micro_batch"] = int(arg.get("num_micro_batch", 2))
        elif name == "pipeline":
            p = int(arg.get("num_stages", 2))
            kw.update(p=p, d=max(1, devices // (p * t)),
                      num_micro_batch=int(arg.get("num_micro_batch", 4)),
                      schedule=arg.get("schedule", "1f1b"))
        elif name == "gradient_checkpoint":
            kw["recompute"] = True
        elif name == "zero":
            kw["zero"] = "v1"
        elif name == "amp":
            kw["dtype"] = arg.get("dtype", "float16")
        elif name == "offload":
            kw["offload"] = True
    return Layout(**kw)


def rank(model_fn, dataset_fn, optimizer_fn, cands, devices):
    """The candidates in the order to dry-run them: those the planner cannot price
    first (kept in their order), then the others by samples/s predicted on
    ``Cluster.local(devices)`` (its cached calibration); [(strategy, prediction or
    None)]."""
    cluster = Cluster.local(devices)
    profile = graph_profile.profile(model_fn, dataset_fn, optimizer_fn)
    unpriced, priced = [], []
    for cand in cands:
        try:
            lay = layout_of(cand, devices)
            pred = price(profile, lay, cluster)    # each micro-batch: the dataset's batch
        except ValueError:
            unpriced.append((cand, None))
            continue
        priced.append((cand, pred))
    priced.sort(key=lambda cp: -cp[1].samples_per_s)
    return unpriced + priced


def accelerate(model_fn, dataset_fn, optimizer_fn, devices=1, excluded=None,
               load_strategy=None, save_strategy_to_file=None, time_limit=None,
               memory_limit_bytes=None, dry_run_steps=3, candidate_timeout=300,
               verbose=False, dry_run_top=3):
    """Search (or load) a strategy and build it: ``(status, result, strategy)``.

    ``model_fn(features) -> loss``, ``dataset_fn() -> tf.data.Dataset`` (each element
    one batch of a replica, static batch size), ``optimizer_fn() -> tf.compat.v1
    Optimizer``; ``devices``: devices of this worker to use.  ``result`` is a
    ``Result`` (loss, train_op, global_step, config, strategy, report) built in the
    default graph after ``epl.init`` with the chosen config; ``report`` lists every
    candidate tried with its figures.  ``status`` is False (``result`` and
    ``strategy`` None) when no candidate was feasible.

    ``dry_run_top``: with more candidates than this, the planner ranks them first
    (``rank``: ``epl.auto.predict`` on ``Cluster.local(devices)``) and the search
    dry-runs them in that order until this many were measured feasible (those the
    planner cannot price are always dry-run); the rest are reported as skipped with
    their prediction.  None dry-runs every candidate.
    """
    report = []
    if load_strategy is not None:
        strategy = normalize(load_strategy)
    else:
        fns = (model_fn, dataset_fn, optimizer_fn)
        started = time.time()
        best = None
        head = None
        if "split" not in set(excluded or ()) and devices > 1:
            head = split_head(model_fn, dataset_fn)
        cands = [(c, None) for c in candidates(devices, excluded, head)]
        if dry_run_top is not None and len(cands) > dry_run_top:
            cands = rank(model_fn, dataset_fn, optimizer_fn, [c for c, _ in cands], devices)
        feasible = 0
        for cand, pred in cands:
            if time_limit is not None and time.time() - started >= time_limit:
                report.append({"strategy": cand, "status": "skipped (time limit)"})
                continue
            if pred is not None and dry_run_top is not None and feasible >= dry_run_top:
                report.append({"strategy": cand, "status": "skipped (predicted slower)",
                               "predicted_samples_per_s": pred.samples_per_s})
                continue
            status, out = measure(fns, cand, devices, dry_run_steps, candidate_timeout)
            entry = {"strategy": cand, "status": status}
            if pred is not None:
                entry["predicted_samples_per_s"] = pred.samples_per_s
            if status == "ok":
                entry.update(out)
                if memory_limit_bytes is not None and out["peak_bytes"] > memory_limit_bytes:
                    entry["status"] = "infeasible (peak %d > %d bytes)" % (
                        out["peak_bytes"], memory_limit_bytes)
                else:
                    feasible += 1
                    if best is None or out["samples_per_s"] > best[0]:
                        best = (out["samples_per_s"], cand)
            else:
                entry["message"] = out
            report.append(entry)
            line = "EPL auto: %-60s %s" % (json.dumps(cand), _figures(entry))
            (log.warning if verbose else log.info)(line)
        if best is None:
            return False, None, None
        strategy = best[1]
    if save_strategy_to_file:
        with open(save_strategy_to_file, "w") as f:
            json.dump(strategy, f)
    loss, train_op, step, cfg = build(model_fn, dataset_fn, optimizer_fn, strategy, devices)
    return True, Result(loss, train_op, step, cfg, strategy, report), strategy


def _figures(entry):
    if "samples_per_s" not in entry:
        return "%s %s" % (entry["status"], entry.get("message", ""))
    return "%.1f samples/s, peak %.1f MiB, %s" % (
        entry["samples_per_s"], entry["peak_bytes"] / float(1 << 20), entry["status"])
