"""The peak bytes of one traced ``session.run`` (PLATFORM_NOTES "Memory on CPU").

TensorFlow 1.15's CPU allocator keeps no peak; a run made with
``RunOptions(trace_level=FULL_TRACE)`` records every allocation and release of
every op (time, +/- bytes) in its ``RunMetadata``: replayed in time order, the
running sum's maximum is the run's peak.  Variables allocated before the run are
not in it.
"""


def peak_bytes(run_metadata, device=None):
    """The peak of the run ``run_metadata`` describes (of the ops on ``device``,
    default every device)."""
    events = []
    for dev in run_metadata.step_stats.dev_stats:
        if device is not None and dev.device != device:
            continue
        for node in dev.node_stats:
            for mem in node.memory:
                events.extend((r.alloc_micros, r.alloc_bytes) for r in mem.allocation_records)
    events.sort()
    cur = peak = 0
    for _, b in events:
        cur += b
        peak = max(peak, cur)
    return peak


def traced_run(session, fetches, feed_dict=None):
    """Run ``fetches`` once with a full trace; returns (values, RunMetadata)."""
    import tensorflow as tf
    md = tf.compat.v1.RunMetadata()
    out = session.run(fetches, feed_dict=feed_dict, options=tf.compat.v1.RunOptions(
        trace_level=tf.compat.v1.RunOptions.FULL_TRACE), run_metadata=md)
    return out, md
