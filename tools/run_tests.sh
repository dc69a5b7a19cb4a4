#!/usr/bin/env bash
# tools/run_tests.sh PYTHON [PYTEST ARGS...]: the suite on this machine's cores (make test,
# make test-eager-off).  The tests marked `alone` (tests/conftest.py: worker processes that
# wait on each other with timeouts, timings of this machine) run one at a time after the
# others, which run side by side in EPL_TEST_JOBS processes (pytest-xdist; default: the
# machine's cores, at most 8).  On a 2-core machine the suite's in-process tests are mostly
# Python building graphs on one core: two at a time took 58 s where one after another took
# 106 s.  EPL_TEST_JOBS=1, or no pytest-xdist in the venv, runs all of them in one process.
set -uo pipefail
py=$1; shift
cores=$(nproc 2>/dev/null || echo 1)
jobs=${EPL_TEST_JOBS:-$(( cores > 8 ? 8 : cores ))}
if ! [[ "$jobs" =~ ^[1-9][0-9]*$ ]]; then
  echo "EPL_TEST_JOBS=$jobs: use a whole number of test processes, 1 or more" >&2; exit 2
fi
if [ "$jobs" -gt 1 ] && ! "$py" -c "import xdist" >/dev/null 2>&1; then
  echo "tools/run_tests.sh: pytest-xdist is not in $py's venv (make setup installs it in a new one):" \
    "the tests run one at a time (in an older venv: $py -m pip install pytest-xdist)" >&2
  jobs=1
fi
if [ "$jobs" -eq 1 ]; then
  exec "$py" -m pytest -q "$@"
fi
"$py" -m pytest -q -n "$jobs" --dist worksteal -m "not alone" "$@"; beside=$?
echo "=== the tests that run alone (tests/conftest.py), one at a time"
"$py" -m pytest -q -m alone "$@"; alone=$?
# pytest's 5: no test selected in that half (a run of one file, say) is not a failure;
# in both halves it is (pytest's own status for a run that selects nothing).
[ "$beside" = 5 ] && [ "$alone" = 5 ] && exit 5
[ "$beside" = 5 ] && beside=0
[ "$alone" = 5 ] && alone=0
[ "$beside" != 0 ] && exit "$beside"
exit "$alone"
