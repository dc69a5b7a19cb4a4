"""Run an optimizer's update only when a predicate holds, without building it inside
a ``tf.cond`` (an optimizer must be free to create its variables).

The optimizer receives each gradient through a ``Switch`` on the predicate
(``when``): on a run where it is false its update ops get dead inputs and do not
run, nor does anything that waits for them (``global_step``, Adam's beta powers),
like the untaken branch of a ``tf.cond``.  ``done`` is the always-live op to hand
back to the user: after the update (and whatever follows it) when the predicate
holds, at once otherwise.  Used by accumulation across runs (``epl.accumulate``)
and AMP's overflow skip (``epl.amp``).
"""
import tensorflow as tf


def when(g, pred):
    """``g`` (a Tensor or IndexedSlices), alive only on runs where ``pred`` holds."""
    if isinstance(g, tf.IndexedSlices):
        return tf.IndexedSlices(when(g.values, pred), when(g.indices, pred), g.dense_shape)
    return tf.raw_ops.Switch(data=g, pred=pred)[1]


def done(pred, after, name="step"):
    """An op that always runs: after the ops ``after`` when ``pred`` holds (they are
    dead otherwise, and waited for only then)."""
    skipped, taken = tf.raw_ops.Switch(data=pred, pred=pred)
    with tf.control_dependencies(after):
        taken = tf.identity(taken)
    merged, _ = tf.raw_ops.Merge(inputs=[skipped, taken])
    return tf.group(merged, name=name)
