"""Tracing one ``Session.run``: the run options that ask TensorFlow for a full trace,
merged with the user's own, and the executed nodes read back from ``RunMetadata``'s
step stats (``epl.profile`` turns them into a Chrome trace).

Only public protos are read (``RunOptions``, ``RunMetadata.step_stats``); the module
lives in the adapter because what a line fills in differs (TF 2.x records a node's type
in ``timeline_label`` only for some kernels), and that difference belongs here.
"""
import collections

import tensorflow as tf

# One executed node: the device TensorFlow names (/job:.../device:CPU:1), the node's
# name and op type, and its start and end in microseconds of TensorFlow's clock (the
# wall clock, like time.time()).
Node = collections.namedtuple("Node", "device name op start_us end_us thread")


def full_trace_options(options):
    """``options`` (the user's RunOptions or None) with a full trace asked for; the
    user's other settings (timeouts, debug options) are kept."""
    merged = tf.compat.v1.RunOptions()
    if options is not None:
        merged.CopyFrom(options)
    merged.trace_level = tf.compat.v1.RunOptions.FULL_TRACE
    return merged


def new_run_metadata():
    return tf.compat.v1.RunMetadata()


def _op_type(node):
    """``timeline_label`` is "name = Type(inputs)" (or "name = Type()"); the type
    alone, or '' when the line did not write one."""
    label = node.timeline_label
    _, eq, rest = label.partition(" = ")
    if not eq:
        return ""
    return rest.split("(", 1)[0].strip()


def executed_nodes(run_metadata, op_types=None):
    """Every node a traced run executed, per device, as ``Node``s.  ``op_types``
    ({node name: type}, from the graph) names the type where the step stats do not."""
    out = []
    stats = list(run_metadata.step_stats.dev_stats)
    if any("/device:" in dev.device for dev in stats):
        # TF's profiler adds a "/host:CPU" lane of host-side events that repeat the
        # devices' nodes (and the _Send/_Recv around them): the devices' lanes say it.
        stats = [dev for dev in stats if "/device:" in dev.device]
    for dev in stats:
        for node in dev.node_stats:
            name = node.node_name.split(":")[0]
            op = _op_type(node) or (op_types or {}).get(name, "") or name
            start = node.all_start_micros
            end = start + max(node.all_end_rel_micros, node.op_end_rel_micros, 0)
            out.append(Node(dev.device, name, op, start, end, node.thread_id))
    return out
