"""benchmarks/watchdog.py: every benchmark run ends within its bound and leaves no process
behind.  The children here are tiny Python programs (no TensorFlow): one that hangs, one
that exits 0 without its result, one that leaves a grandchild, and callers that are
terminated or killed."""
import os
import signal
import subprocess
import sys
import time

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "benchmarks"))
import watchdog  # noqa: E402

pytestmark = pytest.mark.alone   # it times this machine (conftest.py)

PY = sys.executable
HANG = [PY, "-c", "import time; time.sleep(600)"]
NO_RESULT = [PY, "-c", "print('starting'); import sys; sys.exit(0)"]
RESULT = [PY, "-c", "import json; print(json.dumps([{'ok': 1}]))"]


def gone(pid):
    """True when the process has exited (a zombie nobody reaped counts as gone)."""
    try:
        with open("/proc/%d/stat" % pid) as f:
            return f.read().rsplit(")", 1)[1].split()[0] == "Z"
    except OSError:
        return True


def group_gone(pgid):
    """True when no live process is left in the process group."""
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open("/proc/%s/stat" % entry) as f:
                fields = f.read().rsplit(")", 1)[1].split()
        except OSError:
            continue
        if int(fields[2]) == pgid and fields[0] != "Z":
            return False
    return True


def wait_until(pred, seconds):
    deadline = time.time() + seconds
    while time.time() < deadline:
        if pred():
            return True
        time.sleep(0.05)
    return pred()


def test_a_child_that_hangs_is_stopped_at_the_deadline():
    start = time.time()
    out = watchdog.run_group([HANG], timeout=2, has_result=watchdog.has_json_result)
    took = time.time() - start
    assert not out.ok and "no result within 2s" in out.failure, out.failure
    assert took < 2 + watchdog.GRACE_SECONDS + 5, took
    assert gone(out.pids[0]) and group_gone(out.pids[0])


def test_a_peer_that_exits_0_without_its_result_fails_the_run_at_once():
    """The other rank would wait for it forever: the run fails now, not at the deadline
    (600 s here), and the waiting rank's group is killed."""
    start = time.time()
    out = watchdog.run_group([NO_RESULT, HANG], timeout=600,
                             has_result=watchdog.has_json_result, names=["rank 0", "rank 1"])
    took = time.time() - start
    assert not out.ok
    assert out.failure.startswith("rank 0 exited with status 0 without a result"), out.failure
    assert "stopped the others" in out.failure
    assert took < watchdog.GRACE_SECONDS + 10, took
    assert out.codes[0] == 0 and out.codes[1] is None
    for pid in out.pids:
        assert gone(pid) and group_gone(pid)


def test_a_peer_still_running_long_after_the_others_finished_is_stopped():
    out = watchdog.run_group([RESULT, HANG], timeout=600, has_result=watchdog.has_json_result,
                             names=["rank 0", "rank 1"], peer_seconds=1)
    assert not out.ok
    assert out.failure.startswith("rank 1 still running 1s after rank 0 finished"), out.failure
    assert all(gone(p) and group_gone(p) for p in out.pids)


def test_a_peer_that_fails_stops_the_others():
    out = watchdog.run_group([[PY, "-c", "import sys; sys.exit(3)"], HANG], timeout=600)
    assert not out.ok and out.failure.startswith("child 0 exited with status 3"), out.failure
    assert all(gone(p) and group_gone(p) for p in out.pids)


def test_results_are_returned_and_grandchildren_are_cleaned_up():
    """A child that leaves a process behind in its group (a server, a helper): the group
    goes with the run even though the child itself succeeded."""
    leaves = [PY, "-c", "import json, subprocess; p = subprocess.Popen(['sleep', '600']); "
                        "print(json.dumps([p.pid]))"]
    out = watchdog.run_group([RESULT, leaves], timeout=60, has_result=watchdog.has_json_result)
    assert out.ok, out.failure
    assert watchdog.json_result(out.outputs[0]) == [{"ok": 1}]
    grandchild = watchdog.json_result(out.outputs[1])[0]
    assert wait_until(lambda: gone(grandchild), 5), "the grandchild %d survived" % grandchild
    assert all(group_gone(p) for p in out.pids)


def test_run_one_raises_with_the_failure():
    with pytest.raises(watchdog.Failed,
                       match="(?s)python.* exited with status 0 without a result.*starting"):
        watchdog.run_one(NO_RESULT, timeout=60, has_result=watchdog.has_json_result)


def _caller(tmp_path):
    """A benchmark-like caller whose child hangs and writes its pid to tmp_path/pid."""
    child = ("import os, time; open(%r, 'w').write(str(os.getpid())); os.rename(%r, %r); "
             "time.sleep(600)" % (str(tmp_path / "pid.tmp"), str(tmp_path / "pid.tmp"),
                                  str(tmp_path / "pid")))
    code = ("import sys; sys.path.insert(0, %r); import watchdog; "
            "watchdog.run_group([[sys.executable, '-c', %r]], timeout=600)"
            % (os.path.join(ROOT, "benchmarks"), child))
    proc = subprocess.Popen([PY, "-c", code])
    assert wait_until(lambda: (tmp_path / "pid").exists(), 60), "the child did not start"
    return proc, int((tmp_path / "pid").read_text())


@pytest.mark.parametrize("how", [signal.SIGTERM, signal.SIGINT, signal.SIGKILL])
def test_the_children_end_with_their_caller(tmp_path, how):
    """A caller that is terminated, interrupted or killed outright takes its children
    with it (the 2 GB rank that outlived its caller)."""
    proc, child = _caller(tmp_path)
    try:
        assert not gone(child)
        proc.send_signal(how)
        proc.wait(30)
        assert wait_until(lambda: gone(child), 10), "child %d outlived its caller" % child
        assert group_gone(child)
    finally:
        if proc.poll() is None:
            proc.kill()
        if not gone(child):
            os.kill(child, signal.SIGKILL)


def test_the_collectives_benchmark_gives_up_on_a_baseline_rank_that_left(monkeypatch):
    """The hang seen with --sizes-mib 16,64,256: one rank of TensorFlow's collective
    baseline gone with status 0, the other stuck.  The benchmark records the failure at
    once and goes on, with no rank left running."""
    import collectives
    commands = iter([NO_RESULT, HANG])
    monkeypatch.setattr(collectives, "_rank_command", lambda *args: next(commands))
    monkeypatch.setattr(collectives, "FAILURES", [])
    start = time.time()
    run_cross = collectives._run_cross  # pylint: disable=protected-access
    assert run_cross("tf_collective", "16", 2, 1800) == []
    assert time.time() - start < watchdog.GRACE_SECONDS + 10
    (failure,) = collectives.FAILURES
    assert failure["impl"] == "tf_collective"
    assert "rank 0 exited with status 0 without a result" in failure["failure"]
