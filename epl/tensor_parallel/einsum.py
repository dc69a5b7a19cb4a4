"""``tf.einsum`` under ``epl.split(n)``: sharded along a split variable's first axis.

A variable made under ``split(n)`` (``tf.get_variable``, ``add_weight`` of
``tf.layers``) is stored as n row shards (:mod:`epl.tensor_parallel.variables`);
an MoE layer written by hand keeps its experts that way, ``[experts, m, h]``.
An einsum that reads such a variable, where the variable's first letter (the
expert dimension ``E`` of ``'EGCM,EMH->EGCH'``) is kept in the output, is
computed shard by shard: shard i reads its experts' weights where they live and
the matching rows of every other operand that carries ``E`` (split once, on the
split's first device), and computes its experts' part of the output.  The
output is the logical concatenation of the parts (:mod:`sharding`): a following
einsum over the same experts reads the parts directly, so a chain of expert
einsums never forms the full intermediate on one device.

The numbers are those of the unsplit einsum (the expert dimension is not
contracted, so each output element is computed by exactly one shard).  An
einsum that contracts or drops the expert letter, uses an ellipsis, or reads no
split operand runs unsplit (on the split's first device).
"""
import tensorflow as tf

from epl import ir
from epl.tensor_parallel import sharding
from epl.tf_adapter import variables as tf_variables


def einsum(original, equation, *inputs, **kwargs):
    """``original(equation, *inputs)``, sharded when :func:`_plan` finds a split axis."""
    strategy = sharding.active_split() if sharding.routing() else None
    if strategy is None or not isinstance(equation, str):
        return original(equation, *inputs, **kwargs)
    n = sharding.split_count(strategy)
    plan = _plan(equation, inputs, n) if n > 1 else None
    if plan is None:
        return original(equation, *inputs, **kwargs)
    letter, sizes, out_axis = plan
    subscripts = _subscripts(equation)[0]
    name = kwargs.pop("name", None)
    source = [x for x, sub in zip(inputs, subscripts)
              if tf_variables.is_partitioned(x) and letter in sub][0]
    with sharding.raw():
        pieces = [_pieces(x, sub, letter, sizes) for x, sub in zip(inputs, subscripts)]
        for x, sub in zip(inputs, subscripts):
            if isinstance(x, tf.Tensor) and letter in sub:
                _expert_axes(x.graph).setdefault(x, (sub.index(letter), letter, equation,
                                                     source.name, sum(sizes), n))
        outs = []
        for i in range(n):
            with sharding.on_shard(i):
                outs.append(original(equation, *[p[i] for p in pieces], **kwargs))
    return sharding.concat(outs, axis=out_axis,
                           name=(name or "einsum") + "_sharded_output")


def _subscripts(equation):
    """([input subscripts], output subscripts), or None for forms not sharded here
    (implicit output, ellipsis)."""
    eq = equation.replace(" ", "")
    if "->" not in eq or "." in eq:
        return None
    lhs, out = eq.split("->")
    return lhs.split(","), out


def _split_source(x, n):
    """(shard sizes along axis 0) of a split variable, or (axis, sizes) of a logical
    sharded tensor, as (axis, sizes); None for an ordinary operand."""
    if tf_variables.is_partitioned(x) and getattr(x, "_epl_split", False):
        parts = list(x)
        full = x.get_shape().as_list()
        if len(parts) != n or any(p.shape.as_list()[1:] != full[1:] for p in parts):
            return None   # (not n row shards: partitioned along another axis)
        return 0, [int(p.shape[0]) for p in parts]
    rec = sharding.lookup(x)
    if rec is not None and len(rec.shards) == n:
        return rec.axis % x.shape.ndims, rec.sizes
    return None


def _plan(equation, inputs, n):
    """(letter, shard sizes, output axis) of the letter to shard over, or None."""
    parsed = _subscripts(equation)
    if parsed is None or len(parsed[0]) != len(inputs):
        return None
    subs, out = parsed
    if any(len(set(s)) != len(s) for s in subs):
        return None   # a repeated letter (a diagonal): not sharded here
    choice = None
    for x, sub in zip(inputs, subs):
        src = _split_source(x, n)
        if src is None or src[0] >= len(sub):
            continue
        letter = sub[src[0]]
        if letter not in out:
            continue   # contracted: the shards' products would have to be summed
        if choice is not None and (choice[0] != letter or choice[1] != src[1]):
            return None   # two split operands that disagree
        choice = (letter, src[1])
    if choice is None or not any(tf_variables.is_partitioned(x)
                                 for x in inputs):
        return None
    for x, sub in zip(inputs, subs):
        if choice[0] in sub:
            dim = tf.TensorShape(getattr(x, "shape", None)).as_list()
            size = dim[sub.index(choice[0])] if dim else None
            if size is not None and size != sum(choice[1]):
                return None   # the user's shapes disagree: let tf.einsum say so
    return choice[0], choice[1], out.index(choice[0])


def _pieces(x, sub, letter, sizes):
    """Operand ``x``'s part for each shard: its variable shards, its logical shards,
    its rows along ``letter`` (split once), or the whole operand."""
    n = len(sizes)
    if tf_variables.is_partitioned(x) and getattr(x, "_epl_split", False):
        if letter in sub:
            return list(x)
        return [x] * n
    if letter not in sub:
        return [x] * n
    axis = sub.index(letter)
    rec = sharding.lookup(x)
    if rec is not None and rec.axis % x.shape.ndims == axis and rec.sizes == sizes:
        return rec.shards
    return tf.split(x, sizes, axis=axis)


def _expert_axes(graph):
    """tensor -> (axis, letter, equation, variable, experts, shards) of the einsums that
    read ``tensor``'s ``axis`` as a split variable's expert dimension."""
    return ir.Graph.get(graph).feature(_ExpertAxes)


class _ExpertAxes(dict):
    """``_expert_axes``' map of one graph (``ir.Graph.feature``)."""


def check_not_gathered(t, copies):
    """``t`` is about to be read by the split as the concatenation of every replica's
    copy along its first dimension: refused when a sharded einsum reads that dimension
    as its experts (the replicas' batches would become extra experts)."""
    axis, letter, equation, variable, experts, shards = _expert_axes(t.graph).get(
        t, (None,) * 6)
    if axis != 0:
        return
    raise NotImplementedError(
        "EPL split: tf.einsum(%r) under epl.split reads dimension 0 of %r as the expert "
        "dimension %r of the split variable %r (%d experts over %d devices), but %r is a "
        "batch that each of the %d replicas pulls for itself (the replicated ops read the "
        "input pipeline too): the split would receive the replicas' batches concatenated "
        "along that dimension (%d rows for %d experts). Either let only the split read this "
        "input (the split then reads one batch per step and each replica reads its rows of "
        "the split's output; e.g. compute the targets inside the split, or feed them "
        "through another pipeline), or build the layer with epl.moe_layer(tokens "
        "[tokens, d], num_experts, ...) under epl.split, which sends each replica's tokens "
        "to the devices of their experts with all-to-all and back."
        % (equation, t.name, letter, variable, experts, shards, t.name, len(copies),
           len(copies) * experts, experts))
