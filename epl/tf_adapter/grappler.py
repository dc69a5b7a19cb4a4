"""TensorFlow's graph optimizer (Grappler), run on a built graph without a session.

A session optimizes the graph before running it: identity transposes go, products fuse
with their bias, element-wise chains are rewritten.  What a step holds in memory is a
property of that optimized graph, not of the one the user built (measured on the GPT of
``epl.auto.gpt``: the built graph's liveness over-predicts the traced peak by 15 %, the
optimized one's by 2.6 %).  ``optimized(graph, fetches)`` returns the optimized copy as
a new ``tf.Graph``; ops keep their names where Grappler keeps them.

Grappler's remapper fuses a product with the bias and activation after it
(``_FusedMatMul``, ``_FusedConv2D``) only for ops placed on a CPU: a session places
every op before it optimizes, so ``device=ON_CPU`` gives the kernels the session runs
(the MLP of ``plan_accuracy``: 5 fused products, the mini-BERT's 14; stop 59).  The
default, no device, is the graph as built, which the memory model was validated on."""
import tensorflow as tf

v1 = tf.compat.v1


ON_CPU = "/device:CPU:0"     # every op on a CPU, as the session's placer puts them here


def optimized(graph, fetches, device=""):
    """(a new tf.Graph holding Grappler's default optimization of ``graph`` for
    ``fetches`` (ops), the fetched ops in it); ``device``: every node's device while
    Grappler runs (``ON_CPU``: the CPU-only fusions too), none in the copy returned."""
    from tensorflow.python.grappler import tf_optimizer  # pylint: disable=import-outside-toplevel
    from tensorflow.core.protobuf import meta_graph_pb2  # pylint: disable=import-outside-toplevel
    # (not export_meta_graph: on a graph EPL has rewritten for pipeline stages it leaves
    # out the micro-batch clones that the all-reduce ops read; TF 1.15)
    graph_def = graph.as_graph_def(add_shapes=True)
    for node in graph_def.node:
        node.device = device
    meta = meta_graph_pb2.MetaGraphDef()
    meta.graph_def.CopyFrom(graph_def)
    # Grappler's fetches are read from the train_op collection
    meta.collection_def["train_op"].node_list.value.extend(op.name for op in fetches)
    optimized_def = tf_optimizer.OptimizeGraph(v1.ConfigProto(), meta, verbose=False)
    for node in optimized_def.node:
        node.device = ""
    out = tf.Graph()
    with out.as_default():
        tf.import_graph_def(optimized_def, name="")
    return out, [out.get_operation_by_name(op.name) for op in fetches]
