"""Collectives over the devices of several workers (between-graph training).

Each worker's graph holds only its own ranks.  A collective runs in three
steps: among this worker's devices (in process), then across workers with one
rank per worker (shared memory between the processes of a host, or a TCP ring
between hosts), then the result is handed back to this worker's devices.
"""
import tensorflow as tf

from epl.communicators import native_ops
from epl.communicators.base import Communicator
from epl.communicators.native import NativeCommunicator
from epl.tf_adapter import graph as tfg


class HierarchicalCommunicator(Communicator):
    """all_reduce(_n), all_gather and broadcast across workers; the other ops are
    errors that name this backend (split layers exchange rows across workers in-graph)."""

    def __init__(self, devices, name, timeout_seconds, worker_index, worker_num, job_id,
                 transport="shm"):
        super(HierarchicalCommunicator, self).__init__(devices, name)
        self.local = NativeCommunicator(devices, name + "/local", timeout_seconds)
        self.worker_index = worker_index
        self.worker_num = worker_num
        self.job_id = job_id
        self.transport = transport
        self.timeout_seconds = timeout_seconds
        self._calls = 0
        self.cross_device = host_device(devices[0])
        self.backend = "hierarchical(%s)" % transport

    def _group(self, what):
        self._calls += 1
        return "%s/%s/%s_%d" % (self.job_id, self.name, what, self._calls)

    def _cross(self):
        return dict(rank=self.worker_index, size=self.worker_num,
                    timeout_seconds=self.timeout_seconds, transport=self.transport)

    def _fan_out(self, values):
        outs = []
        for dev in self.devices:
            with tf.device(dev):
                outs.append([tf.identity(v) for v in values])
        return outs

    def all_reduce_n(self, lists, reduce_op="sum"):
        self._check(lists, "all_reduce_n")
        if reduce_op not in ("sum", "mean"):
            raise ValueError("hierarchical all_reduce supports sum and mean, got %r" % reduce_op)
        if self.size == 1:
            # One device per worker: no local step, and the mean is taken inside the
            # collective (no extra pass over the gradients, no extra buffers).
            return [list(native_ops.all_reduce_n(
                lists[0], self._group("all_reduce_n"), reduce_op=reduce_op,
                device=self.cross_device, **self._cross()))]
        local = self.local.all_reduce_n(lists, "sum")
        with tf.device(self.cross_device):
            total = native_ops.all_reduce_n(local[0], self._group("all_reduce_n"), reduce_op="sum",
                                            **self._cross())
            if reduce_op == "mean":
                n = float(self.size * self.worker_num)
                total = [t / tf.cast(n, t.dtype) for t in total]
        outs = self._fan_out(total)
        # Rank 0's result depends on every local rank's collective; the others read it.
        for rank in range(1, self.size):
            for t in outs[rank]:
                tfg.add_control_inputs(t.op, [local[rank][0].op])
        return outs

    def all_reduce(self, tensors, reduce_op="sum"):
        return [out[0] for out in self.all_reduce_n([[t] for t in tensors], reduce_op)]

    def all_gather(self, tensors):
        local = self.local.all_gather(tensors)
        with tf.device(self.cross_device):
            total = native_ops.all_gather(local[0], self._group("all_gather"), **self._cross())
        outs = [o[0] for o in self._fan_out([total])]
        for rank in range(1, self.size):
            tfg.add_control_inputs(outs[rank].op, [local[rank].op])
        return outs

    def broadcast(self, tensors, root=0):
        """Broadcast from rank ``root`` of worker 0."""
        with tf.device(self.cross_device):
            value = native_ops.broadcast(tensors[root], self._group("broadcast"), root=0,
                                         **self._cross())
        return [o[0] for o in self._fan_out([value])]


def host_device(device):
    """Where a cross-worker step of ``device``'s worker runs: the transports move host
    memory, so on GPUs it is the worker's CPU (TensorFlow copies around it)."""
    return device if "CPU" in device.upper() else \
        device[:device.upper().rfind("/DEVICE:")] + "/device:CPU:0"
