"""Kinds of variable objects that TensorFlow has no public name for.

``tf.compat.v1.get_variable`` with a partitioner returns a ``PartitionedVariable`` (a
list of shards that reads as one tensor); neither line exports the class.
"""
from tensorflow.python.ops import variables as _variables


def is_partitioned(x):
    """``x`` is a partitioned variable (``get_variable`` with a partitioner)."""
    return isinstance(x, _variables.PartitionedVariable)
