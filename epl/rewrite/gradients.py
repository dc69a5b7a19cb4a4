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
and scaled for the mean.  Which gradients are reduced, and where (at
``apply_gradients`` or where ``tf.gradients`` returns them), is decided by
``updates.py``.

Every clone's updates wait for all of its reduced gradients, so no update
overtakes a gradient computation still reading the old weights (ref variables).
"""
import tensorflow as tf

from epl import ir
from epl.rewrite import fusion
from epl.rewrite.cloner import new_ops
from epl.rewrite.updates import variable_behind
from epl.tf_adapter import graph as tfg


def reduce_gradients(state, site):
    """All-reduce the gradients of one ``updates.ReductionSite`` across clones."""
    cfg = state.config
    # (a loss of split groups is each group's own, as in data parallelism)
    method = ("sum" if site.loss_in_split and not state.layout.split_groups
              else cfg.get("communication.gradients_reduce_method"))
    n = state.num_clones
    users = 1 if state.share_variables else n  # shared variables: only rank 0's result is read
    name = "EPL_GRADIENTS_%d" % site.index
    pairs = site.pairs
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

        owners = _owner_ranks(state, pairs)
        dense = sorted((g for g, _ in pairs
                        if not isinstance(g, tf.IndexedSlices) and g not in owners),
                       key=lambda t: tfg.op_id(t.op))
        last = {}
        for k, g in enumerate(sorted(owners, key=lambda t: tfg.op_id(t.op))):
            comm = comm_for(state.lane_of(g.op), k)
            root = owners[g]
            out = comm.reduce([state.tensor(c, g) for c in range(n)], root, method)
            for c in range(n):
                reduced[c].append(out[c])
                if comm in last:
                    tfg.add_control_inputs(out[c].op, [last[comm][c].op])
            last[comm] = out
            installs.append((g, [out[root]]))
        # Buckets never mix lanes (pipeline stages, split shards): a lane's gradients
        # live on its devices.
        buckets = fusion.plan_buckets([(g, (state.lane_of(g.op), g.dtype), fusion.nbytes(g))
                                       for g in dense], cfg.get("communication.max_splits"))
        for b, ((stage, _), grads) in enumerate(buckets):
            comm = comm_for(stage, b + len(owners))
            out = _reduce_bucket(state, comm, grads, method, users)
            for c in range(n):
                reduced[c].append(out["collective"][c])
                if comm in last:
                    tfg.add_control_inputs(out["collective"][c].op, [last[comm][c].op])
            last[comm] = out["collective"]
            for i, g in enumerate(grads):
                installs.append((g, [out["grads"][c][i] for c in range(users)]))
        for g, _ in pairs:
            if isinstance(g, tf.IndexedSlices):
                comm = comm_for(state.lane_of(g.values.op), 0)
                values = comm.all_gather([state.output(c, g.values) for c in range(n)])
                indices = comm.all_gather([state.output(c, g.indices) for c in range(n)])
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
        _install(state, original, per_clone, site)
    for c in range(users):
        state.op_map[c][barriers[0]] = barriers[c]
    # Whatever reads a reduced gradient (the update, the user's clipping) waits for
    # the whole reduction (not slot initializers: they run before any gradient exists).
    readers = set()
    for _, per in installs:
        readers.update(op for op in per[0].consumers()
                       if state.ir_graph.phase_of(op) != ir.REWRITE and state.editable(op))
    for op in sorted(readers, key=tfg.op_id):
        tfg.add_control_inputs(op, [barriers[0]])


def _owner_ranks(state, pairs):
    """ZeRO (``zero.level``): {dense gradient: the rank (clone) on its variable's owner
    device}.  Only the owner's update reads the reduced gradient, so it is reduced to
    that device alone (a reduce-scatter to the owners, one reduce per gradient)."""
    if not state.zero_owners or not state.share_variables \
            or state.config.get("communication.fp16"):
        return {}
    out = {}
    for g, x in pairs:
        if isinstance(g, tf.IndexedSlices):
            continue
        device = state.zero_owners.get(variable_behind(x))
        devices = [sd[state.lane_of(g.op)] for sd in state.stage_devices]
        if device in devices:
            out[g] = devices.index(device)
    return out


def _reduce_bucket(state, comm, grads, method, users):
    """One fused all-reduce of ``grads`` (the communicator fuses: no concat/split ops)."""
    cfg = state.config
    fp16 = cfg.get("communication.fp16") and grads[0].dtype == tf.float32
    scale = float(cfg.get("communication.fp16_scale"))
    lists = []
    for c, dev in enumerate(comm.devices):
        if fp16:
            with tf.device(dev):
                lists.append([tf.cast(state.tensor(c, g) * scale, tf.float16) for g in grads])
        else:   # the copies' Python ops are not needed (a fused all-reduce reads them in C)
            lists.append([state.output(c, g) for g in grads])
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


def _install(state, original, per_clone, site):
    """Every user op after the gradient call (the update, the user's clipping) reads the
    reduced gradient; the backward ops of the call itself keep the replica's own."""
    state.substitute(original, per_clone,
                     lambda op: (state.ir_graph.phase_of(op) != ir.REWRITE
                                 and tfg.op_id(op) not in site.origin_ids))
