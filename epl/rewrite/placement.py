"""Where this worker's clones run: the layout (``epl.core.layout``) read for one worker.

An analysis: :func:`place` reads the layout, the cluster and the config and returns a
:class:`Placement` (no graph is read or edited); the passes read it through
``state.RewritePlan``.  The one place a clone's devices are decided, and where the layouts
this worker cannot run are refused.
"""
import logging

from epl.core.layout import LayoutError, how_to_get_devices, in_graph, spans_workers

log = logging.getLogger("epl")


class Placement(object):
    """The clones this worker builds and their devices.

    ``clones[c]`` = (replica, shard, global device) of the layout; clone 0 is the
    user's ops.  ``stage_devices[c][s]``: the device (a TF device name) running stage
    ``s`` of clone ``c``; ``reps[c]``: the clone owning clone c's variables and update
    (its micro-batch 0); ``pull_groups``: clones that pull one batch together.
    ``in_graph``: the chief drives every clone of the job (a pipeline or split over
    several workers, ZeRO across workers)."""

    def __init__(self, in_graph, clones, stage_devices, reps, pull_groups):
        self.in_graph = in_graph
        self.clones = clones
        self.stage_devices = stage_devices
        self.devices = [sd[0] for sd in stage_devices]
        self.reps = reps
        self.pull_groups = pull_groups


def place(layout, cluster, config):
    """The :class:`Placement` of this worker's clones for ``layout``; refuses, naming the
    keys, what this worker cannot run (io.slicing in-graph, a replica split across
    workers between graphs)."""
    per = cluster.gpu_num_per_worker
    me = max(cluster.worker_index, 0)
    driven = in_graph(layout, cluster, config)
    if driven and config.get("io.slicing"):
        raise ValueError(
            "epl.Config: 'io.slicing' = True, but this job runs in-graph (%s): only the "
            "chief reads input, so slicing the files across workers would drop the other "
            "workers' shares. Set io.slicing to False."
            % ("'zero.level' = %r over %d workers" % (config.get("zero.level"),
                                                     cluster.worker_num)
               if config.get("zero.level") else "a model replica spans workers"))
    if driven and config.get("zero.level") and not spans_workers(layout, per):
        log.warning(
            "EPL: 'zero.level' = %r over %d workers: the chief drives the whole job "
            "in-graph on TF's runtime (each variable and its optimizer state live once, "
            "on one device of one worker); only the chief's input pipeline is read, one "
            "batch per replica of the job.", config.get("zero.level"), cluster.worker_num)
    clones = [cl for cl in layout.clones if driven or cl[2] // per == me]
    split = [r for r, _, _ in clones
             if any(dev // per != me for rr, _, dev in layout.clones if rr == r)]
    if split and not driven:
        raise LayoutError(
            "model replica %d spans several workers (device_count %d > %d devices per "
            "worker); between-graph data parallelism needs each replica within one worker: "
            "use device_count <= %d, or more devices per worker. %s"
            % (split[0], layout.device_count, per, per, how_to_get_devices()))
    local_index = [layout.clones.index(cl) for cl in clones]

    def where(d):
        return cluster.device(d) if driven else cluster.local_device(d % per)
    stage_devices = [[where(layout.stage_device(g, s)) for s in range(layout.lanes)]
                     for g in local_index]
    reps = [local_index.index(layout.representative(g)) for g in local_index]
    pull_groups = [[local_index.index(g) for g in grp]
                   for grp in layout.pull_groups(local_index)]
    return Placement(driven, clones, stage_devices, reps, pull_groups)
