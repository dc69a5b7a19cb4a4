"""Apply capture: a user's ``apply_gradients`` call is the apply phase, recorded, and
run through the apply-path hooks (patch point 4 of ``epl.capture.patches``).

4. ``optimizer.Optimizer.apply_gradients`` (:func:`apply_gradients`) and
   ``OptimizerV2.apply_gradients`` of tf.keras (:func:`apply_gradients_v2`), plus
   ``Optimizer.__init__`` / ``OptimizerV2.__init__`` (:func:`optimizer_init`,
   :func:`optimizer_v2_init`), which route a subclass's own ``apply_gradients``
   override (BERT's AdamWeightDecay, LAMB...) through the same capture: the call is the
   apply phase (its ops belong to their variable's TaskGraph, ``epl.capture.ops``); the
   (gradient, variable) pairs the optimizer got are recorded (``ir.ApplyRecord``: the
   rewrite reduces them where ``communication.clip_after_allreduce = False``, and
   finds the update's ops by their ids).  The features that change the call
   (densifying sparse gradients, accumulation across runs, AMP's overflow skip,
   grouped apply) register a hook in ``epl.capture.apply_hooks`` with the hooks they
   run after; this module imports none of them and runs the registered hooks in their
   order (:func:`capture_apply`).
"""
import inspect
import types

import tensorflow as tf

from epl import ir
from epl.capture import apply_hooks
from epl.core.process_state import Env
from epl.ir.capture_context import state as _c
from epl.tf_adapter import graph as tfg
from epl.tf_adapter.patching import original


def apply_gradients(self, grads_and_vars, global_step=None, name=None):
    return capture_apply(
        grads_and_vars, global_step,
        lambda gvs: original("optimizer.apply_gradients")(self, gvs, global_step, name))


def apply_gradients_v2(self, grads_and_vars, *args, **kwargs):
    """tf.keras (OptimizerV2): the same capture; its ``iterations`` counter is its own."""
    return capture_apply(
        grads_and_vars, None,
        lambda gvs: original("keras_optimizer.apply_gradients")(self, gvs, *args, **kwargs))


def _route_override(optimizer, patched):
    """An optimizer class that overrides ``apply_gradients`` (BERT's AdamWeightDecay,
    LAMB...) never reaches the patched base method: give the instance a wrapper that
    captures its own method the same way.  Its arguments are read by its own
    signature: an override need not order them as the base class does (a keras
    OptimizerV2's second parameter is ``name``)."""
    own = type(optimizer).apply_gradients
    if own is patched or "apply_gradients" in vars(optimizer):
        return
    signature = inspect.signature(own)

    def apply_gradients(self, *args, **kwargs):
        try:
            call = signature.bind(self, *args, **kwargs)
        except TypeError:
            return own(self, *args, **kwargs)   # Python's own error for the call
        pairs, replace = _pairs_argument(signature, call)

        def apply(gvs):
            replace(gvs)
            return own(*call.args, **call.kwargs)
        return capture_apply(pairs, _global_step_argument(signature, call), apply)
    optimizer.apply_gradients = types.MethodType(apply_gradients, optimizer)


def _pairs_argument(signature, call):
    """The (gradient, variable) pairs a bound ``apply_gradients`` call got (its first
    parameter after ``self``, the first of its ``*args``, or ``grads_and_vars=`` in
    its ``**kwargs``), and a function that replaces them in the call."""
    params = list(signature.parameters.values())[1:]
    first = params[0] if params else None
    if first is not None and first.kind not in (first.VAR_POSITIONAL, first.VAR_KEYWORD):
        def replace_named(pairs):
            call.arguments[first.name] = pairs
        return call.arguments[first.name], replace_named
    if first is not None and first.kind == first.VAR_POSITIONAL and call.arguments.get(first.name):
        rest = call.arguments[first.name]

        def replace_first(pairs):
            call.arguments[first.name] = (pairs,) + tuple(rest[1:])
        return rest[0], replace_first
    for p in params:
        given = call.arguments.get(p.name, {}) if p.kind == p.VAR_KEYWORD else {}
        if "grads_and_vars" in given:
            return given["grads_and_vars"], lambda pairs: given.update(grads_and_vars=pairs)
    raise TypeError("apply_gradients() missing its first argument, grads_and_vars")


def _global_step_argument(signature, call):
    """The ``global_step`` of a bound ``apply_gradients`` call: the parameter of that
    name, or a keyword collected by ``**kwargs``; None where the method takes none
    (a keras OptimizerV2 counts its own ``iterations``)."""
    param = signature.parameters.get("global_step")
    if param is not None and param.kind not in (param.VAR_POSITIONAL, param.VAR_KEYWORD):
        default = None if param.default is param.empty else param.default
        return call.arguments.get("global_step", default)
    for p in signature.parameters.values():
        if p.kind == p.VAR_KEYWORD:
            return call.arguments.get(p.name, {}).get("global_step")
    return None


def optimizer_init(self, *args, **kwargs):
    original("optimizer.init")(self, *args, **kwargs)
    _route_override(self, apply_gradients)


def optimizer_v2_init(self, *args, **kwargs):
    original("keras_optimizer.init")(self, *args, **kwargs)
    _route_override(self, apply_gradients_v2)


def capture_apply(grads_and_vars, global_step, apply):
    """Run ``apply(grads_and_vars)`` as the apply phase and record what it built.

    A user's call goes through the registered apply hooks (``epl.capture.apply_hooks``),
    in their order: each hook is asked whether it ``applies`` (after the hooks before
    it prepared) and ``prepare``s, outside the apply phase; inside it, ``apply`` wrapped
    by every ``wrap`` (the first hook outermost) builds the update; after it, every
    ``finish``.  A nested call (an override calling ``super().apply_gradients``, an
    optimizer wrapping another) belongs to the outermost one."""
    c = _c()
    if not Env.initialized() or c.apply_depth:
        return apply(grads_and_vars)
    graph = tf.compat.v1.get_default_graph()
    call = apply_hooks.ApplyCall(graph, grads_and_vars, global_step, Env.get().config)
    hooks = []
    for hook in apply_hooks.order():
        if hook.applies(call):
            hook.prepare(call)
            hooks.append(hook)
    epl_graph = call.epl_graph
    record = ir.ApplyRecord(call.grads_and_vars, global_step)
    tg = None
    for _, v in call.grads_and_vars:
        tg = epl_graph.taskgraph_of(v.op)
        if tg is not None:
            break
    build = apply
    for hook in reversed(hooks):
        build = hook.wrap(call, build)
    c.apply.append(tg)
    c.apply_depth += 1
    call.first_id = tfg.last_op_id(graph) + 1
    try:
        result = build(call.grads_and_vars)
    finally:
        c.apply.pop()
        c.apply_depth -= 1
    call.result = result
    for hook in hooks:
        hook.finish(call)
    record.across_runs = call.across_runs
    record.op_ids = range(call.first_id, tfg.last_op_id(graph) + 1)
    record.result = result
    epl_graph.apply_records.append(record)
    return result
