"""EPL's own variables in the user's graph (run accumulators, the AMP loss scale).

They are initialized with the global variables (the user's
``global_variables_initializer`` covers them, and tf.keras, which initializes the
variables it tracks, tracks them) but are not part of the model: a
default ``tf.train.Saver`` leaves them out (``epl.capture.savers``), so checkpoints
interchange with the same program trained without the feature.
"""
import tensorflow as tf

from epl.tf_adapter import graph as tfg
from epl.tf_adapter import keras_state

COLLECTION = "epl_internal_state"


def variable(name, initial, dtype=None):
    """A resource variable of EPL's.  ``initial``: a callable building the initial
    value; neither waits for the user's control dependencies (optimizers are often
    built under the gradients')."""
    with tf.control_dependencies(None):
        v = tf.compat.v1.Variable(initial(), trainable=False, name=name, use_resource=True,
                                  dtype=dtype,
                                  collections=[tf.compat.v1.GraphKeys.GLOBAL_VARIABLES,
                                               COLLECTION])
    # tf.keras initializes only the variables it tracks (model.fit never runs the global
    # initializer).
    keras_state.track_variable(v)
    return v


def saveable_default(graph):
    """What a default ``tf.train.Saver`` saves: every saveable but EPL's own state."""
    mine = set(id(v) for v in graph.get_collection(COLLECTION))
    return [v for v in tfg.all_saveable_objects() if id(v) not in mine]


def reinitialize_on_restore(saver, graph):
    """A default Saver's restore also starts EPL's own state again (its initial values):
    the checkpoint does not hold it, and a session restored from a checkpoint
    (MonitoredTrainingSession, Estimator, a job epl-launch restarted) runs no
    initializer, so TensorFlow's session manager would refuse the model ("Variables not
    initialized: EPL_AMP/loss_scale")."""
    saver_def = getattr(saver, "saver_def", None)
    mine = graph.get_collection(COLLECTION)
    if not mine or saver_def is None or not saver_def.restore_op_name:
        return
    restore = graph.get_operation_by_name(saver_def.restore_op_name)
    tfg.add_control_inputs(restore, [v.initializer for v in mine])
