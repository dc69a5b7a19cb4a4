"""The capture hooks: how EPL learns, while the user builds the graph, what each op is.

Each hook replaces one point of the adapter's patch table (``epl.tf_adapter.patching``;
the ``CAPTURE`` list at the end, installed by :func:`install`, idempotent).  The
run-time hooks (Session, finalize, Saver.save, summaries, Estimator) are in
``epl.runtime.integration``; the lazy-wrapper graph hooks in ``epl.tf_adapter.deferred``; the
thread's capture flags in ``epl.ir.capture_context``.  What each point does (numbered as
before the split; 5-9 and 16 now live in those modules):

1. ``ops.Graph._create_op_helper``: every new op is recorded in the IR with its
   TaskGraph and phase (capture).
2. ``gradients_util._maybe_colocate_with``: tf.gradients enters it once per
   forward op; ops made inside are that op's backward ops.
3. ``gradients_util._GradientsHelper`` and ``backprop.GradientTape.gradient``
   (graph mode; ``_push_tape`` / ``_pop_tape`` note which ops a tape records):
   the whole call is the backward phase (ops not tied to one
   forward op go to the loss's TaskGraph); each call is recorded
   (``ir.GradientRecord``) so the rewriter can find the gradients a variable
   update consumes, however the update is written.  The features that change a
   user's backward pass register a hook in ``epl.capture.backward_hooks`` (with the hooks
   they run after) and run from there, in that order: AMP (``epl.features.amp``: float16
   forward products, a loss-scaled backward pass; a tape's gradient is then
   computed through tf.gradients), the automatic stages (``epl.features.auto_stages``, with
   ``auto.auto_parallel``), gradient checkpointing (``epl.features.gradient_checkpoint``).
4. ``optimizer.Optimizer.apply_gradients`` (and ``OptimizerV2.apply_gradients``
   of tf.keras), plus ``Optimizer.__init__`` / ``OptimizerV2.__init__``, which
   route a subclass's own ``apply_gradients`` override through the same
   capture: the apply phase; records the (grad, var) pairs the optimizer got
   (where ``communication.clip_after_allreduce = False`` reduces them),
   densifies sparse gradients when ``communication.sparse_as_dense`` is set, and
   orders the updates in groups with ``optimizer.num_apply_group``
   (``epl.features.grouped_apply``); with ``pipeline.num_micro_batch > 1`` on a model
   without annotation, the optimizer applies gradients accumulated across runs
   (``epl.features.accumulate``); with a dynamic AMP loss scale, an overflowed step's
   updates are skipped (``epl.features.amp``).
5. ``saver.Saver.build``: save/restore ops (a default Saver leaves EPL's own
   state out, ``epl.ir.internal_state``); ``saver.Saver.save`` writes only on the chief.
6. ``ops.Graph.finalize``: rewrite before the graph is frozen
   (MonitoredTrainingSession, Estimator).
7. ``session.BaseSession.__init__``: the session sees EPL's devices; for a pipeline
   spanning workers the chief's session runs on its TF server and the other
   workers serve (``epl.runtime.distributed``).
8. ``session.BaseSession.run``, ``make_callable`` and ``_make_callable_from_options``
   (tf.keras): rewrite before the first run, and the ops built since before a later
   one (``epl.runtime.session_run.before_run``); map fetches of merged tensors (epl.GraphKeys);
   the first ``run`` of a session also fetches the gradient checkpoint checks.
9. ``writer.FileWriter.add_event``: summaries are written only by the chief.
10. ``readers.{TFRecord,TextLine,FixedLengthRecord}DatasetV2.__init__``: with
    ``io.slicing`` each worker reads its share of the files (``epl.capture.readers``).
11. ``monitored_session.WorkerSessionCreator.create_session``: in an EPL job every
    worker runs its own local session, so a non-chief session that would wait for
    someone else to initialize it fails at once with the fix instead of hanging.
12. ``estimator.RunConfig.__init__``: an Estimator in an EPL job runs a local session
    on every worker (EPL does the distribution), so RunConfig does not read the
    job's TF_CONFIG (which would make it look for gRPC masters and a "chief"), and
    a ``train_distribute`` / ``eval_distribute`` strategy is dropped with a warning.
    ``estimator.training._TrainingExecutor.run_local``: in train_and_evaluate only
    the chief writes checkpoints, so only the chief evaluates them; the other
    workers train.
13. ``keras.layers.Dense.build`` / ``call`` (also ``tf.layers.Dense``): under
    ``epl.split`` the layer is built sharded (``epl.tensor_parallel.layers``);
    observers (``observing_dense``) see every Dense layer built and called.
14. ``nn_ops.sparse_softmax_cross_entropy_with_logits`` (so also
    ``tf.losses.sparse_softmax_cross_entropy``) and ``math_ops.argmax``, rebound
    in every TensorFlow module that exports them: on class-sharded logits they
    run sharded (``epl.tensor_parallel.losses``); on anything else, unchanged.
    ``special_math_ops.einsum`` (``tf.einsum``), rebound the same way: under ``split``
    an einsum over a split variable's first axis runs shard by shard
    (``epl.tensor_parallel.einsum``).

15. ``ops.Graph._create_op_internal``: before a user op of a scope that runs on
    another number of rows than it is built for (``replicate(k > 1)``, ``split``)
    is created, its fixed-batch inputs entering the scope are replaced by relaxed
    views with an unknown batch dimension (``epl.capture.rebatch``).
16. ``ops.Graph._get_operation_by_name_unsafe`` (so also ``_get_operation_by_tf_operation``:
    an op's inputs, consumers and control edges), ``_as_graph_element_locked`` (names,
    fetches), ``get_operations``, ``_add_new_tf_operations`` and ``_as_graph_def``: the
    replicas' copies get their Python ``Operation`` on first use
    (``epl.tf_adapter.deferred``).
17. tf.keras ``Model._prepare_total_loss``, ``Metric.__call__`` and
    ``Model._make_predict_function``: the loss, the metrics and the predictions keras
    fetches are the global batch's, not clone 0's (``epl.capture.keras_reports``).

Everything else reads and edits graphs through :mod:`epl.ir` and the rewriter.
"""
import contextlib
import inspect
import types

import tensorflow as tf
from tensorflow.python.ops.unconnected_gradients import UnconnectedGradients
from tensorflow.python.util import nest, object_identity

from epl import ir
from epl.features import accumulate
from epl.features import amp
from epl.capture import backward_hooks
from epl.features import grouped_apply
from epl.ir import internal_state
from epl.capture import keras_reports
from epl.capture import rebatch
from epl.ir.capture_context import creating_for, observing_dense, rewriting  # noqa: F401
from epl.ir.capture_context import state as _c
from epl.core.process_state import Env
from epl.capture.readers import sliced_filenames
from epl.ir.strategies import current_strategy
from epl.tensor_parallel import einsum, layers, losses, sharding, variables
from epl.tf_adapter import deferred, objects, patching
from epl.tf_adapter import graph as tfg

original = patching.original


# A variable and the writes of it (not computations colocated with a shard, like
# an embedding lookup's gathers, which belong to the scope that reads them).
_STATE_OPS = frozenset(["VariableV2", "Variable", "VarHandleOp", "Assign", "AssignAdd",
                        "AssignSub", "AssignVariableOp", "AssignAddVariableOp",
                        "AssignSubVariableOp"])


def _classify(graph, op):
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


def _create_op_internal(self, op_type, inputs, *args, **kwargs):
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
    return original("graph.create_op_internal")(self, op_type, inputs, *args, **kwargs)


def _colocated(epl_graph, op):
    """(TaskGraph, shard) of the op ``op`` is colocated with (optimizer slots and
    updates are colocated with their variable)."""
    for group in op.colocation_groups():
        name = group.decode()[len("loc:@"):]
        tg = epl_graph.op_taskgraph.get(name)
        if tg is not None:
            return tg, epl_graph.op_shard.get(name)
    return None, None


def _create_op_helper(self, op, compute_device=True):
    original("graph.create_op_helper")(self, op, compute_device=compute_device)
    if Env.initialized():
        tg, phase, shard = _classify(self, op)
        ir.Graph.get(self).record(op, tg, phase, shard)
        if phase != ir.REWRITE:
            for listener in NEW_OP_LISTENERS:
                listener(self, op)


# Called with (graph, op) for every user op made (the runtime registers the rewrite's
# handling of ops made after a graph was rewritten; capture does not import it).
NEW_OP_LISTENERS = []


@contextlib.contextmanager
def _maybe_colocate_with(op, gradient_uid, colocate_gradients_with_ops):
    c = _c()
    c.grad_ops.append(op)
    try:
        with original("gradients.colocate")(op, gradient_uid, colocate_gradients_with_ops):
            yield
    finally:
        c.grad_ops.pop()


def _backward_call(kind, ys, xs, compute, bind=None):
    """Run ``compute(call)`` (a tf.gradients or GradientTape.gradient call; ``call`` is
    the :class:`epl.capture.backward_hooks.BackwardCall` the hooks share, or None) as the
    backward phase of the loss ``ys`` and record which gradients it returned.

    A user's call (not one EPL builds, nor one inside another backward pass or an
    apply_gradients) goes through the registered backward hooks
    (``epl.capture.backward_hooks``), in their order: every ``prepare``, then ``compute``
    wrapped by every ``wrap`` (the first hook outermost) inside the backward phase,
    then every ``finish``."""
    c = _c()
    ys_list = [y for y in nest.flatten(ys) if hasattr(y, "op")]
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
        grads = nest.flatten(result) if not isinstance(result, list) else list(result)
        ir.Graph.get(graph).add_gradient_record(ir.GradientRecord(
            ys_list, nest.flatten(xs), grads,
            range(first_id, tfg.last_op_id(graph) + 1)))
    return result


def _gradients_helper(ys, xs, *args, **kwargs):
    """tf.gradients (and ``GradientTape.gradient`` where a hook needs a tf.gradients
    call: ``_tape_gradient``)."""
    helper = original("gradients.helper")

    def bind():
        return inspect.signature(helper).bind(ys, xs, *args, **kwargs)

    def compute(call):
        if call is not None and call.bound is not None:   # a hook changed the arguments
            return helper(*call.bound.args, **call.bound.kwargs)
        return helper(ys, xs, *args, **kwargs)
    return _backward_call("gradients", ys, xs, compute, bind)


def _needs_gradients_call(target):
    """A hook that would change this user's backward pass needs a tf.gradients call."""
    c = _c()
    if not Env.initialized() or c.rewriting or c.grad_default or c.apply:
        return False
    ys_list = [y for y in nest.flatten(target) if hasattr(y, "op")]
    call = backward_hooks.BackwardCall(
        "gradients", ys_list[0].graph if ys_list else None, ys_list, None, Env.get().config)
    return any(h.needs_gradients_call and h.applies(call) for h in backward_hooks.order())


def _tape_gradient(self, target, sources, output_gradients=None, unconnected_gradients=None):
    unconnected = UnconnectedGradients(unconnected_gradients or UnconnectedGradients.NONE)
    if tf.executing_eagerly():
        return original("tape.gradient")(self, target, sources, output_gradients, unconnected)
    if _needs_gradients_call(target) and objects.tape_live(self):
        return _tape_as_gradients(self, target, sources, output_gradients, unconnected)
    return _backward_call("tape", target, sources, lambda call: original("tape.gradient")(
        self, target, sources, output_gradients, unconnected))


def _tape_as_gradients(tape, target, sources, output_gradients, unconnected):
    """A graph-mode tape's gradient under AMP, computed by tf.gradients
    (``_gradients_helper``).  The tape recorded the float32 forward ops before AMP
    rebuilt them in float16, so its own backward pass would stay float32 and
    unscaled.  tf.gradients from the tape's targets walks the same forward ops and
    answers as the tape: it does not differentiate through ops the tape did not
    record (``_unrecorded``), a variable source the tape never watched gets no
    gradient (zeros with ``UnconnectedGradients.ZERO``), a non-persistent tape
    answers once."""
    objects.tape_stop_recording_now(tape)
    targets = [tf.convert_to_tensor(t) if isinstance(t, tf.Variable) else t
               for t in nest.flatten(target)]
    flat = nest.flatten(sources)
    watched = object_identity.ObjectIdentitySet(tape.watched_variables())
    live = [i for i, s in enumerate(flat) if not isinstance(s, tf.Variable) or s in watched]
    grad_ys = None if output_gradients is None else nest.flatten(output_gradients)
    with targets[0].graph.as_default():
        grads = tf.compat.v1.gradients(targets, [flat[i] for i in live], grad_ys,
                                       stop_gradients=_unrecorded(tape, targets, flat),
                                       unconnected_gradients=unconnected)
        out = [tf.zeros_like(s) if unconnected == UnconnectedGradients.ZERO else None
               for s in flat]
    for i, g in zip(live, grads):
        out[i] = g
    objects.tape_release(tape)
    return nest.pack_sequence_as(sources, out)


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


def _tape_push(self):
    """A tape records the ops built while it is pushed: keep the graph's op id spans."""
    original("tape.push")(self)
    graph = tf.compat.v1.get_default_graph()
    self.__dict__.setdefault("_epl_spans", []).append(
        [graph, tfg.last_op_id(graph) + 1, None])


def _tape_pop(self):
    spans = self.__dict__.get("_epl_spans")
    if spans and spans[-1][2] is None:
        spans[-1][2] = tfg.last_op_id(spans[-1][0])
    original("tape.pop")(self)


def _apply_gradients(self, grads_and_vars, global_step=None, name=None):
    return _capture_apply(
        grads_and_vars, global_step,
        lambda gvs: original("optimizer.apply_gradients")(self, gvs, global_step, name))


def _apply_gradients_v2(self, grads_and_vars, *args, **kwargs):
    """tf.keras (OptimizerV2): the same capture; its ``iterations`` counter is its own."""
    return _capture_apply(
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
        return _capture_apply(pairs, _global_step_argument(signature, call), apply)
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


def _optimizer_init(self, *args, **kwargs):
    original("optimizer.init")(self, *args, **kwargs)
    _route_override(self, _apply_gradients)


def _optimizer_v2_init(self, *args, **kwargs):
    original("keras_optimizer.init")(self, *args, **kwargs)
    _route_override(self, _apply_gradients_v2)


def _capture_apply(grads_and_vars, global_step, apply):
    """Run ``apply(grads_and_vars)`` as the apply phase and record what it built.

    A nested call (an override calling ``super().apply_gradients``, an optimizer
    wrapping another) belongs to the outermost one."""
    c = _c()
    if not Env.initialized() or c.apply_depth:
        return apply(grads_and_vars)
    grads_and_vars = list(grads_and_vars)
    if Env.get().config.get("communication.sparse_as_dense"):
        grads_and_vars = [(tf.convert_to_tensor(g) if isinstance(g, tf.IndexedSlices) else g, v)
                          for g, v in grads_and_vars]
    graph = tf.compat.v1.get_default_graph()
    epl_graph = ir.Graph.get(graph)
    record = ir.ApplyRecord(grads_and_vars, global_step)
    tg = None
    for _, v in grads_and_vars:
        tg = epl_graph.taskgraph_of(v.op)
        if tg is not None:
            break
    config = Env.get().config
    across = config.get("pipeline.num_micro_batch") > 1 and not epl_graph.taskgraphs
    amp_state = amp.state_of(epl_graph).dynamic
    if across and amp_state is not None:
        raise NotImplementedError(
            "epl.Config: 'amp.loss_scale' = 'dynamic' with 'pipeline.num_micro_batch' = %d "
            "on a model without annotation (accumulation across runs) is not implemented "
            "yet: use a fixed amp.loss_scale, or annotate the model to accumulate inside "
            "each run." % config.get("pipeline.num_micro_batch"))
    c.apply.append(tg)
    c.apply_depth += 1
    first_id = tfg.last_op_id(graph) + 1
    gates = []      # each wraps the gradients the optimizer gets, and its result
    try:
        if across:
            gates.append(accumulate.AcrossRuns(grads_and_vars, config.get("pipeline.num_micro_batch"),
                                    config.get("communication.gradients_reduce_method")))
        if amp_state is not None:
            gates.append(amp.SkipOnOverflow(grads_and_vars, amp_state, config.get("amp.debug_log")))
        result = apply(gates[-1].grads_and_vars if gates else grads_and_vars)
        for gate in reversed(gates):
            result = gate.finish(result)
    finally:
        c.apply.pop()
        c.apply_depth -= 1
    record.across_runs = across
    groups = config.get("optimizer.num_apply_group")
    if groups > 1:
        grouped_apply.apply(graph, grads_and_vars, first_id, groups)
    record.op_ids = range(first_id, tfg.last_op_id(graph) + 1)
    record.result = result
    epl_graph.apply_records.append(record)
    return result


def _saver_build(self, *args, **kwargs):
    c = _c()
    c.save += 1
    graph = None
    if objects.saver_default_var_list(self):
        graph = tf.compat.v1.get_default_graph()
        if graph.get_collection(internal_state.COLLECTION):
            objects.set_saver_var_list(self, internal_state.saveable_default(graph))
        else:
            graph = None
    try:
        built = original("saver.build")(self, *args, **kwargs)
    finally:
        c.save -= 1
    if graph is not None:   # its restore starts EPL's own state again
        internal_state.reinitialize_on_restore(self, graph)
    return built


def _keras_total_loss(self, *args, **kwargs):
    total_loss = original("keras.total_loss")(self, *args, **kwargs)
    keras_reports.loss_built(total_loss)
    return total_loss


def _keras_metric_call(self, *args, **kwargs):
    result = original("keras.metric_call")(self, *args, **kwargs)
    keras_reports.metric_called(self, result)
    return result


def _keras_predict_function(self, *args, **kwargs):
    out = original("keras.predict_function")(self, *args, **kwargs)
    keras_reports.predict_function_made(self)
    return out


def _dense_build(self, input_shape):
    for observer in _c().dense:
        observer.building(self, input_shape)
    if sharding.routing() and sharding.active_split() is not None:
        return layers.build(self, input_shape)
    return original("keras.dense_build")(self, input_shape)


def _dense_call(self, inputs):
    if getattr(self, "_epl_split", None) is not None:
        out = layers.call(self, inputs)
    else:
        out = original("keras.dense_call")(self, inputs)
    for observer in _c().dense:
        observer.called(self)
    return out


def _sparse_softmax_ce(*args, **kwargs):
    """TF 1.15's signature starts with ``_sentinel`` (keywords only), 2.x's compat.v1 one
    with ``labels``: bind to the installed one's."""
    call = inspect.signature(original("nn.sparse_softmax_cross_entropy")).bind(*args, **kwargs)
    call.apply_defaults()
    labels, logits = call.arguments["labels"], call.arguments["logits"]
    name = call.arguments["name"]
    sharded = sharding.lookup(logits) if sharding.routing() else None
    if sharded is not None and sharding.last_axis(sharded, logits.shape.ndims):
        return losses.sparse_softmax_cross_entropy(sharded, labels, name)
    return original("nn.sparse_softmax_cross_entropy")(*call.args, **call.kwargs)


def _argmax(input, axis=None, name=None, dimension=None, output_type=None):  # pylint: disable=redefined-builtin
    output_type = tf.int64 if output_type is None else output_type
    sharded = sharding.lookup(input) if sharding.routing() else None
    if sharded is not None:
        rank = input.shape.ndims
        ax = axis if axis is not None else dimension
        ax = 0 if ax is None else ax
        if isinstance(ax, int) and ax % rank == sharded.axis % rank:
            return losses.argmax(sharded, output_type, name)
    if dimension is not None:   # (passing dimension=None still warns it is deprecated)
        return original("math.argmax")(input, axis=axis, name=name, dimension=dimension,
                                    output_type=output_type)
    return original("math.argmax")(input, axis=axis, name=name, output_type=output_type)


def _einsum(equation, *inputs, **kwargs):
    return einsum.einsum(original("math.einsum"), equation, *inputs, **kwargs)


def _scope_get_variable(self, var_store, name, *args, **kwargs):
    return variables.get_variable(original("variable_scope.get_variable"), self, var_store, name,
                                  *args, **kwargs)


def _embedding_lookup(params, ids, partition_strategy="mod", *args, **kwargs):
    if variables.is_split_variable(params):
        partition_strategy = "div"   # EPL's contiguous shards hold the local model's rows
    return original("nn.embedding_lookup")(params, ids, partition_strategy, *args, **kwargs)


def _reader_init(point):
    def init(self, filenames, *args, **kwargs):
        return original(point)(self, sliced_filenames(filenames), *args, **kwargs)
    return init


# point (epl.tf_adapter.patching) -> the capture hook that replaces it.  Points a
# TensorFlow line lacks (another Keras, no Estimator) are skipped.
CAPTURE = [
    ("graph.create_op_helper", _create_op_helper),
    ("graph.create_op_internal", _create_op_internal),
    ("gradients.colocate", _maybe_colocate_with),
    ("gradients.helper", _gradients_helper),
    ("tape.gradient", _tape_gradient),
    ("tape.push", _tape_push),
    ("tape.pop", _tape_pop),
    ("optimizer.apply_gradients", _apply_gradients),
    ("optimizer.init", _optimizer_init),
    ("keras_optimizer.apply_gradients", _apply_gradients_v2),
    ("keras_optimizer.init", _optimizer_v2_init),
    ("saver.build", _saver_build),
    ("readers.tfrecord", _reader_init("readers.tfrecord")),
    ("readers.textline", _reader_init("readers.textline")),
    ("readers.fixed_length", _reader_init("readers.fixed_length")),
    ("keras.total_loss", _keras_total_loss),
    ("keras.metric_call", _keras_metric_call),
    ("keras.predict_function", _keras_predict_function),
    ("keras.dense_build", _dense_build),
    ("keras.dense_call", _dense_call),
    ("variable_scope.get_variable", _scope_get_variable),
    ("nn.sparse_softmax_cross_entropy", _sparse_softmax_ce),
    ("math.argmax", _argmax),
    ("math.einsum", _einsum),
    ("nn.embedding_lookup", _embedding_lookup),
]

_installed = []


def install():
    """Install the capture hooks and the lazy-wrapper hooks (idempotent)."""
    if _installed:
        return
    deferred.set_wrap_context(rewriting)
    deferred.install_hooks()
    patching.keep_autograph_out("epl")
    for point, hook in CAPTURE:
        patching.install(point, hook)
    _installed.append(True)


def uninstall():
    """Put every patched TensorFlow point back (the runtime integrations' too)."""
    patching.uninstall_all()
    del _installed[:]
