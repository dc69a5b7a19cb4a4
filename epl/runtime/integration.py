"""Session, Estimator, checkpoint and summary integration: where EPL meets the user's
own training loop at run time.

* The first ``Session.run`` / ``make_callable`` of a graph (and ``Graph.finalize``, which
  MonitoredTrainingSession and the Estimator call) rewrites it (``epl.rewrite``);
  fetches of merged tensors are mapped (``epl.runtime``); the first run also fetches
  the gradient-checkpoint checks.
* A session of a job whose model spans workers runs on the chief's TF server; the other
  workers serve (``epl.runtime.distributed``).
* Only the chief writes checkpoints and summaries; every worker creates its session as
  a chief would (EPL trains between-graph); an Estimator's distribution settings and
  TF_CONFIG are EPL's, not the RunConfig's, and only the chief evaluates.
* The chief writes a checkpoint that exists already beside it and renames it into place
  (``_replace_checkpoint``); a worker of a multi-worker job retries a restore that reads
  a cut checkpoint (``RESTORE_RETRY_S``).

Installed by ``epl.init`` through the adapter's patch table, above the capture hooks.
"""
import logging
import numbers
import os
import time

import tensorflow as tf

from epl import ir, rewrite
from epl.runtime import distributed
from epl.features import gradient_checkpoint
from epl.runtime import progress
from epl.runtime import session_run
from epl.capture import ops as capture_ops
from epl.core.process_state import Env
from epl.profile import record as profile_record
from epl.tf_adapter import objects, patching

log = logging.getLogger("epl")
original = patching.original


def _saver_save(self, sess, save_path, global_step=None, latest_filename=None,
                meta_graph_suffix="meta", write_meta_graph=True, write_state=True,
                *args, **kwargs):
    """Saver.save on the chief only; a checkpoint that exists already is replaced whole
    (``_replace_checkpoint``)."""
    if Env.initialized() and not Env.get().cluster.is_chief:
        return None  # only the chief writes checkpoints
    save = original("saver.save")
    step = global_step
    if step is not None and not isinstance(step, numbers.Integral):
        step = int(tf.compat.v1.train.global_step(sess, step))
    prefix = objects.saver_step_prefix(self, save_path, step)
    if prefix is None or not tf.io.gfile.exists(prefix + ".index"):
        return save(self, sess, save_path, step, latest_filename, meta_graph_suffix,
                    write_meta_graph, write_state, *args, **kwargs)
    return _replace_checkpoint(self, sess, prefix, latest_filename, meta_graph_suffix,
                               write_meta_graph, write_state, *args, **kwargs)


# The temporary prefix a checkpoint that exists already is written to, in its folder
# (``_replace_checkpoint``): <folder>/<RESAVE_TAG><pid>-<its name>
RESAVE_TAG = ".epl-resave-"


def _replace_checkpoint(saver, sess, prefix, latest_filename, meta_graph_suffix,
                        write_meta_graph, write_state, *args, **kwargs):
    """Writes the checkpoint ``prefix``, which exists already, beside it and renames its
    files over the old ones, the index last.  Why: TensorFlow writes ``<prefix>.index``
    in place, so a worker restoring it meanwhile reads a cut file, and a chief killed
    meanwhile leaves the newest checkpoint cut (the ``checkpoint`` file already names
    it), which the next restart cannot restore.  After a restart the chief's
    CheckpointSaverHook saves the step it has just restored again: that is this case.
    Each rename replaces a whole file, and a reader that has opened the old one keeps
    reading it."""
    folder, name = os.path.split(prefix)
    for stale in tf.io.gfile.glob(os.path.join(folder, RESAVE_TAG + "*-" + name + ".*")):
        tf.io.gfile.remove(stale)           # left by a chief killed while writing here
    temp = os.path.join(folder, "%s%d-%s" % (RESAVE_TAG, os.getpid(), name))
    written = original("saver.save")(saver, sess, temp, None, latest_filename,
                                     meta_graph_suffix, write_meta_graph, False,
                                     *args, **kwargs)
    if written is None:
        return None
    files = tf.io.gfile.glob(temp + ".*")
    for path in sorted(files, key=lambda p: p.endswith(".index")):      # the index last
        tf.io.gfile.rename(path, prefix + path[len(temp):], overwrite=True)
    if write_state:
        objects.saver_record(saver, prefix, latest_filename, meta_graph_suffix)
    return prefix


# A worker restoring a checkpoint that the chief rewrites at that moment can read a cut
# index: TensorFlow's MergeV2Checkpoints writes ``<prefix>.index`` at its final path (a
# re-save leaves a new file there, TF 1.15 and 2.x), and after a restart the chief's
# CheckpointSaverHook saves the step it has just restored again, while the other workers
# restore it.  EPL's chief now replaces such a checkpoint whole (``_replace_checkpoint``);
# a restore is still retried for this long (seconds), for a checkpoint written by other
# means (another program, a chief without EPL) and a data file replaced between a
# reader's index and its data.
RESTORE_RETRY_S = 20.0


def _saver_restore(self, sess, save_path):
    """Saver.restore, retried on a cut or mismatched checkpoint while another worker of a
    multi-worker job may be writing it; a checkpoint that stays unreadable is named."""
    restore = original("saver.restore")
    if not (Env.initialized() and Env.get().cluster.worker_num > 1):
        return restore(self, sess, save_path)
    deadline = time.monotonic() + RESTORE_RETRY_S
    wait = 0.05
    while True:
        try:
            return restore(self, sess, save_path)
        except tf.errors.DataLossError as err:
            if time.monotonic() + wait > deadline:
                raise tf.errors.DataLossError(
                    err.node_def, err.op,
                    "EPL: the checkpoint %s stayed unreadable for %.0f s (%s). Another "
                    "worker may have been killed while writing it: restore an earlier one "
                    "(tf.train.get_checkpoint_state(folder).all_model_checkpoint_paths) or "
                    "remove it and its entry in the folder's `checkpoint` file."
                    % (save_path, RESTORE_RETRY_S, err.message.splitlines()[0]))
            log.warning("EPL: checkpoint %s not readable yet (%s): another worker may be "
                        "writing it; retrying in %.2f s", save_path,
                        err.message.splitlines()[0], wait)
            time.sleep(wait)
            wait = min(wait * 2, 1.0)


def _add_event(self, event):
    if Env.initialized() and not Env.get().cluster.is_chief:
        return None  # only the chief writes summaries
    progress.note_writer(self)
    return original("summary.add_event")(self, event)


def _add_event_at_step(self, event, step):
    """FileWriter.add_summary / add_graph / add_session_log (``_add_event``)."""
    if Env.initialized() and not Env.get().cluster.is_chief:
        return None  # only the chief writes summaries
    progress.note_writer(self)
    return original("summary.add_event_at_step")(self, event, step)


def _worker_session(self):
    if Env.initialized() and ir.Graph.get().taskgraphs:
        raise RuntimeError(
            "EPL trains between-graph: every worker runs its own local session and initializes "
            "it (initial values come from worker 0). Create MonitoredTrainingSession with "
            "is_chief=True on every worker (the default); EPL still writes checkpoints and "
            "summaries only on the chief. A non-chief session would wait forever.")
    return original("monitored.worker_session")(self)


def _run_config_init(self, *args, **kwargs):
    if Env.initialized():
        for key in ("train_distribute", "eval_distribute", "experimental_distribute"):
            if kwargs.get(key) is not None:
                log.warning(
                    "EPL: RunConfig(%s=%r) is ignored: EPL distributes this Estimator "
                    "(epl.replicate / epl.split annotations).", key, kwargs[key])
                kwargs[key] = None
    saved = os.environ.get("TF_CONFIG")
    hide = Env.initialized() and Env.get().cluster.distributed and saved is not None
    if hide:
        del os.environ["TF_CONFIG"]
    try:
        return original("estimator.run_config_init")(self, *args, **kwargs)
    finally:
        if hide:
            os.environ["TF_CONFIG"] = saved


def _train_and_evaluate_locally(self):
    if Env.initialized() and not Env.get().cluster.is_chief:
        log.info(
            "EPL: worker %d trains; the chief evaluates the checkpoints it writes.",
            Env.get().cluster.worker_index)
        estimator, train_spec, train_hooks = objects.training_executor_parts(self)
        estimator.train(input_fn=train_spec.input_fn, max_steps=train_spec.max_steps,
                        hooks=list(train_spec.hooks) + train_hooks)
        return None, []
    return original("estimator.run_local")(self)


def _finalize(self):
    rewrite.rewrite_if_needed(self)
    return original("graph.finalize")(self)


def _session_init(self, target="", graph=None, config=None):
    config = session_run.session_config(config)
    if not target and distributed.needed(graph or tf.compat.v1.get_default_graph()):
        if not Env.get().cluster.is_chief:
            distributed.serve_until_chief_exits()
        target = distributed.server().target
    return original("session.init")(self, target, graph, config)


def _session_run(self, fetches, feed_dict=None, options=None, run_metadata=None):
    session_run.before_run(self)
    traced = profile_record.start(self.graph, options, run_metadata, self, fetches)
    if traced is None:
        return _run(self, fetches, feed_dict, options, run_metadata)
    ok = False
    try:
        out = _run(self, fetches, feed_dict, traced.options, traced.metadata)
        ok = True
        return out
    finally:
        profile_record.finish(traced, ok)


def _run(self, fetches, feed_dict, options, run_metadata):
    given = fetches
    fetches = session_run.map_fetches(self.graph, fetches)
    when, checks = gradient_checkpoint.pending_checks(self, fetches)
    if when == "before":
        gradient_checkpoint.report(original("session.run")(self, checks, feed_dict))
    elif when == "with":
        out, values = original("session.run")(self, (fetches, checks), feed_dict, options,
                                                run_metadata)
        gradient_checkpoint.report(values)
        progress.after_run(self, given, feed_dict, out)
        return out
    out = original("session.run")(self, fetches, feed_dict, options, run_metadata)
    progress.after_run(self, given, feed_dict, out)   # (live progress, TensorBoard)
    return out


def _make_callable(self, fetches, feed_list=None, accept_options=False):
    session_run.before_run(self)
    return original("session.make_callable")(self, session_run.map_fetches(self.graph, fetches), feed_list,
                                       accept_options)


def _make_callable_from_options(self, callable_options):
    """tf.keras runs its train, test and predict functions through callables."""
    session_run.before_run(self)

    def make(options):
        return original("session.make_callable_from_options")(self, options)
    return progress.watch_callable(self, callable_options, profile_record.watch_callable(
        self.graph, session_run.map_callable(self.graph, callable_options), make, self))


# point (epl.tf_adapter.patching) -> the hook that replaces it.
HOOKS = [
    ("graph.finalize", _finalize),
    ("session.init", _session_init),
    ("session.run", _session_run),
    ("session.make_callable", _make_callable),
    ("session.make_callable_from_options", _make_callable_from_options),
    ("saver.save", _saver_save),
    ("saver.restore", _saver_restore),
    ("summary.add_event", _add_event),
    ("summary.add_event_at_step", _add_event_at_step),
    ("monitored.worker_session", _worker_session),
    ("estimator.run_config_init", _run_config_init),
    ("estimator.run_local", _train_and_evaluate_locally),
]


def install():
    """Install the run-time hooks (idempotent; points a TensorFlow line lacks, like the
    Estimator from TF 2.16 on, are skipped), and let the rewrite see ops made after it
    ran."""
    for point, hook in HOOKS:
        patching.install(point, hook)
    if rewrite.on_new_op not in capture_ops.NEW_OP_LISTENERS:
        capture_ops.NEW_OP_LISTENERS.append(rewrite.on_new_op)
