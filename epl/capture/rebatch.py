"""Scopes that run on another number of rows are built for any number of rows.

Two annotations change how many examples a part of the model sees:
``replicate(device_count=k)`` with ``k > 1`` splits each replica's batch into k
parts (seed 003), and a ``split`` scope after replicated layers reads every
replica's rows.  TensorFlow bakes a *static* batch size into the graph while it is
built: ``tf.shape`` of a fixed-shape tensor is a constant, and gradient functions
(``Mean``, ``Sum``, ``BroadcastTo``...) write the row count into constants.  Such
a graph cannot be re-batched afterwards.

So while the user builds the graph, an op created in such a scope that reads a
fixed-batch tensor entering the scope (from the input pipeline, or from another
scope) reads a *relaxed* view of it instead: the same values, with the batch
dimension unknown (a ``PlaceholderWithDefault``, whose gradient is the
identity).  Everything built from it, forward and backward, is then computed
from the run-time shape.  The same holds for the gradients other scopes send
into such a scope (the replicas' gradient of a split output they read).  The rewriter treats the relaxed view as the point
where rows enter the scope (see ``epl.rewrite.split``).

Outside those scopes nothing changes: data parallelism with ``device_count=1``
and pipelines keep every static shape (each clone pulls a whole batch).
"""
import tensorflow as tf

from epl import ir
from epl.ir import capture_context
from epl.tf_adapter import graph as tfg


def rebatches(taskgraph):
    """True when the scope may run on another number of rows than it is built for."""
    if taskgraph is None:
        return False
    return taskgraph.kind == "split" or taskgraph.device_count > 1


def _fixed_batch(t):
    shape = t.shape
    return (shape.ndims is not None and shape.ndims >= 1 and shape.dims[0].value is not None
            and not ir.is_state_handle(t))


def inputs_for(graph, taskgraph, inputs, phase=ir.FORWARD):
    """The inputs a new op of ``taskgraph`` should read: fixed-batch tensors that
    enter the scope (in the backward pass: the gradients other scopes send in) are
    replaced by their relaxed views."""
    if taskgraph is None:
        return inputs
    whole = rebatches(taskgraph)
    epl_graph = ir.Graph.get(graph)
    out = None
    for i, t in enumerate(inputs):
        if not isinstance(t, tf.Tensor) or not _fixed_batch(t):
            continue
        src = t.op
        if src.name in epl_graph.relaxed:
            continue
        if not whole and not _from_split(epl_graph, src, taskgraph):
            continue
        if tfg.control_flow_context(src) is not None \
                or tfg.graph_control_flow_context(graph) is not None:
            continue   # inside a loop or condition: a view there would leave its frame
        enters = (epl_graph.taskgraph_of(src) is not taskgraph or src.type in ir.SOURCE_OPS)
        if not enters or not epl_graph.is_batch(src):
            continue
        if out is None:
            out = list(inputs)
        out[i] = _relaxed(graph, epl_graph, t, taskgraph, phase)
    return inputs if out is None else out


def _from_split(epl_graph, src, taskgraph):
    """``src`` is a forward op of a split scope read by another scope: the split may have
    computed more rows than each replica reads (it read the input pipeline itself,
    the global batch, and each replica reads its share of its output)."""
    tg = epl_graph.taskgraph_of(src)
    return (tg is not None and tg is not taskgraph and tg.kind == "split"
            and epl_graph.phase_of(src) == ir.FORWARD)   # (not a variable's gradient)


def _relaxed(graph, epl_graph, t, taskgraph, phase):
    key = (t.name, taskgraph.index)
    view = epl_graph.relax_cache.get(key)
    if view is None:
        shape = [None] + t.shape.as_list()[1:]
        with graph.name_scope(None), graph.control_dependencies(None), \
                graph.colocate_with(None, ignore_existing=True), \
                capture_context.creating_for(taskgraph, phase):
            view = tf.compat.v1.placeholder_with_default(
                t, shape, name="EPL_RELAXED_BATCH/" + t.op.name.replace(":", "_"))
        epl_graph.relaxed[view.op.name] = t
        epl_graph.relax_cache[key] = view
    return view
