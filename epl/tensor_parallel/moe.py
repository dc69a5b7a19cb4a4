"""Mixture of experts (GShard-style top-1 / top-2 gating with capacity).

``moe_layer`` is one function for both worlds, so the local model is its own
reference:

* outside ``epl.split``: every expert on one device, dense einsums;
* under ``epl.split(n)``: the expert weights ``[E, ...]`` are sharded along the
  expert dimension (shard i holds experts ``[o_i, o_i + e_i)``), the token
  groups are divided over the n devices, each device gates its own groups and
  builds its dispatch tensor ``[E, groups, capacity, d]``, an **all-to-all**
  sends every expert its rows, the experts run where their weights are, and a
  second all-to-all brings the results back for the combine einsum.

Tokens are gated in ``num_groups`` groups of equal size (capacity is per group,
as in GShard); under split the default is one group per device, and the same
``num_groups`` gives the same numbers locally.
"""
import tensorflow as tf

from epl import communicators
from epl.communicators.in_graph import InGraphCommunicator
from epl.core.process_state import Env
from epl.tensor_parallel import sharding

_calls = [0]


def moe_layer(inputs, num_experts, hidden_size, output_size=None, top_k=1,
              capacity_factor=1.0, num_groups=None, activation=tf.nn.relu,
              expert_initializer=None, gate_initializer=None, name="moe"):
    """Apply a mixture-of-experts FFN to ``inputs`` [tokens, d].

    Returns ``(outputs [tokens, output_size], aux_loss)``; ``aux_loss`` is the
    load-balancing loss (mean over groups of ``E * sum_e f_e * p_e``).
    """
    if top_k not in (1, 2):
        raise ValueError("moe_layer: top_k must be 1 or 2, got %r" % (top_k,))
    strategy = sharding.active_split()
    n = sharding.split_count(strategy) if strategy is not None else 1
    if num_experts < n:
        raise ValueError("moe_layer: %d experts cannot be sharded over epl.split(%d); use "
                         "at least one expert per device." % (num_experts, n))
    groups = num_groups or n
    if groups % n:
        raise ValueError("moe_layer: num_groups=%d must be a multiple of the split's %d "
                         "devices (each device gates whole groups)." % (groups, n))
    d = int(inputs.shape[-1])
    out_size = output_size or d
    with tf.compat.v1.variable_scope(None, default_name=name), sharding.raw():
        gate = tf.compat.v1.get_variable("gate", [d, num_experts], inputs.dtype,
                               initializer=gate_initializer)
        w1 = _experts(strategy, n, "experts_w1", [num_experts, d, hidden_size], inputs.dtype,
                      expert_initializer)
        w2 = _experts(strategy, n, "experts_w2", [num_experts, hidden_size, out_size],
                      inputs.dtype, expert_initializer)
        tokens = tf.reshape(inputs, [groups, -1, d])
        if n == 1:
            combine, dispatch, aux = _gating(tokens, gate, num_experts, top_k, capacity_factor)
            expert_in = tf.einsum("gsec,gsd->egcd", dispatch, tokens)
            expert_out = _ffn(expert_in, w1[0], w2[0], activation)
            out = tf.einsum("gsec,egcd->gsd", combine, expert_out)
            return tf.reshape(out, [-1, out_size]), aux
        return _sharded(tokens, gate, w1, w2, n, groups, num_experts, top_k, capacity_factor,
                        activation, out_size)


def _experts(strategy, n, name, full_shape, dtype, initializer):
    """One variable (local) or n expert shards, saved as slices of ``name``."""
    if strategy is None:
        return [tf.compat.v1.get_variable(name, full_shape, dtype, initializer=initializer)]
    counts = sharding.sizes(full_shape[0], n, "number of experts")
    offs = sharding.offsets(counts)
    init = initializer or tf.compat.v1.glorot_uniform_initializer()
    out = []
    for i in range(n):
        with sharding.on_shard(i):
            shape = [counts[i]] + full_shape[1:]
            v = tf.compat.v1.get_variable("%s/part_%d" % (name, i), shape, dtype,
                                initializer=sharding.slice_initializer(init, full_shape, 0,
                                                                       offs[i], counts[i]))
            out.append(sharding.mark_slice(v, v.op.name.rsplit("/part_", 1)[0], full_shape, 0,
                                           offs[i]))
    return out


def _ffn(x, w1, w2, activation):
    h = tf.einsum("egcd,edh->egch", x, w1)
    if activation is not None:
        h = activation(h)
    return tf.einsum("egch,eho->egco", h, w2)


def _gating(tokens, gate, num_experts, top_k, capacity_factor):
    """combine [g, s, E, C] weights, dispatch (0/1) and the aux loss for ``tokens`` [g, s, d]."""
    # Capacity from the run-time group size: in a hybrid the split sees every replica's
    # tokens, more than the graph's static shape says.
    s = tf.cast(tf.shape(tokens)[1], tf.float64)
    capacity = tf.maximum(1, tf.cast(tf.math.ceil(top_k * s * capacity_factor / num_experts),
                                     tf.int32))
    logits = tf.einsum("gsd,de->gse", tokens, gate)
    probs = tf.nn.softmax(logits, axis=-1)
    mask1 = tf.one_hot(tf.argmax(probs, axis=-1), num_experts, dtype=probs.dtype)
    aux = tf.reduce_mean(tf.reduce_sum(tf.reduce_mean(mask1, axis=1) *
                                       tf.reduce_mean(probs, axis=1), axis=-1)) * num_experts
    pos1 = tf.cumsum(mask1, axis=1, exclusive=True)           # place among first choices
    cap = tf.cast(capacity, probs.dtype)
    keep1 = mask1 * tf.cast(pos1 < cap, probs.dtype)
    gate1 = tf.reduce_sum(probs * mask1, axis=-1)
    slots = [(keep1, pos1, gate1)]
    if top_k == 2:
        mask2 = tf.one_hot(tf.argmax(probs * (1.0 - mask1), axis=-1), num_experts,
                           dtype=probs.dtype)
        # Second choices queue after every first choice of the group.
        pos2 = (tf.cumsum(mask2, axis=1, exclusive=True)
                + tf.reduce_sum(mask1, axis=1, keepdims=True))
        keep2 = mask2 * tf.cast(pos2 < cap, probs.dtype)
        gate2 = tf.reduce_sum(probs * mask2, axis=-1)
        norm = gate1 + gate2
        slots = [(keep1, pos1, gate1 / norm), (keep2, pos2, gate2 / norm)]
    combine = 0.0
    for keep, pos, g in slots:
        where = tf.one_hot(tf.cast(tf.reduce_sum(pos * keep, axis=-1), tf.int32), capacity,
                           dtype=probs.dtype)                     # [g, s, C]
        combine += (tf.expand_dims(g, -1) * keep)[..., None] * where[:, :, None, :]
    dispatch = tf.cast(combine > 0, combine.dtype)
    return combine, dispatch, aux


def _sharded(tokens, gate, w1, w2, n, groups, num_experts, top_k, capacity_factor, activation,
             out_size):
    counts = [int(w.shape[0]) for w in w1]
    per = groups // n
    _calls[0] += 1
    tag = "EPL_SPLIT_MOE_%d" % _calls[0]
    combines, sent, auxes = [], [], []
    for j in range(n):
        with sharding.on_shard(j):
            mine = tokens[j * per:(j + 1) * per]
            combine, dispatch, aux = _gating(mine, gate, num_experts, top_k, capacity_factor)
            combines.append(combine)
            auxes.append(aux)
            sent.append(tf.einsum("gsec,gsd->egcd", dispatch, mine))   # [E, per, C, d]
    received = _all_to_all(sent, counts, tag + "/dispatch")              # j: [n*e_j, per, C, d]
    back = []
    for i in range(n):
        with sharding.on_shard(i):
            x = _regroup(received[i], n, counts[i])                       # [e_i, groups, C, d]
            y = _ffn(x, w1[i], w2[i], activation)
            back.append(_ungroup(y, n, counts[i]))                        # [n*e_i, per, C, o]
    returned = _all_to_all(back, None, tag + "/combine", back_counts=counts)
    outs = []
    for j in range(n):
        with sharding.on_shard(j):
            outs.append(tf.reshape(tf.einsum("gsec,egco->gso", combines[j], returned[j]),
                                   [-1, out_size]))
    aux = tf.add_n(auxes) / float(n)
    return tf.concat(outs, axis=0), aux


def _regroup(x, n, e):
    """[n*e, per, C, d] rows from each source device -> [e, n*per, C, d]."""
    shape = tf.shape(x)
    x = tf.reshape(x, tf.concat([[n, e], shape[1:]], 0))
    x = tf.transpose(x, [1, 0, 2, 3, 4])
    return tf.reshape(x, tf.concat([[e, n * shape[1]], shape[2:]], 0))


def _ungroup(y, n, e):
    """[e, n*per, C, o] -> [n*e, per, C, o], block j = the rows for device j's groups."""
    shape = tf.shape(y)
    y = tf.reshape(y, tf.concat([[e, n, shape[1] // n], shape[2:]], 0))
    y = tf.transpose(y, [1, 0, 2, 3, 4])
    return tf.reshape(y, tf.concat([[n * e, shape[1] // n], shape[2:]], 0))


def _all_to_all(per_device, counts, group, back_counts=None):
    """Device j sends rows ``counts[i]`` of its tensor to device i (dispatch), or, for
    the way back, every device sends block j (``back_counts[i]`` rows each) to device j.
    Through a communicator over the split's shards: EPL's collectives in one process;
    across workers the rows move in-graph on TF's runtime."""
    n = len(per_device)
    if back_counts is None:
        splits = [list(counts)] * n           # every source splits by expert shard
    else:
        splits = [[back_counts[i]] * n for i in range(n)]   # source i: e_i rows per dest
    shards = [None] * n
    if sharding.single_process():
        timeout = Env.get().config.get("communication.timeout_seconds")
        comm = communicators.create(shards, group, timeout, placer=sharding.on_shard)
    else:
        comm = InGraphCommunicator(shards, group, placer=sharding.on_shard)
    return comm.all_to_all(per_device, splits)
    pieces = []
    for j in range(n):
        with sharding.on_shard(j):
            pieces.append(tf.split(per_device[j], splits[j], axis=0))
    out = []
    for i in range(n):
        with sharding.on_shard(i):
            out.append(tf.concat([pieces[j][i] for j in range(n)], axis=0))
    return out
