"""The rewriter: turn the annotated graph into the parallel one, once.

Runs from ``Graph.finalize`` (MonitoredTrainingSession, Estimator) or the
first ``Session.run`` of a plain session.  Passes, in order, each with one job:

1. plan          layout of replicas on devices (``epl.core.layout``)
2. select        loops and conditions EPL cannot copy refused (``control_flow_checks.py``);
                 which ops form the replica (``selection.py``), which gradients
                 every variable update consumes (``updates.py``)
3. place         the user's ops on clone 0's device, their v2 loops' bodies with
                 them (``function_bodies.py``); split shards on their devices
                 (``split.py``)
4. shard inputs  every clone gets its own batch (``inputs.py``)
5. clone         copies per clone; gradients reduced before the first apply
                 op (``replicate.py``, ``gradients.py``); v1 loops' contexts per clone
                 (``loop_contexts.py``), v2 loops noted as copied (``function_bodies.py``)
6. bridge        split scopes read every clone's batch; their gradients of a loss
                 the replicas compute are averaged like the replicas' (``split.py``)
   schedule      pipeline order of each stage's micro-batches (``schedule.py``)
7. join          the user's train op runs every clone's update; global_step
                 advances after the step's reads of it (``step.py``); every clone
                 adds to the metric state (``metrics.py``)
8. mirror        initial values come from worker 0; initializers / restores /
                 assigns reach every variable copy
9. merge         merged fetches for epl.GraphKeys

Rewrite layer (5): may import capture, features, tensor parallelism and the layers below;
the runtime calls it.
"""
import logging
import time

from epl import ir
from epl.features import amp
from epl.features import apply_gate
from epl.core import layout as planner
from epl.core.process_state import Env
from epl.rewrite import (control_flow_checks, function_bodies, inputs, loop_contexts, merge,
                         metrics, micro_batch_state, mirror, placement, replicate, schedule,
                         selection, split, step, zero)
from epl.rewrite.pipeline import Pass, PassContext, PassPipeline
from epl.rewrite.state import (CLONE_MAPS, CloneMaps, Rewrite, RewritePlan, lane_of,
                               share_variables)
from epl.tf_adapter import graph as tfg
from epl.ir.variable_writes import VARIABLE_OPS, hand_written_update, written_variable

log = logging.getLogger("epl")


class RewriteResult(object):
    def __init__(self, state=None, seconds=0.0):
        self.state = state
        self.merged = state.merged if state is not None else {}
        self.seconds = seconds


def rewrite_if_needed(graph):
    """Rewrite ``graph`` before it runs: the whole graph the first time, then the ops
    added since (a train op built after the first run, tf.keras's train function).

    A rewrite that failed leaves the graph half-edited: every later call raises the
    same error (never runs the plain graph)."""
    if not Env.initialized():
        return None
    epl_graph = ir.Graph.get(graph)
    life = epl_graph.lifecycle
    if life.error is not None:
        raise life.error
    if life.rewritten and not life.pending:
        return life.result
    amp.guard_updates(epl_graph, Env.get().config)
    apply_gate.guard_step(epl_graph)
    if not epl_graph.taskgraphs:
        _refuse_unannotated_accumulation(epl_graph, Env.get().config)
        step.order_global_step(graph, epl_graph)
        if Env.get().cluster.offload:
            _offload_unplaced(graph, Env.get().cluster)
        life.rewritten, life.pending, life.result = True, False, RewriteResult()
        return life.result
    start = time.time()
    try:
        if life.rewritten:
            state = life.result.state
            _extend(epl_graph, Env.get(), state)
        else:
            state = _rewrite(epl_graph, Env.get())
    except Exception as e:
        life.error = e
        raise
    seconds = time.time() - start
    if not life.rewritten:
        log.info("EPL rewrote the graph for %d clones in %.2fs", state.num_clones, seconds)
    life.rewritten, life.pending, life.result = True, False, RewriteResult(state, seconds)
    return life.result


def _refuse_unannotated_accumulation(epl_graph, config):
    """pipeline.num_micro_batch > 1 on a model with no annotation accumulates across
    session runs what ``apply_gradients`` applies (``epl.features.accumulate``).  A trainable
    variable written some other way (an ``assign_sub`` of a gradient by hand) would
    be updated on every run: refused, not silently trained per micro-batch."""
    m = config.get("pipeline.num_micro_batch")
    if m <= 1:
        return
    accumulated = set()
    for rec in epl_graph.apply_records:
        if rec.across_runs:
            accumulated.update(rec.op_ids)
    op = hand_written_update(epl_graph, accumulated)
    if op is not None:
        raise NotImplementedError(
            "epl.Config: 'pipeline.num_micro_batch' = %d on a model without any EPL "
            "annotation accumulates gradients across session runs for what an optimizer's "
            "apply_gradients / minimize updates, but %r (%s) writes the trainable variable "
            "%r by other means, so it would change on every run. Update it through an "
            "optimizer, annotate the model (e.g. epl.set_default_strategy(epl.replicate(1))) "
            "to accumulate the %d micro-batches inside each run, or remove the key."
            % (m, op.name, op.type, written_variable(op).name, m))


def _offload_unplaced(graph, cluster):
    """``offload.level``: the variables no scope placed (a model without annotation,
    ``global_step``) go to host memory too; what reads or updates them follows
    them (TF's colocation)."""
    for op in graph.get_operations():
        if op.type in VARIABLE_OPS and not op.device:
            tfg.set_device(op, cluster.host_device())


def prepare_state(epl_graph, config, cluster):
    """The ``Rewrite`` of ``epl_graph`` before its first run of the passes: the plan
    (``state.RewritePlan``, fixed from here on) and no product yet.

    The analyses run here, each returning its value: the layout (``plan.plan``), the
    selection of the replica's ops and the update plan (``selection.select``), the
    placement of this worker's clones (``placement.place``), the ZeRO owners
    (``zero.plan_owners``); the state is made from them.  The checks of loops and
    conditions across stages and split scopes (``control_flow_checks.check_stages``) come
    before the selection, the split shards' placement (``split.place``) after it: the
    plan is ready for ``PASSES``.  ``cluster``: this worker's (a test may pass another worker's)."""
    layout = planner.plan(cluster, epl_graph.taskgraphs, config)
    if cluster.offload and layout.split_devices:
        raise NotImplementedError(
            "epl.Config: 'offload.level' = %r with an epl.split scope: offloading the shards "
            "of split variables is not implemented yet. Remove offload.level, or use "
            "epl.replicate scopes only." % config.get("offload.level"))
    if any(rec.across_runs for rec in epl_graph.apply_records):
        raise RuntimeError(
            "EPL: apply_gradients / minimize was called before the first EPL annotation, "
            "so it was built to accumulate gradients across session runs "
            "('pipeline.num_micro_batch' = %d on a model without annotation), but the "
            "model has annotations. Call epl.set_default_strategy / open the epl.replicate "
            "scopes before building the optimizer." % config.get("pipeline.num_micro_batch"))
    # (data-parallel split groups: every split scope is copied per group, like a replica)
    replicated = [tg for tg in epl_graph.taskgraphs
                  if tg.kind != "split" or layout.split_groups]
    control_flow_checks.check_stages(epl_graph, replicated, layout.num_stages)
    sel = selection.select(epl_graph, replicated, share_variables(cluster, config),
                           config.get("communication.clip_after_allreduce"))
    stages = epl_graph.stage_order(replicated) if layout.num_stages > 1 else {}
    where = placement.place(layout, cluster, config)
    owners = None
    if config.get("zero.level"):
        if cluster.offload:
            raise NotImplementedError(
                "epl.Config: 'zero.level' = %r with 'offload.level' = %r: both decide where "
                "the variables live; remove one of the two keys."
                % (config.get("zero.level"), config.get("offload.level")))
        owners = zero.plan_owners(sel.shared, lambda op: lane_of(epl_graph, layout, stages, op),
                                  where)
    plan = RewritePlan(epl_graph, replicated, sel, layout, cluster, config,
                       placement=where, zero_owners=owners, stage_index=stages)
    split.place(plan)
    return Rewrite(plan)


def _rewrite(epl_graph, env):
    state = prepare_state(epl_graph, env.config, env.cluster)
    _passes(state, state.selection, since=-1, first=True)
    if env.cluster.offload:
        _offload_unplaced(state.graph, env.cluster)
    return state


def _passes(state, sel, since, first):
    """The passes that copy ``sel`` (all of the replica, or the ops added after
    ``since``) per clone and connect the copies (``state``: the graph's ``Rewrite``)."""
    PASSES.run(PassContext(state, sel, since, first))
    state.last_id = tfg.last_op_id(state.graph)


def _open_clone_maps(ctx):
    """The clone maps of this rewrite: new ones on the first, else the earlier rewrites'
    (kept), whose replacements the ops made since read too."""
    state = ctx.state
    maps = ctx.make(CLONE_MAPS, lambda: CloneMaps(state.graph, state.num_clones), kept=True)
    maps.reinstall(ctx.since)


def _default_pipeline():
    # Products (``ctx.make`` / ``ctx.product``, see pipeline.py): templates (this run's),
    # clone_maps, sharded_inputs, copied_contexts, schedule, merged (kept across rewrites).
    return PassPipeline([
        Pass("place_originals",
             lambda c: replicate.place_originals(c.state, c.selection, c.make("templates", dict)),
             provides={"originals_placed", "templates"},
             doc="replica 0's ops (the originals) on their devices"),
        Pass("place_original_bodies",
             lambda c: function_bodies.place_original_bodies(
                 c.state, replicate.originals(c.selection)),
             requires={"originals_placed"}, provides={"original_bodies_placed"},
             doc="replica 0's v2 loops and conditions call bodies without devices of their "
                 "own (a body runs on its call op's device)"),
        Pass("reinstall", _open_clone_maps, requires={"originals_placed"},
             provides={"replacements_read", CLONE_MAPS},
             doc="the clone maps; ops made after a rewrite read the tensors it replaced"),
        Pass("shard_inputs",
             lambda c: inputs.shard_inputs(c.state, c.selection,
                                           c.make("sharded_inputs", set, kept=True)),
             requires={"originals_placed"}, extends={CLONE_MAPS},
             provides={"inputs_sharded", "sharded_inputs"},
             doc="each clone pulls or slices its own batch"),
        Pass("clone_replicas",
             lambda c: replicate.clone_replicas(c.state, c.selection, c.product("templates")),
             requires={"inputs_sharded", "replacements_read", "templates"},
             extends={CLONE_MAPS},
             provides={"replicas_cloned", "gradients_reduced"},
             doc="the copies of every clone, gradients reduced across them"),
        Pass("copy_loop_contexts",
             lambda c: loop_contexts.copy_contexts(c.state, c.selection.ops,
                                                   c.make("copied_contexts", set, kept=True)),
             requires={"replicas_cloned", CLONE_MAPS},
             provides={"loop_contexts_copied", "copied_contexts"},
             doc="each clone's copies of v1 loops and conditions get contexts of their own"),
        Pass("note_copied_calls",
             lambda c: function_bodies.note_calls(c.state, c.selection.ops),
             requires={"replicas_cloned"}, provides={"copied_calls_noted"},
             doc="the v2 loops and conditions as the clones copied them (a later rewrite "
                 "refuses one changed since)"),
        Pass("bridge_split", lambda c: split.bridge(c.state), first_only=True,
             requires={"replicas_cloned", CLONE_MAPS}, provides={"split_bridged"},
             doc="rows cross between the replicas and the split scopes"),
        Pass("scale_split_gradients", lambda c: split.scale_split_gradients(c.state),
             first_only=True, requires={"split_bridged", "gradients_reduced", CLONE_MAPS},
             doc="a split scope's gradients are the sum over the replicas' parts"),
        Pass("schedule_pipeline",
             lambda c: schedule.schedule_pipeline(c.state, c.make("schedule", dict, kept=True)),
             first_only=True, requires={"replicas_cloned", CLONE_MAPS},
             provides={"pipeline_scheduled", "schedule"},
             doc="control edges of the GPipe / 1F1B micro-batch order"),
        Pass("join_clones", lambda c: replicate.join_clones(c.state, c.selection, c.since),
             requires={"replicas_cloned", CLONE_MAPS}, provides={"clones_joined"},
             doc="the user's fetches and updates wait for every clone"),
        Pass("join_metric_updates",
             lambda c: metrics.join_metric_updates(c.state, c.selection, c.since),
             requires={"replicas_cloned", CLONE_MAPS},
             doc="every clone adds to the metric state before the user's update reads it"),
        Pass("order_micro_batch_state",
             lambda c: micro_batch_state.order_micro_batch_state(c.state, c.selection),
             requires={"replicas_cloned", CLONE_MAPS},
             doc="a replica's micro-batches update its own state (moving statistics) in turn"),
        Pass("order_global_step",
             lambda c: step.order_global_step(c.state.graph, c.state.ir_graph, c.since),
             requires={"clones_joined"},
             doc="global_step advances after everything that reads it"),
        Pass("broadcast_initial_values",
             lambda c: mirror.broadcast_initial_values(c.state, c.since),
             requires={"replicas_cloned"}, provides={"initial_values_shared"},
             doc="every copy of a variable starts from replica 0's value"),
        Pass("mirror_writes", lambda c: mirror.mirror_writes(c.state, c.since),
             requires={"initial_values_shared", CLONE_MAPS},
             doc="writes of a shared variable reach every copy"),
        Pass("merge_outputs",
             lambda c: merge.merge_outputs(c.state, c.make("merged", dict, kept=True)),
             requires={"replicas_cloned", CLONE_MAPS}, provides={"merged"},
             doc="fetched tensors merged across clones (epl.GraphKeys)"),
    ])


PASSES = _default_pipeline()


def _extend(epl_graph, env, state):
    """Rewrite the ops added since the last rewrite.  Sessions that already ran keep
    the nodes they have seen (TensorFlow ignores later edits of them), so this only
    adds nodes and edits new ones; what would need more is refused by name.  (With
    gradient accumulation the added ops' micro-batches are not scheduled: they run in
    whatever order TensorFlow picks, which changes no number.)"""
    since = state.last_id
    new = [op for op in tfg.ops_between(state.graph, since + 1)
           if epl_graph.phase_of(op) not in (ir.REWRITE, ir.SAVE)]
    model = [op for op in new if epl_graph.taskgraph_of(op) is not None]
    if not model:
        state.last_id = tfg.last_op_id(state.graph)
        return
    unknown = [op for op in model if epl_graph.taskgraph_of(op) not in state.laid_out]
    layout = state.layout
    why = None
    if unknown:
        why = "they belong to a scope the first rewrite did not lay out (%r)" % (
            epl_graph.taskgraph_of(unknown[0]).strategy,)
        model = unknown
    elif layout.num_stages > 1:
        why = "the pipeline schedule of the first rewrite orders the ops already run"
    elif layout.split_devices:
        why = "the split scopes were bridged to the replicas by the first rewrite"
    if why is not None:
        model = [op for op in model if epl_graph.phase_of(op) != ir.FORWARD
                 or written_variable(op) is not None]
        if not model and not unknown:
            # Only reads of the model (an accuracy, a whole view of split variables):
            # they compute on replica 0's tensors, like a fetch.
            state.last_id = tfg.last_op_id(state.graph)
            return
        model = model or unknown
        names = ", ".join("%r (%s)" % (op.name, op.type) for op in model[:4])
        raise RuntimeError(
            "EPL rewrote the graph for %d clones before its first session.run; ops were "
            "added afterwards (%s%s) that it cannot add to this model: %s. Build the whole "
            "model and training step before the first session.run, or call epl.init() "
            "again and rebuild the graph." % (state.num_clones, names,
                                              " ..." if len(model) > 4 else "", why))
    sel = selection.select(epl_graph, state.taskgraphs, state.share_variables,
                           env.config.get("communication.clip_after_allreduce"),
                           known=state.selection, since_id=since)
    state.selection.merge(sel)
    function_bodies.check_calls_unchanged(state)
    _passes(state, sel, since, first=False)


def on_new_op(graph, op):
    """Ops made after a rewrite: mirror late writes of the user's variables (a Saver
    built after the first run, a user's assign) at once; model ops wait for the next
    rewrite (before the next run)."""
    epl_graph = ir.Graph.existing(graph)
    if epl_graph is None or epl_graph.lifecycle.result is None:
        return
    state = epl_graph.lifecycle.result.state
    if state is None:
        return
    if epl_graph.taskgraph_of(op) is not None:
        epl_graph.lifecycle.pending = True
        return
    mirror.mirror_one(state, op)
