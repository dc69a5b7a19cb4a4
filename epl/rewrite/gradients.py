"""GradientAggregationPass: reduce each apply_gradients call's gradients across clones.

Dense gradients are fused (``fusion.py`` plans the buckets; the fused
all-reduce op reduces a bucket as one buffer) into at most
``communication.max_splits`` buffers per dtype, in the order backprop
produces them so the first buffer's all-reduce overlaps the rest of the
backward pass; buffers are spread over ``communication.num_communicators``
communicators (buffers of one communicator run in order, different
communicators concurrently).  ``communication.fp16`` sends float32 buffers as
float16, multiplied by ``fp16_scale`` before and divided after.
``IndexedSlices`` gradients are all-gathered (values and indices: their sum)
and scaled for the mean.  With ``communication.clip_after_allreduce`` the
gradients are reduced where ``compute_gradients`` returns them, so the user's
clipping between compute and apply sees the reduced gradients.

Every clone's updates wait for all of its reduced gradients, so no update
overtakes a gradient computation still reading the old weights (ref variables).
"""
import tensorflow as tf

from epl.rewrite import fusion
from epl.rewrite.cloner import new_ops


def targets(state, record):
    """The (grad, var) pairs to reduce for ``record`` and the ops that read them
    (not a split TaskGraph's shards: each has its own gradient)."""
    if state.config.get("communication.clip_after_allreduce") and record.computed is not None:
        pairs = record.computed
    else:
        pairs = record.grads_and_vars
    return [(g, v) for g, v in pairs if g is not None and _per_clone(state, g, v)]


def _per_clone(state, g, v):
    """True when every clone computes its own copy of ``g`` (so it must be reduced).

    A split TaskGraph's shard variable normally gets its gradient from the split's
    own ops (one copy, nothing to reduce); read directly by a replicated op (an
    embedding table under split, looked up by the replicas) its gradient is
    computed per clone and is reduced like any replicated gradient.
    """
    tg = state.ir_graph.taskgraph_of(v.op)
    if tg is None or tg.kind != "split":
        return True
    t = g.values if isinstance(g, tf.IndexedSlices) else g
    return t.op in state.selection


def reduce_gradients(state, record):
    cfg = state.config
    method = state.reduce_method or cfg.get("communication.gradients_reduce_method")
    n = state.num_clones
    users = 1 if state.share_variables else n  # shared variables: only rank 0's result is read
    index = state.ir_graph.apply_records.index(record)
    name = "EPL_GRADIENTS_%d" % index
    pairs = targets(state, record)
    if not pairs:
        return
    reduced = [[] for _ in range(n)]   # every rank's reduced tensors (all must run)
    installs = []
    with new_ops(state.graph):
        num_comms = max(1, cfg.get("communication.num_communicators"))
        comms = {}

        def comm_for(stage, b):
            """Communicator b % num_communicators over the devices of ``stage``."""
            key = (stage, b % num_comms)
            if key not in comms:
                comms[key] = state.communicator("%s/stage_%d/comm_%d" % ((name,) + key), stage)
            return comms[key]

        dense = sorted((g for g, _ in pairs if not isinstance(g, tf.IndexedSlices)),
                       key=lambda t: t.op._id)  # pylint: disable=protected-access
        # Buckets never mix pipeline stages: a stage's gradients live on its devices.
        buckets = fusion.plan_buckets([(g, (state.stage_of(g.op), g.dtype), fusion.nbytes(g))
                                       for g in dense], cfg.get("communication.max_splits"))
        last = {}
        for b, ((stage, _), grads) in enumerate(buckets):
            comm = comm_for(stage, b)
            out = _reduce_bucket(state, comm, grads, method, users)
            for c in range(n):
                reduced[c].append(out["collective"][c])
                if comm in last:
                    out["collective"][c].op._add_control_inputs([last[comm][c].op])  # pylint: disable=protected-access
            last[comm] = out["collective"]
            for i, g in enumerate(grads):
                installs.append((g, [out["grads"][c][i] for c in range(users)]))
        for g, _ in pairs:
            if isinstance(g, tf.IndexedSlices):
                comm = comm_for(state.stage_of(g.values.op), 0)
                values = comm.all_gather(state.copies(g.values))
                indices = comm.all_gather(state.copies(g.indices))
                for c in range(n):
                    reduced[c] += [values[c], indices[c]]
                if method == "mean":
                    total = n * (1 if state.in_graph else state.cluster.worker_num)
                    values = [_scale(v, 1.0 / total, dev) for v, dev in zip(values, comm.devices)]
                installs += [(g.values, values[:users]), (g.indices, indices[:users])]
        barriers = []
        for c in range(users):
            with tf.device(state.devices[c]):
                # Every update also waits for every other rank's collectives: they must all
                # run (with micro-batches or shared variables some ranks' results are unread).
                deps = [t for cc in range(n) for t in reduced[cc]]
                deps += [t for _, per in installs for t in per[c:c + 1]]
                barriers.append(tf.group(*deps, name="%s_ready_%d" % (name, c)))
    for original, per_clone in installs:
        _install(state, original, per_clone)
    for c in range(users):
        state.op_map[c][barriers[0]] = barriers[c]
    # Every update waits for the whole reduction (not slot initializers: they
    # run before any gradient exists).
    wanted = set(per[0] for _, per in installs)
    for g, _ in record.grads_and_vars:
        if isinstance(g, tf.IndexedSlices):
            wanted.update([g.values, g.indices])
        elif g is not None:
            wanted.add(g)
    for op in _apply_ops(state, record):
        if any(t in wanted for t in op.inputs):
            op._add_control_inputs([barriers[0]])  # pylint: disable=protected-access


def _reduce_bucket(state, comm, grads, method, users):
    """One fused all-reduce of ``grads`` (the communicator fuses: no concat/split ops)."""
    cfg = state.config
    fp16 = cfg.get("communication.fp16") and grads[0].dtype == tf.float32
    scale = float(cfg.get("communication.fp16_scale"))
    lists = []
    for c, dev in enumerate(comm.devices):
        with tf.device(dev):
            ts = [state.tensor(c, g) for g in grads]
            if fp16:
                ts = [tf.cast(t * scale, tf.float16) for t in ts]
            lists.append(ts)
    collective = comm.all_reduce_n(lists, method)
    per_clone = []
    for c in range(users):
        outs = collective[c]
        if fp16:
            with tf.device(comm.devices[c]):
                outs = [tf.cast(t, tf.float32) / scale for t in outs]
        per_clone.append(outs)
    return {"collective": [outs[0] for outs in collective], "grads": per_clone}


def _scale(t, factor, device):
    with tf.device(device):
        return t * tf.cast(factor, t.dtype)


def _apply_ops(state, record):
    nodes = state.graph._nodes_by_id  # pylint: disable=protected-access
    return [nodes[i] for i in record.op_ids if i in nodes]


def _install(state, original, per_clone):
    """Every user op (the optimizer's, and clipping with clip_after_allreduce) reads the
    reduced gradient."""
    state.substitute(original, per_clone, lambda op: state.ir_graph.phase_of(op) != "rewrite")
