"""Python wrappers of imported copies, made on first use.

TensorFlow runs the C graph; a Python ``Operation`` is only a view of one node
for Python code.  Making that view costs more than importing the node (about
20 us against 5), and most of a replica's copies are never looked at from
Python: the session runs them by being in the graph.  So ``CopyPlan`` imports
the copies and registers their names here; a copy gets its ``Operation`` the
first time anything asks for it -- by name, as an input, consumer or control
edge of another op, through ``get_operations()``, or before TensorFlow wraps
new C nodes itself (the hooks are in ``epl.capture.patches``, patch point 16).

Wrappers made late are made inside the context set by ``set_wrap_context`` (EPL's
capture marks them as its own rewrite ops), outside any control-flow context (the
copies inside loops and conditions get theirs when the rewrite rebuilds the clone's
contexts).

A pass that only feeds copies into a new op (the gradient all-reduce reads
thousands of them) takes ``Output``s and makes the op in C (``create_op``);
anything else converts an ``Output`` to its ``tf.Tensor``, made then.
"""
import contextlib
import itertools

import tensorflow as tf

from epl.tf_adapter import c_graph
from epl.tf_adapter import graph as tfg
from epl.tf_adapter import patching

_wrap_context = [contextlib.suppress]   # (a no-op context manager by default)


def set_wrap_context(factory):
    """Wrappers made late are made inside ``factory()`` (the capture layer passes its
    "EPL's own op" context)."""
    _wrap_context[0] = factory


def _table(graph):
    """The graph's deferred nodes {name: C node or False}, or None.  (An attribute, not
    ``graph.__dict__``: TF 2.x's ``Graph`` is a C++ class with no ``__dict__``.)"""
    return getattr(graph, "_epl_deferred", None)


def import_nodes(graph, serialized, input_map, control_map, names, rename):
    """Import the serialized nodes ``names`` (``c_graph.import_node_defs``; ``rename``:
    let the importer uniquify taken names) and register them; returns their final
    names.  Where the C graph cannot find a node by name later (TF 2.x), the nodes
    come back from the import itself and get their Python ops at once."""
    if c_graph.DEFERRED_WRAPPERS and not rename:
        c_graph.import_node_defs(graph, serialized, input_map, control_map)
        register(graph, names)
        return names
    final, c_ops = c_graph.import_node_defs(graph, serialized, input_map, control_map,
                                            return_names=names, rename=rename)
    register(graph, final, c_ops)
    return final


def register(graph, names, c_ops=None):
    """The imported nodes named ``names`` (``c_ops``, when known: otherwise looked up
    by name when used) get their wrappers on demand -- or now, where wrappers cannot
    be deferred (``c_graph.DEFERRED_WRAPPERS`` false: TF 2.x); returns the wrappers
    made now (None when deferred)."""
    if not c_graph.DEFERRED_WRAPPERS:
        if c_ops is None:
            raise ValueError("EPL: on this TensorFlow the imported nodes' C handles are "
                             "needed to wrap them (import them with return_names)")
        return _wrap(graph, list(c_ops))
    table = _table(graph)
    if table is None:
        table = {}
        setattr(graph, "_epl_deferred", table)
    in_use = tfg.names_in_use(graph)
    if c_ops is None:
        table.update(dict.fromkeys(names, False))
    else:
        table.update(zip(names, c_ops))
    in_use.update(zip(map(str.lower, names), itertools.repeat(1)))
    return None


def _node(graph, table, name):
    """The C node of a registered name."""
    node = table[name]
    if node is False:
        node = table[name] = c_graph.c_op_by_name(graph, name)
    return node


def waiting(graph):
    return bool(_table(graph))


def materialize(graph, name):
    """The wrapper of the deferred node ``name``, or None if there is none."""
    table = _table(graph)
    if not table:
        return None
    if name not in table:
        return None
    c_op = _node(graph, table, name)
    del table[name]
    return _wrap(graph, [c_op])[0]


def materialize_all(graph):
    table = _table(graph)
    if not table:
        return
    c_ops = [_node(graph, table, name) for name in table]
    table.clear()
    _wrap(graph, c_ops)


def _wrap(graph, c_ops):
    with _wrap_context[0]():
        return tfg.wrap_c_ops(graph, c_ops)


def get(graph, name):
    """The op named ``name`` (made now if deferred)."""
    op = materialize(graph, name)
    return op if op is not None else tfg.op_by_name(graph, name)


def c_op(graph, name):
    """The C node named ``name`` (of a deferred copy or an existing op), without
    making its Python op: control edges between copies are added in C."""
    table = _table(graph)
    if table and name in table:
        return _node(graph, table, name)
    return c_graph.c_op(tfg.op_by_name(graph, name))


def add_control_edges(graph, sources, targets):
    """Every node named in ``targets`` waits for every node named in ``sources``."""
    if not c_graph.DEFERRED_WRAPPERS:   # (every copy has its Python op)
        src = [get(graph, n) for n in sources]
        for name in targets:
            tfg.add_control_inputs(get(graph, name), src)
        return
    src = [c_op(graph, n) for n in sources]
    for name in targets:
        dst = c_op(graph, name)
        for s in src:
            c_graph.add_control_edge(graph, dst, s)


class Output(object):
    """Output ``index`` (of ``dtype``) of the copy named ``name``, whose Python op
    may not exist yet."""
    __slots__ = ("graph", "name", "index", "dtype")

    def __init__(self, graph, name, index, dtype):
        self.graph, self.name, self.index, self.dtype = graph, name, index, dtype

    def tensor(self):
        return get(self.graph, self.name).outputs[self.index]

    def tf_output(self):
        return c_graph.tf_output(c_op(self.graph, self.name), self.index)


tf.register_tensor_conversion_function(
    Output, lambda value, dtype=None, name=None, as_ref=False: value.tensor())


def create_op(graph, op_type, name, device, inputs, attrs):
    """A new op of ``op_type`` on ``device`` made through TensorFlow's C API:
    ``inputs`` are tf.Tensors or ``Output``s (a list of them for a list input),
    ``attrs`` {name: AttrValue}.  Returns its Python op (the inputs' stay unmade)."""
    def tf_output(x):
        return x.tf_output() if isinstance(x, Output) else c_graph.tensor_output(x)

    node = c_graph.new_op(graph, op_type, name, device,
                          [[tf_output(y) for y in x] if isinstance(x, (list, tuple))
                           else tf_output(x) for x in inputs], attrs)
    return _wrap(graph, [node])[0]


# -- the graph hooks that make a deferred copy's wrapper when someone asks for it --------

def _op_by_name(self, name):
    try:
        return patching.original("graph.op_by_name")(self, name)
    except KeyError:
        op = materialize(self, name)
        if op is None:
            raise
        return op


def _as_graph_element_locked(self, obj, *args, **kwargs):
    if isinstance(obj, str) and _table(self):
        materialize(self, obj.split(":")[0] if ":" in obj else obj)
    return patching.original("graph.as_graph_element_locked")(self, obj, *args, **kwargs)


def _all_first(point):
    def patched(self, *args, **kwargs):
        if _table(self):
            materialize_all(self)
        return patching.original(point)(self, *args, **kwargs)
    return patched


def _as_graph_def(self, *args, **kwargs):
    """Shapes come from the Python ops (export_meta_graph asks for them)."""
    add_shapes = kwargs.get("add_shapes", args[1] if len(args) > 1 else False)
    if add_shapes and _table(self):
        materialize_all(self)
    return patching.original("graph.as_graph_def")(self, *args, **kwargs)


def _export_meta_graph(*args, **kwargs):
    """``export_meta_graph`` with ``clear_devices`` or an ``export_scope`` walks the
    Python graph's own table of ops, not ``as_graph_def``: the deferred copies first
    (without, a rewritten pipeline's meta graph lost its micro-batch clones while the
    all-reduce ops that read them stayed: it did not import)."""
    graph = kwargs.get("graph", args[2] if len(args) > 2 else None) \
        or tf.compat.v1.get_default_graph()
    if _table(graph):
        materialize_all(graph)
    return patching.original("meta_graph.export")(*args, **kwargs)


def install_hooks():
    """Every way TensorFlow finds an op by name, lists ops or wraps new C nodes first
    makes the deferred wrappers it needs (idempotent)."""
    patching.install("graph.op_by_name", _op_by_name)
    patching.install("graph.as_graph_element_locked", _as_graph_element_locked)
    patching.install("graph.get_operations", _all_first("graph.get_operations"))
    patching.install("graph.add_new_tf_operations", _all_first("graph.add_new_tf_operations"))
    patching.install("graph.as_graph_def", _as_graph_def)
    patching.install("meta_graph.export", _export_meta_graph)
