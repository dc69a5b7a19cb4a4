"""InputShardingPass: give every clone its own share of the input batch.

Each model replica (and each of its micro-batches) runs its own copy of the
input pipeline's dequeue (``IteratorGetNext``...), so it pulls its own batch
from the shared iterator; a replica over ``d`` devices splits that batch into
``d`` shards (seed 003).
A fed placeholder with an unknown first dimension holds the global batch and
is split into one shard per clone.
"""
import tensorflow as tf

from epl.rewrite.cloner import clone_op, new_ops


def _split(graph, t, n, device, name, why):
    """``n`` equal shards of ``t``'s rows.  The shards' batch dimension is left unknown:
    the ops that read them were built for the whole batch (in place of the user's
    tensor, clone 0 reads a shard) and, where the batch is fixed, by ``epl.capture.rebatch``
    for any number of rows."""
    rows = tf.compat.dimension_value(t.shape[0]) if t.shape.ndims else None
    if rows is not None and rows % n:
        raise ValueError(
            "EPL: the input %r has a fixed batch of %d rows, which cannot be split into %d "
            "equal parts (%s); use a batch size divisible by %d." % (t.name, rows, n, why, n))
    with new_ops(graph), tf.device(device):
        if rows is not None:
            t = tf.compat.v1.placeholder_with_default(t, [None] + t.shape.as_list()[1:])
        size = tf.raw_ops.Shape(input=t)[0]   # (not folded into a constant: see above)
        check = tf.compat.v1.debugging.assert_equal(
            tf.math.floormod(size, n), 0, data=[size],
            message="EPL: input %r has a batch that cannot be split into %d equal parts "
                    "(%s); use a batch size divisible by %d. Rows:" % (t.name, n, why, n))
        with tf.control_dependencies([check]):
            return tf.split(t, n, axis=0, name=name)


def shard_inputs(state, sel, done):
    """Give the clones their input of the sources and placeholders ``sel`` reads (those
    an earlier rewrite sharded are reinstalled for ``sel``'s new readers).  ``done``:
    the sources and placeholders already sharded (this pass's product, updated)."""
    groups = state.pull_groups   # clones that share one pull (the shards of a replica)
    for src in [op for op in sel.sources if op not in done]:
        done.add(src)
        pulls = [src]
        for group in groups[1:]:
            pulls.append(clone_op(src, src.inputs, state.clone_name(group[0], src.name),
                                  src.device, control_inputs=src.control_inputs))
        for i, out in enumerate(src.outputs):
            per_clone = []
            for g, (group, pull) in enumerate(zip(groups, pulls)):
                if len(group) == 1:
                    per_clone.append(pull.outputs[i])
                else:
                    per_clone.extend(_split(
                        state.graph, pull.outputs[i], len(group),
                        state.devices[group[0]], "EPL_SHARD/%s_%d_r%d" % (src.name, i, g),
                        "one per device of a replicate(device_count=%d) replica" % len(group)))
            _install(state, out, per_clone)
    for ph in [op for op in sel.placeholders if op not in done]:
        done.add(ph)
        out = ph.outputs[0]
        shards = _split(state.graph, out, state.num_clones, state.devices[0],
                        "EPL_SHARD/%s" % ph.name, "a fed batch is split over %d clones"
                        % state.num_clones)
        _install(state, out, shards)


def _install(state, original, per_clone):
    """Clone c reads per_clone[c] where the replica's ops read ``original``."""
    state.substitute(original, per_clone, lambda op: op in state.selection)
