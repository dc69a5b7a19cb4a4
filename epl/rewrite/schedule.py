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
from epl.rewrite import control_flow
from epl.rewrite.cloner import new_ops
from epl.rewrite.selection import VARIABLE_OPS

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


def task_ops(state, clone, stage, phase, path):
    """The ops of one task in one clone that schedule edges may touch (``path``):
    loops and conditions are ordered through the ops around them
    (``control_flow.edge_safe``)."""
    out = []
    for op in state.selection.ops:
        if op.type in _SKIP or op not in path or state.stage_of(op) != stage:
            continue
        if state.ir_graph.phase_of(op) != phase:
            continue
        copy = state.op(clone, op)
        if clone != 0 and copy is op:
            continue  # shared with micro-batch 0 (not copied)
        out.append(copy)
    return out


def schedule_pipeline(state):
    layout = state.layout
    if layout.num_stages == 1 and layout.num_micro_batch == 1:
        return
    strategy = state.config.get("pipeline.strategy")
    path = _training_path(state) & control_flow.edge_safe(state.selection.ops)
    state.schedule = {}
    replicas = {}
    for c, (r, m, _) in enumerate(state.clones):
        replicas.setdefault(r, {})[m] = c
    for r, by_micro in replicas.items():
        for s in range(layout.num_stages):
            order = schedule_order(strategy, s, layout.num_stages, layout.num_micro_batch)
            state.schedule[(r, s)] = order
            previous_end = None
            for k, (kind, m) in enumerate(order):
                phase = ir.FORWARD if kind == "F" else ir.BACKWARD
                ops = task_ops(state, by_micro[m], s, phase, path)
                if not ops:
                    continue
                members = set(ops)
                if previous_end is not None:
                    for op in ops:
                        if not any(t.op in members for t in op.inputs):
                            op._add_control_inputs([previous_end])  # pylint: disable=protected-access
                exits = [op for op in ops
                         if not any(cons in members for out in op.outputs
                                    for cons in out.consumers())]
                with new_ops(state.graph), tf.device(state.stage_devices[by_micro[m]][s]):
                    previous_end = tf.group(*exits, name="EPL_SCHEDULE/r%d_s%d_%s%d_end"
                                            % (r, s, kind, m))
