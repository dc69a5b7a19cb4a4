"""UpdateAnalysisPass: which variable writes consume which gradients.

Users write parameter updates in many ways: ``Optimizer.minimize``, an optimizer
subclass that overrides ``apply_gradients`` with its own ``assign`` ops (BERT's
AdamWeightDecay, LAMB), ``tf.gradients`` followed by ``assign_sub``, raw
``Apply*`` ops, keras optimizers.  EPL decides what to reduce from the graph,
not from class or op names: every op that writes a replicated variable is
traced back through the values it reads.

* A write that reaches the replica's gradients (the outputs of a recorded
  ``tf.gradients`` / ``GradientTape.gradient`` call) gets them reduced across
  replicas.  Where the gradients enter an optimizer's ``apply_gradients`` (any
  optimizer, overrides included) and ``communication.clip_after_allreduce`` is
  False, the reduction sits at that boundary instead, after the user's clipping.
  Once reduced, the update is the same in every replica: it runs once per
  replica (once per worker when the worker's replicas share one variable copy,
  once per replica for all its micro-batches).
* A write that reaches the input batch *without* passing a gradient is
  per-replica state.  Of a global variable (batch-norm moving statistics) every
  replica keeps its own copy, updated from its own batch; the checkpoint holds
  replica 0's.  On a trainable variable that would make the replicas' weights
  diverge, so it is an error naming the op.  Of any other variable (a local or
  metric variable, a tf.keras metric's: metric accumulators) it is metric state,
  which a program reads to count every row: one copy that every replica's
  update adds to (``metrics.py``; an update that is not an addition is refused).
* A write that reads neither (``global_step`` aside, handled by selection) is
  the same in every replica and runs once, like an update.
"""
import collections

from epl import ir
from epl.rewrite import metrics
from epl.tf_adapter import graph as tfg
from epl.ir.variable_writes import (  # noqa: F401  (the names the passes import from here)
    VARIABLE_OPS, variable_behind, written_variable)

class ReductionSite(object):
    """Gradients reduced together (one fused collective set, one barrier)."""

    def __init__(self, index, pairs, origin_ids, loss_in_split=False):
        self.index = index            # unique per graph, the same on every worker
        self.pairs = pairs            # [(grad Tensor/IndexedSlices, variable or x)]
        self.origin_ids = origin_ids  # ids of the ops that made them (not readers)
        # The loss is computed by a split scope over every replica's rows: each
        # replica's gradient is a part of the whole, so the parts are summed.
        self.loss_in_split = loss_in_split

    def tensors(self):
        out = []
        for g, _ in self.pairs:
            out.extend(ir.components(g))
        return out


class UpdatePlan(object):
    """What the analysis decided (see the module docstring)."""

    def __init__(self):
        self.sites = []             # ReductionSite, in index order
        self.writes = []            # replica ops that write a replicated variable
        self.run_once = set()       # updates (and what only they read): once per replica
        self.local_variables = set()  # variable ops every replica keeps its own copy of
        self.summed_variables = set()  # metric state: one copy every replica adds to
        self.summed_writes = set()     # the replica's additions to it (per clone)
        self.target = {}            # write op -> variable op it writes
        self.reduced = set()        # the tensors the sites reduce
        self.apply_records = 0      # how many apply_gradients calls were looked at

    def merge(self, later):
        self.sites += later.sites
        self.writes += later.writes
        self.run_once |= later.run_once
        self.local_variables |= later.local_variables
        self.summed_variables |= later.summed_variables
        self.summed_writes |= later.summed_writes
        self.target.update(later.target)
        self.reduced |= later.reduced
        self.apply_records = later.apply_records


def analyze(ir_graph, candidates, batch_ops, is_source, clip_after_allreduce,
            trainable_ops, variables, known=None, earlier_ops=frozenset()):
    """The UpdatePlan for the replica ops ``candidates`` (a set).

    ``batch_ops``: ops computed from an input batch; ``is_source(op)``: the op pulls
    or holds a batch; ``trainable_ops``: variable ops of trainable variables;
    ``variables``: the replicated variable ops.  A later rewrite passes the plan
    ``known`` so far (its reductions are reused, its sites keep their numbers) and
    the replica ops it selected (``earlier_ops``).
    """
    plan = UpdatePlan()
    ordered = sorted(candidates, key=tfg.op_id)
    # A metric made after the model's scope: its variables are outside the replica, its
    # additions (computed from the replica's tensors) inside; metric state if tainted.
    outside = metrics.summed_state(ir_graph.tf_graph, set(
        written_variable(op) for op in ordered if written_variable(op) is not None) - variables)
    for op in ordered:
        var = written_variable(op)
        if var is not None and (var in variables or var in outside):
            plan.writes.append(op)
            plan.target[op] = var

    def per_clone(g):
        return any(t.op in candidates or t.op in earlier_ops for t in ir.components(g))

    grad_owner = {}       # gradient tensor -> (record index, position in record)
    for r, rec in enumerate(ir_graph.gradient_records):
        for i, g in enumerate(rec.grads):
            for t in ir.components(g):
                grad_owner.setdefault(t, (r, i))

    def loss_in_split(records):
        return any(loss_of_split(ir_graph, ir_graph.gradient_records[r]) for r in records)

    reduced = set(known.reduced) if known is not None else set()
    sites = []
    first_record = known.apply_records if known is not None else 0
    plan.apply_records = len(ir_graph.apply_records)
    if not clip_after_allreduce:
        for rec in ir_graph.apply_records[first_record:]:
            pairs = [(g, v) for g, v in rec.grads_and_vars if g is not None and per_clone(g)]
            if pairs:
                tensors = [t for g, _ in pairs for t in ir.components(g)]
                records = _records_behind(tensors, grad_owner, batch_ops)
                sites.append((rec.op_ids[0] if len(rec.op_ids) else 0,
                              ReductionSite(None, pairs, set(), loss_in_split(records))))
                reduced.update(tensors)

    needed = collections.OrderedDict()   # record index -> set of positions
    tainted = {}                         # write op -> (source op, a tensor on the path)
    for w in plan.writes:
        need, taint = _trace(w, reduced, grad_owner, batch_ops, is_source)
        for r, i in need:
            needed.setdefault(r, set()).add(i)
        if taint is not None:
            tainted[w] = taint
    for r in sorted(needed):
        rec = ir_graph.gradient_records[r]
        pairs = [(rec.grads[i], rec.xs[i]) for i in sorted(needed[r])
                 if rec.grads[i] is not None and per_clone(rec.grads[i])]
        if pairs:
            sites.append((rec.op_ids[0] if len(rec.op_ids) else 0,
                          ReductionSite(None, pairs, set(rec.op_ids), loss_in_split([r]))))
            for g, _ in pairs:
                reduced.update(ir.components(g))
    first_index = len(known.sites) if known is not None else 0
    for index, (_, site) in enumerate(sorted(sites, key=lambda s: s[0])):
        site.index = first_index + index
        plan.sites.append(site)
    plan.reduced = reduced - (known.reduced if known is not None else set())

    summed = metrics.summed_state(ir_graph.tf_graph, set(plan.target.values()))
    for w in plan.writes:
        # (a metric's count of a scalar adds a constant, after the batch's value)
        if w not in tainted and plan.target[w] in summed:
            after = metrics.waits_for_batch(w, batch_ops)
            if after is not None:
                tainted[w] = (after, after.outputs[0] if after.outputs else None)
    summed &= set(plan.target[w] for w in tainted)
    for w in [w for w in plan.writes if plan.target[w] in outside - summed]:
        plan.writes.remove(w)   # (not metric state: not the replica's variable either)
        del plan.target[w]
    for w, (source, via) in tainted.items():
        var = plan.target[w]
        if var in summed and var not in trainable_ops:
            if known is not None and var not in candidates and \
                    var not in known.summed_variables:
                raise RuntimeError(
                    "EPL: %r (%s), built after EPL rewrote the graph, adds to the metric "
                    "variable %r from each replica's own batch, but the replicas already "
                    "keep copies of it. Build the metric before the first session.run."
                    % (w.name, w.type, var.name))
            plan.summed_variables.add(var)
            plan.summed_writes.add(w)
            continue
        if known is not None and var not in candidates and var not in known.local_variables:
            raise RuntimeError(
                "EPL: %r (%s), built after EPL rewrote the graph, writes %r from each "
                "replica's own batch: that makes it per-replica state, but the replicas "
                "already share one copy of it. Build it before the first session.run."
                % (w.name, w.type, var.name))
        if var in trainable_ops:
            raise NotImplementedError(
                "EPL: %r (%s) writes the trainable variable %r from values each replica "
                "computes from its own batch (it reads %r, which comes from %r without "
                "passing through a gradient). EPL reduces gradients across replicas; this "
                "update would make the replicas' weights diverge. Compute the update from "
                "tf.gradients / an optimizer, or mark the variable trainable=False if it is "
                "per-replica state (like batch-norm statistics)."
                % (w.name, w.type, var.name, via.name, source.name))
        plan.local_variables.add(var)

    metrics.check_sums(dict((w, plan.target[w]) for w in plan.summed_writes),
                       plan.summed_variables)

    variant = _variant_ops(ordered, candidates, reduced, batch_ops, is_source)
    run_once = set(w for w in plan.writes if w not in tainted)
    run_once.update(op for op in ordered if ir_graph.phase_of(op) == ir.APPLY
                    and op not in variant and op.type not in VARIABLE_OPS
                    and written_variable(op) not in plan.local_variables
                    and written_variable(op) not in plan.summed_variables)
    changed = True
    while changed:   # what only the updates read runs once too
        changed = False
        for op in reversed(ordered):
            if op in run_once or op in variant or op.type in VARIABLE_OPS:
                continue
            users = [c for out in op.outputs for c in out.consumers()]
            users += list(tfg.control_outputs(op))
            if users and all(u in run_once for u in users):
                run_once.add(op)
                changed = True
    plan.run_once = run_once
    return plan


def loss_of_split(ir_graph, record):
    """The gradient call differentiates a loss computed by a split scope."""
    for y in record.ys:
        tg = ir_graph.taskgraph_of(y.op)
        if tg is not None and tg.kind == "split":
            return True
    return False


def _records_behind(tensors, grad_owner, batch_ops):
    """The gradient calls whose outputs ``tensors`` are computed from (through the
    user's clipping, scaling...)."""
    need, _ = _walk_up(tensors, (), grad_owner, batch_ops, lambda op: False)
    return set(r for r, _ in need)


def _trace(write, reduced, grad_owner, batch_ops, is_source):
    """Walk up from ``write``'s values: the gradients it needs (not yet reduced), and a
    batch source it reaches without passing a gradient (or None)."""
    values = [t for t in write.inputs if not ir.is_state_handle(t)]
    return _walk_up(values, reduced, grad_owner, batch_ops, is_source)


def _walk_up(tensors, reduced, grad_owner, batch_ops, is_source):
    """Up from ``tensors`` through ops computed from the batch, stopping at reduced
    tensors and at gradients: ((record, position) of every gradient reached, the first
    batch source reached without passing a gradient as (op, tensor), or None)."""
    stack, seen, need, taint = list(tensors), set(), set(), None
    while stack:
        t = stack.pop()
        if t in seen:
            continue
        seen.add(t)
        if t in reduced:
            continue
        if t in grad_owner:
            need.add(grad_owner[t])
            continue
        op = t.op
        if op not in batch_ops or ir.is_state_handle(t):
            continue
        if is_source(op):
            if taint is None:
                taint = (op, t)
            continue
        stack.extend(op.inputs)
    return need, taint


def _variant_ops(ordered, candidates, reduced, batch_ops, is_source):
    """Replica ops whose value differs between replicas: computed from the batch, other
    than through reduced gradients.  Batch values made outside the replica (the input
    pipeline's pulls, a split scope's rows) differ per replica too.  Creation order is
    topological except along a loop's back edges (a ``Merge`` is made before its
    ``NextIteration``): with loops, passes repeat until nothing changes."""
    variant = set()
    loops = any(op.type in ("NextIteration", "RefNextIteration") for op in ordered)
    changed = True
    while changed:
        changed = False
        for op in ordered:
            if op in variant:
                continue
            if is_source(op):
                variant.add(op)
                changed = True
                continue
            for t in op.inputs:
                if t in reduced:
                    continue
                up = t.op
                if up in variant or (up not in candidates and up in batch_ops):
                    variant.add(op)
                    changed = True
                    break
        changed = changed and loops
    return variant
