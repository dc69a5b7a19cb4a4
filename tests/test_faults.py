"""Fault injection: collectives and jobs under reruns, second sessions, dying and
misbehaving workers, and strangers on the network (issue 12).  Every test runs
processes with a hard timeout: a hang fails the test, it never blocks CI."""
import json
import os
import subprocess
import sys
import time
import uuid

import pytest

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
WORKER = os.path.join(HERE, "fault_worker.py")


def start_ranks(size, scenario, transport="shm", job=None, env_extra=None, tmp_path=None):
    job = job or uuid.uuid4().hex[:12]
    env = dict(os.environ, PYTHONPATH=ROOT, TF_CPP_MIN_LOG_LEVEL="2",
               EPL_COMMUNICATION_TIMEOUT_SECONDS="60")
    if transport == "tcp":
        from epl.launcher import free_ports
        env.setdefault("EPL_COMM_ADDRESSES",
                       ",".join("127.0.0.1:%d" % p for p in free_ports(size)))
    env.update(env_extra or {})
    return [subprocess.Popen([sys.executable, WORKER, str(r), str(size), job, "-", scenario,
                              transport], stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                             env=env) for r in range(size)]


def finish(procs, timeout=120):
    """(exit codes, outputs, seconds); kills what is still running at the timeout."""
    start = time.time()
    outs = []
    for p in procs:
        try:
            out, _ = p.communicate(timeout=max(1, timeout - (time.time() - start)))
        except subprocess.TimeoutExpired:
            p.kill()
            out, _ = p.communicate()
            out += b"\n<killed: hung past the test's timeout>"
        outs.append(out.decode("utf-8", "replace"))
    return [p.returncode for p in procs], outs, time.time() - start


def results(outs):
    found = []
    for out in outs:
        lines = [l for l in out.splitlines() if l.startswith("RESULT ")]
        assert lines, out[-3000:]
        found.append(json.loads(lines[-1][len("RESULT "):]))
    return found


def test_rerun_under_the_same_job_name_gets_the_right_sums():
    """A job started again with the same name (an unchanged TF_CONFIG / machine list) must
    not meet the previous run's shared-memory state."""
    job = "rerun-" + uuid.uuid4().hex[:8]
    for scale in (1, 0.1, 3):
        codes, outs, _ = finish(start_ranks(2, "sum", job=job, env_extra={"SCALE": str(scale)}))
        assert codes == [0, 0], "\n".join(outs)
        sums = [r["sum"][0] for r in results(outs)]
        assert sums == pytest.approx([30.0 * scale] * 2), sums


@pytest.mark.parametrize("transport", ["shm", "tcp"])
def test_a_second_session_in_the_same_process(transport):
    codes, outs, _ = finish(start_ranks(2, "two_sessions", transport), timeout=90)
    assert codes == [0, 0], "\n".join(outs)
    for r in results(outs):
        assert r == {"first": [30.0, 30.0], "second": [300.0, 300.0]}
