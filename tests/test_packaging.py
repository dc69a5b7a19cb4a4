"""The pip route builds the same library as `make setup` (no download: --no-deps, the
venv's TensorFlow), ships the sources for a build on first use, and a wheel carries only
the library of the TensorFlow that built it (issue 33: a checkout that had built both lines
put both into every wheel)."""
import os
import shutil
import subprocess
import sys
import zipfile

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
# Every line's library name, and one of a TensorFlow line that no longer exists.
LIBRARIES = ("libepl_ops.so", "libepl_ops-tf2.21.so", "libepl_ops-tf2.16.so")


def _checkout_that_built_every_line(dest):
    """A copy of the checkout whose epl/lib holds every line's library (placeholders: they
    must never reach a wheel), and a build/ left by an earlier wheel of another line."""
    shutil.copytree(ROOT, dest, ignore=shutil.ignore_patterns(
        ".git", ".venv*", "build", "*.egg-info", "__pycache__", "epl_logs", "results"))
    shutil.rmtree(str(dest / "epl" / "lib"))
    for lib_dir in (dest / "epl" / "lib", dest / "build" / "lib" / "epl" / "lib"):
        lib_dir.mkdir(parents=True, exist_ok=True)
        for name in LIBRARIES:
            (lib_dir / name).write_bytes(b"not a library: another line's build")
            (lib_dir / name.replace(".so", ".json")).write_text("{}")
    return dest


@pytest.mark.timeout(900)   # (one C++ build: minutes on 2 busy cores)
def test_wheel_carries_only_its_own_line_and_installs(tmp_path):
    src = _checkout_that_built_every_line(tmp_path / "src")
    env = dict(os.environ, PIP_DISABLE_PIP_VERSION_CHECK="1")
    proc = subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps",
                           "--no-build-isolation", "-w", str(tmp_path / "dist"), str(src)],
                          stdout=subprocess.PIPE, stderr=subprocess.STDOUT, env=env,
                          cwd=str(tmp_path), timeout=600)
    assert proc.returncode == 0, proc.stdout.decode()[-3000:]
    wheel, = (tmp_path / "dist").glob("pyepl-*.whl")
    from epl.tf_adapter.version import op_library_name
    own = op_library_name()   # (this TensorFlow line's library)
    with zipfile.ZipFile(str(wheel)) as z:
        shipped = sorted(n for n in z.namelist() if n.startswith("epl/lib/"))
    assert shipped == ["epl/lib/" + own.replace(".so", ".json"), "epl/lib/" + own], shipped
    # The wheel installs, loads its own library and reports its backends.
    target = tmp_path / "site"
    proc = subprocess.run([sys.executable, "-m", "pip", "install", "--no-deps", "--target",
                           str(target), str(wheel)], stdout=subprocess.PIPE,
                          stderr=subprocess.STDOUT, env=env, cwd=str(tmp_path), timeout=300)
    assert proc.returncode == 0, proc.stdout.decode()[-3000:]
    lib = target / "epl" / "lib" / own
    assert lib.exists(), proc.stdout.decode()[-3000:]
    assert (target / "epl" / "_csrc" / "build.py").exists()
    assert (target / "epl" / "_csrc" / "nccl" / "nccl_ops.cc").exists()
    report = subprocess.run([sys.executable, "-m", "epl.communicators.op_library"], stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, cwd=str(tmp_path), timeout=300,
                            env=dict(os.environ, PYTHONPATH=str(target)))
    text = report.stdout.decode()
    assert report.returncode == 0, text
    assert "library: %s" % lib in text, text
    assert "backends: cpu-inprocess, cpu-shm, cpu-tcp" in text, text
    assert "nccl not built: " in text, text
