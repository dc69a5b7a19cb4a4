"""Graph surgery on ``tf.Graph`` / ``tf.Operation``: every private attribute EPL reads or
writes on them, behind one small named function each.

Why a module of one-liners: TensorFlow offers no public way to rewire an existing op's
input, add a control edge after the fact, move an op to another device or walk ops in
creation order, yet a graph rewriter needs all four.  Keeping each private access here
makes the rest of EPL independent of TensorFlow's layout, and puts every difference
between TF 1.15 and TF 2.x (whose ``Graph`` is partly C++) in one file.

Op ids: TensorFlow numbers ops in creation order (``op_id``); EPL uses the numbers to
ask for "the ops made since X" (``ops_between`` / ``last_op_id``) and to sort ops into a
deterministic order (``by_id``).
"""
import collections.abc
import contextlib
import operator

from tensorflow.python.framework import ops as _ops

from epl.tf_adapter.version import IS_TF2

# The op's creation number in its graph (increasing, unique); a C-level getter: it is
# the sort key of every rewrite and costs no Python frame.
op_id = operator.attrgetter("_id")


def by_id(ops):
    """``ops`` sorted into creation order."""
    return sorted(ops, key=op_id)


if IS_TF2:
    _offset = []

    def last_op_id(graph):
        """The id of the newest op of ``graph`` (ids of ops made later are larger)."""
        # TF 2.x's C++ graph keeps no "last id", but numbers ops from a counter that
        # ``version`` also reports, shifted by a constant measured once.
        if not _offset:
            scratch = _ops.Graph()
            with scratch.as_default():
                first = _ops.convert_to_tensor(0.0).op
            _offset.append(first._id - scratch.version)  # pylint: disable=protected-access
        return graph.version + _offset[0]

    def ops_between(graph, first_id, last_id=None):
        """The ops of ``graph`` with ids in ``[first_id, last_id]`` (default: to the
        newest), in creation order."""
        last = last_op_id(graph) if last_id is None else last_id
        nodes = graph._nodes_by_id  # pylint: disable=protected-access
        return [nodes[i] for i in range(first_id, last + 1) if i in nodes]

    def op_with_id(graph, i):
        nodes = graph._nodes_by_id  # pylint: disable=protected-access
        return nodes[i] if i in nodes else None

    def _lookup_op(graph, name):
        return graph._get_operation_by_name(name)  # pylint: disable=protected-access
else:
    def last_op_id(graph):
        """The id of the newest op of ``graph`` (ids of ops made later are larger)."""
        return graph._last_id  # pylint: disable=protected-access

    def ops_between(graph, first_id, last_id=None):
        """The ops of ``graph`` with ids in ``[first_id, last_id]`` (default: to the
        newest), in creation order."""
        last = graph._last_id if last_id is None else last_id  # pylint: disable=protected-access
        nodes = graph._nodes_by_id  # pylint: disable=protected-access
        return [nodes[i] for i in range(first_id, last + 1) if i in nodes]

    def op_with_id(graph, i):
        return graph._nodes_by_id.get(i)  # pylint: disable=protected-access

    def _lookup_op(graph, name):
        return graph._get_operation_by_name_unsafe(name)  # pylint: disable=protected-access


def op_by_name(graph, name):
    """The op named ``name`` (KeyError when there is none), without the checks and
    locking of ``get_operation_by_name``: for lookups inside a rewrite."""
    return _lookup_op(graph, name)


class _OpsByName(collections.abc.Mapping):
    """TF 2.x keeps name -> op in a C++ map (``OpsByName``: ``[]``, ``in``, ``keys``,
    no ``get``); this gives it the whole read-only Mapping interface."""

    def __init__(self, nodes):
        self._nodes = nodes

    def __getitem__(self, name):
        return self._nodes[name]

    def __contains__(self, name):
        return name in self._nodes

    def __iter__(self):
        return iter(self._nodes.keys())

    def __len__(self):
        return len(self._nodes)


def ops_by_name(graph):
    """A mapping name -> op of the Python ops of ``graph`` (read only)."""
    nodes = graph._nodes_by_name  # pylint: disable=protected-access
    return nodes if isinstance(nodes, dict) else _OpsByName(nodes)


def names_in_use(graph):
    """The lower-cased names ``graph.unique_name`` avoids (a dict; adding a name
    reserves it)."""
    return graph._names_in_use  # pylint: disable=protected-access


# -- edges ------------------------------------------------------------------------------

def add_control_inputs(op, control_ops):
    """``op`` also waits for every op of ``control_ops``."""
    op._add_control_inputs(list(control_ops))  # pylint: disable=protected-access


def update_input(op, index, tensor):
    """Input ``index`` of ``op`` becomes ``tensor``."""
    op._update_input(index, tensor)  # pylint: disable=protected-access


def rewire(tensor, replacement, skip=None):
    """Every consumer of ``tensor`` reads ``replacement`` instead, except the ops for
    which ``skip(op)`` is true and ``replacement``'s own op; returns the consumers
    rewired."""
    done = []
    for consumer in list(tensor.consumers()):
        if consumer is replacement.op or (skip is not None and skip(consumer)):
            continue
        for i, t in enumerate(consumer.inputs):
            if t is tensor:
                consumer._update_input(i, replacement)  # pylint: disable=protected-access
        done.append(consumer)
    return done


def control_outputs(op):
    """The ops that wait for ``op`` through a control edge."""
    return op._control_outputs  # pylint: disable=protected-access


def users(op):
    """Every op that reads an output of ``op`` or waits for it."""
    return [c for t in op.outputs for c in t.consumers()] + list(op._control_outputs)  # pylint: disable=protected-access


# -- placement -------------------------------------------------------------------------

def set_device(op, device):
    """Place ``op`` on ``device`` (after creation, without TF's device functions)."""
    op._set_device(device)  # pylint: disable=protected-access


def clear_colocation(op):
    """Drop the ``_class`` colocation constraint of ``op`` (its placement is EPL's now)."""
    op._clear_attr("_class")  # pylint: disable=protected-access


def colocating(graph):
    """True inside a ``colocate_with`` block of ``graph``."""
    return bool(len(graph._colocation_stack))  # pylint: disable=protected-access


# -- types -----------------------------------------------------------------------------

def is_ref_dtype(dtype):
    """A reference dtype (TF1 ref variables hand out ``float32_ref`` tensors)."""
    return dtype._is_ref_dtype  # pylint: disable=protected-access


def is_ref(tensor):
    return tensor.dtype._is_ref_dtype  # pylint: disable=protected-access


def input_wants_ref(op, index):
    """Input ``index`` of ``op`` is declared as a reference (an Assign's variable)."""
    return op._input_types[index]._is_ref_dtype  # pylint: disable=protected-access


# -- control flow ----------------------------------------------------------------------

def control_flow_context(op):
    """The TF1 control-flow context (cond / while) ``op`` was made in, or None."""
    return getattr(op, "_control_flow_context", None)


def set_control_flow_context(op, context):
    op._control_flow_context = context  # pylint: disable=protected-access


def graph_control_flow_context(graph):
    """The control-flow context new ops of ``graph`` are made in now, or None."""
    return graph._get_control_flow_context()  # pylint: disable=protected-access


def set_graph_control_flow_context(graph, context):
    graph._set_control_flow_context(context)  # pylint: disable=protected-access


# -- op creation -----------------------------------------------------------------------

def create_op(graph, op_type, inputs, dtypes, input_types=None, name=None, attrs=None,
              op_def=None, compute_device=False):
    """A new op through the graph's internal constructor (no name scope or control
    dependency handling beyond the graph's current ones, no shape function
    surprises): EPL's copies and its own ops are made this way."""
    return graph._create_op_internal(  # pylint: disable=protected-access
        op_type, list(inputs), list(dtypes), input_types=input_types, name=name,
        attrs=attrs, op_def=op_def, compute_device=compute_device)


def copy_op(op, inputs, name, device=None, control_inputs=(), attrs=None):
    """A copy of ``op`` reading ``inputs``, named ``name``, on ``device`` (None: the
    original's), with the original's attributes less colocation, updated by ``attrs``;
    made outside any name scope, control dependency and colocation."""
    g = op.graph
    new_attrs = {k: v for k, v in op.node_def.attr.items() if k != "_class"}
    new_attrs.update(attrs or {})
    with g.name_scope(None), g.control_dependencies(None), \
            g.colocate_with(None, ignore_existing=True):
        new = create_op(g, op.type, inputs, [o.dtype for o in op.outputs],
                        input_types=[t.dtype for t in op.inputs], name=name,
                        attrs=new_attrs, op_def=op.op_def)
    new._set_device(op.device if device is None else device)  # pylint: disable=protected-access
    if control_inputs:
        new._add_control_inputs(list(control_inputs))  # pylint: disable=protected-access
    return new


def wrap_c_ops(graph, c_ops):
    """Python ``Operation``s for nodes already in the C graph (made by an import or the
    C API), outside any control-flow context; allowed on a finalized graph (a view of
    existing nodes changes no graph)."""
    with unfinalized(graph):
        made = [graph._create_op_from_tf_operation(c, compute_device=False)  # pylint: disable=protected-access
                for c in c_ops]
    for op in made:
        op._control_flow_context = None  # pylint: disable=protected-access
    return made


@contextlib.contextmanager
def unfinalized(graph):
    """Inside, ``graph`` accepts new ops even if finalized (EPL's own late edits)."""
    finalized = graph._finalized  # pylint: disable=protected-access
    graph._finalized = False  # pylint: disable=protected-access
    try:
        yield
    finally:
        graph._finalized = finalized  # pylint: disable=protected-access


def is_finalized(graph):
    return graph.finalized


def mutation_lock(graph):
    return graph._mutation_lock()  # pylint: disable=protected-access


def default_graph_replaceable():
    """True when no ``with graph.as_default():`` block is open (the default graph can be
    replaced by ``reset_default_graph``)."""
    return _ops._default_graph_stack.is_cleared()  # pylint: disable=protected-access


# -- variables -------------------------------------------------------------------------

def set_save_slice_info(variable, info):
    """Checkpoint ``variable`` as a slice of a larger variable (``info``: a
    ``tf.Variable.SaveSliceInfo``)."""
    variable._set_save_slice_info(info)  # pylint: disable=protected-access


def save_slice_info(variable):
    """The ``tf.Variable.SaveSliceInfo`` ``variable`` is checkpointed as (a shard of a
    partitioned variable), or None."""
    return variable._get_save_slice_info()  # pylint: disable=protected-access


def all_saveable_objects():
    """What a default ``Saver`` saves: global variables and saveable objects."""
    from tensorflow.python.ops import variables
    return variables._all_saveable_objects()  # pylint: disable=protected-access
