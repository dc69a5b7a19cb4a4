"""MergeOutputsPass: the merged value of tensors in epl.GraphKeys collections."""
import tensorflow as tf

from epl.collections import GraphKeys, merge_kind
from epl.rewrite.cloner import new_ops


def merge_outputs(state):
    with new_ops(state.graph), tf.device(state.devices[0]):
        for key in GraphKeys.ALL:
            _, how = merge_kind(key)
            for t in state.graph.get_collection(key):
                if t.name in state.merged:
                    continue   # (merged by an earlier rewrite)
                copies = state.copies(t)
                name = "EPL_MERGED/%s_%s" % (t.op.name, how)
                if how == "concat":
                    merged = tf.concat(copies, axis=0, name=name)
                elif how == "sum":
                    merged = tf.math.add_n(copies, name=name)
                else:
                    merged = tf.math.truediv(tf.math.add_n(copies),
                                             tf.cast(len(copies), t.dtype), name=name)
                state.merged[t.name] = merged
