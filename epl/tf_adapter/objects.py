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


# -- Estimator -------------------------------------------------------------------------

def training_executor_parts(executor):
    """(estimator, train_spec, train hooks) of ``tf.estimator.train_and_evaluate``'s
    executor."""
    return executor._estimator, executor._train_spec, list(executor._train_hooks)  # pylint: disable=protected-access
