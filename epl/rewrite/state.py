"""What the data-parallel passes see: the plan fixed before they run, and the products
they hand to each other.

* ``RewritePlan``: the analyses' values (layout, placement of this worker's clones,
  selection, ZeRO owners...), made by ``rewrite.prepare_state`` before any pass runs
  and never changed by a pass (setting an attribute raises; a later rewrite, ``_extend``,
  merges the ops added since into ``selection`` between two runs of the passes).
* products: what one pass makes for later ones (``CloneMaps``, the NodeDef templates,
  the merged fetches...), each named in the ``provides`` of the pass that makes it and
  the ``requires`` / ``extends`` of the passes that read or add to it; the driver holds
  them (``epl/rewrite/pipeline.py``).
* ``PassState``: one pass's view: the plan, the clone maps only if the pass declared
  them (reading them otherwise raises ``UndeclaredProduct``).
* ``Rewrite``: a graph's rewrites: the plan, the products kept from one rewrite to the
  next, the last op id the rewrites have seen; read by everything after the rewrite
  (``RewriteResult.state``: the profiler, progress reports, late writes).
"""
from epl import communicators
from epl.rewrite.placement import place
from epl.tf_adapter import deferred
from epl.tf_adapter import graph as tfg

CLONE_MAPS = "clone_maps"


class UndeclaredProduct(RuntimeError):
    """A pass read a product its contract does not name."""


def lane_of(ir_graph, layout, stage_index, op):
    """Which of a clone's devices runs ``op`` (``stage_devices[c][lane]``): the device of
    its pipeline stage (``stage_index``: {taskgraph index: stage}), or, when split scopes
    are copied per clone (``layout.split_groups``), of its shard in its stage; 0 for the
    ops of no scope."""
    tg = ir_graph.taskgraph_of(op)
    if tg is None:
        return 0
    stage = stage_index[tg.index] if layout.num_stages > 1 else 0
    if layout.split_groups:
        return stage * layout.device_count + (ir_graph.shard_of(op) or 0)
    return stage


class RewritePlan(object):
    """The clones this worker builds: clone ``c`` is ``self.clones[c]`` = (replica,
    shard, global device) of the layout, on this worker's local device
    ``self.devices[c]``; clone 0 is the user's ops.  (Between-graph training:
    every worker builds only its own clones; collectives span the workers.)
    Fixed once made: the passes read it, none changes it."""

    def __init__(self, ir_graph, taskgraphs, selection, layout, cluster, config,
                 placement=None, zero_owners=None, stage_index=None):
        d = self.__dict__
        d["ir_graph"] = ir_graph
        d["graph"] = ir_graph.tf_graph
        d["taskgraphs"] = taskgraphs
        d["laid_out"] = tuple(ir_graph.taskgraphs)   # every scope the layout placed
        # {taskgraph index: pipeline stage} (a pipeline's stages are replicate scopes)
        if stage_index is None:
            stage_index = ir_graph.stage_order(taskgraphs) if layout.num_stages > 1 else {}
        d["stage_index"] = stage_index
        d["selection"] = selection
        d["layout"] = layout
        d["cluster"] = cluster
        d["config"] = config
        if placement is None:
            placement = place(layout, cluster, config)
        d["placement"] = placement
        d["in_graph"] = placement.in_graph
        d["clones"] = placement.clones
        d["stage_devices"] = placement.stage_devices
        d["devices"] = placement.devices
        d["reps"] = placement.reps
        d["pull_groups"] = placement.pull_groups
        d["share_variables"] = share_variables(cluster, config)
        # shared variable op -> its device (zero.level: ``zero.plan_owners``)
        d["zero_owners"] = dict(zero_owners or {})

    def __setattr__(self, name, value):
        raise AttributeError(
            "EPL: the rewrite plan is fixed before the passes run (setting %r); a pass hands "
            "what it makes to later passes as a declared product (epl/rewrite/pipeline.py)"
            % name)

    @property
    def num_clones(self):
        return len(self.devices)

    def stage_of(self, op):
        """The pipeline stage of ``op`` (0 without a pipeline, or outside the scopes)."""
        tg = self.ir_graph.taskgraph_of(op)
        return self.stage_index[tg.index] if tg is not None and self.layout.num_stages > 1 else 0

    def lane_of(self, op):
        """The lane of a clone that runs ``op`` (``stage_devices[c][lane]``, see
        :func:`lane_of`)."""
        return lane_of(self.ir_graph, self.layout, self.stage_index, op)

    def stage_lane(self, stage):
        """The first lane of a pipeline stage (its first shard's, in split groups)."""
        return stage * self.layout.device_count if self.layout.split_groups else stage

    def device_for(self, c, op):
        """Where clone c runs ``op``: the device of the op's lane."""
        return self.stage_devices[c][self.lane_of(op)]

    def host_device(self, c):
        """Host memory of clone c's worker (``offload.level``: the variables live there)."""
        if self.in_graph:
            return self.cluster.host_device(self.clones[c][2] // self.cluster.gpu_num_per_worker)
        return self.cluster.host_device()

    def is_rep(self, c):
        """Clone c owns its replica's variables and update (micro-batch 0)."""
        return self.reps[c] == c

    def communicator(self, name, lane=0):
        """A communicator over this worker's clones (their devices of ``lane``) that also
        spans the other workers."""
        devices = [sd[lane] for sd in self.stage_devices]
        if self.in_graph:   # devices of several processes in one graph: TF moves the data
            return communicators.InGraphCommunicator(devices, name)
        return communicators.create(devices, name,
                                    self.config.get("communication.timeout_seconds"),
                                    self.cluster)

    @staticmethod
    def clone_name(c, name):
        return "EPL_REPLICA_%d/%s" % (c, name)


class CloneMaps(object):
    """The product of the passes that copy the replica (made by ``reinstall`` on the
    first rewrite, extended by ``shard_inputs`` and ``clone_replicas``, kept across
    rewrites): ``tensor_map[c]`` / ``op_map[c]`` send an original tensor/op to its copy in
    clone ``c`` (clone 0 maps everything to itself); ``installed``: the tensors a pass
    replaced (a sharded input, a reduced gradient) -> (the per-clone replacement, which
    readers take it), for ops made after a rewrite (``reinstall``)."""

    def __init__(self, graph, num_clones):
        self.graph = graph
        self.tensor_map = [dict() for _ in range(num_clones)]
        self.op_map = [dict() for _ in range(num_clones)]
        self.installed = {}

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
        return [self.tensor(c, t) for c in range(len(self.op_map))]

    def substitute(self, original, per_clone, rewire, since):
        """The user's ops accepted by ``rewire(op)`` (made after op id ``since``: no
        session ran them) read ``per_clone[0]`` instead of ``original``; clone c (copied
        later) reads ``per_clone[c]``."""
        if per_clone[0] is not original:
            for consumer in list(original.consumers()):
                if not rewire(consumer) or not tfg.op_id(consumer) > since:
                    continue
                for i, inp in enumerate(consumer.inputs):
                    if inp is original:
                        tfg.update_input(consumer, i, per_clone[0])
            self.installed[original] = (per_clone, rewire)
        for c in range(len(per_clone)):
            self.tensor_map[c][per_clone[0]] = per_clone[c]

    def reinstall(self, since):
        """Ops made after op id ``since`` that read a tensor an earlier rewrite replaced (a
        sharded input, a reduced gradient) read the replacement too."""
        for original, (per_clone, rewire) in self.installed.items():
            if per_clone[0] is original:
                continue
            for consumer in list(original.consumers()):
                if not tfg.op_id(consumer) > since or not rewire(consumer):
                    continue
                for i, inp in enumerate(consumer.inputs):
                    if inp is original:
                        tfg.update_input(consumer, i, per_clone[0])


# What a pass reaches of the clone maps through its ``PassState`` (declared or refused).
_MAP_NAMES = frozenset(["tensor", "output", "op", "op_name", "mapped", "copies", "tensor_map",
                        "op_map"])


class PassState(RewritePlan):
    """One pass's view of the rewrite: the plan's facts and methods, ``since`` (ops made
    after it are this rewrite's: ``editable``), and the clone maps' look-ups only when the
    pass names ``clone_maps`` in its contract (else reading one raises
    ``UndeclaredProduct``, naming the pass)."""

    def __init__(self, plan, since, maps=None, pass_name=None, writes_maps=False):
        d = self.__dict__
        d.update(plan.__dict__)
        d["plan"] = plan
        d["since"] = since
        d["pass_name"] = pass_name
        d["_maps"] = maps
        d["_writes_maps"] = writes_maps
        if maps is not None:
            for name in _MAP_NAMES:
                d[name] = getattr(maps, name)

    def __getattr__(self, name):
        if name in _MAP_NAMES:
            raise UndeclaredProduct(
                "EPL rewrite: pass %r reads the clone maps (%s) without naming %r in its "
                "requires / extends / provides" % (self.pass_name, name, CLONE_MAPS))
        raise AttributeError(name)

    def editable(self, op):
        """``op`` was made after the last rewrite (no session has run it yet: TensorFlow
        ignores later edits of the ops a session has seen)."""
        return tfg.op_id(op) > self.since

    def substitute(self, original, per_clone, rewire):
        """``CloneMaps.substitute`` for this rewrite (a pass that extends the maps)."""
        if not self._writes_maps:
            raise UndeclaredProduct(
                "EPL rewrite: pass %r changes the clone maps without naming %r in its "
                "extends / provides" % (self.pass_name, CLONE_MAPS))
        self._maps.substitute(original, per_clone, rewire, self.since)


class Rewrite(RewritePlan):
    """A graph's rewrites: the plan, the products kept from one rewrite to the next
    (``products``: name -> value, held for the driver), and ``last_id``, the last op the
    rewrites have seen.  Reads everything (for what runs after a rewrite: the profiler,
    progress reports, mirroring late writes, tests)."""

    def __init__(self, plan):
        d = self.__dict__
        d.update(plan.__dict__)
        d["plan"] = plan
        d["products"] = {}
        d["last_id"] = -1

    def __setattr__(self, name, value):
        if name != "last_id":
            RewritePlan.__setattr__(self, name, value)
        self.__dict__[name] = value

    def __getattr__(self, name):
        if name in _MAP_NAMES:
            maps = self.__dict__["products"].get(CLONE_MAPS)
            if maps is None:
                raise AttributeError("EPL rewrite: no clone maps yet (%s)" % name)
            return getattr(maps, name)
        raise AttributeError(name)

    @property
    def merged(self):
        """Fetched tensor name -> its merged tensor (``merge_outputs``)."""
        return self.products.get("merged", {})

    @property
    def schedule(self):
        """(replica, stage) -> its micro-batches' order (``schedule_pipeline``)."""
        return self.products.get("schedule", {})


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
