"""Dense layers under ``epl.split(n)``: column- or row-parallel, chosen by the input.

* Column-parallel (the input is an ordinary tensor): shard i holds columns
  ``[o_i, o_i + u_i)`` of the kernel and bias and computes those output
  columns, activation included.  The output stays sharded (a logical tensor,
  see :mod:`epl.tensor_parallel.sharding`).
* Row-parallel (the input is a column-sharded logical tensor): shard i holds
  the kernel rows matching the input shard and computes a partial product; the
  partial products are summed once, then the (unsharded) bias and activation.

So an MLP alternates column/row and never gathers a full hidden layer, and a
classifier head (column-parallel) feeds the sharded softmax cross-entropy.
Uneven sizes are fine (numpy.array_split).  Every shard starts as its slice of
the unsplit layer's initial value and is checkpointed as that slice.
"""
import weakref

import tensorflow as tf

from epl.tensor_parallel import sharding
from epl.tf_adapter import graph as tfg

# graph -> {(tensor, shard, control-flow context): the tensor as read on that shard}
_SHARD_INPUTS = weakref.WeakKeyDictionary()


def build(layer, input_shape):
    """Replaces Dense.build under split: weights are made in ``call``, where the input
    tells column- from row-parallel."""
    input_shape = tf.TensorShape(input_shape)
    last = tf.compat.dimension_value(input_shape[-1])
    if last is None:
        raise ValueError("The last dimension of the inputs to `Dense` should be defined. "
                         "Found `None`.")
    dtype = tf.as_dtype(layer.dtype or tf.keras.backend.floatx())
    if not dtype.is_floating:
        raise TypeError("Unable to build `Dense` layer with non-floating point dtype %s"
                        % dtype)
    layer._epl_split = sharding.active_split()  # pylint: disable=protected-access
    layer.input_spec = tf.keras.layers.InputSpec(min_ndim=2, axes={-1: last})
    layer.built = True


def call(layer, inputs):
    strategy = layer._epl_split  # pylint: disable=protected-access
    n = sharding.split_count(strategy)
    rank = inputs.shape.ndims
    if rank is None or rank < 2:
        raise ValueError("EPL split: %s needs an input of known rank >= 2, got %s."
                         % (layer.name, inputs.shape))
    if getattr(layer, "_epl_called", False):
        raise NotImplementedError(
            "EPL split: layer %r is called a second time; a split layer's weights are laid "
            "out for its first input. Create one layer per call inside epl.split."
            % layer.name)
    layer._epl_called = True  # pylint: disable=protected-access
    src = sharding.lookup(inputs)
    # tf.layers creates weights with reuse=True once built: weights are made here.
    layer.built = False
    try:
        if src is not None and sharding.last_axis(src, rank) and len(src.shards) == n:
            return _row_parallel(layer, src, n)
        return _column_parallel(layer, inputs, n)
    finally:
        layer.built = True


def _weight(layer, name, shape, initializer, full_shape, axis, offset, sharded, regularizer,
            constraint):
    kwargs = dict(shape=shape, dtype=layer.dtype, trainable=True, constraint=constraint,
                  regularizer=regularizer)
    if not sharded:
        return layer.add_weight(name, initializer=initializer, **kwargs)
    var = layer.add_weight(name, initializer=sharding.slice_initializer(
        initializer, full_shape, axis, offset, shape[axis]), **kwargs)
    full_name = var.op.name.rsplit("/part_", 1)[0]
    return sharding.mark_slice(var, full_name, full_shape, axis, offset)


def _matmul(x, kernel):
    rank = x.shape.ndims
    if rank > 2:
        out = tf.tensordot(x, kernel, [[rank - 1], [0]])
        out.set_shape(x.shape[:-1].concatenate(kernel.shape[-1:]))
        return out
    return tf.matmul(x, kernel)


def _column_parallel(layer, x, n):
    d, units = int(x.shape[-1]), layer.units
    cols = sharding.sizes(units, n, "%s's %d units" % (layer.name, units))
    offs = sharding.offsets(cols)
    outs, kernels, biases = [], [], []
    with sharding.raw():
        for i in range(n):
            with sharding.on_shard(i):
                k = _weight(layer, "kernel/part_%d" % i, [d, cols[i]], layer.kernel_initializer,
                            [d, units], 1, offs[i], True, layer.kernel_regularizer,
                            layer.kernel_constraint)
                y = _matmul(tf.cast(_on_shard_input(x, i), k.dtype), k)
                kernels.append(k)
                if layer.use_bias:
                    b = _weight(layer, "bias/part_%d" % i, [cols[i]], layer.bias_initializer,
                                [units], 0, offs[i], True, layer.bias_regularizer,
                                layer.bias_constraint)
                    y = tf.nn.bias_add(y, b)
                    biases.append(b)
                if layer.activation is not None:
                    y = layer.activation(y)
                outs.append(y)
    layer.kernel, layer.bias = kernels, (biases or None)
    return sharding.concat(outs, axis=-1, name=layer.name + "_sharded_output")


def _on_shard_input(x, i):
    """``x`` as the column-parallel layers on shard ``i`` read it: one identity per
    shard, shared by every layer that reads ``x`` there (attention's Q/K/V).  Their
    input gradients are then summed on that device and one gradient per device travels
    to ``x``'s device (n - 1 activation-sized transfers instead of 3 (n - 1)): the mirror
    image of the forward pass, where ``x`` is sent to each device once."""
    ctx = tfg.graph_control_flow_context(x.graph)
    copies = _SHARD_INPUTS.setdefault(x.graph, {})
    # (by name: with TF 2.x tensor equality a tensor has no hash)
    key = (x.name, i, id(ctx) if ctx is not None else None)
    if key not in copies:
        copies[key] = tf.identity(x, name="input_shard_%d" % i)
    return copies[key]


def _row_parallel(layer, src, n):
    units = layer.units
    d = sum(src.sizes)
    partials, kernels = [], []
    with sharding.raw():
        for i in range(n):
            with sharding.on_shard(i):
                k = _weight(layer, "kernel/part_%d" % i, [src.sizes[i], units],
                            layer.kernel_initializer, [d, units], 0, src.offsets[i], True,
                            layer.kernel_regularizer, layer.kernel_constraint)
                partials.append(_matmul(src.shards[i], k))
                kernels.append(k)
        # The partial products meet on the split's first device (a [batch, units] sum).
        y = tf.add_n(partials)
        bias = None
        if layer.use_bias:
            bias = _weight(layer, "bias", [units], layer.bias_initializer, None, None, None,
                           False, layer.bias_regularizer, layer.bias_constraint)
            y = tf.nn.bias_add(y, bias)
        if layer.activation is not None:
            y = layer.activation(y)
    layer.kernel, layer.bias = kernels, bias
    return y
