"""ZeRO v1 (seed 001 §6.3, ``zero.level = "v1"``): the optimizer state is partitioned
over the data-parallel replicas instead of kept by every one.

The clones of a worker share one copy of each variable (``cluster.variable_copies
= per_worker`` semantics, forced on): this pass only decides *where* each shared
variable lives.  Every variable and the state beside it (optimizer slots, Adam's
beta powers: the variables colocated with it) is owned by one of the devices that
run the variable's pipeline stage, balanced by bytes (largest first onto the least
loaded device: no device holds more than the mean plus the largest variable).  The
update of a variable runs on its owner, beside its slots (``replicate._device_for``);
the other devices read the new value from there at their next use.  Each gradient is reduced to its owner's device only
(``gradients._owner_ranks``).

Checkpoints do not record devices: one written with ZeRO restores into the plain
program and into any other number of devices.  Over several workers the job runs
in-graph (``plan.in_graph``): the clones of every worker are in the
chief's graph, so the partition spans the job's devices and each variable's state
lives in its owner worker's memory.
"""
import logging

from epl import ir
from epl.rewrite.updates import VARIABLE_OPS

log = logging.getLogger("epl")


def plan_owners(shared, stage_of, placement):
    """{variable op: device} for the worker's shared variables (of the ops ``shared``,
    a selection's ``shared``): each on one device of its stage (``stage_of(op)``) among
    the clones of ``placement`` (a ``rewrite.placement.Placement``) that own their
    replica's variables.  An analysis: reads, edits nothing."""
    variables = [op for op in shared if op.type in VARIABLE_OPS]
    names = dict((op.name, op) for op in variables)
    groups = {}     # primary variable -> the variables kept beside it
    for op in variables:
        primary = op
        for group in op.colocation_groups():
            target = names.get(group.decode()[len("loc:@"):])
            if target is not None:
                primary = target
                break
        groups.setdefault(primary, []).append(op)
    by_stage = {}
    for primary, members in groups.items():
        by_stage.setdefault(stage_of(primary), []).append(
            (sum(ir.variable_bytes(op) for op in members), primary, members))
    owners = {}
    for stage, items in by_stage.items():
        devices = []
        for c, stage_devices in enumerate(placement.stage_devices):
            dev = stage_devices[stage]
            if placement.reps[c] == c and dev not in devices:
                devices.append(dev)
        load = dict((d, 0) for d in devices)
        for size, primary, members in sorted(items, key=lambda x: (-x[0], x[1].name)):
            device = min(devices, key=lambda d: (load[d], devices.index(d)))
            load[device] += size
            for op in members:
                owners[op] = device
        log.info("EPL ZeRO: stage %d's variables over %d devices, bytes %s",
                 stage, len(devices), [load[d] for d in devices])
    return owners
