"""The one place that loads EPL's C++ op library (csrc/ -> epl/lib/libepl_ops.so on
TensorFlow 1.15, epl/lib/libepl_ops-tf<major>.<minor>.so on 2.x: each line links its own,
named by ``tf_adapter.version.op_library_name``).

`make setup` and `pip install .` build the library.  When a pip install could not (no
TensorFlow importable while it built), the first use builds it from the sources that
travel with the package, into epl/lib if writable, else ~/.cache/epl.  When it cannot be
built either (no C++ compiler), EPL falls back to collectives made of TensorFlow ops, in
one process only, and says so once.

    python -m epl.communicators.op_library            # which library, which backends, why not the others,
                                    # the CPU target it was compiled for
    python -m epl.communicators.op_library --build    # build it now
"""
import fcntl
import json
import os
import subprocess
import sys

# The epl/ package folder: the library lives in epl/lib, a pip build's sources in epl/_csrc.
_HERE = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
_module = None
_missing_reason = None


def _sources():
    """csrc/ of a source checkout, else the copy a pip build put in the package."""
    for d in (os.path.join(os.path.dirname(_HERE), "csrc"), os.path.join(_HERE, "_csrc")):
        if os.path.exists(os.path.join(d, "build.py")):
            return d
    return None


def _lib():
    """epl/lib/<the installed TensorFlow line's library> (TensorFlow is imported only
    when a library is asked for)."""
    from epl.tf_adapter import version  # imports TensorFlow: only when a library is asked for
    return os.path.join(_HERE, "lib", version.op_library_name())


def _cache_lib():
    import tensorflow as tf
    return os.path.join(os.path.expanduser("~"), ".cache", "epl",
                        "libepl_ops-tf%s.so" % tf.__version__)


def library_path():
    """The library that is (or would be) loaded."""
    lib = _lib()
    if os.path.exists(lib):
        return lib
    cached = _cache_lib()
    return cached if os.path.exists(cached) else lib


def build():
    """Builds the library (epl/lib if writable, else ~/.cache/epl); returns its path."""
    src = _sources()
    if src is None:
        raise RuntimeError("EPL's C++ sources are not installed with this package; "
                           "reinstall it with `pip install .` from a checkout.")
    lib = _lib()
    lib_dir = os.path.dirname(lib)
    out = lib if os.access(lib_dir if os.path.isdir(lib_dir) else _HERE, os.W_OK) \
        else _cache_lib()
    os.makedirs(os.path.dirname(out), exist_ok=True)
    with open(out + ".lock", "w") as lock:
        # The workers of a job start together: one builds, the others wait for it.
        fcntl.flock(lock, fcntl.LOCK_EX)
        if os.path.exists(out):
            return out
        print("EPL: building the C++ op library into %s (once; about a minute)..." % out,
              file=sys.stderr, flush=True)
        proc = subprocess.run([sys.executable, os.path.join(src, "build.py"), "--out", out],
                              stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    if proc.returncode != 0:
        raise RuntimeError("building EPL's C++ op library failed:\n%s"
                           % proc.stdout.decode(errors="replace")[-2000:])
    return out


def ops():
    """The loaded op module: builds the library on first use when it is missing; raises
    with the reason and the fix when it cannot."""
    global _module
    if _module is None:
        import tensorflow as tf
        path = library_path()
        if not os.path.exists(path):
            path = build()
        _module = tf.load_op_library(path)
    return _module


def available():
    """True when the library is loaded or can be (building it if needed); else the
    reason is kept for :func:`missing_reason`."""
    global _missing_reason
    if _module is not None:
        return True
    if _missing_reason is not None:
        return False   # (tried already: a failed build is not retried per call)
    try:
        ops()
        return True
    except Exception as e:  # pylint: disable=broad-except
        _missing_reason = str(e).strip().splitlines()[-1] if str(e).strip() else repr(e)
        return False


def missing_reason():
    return _missing_reason


def backends():
    import tensorflow as tf
    with tf.Graph().as_default(), tf.compat.v1.Session() as sess:
        return sess.run(ops().epl_build_info()).decode().split(",")


def report():
    """Lines that say which library is loaded, its backends, and why others are not."""
    path = library_path()
    lines = ["library: %s" % path]
    if not available():
        lines.append("not available: %s" % missing_reason())
        lines.append("collectives: TensorFlow ops in one process (no multi-worker, no shm/tcp)")
        return lines
    lines.append("backends: %s" % ", ".join(backends()))
    info = os.path.splitext(library_path())[0] + ".json"
    if os.path.exists(info):
        with open(info) as f:
            meta = json.load(f)
        if meta.get("skipped"):
            lines.append("nccl not built: %s" % meta["skipped"])
        lines.append("built with TensorFlow %s, %s %s" % (
            meta.get("tensorflow"), meta.get("compiler"), " ".join(meta.get("flags", ()))))
        # The CPU it was compiled for: a portable baseline, so that a library built on a
        # login node runs on older compute nodes (csrc/build.py).
        if meta.get("target"):
            lines.append("target: %s (%s)" % (meta["target"], " ".join(
                meta.get("target_flags", ())) or "no -march"))
        else:
            lines.append("target: not recorded (built before EPL recorded it; delete %s "
                         "and run `python -m epl.communicators.op_library --build`)" % path)
    return lines


def main(argv=None):
    argv = sys.argv[1:] if argv is None else argv
    os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
    if "--build" in argv:
        print("built %s" % build())
    for line in report():
        print(line)


if __name__ == "__main__":
    main()
