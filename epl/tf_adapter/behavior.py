"""TensorFlow's process-wide behaviour switches, read in one process and set in another.

TensorFlow 2.x starts every process eager, with resource variables, control flow v2,
v2 ``TensorShape`` (``shape[i]`` an int, not a ``Dimension``) and tensor equality; a
TF1 program switches them off (``tf.compat.v1.disable_v2_behavior()``, or only some of
them) before it builds anything.  A process EPL starts on its own (the strategy
search's dry runs, started with ``multiprocessing``'s spawn: a fresh interpreter) does
not inherit those switches, so it would build the user's model eagerly, or with other
variables and shapes, than the program that started it.  ``current()`` reads the
switches (a picklable dict); ``restore()`` sets them, before anything is built.  On
TensorFlow 1.15 the same calls exist and the defaults are already the TF1 ones.
"""


def current():
    """The calling process's switches, as a dict of booleans (picklable)."""
    import tensorflow as tf
    from tensorflow.python import tf2
    from tensorflow.python.eager import context
    v1 = tf.compat.v1
    return {
        "v2_behavior": bool(tf2.enabled()),
        # The process's mode, not the innermost context's (a graph's as_default()
        # makes executing_eagerly() False even in an eager process).
        "eager": context.default_execution_mode == context.EAGER_MODE,
        "resource_variables": bool(v1.resource_variables_enabled()),
        "control_flow_v2": bool(v1.control_flow_v2_enabled()),
        "tensorshape_v2": isinstance(tf.TensorShape([1])[0], int),
        "tensor_equality": bool(tf.Tensor._USE_EQUALITY),  # pylint: disable=protected-access
    }


def restore(switches):
    """Set the switches ``current()`` read in another process.  Call it before the
    process builds a graph or runs an op (eager execution cannot change after)."""
    import tensorflow as tf
    from tensorflow.python.util import deprecation
    v1 = tf.compat.v1
    if current() == switches:
        return          # TF 1.15's fresh process under a TF1 program: nothing to set
    # These calls repeat the user's own choices: TensorFlow's deprecation notices
    # (TF 1.15's disable_v2_behavior() says disable_resource_variables is) are theirs,
    # already shown in their process, not EPL's to print again.
    with deprecation.silence():
        _set(v1, switches)


def _set(v1, switches):
    """TensorFlow's own bundle first (it also picks tf.data's v1 / v2 symbols), then
    each switch a program may have set apart from it."""
    if switches["v2_behavior"]:
        v1.enable_v2_behavior()
    else:
        v1.disable_v2_behavior()
    toggles = [
        ("eager", v1.enable_eager_execution, v1.disable_eager_execution),
        ("resource_variables", v1.enable_resource_variables, v1.disable_resource_variables),
        ("control_flow_v2", v1.enable_control_flow_v2, v1.disable_control_flow_v2),
        ("tensorshape_v2", v1.enable_v2_tensorshape, v1.disable_v2_tensorshape),
        ("tensor_equality", v1.enable_tensor_equality, v1.disable_tensor_equality),
    ]
    now = current()
    for name, enable, disable in toggles:
        if now[name] != switches[name]:
            (enable if switches[name] else disable)()
