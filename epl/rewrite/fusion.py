"""Tensor fusion: pack many gradients into a few buffers for fewer, larger collectives.

``plan_buckets`` is pure Python (unit-tested without TF); ``pack`` / ``unpack``
build the concat / split ops of one clone.
"""
import collections

import tensorflow as tf


def plan_buckets(items, max_splits):
    """Group ``items`` = [(key, dtype, nbytes)] in the given order into buckets.

    Per dtype at most ``max_splits`` buckets of roughly equal bytes; the order
    of items is kept (callers pass gradients in production order, so the
    first bucket is ready first).  Returns a list of (dtype, [keys]).
    """
    if max_splits < 1:
        raise ValueError("communication.max_splits must be >= 1, got %d" % max_splits)
    by_dtype = collections.OrderedDict()
    for key, dtype, nbytes in items:
        by_dtype.setdefault(dtype, []).append((key, nbytes))
    buckets = []
    for dtype, entries in by_dtype.items():
        total = float(sum(n for _, n in entries))
        target = total / max_splits
        current, filled, made = [], 0.0, 0
        for i, (key, nbytes) in enumerate(entries):
            current.append(key)
            filled += nbytes
            left = len(entries) - i - 1
            if left and made < max_splits - 1 and filled >= target * (made + 1):
                buckets.append((dtype, current))
                current, made = [], made + 1
        if current:
            buckets.append((dtype, current))
    return buckets


def pack(tensors):
    """One flat buffer of ``tensors`` (same dtype)."""
    if len(tensors) == 1:
        return tf.reshape(tensors[0], [-1])
    return tf.concat([tf.reshape(t, [-1]) for t in tensors], axis=0)


def unpack(flat, like):
    """Split ``flat`` back into tensors shaped like ``like``."""
    if len(like) == 1:
        return [_reshape_like(flat, like[0])]
    sizes = [_num_elements(t) for t in like]
    if all(isinstance(s, int) for s in sizes):
        parts = tf.split(flat, sizes, axis=0)
    else:
        parts = tf.split(flat, tf.stack([tf.cast(s, tf.int64) if not isinstance(s, int)
                                         else tf.constant(s, tf.int64) for s in sizes]),
                         num=len(like), axis=0)
    return [_reshape_like(p, t) for p, t in zip(parts, like)]


def _num_elements(t):
    n = t.shape.num_elements()
    return int(n) if n is not None else tf.size(t)


def _reshape_like(flat, t):
    shape = t.shape.as_list() if t.shape.is_fully_defined() else tf.shape(t)
    return tf.reshape(flat, shape)


def nbytes(t):
    n = t.shape.num_elements()
    return (n if n is not None else 1) * t.dtype.size
