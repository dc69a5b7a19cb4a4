"""Control flow v1's Python contexts: what kind a ``WhileContext`` / ``CondContext`` is,
and one rebuilt from its proto.

A v1 loop or condition (``Enter`` / ``Switch`` / ``Merge`` ops) has a Python context that
every op of its body points to (``graph.control_flow_context``); the graph's
WHILE_CONTEXT / COND_CONTEXT collections hold the outermost ones as ``WhileContextDef``
/ ``CondContextDef`` protos when exported.  TensorFlow has no public name for either
class nor for their protos: kept here.
"""
from tensorflow.core.protobuf import control_flow_pb2 as _protos
from tensorflow.python.ops import control_flow_ops as _contexts


def is_loop(ctx):
    """``ctx`` is a ``tf.while_loop``'s context (else a ``tf.cond``'s)."""
    return isinstance(ctx, _contexts.WhileContext)


def is_loop_proto(proto):
    """``proto`` is a ``WhileContextDef`` (else a ``CondContextDef``)."""
    return isinstance(proto, _protos.WhileContextDef)


def from_proto(proto):
    """The context ``proto`` describes, made in the default graph (its ops point to it)."""
    if is_loop_proto(proto):
        return _contexts.WhileContext.from_proto(proto)
    return _contexts.CondContext.from_proto(proto)
