"""Python wrappers of imported copies, made on first use.

TensorFlow runs the C graph; a Python ``Operation`` is only a view of one node
for Python code.  Making that view costs more than importing the node (about
20 us against 5), and most of a replica's copies are never looked at from
Python: the session runs them by being in the graph.  So ``CopyPlan`` imports
the copies and registers their names here; a copy gets its ``Operation`` the
first time anything asks for it -- by name, as an input, consumer or control
edge of another op, through ``get_operations()``, or before TensorFlow wraps
new C nodes itself (the hooks are in ``tf_patches``, patch point 16).

Wrappers made late are rewrite ops (phase REWRITE), outside any control-flow
context (the copies inside loops and conditions get theirs when the rewrite
rebuilds the clone's contexts).

A pass that only feeds copies into a new op (the gradient all-reduce reads
thousands of them) takes ``Output``s and makes the op in C (``create_op``);
anything else converts an ``Output`` to its ``tf.Tensor``, made then.
"""
import itertools

import tensorflow as tf
from tensorflow.python import pywrap_tensorflow as c_api
from tensorflow.python.framework import c_api_util

from epl import tf_patches


def register(graph, names, c_ops=None):
    """The imported nodes named ``names`` (``c_ops``, when known: otherwise looked up
    by name when used) get their wrappers on demand."""
    table = graph.__dict__.setdefault("_epl_deferred", {})
    in_use = graph._names_in_use  # pylint: disable=protected-access
    if c_ops is None:
        table.update(dict.fromkeys(names, False))
    else:
        table.update(zip(names, c_ops))
    in_use.update(zip(map(str.lower, names), itertools.repeat(1)))


def _node(graph, table, name):
    """The C node of a registered name."""
    node = table[name]
    if node is False:
        node = table[name] = c_api.TF_GraphOperationByName(graph._c_graph, name)  # pylint: disable=protected-access
    return node


def waiting(graph):
    return bool(graph.__dict__.get("_epl_deferred"))


def materialize(graph, name):
    """The wrapper of the deferred node ``name``, or None if there is none."""
    table = graph.__dict__.get("_epl_deferred")
    if not table:
        return None
    if name not in table:
        return None
    c_op = _node(graph, table, name)
    del table[name]
    return _wrap(graph, [c_op])[0]


def materialize_all(graph):
    table = graph.__dict__.get("_epl_deferred")
    if not table:
        return
    c_ops = [_node(graph, table, name) for name in table]
    table.clear()
    _wrap(graph, c_ops)


def _wrap(graph, c_ops):
    finalized = graph._finalized  # pylint: disable=protected-access
    graph._finalized = False      # (a view of existing nodes changes no graph)
    try:
        with tf_patches.rewriting():
            ops = [graph._create_op_from_tf_operation(c_op, compute_device=False)  # pylint: disable=protected-access
                   for c_op in c_ops]
    finally:
        graph._finalized = finalized
    for op in ops:
        op._control_flow_context = None  # pylint: disable=protected-access
    return ops


def get(graph, name):
    """The op named ``name`` (made now if deferred)."""
    op = materialize(graph, name)
    return op if op is not None else graph._get_operation_by_name_unsafe(name)  # pylint: disable=protected-access


def c_op(graph, name):
    """The C node named ``name`` (of a deferred copy or an existing op), without
    making its Python op: control edges between copies are added in C."""
    table = graph.__dict__.get("_epl_deferred")
    if table and name in table:
        return _node(graph, table, name)
    return graph._get_operation_by_name_unsafe(name)._c_op  # pylint: disable=protected-access


def add_control_edges(graph, sources, targets):
    """Every node named in ``targets`` waits for every node named in ``sources``."""
    from tensorflow.python import pywrap_tensorflow as c_api
    src = [c_op(graph, n) for n in sources]
    for name in targets:
        dst = c_op(graph, name)
        for s in src:
            c_api.AddControlInput(graph._c_graph, dst, s)  # pylint: disable=protected-access


class Output(object):
    """Output ``index`` (of ``dtype``) of the copy named ``name``, whose Python op
    may not exist yet."""
    __slots__ = ("graph", "name", "index", "dtype")

    def __init__(self, graph, name, index, dtype):
        self.graph, self.name, self.index, self.dtype = graph, name, index, dtype

    def tensor(self):
        return get(self.graph, self.name).outputs[self.index]

    def tf_output(self):
        return c_api_util.tf_output(c_op(self.graph, self.name), self.index)


tf.register_tensor_conversion_function(
    Output, lambda value, dtype=None, name=None, as_ref=False: value.tensor())


def create_op(graph, op_type, name, device, inputs, attrs):
    """A new op of ``op_type`` on ``device`` made through TensorFlow's C API:
    ``inputs`` are tf.Tensors or ``Output``s (a list of them for a list input),
    ``attrs`` {name: AttrValue}.  Returns its Python op (the inputs' stay unmade)."""
    def tf_output(x):
        return x.tf_output() if isinstance(x, Output) else x._as_tf_output()  # pylint: disable=protected-access

    with graph._mutation_lock():  # pylint: disable=protected-access
        desc = c_api.TF_NewOperation(graph._c_graph, op_type, graph.unique_name(name))  # pylint: disable=protected-access
        c_api.TF_SetDevice(desc, device)
        for x in inputs:
            if isinstance(x, (list, tuple)):
                c_api.TF_AddInputList(desc, [tf_output(y) for y in x])
            else:
                c_api.TF_AddInput(desc, tf_output(x))
        for k, v in attrs.items():
            c_api.TF_SetAttrValueProto(desc, k, v.SerializeToString())
        try:
            node = c_api.TF_FinishOperation(desc)
        except tf.errors.InvalidArgumentError as e:
            raise ValueError("EPL could not make op %r (%s): %s" % (name, op_type, e.message))
    return _wrap(graph, [node])[0]
