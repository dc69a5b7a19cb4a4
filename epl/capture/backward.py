"""Backward capture: a user's ``tf.gradients`` / ``GradientTape.gradient`` call is the
backward phase, recorded, and run through the backward-pass hooks (patch points 2 and
3 of ``epl.capture.patches``).

2. ``gradients_util._maybe_colocate_with`` (:func:`maybe_colocate_with`): tf.gradients
   enters it once per forward op; ops made inside are that op's backward ops (its
   TaskGraph, its shard: ``epl.capture.ops``).
3. ``gradients_util._GradientsHelper`` (:func:`gradients_helper`) and
   ``backprop.GradientTape.gradient`` (:func:`tape_gradient`, graph mode;
   ``_push_tape`` / ``_pop_tape`` note which ops a tape records: :func:`tape_push`,
   :func:`tape_pop`): the whole call is the backward phase (ops not tied to one
   forward op go to the loss's TaskGraph); each call is recorded
   (``ir.GradientRecord``) so the rewriter can find the gradients a variable update
   consumes, however the update is written.  The features that change a user's
   backward pass (AMP, the automatic stages, gradient checkpointing) register a hook in
   ``epl.capture.backward_hooks`` with the hooks they run after; this module names none
   of them and runs the registered hooks in their order (:func:`backward_call`).  Where
   a hook needs a tf.gradients call (AMP), a graph-mode tape's gradient is computed
   through tf.gradients (:func:`_tape_as_gradients`).
"""
import contextlib
import inspect

import tensorflow as tf

from epl import ir
from epl.capture import backward_hooks
from epl.core.process_state import Env
from epl.ir.capture_context import state as _c
from epl.tf_adapter import objects
from epl.tf_adapter import graph as tfg
from epl.tf_adapter.patching import original


@contextlib.contextmanager
def maybe_colocate_with(op, gradient_uid, colocate_gradients_with_ops):
    c = _c()
    c.grad_ops.append(op)
    try:
        with original("gradients.colocate")(op, gradient_uid, colocate_gradients_with_ops):
            yield
    finally:
        c.grad_ops.pop()


def backward_call(kind, ys, xs, compute, bind=None):
    """Run ``compute(call)`` (a tf.gradients or GradientTape.gradient call; ``call`` is
    the :class:`epl.capture.backward_hooks.BackwardCall` the hooks share, or None) as the
    backward phase of the loss ``ys`` and record which gradients it returned.

    A user's call (not one EPL builds, nor one inside another backward pass or an
    apply_gradients) goes through the registered backward hooks
    (``epl.capture.backward_hooks``), in their order: every ``prepare``, then ``compute``
    wrapped by every ``wrap`` (the first hook outermost) inside the backward phase,
    then every ``finish``."""
    c = _c()
    ys_list = [y for y in tf.nest.flatten(ys) if hasattr(y, "op")]
    graph = ys_list[0].graph if ys_list else None
    call, hooks = None, []
    if graph is not None and Env.initialized() and not (c.rewriting or c.grad_default or c.apply):
        call = backward_hooks.BackwardCall(kind, graph, ys_list, xs, Env.get().config, bind)
        hooks = backward_hooks.active(call)
    for hook in hooks:
        hook.prepare(call)
    tg = None
    for y in ys_list:
        tg = ir.Graph.get(y.graph).taskgraph_of(y.op)
        if tg is not None:
            break

    def computed():
        return compute(call)
    for hook in reversed(hooks):
        computed = hook.wrap(call, computed)

    def backward():
        c.grad_default.append(tg)
        c.grad_ops.append(None)
        try:
            return computed()
        finally:
            c.grad_ops.pop()
            c.grad_default.pop()
    first_id = tfg.last_op_id(graph) + 1 if graph is not None else 0
    if call is not None:
        call.first_id = first_id
    result = backward()
    if Env.initialized() and graph is not None and not c.rewriting:
        for hook in hooks:
            hook.finish(call, result, backward)
        grads = tf.nest.flatten(result) if not isinstance(result, list) else list(result)
        ir.Graph.get(graph).add_gradient_record(ir.GradientRecord(
            ys_list, tf.nest.flatten(xs), grads,
            range(first_id, tfg.last_op_id(graph) + 1)))
    return result


def gradients_helper(ys, xs, *args, **kwargs):
    """tf.gradients (and ``GradientTape.gradient`` where a hook needs a tf.gradients
    call: ``tape_gradient``)."""
    helper = original("gradients.helper")

    def bind():
        return inspect.signature(helper).bind(ys, xs, *args, **kwargs)

    def compute(call):
        if call is not None and call.bound is not None:   # a hook changed the arguments
            return helper(*call.bound.args, **call.bound.kwargs)
        return helper(ys, xs, *args, **kwargs)
    return backward_call("gradients", ys, xs, compute, bind)


def _needs_gradients_call(target):
    """A hook that would change this user's backward pass needs a tf.gradients call."""
    c = _c()
    if not Env.initialized() or c.rewriting or c.grad_default or c.apply:
        return False
    ys_list = [y for y in tf.nest.flatten(target) if hasattr(y, "op")]
    call = backward_hooks.BackwardCall(
        "gradients", ys_list[0].graph if ys_list else None, ys_list, None, Env.get().config)
    return any(h.needs_gradients_call and h.applies(call) for h in backward_hooks.order())


def tape_gradient(self, target, sources, output_gradients=None, unconnected_gradients=None):
    unconnected = tf.UnconnectedGradients(
        unconnected_gradients or tf.UnconnectedGradients.NONE)
    if tf.executing_eagerly():
        return original("tape.gradient")(self, target, sources, output_gradients, unconnected)
    if _needs_gradients_call(target) and objects.tape_live(self):
        return _tape_as_gradients(self, target, sources, output_gradients, unconnected)
    return backward_call("tape", target, sources, lambda call: original("tape.gradient")(
        self, target, sources, output_gradients, unconnected))


def _tape_as_gradients(tape, target, sources, output_gradients, unconnected):
    """A graph-mode tape's gradient under AMP, computed by tf.gradients
    (:func:`gradients_helper`).  The tape recorded the float32 forward ops before AMP
    rebuilt them in float16, so its own backward pass would stay float32 and
    unscaled.  tf.gradients from the tape's targets walks the same forward ops and
    answers as the tape: it does not differentiate through ops the tape did not
    record (``_unrecorded``), a variable source the tape never watched gets no
    gradient (zeros with ``tf.UnconnectedGradients.ZERO``), a non-persistent tape
    answers once."""
    objects.tape_stop_recording_now(tape)
    targets = [tf.convert_to_tensor(t) if isinstance(t, tf.Variable) else t
               for t in tf.nest.flatten(target)]
    flat = tf.nest.flatten(sources)
    # Variables by identity (a variable's == is elementwise on TF 2.x).
    watched = set(id(v) for v in tape.watched_variables())
    live = [i for i, s in enumerate(flat) if not isinstance(s, tf.Variable) or id(s) in watched]
    grad_ys = None if output_gradients is None else tf.nest.flatten(output_gradients)
    with targets[0].graph.as_default():
        grads = tf.compat.v1.gradients(targets, [flat[i] for i in live], grad_ys,
                                       stop_gradients=_unrecorded(tape, targets, flat),
                                       unconnected_gradients=unconnected)
        out = [tf.zeros_like(s) if unconnected == tf.UnconnectedGradients.ZERO else None
               for s in flat]
    for i, g in zip(live, grads):
        out[i] = g
    objects.tape_release(tape)
    return tf.nest.pack_sequence_as(sources, out)


def _unrecorded(tape, targets, sources):
    """The tensors between ``sources`` and ``targets`` made while ``tape`` was not
    recording (before it, after it, inside its ``stop_recording``): the tape's
    gradients do not flow through them, so tf.gradients must not either."""
    spans = tape.__dict__.get("_epl_spans", [])

    def recorded(op):
        return any(g is op.graph and start <= tfg.op_id(op) and (end is None or tfg.op_id(op) <= end)
                   for g, start, end in spans)
    starts = set((s.handle if isinstance(s, tf.Variable) and hasattr(s, "handle") else s).op
                 for s in sources)
    between = ir.upstream([t.op for t in targets], control=False) & ir.downstream(starts)
    return [op.outputs[0] for op in sorted(between, key=tfg.op_id)
            if op not in starts and op.outputs and not recorded(op)]


def tape_push(self):
    """A tape records the ops built while it is pushed: keep the graph's op id spans."""
    original("tape.push")(self)
    graph = tf.compat.v1.get_default_graph()
    self.__dict__.setdefault("_epl_spans", []).append(
        [graph, tfg.last_op_id(graph) + 1, None])


def tape_pop(self):
    spans = self.__dict__.get("_epl_spans")
    if spans and spans[-1][2] is None:
        spans[-1][2] = tfg.last_op_id(spans[-1][0])
    original("tape.pop")(self)
