"""pyepl: Easy Parallel Library for TensorFlow 1.x graphs (import name ``epl``), on two
lines: TensorFlow 1.15.5 on Python 3.7, and TensorFlow 2.x (>= 2.16, with tf-keras) on
Python 3.11+ through ``tf.compat.v1``.  The extras pick the line from the Python that installs.

`pip install .[cpu]`, `pip install .[gpu]` and `pip wheel .` build EPL's C++ op library
(csrc/ -> epl/lib/libepl_ops.so on TF 1.15, libepl_ops-tf<major>.<minor>.so on 2.x, NCCL
where CUDA and NCCL are found) with the compile flags of the TensorFlow the build can
import.  A package carries that library only: never the libraries a checkout built in its
epl/lib for `make setup` (the other line's, or a stale one), nor those an earlier build
left in build/.  Where no TensorFlow is importable yet (pip may build before it installs
the extras), it carries none, and the first use of EPL's collectives builds it
(`python -m epl.communicators.op_library --build` does it ahead of time); `python -m epl.communicators.op_library` reports what
is built.
"""
import glob
import os
import shutil
import subprocess
import sys

from setuptools import find_packages, setup
from setuptools.command.build_py import build_py

HERE = os.path.dirname(os.path.abspath(__file__))
# Environment markers of the two TensorFlow lines: 1.15 has wheels for Python 3.7 only,
# TensorFlow 2.16+ for 3.9+ (we support 3.11+).
_TF1 = "python_version < '3.8'"
_TF2 = "python_version >= '3.11'"


class BuildWithOps(build_py):
    """build_py, plus the C++ ops into the build's epl/lib."""

    def run(self):
        build_py.run(self)
        # Only the library built below goes into the package: drop what package_data or
        # an earlier build (of either line) put there.
        out_dir = os.path.join(self.build_lib, "epl", "lib")
        for stale in glob.glob(os.path.join(out_dir, "libepl_ops*")):
            os.remove(stale)
        # The sources travel with the package, for a build on first use.
        src = os.path.join(self.build_lib, "epl", "_csrc")
        shutil.rmtree(src, ignore_errors=True)
        shutil.copytree(os.path.join(HERE, "csrc"), src,
                        ignore=shutil.ignore_patterns("build", "__pycache__"))
        if os.environ.get("EPL_SKIP_OPS_BUILD"):
            return
        try:
            import tensorflow  # noqa: F401
        except ImportError:
            print("pyepl: TensorFlow is not importable while building: the C++ ops are "
                  "built on first use (or by `python -m epl.communicators.op_library --build`).")
            return
        # (named for the TensorFlow line it links against: csrc/build.py --out-dir)
        code = subprocess.call([sys.executable, os.path.join(HERE, "csrc", "build.py"),
                                "--out-dir", out_dir])
        if code != 0:
            print("pyepl: the C++ ops did not build (above); they are built on first use.")


setup(
    name="pyepl",
    version="0.1.0",
    description="Easy Parallel Library: distributed training for TensorFlow 1.x graphs",
    license="Apache-2.0",
    packages=find_packages(include=["epl", "epl.*"]),
    python_requires=">=3.7",
    install_requires=["numpy<1.19; " + _TF1, "numpy; " + _TF2, "protobuf<3.21; " + _TF1],
    extras_require={
        "cpu": ["tensorflow==1.15.5; " + _TF1,
                "tensorflow-cpu>=2.16; " + _TF2, "tf-keras>=2.16; " + _TF2],
        "gpu": ["tensorflow-gpu==1.15.5; " + _TF1,
                "tensorflow[and-cuda]>=2.16; " + _TF2, "tf-keras>=2.16; " + _TF2],
    },
    entry_points={"console_scripts": ["epl-launch=epl.launch.cli:main"]},
    # (no package_data for epl/lib: the package carries the one library BuildWithOps
    # builds, never those of the checkout)
    cmdclass={"build_py": BuildWithOps},
)
