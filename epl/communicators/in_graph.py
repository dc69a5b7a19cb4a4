"""Collectives between devices of one process, as ordinary TF ops.

Reduce on the root, then every rank reads the result: on virtual CPU devices
(one address space) TF hands the buffer over without a copy.  It cannot hang:
there is no rendezvous, only data edges.
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


class InGraphCommunicator(Communicator):

    def _fan_out(self, value, name):
        outs = []
        for rank, dev in enumerate(self.devices):
            with tf.device(dev):
                outs.append(tf.identity(value, name="%s_rank%d" % (name, rank)))
        return outs

    def all_reduce(self, tensors, reduce_op="sum"):
        self._check(tensors, "all_reduce")
        if reduce_op not in _REDUCERS:
            raise ValueError("all_reduce: reduce_op %r not in %s" % (reduce_op, sorted(_REDUCERS)))
        if self.size == 1:
            return list(tensors)
        with tf.name_scope(self.name + "/all_reduce"):
            with tf.device(self.devices[0]):
                total = _REDUCERS[reduce_op](list(tensors))
            return self._fan_out(total, "out")

    def all_gather(self, tensors):
        self._check(tensors, "all_gather")
        if self.size == 1:
            return list(tensors)
        with tf.name_scope(self.name + "/all_gather"):
            with tf.device(self.devices[0]):
                total = tf.concat(list(tensors), axis=0)
            return self._fan_out(total, "out")

    def broadcast(self, tensors, root=0):
        self._check(tensors, "broadcast")
        with tf.name_scope(self.name + "/broadcast"):
            return self._fan_out(tensors[root], "out")
