"""What tf.keras reports is the global batch's, as with ``MirroredStrategy``.

tf.keras (graph mode) feeds each step's batch into the model's Inputs; EPL splits it over
the replicas (and micro-batches), so every tensor the model computes from the batch
exists once per clone, and fetching one returns clone 0's value.  Keras fetches three
kinds of such tensors, and users read them (the progress bar, History, the logs that
EarlyStopping or ReduceLROnPlateau act on, ``evaluate``'s and ``predict``'s results):

* the loss (``Model.total_loss``): the mean of the clones' losses, which is the global
  batch's loss when the clones' batches are equal (``epl.GraphKeys.GLOBAL_MEAN_OBJECTS``);
* a stateful metric's result (``Metric.__call__``: accuracy, AUC, Mean...; also a metric
  used by hand, ``update_state`` then ``result()``): the metric's state variables (in no
  collection: not model state) are metric state, one copy that every replica's
  ``assign_add`` adds to, the user's last (``epl.rewrite.metrics``), so ``result()`` reads
  the totals and counts of all replicas; across workers each replica's addend is summed
  over the workers first.  The result ``__call__`` returns is also registered here and
  recomputed from that state, read after every replica's update (``epl.rewrite.merge``:
  combined by each variable's ``aggregation`` where a variable has copies);
  ``reset_states`` writes the one copy;
* the outputs ``predict`` fetches: the clones' rows concatenated in batch order
  (``epl.GraphKeys.LOCAL_CONCAT_OBJECTS``: the rows this worker fed).  With micro-batches
  it is refused: the pipeline schedule runs each micro-batch's forward pass, loss
  included, after the previous one's, so the outputs would need the targets.

In a job of several workers that each run their own graph, the loss and the metrics are
combined across workers too (a collective): every worker must call ``fit`` /
``evaluate`` for the same steps, as with ``MultiWorkerMirroredStrategy``.

Patch point 17 of ``epl.capture.patches``: tf.keras ``Model._prepare_total_loss``,
``Metric.__call__`` and ``Model._make_predict_function`` (:func:`total_loss_hook`,
:func:`metric_call_hook`, :func:`predict_function_hook`) report what they built here.
"""
import tensorflow as tf

from epl import ir
from epl.ir.graph_keys import GraphKeys
from epl.core.process_state import Env
from epl.tf_adapter.patching import original


def loss_built(total_loss):
    """``Model.total_loss`` was built (compile, or a recompile for sample weights)."""
    if _graph_tensor(total_loss):
        _add(total_loss, GraphKeys.GLOBAL_MEAN_OBJECTS)


def metric_called(metric, result):
    """``metric(...)`` returned ``result``: the value computed from its state variables
    after this call's update."""
    if not _graph_tensor(result):
        return
    aggregation = {}
    for v in metric.variables:
        op = getattr(v, "op", None)
        if op is None or op.graph is not result.graph:
            return   # (state outside this graph: nothing EPL replicates)
        aggregation[op.name] = getattr(v, "aggregation", tf.compat.v1.VariableAggregation.SUM)
    if aggregation:
        epl_graph = ir.Graph.get(result.graph)
        epl_graph.state_results.append((result, aggregation))
        epl_graph.pending = epl_graph.pending or epl_graph.rewritten


def predict_function_made(model):
    """``Model.predict`` fetches ``model.outputs`` (one row per example)."""
    outputs = [t for t in getattr(model, "outputs", None) or []
               if _graph_tensor(t) and t.shape.ndims != 0]
    if not outputs:
        return
    micro = Env.get().config.get("pipeline.num_micro_batch") if Env.initialized() else 1
    if micro > 1 and ir.Graph.get(outputs[0].graph).taskgraphs:
        raise NotImplementedError(
            "EPL: tf.keras Model.predict with 'pipeline.num_micro_batch' = %d: each "
            "micro-batch's forward pass, loss included, runs after the previous "
            "micro-batch's (the pipeline schedule), and the loss reads the targets, which "
            "predict does not feed. Predict in a program without micro-batches (epl.init "
            "with pipeline.num_micro_batch 1, after loading the trained weights), or use "
            "evaluate, which feeds the targets." % micro)
    for t in outputs:
        _add(t, GraphKeys.LOCAL_CONCAT_OBJECTS)


def _graph_tensor(t):
    return isinstance(t, tf.Tensor) and not tf.executing_eagerly() and hasattr(t, "graph") \
        and not getattr(t.graph, "building_function", False)


def _add(t, key):
    if t not in t.graph.get_collection(key):
        t.graph.add_to_collection(key, t)
        epl_graph = ir.Graph.get(t.graph)
        epl_graph.pending = epl_graph.pending or epl_graph.rewritten


def total_loss_hook(self, *args, **kwargs):
    total_loss = original("keras.total_loss")(self, *args, **kwargs)
    loss_built(total_loss)
    return total_loss


def metric_call_hook(self, *args, **kwargs):
    result = original("keras.metric_call")(self, *args, **kwargs)
    metric_called(self, result)
    return result


def predict_function_hook(self, *args, **kwargs):
    out = original("keras.predict_function")(self, *args, **kwargs)
    predict_function_made(self)
    return out
