"""Op capture: every op the user's program makes is recorded in the IR with its
TaskGraph, phase and shard (patch points 1 and 15 of ``epl.capture.patches``).

1. ``ops.Graph._create_op_helper`` (:func:`create_op_helper`): every new op is recorded
   in the IR (``ir.Graph.record``) with the TaskGraph (the ``epl.replicate`` /
   ``epl.split`` scope), phase (forward, backward, apply, save, EPL's own rewrite) and
   shard the thread's capture flags give (``epl.ir.capture_context``, :func:`classify`):
   inside a backward pass an op belongs to the forward op whose gradient is built
   (``epl.capture.backward``), inside ``apply_gradients`` to its variable's scope
   (colocation; ``epl.capture.apply``), outside any scope to the latest TaskGraph it
   reads from.  Every user op is then handed to ``NEW_OP_LISTENERS``.
15. ``ops.Graph._create_op_internal`` (:func:`create_op_internal`): before a user op of
   a scope that runs on another number of rows than it is built for (``replicate(k >
   1)``, ``split``) is created, its fixed-batch inputs entering the scope are replaced
   by relaxed views with an unknown batch dimension (``epl.capture.rebatch``).
"""
from epl import ir
from epl.capture import rebatch
from epl.core.process_state import Env
from epl.ir.capture_context import state as _c
from epl.ir.strategies import current_strategy
from epl.tensor_parallel import propagation, sharding
from epl.tf_adapter import graph as tfg
from epl.tf_adapter.patching import original


# A variable and the writes of it (not computations colocated with a shard, like
# an embedding lookup's gathers, which belong to the scope that reads them).
_STATE_OPS = frozenset(["VariableV2", "Variable", "VarHandleOp", "Assign", "AssignAdd",
                        "AssignSub", "AssignVariableOp", "AssignAddVariableOp",
                        "AssignSubVariableOp"])


def classify(graph, op):
    """(TaskGraph, phase, shard) of a new op from the capture context."""
    c = _c()
    epl_graph = ir.Graph.get(graph)
    if c.rewriting:
        return None, ir.REWRITE, None
    if c.forced:
        tg, phase = c.forced[-1]
        return tg, phase, None
    if c.save:
        return None, ir.SAVE, None
    if c.apply:
        tg, shard = _colocated(epl_graph, op)
        return (tg if tg is not None else c.apply[-1]), ir.APPLY, shard
    if c.grad_ops:
        fwd = c.grad_ops[-1]
        tg = epl_graph.taskgraph_of(fwd) if fwd is not None else None
        if tg is None and c.grad_default:
            tg = c.grad_default[-1]
        # A shard's backward runs on the shard's device.
        return tg, ir.BACKWARD, (epl_graph.shard_of(fwd) if fwd is not None else None)
    if tfg.colocating(graph):
        # State kept beside a variable (an ExponentialMovingAverage's shadow, its
        # initializer) belongs to the variable's scope when no scope is current, and
        # to its shard of a split scope, whatever scope is current.
        tg, shard = _colocated(epl_graph, op)
        if tg is not None and op.type in _STATE_OPS and (
                (tg.kind == "split" and shard is not None) or current_strategy() is None):
            return tg, ir.FORWARD, shard
    tg = _forward_taskgraph(epl_graph, op.inputs)
    if tg is None:
        tg = sharding.shard_taskgraph()
    shard = sharding.current_shard() if tg is not None and tg.kind == "split" else None
    if shard is None and tg is not None and tg.kind == "split":
        shard = _colocated(epl_graph, op)[1]   # a shard variable's initializer, slots
    return tg, ir.FORWARD, shard


def _forward_taskgraph(epl_graph, inputs):
    """The TaskGraph of a new forward op reading ``inputs``."""
    strategy = current_strategy()
    if strategy is not None:
        return epl_graph.taskgraph_for(strategy)
    # Outside any annotation: an op computed from annotated ops (a loss built after
    # the last stage's scope) joins the latest TaskGraph it reads from.  Reading a
    # variable's handle itself (IsVariableInitialized, tf.assign) is bookkeeping.
    fed = [epl_graph.taskgraph_of(t.op) for t in inputs if not ir.is_state_handle(t)]
    fed = [tg for tg in fed if tg is not None]
    return max(fed, key=lambda tg: tg.index) if fed else None


def create_op_internal(self, op_type, inputs, *args, **kwargs):
    c = _c()
    if inputs and Env.initialized() and not (c.rewriting or c.save or c.apply or c.forced):
        epl_graph = ir.Graph.get(self)
        if c.grad_ops:
            fwd = c.grad_ops[-1]
            tg = epl_graph.taskgraph_of(fwd) if fwd is not None else None
            if tg is None and c.grad_default:
                tg = c.grad_default[-1]
            phase = ir.BACKWARD
        else:
            tg, phase = _forward_taskgraph(epl_graph, inputs), ir.FORWARD
        inputs = rebatch.inputs_for(self, tg, inputs, phase)
    # (an op on a sharded tensor under epl.split is built shard by shard there)
    return propagation.create_op(original("graph.create_op_internal"), self, op_type, inputs,
                                 *args, **kwargs)


def _colocated(epl_graph, op):
    """(TaskGraph, shard) of the op ``op`` is colocated with (optimizer slots and
    updates are colocated with their variable)."""
    for group in op.colocation_groups():
        name = group.decode()[len("loc:@"):]
        tg = epl_graph.op_taskgraph.get(name)
        if tg is not None:
            return tg, epl_graph.op_shard.get(name)
    return None, None


def create_op_helper(self, op, compute_device=True):
    original("graph.create_op_helper")(self, op, compute_device=compute_device)
    if Env.initialized():
        tg, phase, shard = classify(self, op)
        ir.Graph.get(self).record(op, tg, phase, shard)
        if phase != ir.REWRITE:
            for listener in NEW_OP_LISTENERS:
                listener(self, op)


# Called with (graph, op) for every user op made (the runtime registers the rewrite's
# handling of ops made after a graph was rewritten; capture does not import it).
NEW_OP_LISTENERS = []


