"""How the variables of a split scope are checkpointed: every shard as its slice of the
unsplit variable (``tf.Variable.SaveSliceInfo``), so a checkpoint restores into the
unsplit model and into any split size, and so do the variables a user's own optimizer
makes for each shard (``companion``)."""
import weakref

import tensorflow as tf

from epl.tf_adapter import graph as tfg

# graph -> {op name of a split variable's shard: its SaveSliceInfo}
_SHARDS = weakref.WeakKeyDictionary()


def note_shard(var):
    """``var`` is a shard that is checkpointed as a slice (its SaveSliceInfo is set)."""
    info = tfg.save_slice_info(var)
    if info is not None:
        _SHARDS.setdefault(var.graph, {})[var.op.name] = info


def companion(var):
    """A variable named after a split shard, ``<shard>/<suffix>``, with the shard's shape
    (a hand-written optimizer's moment, ``tf.get_variable(param.op.name + "/adam_m")``,
    made for every trainable variable it is given: the shards) is checkpointed as its
    slice of ``<full name>/<suffix>``, as TensorFlow's own slots of a partitioned
    variable are.  Returns ``var``."""
    if not isinstance(var, tf.Variable):
        return var
    shards = _SHARDS.get(var.graph)
    if not shards or tfg.save_slice_info(var) is not None:
        return var
    name = var.op.name
    cut = name.rfind("/")
    while cut > 0:
        info = shards.get(name[:cut])
        if info is not None:
            if var.shape.as_list() == list(info.var_shape):
                tfg.set_save_slice_info(var, tf.Variable.SaveSliceInfo(
                    info.full_name + name[cut:], info.full_shape, info.var_offset,
                    info.var_shape))
            break
        cut = name.rfind("/", 0, cut)
    return var
