"""PipelineSchedulePass: the order in which each stage runs its micro-batches.

For every pipeline replica and stage, the tasks F(m) (the stage's forward ops
of micro-batch m) and B(m) (its backward ops) are put in the order of
``pipeline.strategy`` and chained with control edges: the entry ops of a task
(those with no data input from the same task) wait for a NoOp that waits for
the exit ops of the task before it.  Tasks are found from the IR (stage and
phase of every op), not from op names.

* PreferForward (GPipe): F(0) .. F(M-1), then B(0) .. B(M-1).
* PreferBackward (1F1B / PipeDream-flush): stage s of p first runs
  min(p - s - 1, M) forwards, then alternates one forward and one backward,
  then drains the backwards; at most p micro-batches are in flight on stage 0.
"""
import tensorflow as tf

from epl import ir
from epl.rewrite import loop_contexts
from epl.rewrite.cloner import new_ops
from epl.rewrite.selection import VARIABLE_OPS
from epl.tf_adapter import deferred

_SKIP = frozenset(["Const"]) | VARIABLE_OPS


def schedule_order(strategy, stage, num_stages, num_micro):
    """[("F"|"B", m)] for one stage."""
    if strategy == "PreferForward":
        return [("F", m) for m in range(num_micro)] + [("B", m) for m in range(num_micro)]
    warm = min(num_stages - stage - 1, num_micro)
    order = [("F", m) for m in range(warm)]
    f, b = warm, 0
    while f < num_micro:
        order += [("F", f), ("B", b)]
        f, b = f + 1, b + 1
    order += [("B", m) for m in range(b, num_micro)]
    return order


def _training_path(state):
    """Forward/backward ops the gradients depend on (not metrics, summaries, ...)."""
    frontier = [op for op in state.selection.ops if state.ir_graph.phase_of(op) == ir.BACKWARD]
    seen = set(frontier)
    while frontier:
        op = frontier.pop()
        for up in [t.op for t in op.inputs] + list(op.control_inputs):
            if up not in seen and up in state.selection:
                seen.add(up)
                frontier.append(up)
    return seen


def _task_originals(state, path):
    """{(stage, phase): the user's ops of that task, creation order}."""
    out = {}
    for op in state.selection.ops:
        if op.type in _SKIP or op not in path:
            continue
        phase = state.ir_graph.phase_of(op)
        if phase in (ir.FORWARD, ir.BACKWARD):
            out.setdefault((state.stage_of(op), phase), []).append(op)
    return out


def task_ops(state, clone, stage, phase, path):
    """Every op of one task in one clone (for inspection: makes their Python ops)."""
    originals = _task_originals(state, path).get((stage, phase), [])
    out = []
    for op in originals:
        copy = state.op(clone, op)
        if clone != 0 and copy is op:
            continue
        out.append(copy)
    return out


def task_ends(state, clone, originals, cache):
    """(entry op names, exit op names) of one task in one clone: the task's ops with
    no data input from the task, and those whose outputs no op of the task reads.
    Found on the user's ops (every clone's copy has their structure, and clones of
    one kind copy the same ops: ``cache`` keeps the ends per kind); the copies'
    edges are added in C (``deferred.add_control_edges``)."""
    kind = (clone == 0, state.is_rep(clone), state.reps[clone] == 0)
    key = (id(originals), kind)
    ends = cache.get(key)
    if ends is None:
        members = []
        for op in originals:
            if clone != 0:
                copy = state.op_map[clone].get(op)
                if copy is None or copy is op:
                    continue  # shared with micro-batch 0 (not copied)
            members.append(op)
        inside = set(members)
        fed = set(t.op for op in members for t in op.inputs if t.op in inside)
        ends = cache[key] = ([op for op in members if not any(t.op in inside for t in op.inputs)],
                             [op for op in members if op not in fed])
    entries, exits = ends
    return ([state.op_name(clone, op) for op in entries],
            [state.op_name(clone, op) for op in exits])


def schedule_pipeline(state, orders):
    """Control edges of the micro-batch order of every replica's stages; ``orders`` (this
    pass's product): (replica, stage) -> that order, as ``schedule_order`` gives it."""
    layout = state.layout
    if layout.num_stages == 1 and layout.num_micro_batch == 1:
        return
    strategy = state.config.get("pipeline.strategy")
    path = _training_path(state) & loop_contexts.edge_safe(state.selection.ops)
    tasks = _task_originals(state, path)
    replicas = {}
    cache = {}
    for c, (r, m, _) in enumerate(state.clones):
        replicas.setdefault(r, {})[m] = c
    for r, by_micro in replicas.items():
        for s in range(layout.num_stages):
            order = schedule_order(strategy, s, layout.num_stages, layout.num_micro_batch)
            orders[(r, s)] = order
            previous_end = None
            for k, (kind, m) in enumerate(order):
                phase = ir.FORWARD if kind == "F" else ir.BACKWARD
                entries, exits = task_ends(state, by_micro[m], tasks.get((s, phase), []), cache)
                if not exits:
                    continue
                if previous_end is not None:
                    deferred.add_control_edges(state.graph, [previous_end.name], entries)
                with new_ops(state.graph), tf.device(state.stage_devices[by_micro[m]][state.stage_lane(s)]):
                    previous_end = tf.no_op(name="EPL_SCHEDULE/r%d_s%d_%s%d_end"
                                            % (r, s, kind, m))
                deferred.add_control_edges(state.graph, exits, [previous_end.name])
