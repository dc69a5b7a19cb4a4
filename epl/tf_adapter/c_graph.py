"""TensorFlow's C API, for the rewrite's bulk work: import thousands of copies at once
(``import_node_defs``), read a NodeDef without parsing it (``node_def_bytes``), make an op
from C outputs whose Python ops do not exist yet (``new_op``), add control edges between
such nodes (``add_control_edge``).

Why C: a Python ``Operation`` costs about 20 us, importing its node about 5; at BERT
scale (tens of thousands of ops per replica) the difference is the rewrite's time.
TF 1.15 exports the functions as ``pywrap_tensorflow``, TF 2.x as ``pywrap_tf_session``
(which takes the Python graph itself where 1.15 takes its ``_c_graph``).
"""
import contextlib

import tensorflow as _tf
from tensorflow.python.framework import c_api_util as _util

from epl.tf_adapter.version import IS_TF2

if IS_TF2:  # pragma: no cover - TF 2.x line
    from tensorflow.python.client import pywrap_tf_session as _c
else:
    from tensorflow.python import pywrap_tensorflow as _c

# TF 2.x's C graph cannot look a node up by name from Python, nor add a control edge
# to a node without its Python op: there every copy gets its Python op at once.
DEFERRED_WRAPPERS = not IS_TF2


@contextlib.contextmanager
def _raw_graph(graph):
    """The handle the C functions take for ``graph``."""
    if IS_TF2:  # pragma: no cover - TF 2.x line
        with graph._c_graph.get() as c_graph:  # pylint: disable=protected-access
            yield c_graph
    else:
        yield graph._c_graph  # pylint: disable=protected-access


def c_op(op):
    """The C node of a Python op."""
    return op._c_op  # pylint: disable=protected-access


def c_op_by_name(graph, name):
    """The C node named ``name`` (it may have no Python op yet)."""
    if IS_TF2:  # pragma: no cover - TF 2.x line
        return graph._get_operation_by_name(name)._c_op  # pylint: disable=protected-access
    return _c.TF_GraphOperationByName(graph._c_graph, name)  # pylint: disable=protected-access


def c_op_name(node):
    return _c.TF_OperationName(node)


def tf_output(node, index):
    """Output ``index`` of the C node ``node``, as the C API takes it."""
    return _util.tf_output(node, index)


def tensor_output(tensor):
    """A ``tf.Tensor`` as the C API takes it."""
    return tensor._as_tf_output()  # pylint: disable=protected-access


def add_control_edge(graph, dst, src):
    """The C node ``dst`` waits for the C node ``src``."""
    if IS_TF2:  # pragma: no cover - TF 2.x line
        raise NotImplementedError("control edges between C nodes need Python ops on TF 2.x")
    _c.AddControlInput(graph._c_graph, dst, src)  # pylint: disable=protected-access


def node_def_bytes(op):
    """The serialized NodeDef of ``op`` (cheaper than ``op.node_def``, which parses)."""
    with _util.tf_buffer() as buf:
        _c.TF_OperationToNodeDef(op._c_op, buf)  # pylint: disable=protected-access
        return _c.TF_GetBuffer(buf)


def new_op(graph, op_type, name, device, inputs, attrs):
    """A new C node: ``inputs`` are C outputs (``tf_output`` / ``tensor_output``) or
    lists of them for a list input, ``attrs`` {name: AttrValue}.  Returns the C node;
    ValueError when TensorFlow refuses it."""
    with graph._mutation_lock(), _raw_graph(graph) as raw:  # pylint: disable=protected-access
        desc = _c.TF_NewOperation(raw, op_type, graph.unique_name(name))
        _c.TF_SetDevice(desc, device)
        for x in inputs:
            if isinstance(x, (list, tuple)):
                _c.TF_AddInputList(desc, list(x))
            else:
                _c.TF_AddInput(desc, x)
        for k, v in attrs.items():
            _c.TF_SetAttrValueProto(desc, k, v.SerializeToString())
        try:
            return _c.TF_FinishOperation(desc)
        except _tf.errors.InvalidArgumentError as e:
            raise ValueError("EPL could not make op %r (%s): %s" % (name, op_type, e.message))


def import_node_defs(graph, serialized, input_map, control_map, return_names=None,
                     rename=None):
    """Import the serialized GraphDef ``serialized`` into ``graph`` in one call.

    ``input_map`` ("name:index" or "name", tf.Tensor) pairs feed the imported nodes'
    inputs of those names from existing tensors; ``control_map`` ("^name", op or C
    node) pairs likewise for control inputs (dicts work too).  With ``rename`` (default:
    when ``return_names`` is given) the importer uniquifies clashing names, without it
    the nodes keep their names (ValueError when one is taken).  Without
    ``return_names`` None is returned; with it the C nodes of ``return_names`` come
    back, in order, with their final names: ``(names, c_nodes)``."""
    if rename is None:
        rename = return_names is not None
    scoped = _util.ScopedTFImportGraphDefOptions()
    options = scoped.options
    _c.TF_ImportGraphDefOptionsSetPrefix(options, "")
    _c.TF_ImportGraphDefOptionsSetUniquifyNames(options, rename)
    _c.TF_ImportGraphDefOptionsSetValidateColocationConstraints(options, False)
    for key, t in (input_map.items() if isinstance(input_map, dict) else input_map):
        name, _, index = key.rpartition(":")      # ("name:1": output 1 of "name")
        if not name:
            name, index = key, "0"
        _c.TF_ImportGraphDefOptionsAddInputMapping(options, name, int(index),
                                                   t._as_tf_output())  # pylint: disable=protected-access
    for key, op in (control_map.items() if isinstance(control_map, dict) else control_map):
        _c.TF_ImportGraphDefOptionsRemapControlDependency(options, key,
                                                          getattr(op, "_c_op", op))
    for name in return_names or ():
        _c.TF_ImportGraphDefOptionsAddReturnOperation(options, name)
    with graph._mutation_lock():  # pylint: disable=protected-access
        with _util.tf_buffer(serialized) as buf, _raw_graph(graph) as raw:
            try:
                results = _c.TF_GraphImportGraphDefWithResults(raw, buf, options)
            except _tf.errors.InvalidArgumentError as e:
                raise ValueError("EPL could not copy the replica's ops: %s" % e.message)
            results = _util.ScopedTFImportGraphDefResults(results)
        if return_names is None:
            return None
        nodes = _c.TF_ImportGraphDefResultsReturnOperations(results.results)
        return [_c.TF_OperationName(n) for n in nodes], nodes
