"""Split passes: place the shards of split TaskGraphs, and bridge them to the
replicated TaskGraph around them.

* ``SplitPlacementPass`` (:func:`place`): shard i of a split runs on the
  split's device i; the split's unsharded ops (the sum of row-parallel partial
  products, a loss mean, ...) run on its first device.
* ``SplitBridgePass`` (:func:`bridge`), after the replicas are cloned: the user
  built the split part reading replica 0's tensors as if they were the whole
  batch.  A split op reading a per-clone tensor (a replica's activation, or a
  batch every replica pulls from the input pipeline) now reads the
  concatenation of every clone's copy (batch order = clone order = the order
  of a fed global batch);
  a replica op reading a split tensor (the gradient of a bridged activation, or
  a split output fed back) reads its clone's rows of it.  Autodiff already built
  the split part's backward for the whole batch, so the gradient of the bridge
  is exactly those row slices.
* Reductions: a loss the split computes is a function of the whole batch, so
  each replica's gradients are partial sums and are all-reduced with SUM
  (``updates.ReductionSite.loss_in_split``).  A loss the replicas compute after
  the split (replicate -> split -> replicate) is one per replica: replicated
  gradients are averaged as in plain data parallelism, and the split's own
  gradients, which sum every replica's part, are divided to match
  (:func:`scale_split_gradients`).
"""
import logging

import tensorflow as tf

from epl import ir
from epl.rewrite.cloner import clone_op, new_ops
from epl.rewrite.selection import downstream_of_batch
from epl.rewrite.updates import loss_of_split
from epl.tensor_parallel import einsum
from epl.tf_adapter import graph as tfg, op_types
from epl.ir.variable_writes import ASSIGN_OPS, VARIABLE_OPS

log = logging.getLogger("epl")


def split_taskgraphs(state):
    return [tg for tg in state.ir_graph.taskgraphs if tg.kind == "split"]


# (the line's matrix products: tf.einsum's fused Einsum op on TF 2.x)
_HEAVY = op_types.matrix_products() | frozenset([
    "Conv2D", "Conv3D", "DepthwiseConv2dNative", "SparseSoftmaxCrossEntropyWithLogits",
    "SoftmaxCrossEntropyWithLogits"])


def place(state):
    per = state.cluster.gpu_num_per_worker
    if state.in_graph:
        def where(d):
            return state.cluster.device(d)
    else:
        def where(d):
            return state.cluster.local_device(d % per)
    for tg in split_taskgraphs(state):
        devices = [where(d) for d in state.layout.split_devices[tg]]
        unsplit = sorted(set("%s (%s)" % (op.name, op.type) for op in tg.ops
                             if op.type in _HEAVY and state.ir_graph.shard_of(op) is None
                             and state.ir_graph.phase_of(op) == ir.FORWARD))
        if unsplit and len(devices) > 1:   # (a split over one device: nothing to spread)
            log.warning(
                "EPL split %r: %d compute-heavy op(s) run unsplit on the split's first device: "
                "%s. EPL shards tf.layers/keras Dense, sparse softmax cross-entropy, argmax, "
                "tf.get_variable tables and epl.moe_layer; build these parts with them to "
                "spread the work.", tg.strategy, len(unsplit), ", ".join(unsplit[:5])
                + (" ..." if len(unsplit) > 5 else ""))
        for op in tg.ops:
            if state.ir_graph.phase_of(op) == ir.REWRITE:
                continue
            if "_class" in op.node_def.attr:
                tfg.clear_colocation(op)
            if state.layout.split_groups:   # (group 0's device of the op's stage and shard)
                tfg.set_device(op, state.stage_devices[0][state.lane_of(op)])
            else:
                tfg.set_device(op, devices[state.ir_graph.shard_of(op) or 0])


def _split_ops(state):
    return set(op for tg in split_taskgraphs(state) for op in tg.ops)


def _is_variable_value(t):
    """A variable itself or its plain read (``v/read``, ReadVariableOp): every clone
    reads the same variable."""
    if ir.is_state_handle(t):
        return True
    return (t.op.type in ("Identity", "ReadVariableOp") and len(t.op.inputs) == 1
            and ir.is_state_handle(t.op.inputs[0]))


def _stateless_value(t):
    """``t`` reads no variable (a split variable's initial value, read by the
    ``initialized_value`` of an ExponentialMovingAverage): every clone reads this one
    tensor, and no gradient flows through it."""
    stack, seen = [t.op], set()
    while stack:
        op = stack.pop()
        if op in seen:
            continue
        seen.add(op)
        if op.type in VARIABLE_OPS or any(ir.is_state_handle(i) for i in op.inputs):
            return False
        stack.extend(i.op for i in op.inputs)
    return True


def _initializes_only(state, op):
    """Nothing computed from ``op`` reaches a gradient or an update, other than
    variable initializers (the ``initialized_value`` condition of an
    ExponentialMovingAverage's shadow of a split variable)."""
    inits = set(v.initializer for key in (tf.compat.v1.GraphKeys.GLOBAL_VARIABLES,
                                          tf.compat.v1.GraphKeys.LOCAL_VARIABLES)
                for v in state.graph.get_collection(key))
    stack, seen = [op], set()
    while stack:
        o = stack.pop()
        if o in seen or o in inits:
            continue
        seen.add(o)
        if state.ir_graph.phase_of(o) in (ir.BACKWARD, ir.APPLY) or o.type in ASSIGN_OPS:
            return False
        stack.extend(tfg.users(o))
    return True


def _crosses(state, t, on_batch):
    """``t`` is a batch every clone has its own copy of (a replica's activation, a pull of
    the input pipeline): a split reads the concatenation of the copies.  Variables and
    values not computed from the batch are the same in every clone (replica 0's)."""
    if _is_variable_value(t) or t.op not in on_batch:
        return False
    return t.op in state.selection or state.mapped(t)


def bridge(state):
    split_ops = _split_ops(state)
    if not split_ops or not state.selection.ops or state.layout.split_groups:
        # (split groups: each group's copy reads its own batch; nothing to bridge)
        return
    sel = state.selection
    n = state.num_clones
    model = (ir.FORWARD, ir.BACKWARD)   # not a shard's optimizer: it reads reduced grads
    # (found here, after the clones were made: a split op may read a reduced gradient)
    gather = _Gather(state, downstream_of_batch(state.graph))
    relaxed = state.ir_graph.relaxed
    # Replica -> split: the whole batch.
    readers = [op for op in split_ops if state.ir_graph.phase_of(op) in model]
    for op in tfg.by_id(readers):
        for i, t in enumerate(op.inputs):
            whole = gather(t, op)
            if whole is t:
                continue
            if op.name in relaxed:
                # The scope reads the rows through a relaxed view (epl.capture.rebatch), built
                # for any batch: its readers take every clone's rows.
                tfg.rewire(op.outputs[0], whole)
            else:
                tfg.update_input(op, i, whole)
    batch_rows, on_batch = gather.batch_rows, gather.on_batch
    if n == 1:
        # One clone (a split over one device, or the only replica of this process):
        # the split computed exactly its batch, so the replica reads its outputs as
        # they are, whatever their layout (e.g. an expert-major [E, G, C, M]).
        return
    # Split -> replica: each clone's rows (not of the gradient of a split variable,
    # e.g. read by the user's global-norm clipping: every clone reads the same).
    weight_grads = _variable_gradients(state, split_ops)
    sliced = {}
    for op in sel.ops:
        # (a clone reads the user's split tensors where the user's op does: split ops
        # are not copied; only those clones' ops are looked at)
        if not any(t.op in split_ops for t in op.inputs):
            continue
        for c in range(n):
            mine = state.op(c, op)
            for i, t in enumerate(mine.inputs):
                if t.op not in split_ops or _is_variable_value(t) or t in weight_grads:
                    continue
                if t.op not in on_batch:
                    if _stateless_value(t) or _initializes_only(state, op):
                        continue   # an initial value: no gradient flows through it
                    raise NotImplementedError(
                        "EPL split: replicated op %r reads %r, a value of the split scope "
                        "that does not depend on the batch (e.g. computed from its variables "
                        "only). Read the split's variables directly (each replica then "
                        "computes with them and their gradients are reduced), or move %r "
                        "into the split scope. (EPL knows the batch as the input pipeline's "
                        "outputs or placeholders with an unknown first dimension.)"
                        % (op.name, t.name, op.name))
                key = (t, c)
                if key not in sliced:
                    with new_ops(state.graph), tf.device(mine.device):
                        # tf.gradients stamps a gradient with its forward input's shape:
                        # the split's gradient of a fixed-batch activation claims one
                        # replica's rows while it holds all of them.
                        whole = tf.compat.v1.placeholder_with_default(
                            t, [None] + t.shape.as_list()[1:]) if t.shape.ndims else t
                        rows = (tf.stack(batch_rows) if batch_rows is not None
                                else _equal_rows(whole, n, op, t))
                        parts = tf.split(whole, rows, num=n, axis=0,
                                         name="EPL_SPLIT_SCATTER/%s_%d" % (t.op.name, t.value_index))
                        for cc in range(n):
                            sliced[(t, cc)] = parts[cc]
                tfg.update_input(mine, i, sliced[key])


def _equal_rows(t, n, reader, original):
    """Each clone's rows of a split output when no batch crossed from the replicas
    into the split (the split read the input pipeline itself: one pull, the global
    batch): n equal parts, as a fed global batch is divided over the clones."""
    if original.shape.ndims == 0:
        raise NotImplementedError(
            "EPL split: replicated op %r reads the scalar %r of the split scope, which has no "
            "rows to divide over the %d replicas; compute it inside one of the scopes."
            % (reader.name, original.name, n))
    size = tf.raw_ops.Shape(input=t)[0]
    check = tf.compat.v1.debugging.assert_equal(
        tf.math.floormod(size, n), 0, data=[size],
        message="EPL split: the %d replicas each read their rows of the split's output %r "
                "(read by %r), which has a number of rows that cannot be divided into %d "
                "equal parts; use a batch size divisible by %d. Rows:"
                % (n, original.name, reader.name, n, n))
    with tf.control_dependencies([check]):
        return tf.fill([n], size // n)


def scale_split_gradients(state):
    """A loss the replicas compute after a split scope (each replica's loss is the mean
    over its own rows): the split's backward reads every replica's gradient at once,
    so its gradients are the *sum* of the replicas' contributions.  With
    ``gradients_reduce_method = "mean"`` the replicated gradients are averaged;
    the split's are divided by the number of replicas to match."""
    n = state.num_clones
    split_ops = _split_ops(state)
    if (n == 1 or not split_ops or state.layout.split_groups
            or state.config.get("communication.gradients_reduce_method") != "mean"):
        return
    names = []

    def copies():
        """Names of the other clones' copies of the replica's ops (they read the split's
        gradients as the user's op does: the user's clipping in every replica)."""
        if not names:
            names.append(set(state.op_name(c, op) for c in range(1, n)
                             for op in state.selection.ops))
        return names[0]
    for rec in state.ir_graph.gradient_records:
        if loss_of_split(state.ir_graph, rec) or not any(
                y.op in state.selection for y in rec.ys):
            continue
        for g, x in zip(rec.grads, rec.xs):
            parts = ir.components(g)
            if not parts:
                continue
            if all(t.op in split_ops for t in parts):
                value = g.values if isinstance(g, tf.IndexedSlices) else g
                with new_ops(state.graph), tf.device(value.device):
                    scaled = value * tf.cast(1.0 / n, value.dtype)
                tfg.rewire(value, scaled,
                           skip=lambda op: _keeps_value(state, rec, op, copies))
            elif _is_split_variable(x, split_ops):
                _scale_finished_outside(state, rec, parts, split_ops)


def _is_split_variable(x, split_ops):
    """``x`` (a source of a gradient call) is a variable of a split scope."""
    handle = getattr(x, "op", None)
    return handle is not None and handle.type in VARIABLE_OPS and handle in split_ops


def _scale_finished_outside(state, rec, parts, split_ops):
    """A split variable's gradient that the gradient call finished outside the split
    (AMP divides it by the loss scale in the loss's scope, and every replica's copy of
    that division reads the split's gradient): the split tensors it is computed from
    are divided by the number of clones where the call's ops on the way to the gradient
    (and the clones' copies of those ops) read them.  Other readers keep the split's
    own value; the division is made once, on the split's device."""
    n = state.num_clones
    sources, path = _split_sources_and_path(parts, split_ops, rec.op_ids)
    readers = set(state.op_name(c, op) for c in range(n) for op in path)
    for t in sorted(sources, key=lambda t: (tfg.op_id(t.op), t.value_index)):
        if not t.dtype.is_floating:
            continue   # (an IndexedSlices' indices: rows, not a sum)
        with new_ops(state.graph), tf.device(t.device):
            scaled = t * tf.cast(1.0 / n, t.dtype)
        tfg.rewire(t, scaled, skip=lambda op: op.name not in readers)


def _keeps_value(state, rec, op, copies):
    """``op`` reads the split's unscaled gradient: an op of the gradient call itself
    (it computed the gradient), or EPL's own reader (not a replica's copy of the user's
    op)."""
    if tfg.op_id(op) in rec.op_ids:
        return True
    return state.ir_graph.phase_of(op) == ir.REWRITE and op.name not in copies()


class _Gather(object):
    """The whole batch behind a tensor a split op reads: the concatenation of every
    clone's copy of a per-clone tensor (batch order = clone order = the order of a fed
    global batch), and, for the unannotated ops between the input pipeline and the
    split (a loss's label preprocessing), a copy of the op computed on the gathered
    inputs.  The user's own ops are left as they are."""

    def __init__(self, state, on_batch):
        self.state = state
        self.done = {}
        self.batch_rows = None      # rows of each clone's part (for the way back)
        self.on_batch = on_batch    # ops computed from an input batch

    def __call__(self, t, reader):
        if t not in self.done:
            self.done[t] = self._whole(t, reader)
        return self.done[t]

    def _whole(self, t, reader):
        state = self.state
        if _crosses(state, t, self.on_batch):
            copies = state.copies(t)
            if all(cp is t for cp in copies):
                return t   # (one clone: nothing to gather)
            _check_batch_major(t, reader)
            einsum.check_not_gathered(t, copies)
            with new_ops(state.graph), tf.device(reader.device):
                whole = tf.concat(copies, axis=0, name="EPL_SPLIT_GATHER/" + t.op.name)
                if self.batch_rows is None and state.ir_graph.phase_of(reader) == ir.FORWARD:
                    # (forward only: the replicas' forward reads these rows, and a
                    # backward gather is computed from it.)
                    # (the Shape op itself: a clone-0 tensor may still claim the fixed batch it
                    # was built with; tf.shape would fold that in)
                    self.batch_rows = [tf.raw_ops.Shape(input=c)[0] for c in copies]
            return whole
        up = t.op
        if (up in self.state.selection or up not in self.on_batch
                or state.ir_graph.taskgraph_of(up) is not None
                or state.ir_graph.phase_of(up) not in (ir.FORWARD, ir.BACKWARD)
                or _is_variable_value(t)):
            return t
        inputs = [self(i, reader) for i in up.inputs]
        if all(a is b for a, b in zip(inputs, up.inputs)):
            return t
        with new_ops(state.graph):
            copy = clone_op(up, inputs, state.graph.unique_name("EPL_SPLIT_GATHER/" + up.name),
                            reader.device, [state.op(0, c) for c in up.control_inputs])
        for old, new in zip(up.outputs, copy.outputs):
            self.done[old] = new
        return self.done[t]


def _variable_gradients(state, split_ops):
    """The gradients of variables (tensors every clone reads alike, not batch rows).

    The gradient call may finish a split variable's gradient in the loss's scope (AMP
    divides it by the loss scale there): the split tensors that such a gradient is
    computed from inside the call are the variable's gradient too."""
    out = set()
    for rec in state.ir_graph.gradient_records:
        for g, x in zip(rec.grads, rec.xs):
            handle = getattr(x, "op", None)
            if handle is None or handle.type not in VARIABLE_OPS:
                continue
            parts = ir.components(g)
            out.update(parts)
            if handle in split_ops:
                out.update(_split_sources(parts, split_ops, rec.op_ids))
    return out


def _split_sources(tensors, split_ops, op_ids):
    """The split tensors ``tensors`` are computed from through ops of the gradient call
    ``op_ids`` outside the split."""
    return _split_sources_and_path(tensors, split_ops, op_ids)[0]


def _split_sources_and_path(tensors, split_ops, op_ids):
    """(the split tensors ``tensors`` are computed from through ops of the gradient call
    ``op_ids`` outside the split, those ops)."""
    found, seen = set(), set()
    stack = [t.op for t in tensors if t.op not in split_ops]
    while stack:
        op = stack.pop()
        if op in seen or tfg.op_id(op) not in op_ids:
            continue
        seen.add(op)
        for t in op.inputs:
            if t.op in split_ops:
                found.add(t)
            else:
                stack.append(t.op)
    return found, seen


def _check_batch_major(t, reader):
    if t.shape.ndims == 0:
        raise NotImplementedError(
            "EPL split: %r (split scope) reads the scalar %r of the replicated part; only "
            "batch-major tensors (first dimension = examples) can cross from epl.replicate "
            "into epl.split. Compute it inside one of the scopes." % (reader.name, t.name))
