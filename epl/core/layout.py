"""Plan: lay TaskGraphs and their replicas out on the cluster's devices.

Pure Python over (cluster, TaskGraph summaries); builds and edits no TF graph,
so it is unit-tested with fake clusters.
"""


class LayoutError(ValueError):
    """The annotations cannot be placed on the devices there are."""


def how_to_get_devices():
    """The ways to change the device count, appended to every device-count error: users
    without GPUs do not know that EPL gives them virtual CPU devices (issue 33)."""
    return ("To get N devices without GPUs: cluster.devices_per_worker = N "
            "(epl.Config), the environment variable EPL_CLUSTER_DEVICES_PER_WORKER=N, or "
            "`epl-launch --gpu_per_worker N`; or more workers (`epl-launch --num_workers`).")


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
                "(%d per worker); lower device_count or add devices. %s"
                % (name, device_count, total_devices, devices_per_worker,
                   how_to_get_devices()))
        if total_devices % device_count:
            raise LayoutError(
                "%s: %d devices cannot be divided into model replicas of %d devices each "
                "(%d %% %d = %d); use a device_count that divides %d, or a device count "
                "divisible by %d. %s"
                % (name, total_devices, device_count, total_devices, device_count,
                   total_devices % device_count, total_devices, device_count,
                   how_to_get_devices()))
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
        self.num_stages = 1
        self.num_micro_batch = 1
        self.split_devices = {}   # split TaskGraph -> global devices of its shards
        self.split_groups = False

    @property
    def num_clones(self):
        return len(self.clones)

    @property
    def lanes(self):
        """Devices one clone runs on (one: a shard of a replica is a clone itself)."""
        return 1

    def stage_device(self, c, stage):
        return self.clones[c][2]

    def representative(self, c):
        """The clone whose variables and updates clone ``c`` uses (itself: every shard
        holds its own copy)."""
        return c

    def pull_groups(self, clone_indices):
        """Clones that share one pull of the input pipeline (the shards of a replica)."""
        groups = []
        for c in clone_indices:
            if groups and self.clones[groups[-1][0]][0] == self.clones[c][0]:
                groups[-1].append(c)
            else:
                groups.append([c])
        return groups


class PipelineLayout(object):
    """``num_stages`` consecutive replicate TaskGraphs (stages), ``num_micro_batch``
    micro-batches, and as many pipeline replicas as the devices allow.

    A clone is one micro-batch of one pipeline replica: ``clones[c]`` =
    (replica, micro-batch, first device).  Stage s of replica r runs on
    ``devices[r][s]``; all micro-batches of a replica share its variables and
    its single update (gradient accumulation).  With one stage this is plain
    gradient accumulation on every device.
    """

    def __init__(self, total_devices, num_stages, num_micro_batch, devices_per_worker,
                 prefer_intra_node=True):
        if num_micro_batch < 1:
            raise LayoutError("epl.Config: 'pipeline.num_micro_batch' = %d is invalid; it must "
                              "be >= 1 (1 disables gradient accumulation)." % num_micro_batch)
        if num_stages > total_devices:
            raise LayoutError("%d pipeline stages need at least %d devices but the cluster has "
                              "%d; merge stages or add devices. %s"
                              % (num_stages, num_stages, total_devices, how_to_get_devices()))
        if total_devices % num_stages:
            raise LayoutError("%d devices cannot hold whole pipelines of %d stages (%d %% %d = "
                              "%d); use a device count divisible by the number of stages. %s"
                              % (total_devices, num_stages, total_devices, num_stages,
                                 total_devices % num_stages, how_to_get_devices()))
        self.num_stages = num_stages
        self.num_micro_batch = num_micro_batch
        self.device_count = num_stages
        self.num_replicas = total_devices // num_stages
        if prefer_intra_node or num_stages > devices_per_worker:
            self.devices = [[r * num_stages + s for s in range(num_stages)]
                            for r in range(self.num_replicas)]
        else:
            self.devices = [[s * self.num_replicas + r for s in range(num_stages)]
                            for r in range(self.num_replicas)]
        self.clones = [(r, m, self.devices[r][0])
                       for r in range(self.num_replicas) for m in range(num_micro_batch)]
        self.split_devices = {}
        self.split_groups = False

    @property
    def num_clones(self):
        return len(self.clones)

    @property
    def lanes(self):
        """Devices one clone runs on: one per stage."""
        return self.num_stages

    def stage_device(self, c, stage):
        return self.devices[self.clones[c][0]][stage]

    def representative(self, c):
        return c - self.clones[c][1]

    def pull_groups(self, clone_indices):
        return [[c] for c in clone_indices]


class SplitGroupLayout(PipelineLayout):
    """Split scopes copied per clone: a model whose every TaskGraph is an
    ``epl.split(t)`` scope, on more devices than ``t``, or with micro-batches.

    * Data parallelism of whole split groups: on ``d * t`` devices the model runs as
      ``d`` copies (groups), each its share of the batch, each split over its own ``t``
      consecutive devices (Megatron-LM's t-way tensor parallelism inside a d-way
      data-parallel job).
    * With ``pipeline.num_micro_batch`` > 1 every split scope is a pipeline stage of
      ``t`` devices (``num_stages`` scopes: ``num_stages * t`` devices per group), and a
      clone is one micro-batch of one group, as in ``PipelineLayout``.

    ``devices[r][s * t + j]``: the global device of shard ``j`` of stage ``s`` of group
    ``r``: a clone's lane ``s * t + j`` (``stage_device``).  The gradients of shard
    ``j``'s variables are reduced among the groups' devices of that lane.  Clones,
    their representatives (micro-batch 0 owns the group's variables and update) and
    input pulls are a ``PipelineLayout``'s.
    """

    def __init__(self, total_devices, split_count, splits, num_stages=1, num_micro_batch=1,
                 name="split"):
        # (its own checks and rows: a stage is t devices here; PipelineLayout's methods
        # read only the attributes set below)
        per_group = num_stages * split_count
        what = ("%d pipeline stages of %s" % (num_stages, name) if num_stages > 1 else name)
        if per_group > total_devices or total_devices % per_group:
            raise LayoutError(
                "%s: %d devices cannot be divided into split groups of %d devices each "
                "(%d %% %d = %d); use a device count divisible by %d%s. %s"
                % (what, total_devices, per_group, total_devices, per_group,
                   total_devices % per_group, per_group,
                   ", or fewer split scopes (each is a stage with pipeline.num_micro_batch "
                   "> 1)" if num_stages > 1 else ", or epl.split(%d)" % total_devices,
                   how_to_get_devices()))
        self.device_count = split_count
        self.num_stages = num_stages
        self.num_micro_batch = num_micro_batch
        self.num_replicas = total_devices // per_group
        self.devices = [[r * per_group + k for k in range(per_group)]
                        for r in range(self.num_replicas)]
        self.clones = [(r, m, self.devices[r][0])
                       for r in range(self.num_replicas) for m in range(num_micro_batch)]
        self.split_groups = True
        # (the user's ops are group 0's; the devices of a scope are those of its stage,
        # known once the graph's stage order is: see ``epl.rewrite.split.place``)
        self.split_devices = {tg: list(self.devices[0]) for tg in splits}

    @property
    def lanes(self):
        """Devices one clone (a group, or a micro-batch of it) runs on: its shards'."""
        return self.num_stages * self.device_count


def plan(cluster, taskgraphs, config):
    """Return the layout for ``taskgraphs`` (summaries with .kind/.device_count/.strategy).

    The layout describes the replicated TaskGraphs; ``layout.split_devices`` maps
    each split TaskGraph to the global devices of its shards.
    """
    if not taskgraphs:
        return None
    num_mb = config.get("pipeline.num_micro_batch")
    prefer = config.get("cluster.device_place_prefer_intra_node")
    splits = [tg for tg in taskgraphs if tg.kind == "split"]
    replicas = [tg for tg in taskgraphs if tg.kind != "split"]
    if splits:
        return _plan_split(cluster, splits, replicas, config)
    if len(taskgraphs) == 1 and num_mb == 1:
        tg = taskgraphs[0]
        return ReplicaLayout(cluster.total_gpu_num, tg.device_count, cluster.gpu_num_per_worker,
                             prefer, name=repr(tg.strategy))
    wide = [tg for tg in taskgraphs if tg.device_count != 1]
    if wide:
        raise NotImplementedError(
            "%r: a pipeline stage (or gradient accumulation) over a replicate scope with "
            "device_count > 1 is not implemented yet; use device_count=1 per stage."
            % (wide[0].strategy,))
    return PipelineLayout(cluster.total_gpu_num, len(taskgraphs), num_mb,
                          cluster.gpu_num_per_worker, prefer)


def split_device_count(tg, total_devices):
    """Devices of a split TaskGraph (``split()`` without a count: every device)."""
    count = getattr(tg.strategy, "device_count", tg.device_count)
    return count or total_devices


def _plan_split(cluster, splits, replicas, config):
    """Split TaskGraphs (tensor model parallelism) and the replicated ones around them.

    With ``cluster.colocate_split_and_replicate`` the split uses the first devices
    that the replicas also use; without it the replicas get the first devices and
    the split the last ``n``.  In a job of several workers the whole model runs
    in-graph on the chief (``epl.runtime.distributed``), so a split may span workers.
    """
    per = cluster.gpu_num_per_worker
    total = cluster.total_gpu_num
    for tg in splits:
        n = split_device_count(tg, total)
        if n > total:
            raise LayoutError(
                "%r needs %d devices but the job has %d (%d worker(s) x %d); use "
                "device_count <= %d or add devices. %s"
                % (tg.strategy, n, total, cluster.worker_num, per, total,
                   how_to_get_devices()))
    num_mb = config.get("pipeline.num_micro_batch")
    if num_mb > 1 and replicas:
        raise NotImplementedError(
            "%r next to %r with pipeline.num_micro_batch = %d: pipelines of split and "
            "replicate scopes together are not implemented yet; put every stage under "
            "epl.split (each split scope is a stage), or set pipeline.num_micro_batch to 1."
            % (splits[0].strategy, replicas[0].strategy, num_mb))
    counts = sorted(set(tg.device_count for tg in replicas))
    if len(counts) > 1:
        raise NotImplementedError(
            "replicate scopes with different device_count (%s) together with %r: the "
            "replicated parts around a split form one model replica; give them the same "
            "device_count." % (", ".join(repr(tg.strategy) for tg in replicas),
                               splits[0].strategy))
    n = max(split_device_count(tg, total) for tg in splits)
    if not replicas and (n < total or num_mb > 1) and all(
            split_device_count(tg, total) == n for tg in splits):
        return SplitGroupLayout(total, n, splits, len(splits) if num_mb > 1 else 1, num_mb,
                                name=repr(splits[0].strategy))
    if not replicas:
        if n != total:
            raise LayoutError(
                "%r uses %d devices but this job has %d: the other devices would sit idle. "
                "Use epl.split(%d), run with %d devices, or add an epl.replicate scope for "
                "the rest of the model. %s"
                % (splits[0].strategy, n, total, total, n, how_to_get_devices()))
        layout = ReplicaLayout(1, 1, 1, name="split")
        first = 0
    else:
        rep = replicas[0]
        colocate = config.get("cluster.colocate_split_and_replicate")
        rep_devices = total if colocate else total - n
        if rep_devices < 1:
            raise LayoutError(
                "%r takes all %d devices, none is left for %r; set "
                "cluster.colocate_split_and_replicate to True (share the devices) or add "
                "devices. %s" % (splits[0].strategy, total, rep.strategy,
                                 how_to_get_devices()))
        layout = ReplicaLayout(rep_devices, rep.device_count, per,
                               config.get("cluster.device_place_prefer_intra_node"),
                               name=repr(rep.strategy))
        first = 0 if colocate else total - n
    layout.split_devices = {tg: list(range(first, first + split_device_count(tg, total)))
                            for tg in splits}
    return layout


def in_graph(layout, cluster, config):
    """The chief drives the whole job in one graph: a model replica (or split) spans
    workers, or ZeRO partitions the state over several workers."""
    if cluster.worker_num <= 1 or layout is None:
        return False
    return bool(spans_workers(layout, cluster.gpu_num_per_worker)
                or config.get("zero.level"))


def spans_workers(layout, devices_per_worker):
    """A model replica over several workers, or split scopes in a multi-worker job (a
    split's shards and the replicas it bridges form one graph)."""
    if layout is None:
        return False
    if layout.split_devices and not layout.split_groups:
        return True
    return any(len(set(d // devices_per_worker for d in row)) > 1 for row in layout.devices)
