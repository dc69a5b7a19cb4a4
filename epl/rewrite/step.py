"""GlobalStepPass: ``global_step`` advances after everything that reads it in the step.

TensorFlow's own optimizers increment ``global_step`` after their updates, but
hand-written training steps often do not: BERT's fine-tuning code runs
``tf.group(train_op, global_step.assign(global_step + 1))``, so the increment
races with the learning-rate schedule that reads ``global_step`` in the same
run.  A plain single-device run usually reads first; under EPL a step takes
longer (collectives, more devices) and the schedule would read the next step's
value.  Every write of ``global_step`` therefore waits for the ops that read its
value (unless they are computed from the write itself).
"""
from epl import ir
from epl.rewrite.updates import written_variable

_READS = frozenset(["Identity", "ReadVariableOp"])


def order_global_step(state, since=-1):
    import tensorflow as tf
    step = tf.compat.v1.train.get_global_step(state.graph)
    if step is None:
        return
    var = step.op
    initializer = getattr(step, "initializer", None)
    nodes = state.graph._nodes_by_id  # pylint: disable=protected-access
    writes = [op for op in (nodes.get(i) for i in range(since + 1, state.graph._last_id + 1))  # pylint: disable=protected-access
              if op is not None and op is not initializer
              and state.ir_graph.phase_of(op) not in (ir.SAVE, ir.REWRITE)
              and written_variable(op) is var]
    if not writes:
        return
    # global_step's value: its read (ref variables) or ReadVariableOps (resource ones)
    values = [out for consumer in var.outputs[0].consumers() if consumer.type in _READS
              for out in consumer.outputs]
    readers = set(c for v in values for c in v.consumers())
    for w in writes:
        if not state.editable(w):
            continue
        after = ir.downstream([w])
        deps = [r for r in readers if r is not w and r not in after
                and written_variable(r) is None and r not in w.control_inputs]
        if deps:
            w._add_control_inputs(sorted(deps, key=lambda o: o._id))  # pylint: disable=protected-access
