"""MicroBatchStatePass: a replica's micro-batches update its own state in turn.

Per-replica state (batch-norm moving statistics: a variable written from the batch, not
through a gradient, ``updates.py``) is one variable per replica, which every micro-batch
of that replica updates with a read-modify-write (``v -= (v - batch_mean) * (1 - decay)``).
Nothing in the graph orders two micro-batches' updates: both may read ``v`` before either
writes, and one micro-batch's update is lost.  With resource variables (TF 2.x after
``disable_eager_execution()`` alone, ``use_resource=True``) that happens on one device
(measured: a conv net's moving variance after one step of 2 micro-batches followed
neither order of the micro-batches).  Gradient accumulation and GPipe / 1F1B mean the
micro-batches run one after another, so the reads of such a variable in micro-batch
``m`` wait for micro-batch ``m - 1``'s writes of it.
"""
from epl import ir
from epl.rewrite import loop_contexts
from epl.rewrite.read_order import variable_readers
from epl.tf_adapter import deferred


def order_micro_batch_state(state, sel):
    """The pass; ``sel``: the replica ops of this rewrite."""
    plan = state.selection.updates
    if not plan.local_variables or state.layout.num_micro_batch < 2:
        return
    micro = {}      # replica -> [clone of micro-batch 0, 1, ...]
    for c, (r, m, _) in enumerate(state.clones):
        micro.setdefault(r, {})[m] = c
    chains = [[by_m[m] for m in sorted(by_m)] for _, by_m in sorted(micro.items())]
    writes = {}
    for w in plan.writes:
        if w in sel and plan.target[w] in plan.local_variables:
            writes.setdefault(plan.target[w], []).append(w)
    safe = loop_contexts.edge_safe(state.selection.ops)
    for var, ws in sorted(writes.items(), key=lambda kv: kv[0].name):
        if any(w not in safe for w in ws):
            continue   # (a write inside a loop or condition: no edge may reach it)
        # The reads that feed the writes (the read of read-modify-write), in the replica.
        reads = sorted(variable_readers(var) & ir.upstream(ws, within=state.selection) & safe,
                       key=lambda op: op.name)
        for chain in chains:
            for before, after in zip(chain, chain[1:]):
                own = [r for r in reads if state.op_map[after].get(r) is not None]
                if own:
                    deferred.add_control_edges(
                        state.graph, [state.op_name(before, w) for w in ws],
                        [state.op_name(after, r) for r in own])
