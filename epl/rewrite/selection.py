"""Which ops of a replicate TaskGraph are copied per replica, and which are shared.

Copied ("the replica"): forward, backward and apply ops of the TaskGraph, plus
any op outside it that computes on the input batch on its way in.  Shared: the
input pipeline's state (iterators, queues, datasets' resources), placeholders,
``global_step`` and the ops that touch it, save/restore ops, and variable
initializers (those are mirrored instead, see ``mirror.py``).  When a worker's
replicas share one copy of the variables, the updates (and what only they
read) run once and are shared too; ``updates.py`` decides which ops those are,
and which variables are per-replica state that every replica still copies.
"""
import tensorflow as tf

from epl import ir
from epl.rewrite import metrics, updates
from epl.ir.variable_writes import ASSIGN_OPS, VARIABLE_OPS  # noqa: F401 (mirror, split)
from epl.tf_adapter import graph as tfg
SOURCE_OPS = ir.SOURCE_OPS
is_batch_placeholder = ir.is_batch_placeholder
is_source = ir.is_batch_source
_CHECKPOINT_OPS = frozenset(["SaveV2", "RestoreV2", "MergeV2Checkpoints", "Save", "Restore",
                             "RestoreSlice", "SaveSlices"])


class Selection(object):
    """The result: ``ops`` to copy (creation order), and the input edges."""

    def __init__(self):
        self.ops = []
        self.op_set = set()
        self.variables = []        # variable ops that get one copy per replica
        self.sources = []          # SOURCE_OPS whose outputs the replica consumes
        self.placeholders = []     # batch placeholders the replica consumes
        self.shared = []           # replica ops run once per worker (shared variables)
        self.updates = None        # the updates.UpdatePlan

    def merge(self, delta):
        """Add the selection of ops made after this one (a later rewrite)."""
        self.ops += delta.ops
        self.op_set |= delta.op_set
        self.variables += delta.variables
        self.sources += [op for op in delta.sources if op not in self.sources]
        self.placeholders += [op for op in delta.placeholders if op not in self.placeholders]
        self.shared += delta.shared
        self.updates.merge(delta.updates)

    def __contains__(self, op):
        return op in self.op_set


# Resources that live for one step of one computation (a loop's TensorArrays, the
# stacks of a loop's gradient): every clone makes its own.
STEP_RESOURCE_OPS = frozenset(["TensorArrayV3", "TensorArrayV2", "TensorArray", "StackV2",
                               "Stack", "TemporaryVariable"])


def _is_shared_resource(op):
    """An op that creates state other than a variable (iterator, queue, table) that
    lives across steps."""
    kind = op.type
    if kind in VARIABLE_OPS or kind in STEP_RESOURCE_OPS:
        return False
    return (any(ir.is_state_handle(o) for o in op.outputs)
            and not any(ir.is_state_handle(i) for i in op.inputs))


def select(ir_graph, taskgraphs, share_variables=False, clip_after_allreduce=False,
           known=None, since_id=-1):
    """The replica's ops (of every TaskGraph: pipeline stages are one replica).

    With ``share_variables`` the clones of one worker read the user's variables
    and only the user's updates change them, once.  A later rewrite passes the
    selection ``known`` so far and selects the ops made after ``since_id``.
    """
    graph = ir_graph.tf_graph
    initializers = set()
    for key in (tf.compat.v1.GraphKeys.GLOBAL_VARIABLES, tf.compat.v1.GraphKeys.LOCAL_VARIABLES):
        for v in graph.get_collection(key):
            initializers.add(v.initializer)
    step = tf.compat.v1.train.get_global_step(graph)
    step_op = step.op if step is not None else None
    from_step = _step_only_ops(graph, step_op)

    mine = set(tg.index for tg in taskgraphs)
    on_batch = downstream_of_batch(graph)

    def excluded(op):
        tg = ir_graph.taskgraph_of(op)
        if tg is not None and tg.index not in mine:
            return True   # another TaskGraph's (a split scope's shards)
        kind = op.type
        if kind in SOURCE_OPS or kind == "Placeholder" or kind in _CHECKPOINT_OPS:
            return True
        if kind == "PlaceholderWithDefault" and op not in on_batch:
            return True   # a flag (is_training): every replica reads the one the user feeds
        if op in initializers or op in from_step or _is_shared_resource(op):
            return True
        if op in initial_values:
            return True   # read only by initializers: the copies take worker 0's values
        if any(ci in initializers for ci in op.control_inputs):
            return True   # tf.global_variables_initializer()'s group
        if known is not None and (op in known or op in known_shared):
            return True   # an earlier rewrite's
        return ir_graph.phase_of(op) in (ir.SAVE, ir.REWRITE)

    initial_values = _initial_values_only(initializers)
    known_shared = set(known.shared) if known is not None else set()
    sel = Selection()
    wanted = [op for tg in taskgraphs for op in tg.ops
              if tfg.op_id(op) > since_id
              and ir_graph.phase_of(op) in (ir.FORWARD, ir.BACKWARD, ir.APPLY)
              and not excluded(op)]
    chosen = set(wanted)

    # Ops outside the TaskGraph that compute on the batch before it enters
    # (e.g. preprocessing built before set_default_strategy) are per-replica too.
    frontier = list(wanted)
    while frontier:
        op = frontier.pop()
        for t in op.inputs:
            up = t.op
            if up not in chosen and up in on_batch and not excluded(up):
                chosen.add(up)
                frontier.append(up)

    chosen |= metrics.outside_additions(ir_graph, chosen, on_batch, excluded)

    trainable = set(v.op for v in graph.get_collection(tf.compat.v1.GraphKeys.TRAINABLE_VARIABLES))
    variables = set(op for tg in taskgraphs for op in tg.ops if op.type in VARIABLE_OPS)
    sel.updates = updates.analyze(ir_graph, chosen, on_batch, is_source, clip_after_allreduce,
                                  trainable, variables,
                                  known.updates if known is not None else None,
                                  (known.op_set | known_shared) if known is not None
                                  else frozenset())
    # Metric state (updates.py, metrics.py): one copy per worker in either mode.
    shared = sel.updates.summed_variables & chosen
    if share_variables:
        shared |= set(op for op in chosen if op.type in VARIABLE_OPS
                      and op not in sel.updates.local_variables) | sel.updates.run_once
    if shared:
        # One read of a shared variable serves every clone (as in hand-written towers).
        shared |= set(op for op in chosen if _plain_read(op, shared))
        chosen = chosen - shared
        sel.shared = sorted(shared, key=tfg.op_id)
    sel.ops = sorted(chosen, key=tfg.op_id)
    sel.op_set = chosen
    sel.variables = [op for op in sel.ops if op.type in VARIABLE_OPS]
    seen = set()
    for op in sel.ops:
        for t in op.inputs:
            up = t.op
            if up in seen:
                continue
            if up.type in SOURCE_OPS:
                sel.sources.append(up)
                seen.add(up)
            elif is_batch_placeholder(up):
                sel.placeholders.append(up)
                seen.add(up)
    return sel


def _plain_read(op, variables):
    """``v/read`` / ``ReadVariableOp`` of one of ``variables``, outside control flow."""
    return (op.type in ("Identity", "ReadVariableOp") and len(op.inputs) == 1
            and op.inputs[0].op in variables and not op.control_inputs
            and tfg.control_flow_context(op) is None)


def _initial_values_only(initializers):
    """Ops computed only for variable initializers (a random initial value, a
    ``initialized_value()`` condition).  The replicas' variable copies start from
    worker 0's values (``mirror.py``), so these are never copied."""
    only = set()
    # (a warm-started variable's initializer is a tensor: init_from_checkpoint)
    initializers = set(i if isinstance(i, tf.Operation) else i.op for i in initializers)
    frontier = [t.op for init in initializers for t in init.inputs]
    while frontier:
        op = frontier.pop()
        if op in only or op in initializers or op.type in VARIABLE_OPS:
            continue
        users = [c for out in op.outputs for c in out.consumers()] + list(tfg.control_outputs(op))
        if users and all(u in only or u in initializers for u in users):
            only.add(op)
            frontier.extend(t.op for t in op.inputs)
            frontier.extend(op.control_inputs)
    return only


def downstream_of_batch(graph):
    """Ops that (transitively) read an input batch."""
    return ir.downstream([op for op in graph.get_operations()
                          if op.type in SOURCE_OPS or is_batch_placeholder(op)], control=False)


def _step_only_ops(graph, step_op):
    """global_step, the ops that change it, and values computed from it alone.

    Such values (a learning-rate schedule, the step's own initialization
    guards) are the same in every replica: they are computed once and shared,
    and global_step advances once per iteration.
    """
    if step_op is None:
        return set()
    ops = graph.get_operations()
    direct = set(op for op in ops if any(t.op is step_op for t in op.inputs))
    stateful = {}   # op type -> stateful (op_def is parsed per call)

    def varies(op):
        """The op's own value may differ between replicas."""
        kind = op.type
        if kind in SOURCE_OPS or kind in VARIABLE_OPS or is_batch_placeholder(op):
            return True
        if kind not in stateful:
            stateful[kind] = op.op_def.is_stateful
        return stateful[kind] and not _is_shared_resource(op)

    # (walked along consumers: creation order is not always topological, tf.cond)
    blocked = direct | set([step_op])
    variant = _downstream([op for op in ops if op not in blocked and varies(op)], blocked)
    derived = _downstream([step_op] + list(direct), ())
    return (derived - variant) | direct


def _downstream(ops, blocked):
    """``ops`` and every op reading them (data or control), not through ``blocked``."""
    seen = set(ops)
    frontier = list(ops)
    while frontier:
        op = frontier.pop()
        for c in [c for out in op.outputs for c in out.consumers()] + tfg.control_outputs(op):
            if c not in seen and c not in blocked:
                seen.add(c)
                frontier.append(c)
    return seen
