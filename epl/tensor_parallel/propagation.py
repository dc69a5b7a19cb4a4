"""Shard propagation: ops on a sharded logical tensor stay sharded, shard by shard.

A split layer returns a *logical* tensor whose shards live on the split's devices
(:mod:`epl.tensor_parallel.sharding`).  When the user's next op reads it, e.g. the
reshape of a column-parallel Q projection into ``[batch, seq, heads, head_dim]``,
the graph's op-creation hook calls :func:`create_op`.  If the op is made under
``epl.split``, reads a sharded input and its type has a rule
(:mod:`epl.tensor_parallel.rules`), the rule builds one op per shard (each under
``sharding.on_shard(i)``, so shard ``i`` runs on device ``i``) and the op the user
gets back is registered as a logical tensor with those shards and the sharded axis
the op carries it to.  So a whole attention block (reshape, transpose, batched
matmuls, scale, mask, softmax, dropout, the reshape back) runs head-parallel and the
row-parallel output projection reads the shards directly.

The op the user gets back is the real op TensorFlow asked for (its type and
attributes are what the caller reads), built on the *gathered* inputs (the
concatenation of their shards): it is computed only when fetched.  An unsharded
op that later reads a propagated logical tensor reads its gather instead (the
concatenation of its shards, on the split's first device): correct, computed only
then.  TensorFlow's autodiff follows the per-shard ops (the gathers lie on the
loss's path only where an unsharded op reads them; then their gradient is the
slice of each shard).

A rule that cannot keep an op sharded returns None (the op reads the gather, as
before this module existed) or raises ``NotImplementedError`` naming the op and
the way to write it, for the patterns that look head-parallel but cannot be (a
reshape that merges the head axis with the batch axis); see docs/split.md.
"""
import contextlib

import tensorflow as tf

from epl import ir
from epl.core.process_state import Env
from epl.ir import capture_context
from epl.tensor_parallel import rules, sharding
from epl.tf_adapter import graph as tfg


class _State(object):
    """Per graph: the gather of every propagated logical tensor, tensors that stand
    for another one (the computed full shape of a sharded tensor), and the shape
    tensors of sharded tensors (for random ops shaped like them: dropout)."""

    def __init__(self):
        self.replacement = ir.TensorMap()    # tensor -> what new ops read instead
        self.shape_source = ir.TensorMap()   # tf.shape(logical) -> Sharded of logical


def _state(graph):
    return ir.Graph.get(graph).feature(_State)


def _capturing():
    if not Env.initialized():
        return False
    c = capture_context.state()
    return not (c.rewriting or c.save or c.apply or c.forced or c.grad_ops)


class Call(object):
    """One op creation the hook intercepted: what rules read and build with."""

    def __init__(self, graph, op_type, inputs, dtypes, input_types, name, attrs, op_def,
                 compute_device, n):
        self.graph, self.op_type, self.inputs = graph, op_type, list(inputs)
        self.dtypes, self.input_types, self.name = dtypes, input_types, name
        self.attrs, self.op_def, self.compute_device = attrs or {}, op_def, compute_device
        self.n = n
        self.records = [_record(t, n) for t in self.inputs]
        self.op = None   # the full op, made before the shards (its name scopes theirs)

    def rank(self, i):
        return self.inputs[i].shape.ndims

    def attr(self, key):
        """The op's attribute ``key`` as a Python value (None when absent)."""
        value = self.attrs.get(key)
        if value is None:
            return None
        field = value.WhichOneof("value")
        return getattr(value, field) if field else None

    def shard_op(self, i, inputs, attrs=None, suffix=""):
        """The op on shard ``i`` reading ``inputs`` (same type and attributes, updated
        by ``attrs``)."""
        merged = dict(self.attrs)
        merged.update(attrs or {})
        with self.graph.name_scope(self.op.name + "/"), sharding.on_shard(i):
            op = tfg.create_op(self.graph, self.op_type, inputs,
                               [o.dtype for o in self.op.outputs],
                               name="shard_%d%s" % (i, suffix), attrs=merged,
                               op_def=self.op_def, compute_device=self.compute_device)
        return op.outputs[0]

    def on_shard(self, i):
        """Context for helper ops of shard ``i`` (name scoped under the op)."""
        return _shard_scope(self, i)

    def shape_source(self, t):
        """The Sharded record of the tensor ``t`` is the shape of (tf.shape), or None."""
        st = _state(self.graph)
        return st.shape_source[t] if t in st.shape_source else None

    def reshard(self, rec, sizes):
        """The shards of ``rec`` re-cut to ``sizes`` along its axis: each new shard takes
        its pieces from the old shards that hold them (slices on their devices)."""
        if list(sizes) == list(rec.sizes):
            return list(rec.shards)
        axis = rec.axis % rec.shards[0].shape.ndims
        out, start = [], 0
        for i, size in enumerate(sizes):
            stop, pieces = start + size, []
            for j, (off, have) in enumerate(zip(rec.offsets, rec.sizes)):
                lo, hi = max(start, off), min(stop, off + have)
                if lo >= hi:
                    continue
                if lo == off and hi == off + have:
                    pieces.append(rec.shards[j])
                    continue
                with self.on_shard(j):
                    index = [slice(None)] * axis + [slice(lo - off, hi - off)]
                    pieces.append(rec.shards[j][tuple(index)])
            with self.on_shard(i):
                out.append(pieces[0] if len(pieces) == 1 else tf.concat(pieces, axis))
            start = stop
        return out

    def split_operand(self, t, axis, sizes):
        """Unsharded operand ``t`` cut into ``sizes`` along ``axis`` (on the split's first
        device, sent to each shard)."""
        with self.graph.name_scope(self.op.name + "/"), sharding.raw():
            return tf.split(t, sizes, axis=axis, name="operand_pieces")

    def describe(self):
        return "%s op %r" % (self.op_type, self.op.name if self.op is not None else self.name)


@contextlib.contextmanager
def _shard_scope(call, i):
    with call.graph.name_scope(call.op.name + "/"), sharding.raw(), sharding.on_shard(i):
        yield


def _record(t, n):
    rec = sharding.lookup(t)
    if rec is None or len(rec.shards) != n or t.shape.ndims is None:
        return None
    return rec


def create_op(create, graph, op_type, inputs, dtypes=None, input_types=None, name=None,
              attrs=None, op_def=None, compute_device=True):
    """The graph hook's op creation (``create`` makes the op as TensorFlow would)."""
    if not inputs or not _capturing():
        return create(graph, op_type, inputs, dtypes, input_types, name, attrs, op_def,
                      compute_device)
    st = _state(graph)
    builder = None
    strategy = sharding.active_split() if sharding.routing() else None
    if strategy is not None:
        rule = rules.RULES.get(op_type)
        n = sharding.split_count(strategy)
        if rule is not None and n > 1:
            call = Call(graph, op_type, inputs, dtypes, input_types, name, attrs, op_def,
                        compute_device, n)
            if any(call.records) or any(t in st.shape_source for t in call.inputs):
                builder = rule(call)
    gathered = [_read(st, t) for t in inputs] if len(st.replacement) else inputs
    op = create(graph, op_type, gathered, dtypes, input_types, name, attrs, op_def,
                compute_device)
    if builder is not None:
        call.op = op
        result = builder()
        if isinstance(result, tuple):
            shards, axis = result
            _register(graph, op.outputs[0], shards, axis)
            # The full op runs (only when fetched) beside shard 0: it is not unsplit work
            # the rewriter should warn about.
            ir.Graph.get(graph).op_shard[op.name] = 0
        elif result is not None:
            st.replacement[op.outputs[0]] = result
            st.shape_source[op.outputs[0]] = call.records[0]
    return op


def _read(st, t):
    """What a new op reads for input ``t``."""
    return st.replacement[t] if isinstance(t, tf.Tensor) and t in st.replacement else t


def _register(graph, logical, shards, axis):
    """``logical`` (the full op's output) is held as ``shards`` along ``axis``; unsharded
    readers read their concatenation."""
    with graph.name_scope(logical.op.name + "/"):
        gather = sharding.concat(shards, axis=axis, name="gather")
    _state(graph).replacement[logical] = gather
    sharding.register(logical, shards, axis)
