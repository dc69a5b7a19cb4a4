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


def _split(graph, t, n, device, name):
    with new_ops(graph), tf.device(device):
        rows = tf.shape(t)[0]
        check = tf.debugging.assert_equal(
            tf.math.floormod(rows, n), 0,
            message="EPL: input %r has a batch that cannot be split into %d equal shards "
                    "(one per device of the replica); use a batch size divisible by %d."
                    % (t.name, n, n))
        with tf.control_dependencies([check]):
            return tf.split(t, n, axis=0, name=name)


def shard_inputs(state):
    groups = state.pull_groups   # clones that share one pull (the shards of a replica)
    for src in state.selection.sources:
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
                    per_clone.extend(_split(state.graph, pull.outputs[i], len(group),
                                            state.devices[group[0]],
                                            "EPL_SHARD/%s_%d_r%d" % (src.name, i, g)))
            _install(state, out, per_clone)
    for ph in state.selection.placeholders:
        out = ph.outputs[0]
        shards = _split(state.graph, out, state.num_clones, state.devices[0],
                        "EPL_SHARD/%s" % ph.name)
        _install(state, out, shards)


def _install(state, original, per_clone):
    """Clone c reads per_clone[c] where the replica's ops read ``original``."""
    state.substitute(original, per_clone, lambda op: op in state.selection)
