"""Communicator over EPL's C++ collectives (csrc/): one op per rank, each on its device."""
import tensorflow as tf

from epl.communicators import native_ops
from epl.communicators.base import Communicator


class NativeCommunicator(Communicator):
    """Ranks are devices of this process (``transport="inprocess"``).

    Every call makes a new collective group named ``<name>/<op>_<k>``: the
    graph is built in the same order on every worker, so names agree, and
    the kernels check that every rank runs the same collective.
    """

    def __init__(self, devices, name, timeout_seconds=600, transport="inprocess", placer=None):
        super(NativeCommunicator, self).__init__(devices, name, placer)
        self.timeout_seconds = timeout_seconds
        self.transport = transport
        self._calls = 0

    @property
    def backend(self):
        """nccl on GPUs (the kernels registered for GPU), else the CPU transport."""
        if any(d and "GPU" in d.upper() for d in self.devices):
            return "nccl"
        return self.transport

    def _group(self, what):
        self._calls += 1
        return "%s/%s_%d" % (self.name, what, self._calls)

    def _per_rank(self, tensors, what, fn):
        self._check(tensors, what)
        group = self._group(what)
        outs = []
        for rank, t in enumerate(tensors):
            with self._on(rank):
                outs.append(fn(t, group, rank))
        return outs

    def _kw(self):
        return dict(timeout_seconds=self.timeout_seconds, transport=self.transport)

    def all_reduce(self, tensors, reduce_op="sum"):
        return self._per_rank(tensors, "all_reduce", lambda t, g, r: native_ops.all_reduce(
            t, g, r, self.size, reduce_op, **self._kw()))

    def all_reduce_n(self, lists, reduce_op="sum"):
        return self._per_rank(lists, "all_reduce_n", lambda ts, g, r: native_ops.all_reduce_n(
            ts, g, r, self.size, reduce_op, device=self.devices[r], **self._kw()))

    def all_gather(self, tensors):
        return self._per_rank(tensors, "all_gather", lambda t, g, r: native_ops.all_gather(
            t, g, r, self.size, device=self.devices[r], **self._kw()))

    def reduce_scatter(self, tensors, reduce_op="sum"):
        return self._per_rank(tensors, "reduce_scatter", lambda t, g, r: native_ops.reduce_scatter(
            t, g, r, self.size, reduce_op, **self._kw()))

    def broadcast(self, tensors, root=0):
        return self._per_rank(tensors, "broadcast", lambda t, g, r: native_ops.broadcast(
            t, g, r, self.size, root, **self._kw()))

    def reduce(self, tensors, root=0, reduce_op="sum"):
        return self._per_rank(tensors, "reduce", lambda t, g, r: native_ops.reduce(
            t, g, r, self.size, root, reduce_op, **self._kw()))

    def all_to_all(self, tensors, split_sizes=None):
        return self._per_rank(tensors, "all_to_all", lambda t, g, r: native_ops.all_to_all(
            t, g, r, self.size, None if split_sizes is None else split_sizes[r],
            **self._kw())[0])
