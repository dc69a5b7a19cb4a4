"""The pip route builds the same library as `make setup` (no download: --no-deps, the
venv's TensorFlow), and ships the sources for a build on first use."""
import os
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def test_pip_install_builds_the_ops(tmp_path):
    target = tmp_path / "site"
    env = dict(os.environ, PIP_DISABLE_PIP_VERSION_CHECK="1")
    proc = subprocess.run([sys.executable, "-m", "pip", "install", "--no-deps",
                           "--no-build-isolation", "--target", str(target), ROOT],
                          stdout=subprocess.PIPE, stderr=subprocess.STDOUT, env=env,
                          cwd=str(tmp_path), timeout=600)
    assert proc.returncode == 0, proc.stdout.decode()[-3000:]
    from epl.tf_adapter.version import op_library_name
    lib = target / "epl" / "lib" / op_library_name()   # (this TensorFlow line's library)
    assert lib.exists(), proc.stdout.decode()[-3000:]
    assert (target / "epl" / "_csrc" / "build.py").exists()
    assert (target / "epl" / "_csrc" / "nccl" / "nccl_ops.cc").exists()
    # The installed package loads its own library and reports its backends.
    report = subprocess.run([sys.executable, "-m", "epl.native"], stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, cwd=str(tmp_path), timeout=300,
                            env=dict(os.environ, PYTHONPATH=str(target)))
    text = report.stdout.decode()
    assert report.returncode == 0, text
    assert "library: %s" % lib in text, text
    assert "backends: cpu-inprocess, cpu-shm, cpu-tcp" in text, text
    assert "nccl not built: " in text, text
