"""The capture's patch list: which TensorFlow entry point each capture hook replaces,
and :func:`install` / :func:`uninstall`.

Each hook replaces one point of the adapter's patch table (``epl.tf_adapter.patching``;
the ``CAPTURE`` list below, installed by :func:`install`, idempotent).  The hooks live
in the module of their job, which documents its points in full; the run-time hooks
(Session, finalize, Saver.save, summaries, Estimator) are in
``epl.runtime.integration``, the lazy-wrapper graph hooks in ``epl.tf_adapter.deferred``,
the thread's capture flags in ``epl.ir.capture_context``.  The points, numbered as
before the split (5-9, 11, 12 and 16 are partly or wholly those other modules'):

1. ``ops.Graph._create_op_helper``: every new op recorded in the IR with its TaskGraph,
   phase and shard (``epl.capture.ops``).
2. ``gradients_util._maybe_colocate_with``: the forward op whose backward ops are being
   made (``epl.capture.backward``).
3. ``gradients_util._GradientsHelper``, ``backprop.GradientTape.gradient``,
   ``_push_tape`` / ``_pop_tape``: a user's backward pass, recorded and run through the
   backward-pass hooks (``epl.capture.backward``, ``epl.capture.backward_hooks``).
4. ``Optimizer.apply_gradients`` / ``__init__`` and keras ``OptimizerV2``'s: a user's
   update, recorded and run through the apply-path hooks (``epl.capture.apply``,
   ``epl.capture.apply_hooks``).
5. ``saver.Saver.build``: the save phase; a default Saver leaves EPL's own state out
   (``epl.capture.savers``).  ``Saver.save``: the runtime's.
6.-9. ``Graph.finalize``, ``BaseSession.__init__`` / ``run`` / ``make_callable``,
   ``FileWriter.add_event``: the runtime's (``epl.runtime.integration``).
10. ``readers.{TFRecord,TextLine,FixedLengthRecord}DatasetV2.__init__``: with
    ``io.slicing`` each worker reads its share of the files (``epl.capture.readers``).
11.-12. ``WorkerSessionCreator.create_session``, ``estimator.RunConfig.__init__``,
    ``_TrainingExecutor.run_local``: the runtime's (``epl.runtime.integration``).
13. ``keras.layers.Dense.build`` / ``call``: sharded under ``epl.split``; Dense
    observers (``epl.capture.tensor_parallel_routing``).
14. ``sparse_softmax_cross_entropy_with_logits``, ``argmax``, ``einsum``,
    ``VariableScope.get_variable``, ``embedding_lookup``: routed to
    ``epl.tensor_parallel`` under ``epl.split`` (``epl.capture.tensor_parallel_routing``).
15. ``ops.Graph._create_op_internal``: fixed-batch inputs entering a scope that runs on
    another number of rows are relaxed (``epl.capture.ops``, ``epl.capture.rebatch``).
16. ``Graph._get_operation_by_name_unsafe`` and the other graph lookups: the replicas'
    copies get their Python ``Operation`` on first use (``epl.tf_adapter.deferred``).
17. tf.keras ``Model._prepare_total_loss``, ``Metric.__call__``,
    ``Model._make_predict_function``: what keras reports is the global batch's
    (``epl.capture.keras_reports``).

Everything else reads and edits graphs through :mod:`epl.ir` and the rewriter.
"""
from epl.capture import apply, backward, keras_reports, ops, readers, savers
from epl.capture import tensor_parallel_routing as routing
from epl.ir.capture_context import rewriting
from epl.tf_adapter import deferred, patching

# point (epl.tf_adapter.patching) -> the capture hook that replaces it.  Points a
# TensorFlow line lacks (another Keras, no Estimator) are skipped.
CAPTURE = [
    ("graph.create_op_helper", ops.create_op_helper),
    ("graph.create_op_internal", ops.create_op_internal),
    ("gradients.colocate", backward.maybe_colocate_with),
    ("gradients.helper", backward.gradients_helper),
    ("tape.gradient", backward.tape_gradient),
    ("tape.push", backward.tape_push),
    ("tape.pop", backward.tape_pop),
    ("optimizer.apply_gradients", apply.apply_gradients),
    ("optimizer.init", apply.optimizer_init),
    ("keras_optimizer.apply_gradients", apply.apply_gradients_v2),
    ("keras_optimizer.init", apply.optimizer_v2_init),
    ("saver.build", savers.saver_build),
    ("readers.tfrecord", readers.reader_init("readers.tfrecord")),
    ("readers.textline", readers.reader_init("readers.textline")),
    ("readers.fixed_length", readers.reader_init("readers.fixed_length")),
    ("keras.total_loss", keras_reports.total_loss_hook),
    ("keras.metric_call", keras_reports.metric_call_hook),
    ("keras.predict_function", keras_reports.predict_function_hook),
    ("keras.dense_build", routing.dense_build),
    ("keras.dense_call", routing.dense_call),
    ("variable_scope.get_variable", routing.scope_get_variable),
    ("nn.sparse_softmax_cross_entropy", routing.sparse_softmax_cross_entropy),
    ("math.argmax", routing.argmax),
    ("math.einsum", routing.einsum),
    ("nn.embedding_lookup", routing.embedding_lookup),
]

_installed = []


def install():
    """Install the capture hooks and the lazy-wrapper hooks (idempotent)."""
    if _installed:
        return
    deferred.set_wrap_context(rewriting)
    deferred.install_hooks()
    patching.keep_autograph_out("epl")
    for point, hook in CAPTURE:
        patching.install(point, hook)
    _installed.append(True)


def uninstall():
    """Put every patched TensorFlow point back (the runtime integrations' too)."""
    patching.uninstall_all()
    del _installed[:]
