"""MirrorVariableWritesPass: writes to replica 0's variables reach every copy.

Variable initializers, checkpoint restores and users' own ``tf.assign`` ops
live outside the replica and write replica 0's variable.  Each gets a twin per
clone that writes the same value into that clone's copy, and the original waits
for its twins: initializing or restoring replica 0 broadcasts to all replicas.
"""
import tensorflow as tf

from epl import communicators, ir
from epl.rewrite.cloner import clone_op, new_ops
from epl.rewrite.selection import ASSIGN_OPS
from epl.tf_adapter import graph as tfg


def mirror_writes(state, since=-1):
    """Mirror the writes made after op id ``since`` (all of them the first time)."""
    variables = set(state.selection.variables)
    for op in tfg.ops_between(state.graph, since + 1):
        mirror_one(state, op, variables)


def mirror_one(state, op, variables=None):
    variables = set(state.selection.variables) if variables is None else variables
    if op.type not in ASSIGN_OPS or op in state.selection:
        return
    if state.ir_graph.phase_of(op) == ir.REWRITE or not op.inputs:
        return
    target = op.inputs[0].op
    if target not in variables:
        return
    twins = []
    for c in range(1, state.num_clones):
        if not state.is_rep(c):
            continue   # micro-batches share their replica's variables
        inputs = [state.tensor(c, op.inputs[0])] + list(op.inputs[1:])
        twins.append(clone_op(op, inputs, state.clone_name(c, op.name),
                              state.device_for(c, target)))
    tfg.add_control_inputs(op, twins)


def broadcast_initial_values(state, since=-1):
    """Multi-worker: every variable (made after op id ``since``) starts from worker 0's
    initial value."""
    if state.cluster.worker_num <= 1 or state.in_graph:
        return   # (in-graph: one session initializes every variable)
    timeout = state.config.get("communication.timeout_seconds")
    for v in state.graph.get_collection(tf.compat.v1.GraphKeys.GLOBAL_VARIABLES):
        # (init_from_checkpoint makes a ref variable's initializer its restore's Assign
        # tensor, not an op)
        init = getattr(v.initializer, "op", v.initializer)
        if tfg.op_id(init) <= since:
            continue
        if init.type not in ASSIGN_OPS or len(init.inputs) < 2:
            continue
        with new_ops(state.graph), tf.device(state.devices[0]):
            comm = communicators.create(state.devices[:1], "EPL_INIT/" + v.op.name, timeout,
                                        state.cluster)
            value = comm.broadcast([init.inputs[1]], root=0)[0]
        tfg.update_input(init, 1, value)

