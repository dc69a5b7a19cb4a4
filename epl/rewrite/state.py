"""What the data-parallel passes share: the layout and the per-clone maps."""
from epl import communicators
from epl.rewrite.placement import place
from epl.tf_adapter import deferred
from epl.tf_adapter import graph as tfg


class ReplicaState(object):
    """The clones this worker builds: clone ``c`` is ``self.clones[c]`` = (replica,
    shard, global device) of the layout, on this worker's local device
    ``self.devices[c]``; clone 0 is the user's ops.  (Between-graph training:
    every worker builds only its own clones; collectives span the workers.)

    ``tensor_map[c]`` / ``op_map[c]`` send an original tensor/op to its copy in
    clone ``c`` (clone 0 maps everything to itself).
    """

    def __init__(self, ir_graph, taskgraphs, selection, layout, cluster, config,
                 placement=None, zero_owners=None, stage_index=None):
        self.ir_graph = ir_graph
        self.graph = ir_graph.tf_graph
        self.taskgraphs = taskgraphs
        self.laid_out = list(ir_graph.taskgraphs)   # every scope the layout placed
        # {taskgraph index: pipeline stage} (a pipeline's stages are replicate scopes)
        if stage_index is None:
            stage_index = ir_graph.stage_order(taskgraphs) if layout.num_stages > 1 else {}
        self.stage_index = stage_index
        self.selection = selection
        self.layout = layout
        self.cluster = cluster
        self.config = config
        if placement is None:
            placement = place(layout, cluster, config)
        self.placement = placement
        self.in_graph = placement.in_graph
        self.clones = placement.clones
        self.stage_devices = placement.stage_devices
        self.devices = placement.devices
        self.reps = placement.reps
        self.pull_groups = placement.pull_groups
        self.share_variables = share_variables(cluster, config)
        self.tensor_map = [dict() for _ in self.clones]
        self.op_map = [dict() for _ in self.clones]
        self.merged = {}          # fetched tensor name -> merged tensor
        # Ops up to ``frozen_id`` may have run in a session: TensorFlow ignores later
        # edits of them, so a later rewrite only edits ops made after (``editable``).
        self.frozen_id = -1
        self.last_id = -1         # the last op the rewrites have seen
        self.installed = {}       # original tensor -> per-clone replacement (substitute)
        self.sharded_inputs = set()  # sources and placeholders given to the clones
        self.batch_ops = None      # ops computed from an input batch (split.py)
        self.copied_contexts = set()  # loops / conditions the clones have copies of
        self.templates = {}       # op -> its NodeDef template (replicate.place_originals)
        # shared variable op -> its device (zero.level: ``zero.plan_owners``)
        self.zero_owners = dict(zero_owners or {})

    @property
    def num_clones(self):
        return len(self.devices)

    def tensor(self, c, t):
        x = self.tensor_map[c].get(t)
        if x is not None:
            return x
        if t.op not in self.op_map[c]:
            return t
        x = self.op(c, t.op).outputs[t.value_index]
        self.tensor_map[c][t] = x
        return x

    def output(self, c, t):
        """Clone c's copy of ``t``, as a ``deferred.Output`` while its Python op is
        not made (for a pass that only feeds it to ``deferred.create_op``)."""
        x = self.tensor_map[c].get(t)
        if x is not None:
            return x
        x = self.op_map[c].get(t.op)
        if x is None:
            return t
        if isinstance(x, str):
            return deferred.Output(self.graph, x, t.value_index, t.dtype)
        return x.outputs[t.value_index]

    def op(self, c, op):
        """Clone c's copy of ``op`` (``op_map`` may hold a copy's name: its Python
        ``Operation`` is made on first use, see ``deferred.py``)."""
        x = self.op_map[c].get(op)
        if x is None:
            return op
        if isinstance(x, str):
            x = deferred.get(self.graph, x)
            self.op_map[c][op] = x
        return x

    def op_name(self, c, op):
        """The name of clone c's copy of ``op`` (without making its Python op)."""
        x = self.op_map[c].get(op)
        return op.name if x is None else (x if isinstance(x, str) else x.name)

    def mapped(self, t):
        """``t`` has a copy (or replacement) in some clone."""
        return any(t in tm or t.op in om for tm, om in zip(self.tensor_map[1:], self.op_map[1:]))

    def copies(self, t):
        """``t`` in every clone (a list indexed by clone)."""
        return [self.tensor(c, t) for c in range(self.num_clones)]

    def editable(self, op):
        """``op`` was made after the last rewrite (no session has run it yet)."""
        return tfg.op_id(op) > self.frozen_id

    def substitute(self, original, per_clone, rewire):
        """The user's ops accepted by ``rewire(op)`` read ``per_clone[0]`` instead of
        ``original``; clone c (copied later) reads ``per_clone[c]``."""
        if per_clone[0] is not original:
            for consumer in list(original.consumers()):
                if not rewire(consumer) or not self.editable(consumer):
                    continue
                for i, inp in enumerate(consumer.inputs):
                    if inp is original:
                        tfg.update_input(consumer, i, per_clone[0])
            self.installed[original] = (per_clone, rewire)
        for c in range(len(per_clone)):
            self.tensor_map[c][per_clone[0]] = per_clone[c]

    def reinstall(self):
        """Ops made after a rewrite that read a tensor an earlier rewrite replaced (a
        sharded input, a reduced gradient) read the replacement too."""
        for original, (per_clone, rewire) in self.installed.items():
            if per_clone[0] is original:
                continue
            for consumer in list(original.consumers()):
                if not self.editable(consumer) or not rewire(consumer):
                    continue
                for i, inp in enumerate(consumer.inputs):
                    if inp is original:
                        tfg.update_input(consumer, i, per_clone[0])

    def stage_of(self, op):
        tg = self.ir_graph.taskgraph_of(op)
        return self.stage_index[tg.index] if tg is not None and self.layout.num_stages > 1 else 0

    def device_for(self, c, op):
        """Where clone c runs ``op``: the device of the op's stage."""
        return self.stage_devices[c][self.stage_of(op)]

    def host_device(self, c):
        """Host memory of clone c's worker (``offload.level``: the variables live there)."""
        if self.in_graph:
            return self.cluster.host_device(self.clones[c][2] // self.cluster.gpu_num_per_worker)
        return self.cluster.host_device()

    def is_rep(self, c):
        """Clone c owns its replica's variables and update (micro-batch 0)."""
        return self.reps[c] == c

    def communicator(self, name, stage=0):
        """A communicator over this worker's clones (their devices of ``stage``) that also
        spans the other workers."""
        devices = [sd[stage] for sd in self.stage_devices]
        if self.in_graph:   # devices of several processes in one graph: TF moves the data
            return communicators.InGraphCommunicator(devices, name)
        return communicators.create(devices, name,
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
    if config.get("zero.level"):
        return True     # ZeRO places each shared variable with its owner (rewrite/zero.py)
    mode = config.get("cluster.variable_copies")
    if mode == "auto":
        return cluster.device_type == "cpu"
    return mode == "per_worker"
