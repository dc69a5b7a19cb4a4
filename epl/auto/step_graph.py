"""A training step as the session runs it, for the planner's time and memory on
this machine: Grappler's optimization of the built graph (``tf_adapter.grappler``), its
dataflow (each op's kernel signature and what it waits for: ``epl.auto.dataflow``
replays it), its transient peak (``epl.auto.liveness``), the model as EPL itself builds
it under a config (AMP's rewrite, in a process of its own), and what EPL's automatic
gradient checkpointing recomputes (its rule, replayed)."""
import collections
import multiprocessing
import re

import tensorflow as tf

import epl
from epl import ir, rewrite
from epl.auto import cold_reads, head_split, liveness, product_timing, shapes, \
    update_timing
from epl.features import gradient_checkpoint
from epl.tf_adapter import behavior, grappler
from epl.tf_adapter import graph as tfg

v1 = tf.compat.v1
_SHAPE_OPS = gradient_checkpoint._SHAPE_READERS
_GET_NEXT = ("IteratorGetNext", "IteratorGetNextSync")


def epl_built_dataflow(fns, config, timeout=600, replicate=True):
    """``dataflow`` of the step EPL makes of the model under the EPL ``config`` (a
    dict: ``{"amp.level": "O1"}``: its build-time rewrites; ``auto.auto_parallel`` with
    ``pipeline.*`` keys: its stages, micro-batch clones and schedule edges, on
    ``cluster.devices_per_worker`` devices, default 1), rewritten as before a
    session's first run, in a process of its own (with ``"devices"``: each op's
    device, ``resolved_devices``, and ``"memory"``: ``device_memory``): ``epl.init``
    starts a new default graph and replaces this process's EPL state, which a planner
    must leave alone.  The functions must be importable (module level).
    ``replicate``: data parallelism as the default strategy (the whole model's
    layouts); False for a model with scopes of its own (a split variant, as its user
    runs it: a default ``replicate`` beside its split scopes is another layout, refused
    where the split takes every device)."""
    ctx = multiprocessing.get_context("spawn")
    parent, child = ctx.Pipe(duplex=False)
    proc = ctx.Process(target=_built_dataflow_child,
                       args=(child, fns, config, behavior.current(), replicate))
    proc.start()
    child.close()
    try:
        if not parent.poll(timeout):
            raise RuntimeError("epl.auto: building the model with %r took over %.0f s"
                               % (config, timeout))
        status, out = parent.recv()
    except EOFError:
        raise RuntimeError("epl.auto: the process building the model with %r died "
                           "(exit code %s)" % (config, proc.exitcode))
    finally:
        if proc.is_alive():
            proc.terminate()
        proc.join(10)
    if status != "ok":
        raise RuntimeError("epl.auto: building the model with %r failed: %s" % (config, out))
    return out


def _built_dataflow_child(conn, fns, config, switches, replicate=True):
    try:
        behavior.restore(switches)
        graph = tf.Graph()
        with graph.as_default():
            config = dict({"cluster.devices_per_worker": 1}, **config)
            head = _split_head(fns, config)
            epl.init(epl.Config(config))
            features = v1.data.make_one_shot_iterator(fns[1]()).get_next()
            rows = tf.nest.flatten(features)[0].shape.as_list()[0]
            if replicate and not config.get("auto.auto_parallel"):
                epl.set_default_strategy(epl.replicate(1))
            loss = fns[0](features) if head is None else head_split.build_loss(
                fns[0], features, head, config["cluster.devices_per_worker"])
            train_op = fns[2]().minimize(loss, global_step=v1.train.get_or_create_global_step())
            rewrite.rewrite_if_needed(graph)
        placed = dict((op.name, op.device) for op in graph.get_operations())
        ops = optimized_step(graph, train_op)()
        run = optimized_step(graph, train_op, grappler.ON_CPU)()
        device = resolved_devices(run, placed)
        out = dataflow(run, rows, placed)
        out["devices"] = [device[op] for op in run]
        out["memory"] = device_memory(graph, ops, rows, resolved_devices(ops, placed))
        conn.send(("ok", out))
    except Exception as e:  # pylint: disable=broad-except
        conn.send(("error", "%s: %s" % (type(e).__name__, e)))
    finally:
        conn.close()


def _split_head(fns, config):
    """The build-order index of the Dense layer ``accelerate``'s split head puts under
    ``epl.split`` over every device (``head_split``) where ``config`` asks for the split
    head, else None.  Only the plain split head: its config has the device count and
    the split's key alone."""
    if not config.get("cluster.colocate_split_and_replicate"):
        return None
    extra = set(config) - set(["cluster.devices_per_worker",
                                "cluster.colocate_split_and_replicate"])
    if extra:
        raise ValueError("epl.auto: the split head's built step takes no other keys, got "
                         "%s" % ", ".join(sorted(extra)))
    layer = head_split.find(fns[0], fns[1])
    if layer is None:
        raise ValueError("epl.auto: the model has no head to split (its largest Dense "
                         "layer is not its last)")
    return layer


def resolved_devices(ops, placed):
    """{op: its device} of Grappler's copy ``ops`` of a graph placed as ``placed``
    ({op name: device}): an op Grappler made is placed with the first of its inputs, or
    readers, that is placed."""
    def spec(name):
        return tf.DeviceSpec.from_string(name).to_string() if name else ""
    where = dict((name, spec(d)) for name, d in placed.items())
    readers = collections.defaultdict(list)
    for op in ops:
        for t in op.inputs:
            readers[t.op].append(op)
    device = {}
    for op in ops:                  # Grappler's own ops: their neighbours' device
        device[op] = where.get(op.name) or next(
            (device[t.op] for t in op.inputs if t.op in device and device[t.op]), "")
    for op in reversed(ops):
        if not device[op]:
            device[op] = next((device[r] for r in readers[op] if device[r]), "")
    return device


def device_memory(graph, ops, rows, device):
    """[(device, the variables' bytes there, the step's transient peak there)] of a
    placed step, in the devices' order (the variables: ``graph``'s, where EPL placed
    them; the peak: ``liveness.device_peaks`` of Grappler's copy ``ops``, placed as
    ``device``: ``resolved_devices``)."""
    peaks = liveness.device_peaks(ops, rows, device.get)
    held = ir.variables_by_device(graph)
    devices = sorted(set(peaks) | set(held), key=_device_order)
    return [(d, int(held[d]), int(peaks.get(d, 0))) for d in devices]


def _device_order(name):
    spec = tf.DeviceSpec.from_string(name)
    return (spec.job or "", spec.replica or 0, spec.task or 0, spec.device_type or "",
            spec.device_index or 0)


def optimized_step(graph, train_op, device=""):
    """``ops()``: the ops of a step as the session runs them (Grappler's optimization of
    the built graph: folded constants, fused products; ``tf_adapter.grappler``), in
    dataflow order; computed on the first call, kept.  ``device``: where Grappler sees
    the ops (``grappler.ON_CPU``: the kernels a session on this machine's CPU devices
    runs, its products fused with their bias and activation: the planner's timed
    dataflow; none: the graph the memory model reads)."""
    cache = {}

    def ops():
        if "ops" not in cache:
            _, fetched = grappler.optimized(graph, [train_op], device)
            cache["ops"] = sorted(ir.upstream(fetched), key=tfg.op_id)
        return cache["ops"]
    return ops


def dataflow(ops, rows, devices=None):
    """The step's ops for ``epl.auto.dataflow``, in dataflow order:
    {"sigs": each op's product or kernel signature (None: no time of its own),
    "flops": forward FLOPs of the products without a signature, "deps": the indices
    each op waits for (inputs and control inputs), "inputs": the indices of the ops
    that pull the input pipeline's next batch, "updates": (index, device) of the
    optimizer's updates of variables (``update_timing.signature``), "hops":
    how many of the ops each op waits for are on another device (``devices``: {op
    name: device} of the placed graph; Grappler's copy has none), "reads": the bytes
    each op is the first to read of a variable, "state": the variables' bytes (a weight
    read from memory where they outgrow the cache: ``cold_reads``), "cold": the bytes
    each op reads of activations that have left the cache (``cold_reads.cold_activations``)}."""
    index = dict((op, i) for i, op in enumerate(ops))
    sigs, flops, deps, hops, updates = [], [], [], [], []
    inputs = [i for i, op in enumerate(ops) if op.type in _GET_NEXT]
    devices = devices or {}
    for op in ops:
        sig = product_timing.any_signature(op, rows)
        if sig is None:
            sig = update_timing.signature(op)
            if sig is not None:
                updates.append((len(sigs), devices.get(op.name) or ""))
        sigs.append(sig)
        untimed = sig is None and op.type in shapes.MATMULS
        flops.append(shapes.op_flops(op, rows) if untimed else 0.0)
        waits = set(t.op for t in op.inputs if t.op in index) \
            | set(c for c in op.control_inputs if c in index)
        deps.append(sorted(index[w] for w in waits))
        here = devices.get(op.name)
        hops.append(sum(1 for w in waits if here and devices.get(w.name) not in (None, "", here)))
    return dict(sigs=sigs, flops=flops, deps=deps, inputs=inputs, hops=hops,
                updates=updates, reads=cold_reads.first_reads(ops),
                state=cold_reads.state_bytes(ops), sums=_local_sums(ops, rows, devices),
                cold=cold_reads.cold_activations(ops, cold_reads.cache_bytes(), rows))


def _local_sums(ops, rows, devices):
    """[(index of the op that sums, bytes it reads and writes)] for EPL's collectives
    whose ranks all run on one device (a pipeline's micro-batches' gradients, summed by
    one op per micro-batch): the last rank to arrive adds every rank's tensors into one
    (``csrc/collectives.cc``), priced on that rank's op, the last in dataflow order
    (measured: 8 ranks of 4 MiB took 1.0 ms more than reading them, 4 ranks 0.3 ms).
    The ranks on different devices (data parallelism) are the cluster's all-reduce."""
    index = dict((op, i) for i, op in enumerate(ops))
    groups = collections.defaultdict(list)
    for op, meeting in liveness.rendezvous(ops).items():
        groups[meeting].append(op)
    out = []
    for members in groups.values():
        places = set(devices.get(op.name) for op in members)
        if len(places) != 1 or None in places or "" in places:
            continue
        last = max(members, key=index.get)
        moved = sum(liveness.tensor_bytes(t, rows) for op in members for t in op.inputs) \
            + sum(liveness.tensor_bytes(t, rows) for t in last.outputs)
        out.append((index[last], moved))
    return sorted(out)


def step_peak(step_ops, rows, split=None):
    """``step_peak(updates_last, side_by_side, t=1)``: the transient bytes one device
    holds at the peak of a step of the whole model at ``rows`` rows (``epl.auto.liveness``
    on the graph Grappler makes of it: ``step_ops``; computed on the first call, kept);
    ``t`` > 1: of its tensor-parallel split over ``t`` devices, the ``split`` tensors
    (``split_share``) 1/t of their bytes."""
    cache = {}

    def step_peak(updates_last=False, side_by_side=True, t=1):
        key = (updates_last, side_by_side, t)
        if key not in cache:
            share = split_share(split, t, rows) if t > 1 and split is not None else None
            cache[key] = liveness.peak_bytes(step_ops(), rows, updates_last, side_by_side,
                                             share=share)
        return cache[key]
    return step_peak


GRAD_OF = re.compile(r"gradients(?:_\d+)?/(.*?)_grad/")     # its forward op's name


def split_share(split, t, rows):
    """tensor -> the part of its bytes one of ``t`` devices holds under EPL's split
    (docs/split.md), for a step of the whole model: ``split`` = (the forward tensors
    the split shards, {forward op: the shapes of its sharded tensors and weights}).
    A gradient op's output with the shape of a sharded tensor or weight of its forward
    op is sharded too, unless a whole input of that op has that shape (the gradient of
    a column-parallel layer's input is whole: EPL all-reduces it; a square layer's is
    counted whole).  Measured (TF 1.15, the MLP under epl.split(2)): its step's peak
    held its gradients' halves (6.5 MiB on a device), the whole model's walk 14.5;
    the GPT's held the LM head's logits whole beside the blocks' halves."""
    tensors, shapes_of = split

    def share(tensor):
        if tensor.name in tensors:
            return 1.0 / t
        m = GRAD_OF.match(tensor.op.name)
        if m and m.group(1) in shapes_of:
            dims = shapes.dims(tensor, rows)
            if dims is not None and tuple(dims) in shapes_of[m.group(1)]:
                return 1.0 / t
        return 1.0
    return share


def gc_recompute(loss, backward):
    """The share of the activations EPL's ``gradient_checkpoint "auto"`` still holds at
    its peak (one pipeline stage, the whole model), by its own rule
    (``epl.features.gradient_checkpoint``): checkpoints are separators (``choose``);
    nothing after the last one is recomputed (the tail stays); each segment before it
    is recomputed once the backward pass has left the later ones, so the peak is the
    checkpoints plus the larger of the tail and the largest segment.  1.0 where it
    finds fewer than two separators (nothing recomputed).  Returns (that share, the
    forward ops the rewrite copies: those between checkpoints the backward pass reads,
    and what they are computed from back to the checkpoints)."""
    stop = set(backward)
    ops = sorted(ir.upstream([loss.op], stop=stop), key=tfg.op_id)
    never = gradient_checkpoint._NEVER | gradient_checkpoint._CONTROL_FLOW
    cands = [op for op in ops if op.type not in never and not op.op_def.is_stateful
             and tfg.control_flow_context(op) is None
             and not any(ir.is_state_handle(t) for t in list(op.outputs) + list(op.inputs))]
    members = set(cands)
    wanted = set(t for b in backward if b.type not in _SHAPE_OPS for t in b.inputs
                 if t.op in members and t.dtype.is_floating)
    total = float(sum(gradient_checkpoint._nbytes(t) for t in wanted))
    picks = gradient_checkpoint.choose(cands, wanted) if total else []
    if not picks:
        return 1.0, []
    able = ir.upstream([t.op for t in picks], control=False, within=members)
    kept = set(picks)
    stack = [t.op for t in wanted if t.op in able and t not in kept]
    recomputed = set()
    while stack:                    # gradient_checkpoint._copy_upstream's closure
        op = stack.pop()
        if op in recomputed:
            continue
        recomputed.add(op)
        stack.extend(t.op for t in op.inputs if t.op in able and t not in kept)
    pos = dict((op, i) for i, op in enumerate(cands))
    bounds = sorted(pos[t.op] for t in picks)
    parts = [0.0] * (len(bounds) + 1)          # segments before each pick, then the tail
    for t in wanted:
        if t in picks:
            continue
        i = len(bounds) if t.op not in able else sum(1 for b in bounds if b < pos[t.op])
        parts[i] += gradient_checkpoint._nbytes(t)
    held = sum(gradient_checkpoint._nbytes(t) for t in picks)
    return min(1.0, (held + max(parts)) / total), sorted(recomputed, key=tfg.op_id)
