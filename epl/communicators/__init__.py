"""Communicators: collectives over an ordered group of devices.

The rewriter asks :func:`create` for one communicator per device group and
calls its methods with one tensor per device (list index = rank); every rank's
result must be consumed (or waited for), since a collective completes only
when all its ranks run.  Swapping the transport is a change of the class
:func:`create` returns.

Communicators layer (3): the C++ op library (``op_library``, ``native_ops``) and the
communicator classes over it; may import ``ir``, ``core`` and the adapter.
"""
from epl.communicators.base import Communicator  # noqa: F401
# (named apart: importing the submodule epl.communicators.native binds `native` here)
from epl.communicators import op_library as native_library
from epl.communicators.hierarchical import HierarchicalCommunicator
from epl.communicators.in_graph import InGraphCommunicator
from epl.communicators.native import NativeCommunicator


def create(devices, name="epl_comm", timeout_seconds=600, cluster=None, placer=None):
    """The communicator for ``devices`` of this process (and, in a multi-worker
    job, the same devices of every other worker).  The backend follows from what the
    devices are: other processes -> hierarchical over shm (one host) or tcp; GPUs of
    this process -> nccl; CPU devices of this process -> inprocess; without EPL's C++
    library -> in_graph (TF ops).  ``placer(rank)``, if given, scopes rank's ops
    instead of its device (a split layer's shards)."""
    if cluster is not None and cluster.worker_num > 1:
        if not native_library.available():
            raise RuntimeError("multi-worker training needs EPL's C++ op library (%s); run "
                               "`make setup` or `python -m epl.communicators.op_library --build`."
                               % native_library.missing_reason())
        return HierarchicalCommunicator(devices, name, timeout_seconds, cluster.worker_index,
                                        cluster.worker_num, cluster.job_id,
                                        cluster.cross_worker_transport())
    if native_library.available():
        return NativeCommunicator(devices, name, timeout_seconds, placer=placer)
    _warn_fallback(native_library.missing_reason())
    return InGraphCommunicator(devices, name, placer)


_warned = []


def _warn_fallback(reason):
    """Says once per process which backend runs instead, and why."""
    if _warned:
        return
    _warned.append(reason)
    import tensorflow as tf
    tf.compat.v1.logging.warning(
        "EPL: collectives run as TensorFlow ops (in-graph communicator), not EPL's C++ "
        "library: %s. Run `python -m epl.communicators.op_library --build` (needs g++) for the fast backends.",
        reason)
