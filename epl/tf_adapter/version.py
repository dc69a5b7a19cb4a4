"""Which TensorFlow line is installed: the one fact every other adapter module branches on.

EPL runs TF1 programs on two lines from one code base: TensorFlow 1.15 and TensorFlow 2.x
through ``tf.compat.v1``.  Only the adapter (``epl.tf_adapter``) may look at the version;
the rest of EPL asks the adapter for what it needs instead.
"""
import tensorflow as _tf

VERSION = tuple(int(p) for p in _tf.__version__.split("-")[0].split(".")[:2])
IS_TF2 = VERSION[0] >= 2


def describe():
    """One line for logs and ``python -m epl.native``."""
    return "TensorFlow %s (%s line)" % (_tf.__version__, "2.x" if IS_TF2 else "1.15")
