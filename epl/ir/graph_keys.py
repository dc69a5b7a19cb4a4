"""``epl.GraphKeys``: tensors whose fetched value is merged across replicas.

Fetching a replicated tensor returns replica 0's value.  Add it to one of these
collections to fetch the merged value instead: LOCAL merges the replicas of
this worker, GLOBAL those of all workers; CONCAT joins along axis 0, MEAN and
SUM reduce element-wise.
"""
import tensorflow as tf


class GraphKeys(object):
    GLOBAL_CONCAT_OBJECTS = "global_concat_objects"
    GLOBAL_MEAN_OBJECTS = "global_mean_objects"
    GLOBAL_SUM_OBJECTS = "global_sum_objects"
    LOCAL_CONCAT_OBJECTS = "local_concat_objects"
    LOCAL_MEAN_OBJECTS = "local_mean_objects"
    LOCAL_SUM_OBJECTS = "local_sum_objects"

    ALL = (GLOBAL_CONCAT_OBJECTS, GLOBAL_MEAN_OBJECTS, GLOBAL_SUM_OBJECTS,
           LOCAL_CONCAT_OBJECTS, LOCAL_MEAN_OBJECTS, LOCAL_SUM_OBJECTS)
    ALL_COLLECTION_KEYS = list(ALL)


def merge_kind(key):
    """('global'|'local', 'concat'|'mean'|'sum') of a GraphKeys value."""
    scope, how, _ = key.split("_")
    return scope, how


def add_to_collection(tensors, key):
    """Add a tensor, or a list/tuple of tensors, to the epl.GraphKeys collection ``key``."""
    if key not in GraphKeys.ALL:
        raise ValueError("epl.add_to_collection: unknown key %r; use one of epl.GraphKeys.%s"
                         % (key, ", epl.GraphKeys.".join(k.upper() for k in GraphKeys.ALL)))
    for tensor in (tensors if isinstance(tensors, (list, tuple)) else [tensors]):
        if not isinstance(tensor, tf.Tensor):
            raise TypeError("epl.add_to_collection expects a tf.Tensor or a list of them, "
                            "got %r" % (tensor,))
        tensor.graph.add_to_collection(key, tensor)


def get_collection(key, graph=None):
    graph = graph or tf.compat.v1.get_default_graph()
    return graph.get_collection(key)


def get_all_collections(graph=None):
    """{key: tensors} for every epl.GraphKeys collection (``GraphKeys.ALL_COLLECTION_KEYS``)."""
    return {key: get_collection(key, graph) for key in GraphKeys.ALL_COLLECTION_KEYS}
