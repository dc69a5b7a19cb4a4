"""Kinds of variable objects that TensorFlow has no public name for.

``tf.compat.v1.get_variable`` with a partitioner returns a ``PartitionedVariable`` (a
list of shards that reads as one tensor); neither line exports the class.
"""
from tensorflow.python.ops import variables as _variables


def is_partitioned(x):
    """``x`` is a partitioned variable (``get_variable`` with a partitioner)."""
    return isinstance(x, _variables.PartitionedVariable)


class _IndexableTable(_variables.PartitionedVariable):
    """A partitioned variable that also takes the operators a plain variable takes and
    ``PartitionedVariable`` lacks (``table[None, :, :]``, ``-table``): they read the
    concatenation of the shards, as its other uses do.  Only EPL's split tables are
    given this class, so user programs written for a plain variable keep working
    under ``epl.split``."""

    def __getitem__(self, index):
        return self.as_tensor()[index]

    def __neg__(self):
        return -self.as_tensor()

    def __abs__(self):
        return abs(self.as_tensor())


def indexable(var):
    """Give the partitioned variable ``var`` a plain variable's indexing and unary
    operators (see ``_IndexableTable``); returns ``var``."""
    if type(var) is _variables.PartitionedVariable:   # (not a user's own subclass)
        var.__class__ = _IndexableTable
    return var
