"""Which TensorFlow line is installed: the one fact every other adapter module branches on.

EPL runs TF1 programs on two lines from one code base: TensorFlow 1.15 and TensorFlow 2.x
through ``tf.compat.v1``.  Only the adapter (``epl.tf_adapter``) may look at the version;
the rest of EPL asks the adapter for what it needs instead.
"""
import tensorflow as _tf

VERSION = tuple(int(p) for p in _tf.__version__.split("-")[0].split(".")[:2])
IS_TF2 = VERSION[0] >= 2


def describe():
    """One line for logs and ``python -m epl.communicators.op_library``."""
    return "TensorFlow %s (%s line)" % (_tf.__version__, "2.x" if IS_TF2 else "1.15")


def op_library_name(version=None):
    """The file name of EPL's C++ op library built against TensorFlow ``version``
    (default: the installed one).  A library links against one TensorFlow line's
    framework, so each line has its own file and the two never overwrite each other:
    ``libepl_ops.so`` for 1.15 (the name ``make setup`` and ``pip install .`` have
    always built), ``libepl_ops-tf<major>.<minor>.so`` for 2.x (TF 2.x's C++ ABI
    changes between minor versions)."""
    major, minor = version or VERSION
    return "libepl_ops.so" if major < 2 else "libepl_ops-tf%d.%d.so" % (major, minor)


def compile_flags(version=None):
    """The C++ standard and the preprocessor definitions csrc/ is built with against
    TensorFlow ``version``: C++17 from 2.x on (TF >= 2.10's headers need it), and
    EPL_TF_MAJOR / EPL_TF_MINOR / EPL_TF_VERSION (major * 100 + minor) for the ``#if``
    guards where the lines' headers differ."""
    major, minor = version or VERSION
    flags = ["-std=c++17" if major >= 2 else "-std=c++11",
             "-DEPL_TF_MAJOR=%d" % major, "-DEPL_TF_MINOR=%d" % minor,
             "-DEPL_TF_VERSION=%d" % (major * 100 + minor)]
    if major >= 2:
        # TF 2.x's own headers call its deprecated functions inline (errors::Internal,
        # tsl::Status), and their Eigen reads hardware_destructive_interference_size:
        # hundreds of warnings per build that say nothing about EPL.
        flags += ["-Wno-deprecated-declarations", "-Wno-interference-size"]
    return flags


def onednn_enabled():
    """Whether TensorFlow's CPU kernels are oneDNN's (TF 2.x turns them on by default
    on CPUs with AVX-512 VNNI/BF16 or AMX, ``TF_ENABLE_ONEDNN_OPTS=0|1`` decides
    otherwise; 1.15's pip wheel has none): its convolution gradients allocate no patch
    buffer of TensorFlow's (``epl.auto.liveness.scratch_bytes``)."""
    if not IS_TF2:
        return False
    try:
        from tensorflow.python.util import _pywrap_util_port
        return bool(_pywrap_util_port.IsMklEnabled())
    except (ImportError, AttributeError):
        return False
