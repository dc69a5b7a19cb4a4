"""The interface every communicator implements."""


class Communicator(object):
    """Collectives over ``devices`` (ordered: list position = rank).

    Every method takes one tensor per rank and returns one result per rank,
    each placed on that rank's device.
    """

    def __init__(self, devices, name):
        self.devices = list(devices)
        self.name = name

    @property
    def size(self):
        return len(self.devices)

    def _check(self, tensors, what):
        if len(tensors) != self.size:
            raise ValueError("%s.%s: got %d tensors for %d ranks"
                             % (self.name, what, len(tensors), self.size))

    def all_reduce(self, tensors, reduce_op="sum"):
        raise NotImplementedError

    def all_reduce_n(self, lists, reduce_op="sum"):
        """Fused all-reduce: ``lists[rank]`` is that rank's list of tensors (one dtype)."""
        self._check(lists, "all_reduce_n")
        per_tensor = [self.all_reduce([lst[i] for lst in lists], reduce_op)
                      for i in range(len(lists[0]))]
        return [[out[rank] for out in per_tensor] for rank in range(self.size)]

    def all_gather(self, tensors):
        """Concatenate along axis 0 (sizes may differ per rank)."""
        raise NotImplementedError

    def broadcast(self, tensors, root=0):
        raise NotImplementedError
