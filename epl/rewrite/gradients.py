"""GradientAggregationPass: reduce each apply_gradients call's gradients across clones.

Dense gradients are all-reduced (``communication.gradients_reduce_method``:
mean or sum); ``IndexedSlices`` gradients are all-gathered (values and
indices), which is their sum, and scaled for the mean.  With variables shared
per worker only the user's (rank 0's) apply ops consume the result.  Every clone's updates
then wait for all of its reduced gradients, so no update overtakes a
gradient computation that still reads the old weights (ref variables).
"""
import tensorflow as tf

from epl import communicators
from epl.rewrite.cloner import new_ops


def reduce_gradients(state, record):
    method = state.config.get("communication.gradients_reduce_method")
    n = state.num_clones
    # With shared variables only the user's apply ops run: they need rank 0's result.
    users = 1 if state.share_variables else n
    index = state.ir_graph.apply_records.index(record)
    comm = communicators.create(state.devices, name="EPL_GRADIENTS_%d" % index)
    reduced_per_clone = [[] for _ in range(users)]
    with new_ops(state.graph):
        for g, _ in record.grads_and_vars:
            if g is None:
                continue
            if isinstance(g, tf.IndexedSlices):
                values = comm.all_gather(state.copies(g.values))
                if method == "mean":
                    values = [_scale(v, 1.0 / n, dev) for v, dev in zip(values, state.devices)]
                indices = comm.all_gather(state.copies(g.indices))
                pairs = [(g.values, values), (g.indices, indices)]
            else:
                pairs = [(g, comm.all_reduce(state.copies(g), method))]
            for original, per_clone in pairs:
                _install(state, record, original, per_clone[:users])
                for c in range(users):
                    reduced_per_clone[c].append(per_clone[c])
        barriers = []
        for c in range(users):
            with tf.device(state.devices[c]):
                barriers.append(tf.group(*reduced_per_clone[c],
                                         name="EPL_GRADIENTS_%d_ready_%d" % (index, c)))
    for c in range(users):
        state.op_map[c][barriers[0]] = barriers[c]
    for op in _apply_ops(state, record):
        if _reads_any(op, reduced_per_clone[0]):
            op._add_control_inputs([barriers[0]])  # pylint: disable=protected-access


def _apply_ops(state, record):
    return [state.graph._nodes_by_id[i] for i in record.op_ids  # pylint: disable=protected-access
            if i in state.graph._nodes_by_id]  # pylint: disable=protected-access


def _scale(t, factor, device):
    with tf.device(device):
        return t * tf.cast(factor, t.dtype)


def _reads_any(op, tensors):
    wanted = set(tensors)
    return any(t in wanted for t in op.inputs)


def _install(state, record, original, per_clone):
    """The record's apply ops read per_clone[c] in clone c instead of ``original``."""
    for consumer in list(original.consumers()):
        if consumer._id in record.op_ids:  # pylint: disable=protected-access
            for i, inp in enumerate(consumer.inputs):
                if inp is original:
                    consumer._update_input(i, per_clone[0])  # pylint: disable=protected-access
    for c in range(len(per_clone)):
        state.tensor_map[c][per_clone[0]] = per_clone[c]
