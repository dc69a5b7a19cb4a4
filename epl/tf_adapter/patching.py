"""The patch table: every TensorFlow function or method EPL replaces, by a name of ours.

EPL learns what the user builds by wrapping a few TensorFlow entry points (op creation,
tf.gradients, apply_gradients, Session.run...).  Which module and attribute implement
each one differs between TensorFlow lines (``Graph._get_operation_by_name_unsafe`` in
1.15 is ``_get_operation_by_name`` in 2.x; Keras lives in ``tensorflow.python.keras``
or in ``tf_keras``), so the capture code names a *point* and this module finds it.

    patching.install("session.run", my_run)      # my_run(self, *args, **kwargs)
    patching.original("session.run")(sess, ...)  # TensorFlow's own
    patching.uninstall_all()

A point whose owner is not installed (the Estimator package on TF >= 2.16) is
unavailable: ``install`` returns False and nothing is patched.  Functions that
TensorFlow re-exports under many names (``tf.nn.sparse_softmax_cross_entropy_with_logits``
is the same function in a dozen modules) are replaced in every module that exports it.

A point that TensorFlow wraps in its deprecation notice (every Estimator class on 2.15)
keeps the notice where the user calls it: the wrapper stays in place and calls EPL's
replacement, and ``original`` is the unwrapped function, so EPL's own call to it adds
no deprecation warning pointing into EPL.
"""
import functools
import importlib
import sys

from tensorflow.python.autograph.core import config as autograph_config

from epl.tf_adapter.version import IS_TF2

_GRAPH = ("tensorflow.python.framework.ops", "Graph")
_OP_BY_NAME = "_get_operation_by_name" if IS_TF2 else "_get_operation_by_name_unsafe"
_KERAS = "tf_keras.src" if IS_TF2 else "tensorflow.python.keras"

# point -> (module, class or None, attribute); module-level functions have no class.
POINTS = {
    # op creation and lookup
    "graph.create_op_helper": _GRAPH + ("_create_op_helper",),
    "graph.create_op_internal": _GRAPH + ("_create_op_internal",),
    "graph.op_by_name": _GRAPH + (_OP_BY_NAME,),
    "graph.as_graph_element_locked": _GRAPH + ("_as_graph_element_locked",),
    "graph.get_operations": _GRAPH + ("get_operations",),
    "graph.add_new_tf_operations": _GRAPH + ("_add_new_tf_operations",),
    "graph.as_graph_def": _GRAPH + ("_as_graph_def",),
    "graph.finalize": _GRAPH + ("finalize",),
    # backward pass
    "gradients.colocate": ("tensorflow.python.ops.gradients_util", None, "_maybe_colocate_with"),
    "gradients.helper": ("tensorflow.python.ops.gradients_util", None, "_GradientsHelper"),
    "tape.gradient": ("tensorflow.python.eager.backprop", "GradientTape", "gradient"),
    "tape.push": ("tensorflow.python.eager.backprop", "GradientTape", "_push_tape"),
    "tape.pop": ("tensorflow.python.eager.backprop", "GradientTape", "_pop_tape"),
    # optimizers
    "optimizer.apply_gradients": ("tensorflow.python.training.optimizer", "Optimizer",
                                  "apply_gradients"),
    "optimizer.init": ("tensorflow.python.training.optimizer", "Optimizer", "__init__"),
    "keras_optimizer.apply_gradients": (_KERAS + ".optimizers.legacy.optimizer_v2"
                                        if IS_TF2 else _KERAS + ".optimizer_v2.optimizer_v2",
                                        "OptimizerV2", "apply_gradients"),
    "keras_optimizer.init": (_KERAS + ".optimizers.legacy.optimizer_v2"
                             if IS_TF2 else _KERAS + ".optimizer_v2.optimizer_v2",
                             "OptimizerV2", "__init__"),
    # what tf.keras reports (the global batch's loss, metrics, predictions)
    "keras.total_loss": (_KERAS + (".engine.training_v1" if IS_TF2 else ".engine.training"),
                         "Model", "_prepare_total_loss"),
    "keras.predict_function": (_KERAS + (".engine.training_v1" if IS_TF2
                                         else ".engine.training"),
                               "Model", "_make_predict_function"),
    "keras.metric_call": (_KERAS + (".metrics.base_metric" if IS_TF2 else ".metrics"),
                          "Metric", "__call__"),
    # layers and ops routed to tensor parallelism
    "keras.dense_build": (_KERAS + ".layers.core.dense" if IS_TF2 else _KERAS + ".layers.core",
                          "Dense", "build"),
    "keras.dense_call": (_KERAS + ".layers.core.dense" if IS_TF2 else _KERAS + ".layers.core",
                         "Dense", "call"),
    "variable_scope.get_variable": ("tensorflow.python.ops.variable_scope", "VariableScope",
                                    "get_variable"),
    # checkpoints, summaries, sessions
    "saver.build": ("tensorflow.python.training.saver", "Saver", "build"),
    "saver.save": ("tensorflow.python.training.saver", "Saver", "save"),
    "saver.restore": ("tensorflow.python.training.saver", "Saver", "restore"),
    "meta_graph.export": ("tensorflow.python.framework.meta_graph", None,
                          "export_scoped_meta_graph"),
    "summary.add_event": ("tensorflow.python.summary.writer.writer", "FileWriter", "add_event"),
    # (add_summary, add_graph, add_session_log: they do not go through add_event)
    "summary.add_event_at_step": ("tensorflow.python.summary.writer.writer", "FileWriter",
                                  "_add_event"),
    "monitored.worker_session": ("tensorflow.python.training.monitored_session",
                                 "WorkerSessionCreator", "create_session"),
    "session.init": ("tensorflow.python.client.session", "BaseSession", "__init__"),
    "session.run": ("tensorflow.python.client.session", "BaseSession", "run"),
    "session.make_callable": ("tensorflow.python.client.session", "BaseSession",
                              "make_callable"),
    "session.make_callable_from_options": ("tensorflow.python.client.session", "BaseSession",
                                           "_make_callable_from_options"),
    # input readers
    "readers.tfrecord": ("tensorflow.python.data.ops.readers", "TFRecordDatasetV2", "__init__"),
    "readers.textline": ("tensorflow.python.data.ops.readers", "TextLineDatasetV2", "__init__"),
    "readers.fixed_length": ("tensorflow.python.data.ops.readers", "FixedLengthRecordDatasetV2",
                             "__init__"),
    # Estimator (absent from TF 2.16 on)
    "estimator.run_config_init": ("tensorflow_estimator.python.estimator.run_config",
                                  "RunConfig", "__init__"),
    "estimator.run_local": ("tensorflow_estimator.python.estimator.training",
                            "_TrainingExecutor", "run_local"),
}

# point -> (module, function): replaced in every TensorFlow module that exports it.
FUNCTIONS = {
    "nn.sparse_softmax_cross_entropy": ("tensorflow.python.ops.nn_ops",
                                        "sparse_softmax_cross_entropy_with_logits"),
    "math.argmax": ("tensorflow.python.ops.math_ops", "argmax"),
    "math.einsum": ("tensorflow.python.ops.special_math_ops", "einsum"),
    "nn.embedding_lookup": ("tensorflow.python.ops.embedding_ops", "embedding_lookup"),
}

_originals = {}     # point -> TensorFlow's own
_installed = []     # (point, owner, attribute)
_rebound = []       # (module, attribute, original)
_redirected = []    # (point, closure cell of a deprecation wrapper, the function it called)


def _deprecation_cell(function):
    """The closure cell through which TensorFlow's deprecation wrapper ``function``
    calls the deprecated function, or None when ``function`` is not such a wrapper
    (``deprecation.deprecated``: ``new_func`` logs the notice with its caller's file
    and line, then calls ``func``)."""
    decorator = getattr(function, "_tf_decorator", None)
    if getattr(decorator, "decorator_name", None) != "deprecated":
        return None
    code = getattr(function, "__code__", None)
    closure = getattr(function, "__closure__", None)
    if code is None or not closure or "func" not in code.co_freevars:
        return None
    cell = closure[code.co_freevars.index("func")]
    return cell if callable(cell.cell_contents) else None


def _owner(point):
    module_name, cls, attr = POINTS[point]
    try:
        module = importlib.import_module(module_name)
    except ImportError:
        return None, attr
    owner = getattr(module, cls, None) if cls else module
    if owner is None or not hasattr(owner, attr):
        return None, attr
    return owner, attr


def available(point):
    """The point exists in the installed TensorFlow (and its optional packages)."""
    if point in FUNCTIONS:
        return True
    return _owner(point)[0] is not None


def install(point, replacement):
    """Replace ``point`` by ``replacement``; False when the point is unavailable.
    Installing an installed point again does nothing."""
    if point in _originals:
        return True
    if point in FUNCTIONS:
        module_name, name = FUNCTIONS[point]
        original = getattr(importlib.import_module(module_name), name)
        _originals[point] = original
        for mod_name, module in list(sys.modules.items()):
            if module is None or not mod_name.startswith(("tensorflow", "tensorflow_core",
                                                          "tf_keras")):
                continue
            for attr, value in list(vars(module).items()):
                if value is original:
                    setattr(module, attr, replacement)
                    _rebound.append((module, attr, original))
        return True
    owner, attr = _owner(point)
    if owner is None:
        return False
    current = getattr(owner, attr)
    cell = _deprecation_cell(current)
    if cell is not None:
        # The notice names the deprecated function and the user's line; it calls
        # EPL's replacement, under the deprecated function's name.
        deprecated = cell.cell_contents
        _originals[point] = deprecated

        @functools.wraps(deprecated)
        def redirect(*args, **kwargs):
            return replacement(*args, **kwargs)
        cell.cell_contents = redirect
        _redirected.append((point, cell, deprecated))
        return True
    _originals[point] = current
    setattr(owner, attr, replacement)
    _installed.append((point, owner, attr))
    return True


def original(point):
    """TensorFlow's own implementation of an installed point."""
    return _originals[point]


def installed():
    return bool(_originals)


def uninstall(point):
    """Put one patched method or attribute point back (nothing when it is not installed).
    Functions re-exported under many names (``FUNCTIONS``) go back with
    ``uninstall_all`` only."""
    if point in FUNCTIONS:
        raise ValueError("%s: a re-exported function is put back by uninstall_all()" % point)
    for i, (name, owner, attr) in enumerate(_installed):
        if name == point:
            setattr(owner, attr, _originals.pop(point))
            del _installed[i]
            return
    for i, (name, cell, deprecated) in enumerate(_redirected):
        if name == point:
            cell.cell_contents = deprecated
            del _originals[point]
            del _redirected[i]
            return


def uninstall_all():
    """Put every patched point back."""
    while _installed:
        point, owner, attr = _installed.pop()
        setattr(owner, attr, _originals.pop(point))
    while _rebound:
        module, attr, value = _rebound.pop()
        setattr(module, attr, value)
    while _redirected:
        _, cell, deprecated = _redirected.pop()
        cell.cell_contents = deprecated
    _originals.clear()


def keep_autograph_out(package):
    """Put ``package`` on autograph's do-not-convert list (idempotent).

    Autograph converts a Keras layer's ``call`` and, recursively, every Python function
    that converted code calls and whose module is not on that list.  EPL's patched entry
    points (``tf.einsum``, ``Dense.call``, ``get_variable``...) are such functions: a
    user's layer calling ``tf.einsum`` had EPL's capture code rewritten by autograph,
    which broke it (measured: ``ir.Graph.get(...).sharded.get(t)`` failed inside a
    converted MoE layer with "tf__get() takes from 0 to 1 positional arguments but 2
    were given", depending on what ran before).  EPL's code is graph-building code: it
    must run as written."""
    rules = tuple(autograph_config.CONVERSION_RULES)
    if any(isinstance(r, autograph_config.DoNotConvert) and r.matches(package)
           and r.matches(package + ".x") for r in rules):
        return
    autograph_config.CONVERSION_RULES = (autograph_config.DoNotConvert(package),) + rules
