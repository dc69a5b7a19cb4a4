"""Plan: lay TaskGraphs and their replicas out on the cluster's devices.

Pure Python over (cluster, TaskGraph summaries); builds and edits no TF graph,
so it is unit-tested with fake clusters.
"""


class LayoutError(ValueError):
    """The annotations cannot be placed on the devices there are."""


class ReplicaLayout(object):
    """Data-parallel layout of one replicate TaskGraph.

    ``num_replicas`` model replicas, each over ``device_count`` devices;
    ``devices[r][j]`` is the global device index of shard ``j`` of replica
    ``r``.  Every shard is one clone of the TaskGraph; ``clones`` lists them
    as (replica, shard, device) with clone 0 the user's original ops.
    """

    def __init__(self, total_devices, device_count, devices_per_worker,
                 prefer_intra_node=True, name="replicate"):
        if device_count > total_devices:
            raise LayoutError(
                "%s needs %d devices per model replica but the cluster has only %d "
                "(%d per worker); lower device_count or add devices "
                "(cluster.devices_per_worker / epl-launch --gpu_per_worker)."
                % (name, device_count, total_devices, devices_per_worker))
        if total_devices % device_count:
            raise LayoutError(
                "%s: %d devices cannot be divided into model replicas of %d devices each "
                "(%d %% %d = %d); use a device_count that divides %d."
                % (name, total_devices, device_count, total_devices, device_count,
                   total_devices % device_count, total_devices))
        self.device_count = device_count
        self.num_replicas = total_devices // device_count
        fits_in_node = device_count <= devices_per_worker
        if prefer_intra_node or not fits_in_node:
            # Replica r owns consecutive devices: one worker when it fits.
            self.devices = [[r * device_count + j for j in range(device_count)]
                            for r in range(self.num_replicas)]
        else:
            # Spread each replica across workers (strided).
            self.devices = [[j * self.num_replicas + r for j in range(device_count)]
                            for r in range(self.num_replicas)]
        self.clones = [(r, j, self.devices[r][j])
                       for r in range(self.num_replicas) for j in range(device_count)]

    @property
    def num_clones(self):
        return len(self.clones)


def plan(cluster, taskgraphs, config):
    """Return the layout for ``taskgraphs`` (summaries with .kind/.device_count/.strategy)."""
    if not taskgraphs:
        return None
    kinds = [tg.kind for tg in taskgraphs]
    if "split" in kinds:
        raise NotImplementedError(
            "epl.split (tensor model parallelism) is not implemented in this EPL version yet; "
            "use epl.replicate for now.")
    if len(taskgraphs) > 1:
        raise NotImplementedError(
            "%d TaskGraphs were annotated (%s): pipeline parallelism over several "
            "replicate scopes is not implemented in this EPL version yet; annotate the whole "
            "model with one epl.replicate scope or epl.set_default_strategy call."
            % (len(taskgraphs), ", ".join(repr(tg.strategy) for tg in taskgraphs)))
    tg = taskgraphs[0]
    num_mb = config.get("pipeline.num_micro_batch")
    if num_mb < 1:
        raise LayoutError("epl.Config: 'pipeline.num_micro_batch' = %d is invalid; it must be "
                          ">= 1 (1 disables gradient accumulation)." % num_mb)
    if num_mb > 1:
        raise NotImplementedError("pipeline.num_micro_batch > 1 (gradient accumulation / "
                                  "pipeline) is not implemented in this EPL version yet.")
    return ReplicaLayout(cluster.total_gpu_num, tg.device_count, cluster.gpu_num_per_worker,
                         config.get("cluster.device_place_prefer_intra_node"),
                         name=repr(tg.strategy))
