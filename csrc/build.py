"""Build EPL's TensorFlow custom-op library (csrc/ -> epl/lib/libepl_ops.so on TF 1.15,
epl/lib/libepl_ops-tf<major>.<minor>.so on TF 2.x: one file per line).

Uses the compile and link flags TensorFlow reports (ABI included; C++17 on TF 2.x) and
defines EPL_TF_MAJOR / EPL_TF_MINOR / EPL_TF_VERSION for the ``#if`` guards of csrc/
where the lines' headers differ (the names come from ``epl/tf_adapter/version.py``).  The NCCL
backend is compiled only when CUDA and NCCL headers are found *and* the
installed TensorFlow is a CUDA build; the CPU backends are always built.
Prints which backends it built.
"""
import argparse
import glob
import importlib.util
import json
import os
import shutil
import subprocess
import sys

HERE = os.path.dirname(os.path.abspath(__file__))


def _tf_version_module():
    """epl/tf_adapter/version.py, loaded by path (this script runs without EPL on the
    path): it names the library and the version macros, for every line, in one place.
    A checkout has it at ../epl/tf_adapter, a pip-installed package (epl/_csrc) at
    ../tf_adapter."""
    for rel in (("..", "epl", "tf_adapter"), ("..", "tf_adapter")):
        path = os.path.join(HERE, *rel, "version.py")
        if os.path.exists(path):
            spec = importlib.util.spec_from_file_location("_epl_tf_version", path)
            module = importlib.util.module_from_spec(spec)
            spec.loader.exec_module(module)
            return module
    sys.exit("csrc/build.py: epl/tf_adapter/version.py not found next to %s" % HERE)


def _find_header(name, extra_dirs):
    dirs = list(extra_dirs) + ["/usr/local/cuda/include", "/usr/include", "/usr/local/include"]
    for d in dirs:
        if d and os.path.exists(os.path.join(d, name)):
            return d
    return None


def main():
    parser = argparse.ArgumentParser()
    where = parser.add_mutually_exclusive_group(required=True)
    where.add_argument("--out", help="the library's path")
    where.add_argument("--out-dir", help="a directory: the library gets the installed "
                                         "TensorFlow line's name there")
    parser.add_argument("--require-nccl", action="store_true",
                        help="fail unless the NCCL backend is built (make gpu-ops-check)")
    parser.add_argument("--define", action="append", default=[],
                        help="extra preprocessor definitions (e.g. EPL_NCCL_SUM_THEN_SCALE)")
    args = parser.parse_args()
    try:
        import tensorflow as tf
    except ImportError:
        sys.exit("csrc/build.py: TensorFlow is not importable from %s; run `make setup`."
                 % sys.executable)
    cxx = os.environ.get("CXX", "g++")
    if shutil.which(cxx) is None:
        sys.exit("csrc/build.py: no C++ compiler %r found; install g++ (Debian: apt-get "
                 "install g++) or set CXX." % cxx)
    version = _tf_version_module()
    if args.out is None:
        args.out = os.path.join(args.out_dir, version.op_library_name())
    # The C++ standard and the EPL_TF_* macros first: TensorFlow's own flags after them
    # (a later -std wins, and TF 2.x's ask for C++17 themselves).
    flags = version.compile_flags() + list(tf.sysconfig.get_compile_flags())
    link = list(tf.sysconfig.get_link_flags())
    sources = sorted(glob.glob(os.path.join(HERE, "*.cc")))
    backends = ["cpu-inprocess", "cpu-shm", "cpu-tcp"]
    defines = []
    cuda_home = os.environ.get("CUDA_HOME", "/usr/local/cuda")
    cuda_inc = _find_header("cuda_runtime.h", [os.path.join(cuda_home, "include")])
    nccl_inc = _find_header("nccl.h", [os.environ.get("NCCL_INCLUDE_DIR", "")])
    if cuda_inc and nccl_inc and tf.test.is_built_with_cuda():
        sources += sorted(glob.glob(os.path.join(HERE, "nccl", "*.cc")))
        defines += ["-DEPL_WITH_NCCL=1", "-DGOOGLE_CUDA=1", "-I" + cuda_inc, "-I" + nccl_inc]
        # More CUDA header directories (pip's CUDA wheels split them: crt/ is in nvcc's).
        defines += ["-I" + d for d in os.environ.get("CUDA_EXTRA_INCLUDES", "").split(os.pathsep)
                    if d]
        for env, default in (("CUDA_LIB_DIR", os.path.join(cuda_home, "lib64")),
                             ("NCCL_LIB_DIR", "")):
            d = os.environ.get(env, default)
            if d:
                link += ["-L" + d]
        link += ["-lcudart", "-lnccl"]
        backends.append("nccl")
        skipped = ""
    else:
        why = []
        if not cuda_inc:
            why.append("no cuda_runtime.h")
        if not nccl_inc:
            why.append("no nccl.h")
        if not tf.test.is_built_with_cuda():
            why.append("TensorFlow is the CPU build")
        skipped = "nccl skipped (%s)" % ", ".join(why)
        if args.require_nccl:
            sys.exit("csrc/build.py: --require-nccl, but %s" % skipped)
    defines += ["-D" + d for d in args.define]
    os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
    tmp = "%s.%d.tmp" % (args.out, os.getpid())   # (concurrent builds never share it)
    cmd = ([cxx, "-shared", "-fPIC", "-O3", "-march=native",
            "-pthread", "-Wall", "-Wno-sign-compare", "-Wno-unused-function",
            "-DEPL_BACKENDS=\"%s\"" % ",".join(backends)]
           + defines + flags + sources + ["-o", tmp] + link + ["-lrt"])
    print("csrc/build.py: building %s" % args.out)
    proc = subprocess.run(cmd)
    if proc.returncode != 0:
        sys.exit("csrc/build.py: the C++ build failed (command above). It needs g++ and the "
                 "TensorFlow headers of %s (the venv's tensorflow)." % version.describe())
    os.replace(tmp, args.out)
    # What was built and why the rest was not, for `python -m epl.native`.
    info = {"backends": backends, "skipped": skipped[len("nccl skipped ("):-1] if skipped else "",
            "tensorflow": tf.__version__, "compiler": cxx,
            "flags": version.compile_flags()}
    with open(os.path.splitext(args.out)[0] + ".json", "w") as f:
        json.dump(info, f, indent=1)
    print("csrc/build.py: built backends: %s%s" % (", ".join(backends),
                                                   ("; " + skipped) if skipped else ""))


if __name__ == "__main__":
    main()
