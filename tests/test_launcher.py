"""epl-launch itself: where its logs go, and how it judges a worker that exits early."""
import os
import shutil
import subprocess
import sys

import pytest

from epl.core.worker_files import LAUNCH_DIR_PREFIX
from epl.launch import channel, launch_dirs

pytestmark = pytest.mark.alone   # processes that wait on each other with timeouts (conftest.py)

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _launch(args, cwd, env=None, timeout=120):
    env = dict(os.environ if env is None else env, PYTHONPATH=ROOT)
    out = subprocess.run([sys.executable, "-m", "epl.launch"] + args, cwd=cwd, env=env,
                         stdout=subprocess.PIPE, stderr=subprocess.STDOUT, timeout=timeout)
    return out.returncode, out.stdout.decode()


def test_a_launch_without_log_dir_writes_its_logs_where_epl_log_dir_says(tmp_path):
    """Tests launch multi-worker jobs from the checkout: their logs must land in a
    temporary folder (EPL_LOG_DIR, set by conftest.py), never in ./epl_logs of the
    repository."""
    script = tmp_path / "hello.py"
    script.write_text("import os\nprint('hello from', os.environ['EPL_WORKER_INDEX'])\n")
    logs = tmp_path / "logs"
    env = dict(os.environ, EPL_LOG_DIR=str(logs))
    code, out = _launch(["--num_workers", "2", str(script)], cwd=ROOT, env=env)
    assert code == 0, out
    assert not os.path.exists(os.path.join(ROOT, "epl_logs")), out
    for i in range(2):
        assert (logs / ("worker_%d.log" % i)).read_text() == "hello from %d\n" % i
    assert str(logs / "worker_1.log") in out


def test_the_test_session_sends_launcher_logs_to_a_temporary_folder():
    log_dir = os.environ.get("EPL_LOG_DIR", "")
    assert log_dir and not os.path.abspath(log_dir).startswith(ROOT + os.sep)


def _stream(cmd, env, cwd, limit):
    """Run ``cmd``; returns (exit status, [(arrival time, line)]).  Kills it after
    ``limit`` seconds (the status is then None)."""
    import queue
    import threading
    import time
    proc = subprocess.Popen(cmd, env=env, cwd=cwd, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT)
    q = queue.Queue()

    def pump():
        for raw in iter(proc.stdout.readline, b""):
            q.put((time.time(), raw.decode(errors="replace")))
        q.put(None)
    threading.Thread(target=pump, daemon=True).start()
    lines, deadline = [], time.time() + limit
    try:
        while True:
            try:
                item = q.get(timeout=max(0.1, deadline - time.time()))
            except queue.Empty:
                break   # (still running at the limit)
            if item is None:
                return proc.wait(timeout=max(1, deadline - time.time())), lines
            lines.append(item)
    except subprocess.TimeoutExpired:
        pass
    finally:
        if proc.poll() is None:   # SIGTERM: epl-launch then stops its workers
            proc.terminate()
            try:
                proc.wait(30)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
    return None, lines


def _early_exit_job(tmp_path, mode, limit):
    env = dict(os.environ, PYTHONPATH=ROOT, TF_CPP_MIN_LOG_LEVEL="2",
               EPL_COMMUNICATION_TIMEOUT_SECONDS="600")   # the default: no test shortcut
    env.pop("EPL_JOB_ID", None)
    cmd = [sys.executable, "-m", "epl.launch", "--num_workers", "2", "--gpu_per_worker", "1",
           "--log_dir", str(tmp_path / "logs"),
           os.path.join(ROOT, "tests", "mw_early_exit.py"), mode, str(tmp_path)]
    return _stream(cmd, env, ROOT, limit)


def test_a_worker_that_exits_0_before_joining_ends_the_job_at_once(tmp_path):
    """Worker 1 exits 0 right after epl.init(): worker 0 would wait in the initial
    broadcast for communication.timeout_seconds (600 s).  The launcher ends the job
    within 10 s of worker 1's exit, naming worker 1 and that it left before joining."""
    import time
    start = time.time()
    code, lines = _early_exit_job(tmp_path, "after_init", limit=150)
    out = "".join(l for _, l in lines)
    assert code is not None, "epl-launch still running after %.0f s:\n%s" % (
        time.time() - start, out[-4000:])
    left = [t for t, l in lines if "worker 1 leaves after epl.init()" in l]
    assert left, out[-4000:]
    ended = lines[-1][0]
    print("the job ended %.2f s after worker 1 left" % (ended - left[0]))
    assert ended - left[0] < 10, out[-4000:]
    assert code != 0
    assert "worker 1 exited with status 0 before it joined the job's collectives" in out, \
        out[-4000:]
    assert "worker 0" in out[out.index("before it joined"):].splitlines()[0], out[-4000:]


def test_a_worker_that_finishes_before_the_others_does_not_stop_the_job(tmp_path):
    """A worker that trained to the end and exits while worker 0 still works (4 s more):
    the job succeeds and both trained the same weights, equal to the local model."""
    import numpy as np
    from tests import models, mw_train
    code, lines = _early_exit_job(tmp_path, "finish_early", limit=240)
    out = "".join(l for _, l in lines)
    assert code == 0, out[-4000:]
    assert "worker 0 done lingering" in out, out[-4000:]
    x, y = models.data(mw_train.STEPS * mw_train.BATCH * 2)
    want = models.train_local(x, y, mw_train.BATCH * 2, mw_train.STEPS, "adam")[0]
    for w in range(2):
        models.assert_weights_close(dict(np.load(str(tmp_path / ("worker_%d.npz" % w)))), want)


@pytest.mark.parametrize("how", ["SIGTERM", "SIGKILL"])
def test_stopping_the_launcher_stops_its_workers(tmp_path, how):
    """The workers run in their own sessions (a terminal's Ctrl-C does not reach them):
    SIGTERM to epl-launch (a scheduler, a benchmark's watchdog) must stop them too, and
    so must killing it outright."""
    import signal
    import time
    script = tmp_path / "sleeper.py"
    script.write_text("import os, sys, time\n"
                      "path = os.path.join(sys.argv[1], 'pid_' + os.environ['EPL_WORKER_INDEX'])\n"
                      "open(path + '.tmp', 'w').write(str(os.getpid()))\n"
                      "os.rename(path + '.tmp', path)\ntime.sleep(600)\n")
    env = dict(os.environ, PYTHONPATH=ROOT)
    proc = subprocess.Popen([sys.executable, "-m", "epl.launch", "--num_workers", "2",
                             "--log_dir", str(tmp_path / "logs"), str(script), str(tmp_path)],
                            env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    pids = []
    try:
        deadline = time.time() + 60
        while len(pids) < 2 and time.time() < deadline:
            pids = [int(p.read_text()) for p in tmp_path.glob("pid_?")]
            time.sleep(0.1)
        if len(pids) < 2:
            proc.kill()
            raise AssertionError("the workers did not start:\n" + proc.communicate()[0].decode())
        proc.send_signal(getattr(signal, how))
        out = proc.communicate(timeout=30)[0].decode()
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode != 0
    if how == "SIGTERM":
        assert "terminated (SIGTERM)" in out, out

    def running(pid):
        try:
            return open("/proc/%d/stat" % pid).read().rsplit(")", 1)[1].split()[0] != "Z"
        except OSError:
            return False
    deadline = time.time() + 10
    while any(running(p) for p in pids) and time.time() < deadline:
        time.sleep(0.05)
    left = [p for p in pids if running(p)]
    for p in left:
        os.kill(p, signal.SIGKILL)
    assert not left, "workers %s outlived the launcher" % left


def test_a_new_launch_removes_the_folders_of_launchers_that_were_killed(tmp_path):
    """A launcher killed outright (SIGKILL) cannot remove its launch folder; the next
    launch removes it, and keeps the folder of a launcher that still runs."""
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    gone = tmp_path / (LAUNCH_DIR_PREFIX + "aaaa-1")
    live = tmp_path / (LAUNCH_DIR_PREFIX + "bbbb-2")
    unmarked = tmp_path / (LAUNCH_DIR_PREFIX + "cccc-3")
    for folder, pid in ((gone, dead.pid), (live, os.getpid()), (unmarked, None)):
        folder.mkdir()
        (folder / "worker_1.joined").write_text("")
        if pid is not None:
            (folder / "launcher.pid").write_text(str(pid))
    assert launch_dirs.sweep_launch_dirs(str(tmp_path)) == [str(gone)]
    assert not gone.exists() and live.exists() and unmarked.exists()


def test_a_launch_folder_names_its_launcher():
    folder = launch_dirs.new_launch_dir("runid")
    try:
        assert os.path.basename(folder).startswith(LAUNCH_DIR_PREFIX + "runid-")
        with open(os.path.join(folder, "launcher.pid")) as f:
            assert int(f.read()) == os.getpid()
        assert folder not in launch_dirs.sweep_launch_dirs(os.path.dirname(folder))
        assert os.path.isdir(folder)
    finally:
        shutil.rmtree(folder)


def test_a_control_link_counts_a_silent_peer_as_gone():
    """The launchers' control links (--machine_list with --max_restarts) carry kernel
    keepalive and a user timeout: a partitioned machine sends no FIN or reset, and
    without them the coordinator would wait for it for ever instead of applying
    --host_timeout."""
    import socket
    server = socket.socket()
    server.bind(("127.0.0.1", 0))
    server.listen(1)
    client = socket.create_connection(server.getsockname())
    accepted, _ = server.accept()
    try:
        for sock in (client, accepted):
            ch = channel.Channel(sock)
            assert sock.getsockopt(socket.SOL_SOCKET, socket.SO_KEEPALIVE) == 1
            assert sock.getsockopt(socket.IPPROTO_TCP, socket.TCP_USER_TIMEOUT) == \
                channel.LINK_DEAD_SECONDS * 1000
            probes = (sock.getsockopt(socket.IPPROTO_TCP, socket.TCP_KEEPIDLE) +
                      sock.getsockopt(socket.IPPROTO_TCP, socket.TCP_KEEPINTVL) *
                      sock.getsockopt(socket.IPPROTO_TCP, socket.TCP_KEEPCNT))
            assert probes <= channel.LINK_DEAD_SECONDS
            ch.reader.close()
    finally:
        client.close()
        accepted.close()
        server.close()
