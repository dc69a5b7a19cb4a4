"""The C++ library is built for a portable CPU baseline, never for the building machine
(issue 33 item 3): GCC's native target made `make setup TF=2` fail on Sapphire Rapids
Xeons (TensorFlow 2.21's Eigen cannot be compiled with AVX-512 FP16 by GCC 12), and a
library built on a login node died with SIGILL on older compute nodes.

Pinned here: no build command asks for the native CPU; csrc/build.py's own command (captured,
nothing compiled) names the portable target; the library `make setup` built records that
target and `python -m epl.communicators.op_library` reports it; the target enables no AVX-512; and CI runs the
Sapphire Rapids compile check (tools/xeon_compile_check.sh) on both lines.
"""
import glob
import importlib.util
import json
import os
import platform
import re
import subprocess

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
NATIVE = re.compile(r"-m(arch|tune|cpu)=native")
PORTABLE = {"x86_64": "x86-64-v2", "amd64": "x86-64-v2"}.get(platform.machine().lower())


def _build_module():
    spec = importlib.util.spec_from_file_location(
        "_epl_csrc_build", os.path.join(ROOT, "csrc", "build.py"))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _build_files():
    """Every file that builds or compiles EPL's C++ code."""
    files = [os.path.join(ROOT, p) for p in ("csrc/build.py", "setup.py", "setup.cfg",
                                              "Makefile", ".ci/run")]
    files += glob.glob(os.path.join(ROOT, "tools", "*"))
    files += glob.glob(os.path.join(ROOT, "csrc", "**", "*.py"), recursive=True)
    return [f for f in files if os.path.isfile(f)]


def test_no_build_command_targets_the_building_cpu():
    found = []
    for path in _build_files():
        with open(path, errors="replace") as f:
            for n, line in enumerate(f, 1):
                if NATIVE.search(line):
                    found.append("%s:%d: %s" % (os.path.relpath(path, ROOT), n, line.strip()))
    assert not found, "\n".join(found)


def test_portable_target_per_architecture():
    build = _build_module()
    assert build.portable_target("x86_64") == (["-march=x86-64-v2"], "x86-64-v2")
    flags, name = build.portable_target("aarch64")
    assert flags == [] and "aarch64" in name      # no -march: the compiler's default


def _capture(monkeypatch, tmp_path, *argv):
    """Runs csrc/build.py's main with ``argv``; returns the compiler commands it ran (each
    'compiles' by creating its -o file)."""
    build = _build_module()
    commands = []
    monkeypatch.delenv("EPL_MARCH", raising=False)   # (a site's own choice of target)

    class Done(object):
        returncode = 0
        stdout = b""

    def fake_run(cmd, **kw):
        commands.append(list(cmd))
        with open(cmd[cmd.index("-o") + 1], "wb") as f:
            f.write(b"")
        return Done()

    monkeypatch.setattr(build.subprocess, "run", fake_run)
    monkeypatch.setattr("sys.argv", ["build.py"] + list(argv))
    build.main()
    return commands


def test_build_command_names_the_portable_target(monkeypatch, tmp_path):
    """The library: each source compiled for the portable target (side by side, up to
    --jobs at a time), then one link of their objects into the library."""
    out = tmp_path / "libepl_ops_test.so"
    cmds = _capture(monkeypatch, tmp_path, "--out", str(out), "--jobs", "3")
    compiles, link = cmds[:-1], cmds[-1]
    sources = sorted(glob.glob(os.path.join(ROOT, "csrc", "*.cc")))
    assert sorted(c[c.index("-o") - 1] for c in compiles) == sources
    marches = (["-march=" + PORTABLE] if PORTABLE else [])
    for c in compiles:
        assert "-c" in c and "-shared" not in c
        assert [a for a in c if a.startswith("-march=")] == marches, c
    objects = [a for a in link if a.endswith(".o")]
    assert "-shared" in link and "-c" not in link and len(objects) == len(sources), link
    assert not any(a.endswith(".cc") for a in link), link
    assert out.exists()
    with open(str(tmp_path / "libepl_ops_test.json")) as f:
        info = json.load(f)
    assert info["target"] == (PORTABLE or "%s (compiler default)" % platform.machine().lower())
    assert info["target_flags"] == marches


def test_compile_only_compiles_each_source_for_the_asked_cpu(monkeypatch, tmp_path):
    cmds = _capture(monkeypatch, tmp_path, "--compile-only", str(tmp_path / "o"),
                    "--march", "sapphirerapids", "--cxxflag=-mno-avx512fp16", "--jobs", "2")
    sources = sorted(glob.glob(os.path.join(ROOT, "csrc", "*.cc")))
    assert sorted(c[c.index("-o") - 1] for c in cmds) == sources
    for c in cmds:
        assert "-c" in c and "-shared" not in c
        assert [a for a in c if a.startswith("-march=")] == ["-march=sapphirerapids"], c
        assert "-mno-avx512fp16" in c


def test_the_portable_target_enables_no_avx512():
    """What keeps TensorFlow 2.21's Eigen FP16 code (and SIGILL on older CPUs) out of the
    build: the target's predefined macros, asked of the compiler."""
    if PORTABLE is None:
        pytest.skip("no portable -march for %s: the compiler's default" % platform.machine())
    cxx = os.environ.get("CXX", "g++")

    def macros(*flags):
        return subprocess.run([cxx] + list(flags) + ["-dM", "-E", "-x", "c++", os.devnull],
                              stdout=subprocess.PIPE, check=True).stdout.decode()
    assert "__AVX512" not in macros("-march=" + PORTABLE)
    assert "__SSE4_2__" in macros("-march=" + PORTABLE)
    # ... while the CI check's CPU does turn FP16 on (so that check exercises it on TF 1.15).
    assert "__AVX512FP16__" in macros("-march=sapphirerapids")


def test_built_library_records_and_reports_the_portable_target():
    from epl.communicators import op_library
    from epl.tf_adapter.version import op_library_name
    info = os.path.join(ROOT, "epl", "lib", os.path.splitext(op_library_name())[0] + ".json")
    if not os.path.exists(info):
        pytest.skip("the library is not built (make setup)")
    with open(info) as f:
        meta = json.load(f)
    assert meta.get("target") == (PORTABLE or "%s (compiler default)"
                                  % platform.machine().lower()), meta
    assert not any(NATIVE.search(flag) for flag in meta.get("target_flags", [])), meta
    report = "\n".join(op_library.report())
    assert "target: %s (" % meta["target"] in report, report


def test_ci_runs_the_sapphire_rapids_compile_check_on_both_lines():
    with open(os.path.join(ROOT, ".ci", "run")) as f:
        ci = f.read()
    with open(os.path.join(ROOT, "Makefile")) as f:
        makefile = f.read()
    with open(os.path.join(ROOT, "tools", "xeon_compile_check.sh")) as f:
        script = f.read()
    assert "make xeon-compile-check" in ci and "tools/xeon_compile_check.sh 2" in ci
    assert re.search(r"^xeon-compile-check:\n\ttools/xeon_compile_check\.sh\n", makefile, re.M)
    assert 'lines=${1:-"1 2"}' in script and "--march sapphirerapids" in script
    assert os.access(os.path.join(ROOT, "tools", "xeon_compile_check.sh"), os.X_OK)
