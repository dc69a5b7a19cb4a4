"""The graph-mode tf.keras backend's record of the variables it initializes.

tf.keras in graph mode (``model.fit`` / ``evaluate`` / ``predict`` of a TF1 program)
never runs the global variables initializer: its session initializes the variables
its backend *tracks* (``backend.track_variable``; layers and optimizers track theirs).
A variable EPL makes on the user's behalf (the AMP loss scale, run accumulators) must be
tracked by that same backend.  Which module it is differs between the lines: TensorFlow
1.15's ``tensorflow.python.keras.backend``; on 2.x with ``TF_USE_LEGACY_KERAS=1`` the
``tf_keras`` package's (TensorFlow 2.x still ships an older in-tree copy under
``tensorflow.python.keras`` whose registry tf.keras never reads).
"""
import sys

from epl.tf_adapter.version import IS_TF2

_BACKEND = "tf_keras.src.backend" if IS_TF2 else "tensorflow.python.keras.backend"


def track_variable(variable):
    """tf.keras's session initializes ``variable`` with the model's variables when it
    runs a graph holding it.  Returns False, tracking nothing, when this line's
    graph-mode keras is not loaded (a program without tf.keras has no keras session;
    ``import tensorflow`` loads it on 1.15, and on 2.x with ``TF_USE_LEGACY_KERAS=1``)."""
    backend = sys.modules.get(_BACKEND)
    if backend is None:
        return False
    backend.track_variable(variable)
    return True
