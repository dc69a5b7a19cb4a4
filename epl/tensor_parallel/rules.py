"""Per-op-type rules of shard propagation (:mod:`epl.tensor_parallel.propagation`).

A rule reads a ``propagation.Call`` (the op being made, its inputs, their
Sharded records) and returns None when it cannot keep the op sharded (the op then
reads the gathered input, correct and unsplit) or a builder: called once the full
op exists, it makes the per-shard ops and returns ``(shards, axis)`` (the op's
output is that logical tensor) or, for ``Shape``, the tensor consumers read instead.

Rules:

* element-wise ops (unary, and n-ary with broadcasting: an unsharded operand whose
  dimension on the sharded axis is 1 or missing is read whole by every shard, one
  with the full dimension is cut into the shards' pieces), ``BiasAdd``;
* ``Reshape`` that keeps the sharded block contiguous: splitting the sharded axis
  into ``[heads, head_dim]`` (heads outermost) or merging ``[heads, head_dim]``
  back, outer axes reshaped freely.  Shard boundaries must fall on the new axis'
  boundaries (whole heads); when the previous layer's column sizes do not, the
  shards are re-cut to ``array_split`` of the heads first (slices move between
  neighbouring devices; never when the heads divide the split).  A reshape that
  merges a head axis with an outer axis (``[b, h, s, d] -> [b*h, s, d]``) is refused;
* ``Transpose`` (the sharded axis moves with the permutation), ``ExpandDims``;
* ``BatchMatMul``/``V2``/``V3`` and ``MatMul`` that keep the sharded axis: a batch
  axis of both operands (or one broadcast), the rows of ``x`` or the columns of ``y``;
* ``Softmax``/``LogSoftmax`` over another axis than the sharded one; reductions over
  other axes;
* ``Shape`` (computed from shard 0, no gather) and random ops shaped like a sharded
  tensor (dropout's mask): one random op per shard, each with its own seed.
"""
import numpy as np
import tensorflow as tf

from epl.tensor_parallel import sharding

UNARY = frozenset([
    "Cast", "Neg", "Exp", "Log", "Log1p", "Expm1", "Tanh", "Sigmoid", "Relu", "Relu6",
    "Elu", "Selu", "Softplus", "Softsign", "Erf", "Sqrt", "Rsqrt", "Square", "Abs",
    "Identity", "StopGradient", "PreventGradient", "Snapshot", "Floor", "Ceil", "Round",
    "Sign", "Reciprocal", "Inv", "Sin", "Cos", "LeakyRelu", "Gelu", "ZerosLike",
    "OnesLike", "LogicalNot", "IsNan", "IsFinite"])
NARY = frozenset([
    "Add", "AddV2", "Sub", "Mul", "RealDiv", "Div", "DivNoNan", "MulNoNan", "Maximum",
    "Minimum", "Pow", "SquaredDifference", "FloorDiv", "FloorMod", "TruncateDiv",
    "Greater", "GreaterEqual", "Less", "LessEqual", "Equal", "NotEqual", "LogicalAnd",
    "LogicalOr", "SelectV2", "AddN", "BiasAdd"])
RANDOM = frozenset(["RandomUniform", "RandomStandardNormal", "TruncatedNormal"])
REDUCE = frozenset(["Sum", "Mean", "Max", "Min", "Prod", "All", "Any"])


def _axis(rec):
    return rec.axis % rec.shards[0].shape.ndims


def _static(t):
    """Static value of an int vector as a list (None entries where unknown), or None."""
    value = tf.get_static_value(t)
    if value is not None:
        return [int(v) for v in np.reshape(value, [-1])]
    if t.op.type == "Pack":
        out = []
        for x in t.op.inputs:
            v = tf.get_static_value(x)
            out.append(None if v is None else int(v))
        return out
    return None


def _dims(t):
    return t.shape.as_list()


def _unary(call):
    rec = call.records[0]
    if rec is None or len(call.inputs) != 1:
        return None
    return lambda: ([call.shard_op(i, [s]) for i, s in enumerate(rec.shards)], _axis(rec))


def _align(call, sharded):
    """The shards of every sharded input, re-cut to the first one's sizes."""
    first = call.records[sharded[0]]
    return {k: call.reshard(call.records[k], first.sizes) for k in sharded}


def _nary(call):
    """Broadcasting element-wise ops: operands aligned from the right."""
    if call.op_type == "BiasAdd" and call.attr("data_format") not in (None, b"NHWC", "NHWC"):
        return None
    ranks = [call.rank(k) for k in range(len(call.inputs))]
    if any(r is None for r in ranks):
        return None
    sharded = [k for k, rec in enumerate(call.records) if rec is not None]
    neg = set(_axis(call.records[k]) - ranks[k] for k in sharded)
    if len(neg) != 1:
        return None   # sharded along different axes
    neg = neg.pop()
    full = sum(call.records[sharded[0]].sizes)
    plan = []
    for k, t in enumerate(call.inputs):
        if k in sharded:
            plan.append("shards")
            continue
        dims = _dims(t)
        dim = dims[neg] if -neg <= len(dims) else 1
        if dim == 1:
            plan.append("whole")
        elif dim == full:
            plan.append("split")
        else:
            return None   # unknown: it may or may not broadcast
    rank_out = max(ranks)

    def build():
        pieces = _align(call, sharded)
        sizes = call.records[sharded[0]].sizes
        per_input = []
        for k, (how, t) in enumerate(zip(plan, call.inputs)):
            if how == "shards":
                per_input.append(pieces[k])
            elif how == "whole":
                per_input.append([t] * call.n)
            else:
                per_input.append(call.split_operand(t, len(_dims(t)) + neg, sizes))
        shards = [call.shard_op(i, [p[i] for p in per_input]) for i in range(call.n)]
        return shards, rank_out + neg
    return build


def _reshape(call):
    rec = call.records[0]
    if rec is None:
        return None
    a = _axis(rec)
    in_dims = _dims(call.inputs[0])
    out = _static(call.inputs[1])
    if out is None:
        return None
    raw = out
    out = [None if d is None or d < 0 else d for d in raw]
    inner = in_dims[a + 1:]
    if any(d is None for d in inner):
        return None
    p_in = int(np.prod(inner)) if inner else 1
    total = sum(rec.sizes) * p_in
    p, prod = len(out), 1
    while p > 0 and prod < total and out[p - 1] is not None:
        prod *= out[p - 1]
        p -= 1
    if prod < total and p > 0 and _same_prefix(out[:p - 1], in_dims[:a]) \
            and total % prod == 0:
        out[p - 1] = total // prod   # (the one unknown is inside the sharded block)
        prod, p = total, p - 1
    if prod != total:
        mixes = prod > total or (p > 0 and out[p - 1] is None)
        if mixes and a > 0 and in_dims[:a] != [1] * a and not sharding.last_axis(
                rec, len(in_dims)):
            raise NotImplementedError(
                "EPL split: %s reshapes %r %s, sharded along axis %d over %d devices (a "
                "head axis), to %s, which merges that axis with an outer one (e.g. "
                "[batch, heads, seq, head_dim] -> [batch * heads, seq, head_dim]). The "
                "result would not be a slice of the shards, so it cannot stay sharded, "
                "and EPL does not gather it silently. Keep the heads as their own axis "
                "(tf.matmul broadcasts over [batch, heads]) and merge them only with "
                "head_dim, after transposing them next to it."
                % (call.describe(), call.inputs[0].name, in_dims, a, call.n, out))
        return None   # not a block of trailing axes (or not decidable): gather
    j = p
    while out[j] == 1:
        j += 1
    block = int(np.prod(out[j + 1:])) if j + 1 < len(out) else 1
    if all(s * p_in % block == 0 for s in rec.sizes):
        heads = [s * p_in // block for s in rec.sizes]
    else:
        heads = sharding.sizes(out[j], call.n, "%s's axis %d (heads)" % (call.describe(), j))
        if any(h * block % p_in for h in heads):
            return None
    in_sizes = [h * block // p_in for h in heads]

    def build():
        shards = call.reshard(rec, in_sizes)
        outs = []
        target = call.inputs[1]
        for i, s in enumerate(shards):
            with call.on_shard(i):
                if raw[j] == -1:
                    shape = target   # (-1 infers the shard's heads itself)
                elif tf.get_static_value(target) is not None:
                    shape = tf.constant(raw[:j] + [heads[i]] + raw[j + 1:], target.dtype)
                elif target.op.type == "Pack":
                    parts = list(target.op.inputs)
                    parts[j] = tf.constant(heads[i], target.dtype)
                    shape = tf.stack(parts)
                else:
                    delta = [0] * len(out)
                    delta[j] = heads[i] - out[j]
                    shape = target + tf.constant(delta, dtype=target.dtype)
            y = call.shard_op(i, [s, shape])
            dims = [None] * len(out)
            dims[j] = heads[i]
            y.set_shape(dims)
            outs.append(y)
        return outs, j
    return build


def _same_prefix(out, dims):
    """True when ``out`` (a reshape's leading target dims) is ``dims`` (the input's),
    unknown entries matching unknown ones."""
    return len(out) == len(dims) and all(o == d or (o is None and d is None)
                                         for o, d in zip(out, dims))


def _transpose(call):
    rec = call.records[0]
    perm = _static(call.inputs[1]) if rec is not None else None
    if perm is None or None in perm:
        return None
    a = _axis(rec)
    return lambda: ([call.shard_op(i, [s, call.inputs[1]]) for i, s in enumerate(rec.shards)],
                    perm.index(a))


def _expand_dims(call):
    rec = call.records[0]
    dim = _static(call.inputs[1]) if rec is not None else None
    if not dim or dim[0] is None:
        return None
    rank = call.rank(0) + 1
    d = dim[0] % rank
    a = _axis(rec)
    return lambda: ([call.shard_op(i, [s, call.inputs[1]]) for i, s in enumerate(rec.shards)],
                    a + 1 if d <= a else a)


def _matmul(call):
    x, y = call.inputs[:2]
    rx, ry = call.rank(0), call.rank(1)
    if rx is None or ry is None:
        return None
    if call.op_type == "MatMul":
        adj_x, adj_y = call.attr("transpose_a"), call.attr("transpose_b")
    else:
        adj_x, adj_y = call.attr("adj_x"), call.attr("adj_y")
    rx_, ry_ = call.records
    ax = _axis(rx_) - rx if rx_ is not None else None
    ay = _axis(ry_) - ry if ry_ is not None else None
    rank_out = max(rx, ry)
    row_x, col_y = (-1 if adj_x else -2), (-2 if adj_y else -1)
    if (ax is not None and ax <= -3) or (ay is not None and ay <= -3):
        neg = ax if ax is not None else ay
        if (ax is not None and ax != neg) or (ay is not None and ay != neg):
            return None
        sharded = [k for k, rec in enumerate(call.records) if rec is not None]
        full = sum(call.records[sharded[0]].sizes)
        plan = []
        for k, t in enumerate((x, y)):
            if call.records[k] is not None:
                plan.append("shards")
                continue
            dims = _dims(t)
            dim = dims[neg] if -neg <= len(dims) else 1
            if dim == 1:
                plan.append("whole")
            elif dim == full:
                plan.append("split")
            else:
                return None
        out_axis = rank_out + neg
    elif ax == row_x and ry_ is None:
        sharded, plan, neg, out_axis = [0], ["shards", "whole"], None, rank_out - 2
    elif ay == col_y and rx_ is None:
        sharded, plan, neg, out_axis = [1], ["whole", "shards"], None, rank_out - 1
    else:
        return None   # the contracted axis (partial products) or mixed: gather

    def build():
        pieces = _align(call, sharded)
        sizes = call.records[sharded[0]].sizes
        per = []
        for k, (how, t) in enumerate(zip(plan, (x, y))):
            if how == "shards":
                per.append(pieces[k])
            elif how == "whole":
                per.append([t] * call.n)
            else:
                per.append(call.split_operand(t, len(_dims(t)) + neg, sizes))
        return [call.shard_op(i, [per[0][i], per[1][i]]) for i in range(call.n)], out_axis
    return build


def _softmax(call):
    rec = call.records[0]
    if rec is None or _axis(rec) == call.rank(0) - 1:
        return None   # over the sharded axis: gather (a classifier's probabilities)
    return _unary(call)


def _reduce(call):
    rec = call.records[0]
    axes = _static(call.inputs[1]) if rec is not None else None
    if axes is None or None in axes:
        return None
    rank = call.rank(0)
    axes = sorted(set(d % rank for d in axes))
    a = _axis(rec)
    if a in axes:
        return None   # over the sharded axis: gather
    keep = bool(call.attr("keep_dims"))
    new_axis = a if keep else a - len([d for d in axes if d < a])
    return lambda: ([call.shard_op(i, [s, call.inputs[1]]) for i, s in enumerate(rec.shards)],
                    new_axis)


def _shape(call):
    rec = call.records[0]
    if rec is None:
        return None
    a = _axis(rec)
    rank = call.rank(0)

    def build():
        dtype = call.op.outputs[0].dtype
        with call.on_shard(0):
            first = tf.shape(rec.shards[0], out_type=dtype)
            delta = [0] * rank
            delta[a] = sum(rec.sizes) - rec.sizes[0]
            return first + tf.constant(delta, dtype=dtype)
    return build


def _random(call):
    rec = call.shape_source(call.inputs[0])
    if rec is None:
        return None
    a = _axis(rec)

    def build():
        outs = []
        for i, s in enumerate(rec.shards):
            with call.on_shard(i):
                shape = tf.shape(s, out_type=call.inputs[0].dtype)
            attrs = {}
            seed, seed2 = call.attr("seed") or 0, call.attr("seed2") or 0
            if (seed or seed2) and "seed2" in call.attrs:
                # Each shard its own stream (the same seeds would repeat shard 0's mask).
                value = type(call.attrs["seed2"])()
                value.i = (seed2 + 1000003 * i) % (2 ** 31 - 1)
                attrs["seed2"] = value
            outs.append(call.shard_op(i, [shape] + call.inputs[1:], attrs))
        return outs, a
    return build


RULES = {}
RULES.update({t: _unary for t in UNARY})
RULES.update({t: _nary for t in NARY})
RULES.update({t: _random for t in RANDOM})
RULES.update({t: _reduce for t in REDUCE})
RULES.update({"Reshape": _reshape, "Transpose": _transpose, "ExpandDims": _expand_dims,
              "BatchMatMul": _matmul, "BatchMatMulV2": _matmul, "BatchMatMulV3": _matmul,
              "MatMul": _matmul, "Softmax": _softmax, "LogSoftmax": _softmax,
              "Shape": _shape})
