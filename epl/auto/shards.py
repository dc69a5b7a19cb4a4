"""Tensor parallelism's shards of a model's matrix products, for timing them as what they
are: a split product runs thinner (a column-parallel product has 1/t of the output
columns, a row-parallel one 1/t of the inner dimension, attention 1/t of the heads),
and on EPL's CPU devices a thin product runs at its own speed, not at the whole one's
(``product_timing``: how well a product spreads over the cores depends on its shape).

Which axis a split divides is read per tensor from Megatron's pattern as
``graph_profile`` finds it (the forward pass):

* a product with a weight whose data input is replicated (column-parallel) divides the
  weight's free axis and the output's matching axis;
* one whose data input is split (row-parallel) divides the inner axis of both operands;
  its output is whole (a partial sum, all-reduced);
* a product without a weight whose inputs are split (attention's scores and context, of
  rank 4: [batch, heads, rows, depth]) divides axis 1 (the heads) of every operand.

A gradient product reads the forward tensors (their axes) and the output's gradient
(the output's axis), and writes the gradient of the forward input it does not read
(that input's axis).  A recipe is the axis each of a product signature's shapes (its
inputs, then its output) is divided along, or None: ``shard_signature`` makes the
shard's signature of it for a split degree."""
import json

_PRODUCTS = ("MatMul", "BatchMatMul", "BatchMatMulV2", "BatchMatMulV3")


def _free_and_inner(op, index):
    """(the free axis, the inner axis) of operand ``index`` (0 or 1) of ``op``."""
    rank = op.inputs[index].shape.rank
    flag = ("transpose_a", "adj_x")[op.type != "MatMul"] if index == 0 else \
        ("transpose_b", "adj_y")[op.type != "MatMul"]
    swapped = bool(op.get_attr(flag))
    last, before = rank - 1, rank - 2
    if index == 0:      # [.., m, k] (or [.., k, m] when transposed)
        return (last, before) if swapped else (before, last)
    return (before, last) if swapped else (last, before)    # [.., k, n] or [.., n, k]


def forward_axes(op, weight_index, in_split):
    """{tensor name: the axis the split divides} of a split forward product's operands
    and output (a whole one: absent), or None where the pattern is not one above."""
    if op.type not in _PRODUCTS or any(t.shape.rank is None for t in
                                       list(op.inputs) + [op.outputs[0]]):
        return None
    out = op.outputs[0]
    if weight_index is None:
        tensors = list(op.inputs) + [out]
        if not in_split or any(t.shape.rank != 4 for t in tensors):
            return None
        return dict((t.name, 1) for t in tensors)
    data = 1 - weight_index
    weight_free, weight_inner = _free_and_inner(op, weight_index)
    if in_split:        # row-parallel: the inner axis of both operands
        return {op.inputs[data].name: _free_and_inner(op, data)[1],
                op.inputs[weight_index].name: weight_inner}
    # column-parallel: the weight's free axis and the output's (m: second to last, n: last)
    rank = out.shape.rank
    return {op.inputs[weight_index].name: weight_free,
            out.name: rank - 2 if weight_index == 0 else rank - 1}


def forward_recipe(op, axes):
    """The recipe of a forward product whose tensors split as ``axes``."""
    return [axes.get(t.name) for t in list(op.inputs) + [op.outputs[0]]]


def gradient_recipe(op, forward_op, axes):
    """The recipe of gradient product ``op`` of ``forward_op``, whose tensors split as
    ``axes`` (``forward_axes``), or None where it does not read as one (an input that is
    neither a forward operand nor of the output's gradient's shape)."""
    operands = list(forward_op.inputs)
    names = [t.name for t in operands]
    y = forward_op.outputs[0]
    recipe, read = [], set()
    for t in op.inputs:
        if t.name in names:
            read.add(t.name)
            recipe.append(axes.get(t.name))
        elif t.shape.as_list() == y.shape.as_list():
            recipe.append(axes.get(y.name))
        else:
            return None
    unread = [t for t in operands if t.name not in read]
    if len(unread) != 1 or op.outputs[0].shape.as_list() != unread[0].shape.as_list():
        return None
    recipe.append(axes.get(unread[0].name))
    return recipe


def key(sig, recipe):
    """The key of a product signature split by ``recipe`` (``Region.shards``)."""
    return json.dumps([sig, recipe])


def unkey(shard_key):
    """(signature, recipe) of a ``key``."""
    sig, recipe = json.loads(shard_key)
    return sig, recipe


def shard_signature(shard_key, t):
    """The signature of the product of ``key`` on one of ``t`` devices: each shape
    divided along its recipe's axis (rounded up), or None where an axis is not there."""
    sig, recipe = unkey(shard_key)
    kind, shapes, attrs = json.loads(sig)
    if recipe is None or len(recipe) != len(shapes):
        return None
    out = []
    for shape, axis in zip(shapes, recipe):
        shape = list(shape)
        if axis is not None:
            if not 0 <= axis < len(shape):
                return None
            shape[axis] = -(-shape[axis] // t)
        out.append(shape)
    return json.dumps([kind, out, attrs], sort_keys=True)


def signatures(shard_counts, t):
    """The shards' signatures on one of ``t`` devices of ``Region.shards`` (none for
    t = 1), to be timed."""
    if t == 1:
        return []
    return [s for s in (shard_signature(k, t) for k in shard_counts) if s]


def seconds(shard_key, t, timed):
    """Seconds of one run of a split product's shard on one of ``t`` devices: its shard's
    time (``timed(signature)``, None where it was not timed), else the whole product's
    / t."""
    sig = shard_signature(shard_key, t)
    got = timed(sig) if sig is not None else None
    return got if got is not None else timed(unkey(shard_key)[0]) / float(t)


def split_part(region, what, epl_runtime):
    """The region's ``"flops"`` / ``"pointwise"`` (per row) or ``"shards"`` its split
    divides: Megatron-LM's, or on EPL's own runtime (``epl_runtime``) less what EPL's
    split runs whole on the first device (``Region.epl_whole``: a tied LM head and
    what reads it; priced sharded, the GPT's TP 2 read -20 % on TF 2.x)."""
    whole = getattr(region, "epl_whole", None) if epl_runtime else None
    if what == "shards":        # (less the head's runs: another product may share a key)
        less = whole["shards"] if whole else {}
        kept = dict((k, [a - b for a, b in zip(n, less.get(k, (0, 0)))])
                    for k, n in region.shards.items())
        return dict((k, n) for k, n in kept.items() if any(n))
    part = getattr(region, what + "_split")
    return part - whole[what] if whole else part
