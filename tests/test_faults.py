"""Fault injection: collectives and jobs under reruns, second sessions, dying and
misbehaving workers, and strangers on the network (issue 12).  Every test runs
processes with a hard timeout: a hang fails the test, it never blocks CI."""
import glob
import json
import os
import subprocess
import sys
import time
import uuid

import pytest

pytestmark = pytest.mark.alone   # processes that wait on each other with timeouts (conftest.py)

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
WORKER = os.path.join(HERE, "fault_worker.py")


def start_ranks(size, scenario, transport="shm", job=None, env_extra=None, only=None):
    """Start ranks (all, or those in ``only``) of a ``size``-rank job of ``scenario``."""
    job = job or uuid.uuid4().hex[:12]
    env = dict(os.environ, PYTHONPATH=ROOT, TF_CPP_MIN_LOG_LEVEL="2",
               EPL_COMMUNICATION_TIMEOUT_SECONDS="60")
    if transport == "tcp":
        from epl.launch.ports import free_ports
        env.setdefault("EPL_COMM_ADDRESSES",
                       ",".join("127.0.0.1:%d" % p for p in free_ports(size)))
        env.setdefault("EPL_JOB_SECRET", "secret-of-" + job)   # (epl-launch sets one)
    env.update(env_extra or {})
    return [subprocess.Popen([sys.executable, WORKER, str(r), str(size), job, "-", scenario,
                              transport], stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                             env=env) for r in (range(size) if only is None else only)]


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


@pytest.mark.parametrize("transport", ["shm", "tcp"])
def test_a_rank_failing_in_a_collective_fails_its_peers_at_once(transport):
    """Rank 1's collective fails on its own (its split sizes are wrong): rank 0, waiting in
    the same collective, fails within 5 s with rank 1's error -- not after the 60 s
    timeout; the next job on the same machine is fine."""
    codes, outs, _ = finish(start_ranks(2, "raise", transport), timeout=60)
    assert codes == [0, 0], "\n".join(outs)
    mine, theirs = results(outs)
    assert "split sizes" in theirs["error"]
    assert "rank 1" in mine["error"] and "split sizes" in mine["error"], mine
    assert mine["seconds"] < 5, mine
    codes, outs, _ = finish(start_ranks(2, "sum", transport))
    assert [r["sum"] for r in results(outs)] == [[30.0], [30.0]]


@pytest.mark.parametrize("transport", ["shm", "tcp"])
def test_an_abort_also_fails_the_other_pending_collectives_of_the_job(transport):
    """Rank 0 runs a failing collective and, in the same step, one rank 1 never joins: the
    first failure ends both at once (a collective kernel cannot be cancelled otherwise)."""
    codes, outs, _ = finish(start_ranks(2, "abort_wakes", transport), timeout=90)
    assert codes == [0, 0], "\n".join(outs)
    for r in results(outs):
        assert "split sizes" in r["error"] and r["seconds"] < 5, r


@pytest.mark.parametrize("transport", ["shm", "tcp"])
def test_a_worker_leaving_early_fails_the_others_naming_it(transport):
    """Rank 1 exits with status 0 while rank 0 waits for it in a collective."""
    codes, outs, _ = finish(start_ranks(2, "exit_early", transport), timeout=60)
    assert codes == [0, 0], "\n".join(outs)
    mine, theirs = results(outs)
    assert theirs["warm"] == [2.0]
    assert mine["error"] and "rank 1" in mine["error"], mine
    assert mine["seconds"] < 10, mine


def test_a_thousand_groups_over_tcp_on_two_hosts():
    """One group per variable (the initial-value broadcast of a large model) over the TCP
    transport between two 'hosts' (127.0.0.2 and 127.0.0.3): one connection carries
    them all."""
    from epl.launch.ports import free_ports
    addrs = "127.0.0.2:%d,127.0.0.3:%d" % (free_ports(1, "127.0.0.2")[0],
                                         free_ports(1, "127.0.0.3")[0])
    codes, outs, _ = finish(start_ranks(2, "broadcast_many", "tcp",
                                        env_extra={"EPL_COMM_ADDRESSES": addrs,
                                                   "GROUPS": "1000"}), timeout=240)
    assert codes == [0, 0], "\n".join(o[-3000:] for o in outs)
    for r in results(outs):
        assert r["wrong"] == []


@pytest.mark.parametrize("transport", ["shm", "tcp"])
def test_two_reductions_of_one_step_keep_their_values(transport):
    codes, outs, _ = finish(start_ranks(2, "two_gradients", transport))
    assert codes == [0, 0], "\n".join(outs)
    for r in results(outs):
        assert r["values"] == [3.0, 6.0]


def _lines(proc):
    """A queue of the process's output lines (read on a thread, so waits can time out)."""
    import queue
    import threading
    q = queue.Queue()

    def pump():
        for raw in iter(proc.stdout.readline, b""):
            q.put(raw.decode("utf-8", "replace"))
        q.put(None)
    threading.Thread(target=pump, daemon=True).start()
    return q


def _wait_for(q, pred, timeout, seen):
    deadline = time.time() + timeout
    while time.time() < deadline:
        try:
            line = q.get(timeout=max(0.1, deadline - time.time()))
        except Exception:  # pylint: disable=broad-except
            break
        if line is None:
            break
        seen.append(line)
        if pred(line):
            return line
    pytest.fail("did not see the expected line; output:\n" + "".join(seen[-60:]))


def _segments(run):
    """The shared-memory segments of the run ``run`` (other jobs of this machine may
    hold segments of their own meanwhile)."""
    return glob.glob("/dev/shm/epl-%s-*" % run)


def test_kill_9_of_a_worker_mid_step(tmp_path):
    """A worker killed mid-training: the launcher stops the job within 10 s, names the
    killed worker as the cause, and leaves none of the run's shared memory behind (the
    two workers of one host met in it: it existed while they trained)."""
    import signal
    env = dict(os.environ, PYTHONPATH=ROOT, TF_CPP_MIN_LOG_LEVEL="2")
    env.pop("EPL_JOB_ID", None)
    env.pop("EPL_COMM_TRANSPORT", None)   # (one host: shared memory)
    proc = subprocess.Popen([sys.executable, "-m", "epl.launch", "--num_workers", "2",
                             "--gpu_per_worker", "1", "--log_dir", str(tmp_path / "logs"),
                             os.path.join(HERE, "fault_train.py")],
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, env=env)
    try:
        q, seen = _lines(proc), []
        run = _wait_for(q, lambda l: l.startswith("epl-launch: attempt 0: run "), 120,
                        seen).split()[-1]
        pid = int(_wait_for(q, lambda l: l.startswith("[worker 1] PID"), 120, seen).split()[-1])
        _wait_for(q, lambda l: l.startswith("[worker 1] step 3"), 120, seen)
        assert _segments(run), "".join(seen[-60:])
        os.kill(pid, signal.SIGKILL)
        killed = time.time()
        proc.wait(timeout=60)
        elapsed = time.time() - killed
        while True:
            line = q.get(timeout=10)
            if line is None:
                break
            seen.append(line)
    finally:
        if proc.poll() is None:
            proc.kill()
    out = "".join(seen)
    assert proc.returncode != 0
    print("launcher stopped %.2f s after the kill" % elapsed)
    assert elapsed < 10, out[-3000:]
    assert "worker 1 was killed by SIGKILL" in out, out[-3000:]
    assert _segments(run) == []


def _fnv1a(text):
    """The job hash the TCP handshake carries (64-bit FNV-1a, as csrc/crossproc.cc)."""
    h = 1469598103934665603
    for c in text.encode():
        h = ((h ^ c) * 1099511628211) % (1 << 64)
    return h


def _tcp_pair(env_extra):
    from epl.launch.ports import free_ports
    ports = free_ports(2)
    env = {"EPL_COMM_ADDRESSES": "127.0.0.1:%d,127.0.0.1:%d" % tuple(ports)}
    env.update(env_extra)
    return ports, env


def test_a_stranger_is_refused_and_the_numbers_are_unchanged():
    """While a 2-rank TCP job runs, a stranger connects to rank 1's port: silently, with a
    forged handshake claiming to be rank 0, and with 20 idle connections.  Each is
    refused (and logged with its address); the job's sums are unchanged."""
    import socket
    import struct
    ports, env = _tcp_pair({"EPL_JOB_SECRET": "the-job-secret", "PAUSE": "8"})
    job = "stranger-" + uuid.uuid4().hex[:6]
    procs = start_ranks(2, "stranger_target", "tcp", env_extra=env, job=job)
    target = ("127.0.0.1", ports[1])
    deadline = time.time() + 60
    while True:   # until rank 1 listens
        try:
            socket.create_connection(target, timeout=1).close()
            break
        except OSError:
            assert time.time() < deadline, "rank 1 never listened"
            time.sleep(0.1)
    forged = socket.create_connection(target, timeout=5)
    hello = forged.recv(20)
    assert hello[:4] == b"EPLH"
    # It knows the job id (not secret) and claims to be rank 0; it cannot know the secret.
    forged.sendall(b"EPLC" + struct.pack("<Qi", _fnv1a(job), 0) + os.urandom(16) +
                   os.urandom(32))
    forged.settimeout(5)
    assert forged.recv(64) == b""          # closed: no server proof for a stranger
    forged.close()
    idle = [socket.create_connection(target, timeout=5) for _ in range(20)]
    codes, outs, _ = finish(procs, timeout=120)
    for s in idle:
        s.close()
    assert codes == [0, 0], "\n".join(outs)
    for r in results(outs):
        assert r["second"] == [300.0]
    assert "refused a connection from 127.0.0.1" in outs[1]
    assert "does not prove the job's secret" in outs[1]


def test_a_peer_with_another_secret_is_refused_with_a_clear_error():
    ports, env = _tcp_pair({})
    procs = []
    for rank, secret in ((0, "one-secret"), (1, "another-secret")):
        e = dict(env, EPL_JOB_SECRET=secret, EPL_COMMUNICATION_TIMEOUT_SECONDS="10")
        procs += start_ranks(2, "sum", "tcp", env_extra=e, job="j-secret", only=[rank])
    codes, outs, seconds = finish(procs, timeout=120)
    assert codes[0] != 0 and "secret" in outs[0], outs[0][-3000:]
    assert "RESULT" not in "".join(outs)


def test_launcher_gives_each_machines_workers_their_own_gpus():
    """With --machine_list, worker k of a machine gets that machine's GPUs k*n .. k*n+n-1
    (not numbered across machines)."""
    from epl.launch import cli, ports, workers
    a = cli.parse_args(["--num_workers", "4", "--gpu_per_worker", "2", "--machine_list",
                             "h1:7000,h2:7000", "--machine_rank", "1", __file__])
    addrs, comm, mine = ports.worker_addresses(a)
    assert mine == [2, 3]
    got = [workers.worker_env(a, addrs, comm, i, "job", True, local)["CUDA_VISIBLE_DEVICES"]
           for local, i in enumerate(mine)]
    assert got == ["0,1", "2,3"]


def test_launcher_summary_names_the_root_cause_first(tmp_path):
    """Worker 1 raises; worker 0 then fails because of it.  The summary names worker 1 and
    shows its exception line before the log tail, even when the log ends in frames."""
    script = tmp_path / "fail.py"
    script.write_text(
        "import os, sys, time\n"
        "if os.environ['EPL_WORKER_INDEX'] == '1':\n"
        "    try:\n"
        "        raise ValueError('the real cause: bad input file')\n"
        "    finally:\n"
        "        print('  File \"x.py\", line 1, in f\\n' * 30)\n"
        "time.sleep(0.5)\n"
        "raise RuntimeError('rank 1 reported: the real cause')\n")
    env = dict(os.environ, PYTHONPATH=ROOT)
    out = subprocess.run([sys.executable, "-m", "epl.launch", "--num_workers", "2",
                          "--log_dir", str(tmp_path / "logs"), str(script)],
                         stdout=subprocess.PIPE, stderr=subprocess.STDOUT, env=env,
                         timeout=120).stdout.decode()
    summary = out[out.index("epl-launch summary"):]
    assert "worker 1 exited with status 1" in summary, summary
    assert summary.index("ValueError: the real cause: bad input file") < \
        summary.index("Last lines of"), summary


def test_patches_can_be_removed_and_installed_again():
    from epl.capture import patches
    import tensorflow.compat.v1 as tf
    patches.install()
    patches.uninstall()
    patches.install()
    patches.install()
    with tf.Graph().as_default():   # (a recursion would raise RecursionError here)
        x = tf.constant([1.0, 2.0])
        assert tf.Session().run(tf.argmax(x)) == 1


def _available_gib():
    with open("/proc/meminfo") as f:
        for line in f:
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) / (1 << 20)
    return 0


def test_a_fused_all_reduce_above_2_gib_over_tcp():
    """A fused all-reduce whose second tensor starts past byte 2^31 (the old TCP body kept
    the offset in an int).  Needs about 13 GiB; skipped on smaller machines."""
    if _available_gib() < 16:
        pytest.skip("needs 16 GiB of available memory (two processes of ~6.5 GiB)")
    codes, outs, _ = finish(start_ranks(2, "big_fused", "tcp", env_extra={
        "EPL_COMMUNICATION_TIMEOUT_SECONDS": "300"}), timeout=600)
    assert codes == [0, 0], "\n".join(o[-3000:] for o in outs)
    for r in results(outs):
        assert r["checks"] == [3.0, 3.0, 30.0, 30.0]


def _launch(args, timeout=240):
    from tests.test_multi_worker import launch
    return launch(args, timeout=timeout)


@pytest.mark.estimator
def test_estimator_trains_twice_on_two_workers(tmp_path):
    """est.train() called twice: a second graph and session in every worker (this hung
    forever: the second session's collectives restarted their count)."""
    code, out = _launch(["--num_workers", "2", "--gpu_per_worker", "1", "--log_dir",
                        str(tmp_path / "logs"), os.path.join(HERE, "mw_api.py"),
                        "estimator_twice", str(tmp_path)], timeout=240)
    assert code == 0, out[-5000:]
    import numpy as np
    from tests import models
    from tests.mw_train import BATCH, STEPS
    got = dict(np.load(str(tmp_path / "chief.npz")))
    assert got.pop("steps")[0] == 6
    x, y = models.data(STEPS * BATCH * 2)
    first = slice(0, 3 * BATCH * 2)   # each train() call starts its input again
    want, _ = models.train_local(np.concatenate([x[first], x[first]]),
                                 np.concatenate([y[first], y[first]]), 2 * BATCH, 6, "momentum")
    models.assert_weights_close(got, want)


def test_two_gradient_calls_on_two_workers(tmp_path):
    """Two tf.gradients calls with hand-written updates: each has its own reduction (its
    own collective groups) across the workers."""
    import numpy as np
    import tensorflow.compat.v1 as tf
    from tests import models, mw_api
    from tests.mw_train import BATCH, STEPS
    code, out = _launch(["--num_workers", "2", "--gpu_per_worker", "1", "--log_dir",
                        str(tmp_path / "logs"), os.path.join(HERE, "mw_api.py"),
                        "two_gradients", str(tmp_path)])
    assert code == 0, out[-5000:]
    x, y = models.data(STEPS * BATCH * 2)
    with tf.Graph().as_default():
        op, tvars = mw_api.two_losses(*models.input_batch(x, y, 2 * BATCH))
        want = models.run_steps(op, STEPS, {v.op.name: v for v in tvars})
    for w in range(2):
        got = dict(np.load(str(tmp_path / ("two_%d.npz" % w))))
        for k in want:
            np.testing.assert_allclose(got[k], want[k], rtol=1e-5, atol=1e-6, err_msg=k)
