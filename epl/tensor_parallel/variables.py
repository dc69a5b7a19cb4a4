"""``tf.get_variable`` under ``epl.split(n)``: the variable is stored as n
contiguous row shards, shard i on device i.

It is TensorFlow's own partitioned variable (``fixed_size_partitioner``), so
the user's code keeps working: math ops and indexing read the concatenation, the optimizer
updates every shard where it lives, ``tf.nn.embedding_lookup`` gathers rows
shard by shard, and checkpoints hold the full variable under its local name
(restorable into the unsplit model and into any other shard count).
A variable whose first dimension is smaller than n stays whole on the split's
first device.
"""
import inspect

import tensorflow as tf

from epl import ir
from epl.tensor_parallel import checkpoint_slices, sharding
from epl.tf_adapter import graph as tfg
from epl.tf_adapter import variables as tf_variables


def get_variable(original, scope, var_store, name, *args, **kwargs):
    strategy = sharding.active_split() if sharding.routing() else None
    if strategy is None:
        return checkpoint_slices.companion(original(scope, var_store, name, *args, **kwargs))
    bound = inspect.signature(original).bind(scope, var_store, name, *args, **kwargs)
    params = bound.arguments
    shape = params.get("shape")
    value = params.get("initializer")
    if shape is None and value is not None and not callable(value):
        # tf.get_variable(name, initializer=array_or_tensor): the value gives the shape;
        # each shard takes its rows of it.
        with sharding.raw():
            value = tf.convert_to_tensor(value)
        shape = value.shape
        params["shape"] = shape
        params["dtype"] = value.dtype.base_dtype
        params["initializer"] = _rows_of(value)
    n = sharding.split_count(strategy)
    try:
        dims = tf.TensorShape(shape).as_list() if shape is not None else None
    except ValueError:
        dims = None
    if (params.get("partitioner") is not None or scope.partitioner is not None or not dims
            or dims[0] is None or dims[0] < n or n == 1):
        return original(*bound.args, **bound.kwargs)
    params["partitioner"] = tf.compat.v1.fixed_size_partitioner(n, axis=0)
    init = params.get("initializer")
    if init is None and tf.as_dtype(params.get("dtype") or tf.float32).is_floating:
        init = tf.compat.v1.glorot_uniform_initializer()   # (tf.get_variable's default)
    if init is not None:
        params["initializer"] = _sliced(init)
    graph = tf.compat.v1.get_default_graph()
    first = tfg.last_op_id(graph) + 1
    var = original(*bound.args, **bound.kwargs)
    if tf_variables.is_partitioned(var):
        tf_variables.indexable(var)   # (``table[None]``: a user's code for a plain variable)
        var._epl_split = True  # pylint: disable=protected-access
        _tag_parts(graph, var, first)
        for part in var:
            checkpoint_slices.note_shard(part)
    return var


def _sliced(init):
    """Each shard starts as its rows of the full initial value, as the unsplit variable
    would: a seeded random initializer gives the unsplit model's values, a fan-scaled one
    (glorot) its scale, and a constant fits (TF's own ignores the partition).  The full
    value is made once per shard, at initialization only."""
    def make(shape, dtype=None, partition_info=None):
        if partition_info is None:
            return init(shape, dtype=dtype)
        full = init(partition_info.full_shape, dtype=dtype)
        return tf.slice(full, partition_info.var_offset, shape)
    return make


def _rows_of(value):
    def make(shape, dtype=None, partition_info=None):  # pylint: disable=unused-argument
        if partition_info is None:
            return value
        return tf.slice(value, partition_info.var_offset, shape)
    return make


def _tag_parts(graph, var, first):
    ir_graph = ir.Graph.get(graph)
    prefixes = [(p.op.name, i) for i, p in enumerate(var)]
    for op in tfg.ops_between(graph, first):
        for prefix, i in prefixes:
            if op.name == prefix or op.name.startswith(prefix + "/"):
                ir_graph.op_shard[op.name] = i


def is_split_variable(params):
    return getattr(params, "_epl_split", False)
