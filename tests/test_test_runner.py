"""tools/run_tests.sh (what `make test` runs): the tests side by side, then the `alone`
ones one at a time; it must fail when a test of either half fails (CI reads only its exit
status), run both halves even when the first fails, and refuse a bad EPL_TEST_JOBS."""
import os
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
RUNNER = os.path.join(ROOT, "tools", "run_tests.sh")

INI = """[pytest]
markers =
    alone: runs alone
addopts = -p no:cacheprovider
"""


def _suite(tmp_path, beside_ok, alone_ok):
    """A tiny suite of its own (not this repository's conftest): two tests side by side,
    one alone; each writes its process id so the halves' processes can be told apart."""
    (tmp_path / "pytest.ini").write_text(INI)
    (tmp_path / "test_tiny.py").write_text(
        "import os\nimport pytest\n\nHERE = %r\n\n"
        "def _mark(name):\n"
        "    open(os.path.join(HERE, name + '.pid'), 'w').write(str(os.getpid()))\n\n"
        "def test_a():\n    _mark('a')\n    assert %s\n\n"
        "def test_b():\n    _mark('b')\n\n"
        "@pytest.mark.alone\n"
        "def test_c():\n    _mark('c')\n    assert %s\n"
        % (str(tmp_path), beside_ok, alone_ok))


def _run(tmp_path, jobs="2", *args):
    env = dict(os.environ, EPL_TEST_JOBS=jobs)
    env.pop("PYTEST_ADDOPTS", None)
    return subprocess.run(["bash", RUNNER, sys.executable, "-c", str(tmp_path / "pytest.ini"),
                           str(tmp_path)] + list(args), stdout=subprocess.PIPE,
                          stderr=subprocess.STDOUT, env=env, cwd=str(tmp_path), timeout=240)


def _pids(tmp_path):
    return {n: int((tmp_path / (n + ".pid")).read_text()) for n in "abc"}


def _has_xdist():
    try:
        import xdist  # noqa: F401
        return True
    except ImportError:
        return False


needs_xdist = pytest.mark.skipif(not _has_xdist(), reason="pytest-xdist (make setup installs it)")


@needs_xdist
def test_both_halves_pass_and_the_alone_test_runs_in_the_runners_own_process(tmp_path):
    _suite(tmp_path, True, True)
    proc = _run(tmp_path)
    out = proc.stdout.decode()
    assert proc.returncode == 0, out
    pids = _pids(tmp_path)
    # side by side: in xdist's worker processes; alone: one pytest after them
    assert pids["c"] not in (pids["a"], pids["b"]), out
    assert "the tests that run alone" in out


@needs_xdist
@pytest.mark.parametrize("beside_ok, alone_ok", [(False, True), (True, False)])
def test_a_failure_in_either_half_fails_the_run_and_both_halves_run(tmp_path, beside_ok,
                                                                     alone_ok):
    _suite(tmp_path, beside_ok, alone_ok)
    proc = _run(tmp_path)
    out = proc.stdout.decode()
    assert proc.returncode == 1, out
    assert sorted(_pids(tmp_path)) == ["a", "b", "c"], out      # both halves ran
    assert "FAILED" in out and ("test_a" if not beside_ok else "test_c") in out


def test_one_job_runs_everything_in_one_process(tmp_path):
    _suite(tmp_path, True, False)
    proc = _run(tmp_path, jobs="1")
    assert proc.returncode == 1, proc.stdout.decode()
    assert len(set(_pids(tmp_path).values())) == 1


def test_a_bad_job_count_is_refused_by_name(tmp_path):
    _suite(tmp_path, True, True)
    proc = _run(tmp_path, jobs="two")
    out = proc.stdout.decode()
    assert proc.returncode == 2 and "EPL_TEST_JOBS=two" in out, out
    assert not list(tmp_path.glob("*.pid"))


@needs_xdist
def test_a_run_that_selects_nothing_is_pytests_no_tests_status(tmp_path):
    _suite(tmp_path, True, True)
    proc = _run(tmp_path, "2", "-k", "no_such_test")
    assert proc.returncode == 5, proc.stdout.decode()
