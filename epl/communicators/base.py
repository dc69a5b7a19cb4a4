"""The interface every communicator implements."""
import tensorflow as tf


class Communicator(object):
    """Collectives over ``devices`` (ordered: list position = rank).

    Every method takes one tensor per rank and returns one result per rank, each placed
    on that rank's device (or, with ``placer``, inside ``placer(rank)``: a split layer's
    shard scopes).  A backend that lacks an op raises an error naming both.
    """

    backend = "abstract"

    def __init__(self, devices, name, placer=None):
        self.devices = list(devices)
        self.name = name
        self._placer = placer

    @property
    def size(self):
        return len(self.devices)

    def _on(self, rank):
        """The placement scope of ``rank``'s ops."""
        if self._placer is not None:
            return self._placer(rank)
        return tf.device(self.devices[rank])

    def _check(self, tensors, what):
        if len(tensors) != self.size:
            raise ValueError("%s.%s: got %d tensors for %d ranks"
                             % (self.name, what, len(tensors), self.size))

    def _lacks(self, op):
        raise NotImplementedError(
            "EPL communicator backend '%s' (%s) has no %s; the backends with every op are "
            "'inprocess', 'nccl' and 'in_graph' (one process)." % (self.backend, self.name, op))

    def all_reduce(self, tensors, reduce_op="sum"):
        self._lacks("all_reduce")

    def all_reduce_n(self, lists, reduce_op="sum"):
        """Fused all-reduce: ``lists[rank]`` is that rank's list of tensors (one dtype)."""
        self._check(lists, "all_reduce_n")
        per_tensor = [self.all_reduce([lst[i] for lst in lists], reduce_op)
                      for i in range(len(lists[0]))]
        return [[out[rank] for out in per_tensor] for rank in range(self.size)]

    def all_gather(self, tensors):
        """Concatenate along axis 0 (sizes may differ per rank)."""
        self._lacks("all_gather")

    def reduce_scatter(self, tensors, reduce_op="sum"):
        """Rank r's rows of the reduction (rows split like numpy.array_split)."""
        self._lacks("reduce_scatter")

    def broadcast(self, tensors, root=0):
        self._lacks("broadcast")

    def reduce(self, tensors, root=0, reduce_op="sum"):
        """The reduction on ``root``, zeros on the other ranks."""
        self._lacks("reduce")

    def all_to_all(self, tensors, split_sizes=None):
        """Rank r sends rows ``split_sizes[r][j]`` (equal parts if None) to rank j; rank j
        gets them concatenated in rank order."""
        self._lacks("all_to_all")
