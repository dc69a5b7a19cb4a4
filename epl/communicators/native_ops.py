"""Thin wrappers over the C++ collective ops (csrc/), with their gradients.

Each function builds the op of ONE rank; the ranks of a collective share the
``group`` string.  Gradients pair all-reduce with all-reduce, all-gather with
reduce-scatter (here: all-reduce + own slice, which also handles unequal
sizes), broadcast with reduce, and all-to-all with all-to-all.
"""
import tensorflow as tf

from epl.communicators import op_library
from epl.tf_adapter import deferred

DTYPES = (tf.float16, tf.float32, tf.float64, tf.int32, tf.int64)


def _common(group, rank, size, timeout_seconds, transport):
    return dict(group=group, rank=rank, size=size, timeout_seconds=int(timeout_seconds),
                transport=transport)


def all_reduce(x, group, rank, size, reduce_op="sum", timeout_seconds=600,
               transport="inprocess", name=None):
    return op_library.ops().epl_all_reduce(x, reduce_op=reduce_op, name=name,
                                       **_common(group, rank, size, timeout_seconds, transport))


def _deferred(xs, device):
    """The inputs hold a rewrite's not-yet-made copies (``deferred.Output``): the
    op is then made in C on ``device``, without making them."""
    return device is not None and any(isinstance(x, deferred.Output) for x in xs)


def _create(op_type, inputs, dtype, attrs, device, name):
    attr = tf.compat.v1.AttrValue
    values = dict(T=attr(type=dtype.as_datatype_enum))
    for k, v in attrs.items():
        values[k] = attr(s=v.encode()) if isinstance(v, str) else attr(i=v)
    first = inputs[0][0] if isinstance(inputs[0], list) else inputs[0]
    return deferred.create_op(first.graph, op_type, name or op_type, device, inputs,
                              values).outputs


def all_reduce_n(xs, group, rank, size, reduce_op="sum", timeout_seconds=600,
                 transport="inprocess", name=None, device=None):
    """Fused all-reduce of a list of same-dtype tensors: one collective, no concat/split.
    ``xs`` may hold deferred copies (see ``_deferred``)."""
    xs = list(xs)
    common = _common(group, rank, size, timeout_seconds, transport)
    if _deferred(xs, device):
        return _create("EplAllReduceN", [xs], xs[0].dtype,
                       dict(common, N=len(xs), reduce_op=reduce_op), device, name)
    return op_library.ops().epl_all_reduce_n(xs, reduce_op=reduce_op, name=name, **common)


def all_gather(x, group, rank, size, timeout_seconds=600, transport="inprocess", name=None,
               device=None):
    """Concatenation of every rank's ``x`` along axis 0 (sizes may differ).  ``x`` may
    be a deferred copy (see ``_deferred``)."""
    common = _common(group, rank, size, timeout_seconds, transport)
    if _deferred([x], device):
        return _create("EplAllGather", [x], x.dtype, common, device, name)[0]
    out, _ = op_library.ops().epl_all_gather(x, name=name, **common)
    return out


def reduce_scatter(x, group, rank, size, reduce_op="sum", timeout_seconds=600,
                   transport="inprocess", name=None):
    """This rank's rows of the reduction, rows split like numpy.array_split."""
    return op_library.ops().epl_reduce_scatter(x, reduce_op=reduce_op, name=name,
                                           **_common(group, rank, size, timeout_seconds,
                                                     transport))


def broadcast(x, group, rank, size, root=0, timeout_seconds=600, transport="inprocess",
              name=None):
    return op_library.ops().epl_broadcast(x, root=root, name=name,
                                      **_common(group, rank, size, timeout_seconds, transport))


def reduce(x, group, rank, size, root=0, reduce_op="sum", timeout_seconds=600,
           transport="inprocess", name=None):
    """The reduction on ``root``; zeros on the other ranks."""
    return op_library.ops().epl_reduce(x, root=root, reduce_op=reduce_op, name=name,
                                   **_common(group, rank, size, timeout_seconds, transport))


def all_to_all(x, group, rank, size, split_sizes=None, timeout_seconds=600,
               transport="inprocess", name=None):
    """Rank r sends rows ``split_sizes[j]`` to rank j; returns (received rows, recv sizes)."""
    if split_sizes is None:
        split_sizes = tf.zeros([0], tf.int64)
    split_sizes = tf.cast(split_sizes, tf.int64)
    return op_library.ops().epl_all_to_all(x, split_sizes, name=name,
                                       **_common(group, rank, size, timeout_seconds, transport))


def _attrs(op):
    """The attributes of the collective that computes ``op``'s gradient: the same ranks,
    in a group of its own for each backward pass through ``op``."""
    return dict(group=_gradient_group(op), rank=op.get_attr("rank"),
                size=op.get_attr("size"), timeout_seconds=op.get_attr("timeout_seconds"),
                transport=op.get_attr("transport").decode())


def _gradient_group(op):
    """``<group>/grad_<k>`` for the k-th backward pass through rank r's op of ``group``.

    Every backward pass (two losses through one layer, each with its own tf.gradients
    call; gradient checkpointing's check; a GradientTape) builds one gradient op per
    rank, and the ranks of one pass must meet in one group, apart from the other
    passes (a shared group would see a rank arrive twice, or add one pass's values to
    another's).  A pass differentiates every rank of the collective (a rank left out
    would wait forever), so the k-th gradient of rank 0's op and the k-th gradient of
    rank 1's op belong to the same pass; the count is kept per graph (the graph is
    built in the same order on every worker, so the names agree across workers).
    ``op`` may be a GradientTape's stand-in for the op: only its attributes are read.
    """
    graph = tf.compat.v1.get_default_graph()
    counts = getattr(graph, "_epl_collective_gradients", None)
    if counts is None:   # (an attribute: TF 2.x's Graph has no __dict__)
        counts = {}
        setattr(graph, "_epl_collective_gradients", counts)
    group = op.get_attr("group").decode()
    key = (group, op.get_attr("rank"))
    counts[key] = counts.get(key, 0) + 1
    return "%s/grad_%d" % (group, counts[key])


@tf.RegisterGradient("EplAllReduce")
def _all_reduce_grad(op, grad):
    how = op.get_attr("reduce_op").decode()
    if how not in ("sum", "mean"):
        return [None]
    return [op_library.ops().epl_all_reduce(grad, reduce_op=how, **_attrs(op))]


@tf.RegisterGradient("EplAllReduceN")
def _all_reduce_n_grad(op, *grads):
    how = op.get_attr("reduce_op").decode()
    if how not in ("sum", "mean"):
        return [None] * len(grads)
    grads = [g if g is not None else tf.zeros_like(x) for g, x in zip(grads, op.inputs)]
    return op_library.ops().epl_all_reduce_n(grads, reduce_op=how, **_attrs(op))


@tf.RegisterGradient("EplAllGather")
def _all_gather_grad(op, grad, _):
    total = op_library.ops().epl_all_reduce(grad, reduce_op="sum", **_attrs(op))
    sizes = op.outputs[1]
    rank = op.get_attr("rank")
    start = tf.reduce_sum(sizes[:rank])
    return [total[start:start + sizes[rank]]]


@tf.RegisterGradient("EplReduceScatter")
def _reduce_scatter_grad(op, grad):
    if op.get_attr("reduce_op").decode() not in ("sum", "mean"):
        return [None]
    out, _ = op_library.ops().epl_all_gather(grad, **_attrs(op))
    if op.get_attr("reduce_op").decode() == "mean":
        out = out / tf.cast(op.get_attr("size"), out.dtype)
    return [out]


@tf.RegisterGradient("EplBroadcast")
def _broadcast_grad(op, grad):
    return [op_library.ops().epl_reduce(grad, root=op.get_attr("root"), reduce_op="sum",
                                    **_attrs(op))]


@tf.RegisterGradient("EplReduce")
def _reduce_grad(op, grad):
    how = op.get_attr("reduce_op").decode()
    if how not in ("sum", "mean"):
        return [None]
    out = op_library.ops().epl_broadcast(grad, root=op.get_attr("root"), **_attrs(op))
    if how == "mean":
        out = out / tf.cast(op.get_attr("size"), out.dtype)
    return [out]


@tf.RegisterGradient("EplAllToAll")
def _all_to_all_grad(op, grad, _):
    back, _ = op_library.ops().epl_all_to_all(grad, op.outputs[1], **_attrs(op))
    return [back, None]
