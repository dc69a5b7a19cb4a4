"""Functional control flow (control flow v2): ops whose bodies are functions of the graph's
function library.

With control flow v2 (TF 2.x after ``disable_eager_execution()`` alone, or
``tf.compat.v1.enable_control_flow_v2()`` on either line) ``tf.while_loop`` and ``tf.cond``
build one op each -- ``While`` / ``StatelessWhile`` / ``If`` / ``StatelessIf`` -- whose
condition and bodies are ``FunctionDef``s in the graph's library, named by the op's
function-valued attributes.  The ops inside a body are not ops of the graph: a rewrite
sees the call op, and what its bodies do (which captured variables they write, their
colocation, devices and random seeds) is read from the ``FunctionDef``s here.  Copying a
call op shares its bodies; a copy that needs bodies of its own gets edited copies of the
``FunctionDef``s, added to the library (``add_function_defs``).

Where the bodies live differs between the lines only in private attributes
(``Graph._get_function``, ``Operation._set_attr``): kept in this module.
"""
from tensorflow.python.framework import function as _function
from tensorflow.python.framework import op_def_registry as _op_defs

from epl.tf_adapter.version import IS_TF2

# Call op type -> how its inputs map to its functions' arguments: a loop passes input i
# as argument i; a condition / case takes the predicate (branch index) first; a call
# passes every input.
CALL_OPS = {"While": "loop", "StatelessWhile": "loop", "If": "branch", "StatelessIf": "branch",
            "Case": "branch", "StatelessCase": "branch", "PartitionedCall": "call",
            "StatefulPartitionedCall": "call"}

# Ops that take a resource (a captured variable) without changing it.
_RESOURCE_READS = frozenset(["ReadVariableOp", "ResourceGather", "ResourceGatherNd",
                             "VariableShape", "VarIsInitializedOp", "DestroyResourceOp",
                             "_ReadVariablesOp"])
_PASSTHROUGH = frozenset(["Identity", "IdentityN"])


def runs_apart_from_captured_variables():
    """A v2 loop or condition may run on another device than a variable it captured.
    TF 2.x's placer exempts these ops from colocation with their resource inputs (the
    reads inside their bodies go to the variable); TF 1.15's lowers a ``While`` into
    ``Enter`` / ``NextIteration`` nodes that must share the variable's device."""
    return IS_TF2


def is_call(op):
    """``op`` runs functions of the graph's library (a v2 loop or condition, a call)."""
    return op.type in CALL_OPS


def function_attrs(op):
    """[(attribute name, AttrValue)] of ``op``'s function-valued attributes (a loop's
    ``cond`` / ``body``, a condition's branches, a call's ``f``)."""
    out = []
    for name, value in sorted(op.node_def.attr.items()):
        if value.HasField("func") or (value.HasField("list") and len(value.list.func)):
            out.append((name, value))
    return out


def attr_function_names(value):
    """The function names an AttrValue names (one ``func`` or a list of them)."""
    if value.HasField("func"):
        return [value.func.name]
    if value.HasField("list"):
        return [f.name for f in value.list.func]
    return []


def node_function_names(node_def):
    """The function names a body's NodeDef names in its attributes (nested loops)."""
    out = []
    for _, value in sorted(node_def.attr.items()):
        out.extend(attr_function_names(value))
    return out


def function_def(graph, name):
    """The FunctionDef ``name`` of ``graph``'s library, or None when it is not there."""
    fn = graph._get_function(name)  # pylint: disable=protected-access
    if fn is not None:
        return fn.definition
    # (functions that came with an imported GraphDef: read the library once)
    cache = getattr(graph, "_epl_library", None)
    if cache is None or cache[0] != graph.version:
        library = {f.signature.name: f for f in graph.as_graph_def().library.function}
        cache = (graph.version, library)
        setattr(graph, "_epl_library", cache)
    return cache[1].get(name)


def function_graph(graph, name):
    """The Python ``FuncGraph`` a function of ``graph`` was built from, or None (a
    function imported from a GraphDef has none)."""
    fn = graph._get_function(name)  # pylint: disable=protected-access
    return getattr(fn, "graph", None) if fn is not None else None


def source_graphs(graph, name):
    """The Python ``FuncGraph``s function ``name`` was built from: its own, and where
    TensorFlow rebuilt it while building a gradient (a loop's body with accumulators:
    ``<name>_rewritten``) the one the user's code built, which holds what was
    recorded while the user built it.  (TF 1.15 rebuilds the body from its FunctionDef
    into a new graph; TF 2.x extends the user's.)"""
    out = []
    for n in (name, name[:-len("_rewritten")] if name.endswith("_rewritten") else None):
        g = function_graph(graph, n) if n else None
        if g is not None and all(g is not x for x in out):
            out.append(g)
    return out


def has_function(graph, name):
    return graph._get_function(name) is not None  # pylint: disable=protected-access


def add_function_defs(graph, fdefs):
    """Add the FunctionDefs ``fdefs`` to ``graph``'s library, known to its Python side
    too (``as_graph_def(add_shapes=True)``, which export_meta_graph and the Saver ask
    for, looks every library function up there)."""
    for fdef in fdefs:
        graph._add_function(_function._from_definition(fdef))  # pylint: disable=protected-access


def set_attr(op, name, value):
    """Set the attribute ``name`` of the existing op ``op`` to the AttrValue ``value``."""
    op._set_attr(name, value)  # pylint: disable=protected-access


def is_stateful_type(op_type):
    """Ops of ``op_type`` are stateful (unknown types count as stateful)."""
    if IS_TF2:
        op_def = _op_defs.get(op_type)
    else:
        op_def = _op_defs.get_registered_ops().get(op_type)
    return True if op_def is None else op_def.is_stateful


def argument_of(op_type, index):
    """The function argument input ``index`` of a call op of ``op_type`` becomes (None:
    the predicate or branch index of a condition)."""
    kind = CALL_OPS[op_type]
    if kind == "branch":
        return index - 1 if index > 0 else None
    return index


def written_inputs(op):
    """The input indices of the call op ``op`` whose resource (a captured variable) one
    of its functions writes: through an assign, an optimizer's apply op, any stateful op
    that is not a known read, in nested loops and conditions too.  A loop that only
    reads a variable it captured does not write it."""
    graph = op.graph
    names = [n for _, v in function_attrs(op) for n in attr_function_names(v)]
    # (asked of every op by several passes: kept per op and bodies; a body never
    # changes under its name -- a gradient that extends one renames it)
    cache = getattr(graph, "_epl_written_inputs", None)
    if cache is None:
        cache = {}
        setattr(graph, "_epl_written_inputs", cache)
    key = (op.name, tuple(names), len(op.inputs))
    if key not in cache:
        cache[key] = _written_inputs(op, names)
    return cache[key]


def _written_inputs(op, names):
    graph = op.graph
    memo = {}
    out = set()
    for i, t in enumerate(op.inputs):
        if t.dtype.base_dtype.name != "resource":
            continue
        arg = argument_of(op.type, i)
        if arg is None:
            continue
        if any(_writes_argument(graph, name, arg, memo) for name in names):
            out.add(i)
    return frozenset(out)


def _writes_argument(graph, fname, arg, memo):
    """A function of ``graph`` writes the resource it gets as argument ``arg``."""
    key = (fname, arg)
    if key in memo:
        return memo[key]
    memo[key] = False       # (a recursive call reads "no" until decided)
    fdef = function_def(graph, fname)
    if fdef is None or arg >= len(fdef.signature.input_arg):
        memo[key] = True    # unknown body: assume it writes
        return True
    readers = {}            # reference string -> [(node, data input position)]
    for node in fdef.node_def:
        pos = 0
        for ref in node.input:
            if ref.startswith("^"):
                continue
            readers.setdefault(ref, []).append((node, pos))
            pos += 1
    pending = [fdef.signature.input_arg[arg].name]
    seen = set()
    writes = False
    while pending and not writes:
        ref = pending.pop()
        if ref in seen:
            continue
        seen.add(ref)
        for node, pos in readers.get(ref, ()):
            if node.op in _RESOURCE_READS:
                continue
            if node.op in _PASSTHROUGH:
                out = "output:%d" % pos if node.op == "IdentityN" else "output:0"
                pending.append("%s:%s" % (node.name, out))
                if node.op == "Identity":
                    pending.append(node.name)   # (also referenced by bare name)
                continue
            if node.op in CALL_OPS:
                inner = argument_of(node.op, pos)
                if inner is not None and any(
                        _writes_argument(graph, name, inner, memo)
                        for name in node_function_names(node)):
                    writes = True
                    break
                continue
            if is_stateful_type(node.op):
                writes = True
                break
    memo[key] = writes
    return writes
