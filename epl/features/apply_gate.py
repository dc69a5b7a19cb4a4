"""Run an optimizer's update only when a predicate holds, without building it inside
a ``tf.cond`` (an optimizer must be free to create its variables).

The optimizer receives each gradient through a ``Switch`` on the predicate
(``when``): on a run where it is false its update ops get dead inputs and do not
run, nor does anything that waits for them (``global_step``, Adam's beta powers),
like the untaken branch of a ``tf.cond``.  ``done`` is the always-live op to hand
back to the user: after the update (and whatever follows it) when the predicate
holds, at once otherwise.  Used by accumulation across runs (``epl.features.accumulate``)
and AMP's overflow skip (``epl.features.amp``).

A ``global_step`` advanced by hand outside ``apply_gradients`` (BERT's
``tf.group(train_op, step.assign(step + 1))``) is not behind the gate: every gate
``register``s its predicate, and ``guard_step`` (before a run) makes each such
advance keep the step's value on runs where a predicate is false, so the step
counts the optimizer's updates (once per m runs when accumulating, not on a
skipped overflow).
"""
import logging

import tensorflow as tf

from epl import ir
from epl.ir import capture_context
from epl.tf_adapter import graph as tfg
from epl.ir.variable_writes import advances, written_variable

log = logging.getLogger("epl")


def when(g, pred):
    """``g`` (a Tensor or IndexedSlices), alive only on runs where ``pred`` holds."""
    if isinstance(g, tf.IndexedSlices):
        return tf.IndexedSlices(when(g.values, pred), when(g.indices, pred), g.dense_shape)
    return tf.raw_ops.Switch(data=g, pred=pred)[1]


def done(pred, after, name="step"):
    """An op that always runs: after the ops ``after`` when ``pred`` holds (they are
    dead otherwise, and waited for only then)."""
    skipped, taken = tf.raw_ops.Switch(data=pred, pred=pred)
    with tf.control_dependencies(after):
        taken = tf.identity(taken)
    merged, _ = tf.raw_ops.Merge(inputs=[skipped, taken])
    return tf.group(merged, name=name)


class Gates(object):
    """The gates of one graph (``ir.Graph.feature(Gates)``)."""

    def __init__(self):
        self.flags = []             # predicates gating optimizer updates
        self.step_guarded_id = -1   # ``guard_step`` has seen the ops up to this id


def register(pred):
    """``pred`` gates an optimizer's update (hand-written step advances follow it)."""
    ir.Graph.get(pred.graph).feature(Gates).flags.append(pred)


def guard_step(epl_graph):
    """The ``global_step`` advances built since the last call outside any
    ``apply_gradients`` run only when every registered predicate holds: the increment
    becomes ``where(pred, step + 1, step)`` (``where(pred, 1, 0)`` for an
    ``assign_add``).  Initializers and restores set the step: left alone."""
    graph = epl_graph.tf_graph
    gates = epl_graph.feature(Gates)
    since = gates.step_guarded_id
    gates.step_guarded_id = tfg.last_op_id(graph)
    step = tf.compat.v1.train.get_global_step(graph)
    flags = gates.flags
    if step is None or not flags:
        return
    handled = set()
    for rec in epl_graph.apply_records:
        handled.update(rec.op_ids)
    for op in tfg.ops_between(graph, since + 1):
        if tfg.op_id(op) in handled or written_variable(op) is not step.op \
                or epl_graph.phase_of(op) in (ir.SAVE, ir.REWRITE) or not advances(op, step.op):
            continue
        with graph.name_scope(None), capture_context.rewriting(), \
                tf.compat.v1.device(op.device or None):
            pred = flags[0] if len(flags) == 1 else tf.reduce_all(tf.stack(flags))
            value = op.inputs[1]
            increment = op.type.startswith(("AssignAdd", "AssignSub"))
            kept = tf.zeros_like(value) if increment else step.value()
            tfg.update_input(op, 1, tf.where(pred, value, kept,
                                         name=op.name.split("/")[-1] + "_when_applied"))
        log.info("EPL: %r (%s) advances global_step only on runs that apply the optimizer's "
                 "update", op.name, op.type)
