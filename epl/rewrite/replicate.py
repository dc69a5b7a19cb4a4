"""ReplicaClonePass: one copy of the replica's ops per clone, on its device.

Ops are copied in creation order (a topological order of the user's graph).
Just before the first op that reads the gradients of an ``apply_gradients``
call is copied, those gradients are reduced across clones (``gradients.py``),
so every clone's optimizer reads the reduced gradient.
"""
import tensorflow as tf

from epl import ir
from epl.rewrite.cloner import check_clonable, clone_op
from epl.rewrite.gradients import reduce_gradients, targets
from epl.rewrite.selection import VARIABLE_OPS


def place_originals(state):
    """The user's replica ops go to clone 0's device (shared variables and the
    single update too, when a worker shares one copy of its variables)."""
    ops = list(state.selection.ops)
    if state.share_variables:
        ops += [op for tg in state.taskgraphs for op in tg.ops if op not in state.selection and
                (op.type in VARIABLE_OPS or state.ir_graph.phase_of(op) == ir.APPLY)]
    for op in ops:
        check_clonable(op)
        # Our placement replaces TF's colocation hints: tf.gradients colocates a
        # gradient sum with its first input, which may live on another stage.
        if "_class" in op.node_def.attr:
            op._clear_attr("_class")  # pylint: disable=protected-access
        op._set_device(state.device_for(0, op))  # pylint: disable=protected-access


def _device_for(state, c, inputs, op):
    """Clone c's device for the op's stage, unless the op reads a resource variable:
    TF keeps resource reads on the resource's device (a shared variable is on clone 0's)."""
    for t in inputs:
        if t.dtype == tf.resource and t.op.type in VARIABLE_OPS and t.op.device:
            return t.op.device
    return state.device_for(c, op)


def clone_replicas(state):
    sel = state.selection
    # A record whose apply ops are not copied (shared variables) is reduced last.
    pending = sorted(((_first_id(state, rec), rec) for rec in state.ir_graph.apply_records),
                     key=lambda x: x[0])
    for op in sel.ops:
        while pending and op._id >= pending[0][0]:  # pylint: disable=protected-access
            reduce_gradients(state, pending.pop(0)[1])
        owned = op.type in VARIABLE_OPS or state.ir_graph.phase_of(op) == ir.APPLY
        for c in range(1, state.num_clones):
            if owned and not state.is_rep(c):
                # Micro-batches of a replica share its variables and its one update.
                rep = state.reps[c]
                state.op_map[c][op] = state.op(rep, op)
                for t in op.outputs:
                    state.tensor_map[c][t] = state.tensor(rep, t)
                continue
            inputs = [state.tensor(c, t) for t in op.inputs]
            controls = [state.op(c, ci) for ci in op.control_inputs]
            attr = None
            if op.type == "VarHandleOp":
                attr = {"shared_name": tf.AttrValue(s=state.clone_name(c, op.name).encode())}
            new = clone_op(op, inputs, state.clone_name(c, op.name), _device_for(state, c, inputs, op),
                           controls, seed_offset=c, attr_overrides=attr)
            state.op_map[c][op] = new
            for old_t, new_t in zip(op.outputs, new.outputs):
                state.tensor_map[c][old_t] = new_t
    for _, rec in pending:
        reduce_gradients(state, rec)


def _first_id(state, record):
    """The first copied op that reads the record's gradients (or is its apply op)."""
    wanted = set()
    for g, _ in targets(state, record):
        wanted.update([g.values, g.indices] if isinstance(g, tf.IndexedSlices) else [g])
    ids = [op._id for op in state.selection.ops  # pylint: disable=protected-access
           if op._id in record.op_ids or any(t in wanted for t in op.inputs)]  # pylint: disable=protected-access
    return min(ids) if ids else float("inf")


def join_clones(state):
    """Running the user's train op must run every clone's update.

    * Every apply op waits for its copies: whichever of them the user fetches
      (``minimize``'s result, a keras optimizer's counter increment, ...)
      runs every clone's update.
    * An op outside the replica that reads or waits for a replica's apply op
      (the ``global_step`` increment) waits for all copies of it.
    """
    sel = state.selection
    owners = [c for c in range(1, state.num_clones) if state.is_rep(c)]  # hold an update
    for op in sel.ops:
        if (state.ir_graph.phase_of(op) != ir.APPLY or not owners
                or op.type in VARIABLE_OPS or op.type == "Const"):
            continue
        op._add_control_inputs([state.op(c, op) for c in owners])  # pylint: disable=protected-access
    for op in state.graph.get_operations():
        if op in sel or state.ir_graph.phase_of(op) == ir.REWRITE:
            continue
        upstream = list(op.control_inputs) + [t.op for t in op.inputs]
        extra = [state.op(c, up) for up in upstream if up in sel
                 and state.ir_graph.phase_of(up) == ir.APPLY for c in owners]
        if extra:
            op._add_control_inputs(extra)  # pylint: disable=protected-access

