"""Communicators: collectives over an ordered group of devices.

The rewriter asks :func:`create` for one communicator per device group and
calls its methods with one tensor per device (list index = rank); every rank's
result must be consumed (or waited for), since a collective completes only
when all its ranks run.  Swapping the transport is a change of the class
:func:`create` returns.
"""
from epl.communicators.base import Communicator  # noqa: F401
from epl.communicators.in_graph import InGraphCommunicator


def create(devices, name="epl_comm", timeout_seconds=600):
    """The communicator used for ``devices`` (full device strings of this process)."""
    from epl import native
    if native.available():
        from epl.communicators.native import NativeCommunicator
        return NativeCommunicator(devices, name, timeout_seconds)
    return InGraphCommunicator(devices, name)
