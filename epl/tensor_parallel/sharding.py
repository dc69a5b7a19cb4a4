"""Shards: which shard new ops belong to, how a dimension is divided, and the
registry of logical tensors built from shards.

A sharded layer returns ONE ordinary tensor to the user (the concatenation of
its shards, computed on the split's first device only if something reads it)
and records its shards here, so the next split-aware call reads the shards
directly and the full tensor is never formed.
"""
import contextlib
import threading

import tensorflow as tf

from epl import ir
from epl.core import layout
from epl.core.process_state import Env
from epl.ir.strategies import current_strategy
from epl.tensor_parallel import checkpoint_slices
from epl.tf_adapter import graph as tfg

_local = threading.local()


def _stack():
    if not hasattr(_local, "shards"):
        _local.shards = []
        _local.raw = 0
    return _local


@contextlib.contextmanager
def on_shard(index, taskgraph=None):
    """Ops created inside run on shard ``index`` of the current split.  ``taskgraph``:
    the split's TaskGraph, for ops that read no tensor of it (a sharded loss's one-hot
    labels built outside the split scope): they join it instead of staying
    unannotated."""
    st = _stack()
    st.shards.append((index, taskgraph))
    try:
        yield
    finally:
        st.shards.pop()


def current_shard():
    st = _stack()
    return st.shards[-1][0] if st.shards else None


def shard_taskgraph():
    """The TaskGraph given to the innermost ``on_shard``, or None."""
    st = _stack()
    return st.shards[-1][1] if st.shards else None


@contextlib.contextmanager
def raw():
    """EPL's own calls of patched functions inside (no re-routing)."""
    st = _stack()
    st.raw += 1
    try:
        yield
    finally:
        st.raw -= 1


def routing():
    """True when a patched user call may be re-routed to its sharded form."""
    return not _stack().raw


def active_split():
    """The ``epl.split`` strategy new ops belong to, or None."""
    s = current_strategy()
    return s if s is not None and s.kind == "split" else None


def split_count(strategy):
    """Devices of a split; an impossible count fails here, while the user builds."""
    cluster = Env.get().cluster
    n = strategy.device_count
    if n is None:
        n = cluster.total_gpu_num
    if n > cluster.total_gpu_num:
        raise ValueError(
            "%r: the split needs %d devices but the job has %d (%d worker(s) x %d); use "
            "device_count <= %d or add devices. %s"
            % (strategy, n, cluster.total_gpu_num, cluster.worker_num,
               cluster.gpu_num_per_worker, cluster.total_gpu_num, layout.how_to_get_devices()))
    return n


def single_process():
    """True when every device of the job is in this process (in-process collectives)."""
    return Env.get().cluster.worker_num == 1


def sizes(total, n, what="dimension"):
    """Shard sizes of ``total`` over ``n`` shards, like numpy.array_split."""
    if total < n:
        raise ValueError("EPL split: cannot shard a %s of %d over %d devices (a shard would be "
                         "empty); use epl.split(device_count <= %d) or a larger layer."
                         % (what, total, n, total))
    base, extra = divmod(total, n)
    return [base + (1 if i < extra else 0) for i in range(n)]


def offsets(shard_sizes):
    out, acc = [], 0
    for s in shard_sizes:
        out.append(acc)
        acc += s
    return out


class Sharded(object):
    """A logical tensor held as ``shards`` along ``axis`` (shard i on device i)."""

    def __init__(self, shards, axis):
        self.shards = list(shards)
        self.axis = axis
        self.sizes = [int(s.shape[axis]) for s in shards]
        self.offsets = offsets(self.sizes)


def register(logical, shards, axis):
    ir.Graph.get(logical.graph).sharded[logical] = Sharded(shards, axis)
    return logical


def lookup(t):
    """The Sharded record of logical tensor ``t`` (or None)."""
    if not isinstance(t, tf.Tensor):
        return None
    return ir.Graph.get(t.graph).sharded.get(t)


def last_axis(sharded, rank):
    return sharded.axis in (-1, rank - 1)


def slice_initializer(initializer, full_shape, axis, offset, size):
    """Shard of ``initializer``'s value for the full shape: a shard starts exactly as
    its slice of the unsplit variable (fan-in/out scaling included)."""
    if initializer is None:
        initializer = tf.compat.v1.glorot_uniform_initializer()   # tf.get_variable's default
    init = tf.keras.initializers.get(initializer) if not callable(initializer) else initializer

    def make(shape, dtype=None, partition_info=None):  # pylint: disable=unused-argument
        full = init(list(full_shape), dtype=dtype)
        begin = [0] * len(full_shape)
        begin[axis] = offset
        extent = list(full_shape)
        extent[axis] = size
        return tf.slice(full, begin, extent)
    return make


def mark_slice(var, full_name, full_shape, axis, offset):
    """Checkpoints save ``var`` as its slice of ``full_name`` (the unsplit variable's
    name): a sharded model's checkpoint restores into the local model and into any
    other shard count (TF's partitioned-variable slices)."""
    var_offset = [0] * len(full_shape)
    var_offset[axis] = offset
    tfg.set_save_slice_info(var, tf.Variable.SaveSliceInfo(
        full_name, list(full_shape), var_offset, var.shape.as_list()))
    checkpoint_slices.note_shard(var)
    return var


def concat(shards, axis, name=None):
    """The logical tensor of ``shards`` (on the split's first device)."""
    with raw():
        out = tf.concat(shards, axis=axis, name=name)
    return register(out, shards, axis)
