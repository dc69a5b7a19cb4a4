"""Private state of TensorFlow objects EPL's hooks must read or set: a GradientTape's
recording state, a Saver's variable list, an Estimator training executor's parts.

Kept apart from ``graph`` (graph surgery): these are the internals of single objects,
and each differs between TensorFlow lines on its own schedule.
"""


# -- GradientTape ----------------------------------------------------------------------

def tape_live(tape):
    """The tape still holds its recording (a non-persistent tape drops it once asked)."""
    return tape._tape is not None  # pylint: disable=protected-access


def tape_persistent(tape):
    return tape._persistent  # pylint: disable=protected-access


def tape_stop_recording_now(tape):
    """A recording, non-persistent tape stops recording (as its ``gradient`` does)."""
    if tape._recording and not tape._persistent:  # pylint: disable=protected-access
        tape._pop_tape()  # pylint: disable=protected-access


def tape_release(tape):
    """A non-persistent tape forgets its recording after its one ``gradient``."""
    if not tape._persistent:  # pylint: disable=protected-access
        tape._tape = None  # pylint: disable=protected-access


# -- Saver -----------------------------------------------------------------------------

def saver_default_var_list(saver):
    """The Saver was made without a var_list and has not built its ops yet."""
    return saver._var_list is None and not saver._is_built  # pylint: disable=protected-access


def set_saver_var_list(saver, var_list):
    saver._var_list = var_list  # pylint: disable=protected-access


def saver_step_prefix(saver, save_path, step):
    """The prefix ``Saver.save(sess, save_path, global_step=step)`` writes (an integer
    step, or None), or None where the Saver does not write V2 checkpoints (an index and
    data files) or has nothing to save."""
    from tensorflow.core.protobuf import saver_pb2
    if saver._is_empty or saver.saver_def is None \
            or saver.saver_def.version != saver_pb2.SaverDef.V2:  # pylint: disable=protected-access
        return None
    if step is None:
        return save_path
    if saver._pad_step_number:  # pylint: disable=protected-access
        return "%s-%08d" % (save_path, step)
    return "%s-%d" % (save_path, step)


def saver_record(saver, prefix, latest_filename, meta_graph_suffix):
    """What ``Saver.save`` does once it has written ``prefix`` (``write_state``): the
    Saver's list of its checkpoints, the folder's ``checkpoint`` file, and the deletion
    of those beyond ``max_to_keep``."""
    import os
    from tensorflow.python.training import checkpoint_management
    saver._RecordLastCheckpoint(prefix)  # pylint: disable=protected-access
    checkpoint_management.update_checkpoint_state_internal(
        save_dir=os.path.dirname(prefix), model_checkpoint_path=prefix,
        all_model_checkpoint_paths=saver.last_checkpoints,
        latest_filename=latest_filename,
        save_relative_paths=saver._save_relative_paths)  # pylint: disable=protected-access
    saver._MaybeDeleteOldCheckpoints(meta_graph_suffix=meta_graph_suffix)  # pylint: disable=protected-access


# -- Estimator -------------------------------------------------------------------------

def training_executor_parts(executor):
    """(estimator, train_spec, train hooks) of ``tf.estimator.train_and_evaluate``'s
    executor."""
    return executor._estimator, executor._train_spec, list(executor._train_hooks)  # pylint: disable=protected-access
