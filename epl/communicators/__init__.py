"""Communicators: collectives over an ordered group of devices.

The rewriter asks :func:`create` for one communicator per device group and
calls its methods with one tensor per device (list index = rank).  Swapping
the transport is a change of the class :func:`create` returns.
"""
from epl.communicators.base import Communicator  # noqa: F401
from epl.communicators.in_graph import InGraphCommunicator


def create(devices, name="epl_comm"):
    """The communicator used for ``devices`` (full device strings)."""
    return InGraphCommunicator(devices, name)
