"""Gradient checkpointing (seed 001 §6.2): the backward pass recomputes forward
activations from a few kept tensors instead of holding all of them.

It runs when a ``tf.gradients`` call (``compute_gradients``, ``minimize``, keras)
has built its backward ops (a backward-pass hook, ``epl.capture.backward_hooks``), not
among the rewrite passes: the recomputed ops then belong to that call like the gradients do, so
data parallelism, gradient accumulation and pipelines copy and schedule them as
backward ops of their stage with nothing special.

What it does to the backward ops just built:

1. *Checkpoints*: ``"collection"``: the tensors in ``tf.get_collection("checkpoints")``;
   ``"auto"``: tensors that separate the forward graph (every later forward op
   depends on the earlier ones only through them, like a layer's output), about
   ``sqrt`` of them, spaced by the activation bytes between them (``choose``),
   chosen for each pipeline stage on its own (each stage's device has its own peak).
2. *Recompute*: every forward tensor a backward op reads that is not kept is read
   from a copy of the forward ops between it and the kept tensors (but not
   after the last checkpoint, where the backward pass starts at once).  Kept: the
   checkpoints, and outputs of ops that must not run twice or cannot be copied
   alone: stateful ops (random numbers: a dropout mask is reused, never redrawn;
   variable reads), constants and ops inside ``tf.cond`` / ``tf.while_loop``.  Ops
   of ``epl.split`` scopes are recomputed shard by shard (a copy keeps its original's
   shard, so it runs on that shard's device).  ``Shape``-like readers keep the
   original tensor (it is freed during the forward pass anyway).
3. *Order*: each connected group of copies (a segment) waits (control edges)
   for the gradients its consumers receive from later layers and for the
   consumers of the later segment, excluding ops computed from the group itself:
   a segment is recomputed when the backward pass reaches it, not during the
   forward pass (which would save nothing), and not while the later segment's
   recomputed activations are still held.
"""
import logging

import tensorflow as tf

from epl import ir
from epl.capture import backward_hooks
from epl.ir import capture_context
from epl.tf_adapter import graph as tfg

log = logging.getLogger("epl")

COLLECTION = "checkpoints"
_SHAPE_READERS = frozenset(["Shape", "ShapeN", "Size", "Rank", "BroadcastGradientArgs"])
_CONTROL_FLOW = frozenset(["Enter", "RefEnter", "Exit", "RefExit", "Merge", "RefMerge",
                           "Switch", "RefSwitch", "NextIteration", "RefNextIteration",
                           "LoopCond", "ControlTrigger"])
_DRAWS = frozenset(["Multinomial", "TruncatedNormal", "ParameterizedTruncatedNormal"])
_NEVER = frozenset(["Const", "Placeholder", "PlaceholderWithDefault", "VarHandleOp",
                    "VariableV2", "Variable"])


class Checks(object):
    """``gradient_checkpoint.check_gradients``' checks of one graph
    (``ir.Graph.feature(Checks)``): (the stacked differences, the ops of the checked
    gradients), one per backward pass."""

    def __init__(self):
        self.checks = []


def enabled(config):
    return bool(config.get("gradient_checkpoint.type"))


def apply(graph, ys, first_id, config):
    """Make the backward ops with ids ``first_id``.. (one tf.gradients call of ``ys``)
    recompute forward activations; returns the number of ops copied."""
    epl_graph = ir.Graph.get(graph)
    backward = ir.ops_since(graph, first_id)
    if not backward:
        return 0
    in_backward = set(backward)
    # The ops ``ys`` are computed from, in creation (= topological) order.
    forward = sorted(ir.upstream([y.op for y in ys], stop=in_backward),
                     key=tfg.op_id)
    end = config.get("gradient_checkpoint.end_taskgraph")
    stateful = {}

    def recomputable(op):
        if op in in_backward or op.type in _NEVER or op.type in _CONTROL_FLOW:
            return False
        if tfg.control_flow_context(op) is not None:
            return False
        if epl_graph.phase_of(op) not in (None, ir.FORWARD):
            return False
        tg = epl_graph.taskgraph_of(op)
        if tg is not None and 0 <= end < tg.index:
            return False
        if op.type not in stateful:
            stateful[op.type] = op.op_def.is_stateful
        if stateful[op.type]:
            return False
        # Not a variable's handle, nor a read of one (``v/read``).
        return not any(ir.is_state_handle(t) for t in list(op.outputs) + list(op.inputs))

    candidates = [op for op in forward if recomputable(op)]
    wanted = _read_by(backward, set(candidates))
    if config.get("gradient_checkpoint.type") == "collection":
        checkpoints = set(t for t in graph.get_collection(COLLECTION) if hasattr(t, "op"))
    else:
        checkpoints = set(_choose_per_stage(candidates, wanted, epl_graph))
    # After the last checkpoint the backward pass starts at once: nothing to save there.
    able = ir.upstream([t.op for t in checkpoints], control=False, within=set(candidates))

    def kept(t):
        return t in checkpoints or t.op not in able

    copies = {}     # forward op -> its recomputed copy
    rewired = []    # (backward op, input index, forward tensor)
    for b in backward:
        if tfg.control_flow_context(b) is not None or b.type in _SHAPE_READERS:
            continue
        for i, t in enumerate(b.inputs):
            if t.op in able and not kept(t):
                rewired.append((b, i, t))
    if not rewired:
        return 0
    for _, _, t in rewired:
        _copy_upstream(t.op, kept, copies, epl_graph)
    for b, i, t in rewired:
        tfg.update_input(b, i, copies[t.op].outputs[t.value_index])
    _order(copies, rewired, in_backward)
    log.info("EPL gradient checkpoint (%s): %d checkpoint tensors, %d forward ops recomputed",
             config.get("gradient_checkpoint.type"), len(checkpoints), len(copies))
    return len(copies)


class _Hook(backward_hooks.BackwardHook):
    """Gradient checkpointing's part in a user's backward pass: once its backward ops
    are built, they recompute forward activations (``apply``); with
    ``gradient_checkpoint.check_gradients`` the same gradients are built again without
    recomputation, to be compared once (``add_check``).  After AMP (recomputation
    copies the half-precision forward products AMP rebuilt) and the automatic stages
    (the checkpoints are chosen per stage)."""

    name = "gradient_checkpoint"
    after = ("amp", "auto_stages")

    def applies(self, call):
        return enabled(call.config)

    def finish(self, call, result, recompute):
        apply(call.graph, call.ys, call.first_id, call.config)
        if call.config.get("gradient_checkpoint.check_gradients"):
            # The same gradients without recomputation, compared once.
            add_check(call.graph, tf.nest.flatten(result), tf.nest.flatten(recompute()))


backward_hooks.register(_Hook())


def add_check(graph, recomputed, plain):
    """``gradient_checkpoint.check_gradients``: the largest difference between the
    gradients computed with recomputation and the same gradients computed from the
    kept activations, fetched with the first run of each session (``pending_checks``)
    and logged.  The plain gradients run only then: with the first run that computes
    the recomputed ones (a training step, not the initializer)."""
    diffs = []
    # EPL's own ops: they read the replica's gradients, not the all-reduced ones.
    with tf.compat.v1.name_scope("EPL_GC_CHECK"), capture_context.rewriting():
        for a, b in zip(recomputed, plain):
            if a is None or b is None:
                continue
            a, b = tf.convert_to_tensor(a), tf.convert_to_tensor(b)
            if not a.dtype.is_floating:
                continue
            diffs.append(tf.reduce_max(tf.abs(tf.cast(a - b, tf.float32))))
            diffs.append(tf.reduce_max(tf.abs(tf.cast(b, tf.float32))))
    if diffs:
        sources = set(tf.convert_to_tensor(g).op for g in recomputed if g is not None)
        ir.Graph.get(graph).feature(Checks).checks.append((tf.stack(diffs), sources))


def pending_checks(session, fetches):
    """(when, checks) for this run of ``session``: each session checks once, at its
    first run that computes the checked gradients.

    ``when`` is how the check can run without changing training: "before" (its own
    run with the same feeds, when nothing upstream has state a run advances: fed
    inputs, no random op), "with" (fetched with the step: a run of its own would
    advance an input pipeline or a random stream; the weights are resource
    variables, whose reads are snapshots), else "skip": the plain gradients would
    read ref variables while the step updates them in place (PLATFORM_NOTES), so
    their numbers would be meaningless.
    """
    recorded = ir.Graph.get(session.graph).feature(Checks).checks
    if getattr(session, "_epl_gc_checked", False) or not recorded:
        return None, []
    sources = set().union(*(s for _, s in recorded))
    if not _computes(session.graph, fetches, sources):
        return None, []
    session._epl_gc_checked = True  # pylint: disable=protected-access
    checks = [t for t, _ in recorded]
    upstream = ir.upstream([t.op for t in checks])
    if not any(_advanced_by_a_run(op) for op in upstream):
        return "before", checks
    if not any(tfg.is_ref_dtype(t.dtype) for op in upstream for t in op.inputs):
        return "with", checks
    log.warning("EPL gradient checkpoint check skipped: the model reads ref variables "
                "(tf.Variable / get_variable without use_resource) and draws from an input "
                "pipeline or random ops, so the plain gradients could only be computed in "
                "the training step, racing with its in-place updates. Use resource "
                "variables (or fed inputs and no dropout) to check.")
    return "skip", []


def _advanced_by_a_run(op):
    """Each run of ``op`` moves some state on: an input pipeline, a random stream."""
    return op.type in ir.SOURCE_OPS or op.type in _DRAWS or (
        "Random" in op.type and not op.type.startswith("Stateless"))


def _computes(graph, fetches, wanted):
    """Running ``fetches`` runs one of the ops ``wanted``."""
    ops = []
    for f in _fetch_leaves(fetches):
        try:
            f = graph.as_graph_element(f, allow_tensor=True, allow_operation=True)
        except (TypeError, ValueError, KeyError):
            continue
        ops.append(getattr(f, "op", f))
    return bool(ir.upstream(ops) & wanted)


def _fetch_leaves(fetches):
    """The graph elements in ``fetches``, walked as ``Session.run`` walks them: lists,
    tuples, namedtuples, the values of dicts keyed by anything (MonitoredSession keys
    its fetches by hook objects, which ``nest.flatten`` cannot sort), attrs objects."""
    import collections.abc
    out, stack = [], [fetches]
    while stack:
        f = stack.pop()
        if isinstance(f, collections.abc.Mapping):
            stack.extend(f.values())
        elif isinstance(f, (list, tuple)):
            stack.extend(f)
        elif hasattr(type(f), "__attrs_attrs__"):
            stack.extend(getattr(f, a.name) for a in type(f).__attrs_attrs__)
        elif f is not None:
            out.append(f)
    return out


def report(values):
    """Log the checks' results: the max difference, relative to the max gradient."""
    import numpy as np
    for v in values:
        diff, scale = np.max(v[0::2]), np.max(v[1::2])
        rel = diff / scale if scale > 0 else diff
        level = logging.INFO if np.isfinite(rel) and rel <= 1e-4 else logging.WARNING
        log.log(level, "EPL gradient checkpoint check: recomputed vs plain gradients, max "
                "difference %.3g (max gradient %.3g, relative %.3g)", diff, scale, rel)
    return values


def _read_by(backward, ops):
    """Outputs of ``ops`` that backward ops read (not for their shape only)."""
    out = set()
    for b in backward:
        if b.type in _SHAPE_READERS:
            continue
        out.update(t for t in b.inputs if t.op in ops)
    return out


def _nbytes(t):
    """Bytes of ``t`` per unknown dimension (activations share the batch dimension,
    so only their ratios matter)."""
    n = max(t.dtype.size, 1)
    if t.shape.ndims is None:
        return n
    for d in t.shape.dims:
        n *= d.value if d.value is not None else 1
    return n


def _choose_per_stage(ops, wanted, epl_graph):
    """``choose`` for each taskgraph's ops (a pipeline stage) on its own.

    Each stage runs on its own devices, so its peak is its own checkpoints plus its
    own largest recomputed segment: one byte axis over the whole model would trade
    one stage's memory against another's, and its picks would land in whichever
    stage the sqrt spacing happens to favour (with TF 2.x's lighter dropout, which
    keeps a bool mask instead of TF 1.x's float mask and scaled copy, a single
    checkpoint at the end of the first stage: nothing recomputed in the second)."""
    stages = {}
    for op in ops:
        tg = epl_graph.taskgraph_of(op)
        stages.setdefault(tg.index if tg is not None else -1, []).append(op)
    picks = []
    for index in sorted(stages):
        members = set(stages[index])
        picks.extend(choose(stages[index], set(t for t in wanted if t.op in members)))
    return picks


def choose(ops, wanted):
    """Checkpoints for ``"auto"``: among the tensors that separate the forward ops
    ``ops`` (in topological order), about sqrt(n) spaced evenly by the bytes of the
    activations the backward pass reads (``wanted``) between them.

    The separators: ``ir.separators`` (a residual stream between blocks, a plain
    layer's output)."""
    pos = {op: i for i, op in enumerate(ops)}
    alone = ir.separators(ops)
    read = [t for t in alone if t in wanted]
    separators = read or alone
    if len(separators) < 2:
        return []
    # Activation bytes the backward pass reads, up to each op.
    cum, total = [], 0
    for op in ops:
        total += sum(_nbytes(t) for t in op.outputs if t in wanted)
        cum.append(total)
    best = None
    for k in range(1, len(separators) + 1):
        picks = _spaced(separators, [cum[pos[t.op]] for t in separators], total, k)
        cost = _cost(picks, pos, cum, total)
        if best is None or cost < best[0]:
            best = (cost, picks)
    return best[1]


def _spaced(separators, at, total, k):
    """``k`` separators nearest to the k evenly spaced marks of ``total`` bytes."""
    picks, i = [], 0
    for j in range(1, k + 1):
        mark = total * j / float(k + 1)
        while i + 1 < len(separators) and abs(at[i + 1] - mark) <= abs(at[i] - mark):
            i += 1
        if not picks or picks[-1] is not separators[i]:
            picks.append(separators[i])
    return picks


def _cost(picks, pos, cum, total):
    """Peak estimate: the checkpoints held plus the largest segment recomputed."""
    held = sum(_nbytes(t) for t in picks)
    bounds = [0] + [cum[pos[t.op]] for t in picks] + [total]
    return held + max(b - a for a, b in zip(bounds, bounds[1:]))


def _copy_upstream(op, kept, copies, epl_graph):
    """Copy ``op`` and the not-kept forward ops it reads (iteratively: deep models)."""
    stack = [op]
    while stack:
        cur = stack[-1]
        if cur in copies:
            stack.pop()
            continue
        pending = [t.op for t in cur.inputs if not kept(t) and t.op not in copies]
        if pending:
            stack.extend(pending)
            continue
        stack.pop()
        inputs = [t if kept(t) else copies[t.op].outputs[t.value_index] for t in cur.inputs]
        g = cur.graph
        attrs = dict(cur.node_def.attr.items())
        with g.name_scope(None), g.control_dependencies(None), \
                capture_context.creating_for(epl_graph.taskgraph_of(cur), ir.BACKWARD):
            new = tfg.create_op(g, cur.type, inputs, [o.dtype for o in cur.outputs],
                                input_types=[t.dtype for t in cur.inputs],
                                name=cur.name + "_recompute", attrs=attrs, op_def=cur.op_def)
        tfg.set_device(new, cur.device)
        shard = epl_graph.shard_of(cur)
        if shard is not None:   # a split scope's op: its copy runs on the same shard
            epl_graph.op_shard[new.name] = shard
        if cur.control_inputs:
            tfg.add_control_inputs(new, cur.control_inputs)
        copies[cur] = new


def _order(copies, rewired, backward):
    """Each connected group of copies (a segment) waits for the gradients its readers
    receive from outside the group (not computed from it), and for the readers of
    the segment after it: recomputed when the backward pass reaches it, once the
    later segment's recomputed activations are freed (else the weight gradients of
    one segment, off the critical path, keep its activations alive while the next
    is recomputed).  Edges from ops computed from the group itself would close a
    cycle: left out."""
    made = set(copies.values())
    origin = dict((new, old) for old, new in copies.items())
    parent = {op: op for op in made}

    def find(op):
        while parent[op] is not op:
            parent[op] = parent[parent[op]]
            op = parent[op]
        return op
    for op in made:
        for t in op.inputs:
            if t.op in made:
                parent[find(t.op)] = find(op)
    groups = {}
    for op in made:
        groups.setdefault(find(op), []).append(op)
    readers = {}
    for b, _, t in rewired:
        readers.setdefault(find(copies[t.op]), set()).add(b)
    # Latest segment (in forward order) first.
    ordered = sorted(groups.items(), key=lambda kv: -max(tfg.op_id(origin[op]) for op in kv[1]))
    later = ()
    for root, members in ordered:
        down = ir.downstream(members)
        mine = readers.get(root, ())
        triggers = set(b for b in later if b not in down)
        for b in mine:
            for t in b.inputs:
                if t.op in backward and t.op not in made and t.op not in down:
                    triggers.add(t.op)
        later = mine
        if not triggers:
            continue
        heads = [op for op in members if not any(t.op in made for t in op.inputs)]
        for h in heads:
            tfg.add_control_inputs(h, sorted(triggers, key=tfg.op_id))
