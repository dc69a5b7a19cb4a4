"""Collectives between devices of one process, as ordinary TF ops.

Reduce on the root, then every rank reads the result: on virtual CPU devices
(one address space) TF hands the buffer over without a copy.  It cannot hang:
there is no rendezvous, only data edges.  The fallback when EPL's C++ library is
not available, and the way split layers exchange rows across workers (TF's runtime
moves them).
"""
import tensorflow as tf

from epl.communicators.base import Communicator

_REDUCERS = {
    "sum": tf.math.add_n,
    "mean": lambda ts: tf.math.add_n(ts) / tf.cast(len(ts), ts[0].dtype),
    "max": lambda ts: _fold(tf.math.maximum, ts),
    "min": lambda ts: _fold(tf.math.minimum, ts),
}


def _fold(fn, ts):
    out = ts[0]
    for t in ts[1:]:
        out = fn(out, t)
    return out


def _reducer(reduce_op):
    if reduce_op not in _REDUCERS:
        raise ValueError("reduce_op %r not in %s" % (reduce_op, sorted(_REDUCERS)))
    return _REDUCERS[reduce_op]


class InGraphCommunicator(Communicator):

    backend = "in_graph"

    def _fan_out(self, value, name):
        outs = []
        for rank in range(self.size):
            with self._on(rank):
                outs.append(tf.identity(value, name="%s_rank%d" % (name, rank)))
        return outs

    def _total(self, tensors, reduce_op, at=0):
        """The reduction, made on rank ``at``."""
        with self._on(at):
            return _reducer(reduce_op)(list(tensors))

    def all_reduce(self, tensors, reduce_op="sum"):
        self._check(tensors, "all_reduce")
        _reducer(reduce_op)
        if self.size == 1:
            return list(tensors)
        with tf.name_scope(self.name + "/all_reduce"):
            return self._fan_out(self._total(tensors, reduce_op), "out")

    def all_gather(self, tensors):
        self._check(tensors, "all_gather")
        if self.size == 1:
            return list(tensors)
        with tf.name_scope(self.name + "/all_gather"):
            with self._on(0):
                total = tf.concat(list(tensors), axis=0)
            return self._fan_out(total, "out")

    def reduce_scatter(self, tensors, reduce_op="sum"):
        self._check(tensors, "reduce_scatter")
        with tf.name_scope(self.name + "/reduce_scatter"):
            total = self._total(tensors, reduce_op)
            rows = tf.shape(total)[0]
            outs = []
            for rank in range(self.size):
                with self._on(rank):
                    base, extra = rows // self.size, rows % self.size
                    start = rank * base + tf.minimum(rank, extra)
                    count = base + tf.cast(rank < extra, rows.dtype)
                    outs.append(total[start:start + count])
            return outs

    def broadcast(self, tensors, root=0):
        self._check(tensors, "broadcast")
        with tf.name_scope(self.name + "/broadcast"):
            return self._fan_out(tensors[root], "out")

    def reduce(self, tensors, root=0, reduce_op="sum"):
        self._check(tensors, "reduce")
        with tf.name_scope(self.name + "/reduce"):
            total = self._total(tensors, reduce_op, root)
            outs = []
            for rank in range(self.size):
                with self._on(rank):
                    outs.append(tf.identity(total) if rank == root else tf.zeros_like(tensors[rank]))
            return outs

    def all_to_all(self, tensors, split_sizes=None):
        self._check(tensors, "all_to_all")
        with tf.name_scope(self.name + "/all_to_all"):
            pieces = []
            for rank in range(self.size):
                with self._on(rank):
                    if split_sizes is None:
                        pieces.append(tf.split(tensors[rank], self.size, axis=0))
                    else:
                        pieces.append(tf.split(tensors[rank], split_sizes[rank], axis=0))
            outs = []
            for rank in range(self.size):
                with self._on(rank):
                    outs.append(tf.concat([pieces[j][rank] for j in range(self.size)], axis=0))
            return outs
