"""MergeOutputsPass: the merged value of tensors in epl.GraphKeys collections.

LOCAL_* merges this worker's clones (CONCAT along axis 0 in clone order, SUM,
MEAN).  GLOBAL_* merges every clone of the job: in a multi-worker job whose
workers each run their own graph, the worker's merge is then combined across
workers with one collective (rows of worker 0 first for CONCAT).  Every worker
must then fetch a GLOBAL_* tensor in the same steps (it is a collective): a
worker that does not join fails the others after communication.timeout_seconds,
naming it.
"""
import tensorflow as tf

from epl.collections import GraphKeys, merge_kind
from epl.rewrite.cloner import new_ops


def merge_outputs(state):
    across = state.cluster.worker_num > 1 and not state.in_graph
    with new_ops(state.graph), tf.device(state.devices[0]):
        for key in GraphKeys.ALL:
            scope, how = merge_kind(key)
            for t in state.graph.get_collection(key):
                if t.name in state.merged:
                    continue   # (merged by an earlier rewrite)
                copies = state.copies(t)
                name = "EPL_MERGED/%s_%s_%s" % (t.op.name, scope, how)
                if how == "concat":
                    merged = tf.concat(copies, axis=0, name=name)
                else:
                    merged = tf.math.add_n(copies, name=name)
                if scope == "global" and across:
                    merged = _across_workers(state, merged, how, name)
                if how == "mean":
                    total = len(copies) * (state.cluster.worker_num
                                           if scope == "global" and across else 1)
                    merged = tf.math.truediv(merged, tf.cast(total, t.dtype), name=name + "_mean")
                state.merged[t.name] = merged


def _across_workers(state, local, how, name):
    from epl.communicators import native_ops
    from epl.communicators.hierarchical import host_device
    cluster = state.cluster
    kw = dict(rank=cluster.worker_index, size=cluster.worker_num,
              timeout_seconds=state.config.get("communication.timeout_seconds"),
              transport=cluster.cross_worker_transport())
    group = "%s/%s" % (cluster.job_id, name)
    with tf.device(host_device(state.devices[0])):
        if how == "concat":
            return native_ops.all_gather(local, group, **kw)
        return native_ops.all_reduce(local, group, reduce_op="sum", **kw)
