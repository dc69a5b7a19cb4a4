"""What the data-parallel passes share: the layout and the per-clone maps."""


class ReplicaState(object):
    """Clone ``c`` of the replica is ``layout.clones[c]``; clone 0 is the user's ops.

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
        self.devices = [cluster.device(dev) for _, _, dev in layout.clones]
        self.share_variables = share_variables(cluster, config)
        self.tensor_map = [dict() for _ in layout.clones]
        self.op_map = [dict() for _ in layout.clones]
        self.merged = {}          # fetched tensor name -> merged tensor
        self.reduced = []         # per clone: reduced gradient tensors (for barriers)

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
