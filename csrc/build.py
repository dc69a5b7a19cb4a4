"""Build EPL's TensorFlow custom-op library (csrc/ -> epl/lib/libepl_ops.so on TF 1.15,
epl/lib/libepl_ops-tf<major>.<minor>.so on TF 2.x: one file per line).

Uses the compile and link flags TensorFlow reports (ABI included; C++17 on TF 2.x) and
defines EPL_TF_MAJOR / EPL_TF_MINOR / EPL_TF_VERSION for the ``#if`` guards of csrc/
where the lines' headers differ (the names come from ``epl/tf_adapter/version.py``).  The NCCL
backend is compiled only when CUDA and NCCL headers are found *and* the
installed TensorFlow is a CUDA build; the CPU backends are always built.
Prints which backends it built.

The code is compiled for a portable CPU baseline, never for the building machine's own CPU
(GCC's "native" target): a cluster library is built once (on a login node, in a shared home
folder, into a wheel) and run on compute nodes whose CPUs may be older, where code for the
builder's CPU dies with SIGILL.  And GCC 12 cannot compile TensorFlow 2.21's Eigen headers
once the building CPU's AVX-512 FP16 is switched on (Sapphire Rapids and newer Xeons).  The
baseline is x86-64-v2 on x86-64 (SSE4.2, POPCNT: every x86-64 server CPU since 2009); the
compiler's default elsewhere.  x86-64-v3 (AVX2, FMA) was measured about 7% faster in the
in-process all-reduce's sums (docs/communication.md, "Build target"): not worth a library
that dies on older nodes; a site whose nodes all have AVX2 sets EPL_MARCH=x86-64-v3.
``--march`` overrides the target (measurements); ``--compile-only`` compiles the sources
without linking (make xeon-compile-check).  The target is recorded in the library's .json
and reported by ``python -m epl.communicators.op_library``.
"""
import argparse
import glob
import importlib.util
import json
import os
import platform
import shutil
import subprocess
import sys
import tempfile
from concurrent.futures import ThreadPoolExecutor

HERE = os.path.dirname(os.path.abspath(__file__))
# The portable baseline per architecture (platform.machine()); others: the compiler's default.
PORTABLE_MARCH = {"x86_64": "x86-64-v2", "amd64": "x86-64-v2"}


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


def portable_target(machine=None):
    """(the -march flags, the target's name) for this machine's architecture: the
    portable baseline, independent of the building CPU."""
    machine = (machine or platform.machine()).lower()
    march = PORTABLE_MARCH.get(machine)
    if march:
        return ["-march=" + march], march
    return [], "%s (compiler default)" % machine


def _object_path(out_dir, src):
    """Where ``_compile_objects`` puts ``src``'s object."""
    return os.path.join(out_dir, os.path.splitext(os.path.basename(src))[0] + ".o")


def _compile_objects(cxx, cmd_flags, sources, out_dir, jobs):
    """Compiles every source to an object in ``out_dir`` (no link), ``jobs`` at a time;
    returns the sources that failed."""
    os.makedirs(out_dir, exist_ok=True)

    def one(src):
        obj = _object_path(out_dir, src)
        proc = subprocess.run([cxx, "-c"] + cmd_flags + [src, "-o", obj],
                              stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
        return src, proc.returncode, proc.stdout.decode(errors="replace")

    failed = []
    with ThreadPoolExecutor(max_workers=max(1, jobs)) as pool:
        for src, code, text in pool.map(one, sources):
            if code != 0:
                failed.append(src)
                print("csrc/build.py: %s failed:\n%s" % (os.path.basename(src),
                                                          text[-4000:]))
    return failed


def main():
    parser = argparse.ArgumentParser()
    where = parser.add_mutually_exclusive_group(required=True)
    where.add_argument("--out", help="the library's path")
    where.add_argument("--out-dir", help="a directory: the library gets the installed "
                                         "TensorFlow line's name there")
    where.add_argument("--compile-only", metavar="DIR",
                       help="compile every source to DIR/*.o, no link (a compile check)")
    parser.add_argument("--march", default=os.environ.get("EPL_MARCH") or None,
                        help="the -march target instead of the portable baseline "
                             "(default: $EPL_MARCH, e.g. x86-64-v3 where every node has "
                             "AVX2; measurements, compile checks)")
    parser.add_argument("--cxxflag", action="append", default=[],
                        help="an extra compiler flag, as --cxxflag=-mno-avx512fp16")
    parser.add_argument("--jobs", type=int, default=os.cpu_count() or 1,
                        help="sources compiled at a time (default: the machine's cores; "
                             "each a g++ of TensorFlow's headers, ~1 GB)")
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
    if args.out is None and args.out_dir is not None:
        args.out = os.path.join(args.out_dir, version.op_library_name())
    if args.march:
        target_flags, target = ["-march=" + args.march], args.march
    else:
        target_flags, target = portable_target()
    target_flags += args.cxxflag
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
    compile_flags = (["-fPIC", "-O3"] + target_flags
                     + ["-pthread", "-Wall", "-Wno-sign-compare", "-Wno-unused-function",
                        "-DEPL_BACKENDS=\"%s\"" % ",".join(backends)]
                     + defines + flags)
    if args.compile_only:
        print("csrc/build.py: compiling %d sources for %s (%s) into %s, no link"
              % (len(sources), target, " ".join(target_flags) or "no -march",
                 args.compile_only))
        failed = _compile_objects(cxx, compile_flags, sources, args.compile_only, args.jobs)
        if failed:
            sys.exit("csrc/build.py: %d of %d sources failed to compile for %s against %s: %s"
                     % (len(failed), len(sources), " ".join(target_flags), version.describe(),
                        ", ".join(os.path.basename(f) for f in failed)))
        print("csrc/build.py: compiled %d sources for %s" % (len(sources), target))
        return
    os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
    tmp = "%s.%d.tmp" % (args.out, os.getpid())   # (concurrent builds never share it)
    print("csrc/build.py: building %s for %s (%d sources, %d at a time)"
          % (args.out, target, len(sources), max(1, args.jobs)))
    # Each source on its own compiler, then one link: the sources compile side by side
    # (TensorFlow 2.21's headers: 150 s one after another on 2 cores, 84 s two at a time).
    objects = tempfile.mkdtemp(prefix="epl-ops-objects-")
    try:
        failed = _compile_objects(cxx, compile_flags, sources, objects, args.jobs)
        code = 1 if failed else subprocess.run(
            [cxx, "-shared", "-fPIC", "-pthread"]
            + [_object_path(objects, src) for src in sources]
            + ["-o", tmp] + link + ["-lrt"]).returncode
    finally:
        shutil.rmtree(objects, ignore_errors=True)
    if code != 0:
        sys.exit("csrc/build.py: the C++ build failed (%s). It needs g++ and the TensorFlow "
                 "headers of %s (the venv's tensorflow)." % (
                     "the compiler's output above" if failed else "the link above",
                     version.describe()))
    os.replace(tmp, args.out)
    # What was built and why the rest was not, for `python -m epl.communicators.op_library`.
    info = {"backends": backends, "skipped": skipped[len("nccl skipped ("):-1] if skipped else "",
            "tensorflow": tf.__version__, "compiler": cxx,
            "flags": version.compile_flags(), "target": target,
            "target_flags": target_flags}
    with open(os.path.splitext(args.out)[0] + ".json", "w") as f:
        json.dump(info, f, indent=1)
    print("csrc/build.py: built backends: %s%s" % (", ".join(backends),
                                                   ("; " + skipped) if skipped else ""))


if __name__ == "__main__":
    main()
