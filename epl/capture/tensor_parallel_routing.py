"""Tensor-parallel routing: the TensorFlow calls a model under ``epl.split`` makes that
must run shard by shard are sent to ``epl.tensor_parallel`` (patch points 13, 14 and
the variable points of ``epl.capture.patches``); on anything else they run unchanged.

13. ``keras.layers.Dense.build`` / ``call`` (also ``tf.layers.Dense``;
    :func:`dense_build`, :func:`dense_call`): under ``epl.split`` the layer is built
    sharded (``epl.tensor_parallel.layers``); observers
    (``epl.ir.capture_context.observing_dense``: the strategy search) see every Dense
    layer built and called.
14. ``nn_ops.sparse_softmax_cross_entropy_with_logits`` (so also
    ``tf.losses.sparse_softmax_cross_entropy``; :func:`sparse_softmax_cross_entropy`)
    and ``math_ops.argmax`` (:func:`argmax`), rebound in every TensorFlow module that
    exports them: on class-sharded logits they run sharded
    (``epl.tensor_parallel.losses``).  ``special_math_ops.einsum`` (``tf.einsum``;
    :func:`einsum`), rebound the same way: under ``split`` an einsum over a split
    variable's first axis runs shard by shard (``epl.tensor_parallel.einsum``).
    ``variable_scope.VariableScope.get_variable`` (:func:`scope_get_variable`): under
    ``split`` a variable is made as shards (``epl.tensor_parallel.variables``);
    ``embedding_ops.embedding_lookup`` (:func:`embedding_lookup`) on a split variable
    looks up EPL's contiguous shards (``partition_strategy="div"``).
"""
import inspect

import tensorflow as tf

from epl.ir.capture_context import state as _c
from epl.tensor_parallel import einsum as tp_einsum
from epl.tensor_parallel import layers as tp_layers
from epl.tensor_parallel import losses as tp_losses
from epl.tensor_parallel import sharding
from epl.tensor_parallel import variables as tp_variables
from epl.tf_adapter.patching import original


def dense_build(self, input_shape):
    for observer in _c().dense:
        observer.building(self, input_shape)
    if sharding.routing() and sharding.active_split() is not None:
        return tp_layers.build(self, input_shape)
    return original("keras.dense_build")(self, input_shape)


def dense_call(self, inputs):
    if getattr(self, "_epl_split", None) is not None:
        out = tp_layers.call(self, inputs)
    else:
        out = original("keras.dense_call")(self, inputs)
    for observer in _c().dense:
        observer.called(self)
    return out


def sparse_softmax_cross_entropy(*args, **kwargs):
    """TF 1.15's signature starts with ``_sentinel`` (keywords only), 2.x's compat.v1 one
    with ``labels``: bind to the installed one's."""
    call = inspect.signature(original("nn.sparse_softmax_cross_entropy")).bind(*args, **kwargs)
    call.apply_defaults()
    labels, logits = call.arguments["labels"], call.arguments["logits"]
    name = call.arguments["name"]
    sharded = sharding.lookup(logits) if sharding.routing() else None
    if sharded is not None and sharding.last_axis(sharded, logits.shape.ndims):
        return tp_losses.sparse_softmax_cross_entropy(sharded, labels, name)
    return original("nn.sparse_softmax_cross_entropy")(*call.args, **call.kwargs)


def argmax(input, axis=None, name=None, dimension=None, output_type=None):  # pylint: disable=redefined-builtin
    output_type = tf.int64 if output_type is None else output_type
    sharded = sharding.lookup(input) if sharding.routing() else None
    if sharded is not None:
        rank = input.shape.ndims
        ax = axis if axis is not None else dimension
        ax = 0 if ax is None else ax
        if isinstance(ax, int) and ax % rank == sharded.axis % rank:
            return tp_losses.argmax(sharded, output_type, name)
    if dimension is not None:   # (passing dimension=None still warns it is deprecated)
        return original("math.argmax")(input, axis=axis, name=name, dimension=dimension,
                                       output_type=output_type)
    return original("math.argmax")(input, axis=axis, name=name, output_type=output_type)


def einsum(equation, *inputs, **kwargs):
    return tp_einsum.einsum(original("math.einsum"), equation, *inputs, **kwargs)


def scope_get_variable(self, var_store, name, *args, **kwargs):
    return tp_variables.get_variable(original("variable_scope.get_variable"), self, var_store,
                                     name, *args, **kwargs)


def embedding_lookup(params, ids, partition_strategy="mod", *args, **kwargs):
    if tp_variables.is_split_variable(params):
        partition_strategy = "div"   # EPL's contiguous shards hold the local model's rows
    return original("nn.embedding_lookup")(params, ids, partition_strategy, *args, **kwargs)
