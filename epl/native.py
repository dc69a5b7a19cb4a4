"""The one place that loads EPL's C++ op library (csrc/ -> epl/lib/libepl_ops.so)."""
import os

_LIB = os.path.join(os.path.dirname(os.path.abspath(__file__)), "lib", "libepl_ops.so")
_module = None


def ops():
    """The loaded op module; raises with the fix when the library is missing."""
    global _module
    if _module is None:
        import tensorflow as tf
        if not os.path.exists(_LIB):
            raise RuntimeError("EPL's C++ op library %s is missing; build it with `make setup` "
                               "(or `make ops`)." % _LIB)
        _module = tf.load_op_library(_LIB)
    return _module


def available():
    return os.path.exists(_LIB)


def backends():
    import tensorflow as tf
    with tf.Graph().as_default(), tf.compat.v1.Session() as sess:
        return sess.run(ops().epl_build_info()).decode().split(",")
