"""What the data-parallel passes share: the layout and the per-clone maps."""


class ReplicaState(object):
    """The clones this worker builds: clone ``c`` is ``self.clones[c]`` = (replica,
    shard, global device) of the layout, on this worker's local device
    ``self.devices[c]``; clone 0 is the user's ops.  (Between-graph training:
    every worker builds only its own clones; collectives span the workers.)

    ``tensor_map[c]`` / ``op_map[c]`` send an original tensor/op to its copy in
    clone ``c`` (clone 0 maps everything to itself).
    """

    def __init__(self, ir_graph, taskgraph, selection, layout, cluster, config):
        self.ir_graph = ir_graph
        self.graph = ir_graph.tf_graph
        self.taskgraph = taskgraph
        self.selection = selection
        self.layout = layout
        self.cluster = cluster
        self.config = config
        per = cluster.gpu_num_per_worker
        me = max(cluster.worker_index, 0)
        self.clones = [cl for cl in layout.clones if cl[2] // per == me]
        split = [r for r, _, _ in self.clones
                 if any(dev // per != me for rr, _, dev in layout.clones if rr == r)]
        if split:
            from epl.plan import LayoutError
            raise LayoutError(
                "model replica %d spans several workers (device_count %d > %d devices per "
                "worker); between-graph data parallelism needs each replica within one worker: "
                "use device_count <= %d." % (split[0], layout.device_count, per, per))
        self.devices = [cluster.local_device(dev % per) for _, _, dev in self.clones]
        # Local replicas in order, each with its clones (one per shard).
        self.replicas = []
        for c, (r, _, _) in enumerate(self.clones):
            if not self.replicas or self.replicas[-1][0] != r:
                self.replicas.append((r, []))
            self.replicas[-1][1].append(c)
        self.share_variables = share_variables(cluster, config)
        self.tensor_map = [dict() for _ in self.clones]
        self.op_map = [dict() for _ in self.clones]
        self.merged = {}          # fetched tensor name -> merged tensor

    @property
    def num_clones(self):
        return len(self.devices)

    def tensor(self, c, t):
        return self.tensor_map[c].get(t, t)

    def op(self, c, op):
        return self.op_map[c].get(op, op)

    def copies(self, t):
        """``t`` in every clone (a list indexed by clone)."""
        return [self.tensor(c, t) for c in range(self.num_clones)]

    def communicator(self, name):
        """A communicator over this worker's clones that also spans the other workers."""
        from epl import communicators
        return communicators.create(self.devices, name,
                                    self.config.get("communication.timeout_seconds"),
                                    self.cluster)

    @staticmethod
    def clone_name(c, name):
        return "EPL_REPLICA_%d/%s" % (c, name)


def share_variables(cluster, config):
    """True when a worker's clones share one copy of each variable (``cluster.variable_copies``).

    On CPU every virtual device of a worker lives in one address space, so one
    copy and one update per worker is the fast choice; GPUs mirror.
    """
    mode = config.get("cluster.variable_copies")
    if mode == "auto":
        return cluster.device_type == "cpu"
    return mode == "per_worker"
