"""Metric state under data parallelism: one copy of the sums, every replica adds to it.

A streaming metric (``tf.compat.v1.metrics.accuracy`` / ``mean`` / ``auc``, a tf.keras
metric's ``update_state``, a variable a user puts in ``METRIC_VARIABLES``) keeps totals
and counts in variables that are not model state (local variables, or a keras metric's,
in no collection) and adds each batch's contribution with ``assign_add``.  Under EPL
each replica and micro-batch computes on its own rows.  Were each replica to keep its
own copy of those variables (what ``updates.py`` does with per-replica state such as
batch-norm statistics), the program would read replica 0's rows only.

Why one shared copy rather than per-replica copies summed when read: a program reads a
metric through any tensor computed from its variables (the value, the update op's
result, ``total / count`` written by hand, a keras ``result()``), and a shared variable
makes every one of them right without EPL knowing which tensor is the metric.  An
addition is commutative, so the sum of every clone's ``assign_add`` is plain
TensorFlow's value over all the rows.  Hence:

* ``summed_state``: the variables written from each replica's batch (a value computed
  from it, or after it: ``waits_for_batch``) that are not in ``GLOBAL_VARIABLES`` are
  metric state.  (Model state written per replica, batch-norm moving statistics, is a
  global variable: it keeps a copy per replica, as before.)  A metric built after the
  model's scope is read from the replica's tensors: its additions join the replica
  (``outside_additions``), its variables stay one copy outside it.
* ``check_sums``: each such write must add a value that does not read the metric's own
  state (``assign_add`` / ``assign_sub``, ref or resource); anything else (an
  ``assign`` of a running maximum...) cannot be merged and is refused before the first
  run, naming the variable.  ``selection`` then keeps one copy of these variables per
  worker (on clone 0's device), whatever ``cluster.variable_copies`` says.
* ``join_metric_updates`` (a pass): clone 0's write (the user's op) waits for every other
  clone's copy of it, chained one after the other (two ``AssignAdd`` of a ref variable
  must not run at once).  Fetching the update op runs every clone's update, and the
  value it returns, read after clone 0's write, is the step's total, as in plain TF.
* Between-graph jobs of several workers: each worker holds its own copy.  In a graph
  that trains (``sums_across_workers``), each clone's addend is summed across the
  workers (one all-reduce per write and clone) before it is added: every worker's copy
  holds the job's total.  Every worker must then run the metric updates in the same
  steps (as it runs the training steps).  A graph that only evaluates keeps each
  worker's own sums (Estimator's evaluate runs on the chief alone).
"""
import tensorflow as tf

from epl import ir
from epl.communicators import native_ops
from epl.communicators.hierarchical import host_device
from epl.rewrite.cloner import new_ops
from epl.tf_adapter import deferred
from epl.tf_adapter import graph as tfg
from epl.ir.variable_writes import variable_of

# Writes that add their value to the variable (dense: the value is the input after the
# variable's).
ADDITIVE_OPS = frozenset(["AssignAdd", "AssignSub", "AssignAddVariableOp",
                          "AssignSubVariableOp"])


def summed_state(graph, written):
    """The variable ops of ``written`` that may be metric state: not in
    ``GLOBAL_VARIABLES`` (metric state when a replica writes them from its own batch)."""
    model = _global_variable_ops(graph)
    return set(v for v in written if v not in model)


def _global_variable_ops(graph):
    return set(v.op for v in graph.get_collection(tf.compat.v1.GraphKeys.GLOBAL_VARIABLES))


def outside_additions(ir_graph, chosen, batch_ops, excluded):
    """Additions to metric state that the replica's ops ``chosen`` do not include but
    must: a metric built after the model's scope, whose count adds a constant after the
    batch's values (a control edge, not an input, so capture left it outside every
    TaskGraph).  Each clone copies them, like the total they are the divisor of."""
    model = _global_variable_ops(ir_graph.tf_graph)
    out = set()
    for op in chosen:
        if op not in batch_ops:
            continue
        for w in tfg.control_outputs(op):
            if w in chosen or w in out or w.type not in ADDITIVE_OPS or excluded(w):
                continue
            var = variable_of(w.inputs[0])
            if var is not None and var not in model and ir_graph.taskgraph_of(w) is None:
                out.add(w)
    return out


def waits_for_batch(write, batch_ops):
    """An op computed from the batch that ``write`` waits for (a control input), or None.
    A metric's count often adds a constant after the batch's values are computed
    (``tf.metrics.mean`` of a scalar, a keras metric's count after its total): it counts
    one per replica, like the total it divides, not one per run."""
    for op in write.control_inputs:
        if op in batch_ops:
            return op
    return None


def check_sums(writes, summed):
    """Refuse (naming the variable) a write in ``writes`` ({write op: variable op}) of
    the metric state ``summed`` that is not an addition of a value computed without it."""
    depends = _downstream(summed)
    for w in sorted(writes, key=tfg.op_id):
        var = writes[w]
        values = [t for t in w.inputs[1:]]
        why = None
        if w.type not in ADDITIVE_OPS:
            why = "its op is %s, not an assign_add / assign_sub" % w.type
        elif tfg.control_flow_context(w) is not None:
            why = "it runs inside a loop or condition"
        elif any(t.op in depends for t in values):
            why = "the value it adds is computed from the metric's own state"
        if why is not None:
            raise NotImplementedError(
                "EPL: the metric variable %r (not a global variable: local, in "
                "METRIC_VARIABLES, or a tf.keras metric's) is written by %r from each "
                "replica's own batch, and %s. EPL merges such a variable across replicas "
                "by adding every replica's update to one copy, which is plain TensorFlow's "
                "value over all the rows only for additions. Keep the metric's state as "
                "sums updated with tf.assign_add (e.g. a total and a count, divided when "
                "read); a maximum or a minimum cannot be merged this way."
                % (var.name, w.name, why))


def _downstream(variables):
    """Ops that read (through data edges) one of ``variables``."""
    return ir.downstream(variables, control=False)


def join_metric_updates(state, sel, since=-1):
    """Every clone's copy of a metric write runs, one after the other, before the user's
    (clone 0's); across workers each addend is first summed over the workers (see the
    module docstring).  ``sel``: the replica ops of this rewrite."""
    plan = state.selection.updates
    writes = [w for w in sel.ops if w in plan.summed_writes]
    n = state.num_clones
    across = sums_across_workers(state)
    for w in writes:
        if across:
            for c in range(n):
                _sum_across_workers(state, c, w)
        if n == 1:
            continue
        chain = [state.op_name(c, w) for c in range(1, n)]
        chain = [name for name in chain if name != w.name] + [w.name]
        for before, after in zip(chain, chain[1:]):
            deferred.add_control_edges(state.graph, [before], [after])


def sums_across_workers(state):
    """Each clone's addition is summed over the workers first: a between-graph job of
    several workers whose graph trains (its gradients are reduced across the workers, so
    every worker runs its steps, metric updates included, in the same order).  A graph
    that only evaluates (Estimator's evaluate on the chief alone, as TensorFlow's
    train_and_evaluate runs it) keeps each worker's sums: its replicas' rows, and no
    collective that would wait for workers that never run it."""
    return (state.cluster.worker_num > 1 and not state.in_graph
            and bool(state.selection.updates.sites))


def _sum_across_workers(state, c, w):
    """Clone c's copy of the write ``w`` adds the sum of its value over every worker."""
    cluster = state.cluster
    op = state.op(c, w)
    value = op.inputs[1]
    group = "%s/EPL_METRIC/%s/%d" % (cluster.job_id, w.name, c)
    with new_ops(state.graph), tf.device(host_device(state.devices[c])):
        total = native_ops.all_reduce(
            value, group, rank=cluster.worker_index, size=cluster.worker_num,
            timeout_seconds=state.config.get("communication.timeout_seconds"),
            transport=cluster.cross_worker_transport())
    tfg.update_input(op, 1, total)
