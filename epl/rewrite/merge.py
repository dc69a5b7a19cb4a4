"""MergeOutputsPass: the merged value of tensors in epl.GraphKeys collections.

LOCAL_* merges this worker's clones (CONCAT along axis 0 in clone order, SUM,
MEAN).  GLOBAL_* merges every clone of the job: in a multi-worker job whose
workers each run their own graph, the worker's merge is then combined across
workers with one collective (rows of worker 0 first for CONCAT).  Every worker
must then fetch a GLOBAL_* tensor in the same steps (it is a collective): a
worker that does not join fails the others after communication.timeout_seconds,
naming it.

A value computed from per-replica state (``ir.Graph.state_results``: a tf.keras
metric's result, computed from the total and count every replica keeps for its own
rows) is merged by recomputing it from the state of every replica, each variable
combined by its aggregation (SUM: the replicas' counts added), read after every
clone's update.  Averaging the replicas' results would be wrong for a ratio of
sums (AUC, an accuracy over unequal counts).  (Metric state that every clone adds to one
copy of, ``metrics.py``, is read once: that copy already holds every replica's rows, and,
where the graph trains, every worker's the whole job's.)
"""
import logging

import tensorflow as tf

from epl import ir
from epl.ir.graph_keys import GraphKeys, merge_kind
from epl.communicators import native_ops
from epl.communicators.hierarchical import host_device
from epl.rewrite import metrics
from epl.rewrite.cloner import clone_op, new_ops
from epl.rewrite.updates import VARIABLE_OPS
from epl.tf_adapter import graph as tfg

log = logging.getLogger("epl")


def merge_outputs(state, merged_by_name):
    """The merged tensor of every fetched tensor of an epl.GraphKeys collection and of
    every per-replica state result, into ``merged_by_name`` (this pass's product, kept
    across rewrites: fetched tensor name -> merged tensor, read by ``epl.runtime``)."""
    across = state.cluster.worker_num > 1 and not state.in_graph
    with new_ops(state.graph), tf.device(state.devices[0]):
        for key in GraphKeys.ALL:
            scope, how = merge_kind(key)
            for t in state.graph.get_collection(key):
                if t.name in merged_by_name:
                    continue   # (merged by an earlier rewrite)
                copies = state.copies(t)
                name = "EPL_MERGED/%s_%s_%s" % (t.op.name, scope, how)
                if how == "concat":
                    merged = tf.concat(copies, axis=0, name=name)
                else:
                    merged = tf.math.add_n(copies, name=name)
                if scope == "global" and across:
                    merged = _across_workers(state, merged, how, name)
                if how == "mean":
                    total = len(copies) * (state.cluster.worker_num
                                           if scope == "global" and across else 1)
                    merged = tf.math.truediv(merged, tf.cast(total, t.dtype), name=name + "_mean")
                merged_by_name[t.name] = merged
        waiting = []   # (values whose ops a later rewrite may copy)
        for t, aggregation in state.ir_graph.state_results:
            if t.name in merged_by_name or (state.num_clones == 1 and not across):
                continue
            if t.op not in state.selection:
                waiting.append((t, aggregation))
                continue
            merged = _from_every_replica(state, t, aggregation, across)
            if merged is not None:
                merged_by_name[t.name] = merged
        state.ir_graph.state_results[:] = waiting


def _from_every_replica(state, t, aggregation, across):
    """``t`` recomputed from every replica's copy of the state variables it reads
    (``aggregation``: variable op name -> tf.VariableAggregation), or None (logged) where
    ``t`` is not a function of that state alone."""
    reads, order = _state_subgraph(t, aggregation)
    if order is None or not reads:
        log.warning("EPL: %r reads its state inside a loop or condition, or through an op "
                    "that is not a plain read; fetching it returns replica 0's value.", t.name)
        return None
    read_ops = set(r.op for r in reads)
    for op in order:
        for x in ([] if op in read_ops else op.inputs):
            if x not in reads and x.op not in order and _per_replica(state, x):
                log.warning("EPL: %r is computed from %r, which differs between replicas, "
                            "besides its state variables; fetching it returns replica 0's "
                            "value.", t.name, x.name)
                return None
    # Read after everything t waits for, in every clone (each clone's metric update).
    waiting = set(read_ops)
    for op in list(waiting) + order:
        waiting.update(op.control_inputs)
    waits = []
    for c in range(state.num_clones):
        for op in sorted(waiting, key=tfg.op_id):
            copy = state.op(c, op)
            if copy not in waits:
                waits.append(copy)
    values = {}
    for r, var_name in reads.items():
        values[r] = _combined(state, r, var_name, aggregation[var_name], waits, across)
    for op in order:
        if op in read_ops:
            continue
        new = clone_op(op, [values.get(x, x) for x in op.inputs],
                       state.graph.unique_name("EPL_MERGED/" + op.name), state.devices[0])
        values.update(zip(op.outputs, new.outputs))
    return values[t]


def _state_subgraph(t, aggregation):
    """({read tensor: variable op name}, the ops between the reads and ``t`` in
    topological order) of ``t``'s data inputs; (.., None) where one of them is in a loop
    or condition, or takes a state variable other than by a plain read."""
    reads, depends, order = {}, {}, []
    stack = [(t.op, False)]
    while stack:
        op, expanded = stack.pop()
        if op in depends:
            continue
        if expanded:
            depends[op] = any(depends[x.op] or x in reads for x in op.inputs)
            if depends[op]:
                order.append(op)
            continue
        if tfg.control_flow_context(op) is not None:
            return reads, None
        if op.type == "ReadVariableOp" and op.inputs[0].op.name in aggregation:
            reads[op.outputs[0]] = op.inputs[0].op.name
            depends[op] = True
            order.append(op)
            continue
        if op.type in VARIABLE_OPS:
            if op.name in aggregation:
                if not tfg.is_ref_dtype(op.outputs[0].dtype):
                    return reads, None   # a resource handle taken by something else
                reads[op.outputs[0]] = op.name   # a ref variable read as a value
            depends[op] = op.name in aggregation
            continue
        stack.append((op, True))
        stack.extend((x.op, False) for x in op.inputs if x.op not in depends)
    return reads, order


def _per_replica(state, x):
    """``x`` may differ between replicas: computed from the batch or per-replica state."""
    local = state.selection.updates.local_variables
    return any(ir.is_batch_source(op) or op in local
               for op in ir.upstream([x.op], control=False))


def _combined(state, read, var_name, aggregation, waits, across):
    """The value of ``read``'s variable over this worker's replicas (every worker's when
    ``across``), combined by ``aggregation``."""
    var = state.graph.get_operation_by_name(var_name)
    handles, seen = [], set()
    for c in range(state.num_clones):
        h = state.tensor(c, var.outputs[0])
        if h.name not in seen:   # (micro-batches share their replica's copy)
            seen.add(h.name)
            handles.append(h)
    agg = tf.compat.v1.VariableAggregation
    if aggregation in (agg.NONE, agg.ONLY_FIRST_REPLICA):
        handles, across = handles[:1], False
    if var in state.selection.updates.summed_variables and metrics.sums_across_workers(state):
        across = False   # (metric state: every worker's copy holds the job's sum, metrics.py)
    parts = []
    for h in handles:
        with tf.control_dependencies(waits), tf.device(h.op.device or None):
            if h.dtype == tf.resource:
                parts.append(tf.raw_ops.ReadVariableOp(resource=h, dtype=read.dtype))
            else:
                parts.append(tf.identity(h))
    name = "EPL_MERGED/%s_state" % var_name
    total = parts[0] if len(parts) == 1 else tf.math.add_n(parts, name=name)
    if across:
        total = _across_workers(state, total, "sum", name)
    if aggregation == agg.MEAN:
        count = len(handles) * (state.cluster.worker_num if across else 1)
        total = tf.math.truediv(total, tf.cast(count, total.dtype), name=name + "_mean")
    return total


def _across_workers(state, local, how, name):
    cluster = state.cluster
    kw = dict(rank=cluster.worker_index, size=cluster.worker_num,
              timeout_seconds=state.config.get("communication.timeout_seconds"),
              transport=cluster.cross_worker_transport())
    group = "%s/%s" % (cluster.job_id, name)
    with tf.device(host_device(state.devices[0])):
        if how == "concat":
            return native_ops.all_gather(local, group, **kw)
        return native_ops.all_reduce(local, group, reduce_op="sum", **kw)
