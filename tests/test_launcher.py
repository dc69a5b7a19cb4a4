"""epl-launch itself: where its logs go, and how it judges a worker that exits early."""
import os
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _launch(args, cwd, env=None, timeout=120):
    env = dict(os.environ if env is None else env, PYTHONPATH=ROOT)
    out = subprocess.run([sys.executable, "-m", "epl.launcher"] + args, cwd=cwd, env=env,
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
