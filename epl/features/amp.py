"""Memory-efficient automatic mixed precision, O1 (seed 001 §6.5, ``amp.level``).

Three pieces, each applied where the user's program builds the part it changes:

1. *Half-precision math* (``convert``, before a ``tf.gradients`` call builds the
   backward pass): every allow-listed forward op the loss depends on (``ALLOW``:
   matrix products, ``tf.einsum`` included, and convolutions) is rebuilt in float16
   between casts; its consumers read the float32 cast of its result (a shard's op of
   an ``epl.split`` scope is rebuilt on its shard).  The backward
   pass TensorFlow then builds for it is float16 too.  Weights stay float32
   variables: each use casts the value it reads, no float16 copy of a variable
   exists.  Everything else (softmax cross-entropy, reductions, exp/log, normalization statistics,
   the optimizer) stays float32.  ``amp.dtype: bfloat16`` (an EPL extension) uses
   bfloat16 instead: float32's exponent range, so loss scaling is optional.
2. *Loss scaling* (``scaled_gradients``, around the same call): the backward pass
   starts from ``scale`` instead of 1 and the gradients it returns are divided by
   it, so small float16 gradients do not flush to zero.  ``amp.loss_scale``: a
   number (fixed) or ``"dynamic"``: start 2^15, halve on overflow, double after
   2,000 clean steps.
3. *Skipping overflowed steps* (``SkipOnOverflow``, around ``apply_gradients``: an
   apply-path hook, ``epl.capture.apply_hooks``, named "amp", after "accumulate";
   dynamic scale only): the optimizer's update is gated on "every gradient is
   finite" (``epl.features.apply_gate``); on an overflow its updates (``global_step``
   included) do not run, like the untaken branch of a ``tf.cond``.  The flag is
   computed from the gradients the update reads — with data parallelism the
   all-reduced ones — so every replica and micro-batch takes the same decision.
   A ``global_step`` incremented by hand outside ``apply_gradients`` keeps its
   value on a skipped step (``apply_gate.guard_step``); a trainable variable
   written from gradients by hand is refused (``guard_updates``, before a run).
"""
import logging

import tensorflow as tf

from epl import ir
from epl.features import apply_gate
from epl.capture import apply_hooks
from epl.capture import backward_hooks
from epl.ir import capture_context
from epl.core.process_state import Env
from epl.ir.internal_state import variable
from epl.tf_adapter import graph as tfg, op_types
from epl.ir.variable_writes import hand_written_update, written_variable

log = logging.getLogger("epl")

# The matrix products of this TensorFlow line (tf.einsum's fused ``Einsum`` op on 2.x,
# its MatMul / BatchMatMulV2 lowering on 1.15) and convolutions.
ALLOW = op_types.matrix_products() | frozenset(["Conv2D"])
INITIAL_SCALE = 2.0 ** 15
GROWTH_INTERVAL = 2000
COLLECTION = "epl_amp_state"


class AmpState(object):
    """AMP's state of one graph (``ir.Graph.feature(AmpState)``)."""

    def __init__(self):
        self.converted = {}       # float32 op -> its float16 rebuild (``convert``)
        self.dynamic = None       # (loss scale, good steps) variables of a dynamic scale
        self.guarded_id = -1      # ``guard_updates`` has seen the ops up to this id


def state_of(epl_graph):
    """AMP's state of ``epl_graph`` (an ``ir.Graph``)."""
    return epl_graph.feature(AmpState)


def enabled(config):
    return bool(config.get("amp.level"))


def half_dtype():
    """``amp.dtype``: float16, or bfloat16 (not every product has a bfloat16 kernel on
    every device: see ``_has_half_kernel``)."""
    return tf.bfloat16 if Env.get().config.get("amp.dtype") == "bfloat16" else tf.float16


_WARNED = set()


def _has_half_kernel(op_type, half):
    """TensorFlow can run ``op_type`` in ``half`` on the job's devices (TF 1.15's CPU has
    a bfloat16 MatMul but no bfloat16 BatchMatMulV2 or Conv2D): the others stay float32,
    said once, instead of failing with "Cannot assign a device" at the first run."""
    device = "GPU" if Env.get().cluster.device_type == "gpu" else "CPU"
    if op_types.has_kernel(op_type, half, device):
        return True
    if (op_type, half) not in _WARNED:
        _WARNED.add((op_type, half))
        log.warning("EPL AMP: TensorFlow %s has no %s kernel of %s on %s: these products "
                    "stay float32.", tf.__version__, half.name, op_type, device)
    return False


def convert(graph, ys):
    """Rebuild the allow-listed float32 ops ``ys`` depend on in float16."""
    epl_graph = ir.Graph.get(graph)
    converted = state_of(epl_graph).converted
    half = half_dtype()
    todo = [op for op in ir.upstream([y.op for y in ys], control=False)
            if op.type in ALLOW and op not in converted and _convertible(epl_graph, op)
            and _has_half_kernel(op.type, half)]
    for op in sorted(todo, key=tfg.op_id):
        tg = epl_graph.taskgraph_of(op)
        g = op.graph
        first = tfg.last_op_id(g) + 1
        with g.name_scope(None), g.control_dependencies(None), \
                capture_context.creating_for(tg, ir.FORWARD), tf.compat.v1.device(op.device or None):
            halves = [_half(t, half) for t in op.inputs]
            attrs = dict(op.node_def.attr.items())
            attrs["T"] = tf.compat.v1.AttrValue(type=half.as_datatype_enum)
            new = tfg.create_op(g, op.type, halves, [half], input_types=[half] * len(halves),
                                name=op.name + "_fp16", attrs=attrs, op_def=op.op_def)
            if op.control_inputs:
                tfg.add_control_inputs(new, op.control_inputs)
            back = tf.cast(new.outputs[0], tf.float32, name=op.name + "_fp32")
        shard = epl_graph.shard_of(op)
        if shard is not None:   # a split scope's shard: the rebuild runs on its device
            for made in ir.ops_since(g, first):
                epl_graph.op_shard[made.name] = shard
        for consumer in list(op.outputs[0].consumers()):
            if consumer is back.op:
                continue
            for i, t in enumerate(consumer.inputs):
                if t is op.outputs[0]:
                    tfg.update_input(consumer, i, back)
        converted[op] = new
    return len(todo)


def rebuilt(graph, tensors):
    """``tensors`` (tf.gradients' ``stop_gradients``), each output of an op ``convert``
    rebuilt in float16 replaced by the rebuild's output: the backward pass reads the
    rebuild, so a stop at the float32 op it replaced would stop nothing."""
    converted = state_of(ir.Graph.get(graph)).converted
    return [converted[t.op].outputs[t.value_index] if t.op in converted else t
            for t in tensors]


def recast_weights(graph, first_id):
    """The backward ops (ids ``first_id``..) that read a weight's float16 cast made in
    the forward pass read a new cast of the same float32 value instead, made when
    their gradient input is ready: the forward pass's half copy of each weight is
    freed after its forward use instead of living until the backward pass."""
    backward = ir.ops_since(graph, first_id)
    mine = set(backward)
    half = half_dtype()
    made = 0
    for b in backward:
        if tfg.control_flow_context(b) is not None:
            continue
        for i, t in enumerate(b.inputs):
            if not _weight_cast(t, half) or t.op in mine:
                continue
            triggers = [x.op for x in b.inputs if x.op in mine]
            with graph.name_scope(None), graph.control_dependencies(triggers), \
                    tf.compat.v1.device(t.op.device or None):
                again = tf.cast(t.op.inputs[0], half, name=t.op.name + "_again")
            tfg.update_input(b, i, again)
            made += 1
    return made


def _weight_cast(t, half=tf.float16):
    """``t`` is a ``half`` cast of a variable's value (a ref variable's read, a resource
    read)."""
    if t.op.type != "Cast" or t.dtype != half:
        return False
    src = t.op.inputs[0].op
    if src.type == "ReadVariableOp":
        return True
    return src.type == "Identity" and src.inputs and tfg.is_ref_dtype(src.inputs[0].dtype)


def _convertible(epl_graph, op):
    if tfg.control_flow_context(op) is not None:
        return False
    if epl_graph.phase_of(op) not in (None, ir.FORWARD):
        return False
    return op.get_attr("T") == tf.float32


def _half(t, half):
    """``t`` in ``half``: the source of our own float32 cast (two converted ops in a row
    pass the half value along), else a cast at use (of a weight: no half copy is kept)."""
    if t.op.type == "Cast" and t.op.name.endswith("_fp32") and t.op.inputs[0].dtype == half:
        return t.op.inputs[0]
    return tf.cast(t, half)


def loss_scale(graph, config):
    """The loss scale tensor (a variable for "dynamic", a constant otherwise) and, for
    "dynamic", the variables that steer it: (scale, state or None)."""
    value = config.get("amp.loss_scale")
    if value != "dynamic":
        return tf.constant(float(value), tf.float32, name="EPL_AMP/loss_scale"), None
    amp = state_of(ir.Graph.get(graph))
    if amp.dynamic is None:
        with graph.name_scope("EPL_AMP/"):
            scale = variable("loss_scale", lambda: tf.constant(INITIAL_SCALE))
            good = variable("good_steps", lambda: tf.constant(0, tf.int64))
        amp.dynamic = (scale, good)
    return amp.dynamic[0].read_value(), amp.dynamic


def scaled_grad_ys(ys, grad_ys, scale):
    """The ``grad_ys`` that start the backward pass of ``ys`` from ``scale``
    (``grad_ys`` times the scale, or the scale itself)."""
    ys_list = tf.nest.flatten(ys)
    given = tf.nest.flatten(grad_ys) if grad_ys is not None else [None] * len(ys_list)
    start = []
    for y, g in zip(ys_list, given):
        s = tf.cast(scale, y.dtype)
        start.append(tf.fill(tf.shape(y), s) if g is None else g * s)
    return start


def unscale(grads, scale):
    """The gradients of a scaled backward pass, divided by the scale."""
    out = []
    for g in grads:
        if g is None:
            out.append(g)
        elif isinstance(g, tf.IndexedSlices):
            out.append(tf.IndexedSlices(g.values / tf.cast(scale, g.values.dtype), g.indices,
                                        g.dense_shape))
        else:
            out.append(g / tf.cast(scale, g.dtype))
    return out


class SkipOnOverflow(object):
    """The gate around one ``apply_gradients`` call (dynamic loss scale)."""

    def __init__(self, grads_and_vars, state, debug_log):
        self.scale, self.good = state
        self.debug_log = debug_log
        with tf.compat.v1.name_scope("EPL_AMP"):
            checks = [tf.reduce_all(tf.math.is_finite(_values(g)))
                      for g, _ in grads_and_vars if g is not None]
            self.finite = tf.reduce_all(tf.stack(checks), name="all_finite") if checks \
                else tf.constant(True)
            apply_gate.register(self.finite)
            self.grads_and_vars = []
            for g, v in grads_and_vars:
                if g is not None:
                    g = apply_gate.when(g, self.finite)
                self.grads_and_vars.append((g, v))

    def finish(self, applied):
        """The op to return: the update (or not) and the loss scale's next value."""
        with tf.compat.v1.name_scope("EPL_AMP"):
            done = apply_gate.done(self.finite, [applied], name="applied")
            with tf.control_dependencies([done]):
                scale, good = self.scale.read_value(), self.good.read_value()
                grown = good + 1 >= GROWTH_INTERVAL
                where = tf.compat.v2.where      # (TF 1.15's tf.where is deprecated)
                new_scale = where(self.finite, where(grown, scale * 2.0, scale), scale * 0.5)
                new_good = where(self.finite, where(grown, tf.zeros_like(good), good + 1),
                                 tf.zeros_like(good))
                updates = [self.scale.assign(new_scale, read_value=False),
                           self.good.assign(new_good, read_value=False)]
                if self.debug_log:
                    updates.append(tf.print("EPL AMP: loss scale", scale, "->", new_scale,
                                            "step skipped (overflow):",
                                            tf.logical_not(self.finite)))
            return tf.group(*updates, name="step")


def guard_updates(epl_graph, config):
    """Before a run (dynamic loss scale), the writes built since the last call: a
    trainable variable written from gradients outside ``apply_gradients`` (an update
    by hand) would apply an overflowed gradient: refused, naming the op.  (A
    ``global_step`` incremented by hand keeps its value on a skipped step:
    ``apply_gate.guard_step``.)"""
    amp = state_of(epl_graph)
    since = amp.guarded_id
    graph = epl_graph.tf_graph
    amp.guarded_id = tfg.last_op_id(graph)
    if not enabled(config) or config.get("amp.loss_scale") != "dynamic" \
            or amp.dynamic is None:
        return
    handled = set()
    for rec in epl_graph.apply_records:
        handled.update(rec.op_ids)
    op = hand_written_update(epl_graph, handled, since)
    if op is not None:
        raise NotImplementedError(
            "epl.Config: 'amp.loss_scale' = 'dynamic' skips a step whose gradients overflow "
            "inside an optimizer's apply_gradients / minimize, but %r (%s) writes the "
            "trainable variable %r from gradients by hand: it would apply an infinite or NaN "
            "gradient. Update it through an optimizer, or set a fixed amp.loss_scale (e.g. "
            "128)." % (op.name, op.type, written_variable(op).name))


class _Hook(backward_hooks.BackwardHook):
    """AMP's part in a user's tf.gradients call (a graph-mode tape's gradient is
    computed through tf.gradients while AMP is on): before it, the forward products
    are rebuilt in half precision and the backward pass starts from the loss scale;
    inside it, weights are cast again where the backward pass reads them and the
    gradients are divided by the scale."""

    name = "amp"
    needs_gradients_call = True

    def applies(self, call):
        return call.kind == "gradients" and enabled(call.config)

    def prepare(self, call):
        convert(call.graph, call.ys)
        scale, _ = loss_scale(call.graph, call.config)
        call.scratch[self.name] = scale
        given = call.arguments
        given["grad_ys"] = scaled_grad_ys(given["ys"], given.get("grad_ys"), scale)
        if given.get("stop_gradients") is not None:
            given["stop_gradients"] = rebuilt(call.graph,
                                              tf.nest.flatten(given["stop_gradients"]))

    def wrap(self, call, compute):
        scale = call.scratch[self.name]

        def scaled():
            first = tfg.last_op_id(call.graph) + 1
            grads = compute()
            recast_weights(call.graph, first)
            return unscale(grads, scale)
        return scaled


backward_hooks.register(_Hook())


class _SkipHook(apply_hooks.ApplyHook):
    """AMP's part in a user's ``apply_gradients`` (a dynamic loss scale): the optimizer
    gets the gradients gated on "all finite", and the call returns the op that also
    steers the loss scale."""

    name = "amp"
    after = ("accumulate",)     # refuses a call that accumulates across runs

    def applies(self, call):
        return state_of(call.epl_graph).dynamic is not None

    def prepare(self, call):
        if call.across_runs:
            raise NotImplementedError(
                "epl.Config: 'amp.loss_scale' = 'dynamic' with 'pipeline.num_micro_batch' = "
                "%d on a model without annotation (accumulation across runs) is not "
                "implemented yet: use a fixed amp.loss_scale, or annotate the model to "
                "accumulate inside each run." % call.config.get("pipeline.num_micro_batch"))

    def wrap(self, call, apply):
        state = state_of(call.epl_graph).dynamic

        def skipping(grads_and_vars):
            gate = SkipOnOverflow(grads_and_vars, state, call.config.get("amp.debug_log"))
            return gate.finish(apply(gate.grads_and_vars))
        return skipping


apply_hooks.register(_SkipHook())


def _values(g):
    return g.values if isinstance(g, tf.IndexedSlices) else g
