"""GlobalStepPass: ``global_step`` advances after everything that reads it in the step.

TensorFlow's own optimizers increment ``global_step`` after their updates, but
hand-written training steps often do not: BERT's fine-tuning code runs
``tf.group(train_op, global_step.assign(global_step + 1))``, so the increment
races with the learning-rate schedule that reads ``global_step`` in the same
run.  A plain single-device run usually reads first; under EPL a step takes
longer (collectives, more devices) and the schedule would read the next step's
value.  Every write of ``global_step`` therefore waits for the ops that read its
value (unless they are computed from the write itself).

Only the step's *advances* are ordered: writes whose new value is computed from
the step's current one (``assign_add``, ``assign(step + 1)``).  A write that sets
the step without reading it is an initializer or a restore (the variable's own
initializer, ``tf.train.init_from_checkpoint``'s restore, which replaces it, a
Saver's): it runs before anything can read the step, so waiting for the step's
readers would read an uninitialized variable (BERT's warm start from a checkpoint
holding ``global_step``).
"""
from epl import ir
from epl.ir.variable_writes import advances, written_variable  # noqa: F401 (apply_gate)
from epl.tf_adapter import graph as tfg
# How a step's value is read: the read of a ref variable, ReadVariableOp of a resource.
_VALUE_READS = frozenset(["Identity", "ReadVariableOp"])
# Readers that are not part of a training step: a Saver's save writes the checkpoint
# files (a step waiting for it would write the whole model every run).
_NOT_IN_STEP = frozenset(["SaveV2", "Save", "SaveSlices"])


def order_global_step(graph, epl_graph, since=-1):
    """The step's advances made after op id ``since`` wait for the step's readers (on
    a model without annotation too: accumulating across runs, EPL trains it)."""
    import tensorflow as tf
    step = tf.compat.v1.train.get_global_step(graph)
    if step is None:
        return
    var = step.op
    writes = [op for op in tfg.ops_between(graph, since + 1)
              if epl_graph.phase_of(op) not in (ir.SAVE, ir.REWRITE)
              and written_variable(op) is var and advances(op, var)]
    if not writes:
        return
    # global_step's value: its read (ref variables) or ReadVariableOps (resource ones)
    values = [out for consumer in var.outputs[0].consumers() if consumer.type in _VALUE_READS
              for out in consumer.outputs]
    readers = set(c for v in values for c in v.consumers()
                  if c.type not in _NOT_IN_STEP
                  and epl_graph.phase_of(c) not in (ir.SAVE, ir.REWRITE))
    for w in writes:
        after = ir.downstream([w])
        deps = [r for r in readers if r is not w and r not in after
                and written_variable(r) is None and r not in w.control_inputs]
        if deps:
            tfg.add_control_inputs(w, sorted(deps, key=tfg.op_id))
