"""The rewriter: turn the annotated graph into the parallel one, once.

Runs from ``Graph.finalize`` (MonitoredTrainingSession, Estimator) or the
first ``Session.run`` of a plain session.  Passes, in order, each with one job:

1. plan          layout of replicas on devices (``epl.plan``)
2. select        which ops form the replica (``selection.py``), which gradients
                 every variable update consumes (``updates.py``)
3. place         the user's ops on clone 0's device; split shards on their
                 devices (``split.py``)
4. shard inputs  every clone gets its own batch (``inputs.py``)
5. clone         copies per clone; gradients reduced before the first apply
                 op (``replicate.py``, ``gradients.py``)
6. bridge        split scopes read every clone's batch; their gradients of a loss
                 the replicas compute are averaged like the replicas' (``split.py``)
   schedule      pipeline order of each stage's micro-batches (``schedule.py``)
7. join          the user's train op runs every clone's update
8. mirror        initial values come from worker 0; initializers / restores /
                 assigns reach every variable copy
9. merge         merged fetches for epl.GraphKeys
"""
import logging
import time

from epl import ir

log = logging.getLogger("epl")


class RewriteResult(object):
    def __init__(self, state=None, seconds=0.0):
        self.state = state
        self.merged = state.merged if state is not None else {}
        self.seconds = seconds


def rewrite_if_needed(graph):
    from epl.env import Env
    if not Env.initialized():
        return None
    epl_graph = ir.Graph.get(graph)
    if epl_graph.rewritten:
        return epl_graph.rewrite_result
    epl_graph.rewritten = True
    if not epl_graph.taskgraphs:
        epl_graph.rewrite_result = RewriteResult()
        return epl_graph.rewrite_result
    start = time.time()
    state = _rewrite(epl_graph, Env.get())
    epl_graph.rewrite_result = RewriteResult(state, time.time() - start)
    log.info("EPL rewrote the graph for %d clones in %.2fs", state.num_clones,
             epl_graph.rewrite_result.seconds)
    return epl_graph.rewrite_result


def _rewrite(epl_graph, env):
    from epl import plan as planner
    from epl.rewrite import inputs, merge, mirror, replicate, schedule, selection, split
    from epl.rewrite.state import ReplicaState, share_variables
    layout = planner.plan(env.cluster, epl_graph.taskgraphs, env.config)
    replicated = [tg for tg in epl_graph.taskgraphs if tg.kind != "split"]
    sel = selection.select(epl_graph, replicated, share_variables(env.cluster, env.config),
                           env.config.get("communication.clip_after_allreduce"))
    state = ReplicaState(epl_graph, replicated, sel, layout, env.cluster, env.config)
    replicate.place_originals(state)
    split.place(state)
    inputs.shard_inputs(state)
    replicate.clone_replicas(state)
    split.bridge(state)
    split.scale_split_gradients(state)
    schedule.schedule_pipeline(state)
    replicate.join_clones(state)
    mirror.broadcast_initial_values(state)
    mirror.mirror_writes(state)
    merge.merge_outputs(state)
    return state


def on_new_op(graph, op):
    """Ops made after the rewrite: mirror late writes (a Saver built after the first run)."""
    epl_graph = getattr(graph, "_epl_graph", None)
    if epl_graph is None or epl_graph.rewrite_result is None:
        return
    state = epl_graph.rewrite_result.state
    if state is not None:
        from epl.rewrite.mirror import mirror_one
        mirror_one(state, op)
