import atexit
import os
import shutil
import tempfile
import zlib

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
# A collective whose peers never come fails fast in tests instead of after 10 minutes.
os.environ.setdefault("EPL_COMMUNICATION_TIMEOUT_SECONDS", "60")
# Jobs the tests launch without --log_dir write their worker logs to a temporary folder,
# never to ./epl_logs of the checkout (epl-launch's default).
_LOGS = tempfile.mkdtemp(prefix="epl-test-logs-")
atexit.register(shutil.rmtree, _LOGS, True)
os.environ.setdefault("EPL_LOG_DIR", _LOGS)

# TensorFlow 2.x line: tf.keras is tf-keras (Keras 2), as EPL's users on TF >= 2.16 set it
# (before TensorFlow is imported; the tests' subprocesses inherit it).
os.environ.setdefault("TF_USE_LEGACY_KERAS", "1")

import pytest  # noqa: E402
import tensorflow.compat.v1 as tf  # noqa: E402

# The suite's programs are TF1 programs: on TF 2.x they run the way their users run them,
# after TensorFlow's migration switch (on 1.15 it sets what are already the defaults).
# Users write the other graph mode too (disable_eager_execution() alone: shapes index to
# ints, resource variables, control flow v2): EPL_TEST_GRAPH_MODE=eager_off runs the
# suite (CI: the strategies' oracle tests) that way on TF 2.x.  Single tests of that mode
# switch it on for themselves and back.
GRAPH_MODE = os.environ.get("EPL_TEST_GRAPH_MODE", "v1")
if GRAPH_MODE not in ("v1", "eager_off"):
    raise ValueError("EPL_TEST_GRAPH_MODE=%r: use v1 (disable_v2_behavior(), the default) or "
                     "eager_off (disable_eager_execution() alone, TF 2.x)" % GRAPH_MODE)
tf.logging.set_verbosity(tf.logging.ERROR)   # (first: the switch below warns on TF 1.15)
if GRAPH_MODE == "eager_off" and tf.VERSION.startswith("2."):
    tf.disable_eager_execution()
else:
    tf.disable_v2_behavior()

# tf.estimator: TensorFlow removed it in 2.16 (tensorflow-estimator 2.15 is the last).
HAS_ESTIMATOR = hasattr(tf, "estimator")


# Test files whose subject is the processes around TensorFlow (the launcher, restarts,
# Slurm and MPI, network-namespace hosts, the benchmark watchdog): Python that is the
# same on every TensorFlow line.  EPL_TEST_LAUNCHERS=0 skips them: CI's run of the
# TF 2.x line sets it (they run on the default line there) to keep CI's total short.
# test_multi_worker.py (TF's distributed runtime under epl-launch) runs on every line.
# With them: the TCP transport's own hygiene (sockets, handshakes: the op library's
# collectives over TCP run on every line in test_collectives_xproc.py) and the checks
# of EPL's source (test_architecture.py reads files, it runs no TensorFlow).
LAUNCHER_FILES = frozenset([
    "test_cluster_managers.py", "test_restarts.py", "test_netns.py", "test_launcher.py",
    "test_launcher_faults.py", "test_benchmark_watchdog.py", "test_tcp_transport.py",
    "test_architecture.py"])
SKIP_LAUNCHERS = os.environ.get("EPL_TEST_LAUNCHERS", "1") == "0"


def pytest_configure(config):
    config.addinivalue_line("markers", "estimator: needs tf.estimator (TF 1.15; TF 2.x < 2.16)")
    config.addinivalue_line("markers", ALONE)


# `make test` runs the suite side by side on the machine's cores (tools/run_tests.sh:
# pytest-xdist), then the tests marked `alone` one at a time: a job whose worker processes
# wait on each other with timeouts, or a test that times this machine, must not share
# the cores with another test (a 2-core machine would run its processes at half speed).
ALONE = ("alone: runs with no other test beside it (its processes wait on each other with "
         "timeouts, or it times the machine): tools/run_tests.sh runs these one at a time")


def pytest_runtest_setup(item):
    if SKIP_LAUNCHERS and os.path.basename(str(item.fspath)) in LAUNCHER_FILES:
        pytest.skip("EPL_TEST_LAUNCHERS=0: the launcher's tests run on the default line "
                    "(their code is the same on every TensorFlow line)")
    if item.get_closest_marker("estimator") and not HAS_ESTIMATOR:
        pytest.skip("tf.estimator is not in TensorFlow %s (removed in 2.16; the TF=2.15 "
                    "line has it: make test-estimator TF=2.15)" % tf.VERSION)


@pytest.fixture(autouse=True)
def fresh_graph():
    """Every test starts with a new default graph, no EPL strategy and EPL not initialized
    (an oracle built in-process must not see another test's cluster)."""
    from tests import models
    models.reset()
    yield
    models.reset()


# How much of each parametrized test a run takes (EPL_TEST_MATRIX):
#   full       every variant (the default: `make test` on one line);
#   first      the first variant of each (every test function once: the eager_off mode);
#   share:K/N  the first variant, plus the variants whose id hashes to K of N: N runs on
#              N TensorFlow lines run every variant once between them, and every test
#              function on each.  CI runs share:0/4 on the default line and share:1/4 on
#              TF 2.x (.ci/run; half of the variants): the suite's variants
#              (programs x layouts x graph modes) are what TF's own behaviour does not
#              change between the lines, and what made CI's run of both lines longer
#              than its 90 minutes (share:0/2 took 2658 s on TF 1.15 and ~2150 s on
#              TF 2.x on a 2-core Xeon).
MATRIX = os.environ.get("EPL_TEST_MATRIX", "full")


def _matrix_share(spec):
    """(K, N) of the spec; (None, None) for full; (None, 0) for first."""
    if spec == "full":
        return None, None
    if spec == "first":
        return None, 0
    if spec.startswith("share:"):
        k, _, n = spec[len("share:"):].partition("/")
        if k.isdigit() and n.isdigit() and 0 <= int(k) < int(n):
            return int(k), int(n)
    raise ValueError("EPL_TEST_MATRIX=%r: use full, first or share:K/N (0 <= K < N)" % spec)


_SHARE = _matrix_share(MATRIX)     # (a mistyped spec fails here, before collecting)
# EPL_TEST_FIRSTS_ELSEWHERE: test files (paths, space-separated) whose plain tests and
# first variants another run on this line takes: under share:K/N this run takes only
# their shared variants.  CI's TF 2.x run names the oracle files (Makefile's
# ORACLE_TESTS): `make test-eager-off` runs their first variants on that line.
FIRSTS_ELSEWHERE = frozenset(
    os.path.basename(p) for p in os.environ.get("EPL_TEST_FIRSTS_ELSEWHERE", "").split())


def pytest_collection_modifyitems(config, items):
    share, shares = _SHARE
    if shares is None:
        return
    seen, dropped = set(), []
    for item in items:
        elsewhere = bool(shares) and os.path.basename(str(item.fspath)) in FIRSTS_ELSEWHERE
        if getattr(item, "callspec", None) is None:
            if elsewhere:
                dropped.append(item)
            continue
        function = (str(item.fspath), item.originalname)
        first = function not in seen
        seen.add(function)
        if first and not elsewhere:
            continue
        if first or not shares or zlib.crc32(item.nodeid.encode()) % shares != share:
            dropped.append(item)
    if dropped:
        config.hook.pytest_deselected(items=dropped)
        gone = set(id(i) for i in dropped)
        items[:] = [i for i in items if id(i) not in gone]
